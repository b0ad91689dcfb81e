"""Scaled dot-product attention split along the queries, so that no call exceeds a score budget.

On MPS, ``F.scaled_dot_product_attention`` returns wrong values once one call holds more than 2^31
attention scores (B * H * Lq * Lk): reported from Wan video workflows (ComfyUI#14837), where a
Wan2.2 720p clip of 121 frames attends over about 27,000 tokens with 24 heads (about 1.8e10 scores).
Rows of the attention output are independent of each other: computing them in slices of the queries
against all keys gives the same rows, as long as each slice keeps its own rows of the mask (and, for
``is_causal``, its offset into the causal mask).

:func:`sdpa_split` is that computation; :class:`SdpaSplitMode` routes every
``F.scaled_dot_product_attention`` call made while it is active (inside a patched module's forward
only) to it. Calls within the budget pass through unchanged. The budget arrives as an argument: the
recipe that decides (``mpsboost.recipes.attention_split``) owns the 2^31 limit of the MPS kernels.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["score_elements", "query_chunk", "sdpa_split", "SdpaSplitMode"]

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def score_elements(query: torch.Tensor, key: torch.Tensor) -> int:
    """B * H * Lq * Lk of one SDPA call (every leading axis of ``query`` counts as batch or head)."""
    lead = math.prod(query.shape[:-2])
    return int(lead) * int(query.shape[-2]) * int(key.shape[-2])


def query_chunk(query: torch.Tensor, key: torch.Tensor, max_scores: int) -> int:
    """The most query rows per call that keep B * H * rows * Lk within ``max_scores`` (at least 1)."""
    per_row = int(math.prod(query.shape[:-2])) * int(key.shape[-2])
    return max(1, max_scores // max(per_row, 1))


def _mask_rows(mask: torch.Tensor, start: int, stop: int, lq: int) -> torch.Tensor:
    # A mask broadcasts against [..., Lq, Lk]: slice its query axis only where it has one.
    if mask.dim() >= 2 and mask.shape[-2] == lq and lq > 1:
        return mask[..., start:stop, :]
    return mask


def sdpa_split(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    max_scores: int,
    dense: bool = False,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with no single call above ``max_scores`` score elements.

    ``is_causal`` keeps PyTorch's meaning (upper-left aligned: query i sees keys 0..i): each slice
    gets the matching rows of that mask as a boolean mask. ``dense``: every call gets contiguous q/k/v (a
    query slice is a strided view; MPS reads some of those wrong: gate feature ``sdpa_strided_correct``).
    """
    kw: dict[str, Any] = {"dropout_p": dropout_p, "scale": scale}
    if enable_gqa:
        kw["enable_gqa"] = True
    if dense:
        key, value = key.contiguous(), value.contiguous()
    if score_elements(query, key) <= max_scores:
        q = query.contiguous() if dense else query
        return F.scaled_dot_product_attention(q, key, value, attn_mask=attn_mask, is_causal=is_causal, **kw)
    lq, lk = query.shape[-2], key.shape[-2]
    step = query_chunk(query, key, max_scores)
    out = torch.empty(query.shape[:-1] + (value.shape[-1],), dtype=query.dtype, device=query.device)
    for start in range(0, lq, step):
        stop = min(lq, start + step)
        mask = _mask_rows(attn_mask, start, stop, lq) if attn_mask is not None else None
        if is_causal:
            rows = torch.arange(start, stop, device=query.device).unsqueeze(1)
            causal = torch.arange(lk, device=query.device).unsqueeze(0) <= rows
            if mask is None:
                mask = causal
            elif mask.dtype == torch.bool:
                mask = mask & causal
            else:
                mask = mask.masked_fill(~causal, float("-inf"))
        q = query[..., start:stop, :]
        out[..., start:stop, :] = F.scaled_dot_product_attention(
            q.contiguous() if dense else q, key, value, attn_mask=mask, **kw
        )
    return out


def _bind(args: tuple, kwargs: dict) -> dict:
    bound = dict(zip(_SDPA_ARGS, args))
    bound.update(kwargs)
    return bound


class SdpaSplitMode(TorchFunctionMode):
    """Routes ``F.scaled_dot_product_attention`` to :func:`sdpa_split` while active.

    ``largest`` records the largest score count of a call it saw (before splitting), ``splits`` how
    many calls it split; ``dense``: the split calls get contiguous q/k/v.
    """

    def __init__(self, max_scores: int, dense: bool = False) -> None:
        super().__init__()
        self.max_scores = int(max_scores)
        self.dense = bool(dense)
        self.splits = 0
        self.largest = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            b = _bind(args, kwargs)
            q, k = b.get("query"), b.get("key")
            if isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.dim() >= 2:
                n = score_elements(q, k)
                self.largest = max(self.largest, n)
                if n > self.max_scores and set(b) <= set(_SDPA_ARGS):
                    self.splits += 1
                    return sdpa_split(max_scores=self.max_scores, dense=self.dense, **b)
        return func(*args, **kwargs)
