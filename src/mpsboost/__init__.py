"""mpsboost: patch Hugging Face diffusers and transformers pipelines onto the fast kernels of
PyTorch's MPS backend, and around what older torch builds get wrong, in one reversible call.

    report = mpsboost.patch(pipe)     # lossless recipes that fit this device and torch build
    print(report)
    mpsboost.unpatch(pipe)

Importing mpsboost imports neither diffusers nor transformers.
"""

from __future__ import annotations

__version__ = "0.1.0"

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
from .report import PatchReport, Row

# What needs torch loads on first use (PEP 562), so that `mpsboost --help` answers before torch is imported.
_LAZY = {
    "last_report": "api",
    "patch": "api",
    "patched": "api",
    "plan": "api",
    "unpatch": "api",
    "Recipe": "registry",
    "recipe_names": "registry",
    "register": "registry",
    "mac_compile": "recipes.linear_attention",
}


def __getattr__(name: str):
    import importlib

    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    try:  # a submodule named as an attribute (mpsboost.api, mpsboost.bench, ...)
        return importlib.import_module(f".{name}", __name__)
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{name}":
            raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


def save_fp8(obj, path, **kw):  # noqa: D401 - thin lazy wrapper
    """Save a complete fp8 checkpoint (every tensor, config, shards) of a model patched with ``fp8=...``."""
    from .checkpoints import save_fp8 as _save

    return _save(obj, path, **kw)


def load_fp8(obj, path, **kw):
    """Load an fp8 checkpoint (mpsboost's, transformers' FP8, compressed-tensors, scaled_fp8) into ``obj``."""
    from .checkpoints import load_fp8 as _load

    return _load(obj, path, **kw)


def from_pretrained(path, **kw):
    """A transformers model from a low-bit checkpoint folder (MLX affine 4/8-bit, as mlx-community publishes), or
    from a bf16 one with ``quantize={"bits": 4, "group_size": 64}``: streamed onto the device, patched; the report
    is ``mpsboost.last_report(model)``. See :func:`mpsboost.quant.load.from_pretrained`."""
    from .quant.load import from_pretrained as _load

    return _load(path, **kw)


def save_mlx(model, path, **kw):
    """Save a model with low-bit layers in the MLX layout (mlx-lm loads the folder). See
    :func:`mpsboost.quant.save.save_mlx`."""
    from .quant.save import save_mlx as _save

    return _save(model, path, **kw)


__all__ = [
    "__version__",
    "patch",
    "unpatch",
    "patched",
    "plan",
    "last_report",
    "save_fp8",
    "load_fp8",
    "from_pretrained",
    "save_mlx",
    "mac_compile",
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
