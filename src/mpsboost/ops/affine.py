"""MLX's affine low-bit weights: quantise, dequantise and multiply, on every device.

Format (what ``mx.quantize(w, group_size, bits)`` returns and mlx-lm writes): a weight ``w [..., N, K]`` is cut
into groups of ``group_size`` (32, 64, 128) consecutive elements along K; each group has a ``scale`` and a ``bias``
(``[..., N, K / group_size]``, in the weight's dtype: float16, bfloat16 or float32) and each element a code
``q`` of ``bits`` bits (2, 3, 4, 5, 6 or 8), ``w ~= scale * q + bias``. The codes of a row form one little-endian
bit string: code ``j`` occupies bits ``[j * bits, (j + 1) * bits)`` of the row's bytes, stored as uint32 words
``[..., N, K * bits / 32]`` (at 4 bits, 8 codes a word, code 0 in the low nibble; at 3, 5 and 6 bits a code may
straddle two words).

Numerics (decided here, and what every path of this module computes):

* :func:`affine_dequantize` is MLX's dequantisation bit for bit: in the scales' dtype, ``q * scale`` rounded,
  then ``+ bias`` rounded (MLX's ``multiply`` then ``add``, mlx/ops.cpp ``affine_dequantize``), then cast to
  ``dtype``. With ``dtype`` the scales' dtype this is exactly ``mx.dequantize``.
* :func:`affine_quantize` is ``mx.quantize``'s affine mode bit for bit (mlx/backend/cpu/quantized.cpp
  ``quantize``: float32 min/max per group, ``scale = max((max - min) / (2^bits - 1), 1e-7)`` signed towards the
  edge of larger magnitude, the edge made exact (``scale = edge / round(edge / scale)``, ``bias = edge``), codes
  ``clip(rint((w - bias) / scale), 0, 2^bits - 1)`` with the float32 scale, scales and biases then rounded to the
  weight's dtype).
* The products (:func:`affine_gemv`, :func:`affine_grouped_gemv`; the reference path on the CPU, on CUDA and
  wherever the Metal kernel cannot take the tensors) are *dequantise then matmul*: the weight as
  :func:`affine_dequantize` gives it in ``x.dtype``, then torch's matmul (float32 sums on CPU and CUDA), the output
  rounded once. With float32 activations and weights that is what MLX's CPU ``quantized_matmul`` computes
  (``x * (scale * q + bias)`` in float32) up to the order of the sums.
* mpsboost's Metal kernel (:mod:`mpsboost.ops.affine_metal`, MPS) computes what MLX's own Metal ``qmv`` computes:
  per group ``scale * sum(x * q) + bias * sum(x)`` in float32 (the weight is never rounded): the exact product of
  the stored codes, scales and biases within the output's rounding (1e-5 of the output's largest magnitude for
  float32 activations, 2e-3 float16, 1e-2 bfloat16: what its tests and self-check hold it to). The reference path
  rounds each weight in the scales' dtype first, as ``mx.dequantize`` does; with bfloat16 scales that alone moves
  an output by up to about 1e-2 of the largest (a bias and ``q * scale`` that nearly cancel keep the rounding
  error of the larger), so the two paths agree to about 2e-2 at bfloat16 scales, 4e-3 at float16.
* :func:`affine_embedding` gathers rows and dequantises them exactly as :func:`affine_dequantize` does (the Metal
  kernel too: for float16 and bfloat16 scales bit for bit).

Registered operators (``torch.library.custom_op`` with fakes, so ``torch.compile(fullgraph=True)`` traces each as
one opaque call): ``mpsboost::affine_gemv``, ``mpsboost::affine_gemv_out`` (into a caller's buffer, e.g. the
columns of a wider one), ``mpsboost::affine_grouped_gemv`` (rows sorted by expert, int32 cumulative ends on the
device, as ``torch._grouped_mm`` takes them; no host synchronisation) and ``mpsboost::affine_embedding``. Their
MPS kernels run the Metal source (the low_bit_weights recipe chooses this path only where its patch-time verdict,
:func:`mpsboost.recipes.low_bit.paths.metal_verdict`, allowed it); elsewhere the reference above.

Also here: torch's own ``_weight_int4pack_mm`` / ``_weight_int8pack_mm`` fed from MLX's layout
(:func:`to_int4pack`, :func:`int4pack_linear`, :func:`to_int8pack`, :func:`int8pack_linear`), so that a Mac can
compare them. int4pack computes ``(q - 8) * scale + zero`` per group along K: MLX's 4-bit affine maps onto it with
the same codes and ``zero = bias + 8 * scale``, exact wherever that sum is representable in the activation dtype
(in float32 always, for float16/bfloat16 scales and biases; :func:`to_int4pack` counts the groups where it is not).
int8pack is one scale per output channel and no zero: MLX's 8-bit affine maps onto it exactly only if every
group of a row has the same scale and ``bias = -128 * scale``; otherwise :func:`to_int8pack` refuses, or, with
``exact=False``, requantises per channel (lossy: a timing stand-in, not the checkpoint's numbers).
:func:`torch_pack_for` says which of the two serves a layer's shape, :func:`gemv_contenders` makes one decode call
of torch's pack and one of mpsboost's Metal GEMV at a shape, for a patch-time timing (:mod:`mpsboost.ondevice`).

Tensor functions only: which path a layer takes is the recipe's (:mod:`mpsboost.recipes.low_bit.paths`). This module
never imports diffusers or transformers, nor anything of mpsboost outside ``ops/`` (its layout lives in
:mod:`.affine_codec`).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

__all__ = [
    "BITS",
    "GROUP_SIZES",
    "SCALE_DTYPES",
    "GEMV_MAX_ROWS",
    "packed_width",
    "unpack_codes",
    "pack_codes",
    "affine_dequantize",
    "affine_quantize",
    "affine_gemv",
    "affine_gemv_out",
    "affine_grouped_gemv",
    "affine_embedding",
    "affine_gemv_reference",
    "affine_grouped_gemv_reference",
    "affine_embedding_reference",
    "check_affine",
    "to_int4pack",
    "int4pack_linear",
    "to_int8pack",
    "int8pack_linear",
    "torch_pack_for",
    "gemv_contenders",
]

from .affine_codec import (  # noqa: F401 - re-exported: the layout lives in the leaf module
    BITS,
    GROUP_SIZES,
    SCALE_DTYPES,
    ACT_DTYPES,
    GEMV_MAX_ROWS,
    _CODE_DTYPES,
    packed_width,
    _k_of,
    _as_bytes,
    unpack_codes,
    pack_codes,
    _fail,
    check_affine,
    _check_x,
    _check_out,
    affine_dequantize,
    affine_quantize,
    take_rows,
)


# ------------------------------------------------------------------------------------------ references


def affine_gemv_reference(
    x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, bits: int, group_size: int
) -> torch.Tensor:
    """``x [..., K] @ W.T`` with ``W = affine_dequantize(q, scales, biases, dtype=x.dtype)``: torch's matmul
    (float32 sums), ``[..., N]`` in ``x.dtype``."""
    return F.linear(x, affine_dequantize(q, scales, biases, bits, group_size, x.dtype))


def _row_experts(offsets: torch.Tensor, m: int) -> torch.Tensor:
    """Each row's expert: the first ``e`` with ``row < offsets[e]``; ``E`` for rows past the last end."""
    rows = torch.arange(m, device=offsets.device, dtype=offsets.dtype)
    return torch.searchsorted(offsets, rows, right=True)


