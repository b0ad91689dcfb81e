"""Quantise at load: a bf16 / fp16 / fp32 transformers checkpoint read tensor by tensor and stored in MLX affine
low bits as it is read (:func:`dense_row`, a row of :mod:`mpsboost.quant.formats` built for given bits and group).

What is quantised, as mlx-lm's converter does for these families: every plain ``nn.Linear`` (the head included) and
``nn.Embedding`` whose in_features is a multiple of the group size, at the given bits; ``shared_expert_gate`` at
8 bits, groups of 64 (mlx-lm's ``quant_predicate``); the experts' fused stacks expert by expert (the float scratch
is one expert's weights). Kept in the model's dtype: norms, convolutions, biases, the routers (transformers'
``TopKRouter`` reads its ``weight`` directly; they are small). The codes, scales and biases equal ``mx.quantize``'s
of the same weights bit for bit. The peak is the quantized model plus one tensor of the checkpoint.

Checkpoint layouts read: transformers' own keys (fused or per-expert stacks, as ``save_pretrained`` writes them:
``experts.N.{gate,up,down}_proj`` or Mixtral's ``block_sparse_moe.experts.N.{w1,w3,w2}``), and a multimodal
checkpoint's text model (``model.language_model.*``; the vision tower and MTP weights are not read).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..recipes.low_bit.layers import quantize
from .errors import QuantMismatchError
from .formats import Format, ModelView, Source
from .io import Folder, read_rows, read_tensor
from ..recipes.low_bit.layers import QParams

__all__ = ["dense_row"]

_IGNORED = ("model.visual.", "visual.", "vision_tower.", "mtp.", "model.mtp.")
_ROUTER_8BIT = ("shared_expert_gate.weight",)


def _model_config(folder: Folder) -> tuple[Any, dict]:
    import transformers

    cfg = dict(folder.config or {})
    if "model_type" not in cfg:
        raise QuantMismatchError(f"{folder.path}/config.json has no field model_type")
    clean = {k: v for k, v in cfg.items() if k not in ("model_type", "quantization_config", "vision_config")}
    try:
        hf = transformers.AutoConfig.for_model(cfg["model_type"], **clean)
    except Exception as exc:  # transformers' validators raise their own classes
        raise QuantMismatchError(f"config.json (model_type={cfg['model_type']!r}): {exc}") from None
    if "quantization_config" in cfg:
        raise QuantMismatchError(
            f"config.json field quantization_config={cfg['quantization_config']!r}: this checkpoint is quantized "
            "already; quantize= takes bf16, fp16 or fp32 checkpoints"
        )
    return hf.get_text_config(), {}


def _file_key(folder: Folder, key: str) -> Optional[str]:
    ents = folder.entries
    # transformers' keys; a multimodal checkpoint's text model; Mixtral's published block_sparse_moe names
    for cand in (
        key,
        key.replace("model.", "model.language_model.", 1),
        "model.language_model." + key,
        key.replace(".mlp.", ".block_sparse_moe."),
    ):
        if cand in ents:
            return cand
    return None


def _expert_keys(folder: Folder, stack_key: str, e: int, proj: str) -> Optional[str]:
    """The per-expert key of ``proj`` ("gate", "up", "down") of expert ``e`` of ``<...>.experts.gate_up_proj``."""
    base = stack_key.rsplit(".experts.", 1)[0]
    mixtral = {"gate": "w1", "up": "w3", "down": "w2"}[proj]
    for b in (base, base.replace(".mlp", ".block_sparse_moe")):
        for name in (f"{proj}_proj", mixtral):
            k = _file_key(folder, f"{b}.experts.{e}.{name}.weight")
            if k is not None:
                return k
    return None


def dense_row(spec: QParams) -> Format:
    """The row of a plain transformers checkpoint quantised to ``spec`` while it is read."""

    def sources(folder: Folder, view: ModelView, info: dict) -> tuple[dict[str, Source], list[str]]:
        ents = folder.entries
        used: set[str] = set()
        out: dict[str, Source] = {}
        ignored = [k for k in ents if any(k.startswith(p) for p in _IGNORED)]
        used.update(ignored)
        quantizable = info["quantizable"]
        for mk, (shape, dtype) in view.shapes.items():
            leaf = mk.rsplit(".", 1)[-1]
            if mk.endswith(("experts.gate_up_proj", "experts.down_proj")) and len(shape) == 3:
                fk = _file_key(folder, mk)
                e_, n_, k_ = shape
                p = spec if k_ % spec.group_size == 0 else None
                if fk is not None:
                    keys = [fk]
                else:
                    projs = ("gate", "up") if mk.endswith("gate_up_proj") else ("down",)
                    keys = [_expert_keys(folder, mk, e, pr) for e in range(e_) for pr in projs]
                    if any(k is None for k in keys):
                        raise QuantMismatchError(f"{folder.name}: the experts of {mk} are not in the checkpoint")
                used.update(keys)
                out[mk] = Source(
                    tuple(keys),
                    shape,
                    _read_stack(folder, keys, shape, p, leaf, fk is not None),
                    p,
                    sum(ents[k].nbytes for k in keys),
                )
                continue
            fk = _file_key(folder, mk)
            if fk is None:
                continue  # the plan names what is missing (a tied head has none of its own)
            used.add(fk)
            e = ents[fk]
            if tuple(e.shape) != tuple(shape):
                raise QuantMismatchError(f"{fk} {list(e.shape)}: the model's {mk} is {list(shape)}")
            p = None
            mod_path = mk.rsplit(".", 1)[0]
            if leaf == "weight" and mod_path in quantizable and len(shape) == 2:
                p = QParams(8, 64) if mk.endswith(_ROUTER_8BIT) else spec
                if shape[-1] % p.group_size:
                    p = None
            out[mk] = Source((fk,), shape, _read_one(e, p, leaf), p, e.nbytes)
        extra = sorted(set(ents) - used - {_file_key(folder, k) for k in view.shapes})
        if extra:
            raise QuantMismatchError(
                f"{folder.name}: tensor(s) {extra[:4]} have no place in this {info['model_class']}"
            )
        return out, ignored

    def model_config(folder: Folder):
        cfg, info = _model_config(folder)
        info["spec"] = spec
        return cfg, info

    return Format(
        name=f"dense, quantized at load to {spec.bits}-bit g{spec.group_size}",
        summary="a bf16/fp16/fp32 transformers checkpoint quantized while read",
        detect=lambda folder: True,
        model_config=model_config,
        sources=sources,
        extra={"spec": spec},
    )


_ROWS = 1 << 20  # weights a slice: the dense scratch of quantize-at-load (a few MiB)


def _read_one(e, p: Optional[QParams], leaf: str):
    def read(device, dtype):
        if p is None:
            t = read_tensor(e)
            return {leaf: (t.to(dtype) if t.is_floating_point() else t).to(device)}
        n, k = e.shape
        q = torch.empty(n, k * p.bits // 32, dtype=torch.uint32, device=device)
        s = torch.empty(n, k // p.group_size, dtype=dtype, device=device)
        b = torch.empty_like(s)
        step = max(1, _ROWS // k)
        for r0 in range(0, n, step):  # rows straight from the file, a slice at a time: never the whole tensor
            r1 = min(n, r0 + step)
            t = read_rows(e, r0, r1)
            q[r0:r1], s[r0:r1], b[r0:r1] = quantize(t.to(dtype) if t.dtype != dtype else t, p.bits, p.group_size)
        return {"weight": q, "scales": s, "biases": b}

    return read


def _read_stack(folder: Folder, keys: list[str], shape, p: Optional[QParams], leaf: str, fused: bool):
    """A fused stack from one key or from per-expert keys, quantised expert by expert into preallocated codes."""
    e_, n_, k_ = shape
    per = len(keys) // e_ if not fused else 0

    def expert(i: int, dtype) -> torch.Tensor:
        if fused:
            if i == 0:
                expert.whole = read_tensor(folder.entries[keys[0]])
            return expert.whole[i].to(dtype)
        parts = [read_tensor(folder.entries[k]).to(dtype) for k in keys[i * per : (i + 1) * per]]
        return parts[0] if len(parts) == 1 else torch.cat(parts, 0)

    def read(device, dtype):
        if p is None:
            w = torch.empty(shape, dtype=dtype, device=device)
            for i in range(e_):
                w[i] = expert(i, dtype)
            expert.whole = None
            return {leaf: w}
        q = torch.empty(e_, n_, k_ * p.bits // 32, dtype=torch.uint32, device=device)
        s = torch.empty(e_, n_, k_ // p.group_size, dtype=dtype, device=device)
        b = torch.empty_like(s)
        for i in range(e_):
            qi, si, bi = quantize(expert(i, dtype), p.bits, p.group_size)
            q[i], s[i], b[i] = qi, si, bi
        expert.whole = None
        return {"weight": q, "scales": s, "biases": b}

    return read


def quantizable_modules(root: torch.nn.Module) -> set[str]:
    """Module paths whose ``weight`` is stored in low bits: exact ``nn.Linear`` and ``nn.Embedding``."""
    return {n for n, m in root.named_modules() if type(m) in (torch.nn.Linear, torch.nn.Embedding)}
