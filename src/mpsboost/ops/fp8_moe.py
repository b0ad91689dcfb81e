"""Routed experts whose 3-D weights are stored in fp8 (:mod:`mpsboost.ops.fp8` format), on every device.

In MoE models most bytes sit in the stacked expert weights (``gate_up_proj [E, 2I, H]``,
``down_proj [E, H, I]`` of transformers' experts modules), so they are stored like linear weights:
e4m3fn codes (or their uint8 bytes) with float32 scales per expert and output row (``[E, N, 1]``;
``[E, 1, N]`` for the transposed gpt-oss layout), or one per expert (``[E, 1, 1]``).

Routing is :mod:`mpsboost.ops.moe`'s (pairs sorted by expert, int32 offsets from a device-side
histogram, :func:`~mpsboost.ops.moe.unroute`). Paths (:data:`PATHS`):

* ``"scaled_grouped_mm"`` (CUDA with an fp8 grouped kernel, gate ``scaled_grouped_mm``): activations
  quantised per row, one ``torch._scaled_grouped_mm`` per projection reading the fp8 stack and the
  offsets on the device; no weight is ever dequantised.
* decoding (at most 4 tokens) where scaled_mm has few-rows kernels (MPS, torch 2.15; the fp8 layer's state
  says so): :func:`few_rows_experts`, the routed experts' codes gathered in fp8 and multiplied by ``scaled_mm``
  (3 bytes per routed weight, no widened copy, no host sync);
* ``"gather"`` (few routed pairs, e.g. decoding; every device): each pair's expert is gathered in fp8
  and dequantised (only the experts the tokens hit), then one ``bmm``. No host sync.
* ``"stack"`` (many pairs under ``torch.compile``, no fp8 grouped kernel): this layer's whole stack is
  dequantised (transiently the bytes of one stock layer), then the native grouped matmul where the gate
  has one, else the dense fallback of :func:`mpsboost.ops.moe.grouped_linear`. No host sync.
* ``"hit"`` (many pairs, no fp8 grouped kernel; eager only, see :data:`TRACEABLE`): the experts with at
  least one routed pair are found (one host read of the per-expert counts) and only those are
  dequantised: into a compact stack for the native grouped matmul where the gate has one, else one
  expert at a time (rows sliced by the counts already on the host). Never the whole stack unless every expert is hit.

:func:`dequantize_experts` is the one place expert weights are dequantised, so tests can see which
experts were touched. This module never imports diffusers or transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from . import moe as moe_ops
from .fp8_grouped import grouped_mm, scale_blocks
from .fp8 import (
    FEW_ROWS_MAX,
    FP8_DTYPE,
    dequantize,
    few_rows_ok,
    fp8_gemv,
    metal_ok,
    fused_quantize_rows,
    quantize_rows,
    quantize,
    quantize_rows_few,
    scaled_mm_v2,
)

__all__ = [
    "PATHS",
    "TRACEABLE",
    "BACKING",
    "Fp8Stack",
    "dequantize_experts",
    "fp8_routed_experts",
    "scaled_grouped_ok",
    "few_rows_experts_ok",
    "few_rows_experts",
    "grouped_rows_experts",
    "experts_contenders",
]

PATHS = ("scaled_grouped_mm", "gather", "hit", "stack")
# The paths torch.compile(fullgraph=True) can trace: "hit" reads the per-expert counts on the host, so a
# compiled forward takes "stack" instead (no host sync; the whole stack of this one layer dequantised).
TRACEABLE = ("scaled_grouped_mm", "gather", "stack")
# Decoding (at most FEW_ROWS_MAX tokens) where scaled_mm has its few-rows kernels (MPS, torch 2.15+).
FEW_ROWS_BACKING = {
    "scaled_mm": f"decode (<= {FEW_ROWS_MAX} tokens): fp8 gather of the routed experts' codes, one F.scaled_mm for "
    "every up projection and one per 4 pairs for the down projections (3 bytes per routed weight: gather read and "
    "write, matmul read; no bf16 copy)",
    "gemv": f"decode (<= {FEW_ROWS_MAX} tokens): fp8 gather of the routed experts' codes, one fp8 GEMV (triton) for "
    "every up projection and one per 16 pairs for the down projections (3 bytes per routed weight: gather read and "
    "write, GEMV read; no bf16 copy)",
    "grouped": f"decode (<= {FEW_ROWS_MAX} tokens): mpsboost's Metal fp8 grouped GEMV, one call per projection on "
    "the stack as it is, rows sorted by expert with offsets on the device (1 byte per routed weight, experts "
    "without rows never read, activations as they are; no gather, no host sync)",
}
BACKING = {
    "scaled_grouped_mm": "scaled_grouped_mm rowwise on the fp8 stack, offsets on device",
    "gather": "fp8 gather of the routed experts, dequantise, bmm",
    "hit": "dequantise only the hit experts, then grouped matmul",
    "stack": "dequantise this layer's stack, then grouped matmul",
}


@dataclass(frozen=True)
class Fp8Stack:
    """One stacked expert weight in fp8: codes ``[E, out, in]`` (or ``[E, in, out]`` when transposed) and scales."""

    q: torch.Tensor
    scale: torch.Tensor
    transposed: bool = False


def dequantize_experts(stack: Fp8Stack, experts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The experts ``experts`` (int64 ids, any order, repeats allowed) of ``stack``, dequantised to ``dtype``.

    Reads only those experts' codes and scales: the selective dequantisation of the issue.
    """
    q = stack.q.index_select(0, experts)
    s = stack.scale if stack.scale.shape[0] == 1 else stack.scale.index_select(0, experts)
    return dequantize(q, s, dtype)


