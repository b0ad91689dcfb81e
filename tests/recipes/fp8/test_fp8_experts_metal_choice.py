"""fp8 experts on a Mac where both mpsboost's Metal fp8 grouped GEMV (the routed experts read in place) and torch's
own few-rows kernels (2.15's ``scaled_mm_few_rows``, the routed experts' codes gathered) serve a module's decode:
decided by timing the two at the module's shape on the user's Mac at patch time (``mpsboost.ondevice.choose``), the
grouped GEMV taken only where faster; a tie, a slower GEMV or a timing error keeps torch's kernels; a simulated Mac
and option ``mps_kernel="metal"`` take the static choice (the grouped GEMV) and time nothing. Without a Mac: the
gate's probes and the kernel's self-check stubbed, the contenders on the CPU, an injected timer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tiny_models as tm

import mpsboost
from mpsboost import gate, ondevice
from mpsboost.gate import Env
from mpsboost.ops import fp8_metal, fp8_moe
from mpsboost.recipes.fp8 import paths as fp8_paths
from mpsboost.recipes.fp8.layers import fp8_state


@pytest.fixture
def stub_mac(monkeypatch, tmp_path):
    monkeypatch.setenv("MPSBOOST_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(fp8_metal, "self_check", lambda device="mps": None)
    monkeypatch.setattr(fp8_paths, "_METAL_CHECKED", {})
    for feature in ("fp8_metal_gemv", "fp8_gemv", "scaled_mm", "float8_storage", "grouped_mm", "histc_int"):
        monkeypatch.setitem(gate._PROBE_CACHE, (feature, "mps", "2.15.0"), None)
    state = {"timer": tm.no_timing, "built": []}
    real = fp8_moe.experts_contenders

    def contenders(*shape, **kw):
        state["built"].append(shape)
        stock, metal = real(*shape, device="cpu")

        def e_stock():  # named apart from the linears' contenders (the same plan times those too)
            return stock()

        def e_metal():
            return metal()

        return e_stock, e_metal

    monkeypatch.setattr(fp8_moe, "experts_contenders", contenders)
    monkeypatch.setattr(ondevice, "default_timer", lambda fn: state["timer"](fn))
    return state


def _model(dtype="bfloat16"):
    return tm.build("qwen3_moe", dtype)


def _expert_rows(env, **opts):
    options = {"fp8_weights": opts} if opts else None
    report = mpsboost.plan(_model(), recipes=["fp8_weights"], fp8="rowwise", env=env, options=options)
    rows = [r for r in report.rows if r.recipe == "fp8_weights" and r.target.endswith("experts")]
    assert rows and all(r.status == "would apply" for r in rows), str(report)
    return rows


def _timer(experts_metal: float, error: Exception | None = None) -> tm.FakeTimer:
    """Seconds per call: the experts' contenders as given (stock 10 us), the linears' a tie (torch's kernels)."""
    return tm.FakeTimer({"stock": 10e-6, "metal": 10e-6, "e_stock": 10e-6, "e_metal": experts_metal}, error=error)


def _grouped(r) -> bool:
    return r.backing.startswith(fp8_moe.FEW_ROWS_BACKING["grouped"])


def _torchs(r) -> bool:
    return r.backing.startswith(fp8_moe.FEW_ROWS_BACKING["scaled_mm"])


def test_the_contenders_compute_the_experts_output(rng_seed):
    # Both against a float64 reference of the same codes: the grouped GEMV reads the activations as they are,
    # torch's path quantises them per row to fp8 first (its error is that rounding's).
    e, inter, h, k = 8, 32, 48, 3
    stock, metal = fp8_moe.experts_contenders(e, 2 * inter, h, inter, k, torch.float32, device="cpu")
    a, b = metal(), stock()
    assert a.shape == b.shape == (1, h)
    assert (a - b).abs().max() <= 0.06 * a.abs().max()
    assert not torch.equal(a, b)  # two paths, not one called twice


def test_the_contenders_refuse_a_shape_they_do_not_model():
    with pytest.raises(ValueError, match="top_k=9 of 8 experts"):
        fp8_moe.experts_contenders(8, 64, 48, 32, 9, torch.float32, device="cpu")
    with pytest.raises(ValueError, match="up_rows = 2 \\* inter"):
        fp8_moe.experts_contenders(8, 48, 48, 32, 2, torch.float32, device="cpu")


def test_simulated_mac_takes_the_grouped_gemv_and_times_nothing(stub_mac):
    rows = _expert_rows(Env.simulate("mps", "2.15.0"))  # the timer refuses any call
    assert all(_grouped(r) and "not timed: simulated environment" in r.reason for r in rows), [r.reason for r in rows]


def test_real_mac_takes_the_grouped_gemv_where_it_is_faster_and_caches_it(stub_mac):
    stub_mac["timer"] = _timer(7e-6)
    rows = _expert_rows(tm.real_mac())
    assert all(_grouped(r) and "0.70x" in r.reason for r in rows), [r.reason for r in rows]
    assert stub_mac["timer"].calls.count("e_metal") == ondevice.ROUNDS  # every layer of one shape: timed once
    assert len(rows) >= 2 and "(cache)" in rows[-1].reason
    e, n_up, h, inter, k, dtype = stub_mac["built"][0]
    assert n_up == 2 * inter and k == min(8, e) and dtype == torch.bfloat16
    stub_mac["timer"] = tm.no_timing
    rows = _expert_rows(tm.real_mac())
    assert all(_grouped(r) and "(cache)" in r.reason for r in rows)


@pytest.mark.parametrize("metal", [10e-6, 13e-6])
def test_real_mac_keeps_torchs_kernels_on_a_tie_or_slower(stub_mac, metal):
    stub_mac["timer"] = _timer(metal)
    rows = _expert_rows(tm.real_mac())
    assert all(_torchs(r) and "not faster on this Mac" in r.reason for r in rows), [r.backing for r in rows]


def test_real_mac_keeps_torchs_kernels_on_a_timing_error(stub_mac):
    stub_mac["timer"] = _timer(1e-6, error=RuntimeError("command buffer failed"))
    rows = _expert_rows(tm.real_mac())
    assert all(_torchs(r) and "timing failed" in r.reason for r in rows)


def test_option_metal_keeps_the_grouped_gemv_untimed(stub_mac):
    rows = _expert_rows(tm.real_mac(), mps_kernel="metal")
    assert all(_grouped(r) for r in rows) and stub_mac["built"] == []


def test_the_timed_choice_is_the_path_the_experts_run(stub_mac, monkeypatch):
    # The verdict reaches the module: torch's kernels chosen -> its forward calls few_rows_experts(kernel="scaled_mm")
    # on a decode token, never the grouped GEMV; and computes what the stock experts compute, within fp8's error.
    stub_mac["timer"] = _timer(20e-6)
    m = _model("float32")
    ref = m(torch.tensor([[3, 1, 4]])).logits
    mpsboost.patch(m, recipes=["fp8_weights"], fp8="rowwise", device=tm.real_mac())
    states = [fp8_state(mod) for mod in m.modules() if fp8_state(mod) is not None and fp8_state(mod).kind == "experts"]
    assert states and all(s.few_rows == "scaled_mm" for s in states)
    called = []
    monkeypatch.setattr(fp8_moe, "grouped_rows_experts", lambda *a, **k: called.append("grouped"))
    real = fp8_moe.few_rows_experts
    monkeypatch.setattr(fp8_moe, "few_rows_experts", lambda *a, **k: called.append(k["kernel"]) or real(*a, **k))
    out = m(torch.tensor([[3, 1, 4]])).logits
    assert called and set(called) == {"scaled_mm"}
    assert F.cosine_similarity(out.flatten(), ref.flatten(), dim=0) > 0.99