def affine_grouped_gemv_reference(
    x: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor,
    offsets: torch.Tensor,
    bits: int,
    group_size: int,
) -> torch.Tensor:
    """``y [M, N]``: row ``r`` times expert ``e(r)``'s dequantised weight (``e(r)`` the first ``e`` with
    ``r < offsets[e]``), rows at or past ``offsets[-1]`` zeros; nothing read on the host. For ``M <= E`` (decode)
    the rows' experts are gathered (``M`` dequantised weights) and multiplied by ``bmm``; for more rows the whole
    stack is dequantised once and ``torch._grouped_mm`` takes it with the same offsets."""
    m = x.shape[0]
    e, n, _ = q.shape
    eid = _row_experts(offsets, m)
    live = eid < e
    if m > e and hasattr(torch, "_grouped_mm"):
        w = affine_dequantize(q, scales, biases, bits, group_size, x.dtype)
        xc = x if x.is_contiguous() else x.contiguous()  # it refuses stride-0 or sliced rows
        y = torch._grouped_mm(xc, w.transpose(-2, -1), offs=offsets.to(torch.int32))
    else:
        sel = eid.clamp(max=e - 1)
        w = affine_dequantize(take_rows(q, sel), scales[sel], biases[sel], bits, group_size, x.dtype)  # [M, N, K]
        y = torch.bmm(w, x.unsqueeze(-1)).squeeze(-1)
    return torch.where(live.unsqueeze(-1), y, torch.zeros((), dtype=y.dtype, device=y.device))


