"""``mpsboost::grouped_mm``: a grouped matmul with offsets on the device whose weights are fp8 codes with scales.

``y [R, N] = x [R, K] @ (codes[e(r)] * scales[e(r)]).T`` where the rows of ``x`` are sorted by group and
``offs [E]`` (int32, cumulative ends, on the device) says where each group ends, exactly as
``torch._grouped_mm(x, w_kn, offs=offs)`` takes them: row ``r`` belongs to the first ``e`` with ``r < offs[e]``.
Rows at or past ``offs[E - 1]`` are zeros. Only the experts with rows are read; nothing is read on the host.

* codes ``[E, N, K]`` float8_e4m3fn (or their uint8 bytes), the layout transformers' experts store;
* float32 scales ``[E, ceil(N / bn), ceil(K / bk)]``: rowwise ``(bn, bk) = (1, K)``, one per expert ``(N, K)``,
  or the file's blocks (``(128, 128)`` in published FP8 checkpoints), applied as they are.

Numerics: each code times its scale in float32, rounded once to ``x.dtype`` (:func:`mpsboost.ops.fp8.dequantize`),
products accumulated in float32, the output rounded once. Kernels: MPS, mpsboost's Metal kernel
(:mod:`mpsboost.ops.fp8_metal`: 1 byte per routed weight, activations as they are); CUDA, a Triton kernel
(:func:`mpsboost.ops.fp8_triton.grouped_gemv`); elsewhere, and where those cannot take the tensors,
:func:`grouped_mm_reference` (the routed experts' codes gathered and dequantised, then ``bmm``). The caller
chooses this operator at decode (a few rows); it is registered (``torch.library.custom_op`` with a fake), so
``torch.compile(fullgraph=True)`` traces it as one opaque call.

Also here: ``mpsboost::fp8_block_gemv`` (the dense case with a file's block scales), the ``_out`` variants that
write into a caller's buffer, and :class:`GemvOperand`, what an eager decode step calls for an fp8 linear whose
few-rows path is the fp8 GEMV.

This module never imports diffusers or transformers.
"""

from __future__ import annotations

import torch

from typing import Optional

from .fp8 import _eager_cuda, _eager_mps, _have_triton, check_out_size, fp8_gemv, fp8_gemv_out, widen

__all__ = ["GemvOperand", "grouped_mm", "grouped_mm_reference", "block_gemv", "block_gemv_out", "scale_blocks"]


def scale_blocks(codes: torch.Tensor, scale: torch.Tensor) -> tuple[int, int]:
    """``(bn, bk)`` of a rowwise (``[E, N, 1]``) or per-expert (``[E, 1, 1]``) scale of ``codes [E, N, K]``."""
    _, n, k = codes.shape
    if tuple(scale.shape[1:]) == (n, 1):
        return 1, k
    if tuple(scale.shape[1:]) == (1, 1):
        return n, k
    raise ValueError(f"scales {list(scale.shape)} of codes {list(codes.shape)}: expected [E, N, 1] or [E, 1, 1]")


def grouped_mm_reference(
    x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, scale: torch.Tensor, bn: int, bk: int
) -> torch.Tensor:
    """The operator's numbers in plain torch ops, on any device, without a host read: each row's expert found by
    ``searchsorted`` on the device, its codes gathered and dequantised (``code * scale`` in float32, rounded once
    to ``x.dtype``), one ``bmm`` (float32 accumulation), rows past the last offset zeroed."""
    r, _ = x.shape
    e, n, k = w.shape
    rows = torch.arange(r, device=x.device, dtype=offs.dtype)
    grp = torch.searchsorted(offs, rows, right=True)
    valid = grp < e
    grp = grp.clamp(max=e - 1).long()
    s = scale.float().index_select(0, grp)
    s = s.repeat_interleave(bn, dim=1)[:, :n].repeat_interleave(bk, dim=2)[:, :, :k]
    wd = widen(w.index_select(0, grp), torch.float32).mul_(s).to(x.dtype)
    y = torch.bmm(wd, x.unsqueeze(-1)).squeeze(-1)
    return torch.where(valid.unsqueeze(-1), y, torch.zeros((), dtype=y.dtype, device=y.device))


