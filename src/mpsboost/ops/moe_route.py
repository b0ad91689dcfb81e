"""Fused operators for the non-matmul chains of a softmax-routed sparse MoE block at decode.

A decode step of a Qwen3.5/3.6-MoE block composed of aten ops spends most of its dispatches outside the matmuls:
the router's top-k, softmax and the ordering the grouped products need (``topk``, ``topk``, ``gather``,
``_softmax``, ``searchsorted``, ``index_select``), the gated activations (``split``, ``silu``, ``mul`` for the
routed experts; ``silu``, ``mul`` for the shared expert), the shared expert's gate and the combine (``sigmoid``,
``mul``, ``addmm``). Three registered operators take those chains in one call each:

* ``mpsboost::moe_route(logits [N, E], x [N, H], top_k, norm, weights_dtype, want_rows)`` ->
  ``(weights [N, k], ids [N, k] int64, pos [N, k] int32, offs [E] int32, rows [N * k, H] or [0, H])``: transformers'
  router (``softmax(logits, dtype=float32)``, ``topk``, ``/ sum`` when ``norm``, the weights cast to
  ``weights_dtype``), then the pairs in expert order (stable in ``(token, slot)`` order): each pair's position
  ``pos``, the int32 cumulative ends ``offs`` on the device (``torch._grouped_mm``'s, ``mpsboost::grouped_mm``'s and
  ``mpsboost::affine_grouped_gemv``'s ``offs``), and the token rows in that order (the grouped products' input).
  No host synchronisation.
* ``mpsboost::moe_glu(a, b)``: ``silu(a) * b``; with ``b`` omitted, ``a`` is ``[R, 2I]`` (or ``[R, 2I, 1]``) and its
  halves along dim 1 are gate and up (the fused gate/up product of the routed experts).
* ``mpsboost::moe_combine(pair [N * k, H], weights [N, k], pos, shared, gate, shape)``: ``sum_j w[n, j] *
  pair[pos[n, j]] (+ sigmoid(gate[n]) * shared[n])`` in float32, rounded once, in ``shape`` (the block's output
  shape: no view after it).

On the CPU and CUDA each runs its composed reference (the functions ``*_reference`` below: the very aten ops of
transformers' router and of the composed path) as one registered call; on MPS, mpsboost's Metal kernels
(:mod:`mpsboost.ops.moe_metal`), where they take the tensors, else the reference. Each has a fake, so
``torch.compile(fullgraph=True)`` traces it as one opaque call.

Tie order: the CPU reference is ``torch.topk`` itself (stock's ids exactly, ties included: the CPU's ``topk`` has no
documented tie order, e.g. ``[6, 5, 4]`` for three of eight equal logits). The Metal kernel breaks ties by the lower
expert id (a stable descending sort's order, :func:`stable_topk`); on MPS, ``torch.topk``'s own order is not
documented either. The pairs' expert order is stable in both.

:func:`fused_sparse_moe_block` runs a whole block on these operators, the projections as matrix-vector products
(the router and the shared expert by ``mm`` or their layers' own decode operands; the routed experts by
``torch._grouped_mm`` on bf16/fp16/fp32 stacks, ``mpsboost::grouped_mm`` on fp8 codes with scales, or
``mpsboost::affine_grouped_gemv`` on MLX affine low-bit stacks, or gathered then ``bmm`` where no grouped kernel
exists). :func:`timing_pair` gives the two chains a Mac times against each other at patch time.

This module never imports diffusers or transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from .fp8 import _eager_mps
from .moe_ref import combine_reference, glu_reference, route_mismatch, route_reference, stable_topk

__all__ = [
    "ExpertStacks",
    "route_reference",
    "glu_reference",
    "combine_reference",
    "stable_topk",
    "route_mismatch",
    "moe_route",
    "moe_glu",
    "moe_combine",
    "fused_sparse_moe_block",
    "timing_pair",
]


def _metal():
    from . import moe_metal

    return moe_metal


# ----------------------------------------------------------------------------------------- the operators


@torch.library.custom_op("mpsboost::moe_route", mutates_args=())
def _route_op(
    logits: torch.Tensor, x: torch.Tensor, top_k: int, norm: bool, weights_dtype: torch.dtype, want_rows: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return route_reference(logits, x, top_k, norm, weights_dtype, want_rows)


@_route_op.register_kernel("mps")
def _route_mps(logits, x, top_k, norm, weights_dtype, want_rows):
    mm = _metal()
    if mm.route_supported(logits, x, top_k, weights_dtype) is not None:
        return route_reference(logits, x, top_k, norm, weights_dtype, want_rows)
    return mm.route(logits, x, top_k=top_k, norm=norm, weights_dtype=weights_dtype, want_rows=want_rows)


@_route_op.register_fake
def _route_fake(logits, x, top_k, norm, weights_dtype, want_rows):
    n, e = logits.shape
    return (
        logits.new_empty((n, top_k), dtype=weights_dtype),
        logits.new_empty((n, top_k), dtype=torch.int64),
        logits.new_empty((n, top_k), dtype=torch.int32),
        logits.new_empty((e,), dtype=torch.int32),
        x.new_empty((n * top_k if want_rows else 0, x.shape[1])),
    )


@torch.library.custom_op("mpsboost::moe_glu", mutates_args=())
def _glu_op(a: torch.Tensor, b: Optional[torch.Tensor]) -> torch.Tensor:
    return glu_reference(a, b)


@_glu_op.register_kernel("mps")
def _glu_mps(a, b):
    mm = _metal()
    if b is None:
        flat = a if a.dim() == 2 else (a.view(a.shape[0], a.shape[1]) if a.dim() == 3 and a.shape[2] == 1 else None)
        if flat is None or (a.dim() == 3 and not a.is_contiguous()):
            return glu_reference(a, b)
        ga, gb = flat.chunk(2, dim=1)
    else:
        ga, gb = a, b
    if mm.glu_supported(ga, gb) is not None:
        return glu_reference(a, b)
    y = mm.glu(ga, gb)
    return y if b is not None or a.dim() == 2 else y.view(a.shape[0], a.shape[1] // 2, 1)


@_glu_op.register_fake
def _glu_fake(a, b):
    if b is None:
        return a.new_empty((a.shape[0], a.shape[1] // 2, *a.shape[2:]))
    return torch.empty_like(a, memory_format=torch.contiguous_format)


@torch.library.custom_op("mpsboost::moe_combine", mutates_args=())
def _combine_op(
    pair: torch.Tensor,
    weights: torch.Tensor,
    pos: Optional[torch.Tensor],
    shared: Optional[torch.Tensor],
    gate: Optional[torch.Tensor],
    shape: list[int],
) -> torch.Tensor:
    return combine_reference(pair, weights, pos, shared, gate, shape)


@_combine_op.register_kernel("mps")
def _combine_mps(pair, weights, pos, shared, gate, shape):
    mm = _metal()
    pair = pair if pair.dim() == 2 else pair.view(pair.shape[0], -1)
    if mm.combine_supported(pair, weights, pos, shared, gate) is not None:
        return combine_reference(pair, weights, pos, shared, gate, shape)
    return mm.combine(pair, weights, pos, shared, gate, shape)


@_combine_op.register_fake
def _combine_fake(pair, weights, pos, shared, gate, shape):
    return pair.new_empty(shape)


def _check_route(logits: torch.Tensor, x: torch.Tensor, top_k: int) -> None:
    if logits.dim() != 2 or x.dim() != 2 or logits.shape[0] != x.shape[0]:
        raise ValueError(
            f"moe_route: logits {tuple(logits.shape)} and rows {tuple(x.shape)}: expected [N, E] and [N, H]"
        )
    if not 1 <= top_k <= logits.shape[1]:
        raise ValueError(f"moe_route: top_k={top_k} for {logits.shape[1]} experts: expected 1 <= top_k <= E")


def moe_route(
    logits: torch.Tensor, x: torch.Tensor, top_k: int, norm: bool, weights_dtype: torch.dtype, want_rows: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.ops.mpsboost.moe_route`` (the MPS kernel called straight in eager mode)."""
    _check_route(logits, x, top_k)
    if _eager_mps(logits):
        return _route_mps(logits, x, top_k, norm, weights_dtype, want_rows)
    return torch.ops.mpsboost.moe_route(logits, x, top_k, norm, weights_dtype, want_rows)


