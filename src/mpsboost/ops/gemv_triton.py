"""A Triton matrix-vector kernel for one-token ``F.linear`` on CUDA, bias fused into the epilogue.

``y[0, n] = sum_k x[0, k] * W[n, k] + b[n]`` for a ``[1, K]`` activation and an ``[N, K]`` weight in the
``nn.Linear`` layout (``x @ W.t()``). Each program owns ``BLOCK_N`` output features and streams their rows
of W once, accumulating in fp32; the bias is added in fp32 before the single rounding to the output
dtype, as cuBLAS's bias epilogue does.

The kernel is the registered operator ``torch.ops.mpsboost.gemv``, so that ``torch.compile`` sees one
opaque call with a known output shape (``register_fake``) instead of tracing into a Triton launch: its
CUDA kernel launches Triton, every other device runs a plain-torch reference with the same numerics
(fp32 accumulation, bias in fp32, one rounding). CI compiles the CUDA path forced onto CPU tensors.

Whether this kernel is used for a layer is decided from measurements, never assumed: cuBLAS is already
close to the bandwidth limit for large layers (one-token bf16 ``F.linear`` timed by CUDA-graph replay on an H200:
75-100% of the copy bandwidth from 4096x4096 up, 39-53% for the smallest layers), so
the kernel can only win where cuBLAS leaves bandwidth unused (small and medium layers). The shapes where
it won, per execution mode, are the tuning file ``decode_linear_gemv`` (:mod:`mpsboost.tuning`); every
other shape keeps cuBLAS.

Importing this module never imports triton; the kernel is built on first use.
"""
from __future__ import annotations

import functools
import importlib.util
from typing import Any, Optional

import torch
import torch.nn.functional as F

from .. import tuning
from ..gate import Env

__all__ = [
    "TUNING",
    "triton_available",
    "gemv",
    "gemv_reference",
    "block_n_for",
    "measured",
    "measured_speedup",
    "MIN_SPEEDUP",
]

# The tuning file (mpsboost/data/tuning/decode_linear_gemv.json): per mode, the layer shapes where the
# kernel measured at least its ``min_speedup`` faster than cuBLAS, on the device it names.
TUNING = "decode_linear_gemv"
# Below this the difference was within the spread of repeated timings: not worth an extra kernel.
MIN_SPEEDUP = 1.05


def measured(env: Env, mode: str) -> tuple[dict[tuple[int, int, bool, str], float] | None, str]:
    """``({(N, K, has_bias, dtype name): speedup}, "")`` measured in ``mode`` for this kind of GPU.

    ``mode`` is ``"cuda_graph"`` (eager decode replayed as CUDA graphs) or ``"compiled"`` (the forward
    under ``torch.compile``). ``(None, why)`` where the file speaks for another device. Patch time only.
    """
    t, why = tuning.for_env(TUNING, env)
    if t is None:
        return None, why
    rows = t.entries.get(mode, [])
    table = {(int(r["n"]), int(r["k"]), bool(r["bias"]), str(r["dtype"])): float(r["speedup"]) for r in rows}
    return table, t.describe()


def measured_speedup(n: int, k: int, has_bias: bool, dtype: torch.dtype | str, *, mode: str = "cuda_graph",
                     env: Env | None = None) -> float | None:
    """The speedup measured for this shape in ``mode`` (default: the file's own device), or None."""
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if env is None:
        t = tuning.load(TUNING)
        env = Env.simulate(t.device_type, t.torch, capability=t.capability)
    table, _ = measured(env, mode)
    return None if table is None else table.get((int(n), int(k), bool(has_bias), name))


_SMS_TARGET = 264  # two programs per SM on an H200 (132 SMs): enough bytes in flight per SM
_BLOCK_K = 512
_NUM_WARPS = 4


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


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


def gemv_reference(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The kernel's numerics in plain torch: fp32 products and sums, bias in fp32, one rounding."""
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
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


@torch.library.custom_op("mpsboost::gemv", mutates_args=())
def _gemv_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    # Every device but CUDA (and CUDA paths forced onto CPU tensors in tests): the reference.
    return gemv_reference(x, weight, bias)


@_gemv_op.register_kernel("cuda")
def _gemv_cuda(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return _launch(x.contiguous(), weight, bias)


@_gemv_op.register_fake
def _gemv_fake(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return x.new_empty((1, weight.shape[0]))


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` of shape ``[1, K]`` (one token): ``torch.ops.mpsboost.gemv``.

    The caller checks the preconditions (one floating dtype, each weight row contiguous, no autograd);
    they are not re-checked here because this runs once per layer per token. Traceable by torch.compile.
    """
    return torch.ops.mpsboost.gemv(x, weight, bias)
