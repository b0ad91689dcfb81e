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
instead of building a bf16 model that reads fp8 codes as weights. The metadata says, per converted
module, its kind, scales (granularity, block) and compute dtype. Files are written tensor by tensor:
saving never holds a second copy.

``load_fp8`` reads mpsboost's own checkpoints and the formats people publish
(:mod:`mpsboost.quant.fp8_formats`: transformers' fine-grained FP8, compressed-tensors, ``scaled_fp8``
single files) into a model built on the meta device, tensor by tensor, straight into fp8 storage
(uint8 bytes on MPS before torch 2.15, pytorch#194074): the bf16 weights of the fp8 layers never
exist. Every tensor is checked against the model before anything changes (:class:`Fp8MismatchError`,
or :class:`Fp8FileError` for a file that is unreadable, truncated, partial or of no known format,
each naming the format and what is missing). It reads a plan (:func:`~mpsboost.quant.fp8_plan.plan_load`),
asks the ``fp8_weights`` recipe to decide each fp8 layer, builds the changes with the helpers of
:mod:`mpsboost.patching` and commits them through :func:`mpsboost.api.adopt`, patch()'s transaction: a
failure while reading puts every tensor back. Loaded layers are the recipe's own (the layer class, state
and forward of ``patch(fp8=...)``; report rows, ``save_fp8``, ``unpatch`` raising
:class:`~mpsboost.errors.IrreversiblePatchError`). Folders of the earlier layout (``model.safetensors``
without the guard) still load.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import struct
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch

from .errors import Fp8ConversionError, Fp8FileError, Fp8MismatchError, Fp8StateError  # noqa: F401 (re-exported)
from .patching import is_patched_by, replace_tensors
from .quant.io import ST_DTYPES, TORCH_TO_ST
from .quant.fp8_plan import describe_checkpoint  # noqa: F401 (re-exported: which path a file takes here)
from .recipes.fp8.layers import RECIPE as _RECIPE, LoadedLayer, fp8_state, weight_names

__all__ = [
    "save_fp8",
    "load_fp8",
    "describe_checkpoint",
    "Fp8FileError",
    "Fp8MismatchError",
    "Fp8ConversionError",
    "Fp8StateError",
    "FORMAT",
    "FORMAT_VERSION",
]

log = logging.getLogger("mpsboost")

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
#   diffusers:    "<folder> does not appear to have a file named <DECOY_SHARD> which is required according
#                  to the checkpoint index"
DECOY_SHARD = "THIS-FOLDER-HOLDS-FP8-CODES--load-it-with-mpsboost.load_fp8.safetensors"
DECOY_INDEXES = ("model.safetensors.index.json", "diffusion_pytorch_model.safetensors.index.json")


# ------------------------------------------------------------------------------------------ helpers


def _roots(obj: Any) -> list[tuple[str, torch.nn.Module]]:
    from .api import targets

    return targets(obj, action="save or load fp8 weights of")


def _converted(obj: Any) -> Iterator[tuple[str, torch.nn.Module, tuple[str, ...], Any]]:
    """(report path, module, tensor names, layer state) of every fp8 layer (converted or loaded)."""
    from .registry import join_path

    for prefix, root in _roots(obj):
        for name, mod in root.named_modules():
            state = fp8_state(mod)
            if state is None or not state.converted:
                continue
            yield join_path(prefix, name), mod, weight_names(mod), state


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
            mult = {"B": 1, None: 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}[
                m.group(2)
            ]
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
        return (
            "diffusers",
            type(root).__name__,
            json.loads(json.dumps(d, default=lambda o: list(o) if isinstance(o, tuple) else str(o))),
        )
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
            f"this {type(obj).__name__} has no weights converted by fp8_weights, "
            f"so there is nothing to save to {target.name}; "
            "call mpsboost.patch(obj, fp8='rowwise') (or 'tensorwise') first, "
            "or load an fp8 checkpoint with mpsboost.load_fp8"
        )
    for mpath, mod, names, state in entries:
        for n in names:
            q = mod._buffers[n]
            if q.dtype not in (torch.float8_e4m3fn, torch.uint8):
                raise Fp8StateError(
                    f"{mpath}.{n} is {q.dtype}, not fp8 codes: the model was cast after patching; nothing was written"
                )
    roots = _roots(obj)
    single_file = target.suffix == ".safetensors"
    pipeline = not (len(roots) == 1 and roots[0][0] == "")
    if pipeline and single_file:
        raise ValueError(
            f"a {type(obj).__name__} is saved to a folder (one subfolder per component), not to one file {target.name}"
        )
    for prefix, root in roots:
        dest = (target / prefix) if pipeline else target
        mods = {
            m: (mm, nn_, st) for m, mm, nn_, st in entries if prefix == "" or m == prefix or m.startswith(prefix + ".")
        }
        _save_root(root, prefix, mods, dest, single_file, limit)
    return target


