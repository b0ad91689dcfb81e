"""The fp8 load plan, generic over the row (:class:`mpsboost.quant.fp8_formats.Fp8Format`): which model tensor gets
which file tensors, checked, before anything changes; and :func:`describe_checkpoint`, which path a file takes.

:func:`plan_load` walks the model once: every persistent tensor with its holders (tied tensors share one entry), the
row's key map onto the file's names, then (1) the fp8 weights (``nn.Linear`` weights and experts stacks, whole or
one 2-D Linear per expert), (2) the scales of each (the row's scale key, dtype and layout; parts joined into one
scale scheme), (3) every other tensor as a plain one, then the row's own checks and the file tensors no model tensor
uses. Every mismatch is a line of ``plan.problems``; :mod:`mpsboost.checkpoints` raises them together. Each step is
a function of its own (each below ruff's complexity bound); what differs between formats is a field of the row.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from ..errors import Fp8FileError
from .fp8_formats import _LM, Checkpoint, Fp8Format, entry_scheme, open_checkpoint, row as row_named
from .io import ST_DTYPES, TensorEntry

__all__ = ["Part", "QTensor", "PTensor", "LoadPlan", "plan_load", "describe_checkpoint"]


@dataclass
class Part:
    """One fp8 source tensor (and its scale) that fills rows ``rows`` of matrix ``expert`` of a model tensor."""

    codes: str
    scale: Optional[str]
    expert: Optional[int]
    rows: tuple[int, int]
    src_rows: Optional[tuple[int, int]] = None  # a row slice of the source (diffusers' conversion split it)
    scheme: str = ""


@dataclass
class QTensor:
    """A model weight filled with fp8 codes: linear ``weight`` or an experts stack."""

    path: str  # the module's report path
    module: torch.nn.Module
    name: str
    kind: str  # "linear" or "experts"
    shape: tuple[int, ...]
    parts: list[Part]
    scheme: str = ""  # "tensorwise", "rowwise" or "block"
    block: Optional[tuple[int, int]] = None

    @property
    def scale_shape(self) -> tuple[int, ...]:
        lead = self.shape[:-2]
        n, k = self.shape[-2:]
        if self.scheme == "tensorwise":
            return tuple(lead) + ((1, 1) if lead else ())
        if self.scheme == "rowwise":
            return tuple(lead) + (n, 1)
        bn, bk = self.block
        return tuple(lead) + (-(-n // bn), -(-k // bk))


@dataclass
class PTensor:
    """A plain (not fp8) model tensor and where its bytes are; ``holders`` share it (tied weights)."""

    key: str  # model key (first holder)
    holders: list[tuple[torch.nn.Module, str, bool]]  # (module, attribute, is_parameter)
    source: str
    shape: tuple[int, ...]
    keys: list[str] = field(default_factory=list)  # every model key that names it
    src_rows: Optional[tuple[int, int]] = None  # a row slice of the source (diffusers' conversion split it)
    pieces: list[tuple[str, int]] = field(default_factory=list)  # per-expert 2-D sources of a 3-D stack: (key, expert)


@dataclass
class LoadPlan:
    ckpt: Checkpoint
    root: torch.nn.Module
    prefix: str
    quant: list[QTensor] = field(default_factory=list)
    plain: list[PTensor] = field(default_factory=list)
    rebuild: list[tuple[torch.nn.Module, str]] = field(default_factory=list)  # non-persistent buffers on meta
    problems: list[str] = field(default_factory=list)
    compute_dtype: Optional[torch.dtype] = None
    ignored: list[str] = field(default_factory=list)  # file tensors the model does not load (another tower, mtp)


@dataclass
class _Walk:
    """What the steps of one :func:`plan_load` share: the plan, the row, the model's tensors and the key map."""

    plan: LoadPlan
    row: Fp8Format
    groups: dict[int, PTensor]
    order: list[int]
    kmap: dict[str, tuple[str, Optional[tuple[int, int]]]]
    used: set[str] = field(default_factory=set)  # file keys that fill a model tensor
    quant_ids: set[int] = field(default_factory=set)  # model tensors filled with fp8 codes (or their stacks)

    @property
    def ents(self) -> dict[str, TensorEntry]:
        return self.plan.ckpt.entries

    def src_of(self, mkey: str) -> Optional[tuple[str, Optional[tuple[int, int]]]]:
        hit = self.kmap.get(mkey)
        return hit if hit is not None and hit[0] in self.ents else None

    def problem(self, text: str) -> None:
        self.plan.problems.append(text)


