"""Attention in the layout the Metal SDPA kernels of MPS take (prefill kernels from torch 2.13, fully on
Metal in 2.16 nightlies).

On MPS, ``F.scaled_dot_product_attention`` runs a Metal kernel (decode vector kernels for query length
<= 8, flash-style prefill kernels above) only when (aten/src/ATen/native/mps/operations/Attention.mm on
main): q/k/v are ``[B, H, L, D]`` with a contiguous last dim, q and v share a head dim the kernels were
instantiated for, K/V keep their own (fewer) heads for grouped-query attention (the kernels broadcast by
``gqa_factor``; a repeated K/V only costs memory traffic), any mask is bool or of the query's dtype, no
dropout, and not ``is_causal`` together with a mask. Anything else falls back to the MPSGraph path,
which materialises the full score matrix.

:func:`sdpa` normalises its inputs to that layout, then calls SDPA: on CPU and CUDA it is an ordinary SDPA
call (which is how the path is tested there).

Which head dims have a kernel, and so whether routing a model here pays, is the metal_attention recipe's
decision (``mpsboost.recipes.metal_attention.METAL_HEAD_DIMS``).

``ops`` never imports diffusers or transformers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["sdpa", "rotary"]


def sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    *,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    dense: bool = False,
) -> torch.Tensor:
    """SDPA on ``[B, H, Lq, D]`` query and ``[B, Hkv, Lk, D]`` key/value, ``Hkv`` dividing ``H``.

    ``dense``: every input that is not contiguous is copied first (the MPS kernels read some strided views
    wrong: gate feature ``sdpa_strided_correct``, pytorch#163597 / #181133); otherwise only an input whose last
    dim is strided is.

    K/V are never repeated: grouped-query attention goes through ``enable_gqa``. A float mask of another
    dtype is cast to the query's dtype (the Metal kernels take bool or query-dtype masks), clamped so that
    a large negative fp32 value does not overflow to -inf in fp16. ``is_causal`` with a mask becomes the
    mask alone, combined with the causal pattern (the kernels take one or the other).
    """
    if dense:
        q, k, v = (t if t.is_contiguous() else t.contiguous() for t in (query, key, value))
    else:
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    h, hkv = q.shape[-3], k.shape[-3]
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool and attn_mask.dtype != q.dtype:
            attn_mask = attn_mask.to(q.dtype).clamp_(min=torch.finfo(q.dtype).min)
        if is_causal:
            lq, lk = q.shape[-2], k.shape[-2]
            causal = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril_()
            if attn_mask.dtype == torch.bool:
                attn_mask = attn_mask & causal
            else:
                attn_mask = attn_mask.masked_fill(~causal, torch.finfo(q.dtype).min)
            is_causal = False
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=h != hkv
    )


def rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, perm: torch.Tensor, sign: torch.Tensor, *, inplace: bool
) -> torch.Tensor:
    """Rotary position embedding on the first ``R = cos.shape[-1]`` columns of ``x`` ``[..., D]`` (all of them
    when ``R == D``; transformers' partial rotary otherwise): ``x * cos + rotate_half(x) * sin``, with
    rotate_half as one ``index_select`` by ``perm`` (``[R/2..R) + [0..R/2)``) and its negation folded into
    ``sign * sin`` (``sign``: ``-1`` on the first half, ``+1`` on the second; exact). ``cos``/``sin`` broadcast
    against ``x``'s leading dims. A partial rotary writes its columns into ``x`` when ``inplace`` (``x`` must then
    be a tensor the caller owns), else returns a new tensor."""
    rd = cos.shape[-1]
    part = x if rd == x.shape[-1] else x[..., :rd]
    rot = torch.addcmul(part * cos, part.index_select(-1, perm), sin * sign)
    if part is x:
        return rot
    if inplace:
        part.copy_(rot)
        return x
    return torch.cat((rot, x[..., rd:]), dim=-1)