def _save_root(root: torch.nn.Module, prefix: str, mods: dict, dest: Path, single_file: bool, limit: int) -> None:
    from . import __version__

    codes: set[str] = set()
    modules: dict[str, dict] = {}
    for mpath, (mod, names, state) in mods.items():
        rel = mpath[len(prefix) + 1 :] if prefix and mpath != prefix else ("" if prefix else mpath)
        rel = "" if rel == "<root>" else rel
        info = {
            "kind": "linear" if isinstance(mod, torch.nn.Linear) else "experts",
            "tensors": list(names),
            "granularity": state.granularity,
            "compute_dtype": str(state.compute_dtype).replace("torch.", ""),
        }
        if state.block:
            info["block"] = list(state.block)
        modules[rel] = info
        codes.update(f"{rel}.{n}" if rel else n for n in names)
    tensors: list[tuple[str, torch.Tensor, str]] = []
    seen: dict[tuple, str] = {}

    for key, t in root.state_dict(keep_vars=True).items():
        t = t.detach()
        if t.device.type == "meta":
            raise Fp8StateError(f"{key} is on the meta device (no data): nothing was written")
        ident = (
            t.device,
            t.untyped_storage().data_ptr() if t.numel() else id(t),
            t.storage_offset(),
            tuple(t.shape),
            t.dtype,
        )
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
    for old in [
        *dest.glob("model*.safetensors"),
        *dest.glob("diffusion_pytorch_model*.safetensors"),
        *dest.glob("*.safetensors.index.json"),
    ]:
        old.unlink()
    decoy = {
        "metadata": {
            "format": FORMAT,
            "note": "this folder holds fp8 codes and their scales (mpsboost.save_fp8): "
            "load it with mpsboost.load_fp8(model, folder), not from_pretrained",
        },
        "weight_map": {key: DECOY_SHARD for key, _, _ in tensors},
    }
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
        index = {
            "metadata": {"total_size": total, "format": FORMAT, "format_version": FORMAT_VERSION},
            "weight_map": weight_map,
        }
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


def _target_env(obj: Any, roots, device: Any):
    """(Env, torch.device the tensors go to). A simulated Env keeps tensors on the CPU."""
    from .api import device_env, env_for
    from .gate import Env

    if device is not None:
        env = device_env(device, absent="raise")  # patch()'s reading of device=; an absent device: one line
    else:
        on_meta = any(t.device.type == "meta" for _, r in roots for t in list(r.parameters())[:1])
        env = Env.detect() if on_meta else env_for(obj)
    dev = torch.device("cpu") if env.simulated else torch.device(env.device_type)
    return env, dev


def _read_codes(entry, storage: str, dev: torch.device, out: torch.Tensor | None = None) -> torch.Tensor:
    from .quant.io import read_tensor

    if out is not None and out.device.type == "cpu":
        return read_tensor(entry, out=out)
    t = read_tensor(entry)
    t = t.view(torch.uint8) if storage == "uint8" else t
    return t if out is None else out.copy_(t)