def plan_load(root: torch.nn.Module, ckpt: Checkpoint, prefix: str = "") -> LoadPlan:
    """What loading ``ckpt`` into ``root`` means, tensor by tensor; ``plan.problems`` lists every mismatch.

    Changes nothing: the model may be on the meta device or hold real weights.
    """
    from ..recipes.fp8.layers import is_hf_experts
    from ..registry import join_path

    plan = LoadPlan(ckpt, root, prefix)
    row = ckpt.row if ckpt.row is not None else row_named(ckpt.format)
    groups, order = _model_tensors(root, plan)
    # Every name of a tied tensor counts: a file may hold either.
    kmap, problems = row.key_map(ckpt, root, [k for i in order for k in groups[i].keys])
    plan.problems += problems
    walk = _Walk(plan, row, groups, order, kmap)
    # 1. fp8 weights: linear layers and experts stacks.
    for mname, mod in root.named_modules():
        path = join_path(prefix, mname)
        if isinstance(mod, torch.nn.Linear) or (
            mod._parameters.get("weight") is not None and mod.weight.dim() == 2 and not is_hf_experts(mod)
        ):
            _plan_linear(walk, mname, mod, path)
        elif is_hf_experts(mod):
            _plan_experts(walk, mname, mod, path)
    # 2. scales and schemes of every fp8 tensor.
    for qt in plan.quant:
        for part in qt.parts:
            _plan_scale(walk, qt, part)
        _join_schemes(walk, qt)
    # 3. plain tensors, then the row's own checks and what the file holds besides.
    _plan_plain(walk)
    if row.plan_problems is not None:
        plan.problems += row.plan_problems(plan)
    _unused(walk)
    plan.compute_dtype = _compute_dtype(plan)
    return plan


def _model_tensors(root: torch.nn.Module, plan: LoadPlan) -> tuple[dict[int, PTensor], list[int]]:
    """Every persistent tensor of the model with its holders (tied weights share one entry), in model order; the
    non-persistent buffers left on the meta device go to ``plan.rebuild``."""
    groups: dict[int, PTensor] = {}
    order: list[int] = []

    def hold(mname: str, mod: torch.nn.Module, name: str, t: torch.Tensor, is_param: bool) -> None:
        key = f"{mname}.{name}" if mname else name
        if id(t) not in groups:
            groups[id(t)] = PTensor(key, [], "", tuple(t.shape))
            order.append(id(t))
        if (mod, name, is_param) not in groups[id(t)].holders:
            groups[id(t)].holders.append((mod, name, is_param))
            groups[id(t)].keys.append(key)

    for mname, mod in root.named_modules(remove_duplicate=False):
        for pname, p in list(mod._parameters.items()):
            if p is not None:
                hold(mname, mod, pname, p, True)
        for bname, b in list(mod._buffers.items()):
            if b is None:
                continue
            if bname in mod._non_persistent_buffers_set:
                if b.device.type == "meta" and (mod, bname) not in plan.rebuild:
                    plan.rebuild.append((mod, bname))
                continue
            hold(mname, mod, bname, b, False)
    return groups, order


