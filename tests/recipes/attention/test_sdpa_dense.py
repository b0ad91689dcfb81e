"""SDPA on MPS gets contiguous q/k/v (gate feature ``sdpa_strided_correct``; pytorch#163597 / #181133: the Metal
kernels read some transposed or permuted views wrong, behind black images on Macs, ComfyUI#10681).

Under MPS decisions (simulated on the CPU) every ``F.scaled_dot_product_attention`` call of a patched model, in
prefill and decode, receives contiguous tensors, where stock's own calls pass the head-transposed views; the
results equal stock within float32 rounding (relative 1e-5). Off MPS nothing is copied.
"""

from __future__ import annotations

import pytest
from mpsboost.bench import relative_error
import tiny_models as tm
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import mpsboost
from mpsboost.gate import Env

pytest.importorskip("transformers")

TOL = 1e-5


class SdpaInputs(TorchFunctionMode):
    """Records, per ``F.scaled_dot_product_attention`` call, whether each of q, k, v was contiguous."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[bool, bool, bool]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention:
            self.calls.append(tuple(t.is_contiguous() for t in args[:3]))
        return func(*args, **(kwargs or {}))


def _lm(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = tm.gated_deltanet_lm(family) if family.startswith("qwen3_5") else tm.TINY["llama"].make()
    model.config._attn_implementation = "sdpa"
    return model.eval()


@pytest.mark.parametrize("family", ["llama", "qwen3_5_moe"])
@pytest.mark.parametrize("tv", ["2.14.1", "2.15.0"])
def test_every_sdpa_call_gets_contiguous_inputs_under_mps(family, tv, rng_seed):
    model = _lm(family)
    with SdpaInputs() as stock_calls:
        ref = tm._run_lm(model, rng_seed, batch=2, prompt=6, steps=2)
    if family == "llama":  # stock passes strided views (the bug's trigger); Qwen3.5's rotary makes them dense,
        assert any(not all(c) for c in stock_calls.calls)  # but attention_decode's own query is strided (below)
    with mpsboost.patched(model, device=Env.simulate("mps", tv)) as report:
        rows = {r.recipe: r for r in report.rows if r.status == "applied"}
        assert "metal_attention" in rows and "made contiguous" in rows["metal_attention"].backing
        if family == "qwen3_5_moe":  # the gated attention's strided query at decode
            assert "attention_decode" in rows and "sdpa_strided_correct" in rows["attention_decode"].reason
        with SdpaInputs() as calls:
            out = tm._run_lm(model, rng_seed, batch=2, prompt=6, steps=2)
    assert len(calls.calls) >= 2 and all(all(c) for c in calls.calls), calls.calls
    assert relative_error(out, ref) <= TOL


def test_no_copy_off_mps(rng_seed):
    """On the CPU (asked to apply there) attention_decode hands SDPA its strided query as it is: the copy is
    MPS's alone."""
    model = _lm("qwen3_5_moe")
    everywhere = {"attention_decode": {"devices": ("mps", "cuda", "cpu")}}
    with mpsboost.patched(model, device=Env.detect("cpu"), options=everywhere) as report:
        assert any(r.recipe == "attention_decode" and r.status == "applied" for r in report.rows)
        assert not any(r.status == "applied" and "contiguous before SDPA" in r.reason for r in report.rows)
        with SdpaInputs() as calls:
            tm._run_lm(model, rng_seed, batch=2, prompt=6, steps=2)
    assert any(not all(c) for c in calls.calls)


def test_diffusers_matmul_processor_is_kept_under_mps():
    """diffusers' SDPA processors pass head-transposed views themselves: no routing onto them under MPS."""
    pytest.importorskip("diffusers")
    from diffusers.models.attention_processor import Attention, AttnProcessor

    attn = Attention(query_dim=64, heads=1, dim_head=64, processor=AttnProcessor())
    (row,) = mpsboost.plan(attn, env=Env.simulate("mps", "2.15.0"), recipes=["metal_attention"]).rows
    assert row.status == "skipped" and "strided" in row.reason, row.reason
    (forced,) = mpsboost.plan(
        attn, env=Env.detect("cpu"), recipes=["metal_attention"], options={"metal_attention": {"force": True}}
    ).rows
    assert forced.status == "would apply"


@pytest.mark.parametrize("dense", [False, True])
def test_split_calls_get_contiguous_slices_when_dense(dense):
    """attention_split's query slices are strided views: under MPS decisions each split call gets dense copies
    (the result is the same as one unsplit call, within float32 rounding)."""
    from mpsboost.ops.attention_split import sdpa_split

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 10, 4, 32, generator=g).transpose(1, 2) for _ in range(3))  # [B, H, L, D] views
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with SdpaInputs() as calls:
        out = sdpa_split(q, k, v, is_causal=True, max_scores=2 * 4 * 3 * 10, dense=dense)
    assert len(calls.calls) == 4  # 10 query rows, 3 per call
    assert all(all(c) for c in calls.calls) == dense, calls.calls
    assert relative_error(out, ref) <= TOL


def test_attention_split_decides_dense_under_mps():
    model = _lm("llama")
    (row,) = mpsboost.plan(model, env=Env.simulate("mps", "2.15.0"), recipes=["attention_split"]).rows
    assert row.status == "would apply" and "contiguous q/k/v" in row.reason, row.reason
    (forced,) = mpsboost.plan(
        model, env=Env.detect("cpu"), recipes=["attention_split"], options={"attention_split": {"force": True}}
    ).rows
    assert forced.status == "would apply" and "contiguous" not in forced.reason