def scaled_grouped_ok(stack: Fp8Stack, dtype: torch.dtype) -> bool:
    """Static facts for ``torch._scaled_grouped_mm``: float8 codes, [E, out, in] layout, 16-aligned, bf16 out."""
    e, n, k = stack.q.shape
    return (
        stack.q.dtype == FP8_DTYPE
        and not stack.transposed
        and stack.q.is_contiguous()
        and n % 16 == 0
        and k % 16 == 0
        and dtype == torch.bfloat16
        and hasattr(torch, "_scaled_grouped_mm")
    )


def _quant_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # On CUDA one Triton kernel, as the registered operator mpsboost::fp8_quantize_rows (traceable);
    # elsewhere the same numbers in plain torch ops, which torch.compile can fuse.
    if x.is_cuda:
        return fused_quantize_rows(x)
    return quantize_rows(x)


def _scale_en(stack: Fp8Stack) -> torch.Tensor:
    """Weight scales as ``[E, out]`` float32 contiguous (what scaled_grouped_mm reads)."""
    e, n, _ = stack.q.shape
    s = stack.scale
    if s.shape[1] == n:
        return s.reshape(e, n)
    return s.reshape(e, 1).expand(e, n).contiguous()


def _scaled_grouped(x: torch.Tensor, stack: Fp8Stack, offsets: torch.Tensor) -> torch.Tensor:
    xq, xs = _quant_rows(x)
    return torch._scaled_grouped_mm(
        xq, stack.q.transpose(-2, -1), xs.reshape(-1), _scale_en(stack), offs=offsets, out_dtype=torch.bfloat16
    )


def few_rows_experts_ok(up: Fp8Stack, down: Fp8Stack, dtype: torch.dtype, kernel: str = "scaled_mm") -> bool:
    """Static facts for :func:`few_rows_experts` (:func:`grouped_rows_experts` for ``grouped``): float8 codes in the
    [E, out, in] layout; for ``scaled_mm`` 16-aligned dims and an output type it writes; for ``gemv`` a float32,
    bfloat16 or float16 activation; for ``grouped`` that too, K a multiple of 16, and float8 or uint8 codes."""
    if kernel == "grouped":
        return all(
            st.q.dtype in (FP8_DTYPE, torch.uint8)
            and st.q.dim() == 3
            and not st.transposed
            and metal_ok(st.q.shape[2], dtype)
            for st in (up, down)
        )
    if kernel == "gemv":
        ok = lambda st: dtype in (torch.float32, torch.bfloat16, torch.float16)  # noqa: E731
    else:
        ok = lambda st: few_rows_ok(st.q.shape[1], st.q.shape[2], dtype)  # noqa: E731
    return all(st.q.dtype == FP8_DTYPE and not st.transposed and ok(st) for st in (up, down))


