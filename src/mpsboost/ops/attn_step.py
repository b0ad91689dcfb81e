"""The registered operator of an attention layer's decode step after its projections:
``mpsboost::attn_qk_rope_cache`` (q/k RMS norm, rotary, and optionally the K/V write into a preallocated cache),
one call where the composed step takes about fourteen aten ops.

* CPU, CUDA and anything but MPS: the composed reference (:mod:`mpsboost.ops.attn_ref`) runs as the operator's
  implementation: one registered call to whatever counts dispatches;
* MPS: mpsboost's Metal kernel (:mod:`mpsboost.ops.attn_metal`) where it takes the operands, else the reference.

The operator declares the caches it writes (``k_cache``, ``v_cache``: ``Tensor(a!)?``) and has a fake, so
``torch.compile(fullgraph=True)`` traces through it as one opaque call. Its outputs ``q [B, hq, 1, D]`` and
``k [B, hkv, 1, D]`` are contiguous: SDPA takes them with no copy (pytorch#163597: MPS SDPA on strided inputs).

Whether a model takes it on a Mac is decided by timing (:func:`timing_pair`, through ``mpsboost.ondevice.choose``
in the attention_decode recipe); ``ops`` imports nothing of mpsboost's recipes.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from . import attn_ref
from .attn_ref import MODES, cache_write_reference, qk_rope_reference

__all__ = ["MODES", "qk_rope_cache", "composed", "timing_pair"]


def _metal():
    from . import attn_metal

    return attn_metal


@torch.library.custom_op("mpsboost::attn_qk_rope_cache", mutates_args=("k_cache", "v_cache"))
def _op(
    y: torch.Tensor,
    wq: Optional[torch.Tensor],
    wk: Optional[torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    v: Optional[torch.Tensor],
    k_cache: Optional[torch.Tensor],
    v_cache: Optional[torch.Tensor],
    pos: Optional[torch.Tensor],
    hq: int,
    hkv: int,
    d: int,
    q_stride: int,
    eps: float,
    mode: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    q, k = qk_rope_reference(y, wq, wk, cos, sin, hq, hkv, d, q_stride, eps, mode)
    if k_cache is not None:
        cache_write_reference(k, v.view(y.shape[0], hkv, 1, d), k_cache, v_cache, pos)
    return q, k


@_op.register_kernel("mps")
def _op_mps(y, wq, wk, cos, sin, v, k_cache, v_cache, pos, hq, hkv, d, q_stride, eps, mode):
    am = _metal()
    if am.supported(y, cos, hq, hkv, d, q_stride, v, k_cache, v_cache) is not None:
        q, k = qk_rope_reference(y, wq, wk, cos, sin, hq, hkv, d, q_stride, eps, mode)
        if k_cache is not None:
            cache_write_reference(k, v.view(y.shape[0], hkv, 1, d), k_cache, v_cache, pos)
        return q, k
    return am.qk_rope(y, wq, wk, cos, sin, hq, hkv, d, q_stride, eps, mode, v, k_cache, v_cache, pos)


@_op.register_fake
def _op_fake(y, wq, wk, cos, sin, v, k_cache, v_cache, pos, hq, hkv, d, q_stride, eps, mode):
    b = y.shape[0]
    return y.new_empty((b, hq, 1, d)), y.new_empty((b, hkv, 1, d))


def qk_rope_cache(
    y: torch.Tensor,
    wq: Optional[torch.Tensor],
    wk: Optional[torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    hq: int,
    hkv: int,
    d: int,
    q_stride: int,
    eps: float,
    mode: int,
    v: Optional[torch.Tensor] = None,
    k_cache: Optional[torch.Tensor] = None,
    v_cache: Optional[torch.Tensor] = None,
    pos: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [B, hq, 1, D], k [B, hkv, 1, D])`` normed and rotated, contiguous; with ``k_cache``/``v_cache``
    ``[B, hkv, S, D]`` and ``pos`` (int64 ``[1]`` on their device), the token's K and V written there. ``wq``/``wk``:
    the norms' float32 per-column weights (``1 + weight`` for mode 1, the weight for mode 2; None for mode 0).
    Shape checks are host-side (metadata only) and raise ``ValueError`` with what is wrong."""
    if mode not in MODES.values():
        raise ValueError(f"mode must be one of {sorted(MODES.values())} ({MODES}), got {mode!r}")
    if y.dim() != 2 or y.shape[1] < hq * q_stride + hkv * d or y.stride(-1) != 1:
        raise ValueError(f"y must be [B, >= {hq * q_stride + hkv * d}] with unit column stride, got {tuple(y.shape)}")
    if hq < 1 or hkv < 1 or hq % hkv or d < 2 or d % 2 or q_stride < d:
        raise ValueError(f"heads {hq}/{hkv}, head dim {d}, q_stride {q_stride}: not a supported layout")
    if cos.shape != sin.shape or cos.dim() != 3 or cos.shape[1] != 1 or cos.shape[0] not in (1, y.shape[0]):
        raise ValueError(f"cos/sin must be [B or 1, 1, R], got {tuple(cos.shape)} / {tuple(sin.shape)}")
    r = cos.shape[-1]
    if r % 2 or r > d or r < 2:
        raise ValueError(f"rotary width {r} must be even, within the head dim {d}")
    if mode != 0:
        for name, w in (("wq", wq), ("wk", wk)):
            if w is None or w.dtype != torch.float32 or tuple(w.shape) != (d,) or not w.is_contiguous():
                raise ValueError(f"{name} must be a contiguous float32 [{d}] for norm mode {mode}")
    if (k_cache is None) != (v_cache is None) or (k_cache is None) != (pos is None) or (k_cache is None) != (v is None):
        raise ValueError("k_cache, v_cache, v and pos come together")
    if k_cache is not None:
        want = (y.shape[0], hkv, k_cache.shape[2] if k_cache.dim() == 4 else -1, d)
        if tuple(k_cache.shape) != want or tuple(v_cache.shape) != want or k_cache.dtype != y.dtype:
            raise ValueError(f"caches must be {want} in {y.dtype}, got {tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
        if tuple(v.shape) != (y.shape[0], hkv * d) or pos.dtype != torch.int64 or pos.numel() != 1:
            raise ValueError("v must be [B, hkv * D] and pos an int64 tensor of one element")
    op = torch.ops.mpsboost.attn_qk_rope_cache
    return op(y, wq, wk, cos, sin, v, k_cache, v_cache, pos, hq, hkv, d, q_stride, eps, mode)


def composed(
    y: torch.Tensor,
    wq: Optional[torch.Tensor],
    wk: Optional[torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    **kw: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The composed path (the reference, aten op by op): what the fused operator is timed against."""
    v, kc, vc, pos = (kw.pop(n, None) for n in ("v", "k_cache", "v_cache", "pos"))
    q, k = qk_rope_reference(y, wq, wk, cos, sin, **kw)
    if kc is not None:
        cache_write_reference(k, v.view(y.shape[0], kw["hkv"], 1, kw["d"]), kc, vc, pos)
    return q, k


def timing_pair(
    *,
    batch: int,
    hq: int,
    hkv: int,
    d: int,
    q_stride: int,
    rotary: int,
    mode: int,
    dtype: torch.dtype,
    device: str = "mps",
    seed: int = 0,
) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """The step's chain after the projections at these shapes, composed and fused, on inputs made here (nothing
    model-owned is held): ``(composed, fused)``, each one call."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(batch, hq * q_stride + hkv * d, generator=g).to(dtype).to(device)
    w = (torch.rand(2, d, generator=g) + 0.5).to(device)
    wq, wk = (None, None) if mode == 0 else (w[0].contiguous(), w[1].contiguous())
    ang = torch.rand(batch, 1, rotary, generator=g) * 6
    cos, sin = ang.cos().to(dtype).to(device), ang.sin().to(dtype).to(device)
    kw = dict(hq=hq, hkv=hkv, d=d, q_stride=q_stride, eps=1e-6, mode=mode)

    def run_composed():
        return composed(y, wq, wk, cos, sin, **kw)

    def run_fused():
        return qk_rope_cache(y, wq, wk, cos, sin, **kw)

    return run_composed, run_fused


# re-exported for the recipe: the reference's head views
heads = attn_ref.heads
