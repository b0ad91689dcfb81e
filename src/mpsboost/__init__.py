"""mpsboost: patch Hugging Face diffusers and transformers pipelines onto the fast kernels of
PyTorch's MPS backend, and around what older torch builds get wrong, in one reversible call.

    report = mpsboost.patch(pipe)     # lossless recipes that fit this device and torch build
    print(report)
    mpsboost.unpatch(pipe)

Importing mpsboost imports neither diffusers nor transformers.
"""

from __future__ import annotations

__version__ = "0.1.0"

from .api import last_report, patch, patched, plan, unpatch
from .errors import (
    PatchedCopyError,
    GateError,
    IrreversiblePatchError,
    MpsboostError,
    NotPatchedError,
    PatchError,
    RecipeSkippedError,
    UnknownRecipeError,
    UnsupportedTargetError,
)
from .gate import Env, Verdict, check
from .registry import Recipe, recipe_names, register
from .report import PatchReport, Row


def save_fp8(obj, path, **kw):  # noqa: D401 - thin lazy wrapper
    """Save a complete fp8 checkpoint (every tensor, config, shards) of a model patched with ``fp8=...``."""
    from .checkpoints import save_fp8 as _save

    return _save(obj, path, **kw)


def load_fp8(obj, path, **kw):
    """Load an fp8 checkpoint (mpsboost's, transformers' FP8, compressed-tensors, scaled_fp8) into ``obj``."""
    from .checkpoints import load_fp8 as _load

    return _load(obj, path, **kw)


__all__ = [
    "__version__",
    "patch",
    "unpatch",
    "patched",
    "plan",
    "last_report",
    "save_fp8",
    "load_fp8",
    "Env",
    "Verdict",
    "check",
    "Recipe",
    "register",
    "recipe_names",
    "PatchReport",
    "Row",
    "MpsboostError",
    "GateError",
    "PatchError",
    "UnsupportedTargetError",
    "UnknownRecipeError",
    "RecipeSkippedError",
    "NotPatchedError",
    "IrreversiblePatchError",
    "PatchedCopyError",
]
