"""A converted layer is recognisable: fp8_weights swaps each converted instance onto an fp8 layer class
(``FP8Linear``, ``FP8<Experts>``) whose repr shows the storage, granularity, scale shapes and backing
path; it stays an instance of its original class, computes as the conversion dictates, and unpatch
still explains that the conversion cannot be undone."""

from __future__ import annotations

import copy

import pytest
import torch

import mpsboost
import tiny_models as tm
from mpsboost import registry
from mpsboost.errors import IrreversiblePatchError, PatchError
from mpsboost.ops import fp8 as fp8_ops
from mpsboost.recipes.fp8.recipe import FP8Linear
from mpsboost.registry import Decision, Recipe

NAME = "fp8_weights"


def _rows(report):
    return {r.target: r for r in report.rows_for(NAME) if r.status == "applied"}


@pytest.mark.parametrize("granularity", ["rowwise", "tensorwise"])
def test_converted_linear_prints_as_an_fp8_layer(granularity, rng_seed):
    ref_model = tm.build("qwen3_moe", dtype="bfloat16", seed=0)
    model = tm.build("qwen3_moe", dtype="bfloat16", seed=0)
    q_before = model.model.layers[0].self_attn.q_proj
    report = mpsboost.patch(model, fp8=granularity)
    rows = _rows(report)
    q = model.model.layers[0].self_attn.q_proj
    assert q is q_before and type(q) is FP8Linear
    assert isinstance(q, torch.nn.Linear) and torch.nn.Linear in type(q).__mro__
    text = repr(q)
    row = rows["model.layers.0.self_attn.q_proj"]
    scale = "[]" if granularity == "tensorwise" else f"[{q.out_features}, 1]"
    for part in (
        f"in_features={q.in_features}",
        f"out_features={q.out_features}",
        f"bias={q.bias is not None}",
        "fp8=float8_e4m3fn",
        f"granularity={granularity}",
        f"weight_scale={scale}",
        "compute_dtype=bfloat16",
        f"backing={row.backing}",
    ):
        assert part in text, (part, text)
    assert text.startswith("FP8Linear(")
    # Layers left alone keep their class (lm_head: kept in the compute dtype by default).
    assert type(model.lm_head) is torch.nn.Linear and "fp8" not in repr(model.lm_head)
    printed = str(model)
    # (repeated identical blocks print once: count the layers, and see the class in the printout)
    assert "FP8Linear(" in printed and "weight_scale=" in printed
    assert sum(type(m) is FP8Linear for m in model.modules()) == sum(1 for t in rows if not t.endswith("experts"))
    # The experts modules that were converted print as an fp8 layer too.
    experts = model.model.layers[0].mlp.experts
    assert type(experts).__name__ == "FP8" + type(experts).__mro__[1].__name__
    assert isinstance(experts, type(experts).__mro__[1])
    assert f"gate_up_proj={list(experts.gate_up_proj.shape)}" in repr(experts) and "down_proj_scale=" in repr(experts)
    assert f"FP8{type(experts).__mro__[1].__name__}(" in printed
    # The swap changes nothing in the computation: outputs within fp8's quality bound of stock.
    seed = rng_seed % 1000
    out, ref = (
        tm.run("qwen3_moe", model, seed, dtype="bfloat16"),
        tm.run("qwen3_moe", ref_model, seed, dtype="bfloat16"),
    )
    assert fp8_ops.sqnr_db(out, ref) >= 20.0
    # A copy keeps the class; unpatch still refuses (the conversion cannot be undone) and changes nothing.
    assert type(copy.deepcopy(model).model.layers[0].self_attn.q_proj) is FP8Linear
    with pytest.raises(IrreversiblePatchError, match="converted weights in place"):
        mpsboost.unpatch(model)
    assert type(q) is FP8Linear and "weight_scale" in q._buffers


def test_patching_again_finds_the_fp8_layers_as_already_patched():
    model = tm.build("qwen3_moe")
    first = _rows(mpsboost.patch(model, fp8="rowwise"))
    again = mpsboost.patch(model, fp8="rowwise")
    already = {r.target for r in again.rows_for(NAME) if r.status == "already patched"}
    assert set(first) <= already


class _FailLate(Recipe):
    name = "t_fail_late"
    targets = ("torch.nn.modules.sparse.Embedding",)
    default = False
    order = 300  # after fp8_weights

    def decide(self, match, env, options):
        return Decision.apply("test", "test")

    def apply(self, match, decision, env, options):
        raise RuntimeError("late failure")


@pytest.mark.filterwarnings("ignore:mpsboost. requested recipe fp8_weights was skipped")  # lm_head, by design
def test_a_failed_patch_gives_back_the_original_class_and_weights():
    registry.register(_FailLate)
    try:
        model = tm.build("qwen3_moe")
        before = {n: (type(m), m._parameters.get("weight")) for n, m in model.named_modules()}
        with pytest.raises(PatchError, match="late failure"):
            mpsboost.patch(model, recipes=["t_fail_late"], fp8="rowwise")
        for n, m in model.named_modules():
            cls, w = before[n]
            assert type(m) is cls, n
            assert m._parameters.get("weight") is w, n
        assert "FP8" not in str(model)
    finally:
        registry.unregister("t_fail_late")