@torch.library.custom_op("mpsboost::grouped_mm", mutates_args=())
def _grouped_mm_op(
    x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, scale: torch.Tensor, bn: int, bk: int
) -> torch.Tensor:
    return grouped_mm_reference(x, w, offs, scale, bn, bk)


@_grouped_mm_op.register_kernel("cuda")
def _grouped_mm_cuda(
    x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, scale: torch.Tensor, bn: int, bk: int
) -> torch.Tensor:
    if not _have_triton() or w.dtype != torch.float8_e4m3fn:
        return grouped_mm_reference(x, w, offs, scale, bn, bk)
    from . import fp8_triton

    return fp8_triton.grouped_gemv(x, w, offs, scale, bn, bk)


@_grouped_mm_op.register_kernel("mps")
def _grouped_mm_mps(
    x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, scale: torch.Tensor, bn: int, bk: int
) -> torch.Tensor:
    from . import fp8_metal

    if fp8_metal.supported(x, w, bk=bk) is not None or offs.dtype != torch.int32:
        return grouped_mm_reference(x, w, offs, scale, bn, bk)
    # The kernel reads float32 scales (the reference takes any float dtype and computes in float32 too).
    return fp8_metal.rows_gemv(x, w, scale.float().contiguous(), offs.contiguous(), bn=bn, bk=bk)


@_grouped_mm_op.register_fake
def _grouped_mm_fake(
    x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, scale: torch.Tensor, bn: int, bk: int
) -> torch.Tensor:
    return x.new_empty((x.shape[0], w.shape[1]))


def grouped_mm(
    x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, scale: torch.Tensor, bn: int, bk: int
) -> torch.Tensor:
    """``torch.ops.mpsboost.grouped_mm`` (the CUDA kernel called straight in eager mode, as :func:`fp8_gemv` does:
    the dispatcher's host time saved once per call)."""
    if _eager_cuda(x):
        return _grouped_mm_cuda(x, w, offs, scale, bn, bk)
    if _eager_mps(x):
        return _grouped_mm_mps(x, w, offs, scale, bn, bk)
    return torch.ops.mpsboost.grouped_mm(x, w, offs, scale, bn, bk)


# ------------------------------------------------------------------ the dense case with block scales


def _block_gemv_reference(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    from .fp8_block import fp8_block_linear

    return fp8_block_linear(x, w, scale, None, block=(bn, bk), compute_dtype=x.dtype)


@torch.library.custom_op("mpsboost::fp8_block_gemv", mutates_args=())
def _block_gemv_op(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    return _block_gemv_reference(x, w, scale, bn, bk)


@_block_gemv_op.register_kernel("mps")
def _block_gemv_mps(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    from . import fp8_metal

    y = fp8_metal.dense(x, w, scale, bn, bk)
    return _block_gemv_reference(x, w, scale, bn, bk) if y is None else y


@_block_gemv_op.register_kernel("cuda")
def _block_gemv_cuda(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    # The grouped kernel with one group of every row (how a simulated Mac's decisions run on a CUDA GPU).
    if not _have_triton() or w.dtype != torch.float8_e4m3fn:
        return _block_gemv_reference(x, w, scale, bn, bk)
    from . import fp8_triton

    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    offs = torch.full((1,), x2.shape[0], dtype=torch.int32, device=x.device)
    y = fp8_triton.grouped_gemv(x2, w.unsqueeze(0), offs, scale.unsqueeze(0), bn, bk)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], w.shape[0])


@_block_gemv_op.register_fake
def _block_gemv_fake(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], w.shape[0]))


def block_gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """``x [M, K] @ dequantize_block(w [N, K], scale, (bn, bk)).T`` in ``x.dtype`` for a few rows:
    ``torch.ops.mpsboost.fp8_block_gemv`` (MPS: mpsboost's Metal kernel, the file's block scales applied exactly in
    it; elsewhere the layer dequantised, then ``F.linear``)."""
    if _eager_mps(x):
        return _block_gemv_mps(x, w, scale, bn, bk)
    if _eager_cuda(x):
        return _block_gemv_cuda(x, w, scale, bn, bk)
    return torch.ops.mpsboost.fp8_block_gemv(x, w, scale, bn, bk)