def _row_scales(stack: Fp8Stack, ids: torch.Tensor, rows: int) -> torch.Tensor:
    """The gathered experts' scales as one row ``[1, P * out]`` (scaled_mm's rowwise ``scale_b``)."""
    s = stack.scale.index_select(0, ids) if stack.scale.shape[0] != 1 else stack.scale.expand(ids.shape[0], -1, -1)
    if s.shape[1] != stack.q.shape[1]:  # one scale per expert: one per output row of it
        s = s.expand(-1, stack.q.shape[1], -1).contiguous()
    return s.view(1, rows)


FEW_ROWS_KERNELS = {"scaled_mm": FEW_ROWS_MAX, "gemv": 16}  # kernel -> rows one call takes


def _few_rows_mm(
    kernel: str, xq: torch.Tensor, xs: Optional[torch.Tensor], w: torch.Tensor, s_row: torch.Tensor, out_dtype
) -> torch.Tensor:
    """``x [M, K] @ (w [N, K] * s_row [1, N]).T`` by ``kernel``. ``scaled_mm``: ``xq``/``xs`` are the rows' fp8
    codes and scales (:func:`~mpsboost.ops.fp8.quantize_rows_few`), through :func:`~mpsboost.ops.fp8.scaled_mm_v2`
    (``F.scaled_mm``: the MPS kernel), output in ``out_dtype``; ``gemv``: ``xq`` is the
    activation itself, mpsboost's fp8 GEMV (Triton on CUDA; activations untouched)."""
    if kernel == "scaled_mm":
        return scaled_mm_v2(xq, w.t(), xs, s_row, None, out_dtype)
    return fp8_gemv(xq, w, s_row.reshape(-1), None)


def _own_columns(y: torch.Tensor, r: int, n: int) -> torch.Tensor:
    """Row ``j`` of ``y [r, r * n]`` keeps its own ``n`` columns (block ``j``): ``[r, n]`` as one strided view."""
    if r == 1:
        return y
    return y.as_strided((r, n), (r * n + n, 1))  # storage offset: that of y


