"""``mpsboost.save_mlx``: a model with low-bit layers written in the MLX layout, so that mlx-lm loads the folder
(``mlx_lm.load`` / ``utils.load_model``) and computes what mpsboost computes.

Every rewrite of :mod:`mpsboost.quant.families` is made the way mlx-lm's converter makes it: the fused experts
split into ``switch_mlp.{gate,up,down}_proj`` stacks, conv1d weights ``[C, K, 1]``, zero-centred norms ``+1``,
the text model's keys under ``language_model.`` for Qwen3.5/3.6 (with the multimodal ``config.json`` mlx-lm
reads: ``model_type`` and ``text_config``), a tied head not written. ``config.json`` carries ``quantization`` (the
default bits and group size, and an entry per module that differs) and ``quantization_config`` (the same), as
mlx-lm's ``save_config`` writes them. Tensors are written shard by shard from the device (no second copy).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from .errors import QuantMismatchError
from .families import FAMILIES, Family
from .io import write_folder
from ..recipes.low_bit.layers import affine_state, aux_names

__all__ = ["save_mlx"]


def _family(model: torch.nn.Module) -> Family:
    name = type(model).__name__
    for fam in FAMILIES:
        if fam.text_model == name:
            return fam
    raise QuantMismatchError(
        f"save_mlx writes {', '.join(f.text_model for f in FAMILIES)} in the MLX layout; got a {name}"
    )


def _config(model: torch.nn.Module, fam: Family, quantization: dict) -> dict:
    cfg = model.config.to_dict()
    for k in ("quantization_config", "_name_or_path", "transformers_version", "dtype", "torch_dtype"):
        cfg.pop(k, None)
    # mlx-lm's ModelArgs read these at the top level (transformers 5 keeps them in rope_parameters).
    rope = getattr(model.config, "rope_parameters", None) or {}
    cfg.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
    cfg.setdefault("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
    for k in ("num_experts", "num_local_experts"):
        if hasattr(model.config, k):
            cfg.setdefault(k, getattr(model.config, k))
    if fam.prefix:  # the multimodal model's config: mlx-lm builds the text model from text_config
        cfg = {
            "model_type": fam.model_types[0],
            "text_config": cfg,
            "tie_word_embeddings": bool(getattr(model.config, "tie_word_embeddings", False)),
        }
    cfg["quantization"] = quantization
    cfg["quantization_config"] = quantization
    return dict(sorted(cfg.items()))


def save_mlx(model: torch.nn.Module, path: Any, *, max_shard_size: int = 5 * 2**30) -> Path:
    """Write ``model`` (loaded by :func:`mpsboost.from_pretrained`, quantised at load, or patched with
    ``low_bit_weights``) to the folder ``path`` in the MLX layout; returns the folder."""
    fam = _family(model)
    folder = Path(path)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    tensors: list[tuple[str, torch.Tensor]] = []
    per_module: dict[str, dict] = {}
    done: set[str] = set()
    for mname, mod in model.named_modules():
        state = affine_state(mod)
        if tied and mname == "lm_head":
            continue  # the embedding serves as the head (mlx-lm: embed_tokens.as_linear)
        own = list(mod._parameters.items()) + [
            (b, t) for b, t in mod._buffers.items() if b not in mod._non_persistent_buffers_set
        ]
        if state is not None and state.kind in ("linear", "embedding"):
            fm = fam.to_file_key(mname + ".")[:-1]
            tensors += [(f"{fm}.weight", mod.weight), (f"{fm}.scales", mod.scales), (f"{fm}.biases", mod.biases)]
            p = state.params["weight"]
            per_module[fm] = {"group_size": p.group_size, "bits": p.bits}
            done.update(f"{mname}.{n}" for n in ("weight", "scales", "biases"))
            own = [(n, t) for n, t in own if n not in ("weight", "scales", "biases")]
        elif mname.endswith("experts") and hasattr(mod, "down_proj") and hasattr(mod, "gate_up_proj"):
            pre = fam.to_file_key(mname.rsplit(".experts", 1)[0] + ".")[:-1] + ".switch_mlp"
            names = ("gate_up_proj", "down_proj")
            for n in names:
                parts = [("gate_proj", 0), ("up_proj", 1)] if n == "gate_up_proj" else [("down_proj", None)]
                t = getattr(mod, n)
                if state is not None:
                    s_name, b_name = aux_names(n)
                    trio = (t, getattr(mod, s_name), getattr(mod, b_name))
                    p = state.params[n]
                else:
                    trio, p = (t,), None
                for proj, half in parts:
                    pieces = trio if half is None else tuple(x.chunk(2, dim=1)[half] for x in trio)
                    suffixes = ("weight", "scales", "biases")[: len(pieces)]
                    tensors += [(f"{pre}.{proj}.{sfx}", x) for sfx, x in zip(suffixes, pieces)]
                    if p is not None:
                        per_module[f"{pre}.{proj}"] = {"group_size": p.group_size, "bits": p.bits}
            own = [(n, t) for n, t in own if n not in names and not n.endswith(("_scales", "_biases"))]
        for n, t in own:
            if t is None:
                continue
            key = f"{mname}.{n}" if mname else n
            if key in done:
                continue
            fk = fam.to_file_key(key)
            if fam.conv1d and key.endswith("conv1d.weight") and t.dim() == 3:
                t = t.permute(0, 2, 1).contiguous()  # [C, 1, K] -> [C, K, 1]
            elif fam.zero_centred and t.dim() == 1 and any(key.endswith(s) for s in fam.zero_centred):
                t = (t.float() + 1.0).to(t.dtype)
            tensors.append((fk, t))
    if not per_module:
        raise QuantMismatchError(
            f"this {type(model).__name__} has no low-bit layer: there is nothing MLX-quantized to save"
        )
    common = Counter((v["bits"], v["group_size"]) for v in per_module.values()).most_common(1)[0][0]
    quantization: dict = {"group_size": common[1], "bits": common[0], "mode": "affine"}
    for fm, v in sorted(per_module.items()):
        if (v["bits"], v["group_size"]) != common:
            quantization[fm] = v
    folder.mkdir(parents=True, exist_ok=True)
    write_folder(folder, tensors, meta={"format": "mlx"}, max_shard_bytes=max_shard_size)
    (folder / "config.json").write_text(json.dumps(_config(model, fam, quantization), indent=4) + "\n")
    return folder