def affine_embedding_reference(
    ids: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor,
    bits: int,
    group_size: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``[..., K]``: the rows ``ids`` of the quantized table dequantised (:func:`affine_dequantize`), only those
    rows read."""
    flat = ids.reshape(-1)
    w = affine_dequantize(take_rows(q, flat), scales[flat], biases[flat], bits, group_size, dtype)
    return w.reshape(*ids.shape, w.shape[-1])


# ------------------------------------------------------------------------------------------ operators


def _metal():
    from . import affine_metal

    return affine_metal


@torch.library.custom_op("mpsboost::affine_gemv", mutates_args=())
def _affine_gemv_op(
    x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, bits: int, group_size: int
) -> torch.Tensor:
    _check_x(x, check_affine(q, scales, biases, bits, group_size))
    return affine_gemv_reference(x, q, scales, biases, bits, group_size)


@_affine_gemv_op.register_kernel("mps")
def _affine_gemv_mps(
    x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, bits: int, group_size: int
) -> torch.Tensor:
    # mpsboost's Metal GEMV (mpsboost.ops.affine_metal): the codes read once as they are stored. The recipe chooses
    # this path only where its metal_verdict allowed it (compiled and checked on this Mac).
    am = _metal()
    if am.supported(x, q, scales, biases, bits, group_size) is not None:
        return affine_gemv_reference(x, q, scales, biases, bits, group_size)
    return am.rows_gemv(x, q, scales, biases, None, bits=bits, group_size=group_size)


@_affine_gemv_op.register_fake
def _affine_gemv_fake(
    x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, bits: int, group_size: int
) -> torch.Tensor:
    _check_x(x, check_affine(q, scales, biases, bits, group_size))
    return x.new_empty((*x.shape[:-1], q.shape[0]))


@torch.library.custom_op("mpsboost::affine_gemv_out", mutates_args=("out",))
def _affine_gemv_out_op(
    x: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor,
    bits: int,
    group_size: int,
    out: torch.Tensor,
) -> None:
    _check_x(x, check_affine(q, scales, biases, bits, group_size))
    _check_out(out, x, q.shape[0])
    out.copy_(affine_gemv_reference(x, q, scales, biases, bits, group_size).view(out.shape))


@_affine_gemv_out_op.register_kernel("mps")
def _affine_gemv_out_mps(
    x: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor,
    bits: int,
    group_size: int,
    out: torch.Tensor,
) -> None:
    am = _metal()
    if am.supported(x, q, scales, biases, bits, group_size, out=out) is not None:
        out.copy_(affine_gemv_reference(x, q, scales, biases, bits, group_size).view(out.shape))
    else:
        am.rows_gemv(x, q, scales, biases, None, bits=bits, group_size=group_size, out=out)


@_affine_gemv_out_op.register_fake
def _affine_gemv_out_fake(
    x: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor,
    bits: int,
    group_size: int,
    out: torch.Tensor,
) -> None:
    _check_x(x, check_affine(q, scales, biases, bits, group_size))
    _check_out(out, x, q.shape[0])
    return None


@torch.library.custom_op("mpsboost::affine_grouped_gemv", mutates_args=())
def _affine_grouped_op(
    x: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor,
    offsets: torch.Tensor,
    bits: int,
    group_size: int,
) -> torch.Tensor:
    _check_grouped(x, q, scales, biases, offsets, bits, group_size)
    return affine_grouped_gemv_reference(x, q, scales, biases, offsets, bits, group_size)


@_affine_grouped_op.register_kernel("mps")
def _affine_grouped_mps(
    x: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor,
    offsets: torch.Tensor,
    bits: int,
    group_size: int,
) -> torch.Tensor:
    am = _metal()
    if am.supported(x, q, scales, biases, bits, group_size) is not None:
        return affine_grouped_gemv_reference(x, q, scales, biases, offsets, bits, group_size)
    return am.rows_gemv(x, q, scales, biases, offsets, bits=bits, group_size=group_size)


def _check_grouped(x, q, scales, biases, offsets, bits, group_size) -> None:
    k = check_affine(q, scales, biases, bits, group_size, lead=1)
    _check_x(x, k)
    if x.dim() != 2:
        _fail(f"x of shape {tuple(x.shape)}: the grouped GEMV takes rows [M, K] sorted by expert")
    if offsets.dtype != torch.int32 or tuple(offsets.shape) != (q.shape[0],):
        _fail(
            f"offsets {offsets.dtype} {tuple(offsets.shape)}: expected int32 [{q.shape[0]}] (cumulative ends, as "
            "torch._grouped_mm takes them)"
        )
    if offsets.device != x.device or q.device != x.device:
        _fail(f"x on {x.device}, codes on {q.device}, offsets on {offsets.device}: expected one device")


@_affine_grouped_op.register_fake
def _affine_grouped_fake(
    x: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor,
    offsets: torch.Tensor,
    bits: int,
    group_size: int,
) -> torch.Tensor:
    _check_grouped(x, q, scales, biases, offsets, bits, group_size)
    return x.new_empty((x.shape[0], q.shape[1]))


@torch.library.custom_op("mpsboost::affine_embedding", mutates_args=())
def _affine_embedding_op(
    ids: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor,
    bits: int,
    group_size: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    _check_embedding(ids, q, scales, biases, bits, group_size, dtype)
    return affine_embedding_reference(ids, q, scales, biases, bits, group_size, dtype)


@_affine_embedding_op.register_kernel("mps")
def _affine_embedding_mps(
    ids: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor,
    bits: int,
    group_size: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    am = _metal()
    if am.embedding_supported(ids, q, scales, biases, bits, group_size, dtype) is not None:
        return affine_embedding_reference(ids, q, scales, biases, bits, group_size, dtype)
    return am.embedding(ids, q, scales, biases, bits=bits, group_size=group_size, dtype=dtype)


def _check_embedding(ids, q, scales, biases, bits, group_size, dtype) -> None:
    check_affine(q, scales, biases, bits, group_size)
    if ids.dtype not in (torch.int64, torch.int32):
        _fail(f"ids in {ids.dtype}: expected int64 or int32")
    if dtype not in ACT_DTYPES:
        _fail(f"dtype={dtype}: expected one of {ACT_DTYPES}")
    if ids.device != q.device:
        _fail(f"ids on {ids.device}, table on {q.device}: expected one device")


@_affine_embedding_op.register_fake
def _affine_embedding_fake(
    ids: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor,
    bits: int,
    group_size: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    _check_embedding(ids, q, scales, biases, bits, group_size, dtype)
    return q.new_empty((*ids.shape, _k_of(q, bits)), dtype=dtype)


def _eager_mps(x: torch.Tensor) -> bool:
    """Whether a call may go straight to the MPS kernel (eager, a plain MPS tensor, nothing to differentiate):
    the custom_op dispatcher costs about 20 us of host time a call, which a Mac's eager decode step pays per
    projection. Tracing, tensor subclasses and autograd still go through the registered operator."""
    return (
        not torch.compiler.is_compiling()
        and type(x) is torch.Tensor
        and x.device.type == "mps"
        and not (x.requires_grad and torch.is_grad_enabled())
    )


def affine_gemv(
    x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, bits: int, group_size: int
) -> torch.Tensor:
    """``x [..., K] @ W.T -> [..., N]`` in ``x.dtype`` for a quantized ``W`` (``q [N, K * bits / 32]``, scales and
    biases ``[N, K / group_size]``): ``torch.ops.mpsboost.affine_gemv``. Meant for a few rows (decode: 1-4)."""
    if _eager_mps(x):
        _check_x(x, check_affine(q, scales, biases, bits, group_size))
        return _affine_gemv_mps(x, q, scales, biases, bits, group_size)
    return torch.ops.mpsboost.affine_gemv(x, q, scales, biases, bits, group_size)


def affine_gemv_out(
    x: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor,
    bits: int,
    group_size: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """:func:`affine_gemv` written into ``out`` (``[R, N]`` with unit column stride and any row stride, e.g. the
    columns of a wider buffer; or contiguous ``[..., N]``): ``torch.ops.mpsboost.affine_gemv_out``. On MPS the
    Metal kernel writes there; elsewhere a copy."""
    if _eager_mps(x):
        _check_x(x, check_affine(q, scales, biases, bits, group_size))
        _check_out(out, x, q.shape[0])
        _affine_gemv_out_mps(x, q, scales, biases, bits, group_size, out)
    else:
        torch.ops.mpsboost.affine_gemv_out(x, q, scales, biases, bits, group_size, out)
    return out


def affine_grouped_gemv(
    x: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor,
    offsets: torch.Tensor,
    bits: int,
    group_size: int,
) -> torch.Tensor:
    """``y [M, N]``: rows of ``x [M, K]`` sorted by expert times their expert of ``q [E, N, Kw]`` (scales and
    biases ``[E, N, K / group_size]``), int32 ``offsets [E]`` the cumulative ends on the device; experts with no
    rows are never read, rows at or past ``offsets[-1]`` are zeros: ``torch.ops.mpsboost.affine_grouped_gemv``."""
    if _eager_mps(x):
        _check_grouped(x, q, scales, biases, offsets, bits, group_size)
        return _affine_grouped_mps(x, q, scales, biases, offsets, bits, group_size)
    return torch.ops.mpsboost.affine_grouped_gemv(x, q, scales, biases, offsets, bits, group_size)


def affine_embedding(
    ids: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor,
    bits: int,
    group_size: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``[..., K]`` in ``dtype``: the rows ``ids`` of a quantized embedding table ``q [V, Kw]`` dequantised exactly
    (:func:`affine_dequantize`): ``torch.ops.mpsboost.affine_embedding``. The Metal kernel writes zeros for an id
    outside ``[0, V)`` (it cannot raise without a host sync); the reference raises, as indexing does."""
    if _eager_mps(ids):
        _check_embedding(ids, q, scales, biases, bits, group_size, dtype)
        return _affine_embedding_mps(ids, q, scales, biases, bits, group_size, dtype)
    return torch.ops.mpsboost.affine_embedding(ids, q, scales, biases, bits, group_size, dtype)


# ------------------------------------------------------------------------------------------ torch's int4/int8 packs


def to_int4pack(
    q: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor,
    group_size: int,
    *,
    dtype: torch.dtype,
    device_type: str,
    inner_k_tiles: int = 2,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """MLX 4-bit affine ``(q [N, K / 8], scales, biases [N, K / g])`` as torch's int4pack operands for activations
    in ``dtype`` on ``device_type`` ("mps" or "cpu"): ``(packed, scale_and_zeros [K / g, N, 2], inexact)``.

    int4pack computes ``(c - 8) * scale + zero``; with the same codes ``c`` and ``zero = bias + 8 * scale`` that
    is MLX's ``scale * c + bias``. ``inexact`` counts the groups whose ``zero`` is not exactly representable in
    ``dtype`` (0 in float32 for float16/bfloat16 scales). Packing: on MPS ``_convert_weight_to_int4pack`` takes
    ``uint8 [N, K / 2]`` with the even code in the high nibble (it swaps them: its kernel then reads MLX's own
    byte order); on the CPU ``_convert_weight_to_int4pack_for_cpu`` takes the codes as int32 ``[N, K]``."""
    k = check_affine(q, scales, biases, 4, group_size)
    if q.dim() != 2:
        _fail("int4pack takes one 2-D weight")
    if device_type not in ("mps", "cpu"):
        _fail(f"device_type={device_type!r}: torch's int4pack has MPS and CPU kernels here ('mps', 'cpu')")
    if q.device.type != device_type:
        _fail(f"the codes are on {q.device.type}; int4pack for {device_type!r} packs them where its kernel reads them")
    dev = q.device
    # The zeros and the exactness count in float64 on the CPU (MPS has no float64); patch time only.
    s = scales.to("cpu", torch.float64)
    zero = biases.to("cpu", torch.float64) + 8.0 * s
    sz_t = torch.stack([scales.cpu().to(dtype), zero.to(dtype)], -1).transpose(0, 1).contiguous()  # [K/g, N, 2]
    inexact = int((sz_t[..., 1].double().transpose(0, 1) != zero).sum()) + int(
        (sz_t[..., 0].double().transpose(0, 1) != s).sum()
    )
    codes = unpack_codes(q, 4)  # [N, K]
    if device_type == "mps":
        by = (codes[:, 0::2] << 4) | codes[:, 1::2]
        packed = torch._convert_weight_to_int4pack(by.contiguous(), inner_k_tiles)
    else:
        packed = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), inner_k_tiles)
    del k
    return packed, sz_t.to(dev), inexact