def moe_glu(a: torch.Tensor, b: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``torch.ops.mpsboost.moe_glu``: ``silu(a) * b``, or of the two halves of ``a`` along dim 1 when ``b`` is None."""
    if b is None and (a.dim() < 2 or a.shape[1] % 2):
        raise ValueError(
            f"moe_glu: a of shape {tuple(a.shape)} without b: expected [R, 2I, ...] (gate and up halves along dim 1)"
        )
    if b is not None and a.shape != b.shape:
        raise ValueError(f"moe_glu: a {tuple(a.shape)} and b {tuple(b.shape)}: expected one shape")
    if _eager_mps(a):
        return _glu_mps(a, b)
    return torch.ops.mpsboost.moe_glu(a, b)


def moe_combine(
    pair: torch.Tensor,
    weights: torch.Tensor,
    pos: Optional[torch.Tensor],
    shared: Optional[torch.Tensor],
    gate: Optional[torch.Tensor],
    shape: list[int],
) -> torch.Tensor:
    """``torch.ops.mpsboost.moe_combine``: the block's output in ``shape``."""
    n, k = weights.shape
    flat = pair.dim() == 2 or (pair.dim() == 3 and pair.shape[2] == 1)
    if not flat or pair.shape[0] != n * k or (shared is None) != (gate is None):
        raise ValueError(
            f"moe_combine: outputs {tuple(pair.shape)} for weights {tuple(weights.shape)}, shared "
            f"{'given' if shared is not None else 'None'}, gate {'given' if gate is not None else 'None'}: expected "
            "[N * k, H] (or [N * k, H, 1]) outputs and the shared expert's output with its gate, or neither"
        )
    if _eager_mps(pair):
        return _combine_mps(pair, weights, pos, shared, gate, list(shape))
    return torch.ops.mpsboost.moe_combine(pair, weights, pos, shared, gate, list(shape))


# ----------------------------------------------------------------------------------------- a whole block


@dataclass(frozen=True)
class ExpertStacks:
    """How the routed experts' two grouped products run on rows sorted by expert with int32 ``offs``:

    * ``kind="dense"``: ``gate_up_kn [E, H, 2I]``, ``down_kn [E, I, H]`` (views of bf16/fp16/fp32 stacks),
      ``torch._grouped_mm``; ``gate_up`` / ``down`` as stored (``[E, out, in]``) for the gathered path;
    * ``kind="fp8"``: ``(codes, scale, bn, bk)`` of each stack, ``mpsboost::grouped_mm``;
    * ``kind="affine"``: ``(codes, scales, biases, bits, group_size)`` of each stack, ``mpsboost::affine_grouped_gemv``.
    """

    kind: str
    up: tuple
    down: tuple

    def up_rows(self, rows: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return self._run(rows, offs, self.up)

    def down_rows(self, rows: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return self._run(rows, offs, self.down)

    def _run(self, rows: torch.Tensor, offs: torch.Tensor, stack: tuple) -> torch.Tensor:
        if self.kind == "dense":
            from .moe import _grouped_mm_fn

            return _grouped_mm_fn()(rows, stack[0], offs=offs)
        if self.kind == "fp8":
            from .fp8_grouped import grouped_mm

            q, scale, bn, bk = stack
            return grouped_mm(rows, q, offs, scale, bn, bk)
        if self.kind == "affine":
            from .affine import affine_grouped_gemv

            q, s, b, bits, gs = stack
            return affine_grouped_gemv(rows, q, s, b, offs, bits, gs)
        raise ValueError(f"ExpertStacks(kind={self.kind!r}): accepted 'dense', 'fp8', 'affine'")


def _lin(x: torch.Tensor, w: Any) -> torch.Tensor:
    """``x @ w`` for a transposed weight, else ``w(x)`` (a layer another recipe stores in its own format)."""
    return torch.mm(x, w) if isinstance(w, torch.Tensor) else w(x)


def fused_sparse_moe_block(
    x: torch.Tensor,
    w: Any,
    *,
    top_k: int,
    norm: bool,
    cast_weights: bool,
    path: str,
    stacks: Optional[ExpertStacks],
    act_fn: Callable[[torch.Tensor], torch.Tensor],
    shared_act: Optional[Callable[[torch.Tensor], torch.Tensor]],
    silu: bool,
    shared_silu: bool,
    shape: list[int],
) -> torch.Tensor:
    """One softmax-routed sparse MoE block on ``x [N, H]`` (a few tokens), its output in ``shape``.

    ``w``: the block's :class:`mpsboost.ops.moe.BlockWeights` (router and shared expert operands; ``gate_up`` /
    ``down`` for the gathered path). ``path``: ``"grouped"`` (``stacks`` runs the two grouped products on the rows
    ``moe_route`` wrote in expert order) or ``"gather"`` (dense stacks: each pair's expert weights gathered, then
    ``bmm``: where no grouped kernel exists). ``silu`` / ``shared_silu``: the activation is SiLU, so the gated
    products run on ``moe_glu`` (else ``act_fn(gate) * up``). ``cast_weights``: the routing weights in ``x.dtype``
    (all but Mixtral, whose weights and sum stay float32).

    One token of Qwen3.5-MoE (a shared expert with its gate): four ``mm`` (router, shared gate, shared gate and up
    projections), ``moe_glu``, ``mm`` (shared down), ``moe_route``, two grouped products with ``moe_glu`` between
    them, ``moe_combine``: 11 ops, 12 with the caller's reshape of its input.
    """
    n, hdim = x.shape
    wdt = x.dtype if cast_weights else torch.float32
    shared = g = None
    if getattr(w, "inputs_t", None) is not None and shared_act is not None:  # one matmul on the fused copy
        logits, g, sg, su = torch.mm(x, w.inputs_t).split(w.splits, dim=-1)
    else:
        logits = torch.mm(x, w.router_t)
        if shared_act is not None:
            g_t, sg_t, su_t = w.shared_t
            g, sg, su = _lin(x, g_t), _lin(x, sg_t), _lin(x, su_t)
    if shared_act is not None:
        a = moe_glu(sg, su) if shared_silu else shared_act(sg) * su
        shared = _lin(a, w.shared_down_t)
    grouped = path == "grouped"
    weights, ids, pos, offs, rows = moe_route(logits, x, top_k, norm, wdt, grouped)
    if grouped:
        h = stacks.up_rows(rows, offs)
        if h.dtype != x.dtype:
            h = h.to(x.dtype)
        act = moe_glu(h) if silu else glu_reference_act(h, act_fn)
        pair = stacks.down_rows(act, offs)  # [S, H], in expert order
        return moe_combine(pair, weights, pos, shared, g, shape)
    if path != "gather":
        raise ValueError(f"fused_sparse_moe_block(path={path!r}): accepted 'grouped', 'gather'")
    k = top_k
    flat = ids.view(-1)
    if n == 1:
        xr = x.view(1, hdim, 1).expand(k, hdim, 1)
    else:
        xr = x.view(n, 1, hdim, 1).expand(n, k, hdim, 1).reshape(n * k, hdim, 1)
    h = torch.bmm(w.gate_up.index_select(0, flat), xr)  # [S, 2I, 1]
    act = moe_glu(h) if silu else glu_reference_act(h, act_fn, dim=1)  # [S, I, 1]
    pair = torch.bmm(w.down.index_select(0, flat), act)  # [S, H, 1], in (token, slot) order
    return moe_combine(pair, weights, None, shared, g, shape)


def glu_reference_act(h: torch.Tensor, act_fn: Callable[[torch.Tensor], torch.Tensor], dim: int = -1) -> torch.Tensor:
    gate, up = h.chunk(2, dim=dim)
    return act_fn(gate) * up


# ----------------------------------------------------------------------------------------- a Mac's timing


def timing_pair(
    *,
    experts: int,
    top_k: int,
    hidden: int,
    inter: int,
    shared_inter: int,
    dtype: torch.dtype,
    norm: bool,
    cast_weights: bool,
    device: str = "mps",
    seed: int = 0,
) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """The non-matmul chains of one token's block at these shapes, composed and fused, on inputs made here (random
    router logits, gate/up products and routed outputs on ``device``): ``(composed, fused)``, each one call. The
    matmuls are the same on either path, so only these are timed against each other. Nothing model-owned is held."""
    g = torch.Generator().manual_seed(seed)
    k = top_k
    logits = torch.randn(1, experts, generator=g).to(dtype).to(device)
    x = torch.randn(1, hidden, generator=g).to(dtype).to(device)
    h = torch.randn(k, 2 * inter, generator=g).to(dtype).to(device)
    pair = torch.randn(k, hidden, generator=g).to(dtype).to(device)
    wdt = dtype if cast_weights else torch.float32
    bounds = torch.arange(experts, device=device).view(1, -1)
    zeros = torch.zeros(k, dtype=torch.long, device=device)
    if shared_inter:
        sg = torch.randn(1, shared_inter, generator=g).to(dtype).to(device)
        su = torch.randn(1, shared_inter, generator=g).to(dtype).to(device)
        sh = torch.randn(1, hidden, generator=g).to(dtype).to(device)
        gate = torch.randn(1, 1, generator=g).to(dtype).to(device)
    silu = torch.nn.functional.silu

    def composed():
        # mpsboost.ops.moe.sparse_moe_block's one-token chain (grouped path) without its matmuls
        if norm:
            vals, ids = torch.topk(logits, k, dim=-1)
        else:
            vals, ids = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), k, dim=-1)
        ids, perm = torch.topk(ids, k, dim=-1, largest=False)
        vals = vals.gather(-1, perm)
        weights = (torch.softmax(vals, dim=-1, dtype=torch.float32) if norm else vals).to(wdt)
        torch.searchsorted(ids, bounds, right=True, out_int32=True)
        x.index_select(0, zeros)
        ga, up = h.chunk(2, dim=-1)
        silu(ga) * up
        if shared_inter:
            silu(sg) * su
            shared = sh * torch.sigmoid(gate)
            return torch.addmm(shared, weights.to(dtype), pair)
        return torch.mm(weights.to(dtype), pair)

    def fused():
        weights, _, pos, _, _ = moe_route(logits, x, k, norm, wdt, True)
        moe_glu(h)
        if shared_inter:
            moe_glu(sg, su)
            return moe_combine(pair, weights, pos, sh, gate, [1, hidden])
        return moe_combine(pair, weights, pos, None, None, [1, hidden])

    return composed, fused
