"""A Triton matrix-vector kernel for one-token ``F.linear`` on CUDA, bias fused into the epilogue.

``y[0, n] = sum_k x[0, k] * W[n, k] + b[n]`` for a ``[1, K]`` activation and an ``[N, K]`` weight in the
``nn.Linear`` layout (``x @ W.t()``). Each program owns ``BLOCK_N`` output features and streams their rows
of W once, accumulating in fp32; the bias is added in fp32 before the single rounding to the output
dtype, as cuBLAS's bias epilogue does.

Whether this kernel is used for a layer is decided from measurements, never assumed: cuBLAS is already
close to the bandwidth limit for large layers (FACTS: 75-100% of copy bandwidth from 4096x4096 up), so
the kernel can only win where cuBLAS leaves bandwidth unused (small and medium layers). The shapes where
it won on the H200 are listed in :data:`MEASURED` together with the file of records they come from;
every other shape keeps cuBLAS.

Importing this module never imports triton; the kernel is built on first use.
"""
from __future__ import annotations

import functools
import importlib.util
from typing import Any, Mapping

import torch

__all__ = [
    "triton_available",
    "gemv",
    "block_n_for",
    "MEASURED",
    "MEASURED_SOURCE",
    "MEASURED_CAPABILITY",
    "measured_speedup",
    "MIN_SPEEDUP",
]

# A layer gets the Triton kernel only where the H200 measurement (CUDA-graph replay, weights rotated
# beyond L2) showed it at least this much faster than cuBLAS: below that the difference is within the
# spread of repeated timings, and an extra Python-launched kernel is not worth it.
MIN_SPEEDUP = 1.05

# (N, K, has_bias, dtype name) -> measured speedup over cuBLAS (CUDA-graph replay, H200 sm_90, weights
# rotated beyond L2), from the records named by MEASURED_SOURCE: the shapes at least MIN_SPEEDUP faster in
# both independent halves of the timing (the smaller of the two is kept). 24 of the 96 shapes, all with
# N <= 5120 and weights <= 25 MB, where cuBLAS reached 2-60% of the bandwidth limit. The large layers
# (lm_heads, 8192x8192) looked 1.10-1.16x faster in the first half only (cuBLAS timed first after
# allocation) and 0.97-1.01x in the second: they keep cuBLAS.
MEASURED: Mapping[tuple[int, int, bool, str], float] = {
    (128, 896, True, 'bfloat16'): 1.9,
    (256, 1536, True, 'bfloat16'): 1.96,
    (512, 2048, False, 'bfloat16'): 1.95,
    (512, 2880, True, 'bfloat16'): 1.93,
    (512, 3584, True, 'bfloat16'): 1.85,
    (768, 2048, False, 'bfloat16'): 1.85,
    (896, 896, False, 'bfloat16'): 1.68,
    (896, 896, True, 'bfloat16'): 1.65,
    (1024, 1024, False, 'bfloat16'): 2.6,
    (1024, 2048, False, 'bfloat16'): 3.02,
    (1024, 2304, False, 'bfloat16'): 2.67,
    (1024, 2560, False, 'bfloat16'): 2.86,
    (1024, 3072, False, 'bfloat16'): 1.33,
    (1024, 4096, False, 'bfloat16'): 1.11,
    (1536, 256, True, 'bfloat16'): 1.43,
    (1536, 1536, False, 'bfloat16'): 1.62,
    (1536, 1536, True, 'bfloat16'): 1.56,
    (2048, 768, False, 'bfloat16'): 1.3,
    (2048, 1024, False, 'bfloat16'): 1.32,
    (2048, 2048, False, 'bfloat16'): 1.2,
    (2048, 2304, False, 'bfloat16'): 1.12,
    (2048, 4096, False, 'bfloat16'): 1.15,
    (2048, 6144, False, 'bfloat16'): 1.05,
    (5120, 256, True, 'bfloat16'): 1.21,
}
MEASURED_SOURCE = "benchmarks/results/decode_linear-cuda-2026-11-29.jsonl"
MEASURED_CAPABILITY = (9, 0)

_SMS_TARGET = 264  # two programs per SM on an H200 (132 SMs): enough bytes in flight per SM
_BLOCK_K = 512
_NUM_WARPS = 4


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def measured_speedup(n: int, k: int, has_bias: bool, dtype: torch.dtype | str) -> float | None:
    """The speedup measured for this shape on the H200, or None if it was not among the winners."""
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    return MEASURED.get((int(n), int(k), bool(has_bias), name))


def block_n_for(n: int) -> int:
    """Output features per program: the largest power of two up to 16 that still gives every SM work."""
    block = 16
    while block > 1 and -(-n // block) < _SMS_TARGET:
        block //= 2
    return block


@functools.lru_cache(maxsize=None)
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def _gemv_kernel(
        x_ptr,
        w_ptr,
        b_ptr,
        y_ptr,
        N,
        K,
        stride_wn,
        HAS_BIAS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        # A 2-D fp32 accumulator: one reduction over K at the end instead of one per tile.
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            x = tl.load(x_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            w = tl.load(
                w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :],
                mask=mask_n[:, None] & mask_k[None, :],
                other=0.0,
                eviction_policy="evict_first",  # each weight byte is read exactly once
            )
            acc += w.to(tl.float32) * x[None, :]
        y = tl.sum(acc, axis=1)
        if HAS_BIAS:
            y += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=mask_n)

    return _gemv_kernel


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` of shape ``[1, K]`` (one token) by the Triton kernel.

    The caller checks the preconditions (CUDA tensors of one floating dtype, ``x`` and each weight row
    contiguous, no autograd); they are not re-checked here because this runs once per layer per token.
    """
    n, k = weight.shape
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    block_n = block_n_for(n)
    _kernel()[(-(-n // block_n),)](
        x,
        weight,
        bias if bias is not None else weight,  # never read when HAS_BIAS is False
        y,
        n,
        k,
        weight.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_N=block_n,
        BLOCK_K=_BLOCK_K,
        num_warps=_NUM_WARPS,
    )
    return y
