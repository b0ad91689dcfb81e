"""The load plan, generic over the format row: which module of the model gets which tensors, as which layer.

:func:`plan_load` asks the row (:class:`mpsboost.quant.formats.Format`) for a :class:`~mpsboost.quant.formats.Source`
per tensor of the model, checks that every tensor has one (a missing key raises :class:`QuantMismatchError` naming
it), follows tied tensors (one source for every name of the same parameter), and groups the sources by module into
:class:`Item`\\ s: a plain tensor; a quantized ``nn.Linear`` (``linear``), ``nn.Embedding`` (``embedding``) or experts
module (``experts``: the fused stacks kept quantized); a quantized weight of any other module (a router's
``weight`` parameter) is dequantised into that parameter (``dense``: small modules only; the report counts them).
:func:`changes` turns the items into the steps :func:`mpsboost.api.adopt` commits as one transaction.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from .errors import QuantMismatchError
from .formats import ModelView, Source
from ..recipes.low_bit.layers import RECIPE, AffineState, QParams, aux_names, build_layer, dequantize

__all__ = ["Item", "LoadPlan", "plan_load", "changes", "model_view"]


@dataclass
class Item:
    """One module of the model and what it gets."""

    path: str
    module: torch.nn.Module
    kind: str  # "plain", "linear", "embedding", "experts", "dense"
    sources: dict[str, Source]  # tensor name -> source
    holders: list[tuple[torch.nn.Module, str, str]]  # (module, name, source name): other places of a tied tensor

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.sources.values())

    @property
    def params(self) -> dict[str, QParams]:
        return {n: s.quant for n, s in self.sources.items() if s.quant is not None}


@dataclass
class LoadPlan:
    root: torch.nn.Module
    items: list[Item]
    ignored: list[str]
    rebuild: list[tuple[torch.nn.Module, str]]  # non-persistent buffers left on the meta device

    @property
    def quantized_nbytes(self) -> int:
        return sum(i.nbytes for i in self.items if i.kind in ("linear", "embedding", "experts"))


def model_view(root: torch.nn.Module) -> tuple[ModelView, dict[int, list[str]]]:
    """(every state-dict key's shape and dtype, {id(tensor): its keys}) of ``root``, tied names included."""
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    aliases: dict[int, list[str]] = {}
    for mname, mod in root.named_modules(remove_duplicate=False):
        for n, t in list(mod._parameters.items()) + [
            (b, t) for b, t in mod._buffers.items() if b not in mod._non_persistent_buffers_set
        ]:
            if t is None:
                continue
            key = f"{mname}.{n}" if mname else n
            if key in shapes:
                continue
            shapes[key] = (tuple(t.shape), t.dtype)
            aliases.setdefault(id(t), []).append(key)
    return ModelView(shapes), aliases


def _is_experts(mod: torch.nn.Module) -> bool:
    from ..recipes.fp8.layers import is_hf_experts

    return is_hf_experts(mod)


def plan_load(root: torch.nn.Module, sources: dict[str, Source], ignored: list[str], where: str) -> LoadPlan:
    """The items that fill ``root`` from ``sources`` (model key -> Source); ``where`` names the file in errors."""
    view, aliases = model_view(root)
    mods = dict(root.named_modules(remove_duplicate=False))
    missing = []
    by_module: dict[str, dict[str, Source]] = {}
    holders: dict[str, list[tuple[torch.nn.Module, str, str]]] = {}
    for keys in aliases.values():
        have = [k for k in keys if k in sources]
        if not have:
            missing.append(keys[0])
            continue
        if len(have) > 1:
            raise QuantMismatchError(f"{where}: {have} are one tied tensor of the model but the file holds each")
        k = have[0]
        mpath, name = k.rsplit(".", 1) if "." in k else ("", k)
        by_module.setdefault(mpath, {})[name] = sources[k]
        for other in keys:
            if other != k:
                op, on = other.rsplit(".", 1) if "." in other else ("", other)
                holders.setdefault(k, []).append((mods[op], on, name))
    if missing:
        shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        raise QuantMismatchError(
            f"{where}: the model's tensor(s) {shown} are not in the checkpoint; nothing was changed"
        )
    items = []
    for mpath, srcs in by_module.items():
        mod = mods[mpath]
        quant = {n for n, s in srcs.items() if s.quant is not None}
        if not quant:
            kind = "plain"
        elif type(mod) is torch.nn.Linear and quant == {"weight"}:
            kind = "linear"
        elif type(mod) is torch.nn.Embedding and quant == {"weight"}:
            kind = "embedding"
        elif _is_experts(mod) and "down_proj" in quant:
            kind = "experts"
        else:
            kind = "dense"
        held = [h for n in srcs for h in holders.get(f"{mpath}.{n}" if mpath else n, [])]
        items.append(Item(mpath, mod, kind, srcs, held))
    rebuild = [
        (m, b)
        for m in root.modules()
        for b in m._non_persistent_buffers_set
        if m._buffers.get(b) is not None and m._buffers[b].device.type == "meta"
    ]
    return LoadPlan(root, items, ignored, rebuild)


# ------------------------------------------------------------------------------------------ changes


_HINT = "the weights were read from a low-bit checkpoint; load the model again (mpsboost.from_pretrained)"


def _read_item(item: Item, dev: torch.device, dtype_of: Callable[[str], torch.dtype]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, src in item.sources.items():
        got = src.read(dev, dtype_of(name))
        if src.quant is None:
            out.update(got)
        else:
            s_name, b_name = aux_names(name)
            out[name], out[s_name], out[b_name] = got["weight"], got["scales"], got["biases"]
    return out


def changes(plan: LoadPlan, dev: torch.device, dtype: Optional[torch.dtype], decide: Callable[..., Any]) -> list:
    """The steps that fill ``plan.root`` on ``dev`` for :func:`mpsboost.api.adopt`, each read when it runs (one
    module's tensors at a time). ``dtype``: the compute dtype (plain floating tensors are cast to it; default: the
    model's). ``decide(item, compute_dtype) -> (AffineState, Decision)`` is the recipe's path choice per layer."""
    from ..api import Adopted
    from ..patching import Changes, replace_tensors

    steps = []
    for item in plan.items:
        mod = item.module

        def dtype_of(name: str, mod=mod) -> torch.dtype:
            t = mod._parameters.get(name)
            if t is None:
                t = mod._buffers.get(name)
            model_dtype = t.dtype if t is not None else torch.float32
            return dtype if (dtype is not None and model_dtype.is_floating_point) else model_dtype

        if item.kind in ("plain", "dense"):

            def make(item=item, dtype_of=dtype_of):
                got = _read_item(item, dev, dtype_of)
                vals = {}
                for n, t in got.items():
                    if n in item.params or n in ("scales", "biases") or n.endswith(("_scales", "_biases")):
                        continue
                    vals[n] = t
                for n, p in item.params.items():  # dense: a quantized weight of a module that reads it directly
                    s_name, b_name = aux_names(n)
                    vals[n] = dequantize(got[n], got[s_name], got[b_name], p, dtype_of(n))
                with Changes() as ch:
                    params = {n: torch.nn.Parameter(t, requires_grad=False) for n, t in vals.items()}
                    ch.add(replace_tensors(item.module, params, explanation=_HINT, description=f"load {item.path}"))
                    for hm, hn, sn in item.holders:
                        ch.add(replace_tensors(hm, {hn: params[sn]}, explanation=_HINT, description=f"tie {hn}"))
                return ch.patch(reversible=False, description=f"load {item.path}")

            steps.append(Adopted(RECIPE, item.path or "<root>", make))
            continue
        compute = dtype if dtype is not None else _compute_dtype(mod)
        state, decision = decide(item, compute)

        def make_layer(item=item, state=state, dtype_of=dtype_of):
            tensors = _read_item(item, dev, dtype_of)
            with Changes() as ch:
                ch.add(build_layer(item.module, state, tensors, f"load {item.path}"))
                for hm, hn, _ in item.holders:  # a tied head: the embedding's codes, scales and biases
                    tied_state = AffineState(
                        "linear",
                        dict(state.params),
                        state.compute_dtype,
                        state.max_rows,
                        state.kernel,
                        state.backing,
                        state.source,
                    )
                    shared = {"weight": tensors["weight"], "scales": tensors["scales"], "biases": tensors["biases"]}
                    ch.add(build_layer(hm, tied_state, shared, f"tie {hn} to {item.path}"))
            return ch.patch(reversible=False, description=f"load {item.path}")

        steps.append(Adopted(RECIPE, item.path, make_layer, module=mod, decision=decision))
    steps.append(Adopted(RECIPE, "<buffers>", functools.partial(_buffers, plan, dev)))
    return steps


def _compute_dtype(mod: torch.nn.Module) -> torch.dtype:
    for t in mod.parameters(recurse=False):
        if t.is_floating_point():
            return t.dtype
    return torch.float32


def _buffers(plan: LoadPlan, dev: torch.device):
    """Non-persistent buffers a meta-device build left without data (rotary tables): rebuilt by constructing the
    module's class again from its config on the CPU (small modules), then moved where the model computes."""
    from ..patching import Changes, replace_tensors

    with Changes() as ch:
        done: dict[int, dict[str, torch.Tensor]] = {}
        for mod, b in plan.rebuild:
            if id(mod) not in done:
                cfg = getattr(mod, "config", None)
                if cfg is None:
                    raise QuantMismatchError(
                        f"{type(mod).__name__}.{b} is a buffer computed at construction (not stored in checkpoints) "
                        "and this module has no config to build it again from"
                    )
                with torch.device("cpu"):
                    donor = type(mod)(cfg)
                done[id(mod)] = dict(donor._buffers)
            t = done[id(mod)].get(b)
            if t is None:
                raise QuantMismatchError(f"{type(mod).__name__}.{b} could not be rebuilt from the module's config")
            ch.add(replace_tensors(mod, {b: t.to(dev)}, explanation=_HINT))
        for mod in plan.root.modules():
            for b in list(mod._non_persistent_buffers_set):
                t = mod._buffers.get(b)
                if t is not None and t.device.type not in ("meta", dev.type):
                    ch.add(replace_tensors(mod, {b: t.to(dev)}, explanation=_HINT))
    return ch.patch(reversible=False, description="buffers of the model")
