"""``mpsboost.from_pretrained``: one call from a folder to a transformers model with low-bit layers, patched.

The folder's format is detected (:data:`mpsboost.quant.formats.FORMATS`), the transformers text model it holds is
built on the meta device (no bf16 copy of the model ever exists), every tensor is read from the file straight onto
the device, one module at a time, into the layers of :mod:`mpsboost.quant.layers`, and everything is committed
through :func:`mpsboost.api.adopt` (with the lossless recipes where ``patch=True``): one transaction, one report
(``mpsboost.last_report(model)``). A failure anywhere leaves nothing half-built: the model is not returned.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any, Optional

import torch

from .errors import QuantFileError, QuantMismatchError

__all__ = ["from_pretrained", "build_meta_model"]

log = logging.getLogger("mpsboost")


def build_meta_model(config: Any, dtype: torch.dtype) -> torch.nn.Module:
    """The transformers causal LM of ``config`` on the meta device (parameters and buffers without data)."""
    import transformers

    with torch.device("meta"):
        try:
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
        except ValueError as exc:
            raise QuantMismatchError(
                f"transformers has no causal LM for config {type(config).__name__} (model_type={config.model_type!r}): "
                f"{exc}"
            ) from None
    return model


def _env_and_device(device: Any):
    from ..api import device_env
    from ..gate import Env

    env = Env.detect() if device is None else device_env(device, absent="raise")
    if device is None and env.device_type not in ("mps", "cuda"):
        env = Env.detect()
    dev = torch.device("cpu") if env.simulated else torch.device(env.device_type)
    return env, dev


def _quantize_spec(quantize: Any):
    from ..recipes.low_bit.layers import QParams

    if quantize is None:
        return None
    if not isinstance(quantize, dict):
        raise TypeError(f"quantize takes None or a dict such as {{'bits': 4, 'group_size': 64}}, got {quantize!r}")
    unknown = sorted(set(quantize) - {"bits", "group_size"})
    if unknown:
        raise ValueError(f"quantize: unknown key(s) {unknown}; accepted: bits, group_size")
    return QParams(int(quantize.get("bits", 4)), int(quantize.get("group_size", 64)))


def from_pretrained(
    path: Any,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: Any = None,
    quantize: Optional[dict] = None,
    patch: bool = True,
) -> torch.nn.Module:
    """Load the low-bit checkpoint folder ``path`` into its transformers text model and return the model.

    ``path``: a folder mlx-lm wrote (``mlx-community/...-4bit``: ``config.json`` with ``quantization``, safetensors
    shards): the model is the transformers text causal LM of its config (the text model of a multimodal checkpoint:
    Qwen3.6's ``Qwen3_5MoeForConditionalGeneration`` folder gives a ``Qwen3_5MoeForCausalLM``). Or, with
    ``quantize={"bits": 4, "group_size": 64}``, a bf16/fp16/fp32 transformers checkpoint, quantised while it is read
    (codes equal to ``mx.quantize``'s; the peak is the quantized model plus one tensor).

    ``dtype``: the compute dtype (plain tensors are cast to it; scales and biases keep the file's dtype).
    ``device``: ``"mps"``, ``"cuda"``, ``"cpu"`` or an :class:`mpsboost.Env` (a simulated one keeps tensors on the
    CPU); default: the best device here. ``patch``: also apply mpsboost's default lossless recipes, in the same
    transaction. The report: ``mpsboost.last_report(model)``.

    Raises :class:`~mpsboost.quant.errors.QuantFileError` for a folder that cannot be read or is of no known
    format, :class:`~mpsboost.quant.errors.QuantMismatchError` naming the key or config field that cannot be
    mapped; nothing is returned half-loaded.
    """
    from .. import api
    from ..errors import PatchError
    from ..registry import get_recipe
    from .formats import ModelView, detect
    from .io import open_folder
    from ..recipes.low_bit.layers import RECIPE
    from .plan import changes, model_view, plan_load

    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype such as torch.bfloat16, got {dtype!r}")
    if not isinstance(patch, bool):
        raise TypeError(f"patch must be a bool, got {patch!r}")
    spec = _quantize_spec(quantize)
    folder = open_folder(path)
    if spec is None:
        row = detect(folder)
    else:
        from .quantize import dense_row

        row = dense_row(spec)
    config, info = row.model_config(folder)
    model = build_meta_model(config, dtype)
    fam = info.get("family")
    if fam is not None and type(model).__name__ != fam.text_model:
        raise QuantMismatchError(
            f"config.json (model_type={folder.config.get('model_type')!r}) builds a {type(model).__name__}; "
            f"mpsboost maps this family onto {fam.text_model}"
        )
    info["model_class"] = type(model).__name__
    if spec is not None:
        from .quantize import quantizable_modules

        info["quantizable"] = quantizable_modules(model)
    view, _ = model_view(model)
    assert isinstance(view, ModelView)
    sources, ignored = row.sources(folder, view, info)
    where = f"{folder.name} ({row.name})"
    plan = plan_load(model, sources, ignored, where)
    if ignored:
        log.info(
            "from_pretrained: %d tensor(s) of %s are not part of %s (e.g. %s)",
            len(ignored),
            where,
            type(model).__name__,
            ", ".join(ignored[:3]),
        )
    env, dev = _env_and_device(device)
    recipe = get_recipe(RECIPE)

    def decide(item, compute):
        # A dense linear's [out, in] lets its decode path be chosen at its shape (torch's int4pack on a Mac).
        src = item.sources.get("weight") if item.kind == "linear" else None
        shape = tuple(src.shape) if src is not None and len(src.shape) == 2 else None
        return recipe.decide_loaded(item.kind, item.params, compute, env, where, shape=shape)

    steps = changes(plan, dev, dtype, decide)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # moe_experts steps aside for the low-bit experts (their own forward routes them) and says so in its rows.
            api.adopt(model, steps, device=env, recipes=None if patch else ())
    except (QuantFileError, QuantMismatchError, PatchError):
        raise
    except BaseException as exc:
        raise QuantFileError(
            f"loading {Path(folder.path).name} failed ({type(exc).__name__}: {exc}); nothing was returned"
        ) from exc
    model.eval()
    return model
