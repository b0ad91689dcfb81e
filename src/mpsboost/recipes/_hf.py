"""Helpers the transformers-facing recipes share (imports no transformers: it reads duck-typed configs)."""
from __future__ import annotations

from typing import Any

import torch


def configs(model: torch.nn.Module) -> list[Any]:
    """The model's config and every sub-config (identity-deduplicated): where an attention or experts
    implementation choice is recorded."""
    out, seen, todo = [], set(), [getattr(model, "config", None)]
    while todo:
        cfg = todo.pop()
        if cfg is None or id(cfg) in seen:
            continue
        seen.add(id(cfg))
        out.append(cfg)
        for key in getattr(cfg, "sub_configs", {}) or {}:
            todo.append(getattr(cfg, key, None))
    return out