@torch.library.custom_op("mpsboost::fp8_block_gemv_out", mutates_args=("out",))
def _block_gemv_out_op(
    x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bn: int, bk: int, out: torch.Tensor
) -> None:
    check_out_size(x, w.shape[0], out, "mpsboost::fp8_block_gemv_out")
    out.copy_(_block_gemv_reference(x, w, scale, bn, bk).view(out.shape))


@_block_gemv_out_op.register_kernel("cuda")
def _block_gemv_out_cuda(
    x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bn: int, bk: int, out: torch.Tensor
) -> None:
    check_out_size(x, w.shape[0], out, "mpsboost::fp8_block_gemv_out")
    out.copy_(_block_gemv_cuda(x, w, scale, bn, bk).view(out.shape))


@_block_gemv_out_op.register_kernel("mps")
def _block_gemv_out_mps(
    x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bn: int, bk: int, out: torch.Tensor
) -> None:
    from . import fp8_metal

    check_out_size(x, w.shape[0], out, "mpsboost::fp8_block_gemv_out")
    if fp8_metal.dense(x, w, scale, bn, bk, out=out) is None:
        out.copy_(_block_gemv_reference(x, w, scale, bn, bk).view(out.shape))


@_block_gemv_out_op.register_fake
def _block_gemv_out_fake(
    x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bn: int, bk: int, out: torch.Tensor
) -> None:
    return None


def block_gemv_out(
    x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bn: int, bk: int, out: torch.Tensor
) -> torch.Tensor:
    """:func:`block_gemv` written into ``out`` (``[M, N]``, e.g. the columns of a wider buffer)."""
    if _eager_mps(x):
        _block_gemv_out_mps(x, w, scale, bn, bk, out)
    else:
        torch.ops.mpsboost.fp8_block_gemv_out(x, w, scale, bn, bk, out)
    return out


# ------------------------------------------------------------------ what an eager decode step calls


class GemvOperand:
    """One fp8 linear's few-rows product by the fp8 GEMV (``torch.ops.mpsboost.fp8_gemv``: mpsboost's Metal kernel on
    MPS, its Triton kernel on CUDA), for an eager decode step that calls it every token: what the layer's own
    ``fused`` forward does at few rows, without its reshapes (a 2-D input in, a 2-D product out: one dispatch),
    and, with ``out=``, written straight into the caller's buffer (the columns a fused projection's product
    occupies); a contiguous input of more dims reads its leading dims as rows and keeps them in the product (no
    reshape dispatched). Other calls (more rows, another dtype) go to ``layer`` (any callable: the layer, or the
    projections a fused operand stands for, side by side). Rowwise or tensorwise scales, no
    bias. A recipe keeps it with its other eager constants and rebuilds it when the layer's codes or scales change
    (it watches them); traced code never sees it."""

    __slots__ = ("layer", "q", "scale", "max_rows", "dtype", "block")
    writes_out = True

    def __init__(
        self,
        layer: torch.nn.Module,
        q: torch.Tensor,
        scale: torch.Tensor,
        max_rows: int,
        dtype: torch.dtype,
        block: Optional[tuple[int, int]] = None,
    ):
        self.layer = layer
        self.q = q.detach()
        self.scale = scale.detach()
        self.max_rows = max_rows
        self.dtype = dtype
        self.block = block  # a file's block scales (bn, bk): torch.ops.mpsboost.fp8_block_gemv applies them

    def __call__(self, x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
        if (
            x.dtype != self.dtype
            or x.dim() < 2
            or not 0 < rows <= self.max_rows
            or (x.dim() > 2 and not x.is_contiguous())
        ):
            y = self.layer(x)
            return y if out is None else out.copy_(y.view(out.shape))
        if self.block is not None:
            bn, bk = self.block
            if out is None:
                return block_gemv(x, self.q, self.scale, bn, bk)
            return block_gemv_out(x, self.q, self.scale, bn, bk, out)
        if out is None:
            return fp8_gemv(x, self.q, self.scale, None)
        return fp8_gemv_out(x, self.q, self.scale, out)