def _assemble(qt, ckpt, storage: str, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes and float32 scales of one model tensor, read part by part into their final buffers."""
    from .quant.fp8_formats import scale_to_float32

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
                c = c[part.src_rows[0] : part.src_rows[1]]
            dst = codes if part.expert is None else codes[part.expert]
            dst[part.rows[0] : part.rows[1]].copy_(c)
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
                    src = src[..., part.src_rows[0] : part.src_rows[1], :]
                region.copy_(src)
        else:
            bn = qt.block[0]
            src = s
            if part.src_rows is not None:
                src = src[part.src_rows[0] // bn : -(-part.src_rows[1] // bn)]
            sdst[..., r0 // bn : r0 // bn + src.shape[-2], :].copy_(src)
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
            f"buffers of {where} are on the meta device and are not stored in checkpoints "
            "(computed at construction); "
            "build the model with accelerate.init_empty_weights() (it keeps buffers real) "
            "instead of torch.device('meta')"
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
            raise Fp8MismatchError(
                f"{names[id(mod)]}.{b} is a meta-device buffer that is not in checkpoints and could not be rebuilt; "
                "build the model with accelerate.init_empty_weights()"
            )
        out[(id(mod), b)] = t.to(dev)
    return out


def _load_plans(obj: Any, target: Path, roots) -> list:
    from .quant.fp8_formats import open_checkpoint
    from .quant.fp8_plan import plan_load

    pipeline = not (len(roots) == 1 and roots[0][0] == "")
    plans = []
    if not pipeline:
        ckpt = open_checkpoint(target)
        plans.append(plan_load(roots[0][1], ckpt, ""))
        return plans
    if not target.is_dir():
        raise Fp8FileError(
            f"a {type(obj).__name__} loads from a folder with one subfolder per component, "
            f"not from the file {target.name}"
        )
    for prefix, root in roots:
        sub = target / prefix
        if sub.is_dir() and (any(sub.glob("*.safetensors")) or any(sub.glob("*.safetensors.index.json"))):
            plans.append(plan_load(root, open_checkpoint(sub), prefix))
    if not plans:
        raise Fp8FileError(
            f"{target}: no subfolder with safetensors for any component ({', '.join(p for p, _ in roots)})"
        )
    return plans


REQUANTIZE = ("rowwise",)


def _requantize_rowwise(codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]):
    """Block-scaled codes ``[..., N, K]`` -> rowwise codes (in place) and float32 scales ``[..., N, 1]``.

    Each slice of whole block rows is dequantised exactly (code x block scale in float32) and quantised again
    with one scale per output row (:func:`mpsboost.ops.fp8.quantize`): lossy. Every weight moves by at most
    half an e4m3 step of its new code: ``2^-4`` of its magnitude in the normal range, and at most
    ``row_scale * 2^-10`` in the subnormal range (``row_scale = row amax / 448``). Works on slices of at most
    about 16M weights, so the float32 scratch stays small next to the layer."""
    from .ops import fp8 as fp8_ops
    from .ops.fp8_block import dequantize_block

    bn = block[0]
    n, k = codes.shape[-2:]
    storage = "uint8" if codes.dtype == torch.uint8 else "float8"
    c3 = codes.view(-1, n, k)
    s3 = scale.reshape(-1, *scale.shape[-2:])
    out = torch.empty(c3.shape[0], n, 1, dtype=torch.float32, device=codes.device)
    rows = max(bn, ((1 << 24) // max(1, k)) // bn * bn)
    for i in range(c3.shape[0]):
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            w = dequantize_block(c3[i, r0:r1], s3[i, r0 // bn : -(-r1 // bn)], block, torch.float32)
            q, sc = fp8_ops.quantize(w, "rowwise", storage)
            c3[i, r0:r1].copy_(q)
            out[i, r0:r1] = sc
    return codes, out.view(*codes.shape[:-1], 1)


def load_fp8(
    obj: Any,
    path: Any,
    *,
    device: Any = None,
    dtype: torch.dtype | None = None,
    lossless_recipes: bool = True,
    requantize: str | None = None,
):
    """Load an fp8 checkpoint into ``obj`` and return the patch report: one call from a published file to a ready model.

    ``obj``: a model built without weights (``from_config`` under ``torch.device("meta")`` or
    ``accelerate.init_empty_weights()``), a model with weights, or a diffusers pipeline (then ``path``
    is a folder with one subfolder per component). ``path``: a safetensors file or a folder (sharded
    or not) in any of :data:`mpsboost.quant.fp8_formats.FORMATS`: mpsboost's own (:func:`save_fp8`),
    transformers' fine-grained FP8, compressed-tensors float-quantized, or a ``scaled_fp8`` single
    file. Tensors are read one at a time straight into their final storage: fp8 layers never exist
    in bf16. Block scales are kept and applied exactly (:mod:`mpsboost.ops.fp8_block`), per-tensor and
    per-row scales as they are.

    ``device``: where the model computes (``"mps"``, ``"cuda"``, ``"cpu"`` or an :class:`mpsboost.Env`;
    a simulated Env keeps tensors on the CPU); default: the model's device, or the best device for a
    meta model. ``dtype``: cast the non-fp8 floating tensors (and compute) to it; default: the file's
    dtypes, computing in the dtype most of the file's plain bytes have. ``lossless_recipes``: also
    apply mpsboost's default lossless recipes (in the same transaction). ``requantize``: ``None`` (default:
    every scale as in the file) or ``"rowwise"``: block-scaled tensors (e.g. Qwen3.6-FP8's 128x128
    ``weight_scale_inv``) are dequantised exactly and quantised again with one scale per output row while they
    are read. Lossy (each weight within half an e4m3 step of its new code: ``2^-4`` relative, see
    docs/fp8-checkpoints.md for the measured error). On MPS it changes no decode path where mpsboost's Metal
    fp8 GEMV runs (it applies block scales as they are); it matters where that kernel is off (its self-check
    failed on this Mac: rowwise layers then decode on torch 2.15's few-rows ``scaled_mm``, block-scaled ones
    dequantise then multiply) and on CUDA (rowwise layers decode on the Triton fp8 GEMV, block-scaled ones
    dequantise). The report row of each such layer says it was requantised.

    The loaded layers are the ``fp8_weights`` recipe's, built by it from its own decision
    (:meth:`~mpsboost.recipes.fp8.recipe.Fp8Weights.decide_loaded`): the same class, state and forward
    as after ``patch(fp8=...)``, the same path where the scales are per row or per tensor. Everything is
    committed through :func:`mpsboost.api.adopt`, patch()'s transaction: ``unpatch`` then raises
    :class:`~mpsboost.errors.IrreversiblePatchError`.

    Everything is checked before anything changes; a mismatch raises :class:`Fp8MismatchError`, a bad
    file :class:`Fp8FileError`, each naming the format and what is missing; a failure while reading
    puts every tensor back, so the model is exactly as it was.
    """
    from . import api
    from .errors import PatchError

    if requantize is not None and not isinstance(requantize, str):
        raise TypeError(f"load_fp8(requantize=...) takes None or one of {REQUANTIZE}, got {requantize!r}")
    if requantize is not None and requantize not in REQUANTIZE:
        raise ValueError(
            f"load_fp8(requantize={requantize!r}): accepted values are None (keep the file's scales) or "
            f"{', '.join(repr(r) for r in REQUANTIZE)}"
        )
    target = _as_path(path)
    roots = _roots(obj)
    if not target.exists():
        raise FileNotFoundError(f"fp8 checkpoint {str(target)!r} does not exist")
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating torch.dtype such as torch.bfloat16, got {dtype!r}")
    plans = _load_plans(obj, target, roots)
    for p in plans:
        # e.g. a Qwen3.6 wrapper's vision tower and multi-token-prediction head, loaded into the text model
        if p.ignored:
            log.info(
                "load_fp8: %d tensor(s) of %s are not part of this %s and were not read (e.g. %s)",
                len(p.ignored),
                p.ckpt.name,
                type(p.root).__name__,
                ", ".join(p.ignored[:3]),
            )
    problems = [(p.ckpt, pr) for p in plans for pr in p.problems]
    for p in plans:
        for q in p.quant:
            if not is_patched_by(q.module, _RECIPE):
                continue
            state = fp8_state(q.module)
            have = q.module._buffers.get(q.name + "_scale")
            if state is None or not state.converted or have is None:
                problems.append(
                    (
                        p.ckpt,
                        f"{q.path}: patched by fp8_weights but not converted (a failed conversion); reload the model",
                    )
                )
            elif tuple(q.module._buffers[q.name].shape) != q.shape or tuple(have.shape) != q.scale_shape:
                problems.append(
                    (
                        p.ckpt,
                        f"{q.path}.{q.name}_scale: {q.scheme} {list(q.scale_shape)} in the file, but the module was "
                        f"converted with other scales {list(have.shape)}",
                    )
                )
    if problems:
        ck = problems[0][0]
        shown = "; ".join(pr for _, pr in problems[:8]) + (
            f"; and {len(problems) - 8} more" if len(problems) > 8 else ""
        )
        raise Fp8MismatchError(
            f"{ck.name} ({ck.format} checkpoint) does not fit this {type(obj).__name__} "
            f"({len(problems)} problem(s)): {shown}. Nothing was changed."
        )
    env, dev = _target_env(obj, roots, device)
    # Every decision before any change: the fp8_weights recipe decides each loaded layer's path.
    changes = [c for p in plans for c in _changes(p, env, dev, dtype, requantize)]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # moe_experts would wrap the fp8 experts forward with a bf16 one: the fp8 forward routes itself.
            return api.adopt(
                obj, changes, device=env, recipes=None if lossless_recipes else (), exclude=("moe_experts",)
            )
    except (Fp8FileError, Fp8MismatchError, PatchError):
        raise  # the model is as it was (adopt undid every change); a recipe's PatchError names the recipe
    except BaseException as exc:
        raise Fp8FileError(
            f"loading {target.name} failed ({type(exc).__name__}: {exc}); every tensor was put back, "
            "nothing was changed"
        ) from exc


_HINT = (
    "the values read from the fp8 file replaced the module's own; reload the model from its checkpoint "
    "(from_pretrained) and load the fp8 file again"
)


def _tensor_step(mod: torch.nn.Module, path: str, read) -> "Any":
    """A step of the load: ``read()`` gives ``{name: tensor}`` to put into ``mod`` (read when the step is made)."""
    from .api import Adopted

    return Adopted(_RECIPE, path, lambda: replace_tensors(mod, read(), explanation=_HINT, description=f"load {path}"))


def _changes(plan, env, dev: torch.device, dtype, requantize: str | None = None) -> list:
    """The changes that load one checkpoint into ``plan.root``, in order, for :func:`mpsboost.api.adopt`:
    fp8 codes and scales, plain tensors, rebuilt and moved buffers (each read when its step runs, one at a
    time), then the fp8 layers the recipe builds on them. Every layer's decision is made here, before
    any change."""
    from .api import Adopted
    from .patching import Changes
    from .quant.io import read_tensor
    from .recipes.fp8.paths import storage_for
    from .registry import get_recipe

    recipe = get_recipe(_RECIPE)  # through the registry: this module imports no recipe module
    ckpt = plan.ckpt
    ents = ckpt.entries
    storage = storage_for(env)
    compute = dtype or plan.compute_dtype
    steps: list = []
    # fp8 tensors: codes and scales straight into buffers.
    by_module: dict[int, list] = {}
    for qt in plan.quant:
        mod = qt.module
        if is_patched_by(mod, _RECIPE):
            # Converted already (checked: same shapes and scales): new values in buffers of the same kind and place.
            old = mod._buffers[qt.name]
            kind, where = ("uint8" if old.dtype == torch.uint8 else "float8"), old.device
        else:
            kind, where = storage, dev
            by_module.setdefault(id(mod), []).append(qt)

        requant = requantize == "rowwise" and qt.scheme == "block" and not is_patched_by(mod, _RECIPE)

        def read(qt=qt, kind=kind, where=where, requant=requant) -> dict:
            codes, scale = _assemble(qt, ckpt, kind, where)
            if requant:
                codes, scale = _requantize_rowwise(codes, scale, qt.block)
            return {qt.name: codes, qt.name + "_scale": scale}

        steps.append(_tensor_step(mod, qt.path, read))
    # Plain tensors, one at a time.
    for g in plan.plain:

        def read_plain(g=g) -> torch.Tensor:
            e = ents[g.source]
            if g.pieces:
                t = torch.empty(g.shape, dtype=ST_DTYPES[e.dtype])
                for key, ex in g.pieces:
                    read_tensor(ents[key], out=t[ex])
            else:
                t = read_tensor(e)
                if g.src_rows is not None:
                    t = t[g.src_rows[0] : g.src_rows[1]].clone()
            if dtype is not None and t.is_floating_point():
                t = t.to(dtype)
            return t.to(dev)

        def make_plain(g=g, read_plain=read_plain):
            t = read_plain()
            with Changes() as ch:
                for mod, attr, is_param in g.holders:
                    value = torch.nn.Parameter(t, requires_grad=False) if is_param else t
                    ch.add(replace_tensors(mod, {attr: value}, explanation=_HINT, description=f"load {g.key}"))
            return ch.patch(reversible=False, description=f"load {g.key}")

        steps.append(Adopted(_RECIPE, g.key, make_plain))

    def make_buffers():
        # Non-persistent buffers that a meta-device build left without data (rotary tables) are rebuilt; those
        # built with data (accelerate's init_empty_weights keeps buffers real, on the CPU) go where the model computes.
        with Changes() as ch:
            if plan.rebuild:
                rebuilt = _donor_buffers(plan.root, plan.rebuild, dev)
                for mod, b in plan.rebuild:
                    ch.add(replace_tensors(mod, {b: rebuilt[(id(mod), b)]}, explanation=_HINT))
            for mod in plan.root.modules():
                for b in list(mod._non_persistent_buffers_set):
                    t = mod._buffers.get(b)
                    if t is not None and t.device.type not in ("meta", dev.type):
                        ch.add(replace_tensors(mod, {b: t.to(dev)}, explanation=_HINT))
        return ch.patch(reversible=False, description="buffers of the model")

    steps.append(Adopted(_RECIPE, plan.prefix or "<root>", make_buffers))
    # The fp8 layers: the recipe's decision and layer (class, state, forward), as after patch(fp8=...).
    where = f"{ckpt.name} ({ckpt.format})"
    for qts in by_module.values():
        mod, path = qts[0].module, qts[0].path
        schemes = sorted({q.scheme for q in qts})
        if "block" in schemes and len(schemes) > 1:
            raise Fp8MismatchError(
                f"{path}: block-scaled and other fp8 tensors in one experts module ({schemes}); nothing was changed"
            )
        requant = requantize == "rowwise" and schemes == ["block"]
        if requant:
            nbytes = sum(math.prod(q.shape) + 4 * math.prod(q.shape[:-1]) for q in qts)
        else:
            nbytes = sum(math.prod(q.shape) + 4 * math.prod(q.scale_shape) for q in qts)
        layer = LoadedLayer(
            kind=qts[0].kind,
            granularity="rowwise" if requant else "+".join(schemes),
            shapes=tuple(q.shape for q in qts),
            compute_dtype=compute,
            nbytes=nbytes,
            source=where,
            loaded_from=str(ckpt.path),
            format=ckpt.format,
            block=qts[0].block if schemes == ["block"] and not requant else None,
            requantized_from=qts[0].block if requant else None,
        )
        decision = recipe.decide_loaded(mod, path, env, layer)
        steps.append(
            Adopted(
                _RECIPE,
                path,
                functools.partial(recipe.loaded_layer, mod, path, decision),
                module=mod,
                decision=decision,
            )
        )
    return steps