def int4pack_linear(
    x: torch.Tensor, packed: torch.Tensor, scale_and_zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """``x [..., K] @ W.T`` by torch's ``_weight_int4pack_mm`` (MPS) / ``_weight_int4pack_mm_for_cpu`` (CPU)."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    if x.device.type == "cpu":
        y = torch._weight_int4pack_mm_for_cpu(x2, packed, group_size, scale_and_zeros)
    else:
        y = torch._weight_int4pack_mm(x2, packed, group_size, scale_and_zeros)
    return y.view(*x.shape[:-1], y.shape[-1])


def to_int8pack(
    q: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor,
    group_size: int,
    *,
    dtype: torch.dtype,
    exact: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MLX 8-bit affine as ``_weight_int8pack_mm``'s operands ``(int8 [N, K], scales [N] in dtype)``.

    int8pack has one scale per output channel and no zero point. MLX's ``scale * c + bias`` (``c`` in [0, 255])
    equals ``scale * (c - 128)`` exactly only where every group of a row has the same scale and
    ``bias = -128 * scale``; anything else raises :class:`mpsboost.errors.UserInputError`, unless
    ``exact=False``: then the dequantised weight is requantised symmetrically per channel (lossy; a timing
    stand-in for torch's kernel, not the checkpoint's numbers)."""
    check_affine(q, scales, biases, 8, group_size)
    codes = unpack_codes(q, 8)
    s = scales.to("cpu", torch.float64)  # the exactness checks in float64 on the CPU (MPS has no float64)
    same = bool((s == s[:, :1]).all()) and bool((biases.to("cpu", torch.float64) == -128.0 * s).all())
    # the kernel reads its scales in the activation dtype: a scale that rounds there is not the checkpoint's
    cast = scales[:, 0].to(dtype)
    if same and bool((cast.to("cpu", torch.float64) == s[:, 0]).all()):
        # contiguous: torch 2.13's CPU kernel reads a strided scales tensor as if it were contiguous
        return (codes.to(torch.int16) - 128).to(torch.int8), cast.contiguous()
    if exact and same:
        _fail(
            f"this 8-bit affine weight's scales ({scales.dtype}) do not all survive the cast to {dtype}, in which "
            "torch's _weight_int8pack_mm reads them (pass exact=False to requantise per channel, lossy)"
        )
    if exact:
        _fail(
            "this 8-bit affine weight has a scale per group of "
            f"{group_size} and a bias; torch's _weight_int8pack_mm takes one scale per output channel and no bias, "
            "so it cannot represent it (pass exact=False to requantise per channel, lossy)"
        )
    w = affine_dequantize(q, scales, biases, 8, group_size, torch.float32)
    sc = (w.abs().amax(-1) / 127.0).clamp_min(1e-12)
    w8 = torch.clamp(torch.round(w / sc[:, None]), -127, 127).to(torch.int8)
    return w8, sc.to(dtype)


def int8pack_linear(x: torch.Tensor, w8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x [..., K] @ (w8 * scales[:, None]).T`` by torch's ``_weight_int8pack_mm``."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    y = torch._weight_int8pack_mm(x2, w8.contiguous(), scales.contiguous())  # strides are ignored (CPU, 2.13)
    return y.view(*x.shape[:-1], y.shape[-1])


def torch_pack_for(bits: int, n: int, k: int, group_size: int, dtype: torch.dtype) -> tuple[Optional[str], str]:
    """Which of torch's own kernels takes an ``[n, k]`` MLX affine layer of ``bits`` with activations in ``dtype``:
    ``("int4pack", "")``, ``("int8pack", "")``, or ``(None, why not)``. Shapes only: whether an 8-bit layer's
    codes are representable is :func:`to_int8pack`'s (``exact=True``) to say, and a 4-bit layer's repack
    :func:`to_int4pack`'s (its ``inexact`` count). The rules are those of the kernels' own checks: int4pack (MPS:
    ``_weight_int4pack_mm``, a 4-D packed tensor of ``N / 8`` tiles, ``K`` a multiple of 32 with two inner K
    tiles, groups of 32-256; CPU: ``_weight_int4pack_mm_for_cpu``, ``N`` a multiple of 16), int8pack (MPS:
    ``N`` and ``K`` multiples of 32)."""
    if dtype not in ACT_DTYPES:
        return None, f"activations in {dtype}: torch's int4pack/int8pack take {', '.join(map(str, ACT_DTYPES))}"
    if bits == 4:
        if group_size not in (32, 64, 128, 256):
            return None, f"groups of {group_size}: torch's int4pack takes groups of 32, 64, 128 or 256"
        if n % 16 or k % 32:
            return None, f"[{n}, {k}]: torch's int4pack takes N a multiple of 16 and K a multiple of 32"
        return "int4pack", ""
    if bits == 8:
        if n % 32 or k % 32:
            return None, f"[{n}, {k}]: torch's int8pack (MPS) takes N and K multiples of 32"
        return "int8pack", ""
    return None, f"{bits}-bit: torch has int4pack and int8pack kernels only (4 and 8 bits)"


def gemv_contenders(
    n: int,
    k: int,
    bits: int,
    group_size: int,
    dtype: torch.dtype,
    *,
    rows: int = 1,
    device: str = "mps",
) -> tuple:
    """``(stock_run, metal_run)`` at one ``[n, k]`` layer's decode shape (``rows`` activations in ``dtype``), for
    :func:`mpsboost.ondevice.choose`: ``stock_run`` makes one product by torch's own kernel for ``bits``
    (:func:`int4pack_linear` at 4 bits, :func:`int8pack_linear` at 8), ``metal_run`` one by
    :func:`affine_gemv` (on MPS mpsboost's Metal GEMV; elsewhere its reference), both from the same random codes,
    scales and biases on ``device`` (at 8 bits codes that int8pack represents exactly: one scale a row,
    ``bias = -128 * scale``), made at the first call: nothing is allocated where nothing is timed. The Metal
    kernel's correctness is its self-check's, taken before this is asked."""
    if bits not in (4, 8):
        _fail(f"bits={bits}: torch's packs are int4pack (4 bits) and int8pack (8 bits)")
    made: list[tuple] = []

    def inputs() -> tuple:
        if not made:
            g = torch.Generator().manual_seed(0)
            x = torch.randn(rows, k, generator=g).to(dtype)
            if bits == 4:
                q, s, b = affine_quantize((torch.randn(n, k, generator=g) * 0.05).to(dtype), 4, group_size)
            else:
                codes = torch.randint(0, 256, (n, k), generator=g)
                s = (torch.rand(n, 1, generator=g) * 1e-3 + 1e-4).to(dtype).expand(n, k // group_size).contiguous()
                q, b = pack_codes(codes, 8), -128 * s
            dev = torch.device(device)
            q, s, b, x = q.to(dev), s.to(dev), b.to(dev), x.to(dev)
            if bits == 4:
                packed, sz, _ = to_int4pack(q, s, b, group_size, dtype=dtype, device_type=dev.type)
                pack = (packed, sz)
            else:
                pack = to_int8pack(q, s, b, group_size, dtype=dtype)
            made.append((x, q, s, b, pack))
        return made[0]

    def stock() -> torch.Tensor:
        x, _, _, _, pack = inputs()
        return int4pack_linear(x, *pack, group_size) if bits == 4 else int8pack_linear(x, *pack)

    def metal() -> torch.Tensor:
        x, q, s, b, _ = inputs()
        return affine_gemv(x, q, s, b, bits, group_size)

    return stock, metal
