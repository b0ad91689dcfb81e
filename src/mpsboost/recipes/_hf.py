"""Helpers the transformers-facing recipes share (imports no transformers: it reads duck-typed configs)."""
from __future__ import annotations

from typing import Any, Iterable

import torch

from ..registry import Changes, Patch, class_path, keep_attrs, set_instance_attr


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


def use_attn_implementation(model: torch.nn.Module, recipe: str, name: str, registrations: Iterable[Patch],
                            marker: str, description: str) -> Patch:
    """Switch a transformers model to the attention implementation ``name`` (which ``registrations``
    put into transformers' interfaces), reversibly: every config's previous choice is kept and put back
    on a failure part-way and on undo, and recorded on the model under ``marker``."""
    with Changes() as ch:
        for reg in registrations:
            ch.add(reg)
        cfgs = configs(model)
        before = tuple(c.__dict__.get("_attn_implementation_internal") for c in cfgs)
        # Whatever set_attn_implementation touches is restored on failure and on undo.
        ch.add(keep_attrs(cfgs, "_attn_implementation_internal"))
        model.set_attn_implementation(name)
        if getattr(model.config, "_attn_implementation", None) != name:
            raise RuntimeError(f"{class_path(type(model))} did not accept attention implementation {name!r}")
        ch.add(set_instance_attr(model, recipe, marker, before))
    return ch.patch(description=description)