def few_rows_experts(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *,
    up: Fp8Stack,
    down: Fp8Stack,
    activation: Callable[[torch.Tensor], torch.Tensor],
    key: Optional[torch.Tensor] = None,
    kernel: str = "scaled_mm",
) -> torch.Tensor:
    """Routed experts for a few tokens (``T <= 4``) on fp8 stacks, reading the routed experts' fp8 codes only.

    The routed experts' codes are gathered in fp8 (``index_select``: the only copy, 1 byte per weight read and
    written), never widened: 3 bytes per routed weight in all with the matmul's read (no MPS 2.15 kernel reads an
    fp8 stack in place: ``_scaled_grouped_mm`` is CUDA only, the wheel's ``grouped_mm_few_rows`` kernels are bf16).
    Up: one call of ``kernel`` with the ``T`` token rows against all ``T * k`` gathered experts side by side
    (``[T * k * N, H]``), each token keeping its own experts' columns. Down: the ``P = T * k`` pair rows quantised
    once, then one call per few pairs (4 for ``scaled_mm``, 16 for ``gemv``) against those pairs' gathered experts,
    each row keeping its own expert's columns (one strided view; the kernel streams the weight once for all its
    rows); one ``mm`` (``bmm`` for ``T > 1``) then weights each pair by its routing weight and sums a token's ``k``
    pairs (fp32 accumulation, one rounding). No host sync; every branch is on shapes. ``kernel``: ``"scaled_mm"``
    (MPS 2.15's few-rows kernels behind ``F.scaled_mm``; activations quantised per row) or ``"gemv"``
    (:func:`mpsboost.ops.fp8.fp8_gemv`, the Triton GEMV on CUDA: the stored weights exactly).
    ``hidden_states [T, H]``, ``top_k_* [T, k]``; returns ``[T, H]`` in ``hidden_states.dtype``."""
    if kernel not in FEW_ROWS_KERNELS:
        raise ValueError(f"few_rows_experts(kernel={kernel!r}): accepted kernels are {', '.join(FEW_ROWS_KERNELS)}")
    rows = FEW_ROWS_KERNELS[kernel]
    dtype = hidden_states.dtype
    t, hdim = hidden_states.shape
    k = top_k_index.shape[-1]
    p = t * k
    ids = top_k_index.reshape(p)
    _, n_up, _ = up.q.shape
    w_up = up.q.index_select(0, ids).view(p * n_up, hdim)
    if kernel == "scaled_mm":
        xq, xs = quantize_rows_few(hidden_states, key)
    else:
        xq, xs = hidden_states, None
    y = _few_rows_mm(kernel, xq, xs, w_up, _row_scales(up, ids, p * n_up), dtype)
    if t == 1:
        h = y.view(p, n_up)
    else:  # token i keeps the columns of its own k experts: block i of row i, [k, N] each, copied into [P, N]
        h = y.as_strided((t, k, n_up), ((t + 1) * k * n_up, n_up, 1)).reshape(p, n_up)
    h = activation(h)
    if h.dtype != dtype:
        h = h.to(dtype)
    inter = h.shape[-1]
    _, n_down, _ = down.q.shape
    w_down = down.q.index_select(0, ids).view(p * n_down, inter)
    s_down = _row_scales(down, ids, p * n_down)
    # Rowwise quantisation treats each row alone: once for all P rows is the same as once per call's rows.
    hq, hs = quantize_rows_few(h) if kernel == "scaled_mm" else (h, None)
    if p <= rows:  # one call: no slicing
        diag = _own_columns(_few_rows_mm(kernel, hq, hs, w_down, s_down, dtype), p, n_down)
    else:
        parts = []
        for c0 in range(0, p, rows):
            r = min(p, c0 + rows) - c0
            yc = _few_rows_mm(
                kernel,
                hq[c0 : c0 + r],
                None if hs is None else hs[c0 : c0 + r],
                w_down[c0 * n_down : (c0 + r) * n_down],
                s_down[:, c0 * n_down : (c0 + r) * n_down],
                dtype,
            )
            parts.append(_own_columns(yc, r, n_down))
        diag = torch.cat(parts)
    wts = top_k_weights if top_k_weights.dtype == diag.dtype else top_k_weights.to(diag.dtype)
    if t == 1:  # [1, k] @ [k, H]: the routing weights applied and the k pairs summed in one op
        return torch.mm(wts, diag)
    return torch.bmm(wts.view(t, 1, k), diag.view(t, k, n_down)).view(t, n_down)


