"""Saving and loading fp8 checkpoints (``mpsboost.save_fp8`` / ``mpsboost.load_fp8``): safetensors only.

``save_fp8`` writes a complete checkpoint (format ``mpsboost.fp8`` version 2): every tensor of the
model's state, the codes of converted layers as ``F8_E4M3`` (whatever the storage on the device:
uint8 bytes are the same bits) with their float32 ``<tensor>_scale``, every other tensor in its own
dtype, tied tensors once, and the model's config (``config.json`` in a folder, or the metadata of a
single file). A folder holds ``model.fp8.safetensors`` (above ``max_shard_size``: shards
``model.fp8-0000k-of-0000n.safetensors`` plus ``model.fp8.safetensors.index.json``); a pipeline gets one
such folder per component.

Such a folder never loads wrong elsewhere (see :data:`DECOY_SHARD`): the weights are under names that
plain ``from_pretrained`` (transformers, diffusers) does not read, and the folder also holds the
indexes those loaders do read (``model.safetensors.index.json``,
``diffusion_pytorch_model.safetensors.index.json``), which name one shard that does not exist and
whose name says what to do: their ``from_pretrained`` raises an error naming ``mpsboost.load_fp8``
instead of building a bf16 model that reads fp8 codes as weights. The metadata says, per converted module, its kind, scales (granularity,
block) and compute dtype. Files are written tensor by tensor: saving never holds a second copy.

``load_fp8`` reads mpsboost's own checkpoints and the formats people publish
(:mod:`mpsboost.fp8_formats`: transformers' fine-grained FP8, compressed-tensors, ``scaled_fp8``
single files) into a model built on the meta device, tensor by tensor, straight into fp8 storage
(uint8 bytes on MPS before torch 2.15, pytorch#194074): the bf16 weights of the fp8 layers never
exist. Every tensor is checked against the model before anything changes (:class:`Fp8MismatchError`,
or :class:`Fp8FileError` for a file that is unreadable, truncated, partial or of no known format,
each naming the format and what is missing); a failure while reading puts every tensor back. Loaded
layers are the ``fp8_weights`` recipe's (report rows, ``save_fp8``, ``unpatch`` raising
:class:`~mpsboost.errors.IrreversiblePatchError`). Folders of the earlier layout (``model.safetensors``
without the guard) still load; version-1 files (converted layers only, from unreleased development
builds) are refused with a message saying how to re-save them.
"""
from __future__ import annotations

import json
import os
import struct
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch

from .errors import Fp8ConversionError, Fp8FileError, Fp8MismatchError, Fp8StateError  # noqa: F401 (re-exported)
from .recipes.fp8.layers import expert_weight_names

__all__ = ["save_fp8", "load_fp8", "describe_checkpoint", "Fp8FileError", "Fp8MismatchError", "Fp8ConversionError", "Fp8StateError", "FORMAT", "FORMAT_VERSION"]

FORMAT = "mpsboost.fp8"
FORMAT_VERSION = "2"
WEIGHTS_NAME = "model.fp8.safetensors"
INDEX_NAME = "model.fp8.safetensors.index.json"
# Why not a quantization_config that transformers understands instead: transformers skips an unknown
# quant_method with a warning and loads the codes as bf16 weights (quantizers/auto.py,
# supports_quant_method); its fine-grained FP8 takes one block size for every layer (per-row scales
# of layers of different widths do not fit) and diffusers has no fp8 quantizer. An index whose one
# shard is missing is refused by both loaders, and their error prints the shard's name:
#   transformers: "No such file or directory: <folder>/<DECOY_SHARD>"
#   diffusers:    "<folder> does not appear to have a file named <DECOY_SHARD> which is required according to the checkpoint index"
DECOY_SHARD = "THIS-FOLDER-HOLDS-FP8-CODES--load-it-with-mpsboost.load_fp8.safetensors"
DECOY_INDEXES = ("model.safetensors.index.json", "diffusion_pytorch_model.safetensors.index.json")
_RECIPE = "fp8_weights"
_ST_DTYPES = {torch.float8_e4m3fn: "F8_E4M3", torch.float32: "F32"}


# ------------------------------------------------------------------------------------------ helpers

def _roots(obj: Any) -> list[tuple[str, torch.nn.Module]]:
    from .api import _targets

    return _targets(obj, action="save or load fp8 weights of")


