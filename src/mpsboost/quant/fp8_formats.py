"""fp8 checkpoints as people publish them, four formats, each a row (:class:`Fp8Format`) of :data:`FP8_FORMATS`.

Every file is read through :mod:`mpsboost.quant.io` (the one safetensors reader); the rows say what the tensors
mean. :func:`detect` asks the rows in order and takes the first whose ``detect`` recognises the checkpoint (from its
safetensors metadata, its config's ``quantization_config`` or the names of its tensors; never from file names), then
the row's ``inspect`` reads what the format says about its scales (block sizes, a module list), raising
:class:`~mpsboost.errors.Fp8FileError` for what it cannot read. The rows:

* ``mpsboost`` -- written by :func:`mpsboost.save_fp8`: metadata ``format = mpsboost.fp8``; codes
  ``<module>.<tensor>`` (``F8_E4M3``) with float32 ``<module>.<tensor>_scale`` (``[]``, ``[N, 1]``,
  per-expert ``[E, 1, 1]``/``[E, N, 1]``, or block scales: the block per module in the metadata).
* ``transformers-fp8`` -- transformers' fine-grained FP8 (Qwen3-*-FP8, DeepSeek-V3/R1):
  ``config.json`` ``quantization_config.quant_method == "fp8"`` with ``weight_block_size`` (e.g.
  ``[128, 128]``); codes ``<module>.weight`` with ``<module>.weight_scale_inv`` ``[ceil(N/bn),
  ceil(K/bk)]`` (float32, or UE8M0 ``F8_E8M0``); value = code * scale_inv. MoE experts either as 3-D
  stacks (``experts.gate_up_proj`` + ``experts.gate_up_proj_scale_inv``) or, as in the published
  checkpoints, one 2-D Linear per expert (``experts.<e>.gate_proj.weight`` ...). Modules its
  ``modules_to_not_convert`` names must not hold fp8 codes.
* ``compressed-tensors`` -- ``quantization_config.quant_method == "compressed-tensors"``,
  ``format`` ``float-quantized`` (or ``naive-quantized``) with 8-bit float weights: codes
  ``<module>.weight`` with ``<module>.weight_scale`` per tensor (``[1]``), per channel (``[N, 1]``) or
  per block (``block_structure``); ``input_scale`` (static activation scales) is not used by a
  weight-only forward and is ignored.
* ``scaled_fp8`` -- single files of diffusion UIs (Wan2.x, Qwen-Image): a ``scaled_fp8`` marker
  tensor and a ``<module>.scale_weight`` (one float32) per fp8 weight; module names are the original
  repository's and are mapped onto diffusers' through diffusers' own single-file key conversion
  (``SINGLE_FILE_LOADABLE_CLASSES[cls]["checkpoint_mapping_fn"]``) where it has one.

Every row decodes a weight as code x scale in float32; the scale layout of each tensor (per tensor, per row, per
block) follows from its shape and the row's block size (:func:`entry_scheme`); UE8M0 scales are decoded exactly
(:func:`scale_to_float32`). The load plan generic over these rows is :mod:`mpsboost.quant.fp8_plan`.

Tensors are read with plain file reads into tensors allocated for them (no memory map), one at a time, so the only
memory a load needs is the model itself plus the tensor being read. This module imports neither diffusers nor
transformers at import time.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from ..errors import Fp8FileError
from .io import ST_DTYPES, Folder, Layout, TensorEntry, open_folder, read_tensor

__all__ = [
    "Fp8Format",
    "FP8_FORMATS",
    "FORMATS",
    "FP8_LAYOUT",
    "MPSBOOST",
    "TRANSFORMERS_FP8",
    "COMPRESSED_TENSORS",
    "SCALED_FP8",
    "SCALE_DTYPES",
    "Checkpoint",
    "open_checkpoint",
    "detect",
    "row",
    "scale_to_float32",
    "entry_scheme",
]

# The shard that save_fp8's decoy indexes name (checkpoints.DECOY_SHARD): such an index is not the weights' own.
_DECOY_MARK = "load-it-with-mpsboost.load_fp8"
# mpsboost's own folder names first (save_fp8 writes them: plain loaders do not read them), then Hugging Face's.
FP8_LAYOUT = Layout(
    index_names=(
        "model.fp8.safetensors.index.json",
        "model.safetensors.index.json",
        "diffusion_pytorch_model.safetensors.index.json",
    ),
    single_names=("model.fp8.safetensors", "model.safetensors", "diffusion_pytorch_model.safetensors"),
    decoy_mark=_DECOY_MARK,
    error=Fp8FileError,
    noun="fp8 checkpoint",
)
# The scale dtypes every row decodes (scale_to_float32): UE8M0 (F8_E8M0) powers of two exactly, the rest as floats.
SCALE_DTYPES = ("F32", "BF16", "F16", "F64", "F8_E8M0")


@dataclass
class Checkpoint(Folder):
    """An fp8 checkpoint (one file, or a folder with shards and an index), headers read, no data: a
    :class:`~mpsboost.quant.io.Folder` with the row that recognised it (``row``; ``format`` its name) and what the
    row read about it (``info``: ``block`` (bn, bk) or None, ``modules``, ...)."""

    format: str = ""
    info: dict = field(default_factory=dict)
    row: Optional["Fp8Format"] = None


@dataclass(frozen=True, repr=False)
class Fp8Format:
    """One fp8 checkpoint format.

    ``detect(ckpt)`` says whether the checkpoint is this format's (its metadata, its ``quantization_config`` or its
    tensor names); ``inspect(ckpt)`` reads and checks what the format says about its scales (``ckpt.info``), raising
    :class:`~mpsboost.errors.Fp8FileError`. The scale of codes ``<key>`` is ``<key><scale_suffix>`` (or, where
    ``scale_leaf`` is set, ``<module>.<scale_leaf>`` for ``<module>.weight``); its dtype one of ``scale_dtypes``;
    ``block_of(ckpt, module)`` the block size of a module's block scales (None: per tensor or per row).
    ``ignored_suffixes`` name file tensors a weight-only forward does not use (activation scales), ``markers`` file
    tensors that mark the format and hold no weight. ``key_map(ckpt, root, model_keys)`` gives
    ``({model key: (file key, source row slice)}, problems)``. ``codes_problem(ckpt, codes_key)`` and
    ``plan_problems(plan)`` are the row's own checks (None: none); ``naming`` a line for
    :func:`~mpsboost.quant.fp8_plan.describe_checkpoint` where the row renames keys."""

    name: str
    summary: str
    detect: Callable[[Checkpoint], bool]
    inspect: Callable[[Checkpoint], dict]
    scale_suffix: str
    key_map: Callable[[Checkpoint, torch.nn.Module, list[str]], tuple[dict, list[str]]]
    block_of: Callable[[Checkpoint, str], Optional[tuple[int, int]]]
    scale_leaf: Optional[str] = None
    scale_dtypes: tuple[str, ...] = SCALE_DTYPES
    ignored_suffixes: tuple[str, ...] = ()
    markers: tuple[str, ...] = ()
    codes_problem: Optional[Callable[[Checkpoint, str], Optional[str]]] = None
    plan_problems: Optional[Callable[[Any], list[str]]] = None
    naming: str = ""

    def __repr__(self) -> str:
        return f"Fp8Format({self.name!r})"

    def scale_key(self, codes: str) -> str:
        """The file key of the scale of the codes at ``codes``."""
        if self.scale_leaf is not None and codes.endswith(".weight"):
            return codes[: -len("weight")] + self.scale_leaf
        return codes + self.scale_suffix


# ------------------------------------------------------------------------------------------ reading


def scale_to_float32(entry: TensorEntry) -> torch.Tensor:
    """A scale tensor as float32, exactly (F32, BF16, F16, F64, or UE8M0 powers of two)."""
    if entry.dtype == "F8_E8M0":
        raw = read_tensor(dataclasses.replace(entry, dtype="U8")).to(torch.int32)
        # UE8M0: value 2^(e - 127); 0xFF is NaN.
        val = torch.ldexp(torch.ones(raw.shape), (raw - 127).float())
        return torch.where(raw == 255, torch.full_like(val, float("nan")), val)
    if entry.dtype not in SCALE_DTYPES:
        raise Fp8FileError(
            f"{entry.file.name}: a scale tensor has dtype {entry.dtype}; scales are F32, BF16, F16 or F8_E8M0"
        )
    return read_tensor(entry).float()


def entry_scheme(
    codes_shape: tuple[int, ...], scale_shape: tuple[int, ...], block: Optional[tuple[int, int]]
) -> Optional[str]:
    """The scale layout of one fp8 source tensor: "block", "tensorwise" or "rowwise"; None when it fits none."""
    from ..ops.fp8_block import check_block_scale

    if block is not None and check_block_scale(codes_shape, scale_shape, block) is None:
        return "block"
    lead = tuple(codes_shape[:-2])
    n = codes_shape[-2]
    numel = 1
    for s in scale_shape:
        numel *= s
    if (not lead and numel == 1 and len(scale_shape) <= 2) or (lead and tuple(scale_shape) == lead + (1, 1)):
        return "tensorwise"
    if tuple(scale_shape) in (lead + (n, 1), lead + (n,)):
        return "rowwise"
    return None


def open_checkpoint(path: Any, *, config: Optional[dict] = None) -> Checkpoint:
    """Read the headers (every shard's) of the checkpoint at ``path``; detect its format. No tensor data is read.

    ``config`` stands for the checkpoint's ``config.json``; without either, a single file's metadata ``config``
    (what :func:`mpsboost.save_fp8` writes) is the config."""
    folder = open_folder(path, layout=FP8_LAYOUT, config=config)
    config = folder.config
    if config is None and "config" in folder.metadata:
        try:
            config = json.loads(folder.metadata["config"])
        except json.JSONDecodeError:
            raise Fp8FileError(f"{folder.name}: its metadata 'config' is not JSON") from None
    ckpt = Checkpoint(folder.path, folder.files, folder.entries, folder.metadata, config)
    detect(ckpt)
    return ckpt


# ------------------------------------------------------------------------------------------ detecting


def _qconfig(ckpt: Checkpoint) -> Optional[dict]:
    cfg = ckpt.config or {}
    q = cfg.get("quantization_config")
    if q is None and isinstance(cfg.get("text_config"), dict):
        q = cfg["text_config"].get("quantization_config")
    return q if isinstance(q, dict) else None


def _method(ckpt: Checkpoint) -> Optional[str]:
    return (_qconfig(ckpt) or {}).get("quant_method")


def detect(ckpt: Checkpoint) -> str:
    """Set ``ckpt.row``, ``ckpt.format`` (its name, one of :data:`FORMATS`) and ``ckpt.info``; return the name.

    The first row of :data:`FP8_FORMATS` that recognises the checkpoint reads it; raise :class:`Fp8FileError` saying
    why none does (float8 tensors without a known scale layout, or no fp8 checkpoint at all)."""
    found = next((r for r in FP8_FORMATS if r.detect(ckpt)), None)
    if found is None:
        fp8 = [k for k, e in ckpt.entries.items() if e.dtype == "F8_E4M3"]
        if fp8:
            raise Fp8FileError(
                f"{ckpt.name} holds {len(fp8)} float8 tensor(s) (e.g. {fp8[0]!r}) "
                "but none of the scale layouts mpsboost reads: "
                "no mpsboost metadata, no quantization_config (fp8 / compressed-tensors), no '*.weight_scale_inv', "
                "'*.weight_scale' or 'scaled_fp8' marker. Pass the folder with its config.json"
            )
        raise Fp8FileError(
            f"{ckpt.name} is not an fp8 checkpoint: no float8 tensors and none of the markers of {', '.join(FORMATS)}"
        )
    info = found.inspect(ckpt)
    ckpt.row, ckpt.format, ckpt.info = found, found.name, info
    return ckpt.format


def row(name: str) -> Fp8Format:
    """The row called ``name`` (one of :data:`FORMATS`)."""
    for r in FP8_FORMATS:
        if r.name == name:
            return r
    raise ValueError(f"no fp8 format {name!r}; the formats are {', '.join(FORMATS)}")


# ------------------------------------------------------------------------------------------ key maps

_LM = "model.language_model."

# transformers: a base model (Qwen3Model) against a ForCausalLM file, or the other way round; and the
# multimodal wrappers' text prefix: Qwen3.5/3.6-MoE files are Qwen3_5MoeForConditionalGeneration's
# (``model.language_model.*``, ``lm_head.*``), which transformers maps onto Qwen3_5MoeForCausalLM's
# ``model.*`` with PrefixChange(prefix_to_remove="language_model", model_prefix="model")
# (conversion_mapping.py, "qwen3_5_text"); a text-only file onto the wrapper is the reverse.
_KEY_MAPS = (
    lambda k: k,
    lambda k: "model." + k,
    lambda k: k.removeprefix("model."),
    lambda k: (
        _LM + k[len("model.") :] if k.startswith("model.") and not k.startswith(_LM) else k
    ),  # ForCausalLM <- wrapper file
    lambda k: _LM + k,  # the text base model <- wrapper file
    lambda k: "model." + k[len(_LM) :] if k.startswith(_LM) else k,  # wrapper <- ForCausalLM file
)


def transformers_key_map(
    ckpt: Checkpoint, root: torch.nn.Module, model_keys: list[str]
) -> tuple[dict[str, tuple[str, Optional[tuple[int, int]]]], list[str]]:
    """{model key -> (file key, None)} by the one renaming of :data:`_KEY_MAPS` that finds most keys in the file."""
    del root
    ents = ckpt.entries
    best, best_hits = None, -1
    for fn in _KEY_MAPS:
        hits = sum(fn(k) in ents for k in model_keys)
        if hits > best_hits:
            best, best_hits = fn, hits
    return {k: (best(k), None) for k in model_keys}, []


def diffusers_key_map(ckpt: Checkpoint, root: torch.nn.Module, model_keys: list[str]):
    """Map a single-file checkpoint's keys onto diffusers' names with diffusers' own conversion function.

    The conversion runs on meta tensors of the file's shapes (nothing is read); each converted tensor
    is traced back to its source by identity, or as a row slice of one source (split projections).
    """
    del model_keys
    r = ckpt.row
    leaf = "." + r.scale_leaf if r.scale_leaf else None
    src = {
        k: e
        for k, e in ckpt.entries.items()
        if k not in r.markers and not k.endswith(r.ignored_suffixes) and not (leaf and k.endswith(leaf))
    }
    fn = None
    try:
        from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES
    except ImportError:
        SINGLE_FILE_LOADABLE_CLASSES = {}
    for cls in type(root).__mro__:
        entry = SINGLE_FILE_LOADABLE_CLASSES.get(cls.__name__)
        if entry is not None:
            fn = entry.get("checkpoint_mapping_fn")
            break
    metas = {k: torch.empty(e.shape, dtype=ST_DTYPES[e.dtype], device="meta") for k, e in src.items()}
    by_id = {id(t): k for k, t in metas.items()}
    problems: list[str] = []
    if fn is not None:
        try:
            converted = fn(dict(metas), config=getattr(root, "config", None))
        except Exception as exc:  # the conversion function raises on layouts it does not know
            return {}, [
                f"diffusers' single-file conversion for {type(root).__name__} failed on this file: "
                f"{type(exc).__name__}: {exc}"
            ]
    else:
        converted = dict(metas)
    out: dict[str, tuple[str, Optional[tuple[int, int]]]] = {}
    for key, t in converted.items():
        key = key.replace("model.diffusion_model.", "", 1) if key.startswith("model.diffusion_model.") else key
        if id(t) in by_id:
            out[key] = (by_id[id(t)], None)
            continue
        base = getattr(t, "_base", None)
        if (
            base is not None
            and id(base) in by_id
            and t.dim() >= 1
            and tuple(t.shape[1:]) == tuple(base.shape[1:])
            and t.is_contiguous()
        ):
            row_numel = max(1, t[0].numel()) if t.dim() > 1 else 1
            start = t.storage_offset() // row_numel
            out[key] = (by_id[id(base)], (start, start + t.shape[0]))
            continue
        problems.append(
            f"{key}: diffusers' conversion builds it from several tensors of the file; "
            "mpsboost loads renamed or row-split tensors only"
        )
    return out, problems


# ------------------------------------------------------------------------------------------ block sizes


def config_block(ckpt: Checkpoint, module: str) -> Optional[tuple[int, int]]:
    """The block size the checkpoint's config gives every module (``ckpt.info["block"]``)."""
    del module
    b = ckpt.info.get("block")
    if b == "infer":
        return (128, 128)  # transformers' default weight_block_size, checked against every scale shape
    return b


def _module_list_block(ckpt: Checkpoint, module: str) -> Optional[tuple[int, int]]:
    info = ckpt.info.get("modules", {}).get(module) or {}
    b = info.get("block")
    return (int(b[0]), int(b[1])) if b else None


# ------------------------------------------------------------------------------------------ mpsboost


def _mpsboost_detect(ckpt: Checkpoint) -> bool:
    return ckpt.metadata.get("format") == "mpsboost.fp8"


def _mpsboost_inspect(ckpt: Checkpoint) -> dict:
    ver = ckpt.metadata.get("format_version")
    if ver != "2":
        raise Fp8FileError(f"{ckpt.name} has mpsboost fp8 format version {ver!r}; this mpsboost reads '2'")
    try:
        return {"version": ver, "modules": json.loads(ckpt.metadata.get("modules", "{}"))}
    except json.JSONDecodeError:
        raise Fp8FileError(f"{ckpt.name}: its module list (metadata 'modules') is not JSON") from None


def _mpsboost_plan_problems(plan: Any) -> list[str]:
    """Every module the file's metadata lists as fp8 must have found its codes in the model."""
    from ..registry import join_path

    prefix = plan.prefix
    listed = plan.ckpt.info.get("modules", {})
    have = {join_path("", q.path[len(prefix) + 1 :] if prefix else q.path) for q in plan.quant}
    return [
        f"{m}: listed among the file's fp8 modules, but this {type(plan.root).__name__} has no fp8 codes for it there"
        for m in sorted(set(listed) - have)
    ]


MPSBOOST = Fp8Format(
    name="mpsboost",
    summary="mpsboost.save_fp8's own (metadata format mpsboost.fp8, version 2)",
    detect=_mpsboost_detect,
    inspect=_mpsboost_inspect,
    scale_suffix="_scale",
    key_map=transformers_key_map,
    block_of=_module_list_block,
    plan_problems=_mpsboost_plan_problems,
)


# ------------------------------------------------------------------------------------------ transformers-fp8


def _tfp8_detect(ckpt: Checkpoint) -> bool:
    method = _method(ckpt)
    return method == "fp8" or (method is None and any(k.endswith("scale_inv") for k in ckpt.entries))


def _tfp8_inspect(ckpt: Checkpoint) -> dict:
    q = _qconfig(ckpt)
    block = (q or {}).get("weight_block_size", None if q is not None else "infer")
    if block not in (None, "infer"):
        if not (
            isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)
        ):
            raise Fp8FileError(
                f"{ckpt.name}: transformers-fp8 quantization_config.weight_block_size={block!r}; "
                "expected two positive ints such as [128, 128]"
            )
        block = (int(block[0]), int(block[1]))
    if not any(k.endswith("scale_inv") for k in ckpt.entries):
        raise Fp8FileError(
            f"{ckpt.name}: transformers-fp8 checkpoint (quant_method 'fp8') "
            "without any '*.weight_scale_inv' tensor: partial or mislabelled"
        )
    return {"block": block}