def _plan_linear(walk: _Walk, mname: str, mod: torch.nn.Module, path: str) -> None:
    """The fp8 codes of a Linear's weight, if the file holds codes for it."""
    from ..recipes.fp8.layers import plain_linear

    ents, row = walk.ents, walk.row
    s = walk.src_of(f"{mname}.weight" if mname else "weight")
    if s is None:
        return
    if ents[s[0]].dtype != "F8_E4M3":
        if row.scale_key(s[0]) in ents:
            walk.problem(
                f"{s[0]}: dtype {ents[s[0]].dtype} in the file next to its scale {row.scale_key(s[0])}; "
                "expected F8_E4M3 codes"
            )
        return  # a plain weight: step 3
    if not plain_linear(mod):
        walk.problem(
            f"{path}.weight: fp8 codes in the file, but the model's module is a {type(mod).__name__}; "
            "mpsboost loads fp8 into torch.nn.Linear layers"
        )
        return
    w = mod.weight
    if len(walk.groups[id(w)].holders) > 1:
        walk.problem(f"{path}.weight: fp8 codes in the file for a weight the model ties to another module")
        return
    part = Part(s[0], row.scale_key(s[0]), None, (0, w.shape[0]), s[1])
    block = row.block_of(walk.plan.ckpt, mname)
    walk.plan.quant.append(QTensor(path, mod, "weight", "linear", tuple(w.shape), [part], block=block))
    walk.quant_ids.add(id(w))
    walk.quant_ids.add(id(mod._buffers.get("weight_scale")))  # a module converted already: its scales are replaced too


_PER_EXPERT = {"gate_up_proj": ("gate_proj", "up_proj"), "up_proj": ("up_proj",), "down_proj": ("down_proj",)}


def _plan_experts(walk: _Walk, mname: str, mod: torch.nn.Module, path: str) -> None:
    """The fp8 codes of an experts module's 3-D stacks: one file tensor per stack, or one 2-D Linear per expert."""
    from ..recipes.fp8.layers import expert_weight_names

    for name in expert_weight_names(mod):
        w = getattr(mod, name, None)
        if not isinstance(w, torch.Tensor) or w.dim() != 3:
            continue
        key = f"{mname}.{name}"
        s = walk.src_of(key)
        if s is not None:
            if walk.ents[s[0]].dtype != "F8_E4M3":
                continue  # a plain stack: step 3
            parts = [Part(s[0], walk.row.scale_key(s[0]), None, (0, w.shape[1]), s[1])]
        else:
            parts = _per_expert_parts(walk, mod, path, name, key, w)
            if parts is None:
                continue
        block = walk.row.block_of(walk.plan.ckpt, mname)
        walk.plan.quant.append(QTensor(path, mod, name, "experts", tuple(w.shape), parts, block=block))
        walk.quant_ids.add(id(w))
        walk.quant_ids.add(id(mod._buffers.get(name + "_scale")))


def _per_expert_parts(
    walk: _Walk, mod: torch.nn.Module, path: str, name: str, key: str, w: torch.Tensor
) -> Optional[list[Part]]:
    """The parts of a stack the file holds as one 2-D Linear per expert (as the published checkpoints do), or None
    when the stack is not fp8 codes (a plain stack is planned here, from its per-expert pieces) or is reported."""
    ents = walk.ents
    names = _PER_EXPERT[name]
    base = walk.kmap.get(key, (key, None))[0][: -len(name)]
    first = f"{base}0.{names[0]}.weight"
    if first not in ents:
        return None  # reported as missing in step 3
    if getattr(mod, "is_transposed", False):
        walk.problem(
            f"{path}.{name}: per-expert weights in the file, but the model stores experts transposed [E, in, out]"
        )
        return None
    is_fp8 = ents[first].dtype == "F8_E4M3"
    e_count = w.shape[0]
    parts: list[Part] = []
    pieces: list[tuple[str, int]] = []
    row = 0
    for sub in names:
        rows = None
        for e in range(e_count):
            k2 = f"{base}{e}.{sub}.weight"
            if k2 not in ents:
                walk.problem(f"{k2}: missing from the file (expert {e} of {e_count} for {path}.{name})")
                continue
            rows = ents[k2].shape[0]
            if is_fp8:
                parts.append(Part(k2, walk.row.scale_key(k2), e, (row, row + rows)))
            else:
                pieces.append((k2, e))
        row += rows or 0
    if is_fp8:
        return parts
    if len(names) > 1:
        walk.problem(f"{path}.{name}: per-expert {names} in a plain dtype; mpsboost stacks fp8 experts only")
    else:
        g = walk.groups[id(w)]
        g.source, g.pieces = first, pieces
        walk.used.update(k for k, _ in pieces)
        walk.plan.plain.append(g)
    walk.quant_ids.add(id(w))
    return None