def grouped_rows_experts(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *,
    up: Fp8Stack,
    down: Fp8Stack,
    activation: Callable[[torch.Tensor], torch.Tensor],
    block: Optional[tuple[int, int]] = None,
) -> torch.Tensor:
    """Routed experts for a few tokens on fp8 stacks by ``torch.ops.mpsboost.grouped_mm`` (MPS: mpsboost's Metal
    kernel), reading each routed expert's codes once, in place, at 1 byte per weight; activations as they are.

    The ``P = T * k`` pairs are put in ascending expert order by one ``topk(largest=False)`` (see
    :mod:`mpsboost.ops.moe`, ``_ascending``), their int32 offsets come from one ``searchsorted`` on the device, the
    up projections read the token rows as they are (one token: one row of stride 0, no copy), the down projections
    the pair rows, and one ``mm`` (``index_add_`` for several tokens) weights and sums each token's pairs. No host
    sync, no gather of weights. ``block``: the stacks' block scales ``(bn, bk)`` (a file's); otherwise their rowwise
    or per-expert scales. ``hidden_states [T, H]``, ``top_k_* [T, k]``; returns ``[T, H]`` in its dtype."""
    t, hdim = hidden_states.shape
    k = top_k_index.shape[-1]
    p = t * k
    # One token: its [1, k] ids sorted as they are (no reshape); several: all pairs as one row.
    ids = top_k_index if t == 1 else top_k_index.reshape(1, p)
    sids, perm = torch.topk(ids, p, dim=-1, largest=False)
    offs = torch.searchsorted(sids, _bounds(up.q.shape[0], sids), right=True, out_int32=True).view(-1)
    if t == 1:
        rows = hidden_states.expand(p, hdim)
    else:
        rows = hidden_states.index_select(0, torch.div(perm.view(p), k, rounding_mode="floor"))
    ub = block if block is not None else scale_blocks(up.q, up.scale)
    db = block if block is not None else scale_blocks(down.q, down.scale)
    h = activation(grouped_mm(rows, up.q, offs, up.scale, ub[0], ub[1]))
    if h.dtype != hidden_states.dtype:
        h = h.to(hidden_states.dtype)
    y = grouped_mm(h, down.q, offs, down.scale, db[0], db[1])  # [P, H], pairs in expert order
    if t == 1:  # [1, P] @ [P, H]: the routing weights (in the pairs' order) applied and summed in one op
        wts = top_k_weights.gather(1, perm)
        return torch.mm(wts if wts.dtype == y.dtype else wts.to(y.dtype), y)
    wts = top_k_weights.reshape(p).index_select(0, perm.view(p)).to(y.dtype)
    out = torch.zeros((t, hdim), dtype=y.dtype, device=y.device)
    return out.index_add_(0, torch.div(perm.view(p), k, rounding_mode="floor"), y * wts.unsqueeze(-1))


# (device, number of experts) -> arange(E) as [1, E]: searchsorted's bounds, made once per process in eager mode
# (one dispatch less per MoE layer and token); a few bytes per key, no model held.
_BOUNDS: dict = {}


def _bounds(e: int, like: torch.Tensor) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return torch.arange(e, device=like.device, dtype=like.dtype).view(1, e)
    key = (like.device, like.dtype, e)
    found = _BOUNDS.get(key)
    if found is None:
        found = _BOUNDS[key] = torch.arange(e, device=like.device, dtype=like.dtype).view(1, e)
    return found


def _mm_rows(x: torch.Tensor, w: torch.Tensor, transposed: bool) -> torch.Tensor:
    return x @ w if transposed else x @ w.t()


def _bmm_rows(x: torch.Tensor, w: torch.Tensor, transposed: bool) -> torch.Tensor:
    if transposed:
        return torch.bmm(x.unsqueeze(1), w).squeeze(1)
    return torch.bmm(w, x.unsqueeze(-1)).squeeze(-1)