def _not_converted(ckpt: Checkpoint, file_module: str) -> bool:
    """Whether the checkpoint's own ``quantization_config.modules_to_not_convert`` names this module (file
    names), matched as transformers matches it (quantizers_utils.should_convert_module: a prefix up to a
    module boundary, a regex with that boundary, or a suffix)."""
    pats = (_qconfig(ckpt) or {}).get("modules_to_not_convert") or ()
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    for key in pats:
        if not isinstance(key, str):
            continue
        try:
            hit = re.match(rf"(?:{key}){boundary}", file_module) is not None
        except re.error:
            hit = False  # not a regex: transformers falls back to the suffix match below, so does this
        if hit or file_module.endswith(key):
            return True
    return False


def _tfp8_codes_problem(ckpt: Checkpoint, codes: str) -> Optional[str]:
    if _not_converted(ckpt, codes.rsplit(".", 1)[0]):
        return (
            f"{codes}: fp8 codes in the file for a module its quantization_config.modules_to_not_convert "
            "keeps in high precision (a broken export)"
        )
    return None


TRANSFORMERS_FP8 = Fp8Format(
    name="transformers-fp8",
    summary="transformers' fine-grained FP8 (quant_method fp8: Qwen3-*-FP8, DeepSeek-V3/R1)",
    detect=_tfp8_detect,
    inspect=_tfp8_inspect,
    scale_suffix="_scale_inv",
    key_map=transformers_key_map,
    block_of=config_block,
    ignored_suffixes=(".activation_scale", ".input_scale", "_activation_scale"),
    codes_problem=_tfp8_codes_problem,
)


