"""Block-scaled FP8 weights (transformers' fine-grained FP8, compressed-tensors ``block``), on every device.

A block-scaled weight ``[N, K]`` holds e4m3fn codes and one float32 scale per ``[bn, bk]`` block
(``scale [ceil(N/bn), ceil(K/bk)]``; the last block of a dim may be short). Its value is
``code * scale`` of the block: transformers names that scale ``weight_scale_inv`` (it multiplies; it
is the inverse of the quantisation scale). Expert stacks ``[E, N, K]`` carry ``[E, ceil(N/bn),
ceil(K/bk)]``.

The scales are kept as they are in the file, never folded into other scales, and applied here:
each code times its block's float32 scale, computed in float32 (one rounding, the same as the file's
own dequantisation in float32) and rounded once to the compute dtype (see :func:`dequantize_block`). Codes are
float8_e4m3fn or, where float8 tensors cannot live on the device (MPS before torch 2.15,
pytorch#194074), their uint8 bytes decoded with :func:`mpsboost.ops.fp8.decode_e4m3` (bit-identical).

This module never imports diffusers or transformers.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .fp8 import widen

__all__ = ["expand_block_scale", "dequantize_block", "fp8_block_linear", "fp8_block_experts", "check_block_scale"]

# On CPU, blocks are dequantised in slices so that TensorIterator's float32 scratch stays small next to the layer.
_CHUNK_ELEMENTS = 1 << 24


def check_block_scale(shape: tuple[int, ...], scale_shape: tuple[int, ...], block: tuple[int, int]) -> Optional[str]:
    """None when ``scale_shape`` is the block-scale shape of a weight ``shape`` with ``block``; else why not."""
    bn, bk = block
    want = tuple(shape[:-2]) + (-(-shape[-2] // bn), -(-shape[-1] // bk))
    if tuple(scale_shape) != want:
        return (
            f"block scales of a {list(shape)} weight with blocks {[bn, bk]} have shape {list(want)}, "
            f"got {list(scale_shape)}"
        )
    return None


def expand_block_scale(scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    """``scale [..., ceil(rows/bn), ceil(cols/bk)]`` -> one scale per element ``[..., rows, cols]`` (float32).
    A reference for tests and tools; :func:`dequantize_block` never materialises it."""
    bn, bk = block
    s = scale.float().repeat_interleave(bn, dim=-2)[..., :rows, :]
    return s.repeat_interleave(bk, dim=-1)[..., :cols]


def dequantize_block(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """Codes ``[..., N, K]`` and block scales -> ``dtype`` ``[..., N, K]``: ``code * scale`` in float32, rounded once.

    The codes are widened straight to ``dtype`` (exact) and multiplied in place by their float32 block
    scales, viewed so that they broadcast over each block: the full blocks as ``[.., N/bn, bn, K/bk, bk]``
    against ``[.., N/bn, 1, K/bk, 1]``, then the short last row and column of blocks, if any. Type
    promotion computes each product in float32 and rounds it once into ``dtype``; no float32 copy of the
    weight and no per-element scale is made, and one kernel covers the full blocks (CUDA, MPS). On CPU,
    whose TensorIterator keeps a float32 copy of what it writes, the full blocks go in slices."""
    bn, bk = block
    rows, cols = q.shape[-2:]
    w = widen(q, dtype)
    w3 = w.view(-1, rows, cols)
    s = scale.float().reshape(-1, *scale.shape[-2:])
    nb, kb = rows // bn, cols // bk  # full blocks
    rm, cm = nb * bn, kb * bk
    per = nb
    if q.device.type == "cpu":
        per = max(1, _CHUNK_ELEMENTS // max(1, w3.shape[0] * bn * cols))
    if kb:
        for r in range(0, nb, per):
            r1 = min(nb, r + per)
            blocks = w3[:, r * bn : r1 * bn, :cm].unflatten(2, (kb, bk)).unflatten(1, (r1 - r, bn))
            blocks.mul_(s[:, r:r1, None, :kb, None])
    if cm < cols and nb:  # the short last column of blocks
        w3[:, :rm, cm:].unflatten(1, (nb, bn)).mul_(s[:, :nb, None, kb : kb + 1])
    if rm < rows and kb:  # the short last row of blocks
        w3[:, rm:, :cm].unflatten(2, (kb, bk)).mul_(s[:, nb : nb + 1, :kb, None])
    if rm < rows and cm < cols:  # the corner
        w3[:, rm:, cm:].mul_(s[:, nb : nb + 1, kb : kb + 1])
    return w


def fp8_block_linear(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    bias: Optional[torch.Tensor],
    *,
    block: tuple[int, int],
    compute_dtype: torch.dtype,
) -> torch.Tensor:
    """``F.linear(x, dequantize_block(q, scale), bias)``: this one layer is dequantised just before its matmul."""
    return F.linear(x, dequantize_block(q, scale, block, compute_dtype), bias)


def fp8_block_experts(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *,
    up: tuple[torch.Tensor, torch.Tensor],
    down: tuple[torch.Tensor, torch.Tensor],
    block: tuple[int, int],
    activation: Callable[[torch.Tensor], torch.Tensor],
    compute_dtype: torch.dtype,
    up_bias: Optional[torch.Tensor] = None,
    down_bias: Optional[torch.Tensor] = None,
    down_block: Optional[tuple[int, int]] = None,
) -> torch.Tensor:
    """Routed experts on block-scaled stacks ``up [E, N_up, H]``, ``down [E, H, I]`` (the [E, out, in] layout).

    Per-row (``[E, N, 1]``) and per-expert (``[E, 1, 1]``) scales are block scales of blocks ``(1, K)`` and
    ``(N, K)``: ``down_block`` gives the down projection's when it differs from ``block``. Pairs are sorted
    by expert; the per-expert counts are read once on the host and only the experts with routed pairs are
    dequantised, one at a time. ``hidden_states [T, H]``, ``top_k_* [T, k]``. Under
    torch.compile the counts are never read on the host: the layer's stacks are dequantised whole and the
    sync-free routed path of :mod:`mpsboost.ops.moe` runs instead.
    """
    t, hdim = hidden_states.shape
    if torch.compiler.is_compiling():
        # Traced (torch.compile): no host read of the counts. This layer's stacks are dequantised whole
        # (transiently one layer in the compute dtype) and the routed experts run by the sync-free path.
        from .moe import routed_experts

        return routed_experts(
            hidden_states.to(compute_dtype),
            top_k_index,
            top_k_weights.to(compute_dtype),
            up_weight=dequantize_block(up[0], up[1], block, compute_dtype),
            down_weight=dequantize_block(down[0], down[1], down_block or block, compute_dtype),
            activation=activation,
            up_bias=up_bias,
            down_bias=down_bias,
            path="fallback",
        ).to(hidden_states.dtype)
    if t == 0:
        return hidden_states.new_zeros(0, hdim)
    num_experts = up[0].shape[0]
    k = top_k_index.shape[-1]
    flat = top_k_index.reshape(-1).to(torch.int64)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat.clamp(0, num_experts), minlength=num_experts + 1)[:num_experts].tolist()
    x = hidden_states.to(compute_dtype)
    wts = top_k_weights.reshape(-1)
    # Per-pair outputs weighted in the product's dtype and summed over the k slots, in the order of
    # transformers' own experts forward (integrations/moe.py), so that only the matmul kernels differ.
    out = torch.zeros(
        t * k, down[0].shape[-2], dtype=torch.result_type(torch.empty((), dtype=compute_dtype), wts), device=x.device
    )
    start = 0
    for e, c in enumerate(counts):
        if not c:
            continue
        pairs = order[start : start + c]
        start += c
        tok = pairs // k
        w_up = dequantize_block(up[0][e], up[1][e], block, compute_dtype)
        h = F.linear(x[tok], w_up, None if up_bias is None else up_bias[e])
        del w_up
        h = activation(h).to(compute_dtype)
        w_down = dequantize_block(down[0][e], down[1][e], down_block or block, compute_dtype)
        y = F.linear(h, w_down, None if down_bias is None else down_bias[e])
        out[pairs] = y * wts[pairs].unsqueeze(-1)
    return out.view(t, k, -1).sum(dim=1).to(hidden_states.dtype)
