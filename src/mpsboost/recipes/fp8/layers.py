"""Which modules and tensors FP8 weight storage deals with: shared by the ``fp8_weights`` recipe (which
converts them) and :mod:`mpsboost.fp8_io` / :mod:`mpsboost.fp8_formats` (which save and load them), so
that neither of those imports the other.

Imports neither diffusers nor transformers (it reads classes by their code, not their import path), and
no recipe or registry module.
"""
from __future__ import annotations

import os

import torch

__all__ = ["is_hf_experts", "expert_weight_names", "plain_linear", "FP8_BASE_ATTR"]

# On the fp8 layer classes fp8_weights swaps onto converted instances: the class they were made from.
FP8_BASE_ATTR = "_mpsboost_fp8_of"


def is_hf_experts(module: torch.nn.Module) -> bool:
    """An instance of a class decorated by transformers' ``use_experts_implementation``.

    The decorator replaces the class's ``forward`` by its dispatcher in ``integrations/moe.py``
    (``functools.wraps`` keeps the original's name, not its code). Same test as moe_experts uses.
    """
    fwd = getattr(type(module), "forward", None)
    code = getattr(fwd, "__code__", None)
    if code is None:
        return False
    if os.path.normpath(code.co_filename).split(os.sep)[-2:] != ["integrations", "moe.py"]:
        return False
    qual = getattr(code, "co_qualname", "use_experts_implementation.<locals>.wrapper.<locals>.forward")
    return "use_experts_implementation" in qual and hasattr(module, "down_proj")


def expert_weight_names(module: torch.nn.Module) -> tuple[str, str]:
    """The stacked expert weights of an experts module: (``gate_up_proj`` or ``up_proj``, ``down_proj``)."""
    up = "gate_up_proj" if getattr(module, "has_gate", True) else "up_proj"
    return up, "down_proj"


def plain_linear(module: torch.nn.Module) -> bool:
    """Exactly ``torch.nn.Linear`` (subclasses such as ``MultiheadAttention``'s ``out_proj`` read their
    weight directly and are not converted), or the fp8 layer class fp8_weights swapped onto one."""
    t = type(module)
    return t is torch.nn.Linear or t.__dict__.get(FP8_BASE_ATTR) is torch.nn.Linear