# ------------------------------------------------------------------------------------------ compressed-tensors


def _ct_detect(ckpt: Checkpoint) -> bool:
    method = _method(ckpt)
    ents = ckpt.entries
    # Without a config, '*.weight_scale' tensors are compressed-tensors' unless the file carries scaled_fp8's marker.
    return method == "compressed-tensors" or (
        method is None and "scaled_fp8" not in ents and any(k.endswith(".weight_scale") for k in ents)
    )


def _ct_inspect(ckpt: Checkpoint) -> dict:
    q = _qconfig(ckpt) or {}
    fmt = q.get("format", "float-quantized")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise Fp8FileError(
            f"{ckpt.name}: compressed-tensors format {fmt!r}; "
            "mpsboost reads 'float-quantized' (8-bit float weights) only"
        )
    block = None
    for group in (q.get("config_groups") or {}).values():
        w = (group or {}).get("weights") or {}
        if w and (w.get("type") != "float" or int(w.get("num_bits", 8)) != 8):
            raise Fp8FileError(
                f"{ckpt.name}: compressed-tensors weights {w.get('type')} {w.get('num_bits')}-bit; "
                "mpsboost reads 8-bit float weights only"
            )
        if w.get("strategy") == "block":
            bs = w.get("block_structure")
            if not (isinstance(bs, (list, tuple)) and len(bs) == 2):
                raise Fp8FileError(f"{ckpt.name}: compressed-tensors block strategy without a block_structure [bn, bk]")
            block = (int(bs[0]), int(bs[1]))
    if not any(k.endswith(".weight_scale") for k in ckpt.entries):
        raise Fp8FileError(
            f"{ckpt.name}: compressed-tensors checkpoint without any '*.weight_scale' tensor: "
            "partial or not float-quantized"
        )
    return {"block": block}