def _converted(obj: Any) -> Iterator[tuple[str, torch.nn.Module, tuple[str, ...], Any]]:
    """(report path, module, tensor names, recipe state) of every module whose weights fp8_weights converted."""
    from .registry import join_path
    from .patching import ATTR

    for prefix, root in _roots(obj):
        for name, mod in root.named_modules():
            entry = mod.__dict__.get(ATTR, {}).get(_RECIPE)
            state = entry.get("fp8") if entry else None
            if state is None or not state.converted:
                continue
            names = ("weight",) if isinstance(mod, torch.nn.Linear) else expert_weight_names(mod)
            yield join_path(prefix, name), mod, names, state


def _as_path(path: Any) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}: {path!r}")
    return Path(path)


# ------------------------------------------------------------------------------------------ save

_SHARD_DEFAULT = 5 * 2**30


def _parse_size(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    if isinstance(value, str):
        import re

        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|KIB|MIB|GIB)?\s*", value.upper())
        if m:
            mult = {"B": 1, None: 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}[m.group(2)]
            return int(float(m.group(1)) * mult)
    raise ValueError(f"max_shard_size={value!r}: expected a positive int (bytes) or a size such as '5GB' or '500MB'")


def _model_config(root: torch.nn.Module) -> tuple[str, str, dict | None]:
    """(library, class name, config dict) of a transformers or diffusers model (config None for others)."""
    from .registry import matches_class

    cfg = getattr(root, "config", None)
    if matches_class(root, ("transformers.modeling_utils.PreTrainedModel",)) and cfg is not None:
        d = cfg.to_dict()
        d.setdefault("architectures", [type(root).__name__])
        return "transformers", type(root).__name__, d
    if matches_class(root, ("diffusers.models.modeling_utils.ModelMixin",)) and cfg is not None:
        d = {k: v for k, v in dict(cfg).items()}
        d["_class_name"] = type(root).__name__
        return "diffusers", type(root).__name__, json.loads(json.dumps(d, default=lambda o: list(o) if isinstance(o, tuple) else str(o)))
    return "torch", type(root).__name__, None


def save_fp8(obj: Any, path: Any, *, max_shard_size: Any = _SHARD_DEFAULT) -> Path:
    """Write a complete fp8 checkpoint of ``obj`` (patched with ``fp8=...`` or loaded with :func:`load_fp8`).

    Every tensor of the model's state is written: fp8 codes (``F8_E4M3``) and float32 scales of the
    converted layers, every other tensor in its own dtype; tied tensors once. ``path`` ending in
    ``.safetensors``: one file, the model's config in its metadata. Otherwise a folder: ``config.json``
    and ``model.fp8.safetensors``, or ``model.fp8-0000k-of-0000n.safetensors`` shards of at most
    ``max_shard_size`` plus ``model.fp8.safetensors.index.json``; plain ``from_pretrained`` of the folder
    (transformers or diffusers) raises an error naming ``mpsboost.load_fp8`` instead of loading fp8 codes
    as weights (see the module docstring). A pipeline is written to a folder with one such subfolder
    per model component. Returns the path.
    Raises :class:`Fp8StateError` when ``obj`` has no converted module.
    """
    target = _as_path(path)
    limit = _parse_size(max_shard_size)
    entries = list(_converted(obj))
    if not entries:
        raise Fp8StateError(
            f"this {type(obj).__name__} has no weights converted by fp8_weights, so there is nothing to save to {target.name}; "
            "call mpsboost.patch(obj, fp8='rowwise') (or 'tensorwise') first, or load an fp8 checkpoint with mpsboost.load_fp8"
        )
    for mpath, mod, names, state in entries:
        for n in names:
            q = mod._buffers[n]
            if q.dtype not in (torch.float8_e4m3fn, torch.uint8):
                raise Fp8StateError(f"{mpath}.{n} is {q.dtype}, not fp8 codes: the model was cast after patching; nothing was written")
    roots = _roots(obj)
    single_file = target.suffix == ".safetensors"
    pipeline = not (len(roots) == 1 and roots[0][0] == "")
    if pipeline and single_file:
        raise ValueError(f"a {type(obj).__name__} is saved to a folder (one subfolder per component), not to one file {target.name}")
    for prefix, root in roots:
        dest = (target / prefix) if pipeline else target
        mods = {m: (mm, nn_, st) for m, mm, nn_, st in entries if prefix == "" or m == prefix or m.startswith(prefix + ".")}
        _save_root(root, prefix, mods, dest, single_file, limit)
    return target


