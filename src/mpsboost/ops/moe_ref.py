"""The composed references of mpsboost's fused MoE operators (:mod:`mpsboost.ops.moe_route`), in aten ops: what
those operators run on the CPU and CUDA, what their Metal kernels (:mod:`mpsboost.ops.moe_metal`) are checked
against at patch time. A leaf: it imports nothing of mpsboost."""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["route_reference", "glu_reference", "combine_reference", "stable_topk", "route_mismatch"]


def route_reference(
    logits: torch.Tensor, x: torch.Tensor, top_k: int, norm: bool, weights_dtype: torch.dtype, want_rows: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The router of transformers' softmax-routed blocks, then the pairs in expert order, in aten ops."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    vals, ids = torch.topk(probs, top_k, dim=-1)
    if norm:
        vals = vals / vals.sum(dim=-1, keepdim=True)
    weights = vals.to(weights_dtype)
    n, e = logits.shape
    flat = ids.reshape(-1)
    sorted_ids, perm = torch.sort(flat, stable=True)
    pos = torch.empty(n * top_k, dtype=torch.int32, device=logits.device)
    pos.scatter_(0, perm, torch.arange(n * top_k, dtype=torch.int32, device=logits.device))
    bounds = torch.arange(e, device=logits.device, dtype=sorted_ids.dtype)
    offs = torch.searchsorted(sorted_ids, bounds, right=True, out_int32=True)
    if want_rows:
        rows = x.index_select(0, torch.div(perm, top_k, rounding_mode="floor"))
    else:
        rows = x.new_empty((0, x.shape[1]))
    return weights, ids, pos.view(n, top_k), offs, rows


def stable_topk(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k along the last dim, ties broken by the lower index (a stable descending sort): the Metal kernel's order."""
    v, i = torch.sort(values, dim=-1, descending=True, stable=True)
    return v[..., :k], i[..., :k]


def glu_reference(a: torch.Tensor, b: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``silu(a) * b``; without ``b``, of the two halves of ``a`` along dim 1 (``[R, 2I]``, or ``[R, 2I, 1]`` as a
    batched matrix-vector product writes it)."""
    if b is None:
        a, b = a.chunk(2, dim=1)
    return torch.nn.functional.silu(a) * b


def combine_reference(
    pair: torch.Tensor,
    weights: torch.Tensor,
    pos: Optional[torch.Tensor],
    shared: Optional[torch.Tensor],
    gate: Optional[torch.Tensor],
    shape: list[int],
) -> torch.Tensor:
    """The composed path's combine: the routed outputs back in (token, slot) order, weighted and summed (one
    ``bmm``/``baddbmm`` where the weights have the outputs' dtype, float32 otherwise, as transformers' Mixtral sums),
    plus ``sigmoid(gate) * shared``."""
    n, k = weights.shape
    pair = pair.reshape(pair.shape[0], -1)  # [N * k, H] (or [N * k, H, 1], as a batched product writes it)
    h = pair.shape[-1]
    rows = pair if pos is None else pair.index_select(0, pos.reshape(-1).long())
    rows = rows.view(n, k, h)
    gated = None if shared is None else shared * torch.sigmoid(gate)
    if weights.dtype == pair.dtype:
        w = weights.view(n, 1, k)
        out = torch.bmm(w, rows) if gated is None else torch.baddbmm(gated.view(n, 1, h), w, rows)
        return out.view(shape)
    out = (rows.float() * weights.view(n, k, 1).float()).sum(dim=1)
    if gated is not None:
        out = out + gated
    return out.to(pair.dtype).view(shape)


def route_mismatch(got, want, logits: torch.Tensor, tol: float) -> Optional[str]:
    """What differs between two results of ``moe_route`` (ids, offsets, positions and rows exactly; weights within
    ``tol`` relative to the largest), or None. For the kernel's self-check and the emulated tests."""
    names = ("weights", "ids", "pos", "offs", "rows")
    for name, g, w in zip(names, got, want):
        if g.shape != w.shape or g.dtype != w.dtype:
            return f"gives {name} {g.dtype} {tuple(g.shape)}, expected {w.dtype} {tuple(w.shape)}"
    wg, ww = got[0].double(), want[0].double()
    if wg.isnan().any() or float((wg - ww).abs().max() / ww.abs().max().clamp_min(1e-6)) > tol:
        return "gives other routing weights"
    for name, g, w in zip(names[1:], got[1:], want[1:]):
        if not torch.equal(g, w):
            return f"gives other {name}"
    return None