def fp8_routed_experts(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *,
    up: Fp8Stack,
    down: Fp8Stack,
    activation: Callable[[torch.Tensor], torch.Tensor],
    compute_dtype: torch.dtype,
    up_bias: Optional[torch.Tensor] = None,
    down_bias: Optional[torch.Tensor] = None,
    post: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    path: str = "hit",
    native_grouped: bool = False,
    histc_int: bool = False,
) -> torch.Tensor:
    """``sum_j w[n, j] * down(activation(up(x[n])))`` over the top-k experts, weights in fp8.

    ``hidden_states`` ``[N, H]``, ``top_k_index``/``top_k_weights`` ``[N, k]``. ``path`` is one of
    :data:`PATHS` (the caller chooses from the gate and the pair count); ``native_grouped`` says that
    the gate allows the native (non-fp8) grouped matmul for the ``"hit"`` path. Returns ``[N, H]`` in
    ``hidden_states.dtype``.
    """
    if path not in PATHS:
        raise ValueError(f"fp8_routed_experts(path={path!r}): accepted paths are {', '.join(PATHS)}")
    n, hdim = hidden_states.shape
    k = top_k_index.shape[-1]
    num_experts = up.q.shape[0]
    if n == 0:
        return hidden_states.new_zeros(0, hdim)
    x_in = hidden_states.to(compute_dtype)

    if path == "gather":
        # Pairs in (token, slot) order: gather each pair's expert in fp8, dequantise just those.
        ids = top_k_index.reshape(-1).clamp(0, num_experts - 1).to(torch.int64)
        x = x_in.unsqueeze(1).expand(n, k, hdim).reshape(n * k, hdim)
        h = _bmm_rows(x, dequantize_experts(up, ids, compute_dtype), up.transposed)
        if up_bias is not None:
            h = h + up_bias[ids]
        h = activation(h)
        y = _bmm_rows(h.to(compute_dtype), dequantize_experts(down, ids, compute_dtype), down.transposed)
        if down_bias is not None:
            y = y + down_bias[ids]
        if post is not None:
            y = post(y)
        y = y * top_k_weights.reshape(-1, 1).to(y.dtype)
        valid = (top_k_index.reshape(-1) < num_experts).unsqueeze(-1)
        y = torch.where(valid, y, torch.zeros((), dtype=y.dtype, device=y.device))
        return y.view(n, k, -1).sum(dim=1).to(hidden_states.dtype)

    routing = moe_ops.route(top_k_index, top_k_weights, num_experts, histc_int=histc_int)
    x = x_in.index_select(0, routing.sorted_token_idx)
    eos = routing.expert_of_sorted

    if path == "stack":
        eos_c = eos.clamp(0, num_experts - 1)
        w_up = dequantize(up.q, up.scale, compute_dtype)
        grouped = native_grouped and moe_ops.native_grouped_mm_ok(x, moe_ops._as_kn(w_up, up.transposed))
        how = "grouped_mm" if grouped else "fallback"
        h = moe_ops.grouped_linear(x, w_up, routing.offsets, path=how, expert_of_sorted=eos, transposed=up.transposed)
        del w_up
        if up_bias is not None:
            h = h + up_bias[eos_c]
        h = activation(h).to(compute_dtype)
        w_down = dequantize(down.q, down.scale, compute_dtype)
        y = moe_ops.grouped_linear(
            h, w_down, routing.offsets, path=how, expert_of_sorted=eos, transposed=down.transposed
        )
        del w_down
        if down_bias is not None:
            y = y + down_bias[eos_c]
        # grouped_mm leaves rows past offsets[-1] (expert-parallel sentinels) uninitialised: unroute zeroes them.
    elif path == "scaled_grouped_mm":
        h = _scaled_grouped(x, up, routing.offsets)
        if up_bias is not None:
            h = h + up_bias[eos.clamp(0, num_experts - 1)]
        h = activation(h)
        y = _scaled_grouped(h.to(torch.bfloat16).contiguous(), down, routing.offsets)
        if down_bias is not None:
            y = y + down_bias[eos.clamp(0, num_experts - 1)]
    else:
        # "hit": one host read of the per-expert counts names the experts to dequantise.
        counts = routing.counts.tolist()
        hit_list = [e for e, c in enumerate(counts) if c]
        rows = sum(counts)  # pairs of expert-parallel sentinels (ids >= E) sort last and are not counted
        if native_grouped:
            hit = torch.tensor(hit_list, dtype=torch.int64, device=x.device)
            ends, acc = [], 0
            for e in hit_list:
                acc += counts[e]
                ends.append(acc)
            offs = torch.tensor(ends, dtype=torch.int32, device=x.device)
        y = None
        if native_grouped and hit_list:
            w_up = dequantize_experts(up, hit, compute_dtype)
            if moe_ops.native_grouped_mm_ok(x, moe_ops._as_kn(w_up, up.transposed)):
                h = moe_ops.grouped_linear(x, w_up, offs, path="grouped_mm", transposed=up.transposed)
                del w_up
                if up_bias is not None:
                    h = h + up_bias[eos.clamp(0, num_experts - 1)]
                h = activation(h).to(compute_dtype)
                w_down = dequantize_experts(down, hit, compute_dtype)
                y = moe_ops.grouped_linear(h, w_down, offs, path="grouped_mm", transposed=down.transposed)
                del w_down
                if down_bias is not None:
                    y = y + down_bias[eos.clamp(0, num_experts - 1)]
            else:
                del w_up
        if y is None:
            # One expert at a time: the smallest dequantised footprint, exact FLOPs, rows sliced by
            # the counts already on the host.
            y = x.new_zeros(x.shape[0], down.q.shape[-2] if not down.transposed else down.q.shape[-1])
            start = 0
            for e in hit_list:
                c = counts[e]
                idx = torch.tensor([e], dtype=torch.int64, device=x.device)
                h = _mm_rows(x[start : start + c], dequantize_experts(up, idx, compute_dtype)[0], up.transposed)
                if up_bias is not None:
                    h = h + up_bias[e]
                h = activation(h).to(compute_dtype)
                ye = _mm_rows(h, dequantize_experts(down, idx, compute_dtype)[0], down.transposed)
                if down_bias is not None:
                    ye = ye + down_bias[e]
                y[start : start + c] = ye.to(y.dtype)
                start += c
        if rows < y.shape[0]:
            y[rows:] = 0
    if post is not None:
        y = post(y)
    return moe_ops.unroute(y, routing).to(hidden_states.dtype)


