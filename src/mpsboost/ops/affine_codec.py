"""MLX's affine low-bit layout: the code packing, the checks, the quantiser and the exact dequantisation (equal to
``mx.quantize`` / ``mx.dequantize`` bit for bit). A leaf of ``mpsboost.ops``: the operators (:mod:`.affine`) and the
Metal kernel's self-check (:mod:`.affine_metal`) both read it, and it imports neither of them."""

from __future__ import annotations

from typing import Optional

import math

import torch

from ..errors import UserInputError

BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
GEMV_MAX_ROWS = 4  # rows the Metal GEMV is laid out for (decode); it takes more, re-reading the weight per 4
_CODE_DTYPES = (torch.uint32, torch.int32)  # safetensors' U32 (MLX's dtype); int32 holds the same bits


# ------------------------------------------------------------------------------------------ layout


def packed_width(k: int, bits: int) -> int:
    """uint32 words of one row of ``k`` codes at ``bits`` bits."""
    return k * bits // 32


def _k_of(q: torch.Tensor, bits: int) -> int:
    return q.shape[-1] * 32 // bits


def _as_bytes(q: torch.Tensor) -> torch.Tensor:
    """The codes' words as their little-endian bytes ``[..., Kw * 4]`` (a view where ``q`` is contiguous)."""
    return q.contiguous().view(torch.uint8)


def unpack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """The codes ``[..., K]`` (uint8) of packed words ``q [..., K * bits / 32]``: code ``j`` is bits
    ``[j * bits, (j + 1) * bits)`` of the row's little-endian bytes. At 2, 4 and 8 bits a byte holds whole codes,
    low bits first, and is cut in uint8; otherwise eight codes fill ``bits`` bytes exactly, so each run of ``bits``
    bytes is read as one little-endian integer and cut into eight codes."""
    by = _as_bytes(q)
    lead = by.shape[:-1]
    if 8 % bits == 0:
        if bits == 8:
            return by.clone()
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=q.device)
        return (by.unsqueeze(-1) >> shifts).bitwise_and_((1 << bits) - 1).reshape(*lead, -1)
    by = by.to(torch.int64).reshape(*lead, -1, bits)  # [..., K / 8, bits]: eight codes
    word = (by << (8 * torch.arange(bits, device=q.device))).sum(-1, keepdim=True)  # <= 64 bits: fits int64
    shifts = bits * torch.arange(8, device=q.device)
    codes = (word >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*lead, -1).to(torch.uint8)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of :func:`unpack_codes`: integer codes ``[..., K]`` in ``[0, 2^bits)`` as uint32 words
    ``[..., K * bits / 32]`` (K a multiple of 32)."""
    lead = codes.shape[:-1]
    if 8 % bits == 0:  # whole codes a byte: OR them into uint8, low bits first
        c = codes.to(torch.uint8).reshape(*lead, -1, 8 // bits)
        by = c[..., 0].clone()
        for j in range(1, 8 // bits):
            by |= c[..., j] << (j * bits)
        return by.reshape(*lead, -1).view(torch.uint32)
    c = codes.to(torch.int64)
    c = c.reshape(*lead, -1, 8)
    word = (c << (bits * torch.arange(8, device=c.device))).sum(-1, keepdim=True)
    by = (word >> (8 * torch.arange(bits, device=c.device))) & 0xFF
    return by.to(torch.uint8).reshape(*lead, -1).view(torch.uint32)


# ------------------------------------------------------------------------------------------ checks


def _fail(what: str) -> None:
    raise UserInputError(what)


def check_affine(
    q: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, bits: int, group_size: int, *, lead: int = 0
) -> int:
    """Validate one quantized weight (``lead`` extra leading dims before ``[N, Kw]``, e.g. 1 for an expert stack)
    and return K. Raises :class:`mpsboost.errors.UserInputError` saying what was passed and what is accepted."""
    if bits not in BITS:
        _fail(f"bits={bits!r}: MLX's affine format has bits {BITS}")
    if group_size not in GROUP_SIZES:
        _fail(f"group_size={group_size!r}: MLX's affine format has group sizes {GROUP_SIZES}")
    if q.dtype not in _CODE_DTYPES:
        _fail(f"codes in {q.dtype}: expected uint32 words (MLX's layout; int32 with the same bits is accepted)")
    if q.dim() != 2 + lead:
        _fail(f"codes of shape {tuple(q.shape)}: expected {2 + lead} dims ({'[E, N, Kw]' if lead else '[N, Kw]'})")
    if scales.dtype not in SCALE_DTYPES or biases.dtype != scales.dtype:
        _fail(f"scales in {scales.dtype}, biases in {biases.dtype}: expected one of {SCALE_DTYPES}, the same for both")
    if (q.shape[-1] * 32) % bits:
        _fail(f"codes of {q.shape[-1]} words a row do not hold a whole number of {bits}-bit codes")
    k = _k_of(q, bits)
    want = (*q.shape[:-1], k // group_size)
    if k % group_size or tuple(scales.shape) != want or tuple(biases.shape) != want:
        _fail(
            f"scales {tuple(scales.shape)} and biases {tuple(biases.shape)} for codes {tuple(q.shape)} at bits={bits}, "
            f"group_size={group_size}: expected both {want} (K={k} a multiple of the group size)"
        )
    if q.device != scales.device or q.device != biases.device:
        _fail(f"codes on {q.device}, scales on {scales.device}, biases on {biases.device}: expected one device")
    return k


def _check_x(x: torch.Tensor, k: int, what: str = "x") -> None:
    if x.dtype not in ACT_DTYPES:
        _fail(f"{what} in {x.dtype}: expected one of {ACT_DTYPES}")
    if x.dim() < 1 or x.shape[-1] != k:
        _fail(f"{what} of shape {tuple(x.shape)}: expected [..., {k}] (K of the quantized weight)")


def _out_shape_ok(out: torch.Tensor, rows: int, n: int) -> bool:
    return (out.dim() == 2 and tuple(out.shape) == (rows, n)) or (out.numel() == rows * n and out.shape[-1] == n)


def _out_strides_ok(out: torch.Tensor, n: int) -> bool:
    return not (out.dim() == 2 and n > 1 and out.stride(1) != 1 or out.dim() != 2 and not out.is_contiguous())


def out_fits(out: torch.Tensor, x: torch.Tensor, n: int) -> bool:
    """Whether ``affine_gemv_out`` takes ``out`` for ``x`` and ``n`` output features (what :func:`_check_out`
    checks): x's dtype and device, ``[rows, n]`` with unit column stride or contiguous ``[..., n]``."""
    rows = math.prod(x.shape[:-1])
    return out.dtype == x.dtype and out.device == x.device and _out_shape_ok(out, rows, n) and _out_strides_ok(out, n)