COMPRESSED_TENSORS = Fp8Format(
    name="compressed-tensors",
    summary="compressed-tensors float-quantized (8-bit float weights, per tensor, channel or block)",
    detect=_ct_detect,
    inspect=_ct_inspect,
    scale_suffix="_scale",
    key_map=transformers_key_map,
    block_of=config_block,
    ignored_suffixes=(".input_scale", ".weight_zero_point", ".input_zero_point", ".output_scale"),
)


# ------------------------------------------------------------------------------------------ scaled_fp8


def _scaled_detect(ckpt: Checkpoint) -> bool:
    return "scaled_fp8" in ckpt.entries


def _scaled_inspect(ckpt: Checkpoint) -> dict:
    if not any(k.endswith(".scale_weight") for k in ckpt.entries):
        raise Fp8FileError(f"{ckpt.name}: scaled_fp8 marker present but no '*.scale_weight' tensor: partial file")
    return {}


SCALED_FP8 = Fp8Format(
    name="scaled_fp8",
    summary="single files of diffusion UIs (a scaled_fp8 marker, one scale_weight per fp8 weight)",
    detect=_scaled_detect,
    inspect=_scaled_inspect,
    scale_suffix="_scale_weight",
    scale_leaf="scale_weight",
    key_map=diffusers_key_map,
    block_of=config_block,
    ignored_suffixes=(".scale_input",),
    markers=("scaled_fp8",),
    naming="names mapped onto diffusers' with diffusers' single-file conversion of the target class",
)

# In the order detect asks them: a file's own metadata first, then the config's quant_method, then tensor names.
FP8_FORMATS: tuple[Fp8Format, ...] = (MPSBOOST, TRANSFORMERS_FP8, COMPRESSED_TENSORS, SCALED_FP8)
FORMATS: tuple[str, ...] = tuple(r.name for r in FP8_FORMATS)
