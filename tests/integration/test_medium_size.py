"""One decode step at Qwen3.6's widths (the decode-cost tool's ``medium`` model: hidden 2048, 32 experts of 512 top-8,
4 layers, bf16), under Mac 2.15.0 decisions, counted by ``mpsboost.bench.decode_cost`` (aten ops and bytes moved, the
rules of the decode-ops tool): the targets the recipes' issues set at the real widths, against patched bf16.

One file, so that one worker builds the model once and counts each patched step once (the ``medium`` fixture,
tests/step_costs.py); the same checks at the tiny size sit beside each recipe's own tests:
tests/quant/test_low_bit_decode_cost.py, tests/recipes/fp8/test_fp8_decode.py, tests/recipes/fp8/test_fp8_metal_path.py
and tests/recipes/moe/test_moe_block_fused.py.
"""

from __future__ import annotations

import pytest
from step_costs import MAC, fp8_costs, fp8_ratio, low_bit_targets

pytest.importorskip("transformers")


@pytest.mark.slow
def test_low_bit_step_costs_against_bf16(medium):
    # Issue 36's targets: ops at most 1.05x, bytes at most 0.33x at 4 bits and 0.6x at 8 bits.
    low_bit_targets("medium", "2.15.0", medium.cost)


@pytest.mark.slow
def test_fp8_decode_step_moves_fp8_bytes(medium):
    c = fp8_costs(medium.cost)
    # Dense layers read their fp8 bytes once (scaled_mm few rows): half of bf16.
    assert fp8_ratio(c, "bytes", ("self_attn",)) <= 0.52, c  # measured 0.51 (26.7 / 52.8 MiB)
    # Routed experts on the Metal kernel's operators: read once at 1 byte per weight (issue 28's traffic target,
    # decode_ops.py --env mps-2.15.0 --fp8 rowwise --traffic --size medium; 0.93x of the whole step before the kernel,
    # when the routed experts were gathered).
    assert fp8_ratio(c, "bytes", ("mlp",)) <= 0.55, c
    assert fp8_ratio(c, "bytes") <= 0.6, c


@pytest.mark.slow
def test_moe_block_same_ops_and_no_more_bytes(medium):
    """The fused MoE block: the same ops per block as tiny (at most 12 a block), and the bytes one decode step moves
    in the MoE blocks do not grow against the composed path."""
    rows = {
        label: medium.cost(dict(device=MAC, **opts))
        for label, opts in (("fused", {}), ("composed", {"options": {"moe_block": {"fused": "off"}}}))
    }
    ops = {k: v["ops"]["mlp"] for k, v in rows.items()}
    moved = {k: v["bytes"]["mlp"] for k, v in rows.items()}
    assert ops["fused"] <= 12 * 4 < ops["composed"], ops  # 4 blocks
    assert moved["fused"] <= moved["composed"], moved
