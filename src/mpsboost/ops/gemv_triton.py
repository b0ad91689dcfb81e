"""A Triton matrix-vector kernel for one-token ``F.linear`` on CUDA, bias fused into the epilogue.

``y[0, n] = sum_k x[0, k] * W[n, k] + b[n]`` for a ``[1, K]`` activation and an ``[N, K]`` weight in the
``nn.Linear`` layout (``x @ W.t()``). Each program owns ``BLOCK_N`` output features and streams their rows
of W once, accumulating in fp32; the bias is added in fp32 before the single rounding to the output
dtype, as cuBLAS's bias epilogue does.

The kernel is the registered operator ``torch.ops.mpsboost.gemv``, so that ``torch.compile`` sees one
opaque call with a known output shape (``register_fake``) instead of tracing into a Triton launch: its
CUDA kernel launches Triton, every other device runs a plain-torch reference with the same numerics
(fp32 accumulation, bias in fp32, one rounding). CI compiles the CUDA path forced onto CPU tensors.

Whether this kernel is used for a layer, and its launch width (``block_n``, from :func:`block_n_for` and the
number of programs the GPU wants in flight), are the decode_linear recipe's decisions from measurements
(the tuning file ``decode_linear_gemv``); they arrive here as arguments.

Importing this module never imports triton; the kernel is built on first use.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
import torch.nn.functional as F

__all__ = ["gemv", "gemv_reference", "block_n_for"]

_BLOCK_K = 512
_NUM_WARPS = 4


def block_n_for(n: int, programs: int) -> int:
    """Output features per program: the largest power of two up to 16 that still launches at least
    ``programs`` programs (e.g. two per SM, to keep enough bytes in flight on every SM)."""
    block = 16
    while block > 1 and -(-n // block) < programs:
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


def gemv_reference(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The kernel's numerics in plain torch: fp32 products and sums, bias in fp32, one rounding."""
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], block_n: int) -> torch.Tensor:
    n, k = weight.shape
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
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


@torch.library.custom_op("mpsboost::gemv", mutates_args=())
def _gemv_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], block_n: int) -> torch.Tensor:
    # Every device but CUDA (and CUDA paths forced onto CPU tensors in tests): the reference.
    return gemv_reference(x, weight, bias)


@_gemv_op.register_kernel("cuda")
def _gemv_cuda(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], block_n: int) -> torch.Tensor:
    return _launch(x.contiguous(), weight, bias, block_n)


@_gemv_op.register_fake
def _gemv_fake(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], block_n: int) -> torch.Tensor:
    return x.new_empty((1, weight.shape[0]))


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], block_n: int) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` of shape ``[1, K]`` (one token): ``torch.ops.mpsboost.gemv``,
    ``block_n`` output features per program (:func:`block_n_for`; the reference on other devices ignores it).

    The caller checks the preconditions (one floating dtype, each weight row contiguous, no autograd);
    they are not re-checked here because this runs once per layer per token. Traceable by torch.compile.
    """
    return torch.ops.mpsboost.gemv(x, weight, bias, block_n)
