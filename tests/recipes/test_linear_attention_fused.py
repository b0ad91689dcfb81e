"""linear_attention's fused decode step (``mpsboost::deltanet_step``): at most 10 aten ops per Gated DeltaNet layer
and decode step under Mac decisions (bf16, fp8 and low-bit projections), equal to stock, compile-transparent, and
the patch-time choice of :func:`mpsboost.ondevice.choose` (simulated: the static choice, nothing timed; a stubbed real
Mac with an injected timer: timed, cached, refused on a failed self-check or a timing error)."""

from __future__ import annotations

import copy

import pytest
from mpsboost.bench import relative_error
import tiny_models as tm
import torch
from recipes.test_linear_attention import (
    _assert_layers_match,
    _decode_step_compiles,
    _deltanets,
    _model,
)

import mpsboost
from mpsboost import ondevice
from mpsboost.gate import Env
from mpsboost.ops import deltanet_step as dn
from mpsboost.recipes import linear_attention as la

pytest.importorskip("transformers")

MAX_OPS = 10  # issue 37's target: aten ops of one DeltaNet layer's decode step under Mac 2.15.0 decisions
LAYERS = ("linear_attention", "linear_attention", "full_attention")
MAC = "mps-2.15.0"


def _env(name: str = MAC) -> Env:
    dev, _, ver = name.partition("-")
    return Env.simulate(dev, ver or None)


def _patch(model, env, recipes=("linear_attention",), **kw):
    report = mpsboost.patch(model, recipes=list(recipes), device=env, **kw)
    rows = [r for r in report.rows if r.recipe == "linear_attention"]
    assert rows and all(r.status == "applied" for r in rows), str(report)
    return rows


def _ops(model, batch: int) -> list[str]:
    """The ops of every DeltaNet layer in one decode step after a prefill of 8 tokens."""
    return tm.decode_step_ops(model, _deltanets(model), batch)


@pytest.mark.parametrize(
    "family,dtype",
    [("qwen3_5_moe", "float32"), ("qwen3_5_moe", "bfloat16"), ("qwen3_5", "bfloat16"), ("qwen3_next", "float32")],
)
def test_at_most_ten_ops_per_layer_and_the_option_turns_it_off(family, dtype):
    base = _model(family, 2, layers=LAYERS).to(getattr(torch, dtype))
    fused, composed = copy.deepcopy(base), copy.deepcopy(base)
    rows = _patch(fused, _env())
    assert all("mpsboost::deltanet_step" in r.backing for r in rows), [r.backing for r in rows]
    mpsboost.patch(
        composed, recipes=["linear_attention"], device=_env(), options={"linear_attention": {"fused_step": "off"}}
    )
    for batch in (1, 2):
        names = _ops(fused, batch)
        assert names.count("mpsboost.deltanet_step") == 2, names
        assert len(names) <= 2 * MAX_OPS, (batch, names)
        n_composed = len(_ops(composed, batch))
        assert "mpsboost.deltanet_step" not in _ops(composed, batch)
        assert n_composed > 2 * MAX_OPS, n_composed


def test_at_most_ten_ops_per_layer_with_fp8_projections():
    model = _model("qwen3_5_moe", 2, layers=LAYERS).to(torch.bfloat16)
    _patch(model, _env(), recipes=("fp8_weights", "linear_attention"), fp8="rowwise")
    assert _deltanets(model)[0].in_proj_qkv.weight.dtype in (torch.float8_e4m3fn, torch.uint8)
    for batch in (1, 2):
        names = _ops(model, batch)
        assert names.count("mpsboost.deltanet_step") == 2 and len(names) <= 2 * MAX_OPS, (batch, names)


