"""MLX's affine low-bit code for the quantized-weights package: the math is :mod:`mpsboost.ops.affine`'s (bit for
bit ``mx.quantize`` / ``mx.dequantize``, 2-8 bits, groups 32/64/128); here the package's adapters:

* :func:`quantize` works on slices of rows, so quantising a large stack (an experts layer) keeps a bounded float32
  scratch (about 16 MiB) instead of a float32 copy of the whole tensor;
* :func:`dequantize` is ``mx.dequantize`` (in the scales' dtype); :func:`dequantize_exact` computes
  ``scales * q + biases`` in float32 and rounds once to ``dtype``: what the layers' dequantise-then-matmul path
  uses (MLX's own Metal kernels never round the weight either: ``scale * sum(x * q) + bias * sum(x)`` in float32).
"""

from __future__ import annotations

import torch

from ..ops.affine import BITS, GROUP_SIZES, affine_dequantize, affine_quantize, pack_codes, unpack_codes

__all__ = [
    "BITS",
    "GROUP_SIZES",
    "quantize",
    "dequantize",
    "dequantize_exact",
    "pack",
    "unpack",
    "packed_width",
    "check_params",
]

_SCRATCH = 1 << 22  # float32 elements of one quantisation slice


def check_params(bits: int, group_size: int, what: str = "affine quantization") -> None:
    """Raise ValueError naming ``what`` when ``bits`` or ``group_size`` is not one MLX writes."""
    if not isinstance(bits, int) or isinstance(bits, bool) or bits not in BITS:
        raise ValueError(f"{what}: bits={bits!r}; MLX's affine mode takes bits in {list(BITS)}")
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size not in GROUP_SIZES:
        raise ValueError(f"{what}: group_size={group_size!r}; MLX's affine mode takes group sizes {list(GROUP_SIZES)}")


def packed_width(k: int, bits: int) -> int:
    """uint32 words of one row of ``k`` weights at ``bits``."""
    if (k * bits) % 32:
        raise ValueError(f"a row of {k} weights at {bits} bits is not a whole number of 32-bit words")
    return k * bits // 32


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    return pack_codes(codes, bits)


def unpack(q: torch.Tensor, bits: int) -> torch.Tensor:
    return unpack_codes(q, bits)


def quantize(w: torch.Tensor, bits: int = 4, group_size: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``mx.quantize(w, group_size, bits)``: ``(codes uint32 [..., K*bits/32], scales, biases [..., K/g])`` in
    ``w.dtype``, computed slice of rows by slice of rows (bounded scratch)."""
    check_params(bits, group_size)
    k = w.shape[-1]
    if k % group_size:
        raise ValueError(f"the last dimension {k} is not a multiple of group_size={group_size}")
    lead = w.shape[:-1]
    rows = w.reshape(-1, k)
    n = rows.shape[0]
    out_q = torch.empty(n, packed_width(k, bits), dtype=torch.uint32, device=w.device)
    out_s = torch.empty(n, k // group_size, dtype=w.dtype, device=w.device)
    out_b = torch.empty_like(out_s)
    step = max(1, _SCRATCH // max(1, k))
    for r0 in range(0, n, step):
        q, s, b = affine_quantize(rows[r0 : r0 + step], bits, group_size)
        out_q[r0 : r0 + step], out_s[r0 : r0 + step], out_b[r0 : r0 + step] = q, s, b
    return out_q.reshape(*lead, -1), out_s.reshape(*lead, -1), out_b.reshape(*lead, -1)


def dequantize(q, scales, biases, bits: int, group_size: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``mx.dequantize`` bit for bit (in the scales' dtype), then cast to ``dtype``."""
    return affine_dequantize(q, scales, biases, bits, group_size, dtype)


def dequantize_exact(q, scales, biases, bits: int, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """``scales * q + biases`` in float32 (exact for every code, scale and bias of the file), rounded once to
    ``dtype``."""
    return affine_dequantize(q, scales.float(), biases.float(), bits, group_size, dtype)