def _part_shape_problem(qt: QTensor, part: Part, ce: TensorEntry) -> Optional[str]:
    """Why the codes of ``part`` do not fit the model tensor ``qt`` (None: they fit)."""
    cshape = ce.shape if part.src_rows is None else (part.src_rows[1] - part.src_rows[0],) + ce.shape[1:]
    want = qt.shape[-2:] if qt.kind == "linear" else qt.shape[1:]
    if qt.kind == "experts" and part.expert is None:
        bad = tuple(ce.shape) != qt.shape
    else:
        bad = (
            len(cshape) != 2
            or cshape[1] != want[-1]
            or (qt.kind == "linear" and cshape[0] != want[0])
            or (part.expert is not None and part.rows[1] > want[0])
        )
    if bad:
        return f"{part.codes}: shape {list(cshape)} in the file, the model's {qt.path}.{qt.name} is {list(qt.shape)}"
    return None


def _plan_scale(walk: _Walk, qt: QTensor, part: Part) -> None:
    """Check the codes and the scale of one part; set its scheme (left "" where a problem was reported)."""
    ckpt, ents, row = walk.plan.ckpt, walk.ents, walk.row
    walk.used.add(part.codes)
    if row.codes_problem is not None:
        text = row.codes_problem(ckpt, part.codes)
        if text:
            walk.problem(text)
    ce = ents[part.codes]
    if part.scale not in ents:
        walk.problem(f"{part.scale}: missing from the file ({ckpt.format} scale of {part.codes})")
        return
    walk.used.add(part.scale)
    se = ents[part.scale]
    if se.dtype not in row.scale_dtypes:
        walk.problem(f"{part.scale}: dtype {se.dtype}; scales are F32, BF16, F16 or F8_E8M0")
        return
    bad = _part_shape_problem(qt, part, ce)
    if bad:
        walk.problem(bad)
        return
    sch = entry_scheme(ce.shape, se.shape, qt.block)
    if sch is None:
        walk.problem(
            f"{part.scale}: shape {list(se.shape)} is no {ckpt.format} scale layout for codes {list(ce.shape)}"
            + (f" with blocks {list(qt.block)}" if qt.block else "")
        )
        return
    if part.src_rows is not None and sch == "block" and part.src_rows[0] % qt.block[0]:
        walk.problem(f"{part.codes}: split at row {part.src_rows[0]}, inside a scale block of {qt.block[0]} rows")
        return
    part.scheme = sch


def _join_schemes(walk: _Walk, qt: QTensor) -> None:
    """The one scale scheme of a model tensor from its parts' (per-tensor scales of stacked or split parts become
    exact per-row scales); a problem where they cannot be joined exactly."""
    schemes = {p.scheme for p in qt.parts}
    if "" in schemes:
        return  # a part's problem is reported
    if qt.kind == "experts" and any(p.expert is not None for p in qt.parts):
        covered = max(p.rows[1] for p in qt.parts)
        if covered != qt.shape[1]:
            walk.problem(
                f"{qt.path}.{qt.name}: the per-expert tensors give {covered} rows, the model has {qt.shape[1]}"
            )
            return
    per_matrix: dict[Optional[int], int] = {}
    for p in qt.parts:
        per_matrix[p.expert] = per_matrix.get(p.expert, 0) + 1
    if (
        schemes == {"tensorwise"}
        and all(v == 1 for v in per_matrix.values())
        and all(p.src_rows is None for p in qt.parts)
    ):
        qt.scheme = "tensorwise"
    elif "block" not in schemes:
        qt.scheme = "rowwise"
    elif schemes == {"block"} and all(p.rows[0] % qt.block[0] == 0 for p in qt.parts):
        qt.scheme = "block"
    else:
        walk.problem(f"{qt.path}.{qt.name}: parts with scales {sorted(schemes)} cannot be joined exactly")