def _save_root(root: torch.nn.Module, prefix: str, mods: dict, dest: Path, single_file: bool, limit: int) -> None:
    from . import __version__

    codes: set[str] = set()
    modules: dict[str, dict] = {}
    for mpath, (mod, names, state) in mods.items():
        rel = mpath[len(prefix) + 1:] if prefix and mpath != prefix else ("" if prefix else mpath)
        rel = "" if rel == "<root>" else rel
        info = {"kind": "linear" if isinstance(mod, torch.nn.Linear) else "experts", "tensors": list(names),
                "granularity": state.granularity, "compute_dtype": str(state.compute_dtype).replace("torch.", "")}
        block = getattr(state, "block", None)
        if block:
            info["block"] = list(block)
        modules[rel] = info
        codes.update(f"{rel}.{n}" if rel else n for n in names)
    tensors: list[tuple[str, torch.Tensor, str]] = []
    seen: dict[tuple, str] = {}
    from .recipes.fp8.formats import TORCH_TO_ST

    for key, t in root.state_dict(keep_vars=True).items():
        t = t.detach()
        if t.device.type == "meta":
            raise Fp8StateError(f"{key} is on the meta device (no data): nothing was written")
        ident = (t.device, t.untyped_storage().data_ptr() if t.numel() else id(t), t.storage_offset(), tuple(t.shape), t.dtype)
        if t.numel() and ident in seen:
            continue  # a tied tensor: written once, as the first name
        seen[ident] = key
        st = "F8_E4M3" if key in codes else TORCH_TO_ST.get(t.dtype)
        if st is None:
            raise Fp8StateError(f"{key} has dtype {t.dtype}, which safetensors cannot hold; nothing was written")
        tensors.append((key, t, st))
    library, cls_name, config = _model_config(root)
    granularities = sorted({m["granularity"] for m in modules.values()})
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "mpsboost_version": __version__,
        "granularity": granularities[0] if len(granularities) == 1 else "mixed",
        "modules": json.dumps(modules, sort_keys=True),
        "architectures": json.dumps({"": cls_name}),
        "library": library,
    }
    if single_file:
        if config is not None:
            meta["config"] = json.dumps(config, sort_keys=True)
        _write_safetensors(dest, tensors, meta)
        return
    dest.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (dest / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    shards: list[list[tuple[str, torch.Tensor, str]]] = [[]]
    size = 0
    for item in sorted(tensors, key=lambda kv: kv[0]):
        nbytes = item[1].numel() * item[1].element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += nbytes
    # Files an earlier save left here (this layout's and the one before it, which used plain loaders' names).
    for old in [*dest.glob("model*.safetensors"), *dest.glob("diffusion_pytorch_model*.safetensors"), *dest.glob("*.safetensors.index.json")]:
        old.unlink()
    decoy = {"metadata": {"format": FORMAT, "note": "this folder holds fp8 codes and their scales (mpsboost.save_fp8): "
                                                     "load it with mpsboost.load_fp8(model, folder), not from_pretrained"},
             "weight_map": {key: DECOY_SHARD for key, _, _ in tensors}}
    if len(shards) == 1:
        _write_safetensors(dest / WEIGHTS_NAME, shards[0], meta)
    else:
        n = len(shards)
        weight_map = {}
        total = 0
        for i, shard in enumerate(shards, 1):
            fname = f"model.fp8-{i:05d}-of-{n:05d}.safetensors"
            _write_safetensors(dest / fname, shard, meta)
            for key, t, _ in shard:
                weight_map[key] = fname
                total += t.numel() * t.element_size()
        index = {"metadata": {"total_size": total, "format": FORMAT, "format_version": FORMAT_VERSION}, "weight_map": weight_map}
        (dest / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    for name in DECOY_INDEXES:
        (dest / name).write_text(json.dumps(decoy, indent=1, sort_keys=True) + "\n")


def _write_safetensors(target: Path, tensors: list[tuple[str, torch.Tensor, str]], meta: dict[str, str]) -> None:
    """The safetensors layout, one tensor at a time: u64 header size, JSON header, raw little-endian bytes."""
    tensors = sorted(tensors, key=lambda kv: kv[0])
    header: dict[str, Any] = {"__metadata__": meta}
    offset = 0
    for name, t, st in tensors:
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": st, "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    tmp = target.with_name(target.name + ".partial")
    try:
        with open(tmp, "wb") as fh:
            fh.write(struct.pack("<Q", len(raw)))
            fh.write(raw)
            for _, t, _ in tensors:
                cpu = t.detach().to("cpu").contiguous()
                if cpu.numel():
                    fh.write(memoryview(cpu.reshape(-1).view(torch.uint8).numpy()))
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()


# ------------------------------------------------------------------------------------------ load

# ------------------------------------------------------------------------------------------ complete and published checkpoints

class _BlockState:
    """What a block-scaled layer's forward needs (and what save_fp8 reads): same fields as fp8_weights' state."""

    def __init__(self, kind: str, compute_dtype: torch.dtype, block: tuple[int, int]):
        self.kind = kind
        self.compute_dtype = compute_dtype
        self.granularity = "block"
        self.block = tuple(block)
        self.converted = True


def _block_linear_forward(state: _BlockState):
    from .ops.fp8_block import fp8_block_linear

    def forward(self, input, *args, **kwargs):
        return fp8_block_linear(input, self.weight, self.weight_scale, self.bias, block=state.block, compute_dtype=state.compute_dtype)

    return forward


def _routed_block_forward(block: tuple[int, int], down_block: tuple[int, int], compute_dtype: torch.dtype):
    """The forward of an experts module whose fp8 stacks carry block scales (the up and down projections
    may have blocks of their own shape)."""
    from .ops.fp8_block import fp8_block_experts

    def forward(self, hidden_states, *args, **kwargs):
        rest = list(args)
        top_k_index = rest.pop(0) if rest else kwargs.pop("top_k_index", kwargs.pop("router_indices", None))
        top_k_weights = rest.pop(0) if rest else kwargs.pop("top_k_weights", kwargs.pop("routing_weights", None))
        up_name, down_name = expert_weight_names(self)
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        has_bias = bool(getattr(self, "has_bias", False))
        act = self._apply_gate if getattr(self, "has_gate", True) else self.act_fn
        out = fp8_block_experts(
            x, top_k_index.reshape(x.shape[0], -1), top_k_weights.reshape(x.shape[0], -1),
            up=(getattr(self, up_name), getattr(self, up_name + "_scale")),
            down=(getattr(self, down_name), getattr(self, down_name + "_scale")),
            block=block, down_block=down_block, activation=act, compute_dtype=compute_dtype,
            up_bias=getattr(self, up_name + "_bias", None) if has_bias else None,
            down_bias=getattr(self, "down_proj_bias", None) if has_bias else None,
        )
        return out.reshape(shape)

    return forward


def _block_experts_forward(state: _BlockState):
    return _routed_block_forward(state.block, state.block, state.compute_dtype)


class _ExactState(_BlockState):
    """A per-tensor or per-row layer whose scales are applied as blocks (exactly); save_fp8 sees its granularity."""

    def __init__(self, kind: str, compute_dtype: torch.dtype, granularity: str, blocks: list):
        super().__init__(kind, compute_dtype, blocks[0])
        self.granularity = granularity
        self.block = None  # not block-scaled in the file: scales keep their own layout
        self.blocks = [tuple(b) for b in blocks]


def _scale_block(qt) -> tuple[int, int]:
    n, k = qt.shape[-2:]
    return (1, k) if qt.scheme == "rowwise" else (n, k)


def _as_block_scale(scale: torch.Tensor) -> torch.Tensor:
    return scale.reshape(1, 1) if scale.dim() == 0 else scale


def _exact_linear_forward(state: _ExactState):
    from .ops.fp8_block import fp8_block_linear

    def forward(self, input, *args, **kwargs):
        return fp8_block_linear(input, self.weight, _as_block_scale(self.weight_scale), self.bias, block=state.blocks[0],
                                compute_dtype=state.compute_dtype)

    return forward


def _exact_experts_forward(state: _ExactState):
    return _routed_block_forward(state.blocks[0], state.blocks[-1], state.compute_dtype)


def _target_env(obj: Any, roots, device: Any):
    """(Env, torch.device the tensors go to). A simulated Env keeps tensors on the CPU."""
    from .api import _env_for
    from .gate import Env

    if isinstance(device, Env):
        env = device
    elif device is not None:
        env = Env.detect(device)
    else:
        on_meta = any(t.device.type == "meta" for _, r in roots for t in list(r.parameters())[:1])
        env = Env.detect() if on_meta else _env_for(obj, roots, None)
    dev = torch.device("cpu") if env.simulated else torch.device(env.device_type)
    return env, dev


def _read_codes(entry, storage: str, dev: torch.device, out: torch.Tensor | None = None) -> torch.Tensor:
    from .recipes.fp8.formats import read_tensor

    if out is not None and out.device.type == "cpu":
        return read_tensor(entry, out=out)
    t = read_tensor(entry)
    t = t.view(torch.uint8) if storage == "uint8" else t
    return t if out is None else out.copy_(t)


def _assemble(qt, ckpt, storage: str, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes and float32 scales of one model tensor, read part by part into their final buffers."""
    from .recipes.fp8.formats import scale_to_float32

    ents = ckpt.entries
    qdtype = torch.float8_e4m3fn if storage == "float8" else torch.uint8
    codes = torch.empty(qt.shape, dtype=qdtype, device=dev)
    scale = torch.empty(qt.scale_shape, dtype=torch.float32, device=dev)
    for part in qt.parts:
        ce, se = ents[part.codes], ents[part.scale]
        s = scale_to_float32(se)
        whole = part.expert is None and part.src_rows is None
        if whole:
            _read_codes(ce, storage, dev, out=codes)
        else:
            c = _read_codes(ce, storage, dev)
            if part.src_rows is not None:
                c = c[part.src_rows[0]:part.src_rows[1]]
            dst = codes if part.expert is None else codes[part.expert]
            dst[part.rows[0]:part.rows[1]].copy_(c)
            del c
        r0, r1 = part.rows
        sdst = scale if part.expert is None else scale[part.expert]
        if qt.scheme == "tensorwise":
            sdst.copy_(s.reshape(sdst.shape))
        elif qt.scheme == "rowwise":
            region = sdst[..., r0:r1, :]
            if part.scheme == "tensorwise":
                region.copy_(s.reshape(region.shape[:-2] + (1, 1)).expand_as(region))
            else:
                src = s.reshape(*ce.shape[:-2], -1, 1)
                if part.src_rows is not None:
                    src = src[..., part.src_rows[0]:part.src_rows[1], :]
                region.copy_(src)
        else:
            bn = qt.block[0]
            src = s
            if part.src_rows is not None:
                src = src[part.src_rows[0] // bn: -(-part.src_rows[1] // bn)]
            sdst[..., r0 // bn: r0 // bn + src.shape[-2], :].copy_(src)
    return codes, scale


def _donor_buffers(root: torch.nn.Module, pairs, dev: torch.device) -> dict:
    """Non-persistent buffers that a meta-device build left without data (rotary tables), computed by
    building the same class from its config with parameters on the meta device and buffers real."""
    from .registry import matches_class

    try:
        from accelerate import init_empty_weights
    except ImportError:
        init_empty_weights = None
    cfg = getattr(root, "config", None)
    where = ", ".join(sorted({n for n, m in root.named_modules() for mm, _ in pairs if mm is m})[:3])
    if init_empty_weights is None or cfg is None:
        raise Fp8MismatchError(
            f"buffers of {where} are on the meta device and are not stored in checkpoints (computed at construction); "
            "build the model with accelerate.init_empty_weights() (it keeps buffers real) instead of torch.device('meta')"
        )
    with init_empty_weights(include_buffers=False):
        if matches_class(root, ("transformers.modeling_utils.PreTrainedModel",)):
            donor = type(root)._from_config(cfg)
        else:
            donor = type(root).from_config(cfg)
    names = {id(m): n for n, m in root.named_modules(remove_duplicate=False)}
    dmods = dict(donor.named_modules(remove_duplicate=False))
    out = {}
    for mod, b in pairs:
        dm = dmods.get(names[id(mod)])
        t = None if dm is None else dm._buffers.get(b)
        if t is None or t.device.type == "meta":
            raise Fp8MismatchError(f"{names[id(mod)]}.{b} is a meta-device buffer that is not in checkpoints and could not be rebuilt; "
                                   "build the model with accelerate.init_empty_weights()")
        out[(id(mod), b)] = t.to(dev)
    return out


def _load_plans(obj: Any, target: Path, roots) -> list:
    from .recipes.fp8.formats import open_checkpoint, plan_load

    pipeline = not (len(roots) == 1 and roots[0][0] == "")
    plans = []
    if not pipeline:
        ckpt = open_checkpoint(target)
        plans.append(plan_load(roots[0][1], ckpt, ""))
        return plans
    if not target.is_dir():
        raise Fp8FileError(f"a {type(obj).__name__} loads from a folder with one subfolder per component, not from the file {target.name}")
    for prefix, root in roots:
        sub = target / prefix
        if sub.is_dir() and (any(sub.glob("*.safetensors")) or any(sub.glob("*.safetensors.index.json"))):
            plans.append(plan_load(root, open_checkpoint(sub), prefix))
    if not plans:
        raise Fp8FileError(f"{target}: no subfolder with safetensors for any component ({', '.join(p for p, _ in roots)})")
    return plans


def load_fp8(obj: Any, path: Any, *, device: Any = None, dtype: torch.dtype | None = None, lossless_recipes: bool = True):
    """Load an fp8 checkpoint into ``obj`` and return the patch report: one call from a published file to a ready model.

    ``obj``: a model built without weights (``from_config`` under ``torch.device("meta")`` or
    ``accelerate.init_empty_weights()``), a model with weights, or a diffusers pipeline (then ``path``
    is a folder with one subfolder per component). ``path``: a safetensors file or a folder (sharded
    or not) in any of :data:`mpsboost.fp8_formats.FORMATS`: mpsboost's own (:func:`save_fp8`),
    transformers' fine-grained FP8, compressed-tensors float-quantized, or a ``scaled_fp8`` single
    file. Tensors are read one at a time straight into their final storage: fp8 layers never exist
    in bf16. Block scales are kept and applied exactly (:mod:`mpsboost.ops.fp8_block`), per-tensor and
    per-row scales as they are.

    ``device``: where the model computes (``"mps"``, ``"cuda"``, ``"cpu"`` or an :class:`mpsboost.Env`;
    a simulated Env keeps tensors on the CPU); default: the model's device, or the best device for a
    meta model. ``dtype``: cast the non-fp8 floating tensors (and compute) to it; default: the file's
    dtypes, computing in the dtype most of the file's plain bytes have. ``lossless_recipes``: also
    apply mpsboost's default lossless recipes.

    Everything is checked before anything changes; a mismatch raises :class:`Fp8MismatchError`, a bad
    file :class:`Fp8FileError`, each naming the format and what is missing; a failure while reading
    puts every tensor back, so the model is exactly as it was.
    """
    target = _as_path(path)
    roots = _roots(obj)
    if not target.exists():
        raise FileNotFoundError(f"fp8 checkpoint {str(target)!r} does not exist")
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating torch.dtype such as torch.bfloat16, got {dtype!r}")
    plans = _load_plans(obj, target, roots)
    for p in plans:
        if p.ignored:  # e.g. a Qwen3.6 wrapper's vision tower and multi-token-prediction head, loaded into the text model
            import logging

            logging.getLogger("mpsboost").info("load_fp8: %d tensor(s) of %s are not part of this %s and were not read (e.g. %s)",
                                               len(p.ignored), p.ckpt.name, type(p.root).__name__, ", ".join(p.ignored[:3]))
    problems = [(p.ckpt, pr) for p in plans for pr in p.problems]
    for p in plans:
        for q in p.quant:
            entry = q.module.__dict__.get("_mpsboost_patches", {}).get(_RECIPE)
            if entry is None:
                continue
            state = entry.get("fp8")
            have = q.module._buffers.get(q.name + "_scale")
            if state is None or not state.converted or have is None:
                problems.append((p.ckpt, f"{q.path}: patched by fp8_weights but not converted (a failed conversion); reload the model"))
            elif tuple(q.module._buffers[q.name].shape) != q.shape or tuple(have.shape) != q.scale_shape:
                problems.append((p.ckpt, f"{q.path}.{q.name}_scale: {q.scheme} {list(q.scale_shape)} in the file, but the module was "
                                         f"converted with other scales {list(have.shape)}"))
    if problems:
        ck = problems[0][0]
        shown = "; ".join(pr for _, pr in problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise Fp8MismatchError(f"{ck.name} ({ck.format} checkpoint) does not fit this {type(obj).__name__} "
                               f"({len(problems)} problem(s)): {shown}. Nothing was changed.")
    env, dev = _target_env(obj, roots, device)
    undo_log: list = []
    rows: list = []
    applied: list = []
    try:
        for p in plans:
            _materialise(p, env, dev, dtype, undo_log, rows, applied)
    except BaseException as exc:
        for fn in reversed(undo_log):
            fn()
        if isinstance(exc, (Fp8FileError, Fp8MismatchError)):
            raise
        raise Fp8FileError(f"loading {target.name} failed ({type(exc).__name__}: {exc}); every tensor was put back, nothing was changed") from exc
    report = _record(obj, env, rows, applied)
    if lossless_recipes:
        from .api import patch

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                # moe_experts would wrap the fp8 experts forward with a bf16 one: the fp8 forward routes itself.
                rest = patch(obj, device=env, exclude=("moe_experts",))
        except BaseException:
            from . import api

            recs = api._records(obj)
            if recs is not None and recs and recs[-1].report is report:
                recs.pop()
            for fn in reversed(undo_log):
                fn()
            raise
        from .report import PatchReport

        report = PatchReport.from_rows("patch", env, list(report.rows) + list(rest.rows), target_type=type(obj).__name__)
    return report


def _set_tensor(mod: torch.nn.Module, name: str, value: torch.Tensor, is_param: bool, undo_log: list) -> None:
    old_p = mod._parameters.get(name) if name in mod._parameters else None
    had_p = name in mod._parameters
    old_b = mod._buffers.get(name) if name in mod._buffers else None
    had_b = name in mod._buffers

    def undo() -> None:
        mod._parameters.pop(name, None)
        mod._buffers.pop(name, None)
        if had_p:
            mod._parameters[name] = old_p
        if had_b:
            mod._buffers[name] = old_b

    undo_log.append(undo)
    if is_param:
        mod._parameters[name] = torch.nn.Parameter(value, requires_grad=False)
    else:
        mod._buffers[name] = value


def _materialise(plan, env, dev: torch.device, dtype, undo_log: list, rows: list, applied: list) -> None:
    from .recipes.fp8.formats import read_tensor
    from .ops import fp8 as fp8_ops
    from .ops import fp8_moe
    from .registry import Match, get_recipe
    from .patching import Patch, bind_forward, swap_class
    from .report import APPLIED, Row

    # The fp8_weights recipe's forwards, through the registry (fp8_io imports no recipe module).
    recipe = get_recipe(_RECIPE)
    ckpt = plan.ckpt
    ents = ckpt.entries
    storage = fp8_ops.storage_for(env)
    compute = dtype or plan.compute_dtype
    # fp8 tensors: codes and scales straight into buffers.
    by_module: dict[int, list] = {}
    for qt in plan.quant:
        mod = qt.module
        if _RECIPE in mod.__dict__.get("_mpsboost_patches", {}):
            # Converted already (checked: same shapes and scales): new values in buffers of the same kind and place.
            old = mod._buffers[qt.name]
            codes, scale = _assemble(qt, ckpt, "uint8" if old.dtype == torch.uint8 else "float8", old.device)
            _set_tensor(mod, qt.name, codes, False, undo_log)
            _set_tensor(mod, qt.name + "_scale", scale, False, undo_log)
            continue
        codes, scale = _assemble(qt, ckpt, storage, dev)

        def undo(mod=mod, name=qt.name, old=mod._parameters.get(qt.name), had_scale=(qt.name + "_scale") in mod._buffers,
                 old_scale=mod._buffers.get(qt.name + "_scale")) -> None:
            mod._buffers.pop(name, None)
            mod._buffers.pop(name + "_scale", None)
            mod._parameters[name] = old
            if had_scale:
                mod._buffers[name + "_scale"] = old_scale

        undo_log.append(undo)
        mod._parameters.pop(qt.name, None)
        mod._buffers[qt.name] = codes
        mod._buffers[qt.name + "_scale"] = scale
        by_module.setdefault(id(mod), []).append(qt)
    # Plain tensors, one at a time.
    for g in plan.plain:
        e = ents[g.source]
        if g.pieces:
            t = torch.empty(g.shape, dtype=_st_dtype(e.dtype))
            for key, ex in g.pieces:
                read_tensor(ents[key], out=t[ex])
        else:
            t = read_tensor(e)
            if g.src_rows is not None:
                t = t[g.src_rows[0]:g.src_rows[1]].clone()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        t = t.to(dev)
        for mod, attr, is_param in g.holders:
            _set_tensor(mod, attr, t, is_param, undo_log)
    if plan.rebuild:
        rebuilt = _donor_buffers(plan.root, plan.rebuild, dev)
        for mod, b in plan.rebuild:
            _set_tensor(mod, b, rebuilt[(id(mod), b)], False, undo_log)
    # Buffers that are not in checkpoints but were built with data (accelerate's init_empty_weights keeps
    # buffers real, on the CPU) go where the model computes.
    for mod in plan.root.modules():
        for b in list(mod._non_persistent_buffers_set):
            t = mod._buffers.get(b)
            if t is not None and t.device.type not in ("meta", dev.type):
                _set_tensor(mod, b, t.to(dev), False, undo_log)
    # Forwards, records and report rows: the fp8_weights recipe's, so that reports, save_fp8 and unpatch know them.
    where = f"{ckpt.name} ({ckpt.format})"
    for qts in by_module.values():
        mod, path = qts[0].module, qts[0].path
        schemes = sorted({q.scheme for q in qts})
        nbytes = sum(q.module._buffers[q.name].numel() + 4 * q.module._buffers[q.name + "_scale"].numel() for q in qts)
        details = {"kind": qts[0].kind, "granularity": "+".join(schemes), "storage": storage, "compute_dtype": str(compute).replace("torch.", ""),
                   "bytes_after": nbytes, "loaded_from": str(ckpt.path), "format": ckpt.format}
        if "block" in schemes:
            if len(schemes) > 1:
                raise Fp8MismatchError(f"{path}: block-scaled and other fp8 tensors in one experts module ({schemes}); nothing was changed")
            state = _BlockState(qts[0].kind, compute, qts[0].block)
            details["block"] = list(qts[0].block)
            fwd = _block_linear_forward(state) if qts[0].kind == "linear" else _block_experts_forward(state)
            backing = (f"block-scaled fp8 {qts[0].block[0]}x{qts[0].block[1]}, dequantise then linear" if qts[0].kind == "linear"
                       else f"block-scaled fp8 {qts[0].block[0]}x{qts[0].block[1]}: dequantise only the hit experts, one at a time")
            reason = f"{storage} storage, scales kept exactly as in {where}"
        elif qts[0].kind == "linear" and fp8_ops.choose_linear_path(env, n=qts[0].shape[0], k=qts[0].shape[1], dtype=compute).kind != "dequant":
            n, k = qts[0].shape
            lp = fp8_ops.choose_linear_path(env, n=n, k=k, dtype=compute)
            # The same patch-time facts as fp8_weights records (never asked inside a forward).
            bias_in_mm = lp.kind in ("fused", "mps_scaled_mm") and storage == "float8" and \
                fp8_ops.scaled_mm_bias_supported(str(dev))
            state, fwd = recipe.linear_forward(kind=lp.kind, compute_dtype=compute, granularity=schemes[0],
                                               gemv_max_m=lp.gemv_max_m, bias_in_mm=bias_in_mm, large=lp.large)
            backing, reason = lp.backing, f"{schemes[0]} scales from {where}, {lp.storage} storage: {lp.reason}"
        elif qts[0].kind == "linear" or (env.device_type != "cuda" and not getattr(mod, "is_transposed", False)):
            # Where the layer is dequantised before its matmul anyway, the file's scales are applied in float32
            # and rounded once (the file's exact dequantisation): per-row scales are blocks of (1, K), one
            # per-tensor scale a block of (N, K).
            blocks = [_scale_block(q) for q in qts]
            state = _ExactState(qts[0].kind, compute, "+".join(schemes), blocks)
            fwd = _exact_linear_forward(state) if qts[0].kind == "linear" else _exact_experts_forward(state)
            st_reason = fp8_ops.choose_linear_path(env, n=qts[0].shape[-2], k=qts[0].shape[-1], dtype=compute).reason
            backing = ("dequantize (scales in float32, rounded once) then linear" if qts[0].kind == "linear"
                       else "dequantise only the hit experts (scales in float32), one at a time")
            if storage == "uint8":
                backing = "uint8 storage, integer decode, " + backing
            reason = f"{'+'.join(schemes)} scales from {where}, {storage} storage: {st_reason}"
        else:
            tr = bool(getattr(mod, "is_transposed", False))
            ws = [torch.empty(q.shape, dtype=compute, device="meta") for q in qts]
            state, fwd, large, why = recipe.experts_forward(env, ws, tr, storage, compute_dtype=compute,
                                                            granularity="+".join(schemes), gather_max=16)
            backing = fp8_moe.BACKING[large] + ("" if large == "gather" else " (gather at <= 16 routed pairs)")
            reason = f"{'+'.join(schemes)} scales per expert from {where}, {storage} storage: {why}"
        undo_fwd = bind_forward(mod, _RECIPE, fwd, fp8=state)
        undo_log.append(undo_fwd)
        # The layer prints as what it now is (FP8Linear / FP8<Experts>), as after patch(fp8=...).
        state.backing = backing
        undo_log.append(swap_class(mod, _RECIPE, recipe.layer_class(type(mod))))
        state.converted = True
        rows.append(Row(_RECIPE, path, APPLIED, backing, reason, details))
        applied.append((recipe, Match(mod, path, {"kind": qts[0].kind}), Patch(undo_fwd, reversible=False, description=f"{_RECIPE}: {path} (loaded)")))


def _st_dtype(st: str) -> torch.dtype:
    from .recipes.fp8.formats import ST_DTYPES

    return ST_DTYPES[st]


def _record(obj: Any, env, rows: list, applied: list):
    """Register the loaded layers the way patch(fp8=...) does: unpatch() then raises IrreversiblePatchError."""
    from . import api
    from .report import PatchReport

    report = PatchReport.from_rows("patch", env, rows, target_type=type(obj).__name__)
    rec = api._Record(report=report, applied=[api._Applied(r, m, u) for r, m, u in applied])
    with api._LOCK:
        api._add_record(obj, rec)
    return report


def describe_checkpoint(path: Any, env: Any = None) -> str:
    """Which fp8 path a checkpoint takes in ``env`` (see :func:`mpsboost.fp8_formats.describe_checkpoint`)."""
    from .recipes.fp8.formats import describe_checkpoint as _describe

    return _describe(path, env)
