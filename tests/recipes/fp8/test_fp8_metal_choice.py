"""fp8 linears on a Mac where both mpsboost's Metal fp8 GEMV and torch's own few-rows kernels (2.15's
``scaled_mm_few_rows``) serve them: decided by timing the two at the layer's shape on the user's Mac at patch time
(``mpsboost.ondevice.choose``), the Metal GEMV taken only where faster; a simulated Mac and option
``mps_kernel="metal"`` take the static choice (the Metal GEMV) and time nothing. Without a Mac: the gate's probes and
the kernel's self-check stubbed, the contenders on the CPU, an injected timer."""

from __future__ import annotations

import pytest
import torch

import tiny_models as tm

import mpsboost
from mpsboost import gate, ondevice
from mpsboost.gate import Env
from mpsboost.ops import fp8 as fp8_ops
from mpsboost.recipes.fp8 import paths as fp8_paths
from mpsboost.ops import fp8_metal

N, K = 48, 64


@pytest.fixture
def stub_mac(monkeypatch, tmp_path):
    monkeypatch.setenv("MPSBOOST_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(fp8_metal, "self_check", lambda device="mps": None)
    monkeypatch.setattr(fp8_paths, "_METAL_CHECKED", {})
    for feature in ("fp8_metal_gemv", "fp8_gemv", "scaled_mm", "float8_storage"):
        monkeypatch.setitem(gate._PROBE_CACHE, (feature, "mps", "2.15.0"), None)
    state = {"timer": tm.no_timing, "built": []}
    real = fp8_ops.gemv_contenders

    def contenders(n, k, dtype, **kw):
        state["built"].append((n, k, dtype))
        return real(n, k, dtype, device="cpu")

    monkeypatch.setattr(fp8_ops, "gemv_contenders", contenders)
    monkeypatch.setattr(ondevice, "default_timer", lambda fn: state["timer"](fn))
    return state


def _rows(env, **opts):
    m = torch.nn.Sequential(torch.nn.Linear(K, N, bias=False), torch.nn.Linear(K, N, bias=False)).to(torch.bfloat16)
    options = {"fp8_weights": opts} if opts else None
    report = mpsboost.plan(m, recipes=["fp8_weights"], fp8="rowwise", env=env, options=options)
    rows = [r for r in report.rows if r.recipe == "fp8_weights"]
    assert len(rows) == 2 and all(r.status == "would apply" for r in rows), str(report)
    return rows


def _metal(r) -> bool:
    return "mpsboost's Metal kernel" in r.backing


def test_the_contenders_compute_the_same_product():
    stock, metal = fp8_ops.gemv_contenders(N, K, torch.bfloat16, device="cpu")
    a, b = metal().float(), stock().float()
    assert a.shape == b.shape == (1, N)
    # the two differ by the activation's rowwise fp8 rounding (stock quantises it; the GEMV reads it as it is)
    assert (a - b).abs().max() <= 0.05 * a.abs().max()


def test_simulated_mac_takes_the_metal_gemv_and_times_nothing(stub_mac):
    rows = _rows(Env.simulate("mps", "2.15.0"))  # the timer refuses any call
    assert all(_metal(r) and "not timed: simulated environment" in r.reason for r in rows), [r.reason for r in rows]


def test_real_mac_takes_the_metal_gemv_where_it_is_faster_and_caches_it(stub_mac):
    stub_mac["timer"] = tm.FakeTimer({"stock": 10e-6, "metal": 6e-6})
    rows = _rows(tm.real_mac())
    assert all(_metal(r) and "0.60x" in r.reason for r in rows), [r.reason for r in rows]
    assert stub_mac["timer"].calls.count("metal") == ondevice.ROUNDS  # two layers of one shape: timed once
    assert stub_mac["built"][0] == (N, K, torch.bfloat16)
    stub_mac["timer"] = tm.no_timing
    rows = _rows(tm.real_mac())
    assert all(_metal(r) and "(cache)" in r.reason for r in rows)


@pytest.mark.parametrize("metal", [10e-6, 14e-6])
def test_real_mac_keeps_torchs_kernels_on_a_tie_or_slower(stub_mac, metal):
    stub_mac["timer"] = tm.FakeTimer({"stock": 10e-6, "metal": metal})
    rows = _rows(tm.real_mac())
    assert all(not _metal(r) and "scaled_mm" in r.backing for r in rows), [r.backing for r in rows]
    assert all("not faster on this Mac" in r.reason for r in rows)


def test_real_mac_keeps_torchs_kernels_on_a_timing_error(stub_mac):
    stub_mac["timer"] = tm.FakeTimer({"stock": 10e-6, "metal": 1e-6}, error=RuntimeError("command buffer failed"))
    rows = _rows(tm.real_mac())
    assert all(not _metal(r) and "timing failed" in r.reason for r in rows)


def test_option_metal_keeps_the_static_choice_untimed(stub_mac):
    rows = _rows(tm.real_mac(), mps_kernel="metal")
    assert all(_metal(r) for r in rows) and stub_mac["built"] == []


def test_the_timed_choice_is_the_path_the_layer_runs(stub_mac):
    # The plan's verdict reaches the layer: torch's kernels chosen -> the converted layer's kind is mps_scaled_mm.
    stub_mac["timer"] = tm.FakeTimer({"stock": 10e-6, "metal": 20e-6})
    m = torch.nn.Sequential(torch.nn.Linear(K, N, bias=False)).to(torch.bfloat16)
    mpsboost.patch(m, recipes=["fp8_weights"], fp8="rowwise", device=tm.real_mac())
    from mpsboost.recipes.fp8.layers import fp8_state

    assert fp8_state(m[0]).kind == "mps_scaled_mm"