def test_at_most_ten_ops_per_layer_with_low_bit_projections():
    model = _model("qwen3_5_moe", 2, layers=LAYERS).to(torch.bfloat16)
    mpsboost.patch(
        model,
        recipes=["low_bit_weights"],
        device=_env(),
        options={"low_bit_weights": {"bits": 4, "group_size": 32}},
    )
    assert _deltanets(model)[0].in_proj_qkv.weight.dtype in (torch.uint32, torch.int32)
    ref = copy.deepcopy(model)
    _patch(model, _env())
    for batch in (1, 2):
        names = _ops(model, batch)
        assert names.count("mpsboost.deltanet_step") == 2 and len(names) <= 2 * MAX_OPS, (batch, names)
    ids = torch.randint(3, 128, (2, 10), generator=torch.Generator().manual_seed(52))
    # the low-bit layers alone against the same layers under the recipe: the recipe adds no error of its own
    # beyond bf16 rounding of its output (the layers' products are the same operator calls)
    ref_out, got = [], []
    from recipes.test_linear_attention import _steps

    _steps(ref, ids, 7, outputs=ref_out)
    _steps(model, ids, 7, outputs=got)
    for step, (r, g) in enumerate(zip(ref_out, got)):
        assert relative_error(g.float(), r.float()) <= 2e-2, step


# the fused step equal to stock: head ratios, padded and continued batches, slow-decay gates (tiny_models' default),
# OLMo-Hybrid's beta 2, on the operator's CPU implementation (the composed step behind one call)
# (every family and ratio also runs the fused step in tests/recipes/test_linear_attention.py, under Mac decisions)
@pytest.mark.parametrize("family,ratio", [("qwen3_5_moe", 4), ("qwen3_next", 2), ("olmo_hybrid", 1)])
def test_fused_step_equals_stock_fp32(family, ratio):
    stock = _model(family, ratio, seed=11)
    patched = copy.deepcopy(stock)
    rows = _patch(patched, _env())
    assert all("mpsboost::deltanet_step" in r.backing for r in rows)
    for batch, prompt, seed in ((1, 9, 1), (3, 9, 2)):
        ids = torch.randint(3, 128, (batch, prompt + 4), generator=torch.Generator().manual_seed(seed))
        _assert_layers_match(stock, patched, ids, prompt, f"{family} r={ratio} B={batch}")


def test_left_padded_generate_equals_stock():
    """A left-padded batch of three through generate(): greedy tokens equal, logits within the float32 bound."""
    from recipes.test_linear_attention import FP32_TOL, _generate, _left_padded

    stock = _model("qwen3_5_moe", 2, seed=12)
    patched = copy.deepcopy(stock)
    _patch(patched, _env())
    ids, mask = _left_padded((9, 5, 2), 9, 13)
    with torch.no_grad():
        ref_tokens, ref_logits = _generate(stock, ids, mask)
        tokens, logits = _generate(patched, ids, mask)
    assert torch.equal(tokens, ref_tokens)
    assert relative_error(logits, ref_logits) <= FP32_TOL


def test_fused_step_traces_with_fullgraph():
    stock = _model(seed=7)
    patched = copy.deepcopy(stock)
    _patch(patched, _env())
    _decode_step_compiles(stock, patched)


def test_unpatch_restores_the_class_forward():
    model = _model(seed=8)
    _patch(model, _env())
    layer = _deltanets(model)[0]
    assert "forward" in layer.__dict__
    mpsboost.unpatch(model)
    assert "forward" not in layer.__dict__ and la._STATE not in layer.__dict__


# ------------------------------------------------------------------------------------------ the choice


@pytest.fixture
def stub_mac(monkeypatch, tmp_path):
    """The real-Mac path of the choice without a Mac: contenders whose runs do nothing and whose check passes (or
    what ``state["check"]`` says), the timing cache in tmp_path, the timer what ``state["timer"]`` is."""
    monkeypatch.setenv("MPSBOOST_CACHE_DIR", str(tmp_path))
    state = {"check": None, "timer": tm.no_timing, "built": []}

    def contenders(**kw):
        state["built"].append(kw)

        def stock_run():
            return None

        def fused_run():
            return None

        def check_run():
            return state["check"]

        return stock_run, fused_run, check_run

    monkeypatch.setattr(dn, "contenders", contenders)
    monkeypatch.setattr(ondevice, "default_timer", lambda fn: state["timer"](fn))
    return state


