"""The composed reference of an attention layer's decode step after its projections: q/k RMS norm, rotary (full or
partial) and the write of the token's K/V into a preallocated cache. A leaf module: :mod:`mpsboost.ops.attn_step`
(the operator) and :mod:`mpsboost.ops.attn_metal` (the kernel's self-check) both read it, and neither imports the
other.

Layout of the projections' product ``y [B, N]`` (unit column stride, any row stride): query head ``i`` at columns
``[i * q_stride, i * q_stride + D)`` (``q_stride`` is ``2 * D`` where each head's output gate follows its query, as
Qwen3.5/3.6 and Qwen3-Next lay ``q_proj`` out, else ``D``), key head ``j`` at ``hq * q_stride + j * D``.

Norm modes (``mode``), as transformers' norm classes compute them:

* 0: no norm (Llama);
* 1: zero-centred (Qwen3.5/3.6, Qwen3-Next): ``(x * rsqrt(mean(x^2) + eps) * w)`` in float32, then rounded, where
  ``w`` is the caller's float32 ``1 + weight``;
* 2: round then scale (Qwen3, Qwen3-MoE): ``w * round(x * rsqrt(mean(x^2) + eps))`` in the activation dtype.

Rotary on the first ``R = cos.shape[-1]`` columns: ``x * cos + rotate_half(x) * sin`` (cos/sin ``[B or 1, 1, R]``).
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["MODES", "heads", "qk_rope_reference", "cache_write_reference"]

MODES = {"plain": 0, "gated": 1, "qk_norm": 2}


def heads(y: torch.Tensor, hq: int, hkv: int, d: int, q_stride: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The query heads ``[B, hq, D]`` and key heads ``[B, hkv, D]`` of ``y`` (views)."""
    b = y.shape[0]
    rs = y.stride(0) if b > 1 else y.shape[1]
    q = y.as_strided((b, hq, d), (rs, q_stride, 1), y.storage_offset())
    k = y.as_strided((b, hkv, d), (rs, d, 1), y.storage_offset() + hq * q_stride)
    return q, k


def _norm(x: torch.Tensor, w: Optional[torch.Tensor], mode: int, eps: float) -> torch.Tensor:
    if mode == 0:
        return x
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if mode == 1:
        return (normed * w.float()).to(x.dtype)
    return w.to(x.dtype) * normed.to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    half = r // 2
    rh = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    return torch.cat((rot * cos + rh * sin, rest), dim=-1)


def qk_rope_reference(
    y: torch.Tensor,
    wq: Optional[torch.Tensor],
    wk: Optional[torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    hq: int,
    hkv: int,
    d: int,
    q_stride: int,
    eps: float,
    mode: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [B, hq, 1, D], k [B, hkv, 1, D])``, both contiguous: normed and rotated (cos/sin ``[B or 1, 1, R]``
    broadcast over the heads)."""
    q, k = heads(y, hq, hkv, d, q_stride)
    q, k = _norm(q, wq, mode, eps), _norm(k, wk, mode, eps)
    c, s = cos.to(y.dtype), sin.to(y.dtype)  # [B or 1, 1, R]: broadcast over heads
    q, k = _rope(q, c, s), _rope(k, c, s)
    return q.unsqueeze(2).contiguous(), k.unsqueeze(2).contiguous()


def cache_write_reference(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor
) -> None:
    """Write ``k``/``v`` ``[B, hkv, 1, D]`` into ``k_cache``/``v_cache`` ``[B, hkv, S, D]`` at position ``pos``
    (int64 ``[1]``, on the caches' device; no host read)."""
    k_cache.index_copy_(2, pos, k)
    v_cache.index_copy_(2, pos, v)