def _check_out(out: torch.Tensor, x: torch.Tensor, n: int) -> None:
    rows = math.prod(x.shape[:-1])
    if out.dtype != x.dtype:
        _fail(f"out in {out.dtype}: expected x's dtype {x.dtype}")
    if out.device != x.device:
        _fail(f"out on {out.device}: expected x's device {x.device}")
    if not _out_shape_ok(out, rows, n):
        _fail(f"out of shape {tuple(out.shape)}: expected [{rows}, {n}] (x's rows by N) or [..., {n}] of {rows * n}")
    if not _out_strides_ok(out, n):
        _fail(f"out with strides {out.stride()}: expected unit column stride (any row stride) or contiguous")


# ------------------------------------------------------------------------------------------ quantise


def affine_dequantize(
    q: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor,
    bits: int,
    group_size: int,
    dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """``[..., N, K]`` in ``dtype`` (default the scales' dtype): ``mx.dequantize(q, scales, biases, group_size,
    bits)`` bit for bit, then cast. In the scales' dtype: ``q * scale`` rounded, then ``+ bias`` rounded."""
    check_affine(q, scales, biases, bits, group_size, lead=q.dim() - 2)
    codes = unpack_codes(q, bits).to(scales.dtype)
    lead = codes.shape[:-1]
    g = codes.reshape(*lead, -1, group_size)
    # In place in the fresh copy of the codes: the same two roundings as ``g * scale + bias``.
    w = g.mul_(scales.unsqueeze(-1)).add_(biases.unsqueeze(-1)).reshape(*lead, -1)
    return w if dtype is None or dtype == w.dtype else w.to(dtype)


def affine_quantize(w: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q uint32 [..., N, K * bits / 32], scales, biases [..., N, K / group_size])`` equal to
    ``mx.quantize(w, group_size, bits)`` bit for bit (``w`` float16, bfloat16 or float32, 2 or more dims, K a
    multiple of ``group_size``); the scales and biases in ``w.dtype``."""
    if bits not in BITS:
        _fail(f"bits={bits!r}: MLX's affine format has bits {BITS}")
    if group_size not in GROUP_SIZES:
        _fail(f"group_size={group_size!r}: MLX's affine format has group sizes {GROUP_SIZES}")
    if w.dtype not in SCALE_DTYPES:
        _fail(f"weight in {w.dtype}: expected one of {SCALE_DTYPES}")
    if w.dim() < 2 or w.shape[-1] % group_size:
        _fail(f"weight of shape {tuple(w.shape)}: expected 2 or more dims, the last a multiple of {group_size}")
    n_bins = float((1 << bits) - 1)
    lead = w.shape[:-1]
    g = w.reshape(*lead, -1, group_size)
    # A float32 work copy, never the caller's weight: the codes are computed in it, in place (one tensor of the
    # weight's size at 4 bytes an element, where each step of the same arithmetic out of place would add one).
    g = g.float() if g.dtype != torch.float32 else g.clone()
    w_min, w_max = torch.aminmax(g, dim=-1, keepdim=True)
    mask = w_min.abs() > w_max.abs()
    scale = torch.clamp_min((w_max - w_min) / n_bins, 1e-7)
    scale = torch.where(mask, scale, -scale)
    edge = torch.where(mask, w_min, w_max)
    q0 = torch.round(edge / scale)  # rint: ties to even, as std::rint
    nz = q0 != 0
    scale = torch.where(nz, edge / torch.where(nz, q0, torch.ones_like(q0)), scale)
    bias = torch.where(nz, edge, torch.zeros_like(edge))
    codes = g.sub_(bias).div_(scale).round_().clamp_(0, n_bins)
    q = pack_codes(codes.reshape(*lead, -1).to(torch.uint8), bits)
    return q, scale.squeeze(-1).to(w.dtype), bias.squeeze(-1).to(w.dtype)


def take_rows(q: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``q[idx]`` for codes of any dtype: uint32 words are gathered through their int32 view (the same bits), since
    torch's CUDA (and older MPS) index kernels have no uint32 case."""
    if q.dtype == torch.uint32:
        return q.view(torch.int32)[idx].view(torch.uint32)
    return q[idx]