def _plan_plain(walk: _Walk) -> None:
    """Every model tensor not filled with fp8 codes: its file tensor, of its shape and kind of dtype."""
    from ..registry import join_path

    plan, ents, prefix = walk.plan, walk.ents, walk.plan.prefix
    for i in walk.order:
        g = walk.groups[i]
        if i in walk.quant_ids:
            continue
        found = next((s for s in map(walk.src_of, g.keys) if s is not None), None)
        if found is None:
            walk.problem(f"{join_path(prefix, g.key)}: missing from the file")
            continue
        key, rows = found
        e = ents[key]
        shape = e.shape if rows is None else (rows[1] - rows[0],) + e.shape[1:]
        if tuple(shape) != g.shape:
            walk.problem(
                f"{key}: shape {list(shape)} in the file, the model's {join_path(prefix, g.key)} is {list(g.shape)}"
            )
            continue
        if e.dtype == "F8_E4M3":
            walk.problem(
                f"{key}: fp8 codes for {join_path(prefix, g.key)}, which is not a Linear weight or experts stack"
            )
            continue
        model_t = getattr(g.holders[0][0], g.holders[0][1])
        if model_t.is_floating_point() != ST_DTYPES[e.dtype].is_floating_point:
            walk.problem(f"{key}: dtype {e.dtype} in the file, the model's is {model_t.dtype}")
            continue
        g.source, g.src_rows = key, rows
        walk.used.add(key)
        plan.plain.append(g)


def _ignored_keys(ckpt: Checkpoint, root: torch.nn.Module, used: set[str]) -> set[str]:
    """File tensors a text model does not load, as transformers skips them: the class's
    ``_keys_to_ignore_on_load_unexpected`` patterns (Qwen3_5MoeForCausalLM: ``^mtp.*``, ``^model.visual.*``),
    and, when the file is a multimodal wrapper's (``model.language_model.*`` loaded), its other towers."""
    pats = [p for cls in type(root).__mro__ for p in (getattr(cls, "_keys_to_ignore_on_load_unexpected", None) or ())]
    wrapper = any(k.startswith(_LM) for k in used) and not any(
        n.startswith("language_model.") or ".language_model." in n for n, _ in root.named_modules()
    )
    out = set()
    for k in ckpt.entries:
        if k in used:
            continue
        if any(re.search(p, k) for p in pats) or (wrapper and not k.startswith(_LM) and not k.startswith("lm_head.")):
            out.add(k)
    return out


def _unused(walk: _Walk) -> None:
    """The file tensors no model tensor uses: ignored as transformers ignores them, or a problem."""
    plan, row = walk.plan, walk.row
    plan.ignored = sorted(_ignored_keys(plan.ckpt, plan.root, walk.used))
    skip = set(plan.ignored)
    extra = sorted(
        k
        for k in walk.ents
        if k not in walk.used and k not in skip and k not in row.markers and not k.endswith(row.ignored_suffixes)
    )
    if extra:
        walk.problem(
            f"{len(extra)} tensor(s) in the file belong to no tensor of this {type(plan.root).__name__}: {extra[:4]}"
            + (" ..." if len(extra) > 4 else "")
        )


def _compute_dtype(plan: LoadPlan) -> torch.dtype:
    """The compute dtype of fp8 layers: the dtype most plain floating bytes of the file have."""
    counts: dict[str, int] = {}
    for g in plan.plain:
        e = plan.ckpt.entries[g.source]
        if e.dtype in ("BF16", "F16", "F32"):
            counts[e.dtype] = counts.get(e.dtype, 0) + e.nbytes
    return ST_DTYPES[max(counts, key=counts.get)] if counts else torch.bfloat16