def _plan_rows(env, **opts):
    report = mpsboost.plan(
        _model(seed=9), recipes=["linear_attention"], env=env, options={"linear_attention": opts} if opts else None
    )
    rows = [r for r in report.rows if r.recipe == "linear_attention"]
    assert rows and all(r.status == "would apply" for r in rows), str(report)
    return rows


@pytest.mark.parametrize("env_name", ["mps-2.15.0", "mps-2.14.1"])
def test_simulated_mac_takes_the_static_choice_and_times_nothing(stub_mac, env_name):
    rows = _plan_rows(_env(env_name))
    assert all("mpsboost::deltanet_step" in r.backing for r in rows)
    assert all("not timed: simulated environment" in r.reason and "1 dispatch instead of" in r.reason for r in rows)


def test_cpu_and_cuda_keep_the_composed_step(stub_mac):
    for env in (Env.detect("cpu"), Env.simulate("cuda:9.0")):
        rows = _plan_rows(env)
        assert all("mpsboost::deltanet_step" not in r.backing for r in rows), [r.backing for r in rows]
        assert all("decode step composed" in r.reason for r in rows)


def test_real_mac_takes_the_fused_step_where_it_is_faster_and_caches_it(stub_mac):
    stub_mac["timer"] = tm.FakeTimer({"stock_run": 10e-6, "fused_run": 6e-6})
    rows = _plan_rows(tm.real_mac())
    assert all("mpsboost::deltanet_step" in r.backing and "0.60x" in r.reason for r in rows), [r.reason for r in rows]
    assert stub_mac["timer"].calls.count("fused_run") == ondevice.ROUNDS  # the layers share one shape: timed once
    assert stub_mac["built"][0]["dtype"] == torch.float32 and stub_mac["built"][0]["r"] == 2
    stub_mac["timer"] = tm.no_timing  # a second patch of the same shape reads the verdict from the cache
    rows = _plan_rows(tm.real_mac())
    assert all("mpsboost::deltanet_step" in r.backing and "(cache)" in r.reason for r in rows)


@pytest.mark.parametrize("fused", [10e-6, 12e-6])
def test_real_mac_keeps_the_composed_step_on_a_tie_or_slower(stub_mac, fused):
    stub_mac["timer"] = tm.FakeTimer({"stock_run": 10e-6, "fused_run": fused})
    rows = _plan_rows(tm.real_mac())
    assert all("mpsboost::deltanet_step" not in r.backing and "not faster on this Mac" in r.reason for r in rows)


def test_real_mac_keeps_the_composed_step_when_the_self_check_fails(stub_mac):
    stub_mac["check"] = "the fused step's state differs"
    stub_mac["timer"] = tm.FakeTimer({"stock_run": 10e-6, "fused_run": 1e-6})
    rows = _plan_rows(tm.real_mac())
    assert all("mpsboost::deltanet_step" not in r.backing and "self-check" in r.reason for r in rows)
    assert stub_mac["timer"].calls == []


def test_real_mac_keeps_the_composed_step_on_a_timing_error(stub_mac):
    stub_mac["timer"] = tm.FakeTimer({"stock_run": 10e-6}, error=RuntimeError("command buffer failed"))
    rows = _plan_rows(tm.real_mac())
    assert all("mpsboost::deltanet_step" not in r.backing and "timing failed" in r.reason for r in rows)


def test_static_option_on_a_real_mac_times_nothing(stub_mac):
    rows = _plan_rows(tm.real_mac(), fused_step="static")
    assert all("mpsboost::deltanet_step" in r.backing and "option keeps the static choice" in r.reason for r in rows)


def test_bad_option_is_a_clear_error():
    with pytest.raises(mpsboost.PatchError, match="fused_step' must be one of"):
        _plan_rows(_env(), fused_step="always")