def experts_contenders(
    experts: int, up_rows: int, hidden: int, inter: int, top_k: int, dtype: torch.dtype, *, device: str = "mps"
) -> tuple:
    """``(stock_run, metal_run)`` at one experts module's decode shape (one token, ``top_k`` routed experts of
    ``experts``; stacks up ``[E, up_rows, hidden]``, down ``[E, hidden, inter]``; ``up_rows = 2 * inter`` gate and
    up fused, a SiLU-GLU between them), for :func:`mpsboost.ondevice.choose`: ``stock_run`` by torch's own few-rows
    fp8 kernels (:func:`few_rows_experts`, ``kernel="scaled_mm"``: the routed experts' codes gathered, activations
    quantised per row), ``metal_run`` by mpsboost's Metal grouped GEMV (:func:`grouped_rows_experts`: the routed
    experts read in place). Both on the same random rowwise-scaled codes and routing on ``device``, made at the first
    call (nothing is allocated where nothing is timed). The Metal kernel's correctness is its self-check's."""
    if not 0 < top_k <= experts or up_rows != 2 * inter:
        raise ValueError(
            f"experts_contenders: top_k={top_k} of {experts} experts, up_rows={up_rows} for inter={inter} "
            "(gate and up fused: up_rows = 2 * inter)"
        )
    made: list[tuple] = []

    def inputs() -> tuple:
        if not made:
            g = torch.Generator().manual_seed(0)
            up_q, up_s = quantize(torch.randn(experts, up_rows, hidden, generator=g) * 0.05, "rowwise")
            dn_q, dn_s = quantize(torch.randn(experts, hidden, inter, generator=g) * 0.05, "rowwise")
            x = torch.randn(1, hidden, generator=g).to(dtype)
            ids = torch.randperm(experts, generator=g)[:top_k].view(1, top_k)
            w = torch.softmax(torch.randn(1, top_k, generator=g), -1).to(dtype)
            dev = torch.device(device)
            up = Fp8Stack(up_q.to(dev), up_s.to(dev))
            down = Fp8Stack(dn_q.to(dev), dn_s.to(dev))
            made.append((x.to(dev), ids.to(dev), w.to(dev), up, down))
        return made[0]

    def glu(h: torch.Tensor) -> torch.Tensor:
        gate, up = h.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    def stock() -> torch.Tensor:
        x, ids, w, up, down = inputs()
        return few_rows_experts(x, ids, w, up=up, down=down, activation=glu, kernel="scaled_mm")

    def metal() -> torch.Tensor:
        x, ids, w, up, down = inputs()
        return grouped_rows_experts(x, ids, w, up=up, down=down, activation=glu)

    return stock, metal