# ------------------------------------------------------------------------------------------ describing


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def describe_checkpoint(path: Any, env: Any = None) -> str:
    """Which fp8 path the checkpoint at ``path`` takes in ``env`` (an :class:`mpsboost.Env`, a device
    string, or None for this machine), read from its headers only: format, scale layouts, storage and
    forward. For ``mpsboost plan`` and ``mpsboost doctor``."""
    from ..gate import Env, check
    from ..recipes.fp8.paths import storage_for

    if env is None:
        env = Env.detect()
    elif isinstance(env, str):
        env = Env.simulate(env) if ":" in env else Env.detect(env) if env == "cpu" else Env.simulate(env)
    elif not isinstance(env, Env):
        raise TypeError(f"env must be an mpsboost.Env, a device string or None, got {type(env).__name__}")
    p = Path(path)
    folders = [p]
    if p.is_dir() and not any(p.glob("*.safetensors")) and not any(p.glob("*.safetensors.index.json")):
        folders = sorted(
            d
            for d in p.iterdir()
            if d.is_dir() and (any(d.glob("*.safetensors")) or any(d.glob("*.safetensors.index.json")))
        )
        if not folders:
            raise Fp8FileError(f"{p}: no safetensors checkpoint in it or in its subfolders")
    lines = [f"fp8 checkpoint {p} for {env.describe()}:"]
    storage = storage_for(env)
    st = check("float8_storage", env)
    for folder in folders:
        lines += _describe_one(open_checkpoint(folder), f"{folder.name}: " if folder is not p else "", env, storage, st)
    return "\n".join(lines)


def _describe_one(ckpt: Checkpoint, head: str, env: Any, storage: str, st: Any) -> list[str]:
    from ..recipes.fp8.paths import choose_linear_path

    ents, row = ckpt.entries, ckpt.row
    schemes: dict[str, int] = {}
    shapes: dict[tuple, int] = {}
    experts = 0
    fp8_bytes = 0
    for k, e in ents.items():
        if e.dtype != "F8_E4M3" or k in row.markers:
            continue
        fp8_bytes += e.nbytes
        sk = row.scale_key(k)
        block = row.block_of(ckpt, k.rsplit(".", 1)[0])
        sch = entry_scheme(e.shape, ents[sk].shape, block) if sk in ents else None
        name = (f"block {block[0]}x{block[1]}" if sch == "block" else sch) or "no scale"
        schemes[name] = schemes.get(name, 0) + 1
        if len(e.shape) == 3 or re.search(r"\.experts\.\d+\.", k):
            experts += 1
        elif len(e.shape) == 2:
            shapes[e.shape] = shapes.get(e.shape, 0) + 1
    lines = [
        f"  {head}format {ckpt.format}, {len(ckpt.files)} file(s), {_size(ckpt.nbytes)} "
        f"({_size(fp8_bytes)} fp8 codes); scales: " + ", ".join(f"{v} {k}" for k, v in sorted(schemes.items())),
        f"  {head}storage: {storage}"
        + ("" if st.ok else f" (the fp8 bytes kept as uint8 and decoded with integer ops: {st.reason})"),
    ]
    if any(k.startswith("block") for k in schemes):
        lines.append(
            f"  {head}block-scaled layers: dequantise this layer "
            "(code x block scale in float32, rounded once) then linear; "
            "experts: only the hit experts, one at a time"
        )
    if shapes:
        (n, k), _ = max(shapes.items(), key=lambda kv: kv[1])
        lp = choose_linear_path(env, n=n, k=k, dtype=torch.bfloat16)
        if any(not s.startswith("block") for s in schemes):
            lines.append(f"  {head}per-tensor/per-row layers: {lp.backing} ({lp.reason})")
    if experts:
        lines.append(
            f"  {head}{experts} expert weight tensor(s)"
            + (
                " stored one Linear per expert: stacked into [E, out, in] while loading"
                if any(re.search(r"\.experts\.\d+\.", k) for k in ents)
                else ""
            )
        )
    if row.naming:
        lines.append(f"  {head}{row.naming}")
    return lines
