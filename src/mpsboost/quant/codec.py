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

from ..ops.affine import BITS, GROUP_SIZES, affine_dequantize, pack_codes, unpack_codes
from ..recipes.low_bit.layers import check_params, quantize

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


def packed_width(k: int, bits: int) -> int:
    """uint32 words of one row of ``k`` weights at ``bits``."""
    if (k * bits) % 32:
        raise ValueError(f"a row of {k} weights at {bits} bits is not a whole number of 32-bit words")
    return k * bits // 32


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    return pack_codes(codes, bits)


def unpack(q: torch.Tensor, bits: int) -> torch.Tensor:
    return unpack_codes(q, bits)


def dequantize(q, scales, biases, bits: int, group_size: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``mx.dequantize`` bit for bit (in the scales' dtype), then cast to ``dtype``."""
    return affine_dequantize(q, scales, biases, bits, group_size, dtype)


def dequantize_exact(q, scales, biases, bits: int, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """``scales * q + biases`` in float32 (exact for every code, scale and bias of the file), rounded once to
    ``dtype``."""
    return affine_dequantize(q, scales.float(), biases.float(), bits, group_size, dtype)
