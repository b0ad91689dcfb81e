"""Reading fp8 checkpoints as people publish them: safetensors files and sharded folders, four formats.

Formats (:data:`FORMATS`), each detected explicitly (:func:`detect`), never guessed from file names:

* ``mpsboost`` -- written by :func:`mpsboost.save_fp8`: metadata ``format = mpsboost.fp8``; codes
  ``<module>.<tensor>`` (``F8_E4M3``) with float32 ``<module>.<tensor>_scale`` (``[]``, ``[N, 1]``,
  per-expert ``[E, 1, 1]``/``[E, N, 1]``, or block scales).
* ``transformers-fp8`` -- transformers' fine-grained FP8 (Qwen3-*-FP8, DeepSeek-V3/R1):
  ``config.json`` ``quantization_config.quant_method == "fp8"`` with ``weight_block_size`` (e.g.
  ``[128, 128]``); codes ``<module>.weight`` with ``<module>.weight_scale_inv`` ``[ceil(N/bn),
  ceil(K/bk)]`` (float32, or UE8M0 ``F8_E8M0``); value = code * scale_inv. MoE experts either as 3-D
  stacks (``experts.gate_up_proj`` + ``experts.gate_up_proj_scale_inv``) or, as in the published
  checkpoints, one 2-D Linear per expert (``experts.<e>.gate_proj.weight`` ...).
* ``compressed-tensors`` -- ``quantization_config.quant_method == "compressed-tensors"``,
  ``format`` ``float-quantized`` (or ``naive-quantized``) with 8-bit float weights: codes
  ``<module>.weight`` with ``<module>.weight_scale`` per tensor (``[1]``), per channel (``[N, 1]``) or
  per block (``block_structure``); ``input_scale`` (static activation scales) is not used by a
  weight-only forward and is ignored.
* ``scaled_fp8`` -- single files of diffusion UIs (Wan2.x, Qwen-Image): a ``scaled_fp8`` marker
  tensor and a ``<module>.scale_weight`` (one float32) per fp8 weight; module names are the original
  repository's and are mapped onto diffusers' through diffusers' own single-file key conversion
  (``SINGLE_FILE_LOADABLE_CLASSES[cls]["checkpoint_mapping_fn"]``) where it has one.

Tensors are read with plain file reads into tensors allocated for them (no memory map), one at a
time, so the only memory a load needs is the model itself plus the tensor being read.

This module imports neither diffusers nor transformers at import time.
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from ...errors import Fp8FileError

__all__ = [
    "FORMATS",
    "TensorEntry",
    "Checkpoint",
    "open_checkpoint",
    "detect",
    "read_tensor",
    "scale_to_float32",
    "ST_DTYPES",
    "TORCH_TO_ST",
    "plan_load",
    "describe_checkpoint",
]

FORMATS = ("mpsboost", "transformers-fp8", "compressed-tensors", "scaled_fp8")

ST_DTYPES: dict[str, torch.dtype] = {
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
if hasattr(torch, "float8_e8m0fnu"):
    ST_DTYPES["F8_E8M0"] = torch.float8_e8m0fnu
_ITEMSIZE = {
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "BF16": 2,
    "F16": 2,
    "F32": 4,
    "F64": 8,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}
TORCH_TO_ST = {v: k for k, v in ST_DTYPES.items()}
# mpsboost's own folder names first (save_fp8 writes them: plain loaders do not read them), then Hugging Face's.
_INDEX_NAMES = (
    "model.fp8.safetensors.index.json",
    "model.safetensors.index.json",
    "diffusion_pytorch_model.safetensors.index.json",
)
_SINGLE_NAMES = ("model.fp8.safetensors", "model.safetensors", "diffusion_pytorch_model.safetensors")
# The shard that save_fp8's decoy indexes name (checkpoints.DECOY_SHARD): such an index is not the weights' own.
_DECOY_MARK = "load-it-with-mpsboost.load_fp8"


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes are: file, safetensors dtype, shape and absolute byte range."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass
class Checkpoint:
    """A safetensors checkpoint (one file, or a folder with shards and an index), headers read, no data."""

    path: Path
    files: list[Path]
    entries: dict[str, TensorEntry]
    metadata: dict[str, str]
    config: Optional[dict] = None
    format: str = ""
    # Per format: "block" (bn, bk) or None, "scheme" text, ...
    info: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def nbytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)


# ------------------------------------------------------------------------------------------ reading


# The one safetensors header reader of mpsboost: this module imports no other fp8 module at import
# time (mpsboost.checkpoints imports it, never the other way round).
def safetensors_header(path: Path, what: str) -> tuple[int, dict]:
    """(header length, the JSON header as a dict) of a safetensors file, read from its first bytes only;
    ``what`` opens every error message (a truncated file, a wrong length, a header that is not JSON)."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise Fp8FileError(f"{what}: it has {size} bytes, fewer than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, 100 * 2**20):
            raise Fp8FileError(
                f"{what}: its first 8 bytes announce a {n}-byte header in a {size}-byte file "
                "(truncated, or not safetensors)"
            )
        try:
            header = json.loads(fh.read(n).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise Fp8FileError(f"{what}: its header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise Fp8FileError(f"{what}: its header is not a JSON object")
    return n, header


def _header(path: Path) -> tuple[dict[str, str], dict[str, TensorEntry]]:
    what = f"{path.name} is not a readable safetensors file"
    n, header = safetensors_header(path, what)
    size = path.stat().st_size
    meta = header.pop("__metadata__", None) or {}
    entries: dict[str, TensorEntry] = {}
    end = 0
    base = 8 + n
    for key, info in header.items():
        try:
            dt, shape, (a, b) = info["dtype"], tuple(int(x) for x in info["shape"]), info["data_offsets"]
            a, b = int(a), int(b)
        except (KeyError, TypeError, ValueError):
            raise Fp8FileError(f"{what}: malformed header entry for tensor {key!r}") from None
        if dt not in _ITEMSIZE:
            raise Fp8FileError(f"{path.name}: tensor {key!r} has dtype {dt}, which mpsboost does not read")
        numel = 1
        for s in shape:
            numel *= s
        if b - a != numel * _ITEMSIZE[dt] or a < 0:
            raise Fp8FileError(
                f"{what}: tensor {key!r} {dt} {list(shape)} spans {b - a} bytes, expected {numel * _ITEMSIZE[dt]}"
            )
        entries[key] = TensorEntry(path, dt, shape, base + a, base + b)
        end = max(end, b)
    if base + end != size:
        raise Fp8FileError(
            f"{path.name}: the header describes {base + end} bytes but the file has {size} (truncated or padded)"
        )
    return {str(k): str(v) for k, v in meta.items()}, entries


def read_tensor(entry: TensorEntry, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The tensor of ``entry`` on the CPU, read straight into its own memory (or into ``out``, same bytes)."""
    dtype = ST_DTYPES[entry.dtype]
    t = out if out is not None else torch.empty(entry.shape, dtype=dtype)
    if t.numel() * t.element_size() != entry.nbytes or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"read_tensor: destination does not fit {entry.dtype} {list(entry.shape)}")
    if entry.nbytes:
        buf = memoryview(t.view(-1).view(torch.uint8).numpy())
        with open(entry.file, "rb") as fh:
            fh.seek(entry.begin)
            got = fh.readinto(buf)
        if got != entry.nbytes:
            raise Fp8FileError(
                f"{entry.file.name}: short read at byte {entry.begin} ({got} of {entry.nbytes} bytes): "
                "the file changed or is truncated"
            )
    return t


def scale_to_float32(entry: TensorEntry) -> torch.Tensor:
    """A scale tensor as float32, exactly (F32, BF16, F16, or UE8M0 powers of two)."""
    if entry.dtype == "F8_E8M0":
        raw = read_tensor(TensorEntry(entry.file, "U8", entry.shape, entry.begin, entry.end)).to(torch.int32)
        # UE8M0: value 2^(e - 127); 0xFF is NaN.
        val = torch.ldexp(torch.ones(raw.shape), (raw - 127).float())
        return torch.where(raw == 255, torch.full_like(val, float("nan")), val)
    if entry.dtype not in ("F32", "BF16", "F16", "F64"):
        raise Fp8FileError(
            f"{entry.file.name}: a scale tensor has dtype {entry.dtype}; scales are F32, BF16, F16 or F8_E8M0"
        )
    return read_tensor(entry).float()


# ------------------------------------------------------------------------------------------ opening


def _shard_files(folder: Path) -> tuple[list[Path], Optional[dict[str, str]]]:
    for name in _INDEX_NAMES:
        idx = folder / name
        if idx.is_file():
            try:
                data = json.loads(idx.read_text())
                weight_map = data["weight_map"]
                if not isinstance(weight_map, dict):
                    raise TypeError
            except (json.JSONDecodeError, KeyError, TypeError):
                raise Fp8FileError(f"{idx}: not a shard index (a JSON object with a 'weight_map')") from None
            files = sorted({str(v) for v in weight_map.values()})
            if files and all(_DECOY_MARK in f for f in files):
                continue  # save_fp8's guard against plain from_pretrained, not an index of this folder's weights
            missing = [f for f in files if not (folder / f).is_file()]
            if missing:
                raise Fp8FileError(
                    f"{folder.name}: partial checkpoint: the index {name} lists shard(s) {missing[:3]} "
                    "that are not in the folder"
                )
            return [folder / f for f in files], {str(k): str(v) for k, v in weight_map.items()}
    for name in _SINGLE_NAMES:
        if (folder / name).is_file():
            return [folder / name], None
    found = sorted(folder.glob("*.safetensors"))
    if len(found) == 1:
        return found, None
    if not found:
        raise Fp8FileError(
            f"{folder}: no safetensors file (model.safetensors, diffusion_pytorch_model.safetensors, or a shard index)"
        )
    if all(re.search(r"-\d{5}-of-\d{5}\.safetensors$", f.name) for f in found):
        raise Fp8FileError(
            f"{folder}: shards {[f.name for f in found[:3]]} without their index "
            "(model.safetensors.index.json): partial checkpoint"
        )
    raise Fp8FileError(
        f"{folder}: several safetensors files {[f.name for f in found[:4]]} and no index; pass the one to load"
    )


def open_checkpoint(path: Any, *, config: Optional[dict] = None) -> Checkpoint:
    """Read the headers (every shard's) of the checkpoint at ``path``; detect its format. No tensor data is read."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}: {path!r}")
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"fp8 checkpoint {str(p)!r} does not exist")
    if p.is_dir():
        files, weight_map = _shard_files(p)
        cfg_file = p / "config.json"
    else:
        files, weight_map = [p], None
        cfg_file = p.parent / "config.json"
    if config is None and cfg_file.is_file():
        try:
            config = json.loads(cfg_file.read_text())
        except json.JSONDecodeError:
            raise Fp8FileError(f"{cfg_file}: not JSON") from None
    entries: dict[str, TensorEntry] = {}
    metadata: dict[str, str] = {}
    for f in files:
        meta, ents = _header(f)
        for k in ents:
            if k in entries:
                raise Fp8FileError(f"{p.name}: tensor {k!r} is in both {entries[k].file.name} and {f.name}")
        entries.update(ents)
        for k, v in meta.items():
            metadata.setdefault(k, v)
    if weight_map is not None:
        lost = [k for k, f in weight_map.items() if k not in entries or entries[k].file.name != Path(f).name]
        if lost:
            raise Fp8FileError(
                f"{p.name}: partial checkpoint: {len(lost)} tensor(s) of the index are not in their shard, "
                f"e.g. {lost[:3]}"
            )
    if config is None and "config" in metadata:
        try:
            config = json.loads(metadata["config"])
        except json.JSONDecodeError:
            raise Fp8FileError(f"{p.name}: its metadata 'config' is not JSON") from None
    ckpt = Checkpoint(p, files, entries, metadata, config)
    detect(ckpt)
    return ckpt


# ------------------------------------------------------------------------------------------ detecting


def _qconfig(ckpt: Checkpoint) -> Optional[dict]:
    cfg = ckpt.config or {}
    q = cfg.get("quantization_config")
    if q is None and isinstance(cfg.get("text_config"), dict):
        q = cfg["text_config"].get("quantization_config")
    return q if isinstance(q, dict) else None


def _fp8_keys(ckpt: Checkpoint) -> list[str]:
    return [k for k, e in ckpt.entries.items() if e.dtype == "F8_E4M3"]


def detect(ckpt: Checkpoint) -> str:
    """Set and return ``ckpt.format`` (one of :data:`FORMATS`); raise :class:`Fp8FileError` saying why none fits."""
    meta, ents = ckpt.metadata, ckpt.entries
    q = _qconfig(ckpt)
    method = (q or {}).get("quant_method")
    if meta.get("format") == "mpsboost.fp8":
        ver = meta.get("format_version")
        if ver != "2":
            raise Fp8FileError(f"{ckpt.name} has mpsboost fp8 format version {ver!r}; this mpsboost reads '2'")
        ckpt.format = "mpsboost"
        ckpt.info = {"version": ver}
        try:
            ckpt.info["modules"] = json.loads(meta.get("modules", "{}"))
        except json.JSONDecodeError:
            raise Fp8FileError(f"{ckpt.name}: its module list (metadata 'modules') is not JSON") from None
        return ckpt.format
    if method == "fp8" or (method is None and any(k.endswith("scale_inv") for k in ents)):
        block = (q or {}).get("weight_block_size", None if q is not None else "infer")
        if block not in (None, "infer"):
            if not (
                isinstance(block, (list, tuple))
                and len(block) == 2
                and all(isinstance(b, int) and b > 0 for b in block)
            ):
                raise Fp8FileError(
                    f"{ckpt.name}: transformers-fp8 quantization_config.weight_block_size={block!r}; "
                    "expected two positive ints such as [128, 128]"
                )
            block = (int(block[0]), int(block[1]))
        if not any(k.endswith("scale_inv") for k in ents):
            raise Fp8FileError(
                f"{ckpt.name}: transformers-fp8 checkpoint (quant_method 'fp8') "
                "without any '*.weight_scale_inv' tensor: partial or mislabelled"
            )
        ckpt.format = "transformers-fp8"
        ckpt.info = {"block": block, "ignored_suffixes": (".activation_scale", ".input_scale", "_activation_scale")}
        return ckpt.format
    if method == "compressed-tensors" or (
        method is None and "scaled_fp8" not in ents and any(k.endswith(".weight_scale") for k in ents)
    ):
        fmt = (q or {}).get("format", "float-quantized")
        if fmt not in ("float-quantized", "naive-quantized"):
            raise Fp8FileError(
                f"{ckpt.name}: compressed-tensors format {fmt!r}; "
                "mpsboost reads 'float-quantized' (8-bit float weights) only"
            )
        block = None
        for group in ((q or {}).get("config_groups") or {}).values():
            w = (group or {}).get("weights") or {}
            if w and (w.get("type") != "float" or int(w.get("num_bits", 8)) != 8):
                raise Fp8FileError(
                    f"{ckpt.name}: compressed-tensors weights {w.get('type')} {w.get('num_bits')}-bit; "
                    "mpsboost reads 8-bit float weights only"
                )
            if w.get("strategy") == "block":
                bs = w.get("block_structure")
                if not (isinstance(bs, (list, tuple)) and len(bs) == 2):
                    raise Fp8FileError(
                        f"{ckpt.name}: compressed-tensors block strategy without a block_structure [bn, bk]"
                    )
                block = (int(bs[0]), int(bs[1]))
        if not any(k.endswith(".weight_scale") for k in ents):
            raise Fp8FileError(
                f"{ckpt.name}: compressed-tensors checkpoint without any '*.weight_scale' tensor: "
                "partial or not float-quantized"
            )
        ckpt.format = "compressed-tensors"
        ckpt.info = {
            "block": block,
            "ignored_suffixes": (".input_scale", ".weight_zero_point", ".input_zero_point", ".output_scale"),
        }
        return ckpt.format
    if "scaled_fp8" in ents:
        if not any(k.endswith(".scale_weight") for k in ents):
            raise Fp8FileError(f"{ckpt.name}: scaled_fp8 marker present but no '*.scale_weight' tensor: partial file")
        ckpt.format = "scaled_fp8"
        ckpt.info = {"ignored_suffixes": (".scale_input",)}
        return ckpt.format
    fp8 = _fp8_keys(ckpt)
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


# ------------------------------------------------------------------------------------------ planning a load


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


def _scale_key(fmt: str, codes: str) -> str:
    if fmt == "scaled_fp8":
        return codes[: -len("weight")] + "scale_weight" if codes.endswith(".weight") else codes + "_scale_weight"
    if fmt == "transformers-fp8":
        return codes + "_scale_inv"
    return codes + "_scale"


def _key_mapper(
    ckpt: Checkpoint, root: torch.nn.Module, model_keys: list[str]
) -> tuple[dict[str, tuple[str, Optional[tuple[int, int]]]], list[str]]:
    """{model key -> (file key, source row slice)} for the format's naming, and problems."""
    ents = ckpt.entries
    if ckpt.format == "scaled_fp8":
        return _diffusers_key_map(ckpt, root, model_keys)
    # transformers: a base model (Qwen3Model) against a ForCausalLM file, or the other way round; and the
    # multimodal wrappers' text prefix: Qwen3.5/3.6-MoE files are Qwen3_5MoeForConditionalGeneration's
    # (``model.language_model.*``, ``lm_head.*``), which transformers maps onto Qwen3_5MoeForCausalLM's
    # ``model.*`` with PrefixChange(prefix_to_remove="language_model", model_prefix="model")
    # (conversion_mapping.py, "qwen3_5_text"); a text-only file onto the wrapper is the reverse.
    best, best_hits = None, -1
    for fn in _KEY_MAPS:
        hits = sum(fn(k) in ents for k in model_keys)
        if hits > best_hits:
            best, best_hits = fn, hits
    return {k: (best(k), None) for k in model_keys}, []


_LM = "model.language_model."


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
            if re.match(rf"(?:{key}){boundary}", file_module):
                return True
        except re.error:
            pass
        if file_module.endswith(key):
            return True
    return False


def _diffusers_key_map(ckpt: Checkpoint, root: torch.nn.Module, model_keys: list[str]):
    """Map a single-file checkpoint's keys onto diffusers' names with diffusers' own conversion function.

    The conversion runs on meta tensors of the file's shapes (nothing is read); each converted tensor
    is traced back to its source by identity, or as a row slice of one source (split projections).
    """
    skip = ("scaled_fp8",)
    ignored = ckpt.info.get("ignored_suffixes", ())
    src = {
        k: e
        for k, e in ckpt.entries.items()
        if k not in skip and not k.endswith(ignored) and not k.endswith(".scale_weight")
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
            row = max(1, t[0].numel()) if t.dim() > 1 else 1
            start = t.storage_offset() // row
            out[key] = (by_id[id(base)], (start, start + t.shape[0]))
            continue
        problems.append(
            f"{key}: diffusers' conversion builds it from several tensors of the file; "
            "mpsboost loads renamed or row-split tensors only"
        )
    return out, problems


def _entry_scheme(
    codes_shape: tuple[int, ...], scale_shape: tuple[int, ...], block: Optional[tuple[int, int]]
) -> Optional[str]:
    """The scale layout of one fp8 source tensor: "block", "tensorwise" or "rowwise"; None when it fits none."""
    from ...ops.fp8_block import check_block_scale

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


def _module_block(ckpt: Checkpoint, path_rel: str) -> Optional[tuple[int, int]]:
    if ckpt.format == "mpsboost":
        info = ckpt.info.get("modules", {}).get(path_rel) or {}
        b = info.get("block")
        return (int(b[0]), int(b[1])) if b else None
    b = ckpt.info.get("block")
    if b == "infer":
        return (128, 128)  # transformers' default weight_block_size, checked against every scale shape
    return b


def plan_load(root: torch.nn.Module, ckpt: Checkpoint, prefix: str = "") -> LoadPlan:  # noqa: C901  (issue 39: split it below complexity 25)
    """What loading ``ckpt`` into ``root`` means, tensor by tensor; ``plan.problems`` lists every mismatch.

    Changes nothing: the model may be on the meta device or hold real weights.
    """
    from .layers import expert_weight_names as _expert_weight_names, is_hf_experts as _is_hf_experts, plain_linear
    from ...registry import join_path

    plan = LoadPlan(ckpt, root, prefix)
    ents = ckpt.entries
    fmt = ckpt.format
    # Every persistent tensor of the model, with its holders (tied weights share one entry).
    groups: dict[int, PTensor] = {}
    order: list[int] = []
    for mname, mod in root.named_modules(remove_duplicate=False):
        for pname, p in list(mod._parameters.items()):
            if p is None:
                continue
            key = f"{mname}.{pname}" if mname else pname
            if id(p) not in groups:
                groups[id(p)] = PTensor(key, [], "", tuple(p.shape))
                order.append(id(p))
            if (mod, pname, True) not in groups[id(p)].holders:
                groups[id(p)].holders.append((mod, pname, True))
                groups[id(p)].keys.append(key)
        for bname, b in list(mod._buffers.items()):
            if b is None:
                continue
            if bname in mod._non_persistent_buffers_set:
                if b.device.type == "meta" and (mod, bname) not in plan.rebuild:
                    plan.rebuild.append((mod, bname))
                continue
            key = f"{mname}.{bname}" if mname else bname
            if id(b) not in groups:
                groups[id(b)] = PTensor(key, [], "", tuple(b.shape))
                order.append(id(b))
            if (mod, bname, False) not in groups[id(b)].holders:
                groups[id(b)].holders.append((mod, bname, False))
                groups[id(b)].keys.append(key)
    # Every name of a tied tensor counts: a file may hold either.
    kmap, problems = _key_mapper(ckpt, root, [k for i in order for k in groups[i].keys])
    plan.problems += problems
    used: set[str] = set()
    quant_ids: set[int] = set()

    def src_of(mkey: str) -> Optional[tuple[str, Optional[tuple[int, int]]]]:
        hit = kmap.get(mkey)
        return hit if hit is not None and hit[0] in ents else None

    # 1. fp8 weights: linear layers and experts stacks.
    for mname, mod in root.named_modules():
        path = join_path(prefix, mname)
        if isinstance(mod, torch.nn.Linear) or (
            mod._parameters.get("weight") is not None and mod.weight.dim() == 2 and not _is_hf_experts(mod)
        ):
            s = src_of(f"{mname}.weight" if mname else "weight")
            if s is not None and ents[s[0]].dtype != "F8_E4M3" and _scale_key(fmt, s[0]) in ents:
                plan.problems.append(
                    f"{s[0]}: dtype {ents[s[0]].dtype} in the file next to its scale {_scale_key(fmt, s[0])}; "
                    "expected F8_E4M3 codes"
                )
                continue
            if s is None or ents[s[0]].dtype != "F8_E4M3":
                continue
            if not plain_linear(mod):
                plan.problems.append(
                    f"{path}.weight: fp8 codes in the file, but the model's module is a {type(mod).__name__}; "
                    "mpsboost loads fp8 into torch.nn.Linear layers"
                )
                continue
            w = mod.weight
            if len(groups[id(w)].holders) > 1:
                plan.problems.append(
                    f"{path}.weight: fp8 codes in the file for a weight the model ties to another module"
                )
                continue
            qt = QTensor(
                path,
                mod,
                "weight",
                "linear",
                tuple(w.shape),
                [Part(s[0], _scale_key(fmt, s[0]), None, (0, w.shape[0]), s[1])],
                block=_module_block(ckpt, mname),
            )
            plan.quant.append(qt)
            quant_ids.add(id(w))
            quant_ids.add(
                id(mod._buffers.get("weight_scale"))
            )  # a module converted already: its scales are replaced too
        elif _is_hf_experts(mod):
            tr = bool(getattr(mod, "is_transposed", False))
            for name in _expert_weight_names(mod):
                w = getattr(mod, name, None)
                if not isinstance(w, torch.Tensor) or w.dim() != 3:
                    continue
                key = f"{mname}.{name}"
                e_count = w.shape[0]
                s = src_of(key)
                parts: list[Part] = []
                pieces: list[tuple[str, int]] = []
                if s is not None:
                    if ents[s[0]].dtype != "F8_E4M3":
                        continue  # a plain stack: loaded below
                    parts = [Part(s[0], _scale_key(fmt, s[0]), None, (0, w.shape[1]), s[1])]
                else:
                    # One 2-D Linear per expert, as the published checkpoints store them.
                    names = {
                        "gate_up_proj": ("gate_proj", "up_proj"),
                        "up_proj": ("up_proj",),
                        "down_proj": ("down_proj",),
                    }[name]
                    base = kmap.get(key, (key, None))[0][: -len(name)]
                    first = f"{base}0.{names[0]}.weight"
                    if first not in ents:
                        continue  # reported as missing below
                    if tr:
                        plan.problems.append(
                            f"{path}.{name}: per-expert weights in the file, "
                            "but the model stores experts transposed [E, in, out]"
                        )
                        continue
                    is_fp8 = ents[first].dtype == "F8_E4M3"
                    row = 0
                    for sub in names:
                        rows = None
                        for e in range(e_count):
                            k2 = f"{base}{e}.{sub}.weight"
                            if k2 not in ents:
                                plan.problems.append(
                                    f"{k2}: missing from the file (expert {e} of {e_count} for {path}.{name})"
                                )
                                continue
                            rows = ents[k2].shape[0]
                            if is_fp8:
                                parts.append(Part(k2, _scale_key(fmt, k2), e, (row, row + rows)))
                            else:
                                pieces.append((k2, e))
                        row += rows or 0
                    if not is_fp8:
                        if len(names) > 1:
                            plan.problems.append(
                                f"{path}.{name}: per-expert {names} in a plain dtype; mpsboost stacks fp8 experts only"
                            )
                        else:
                            g = groups[id(w)]
                            g.source, g.pieces = first, pieces
                            used.update(k for k, _ in pieces)
                            plan.plain.append(g)
                        quant_ids.add(id(w))
                        continue
                qt = QTensor(path, mod, name, "experts", tuple(w.shape), parts, block=_module_block(ckpt, mname))
                plan.quant.append(qt)
                quant_ids.add(id(w))
                quant_ids.add(id(mod._buffers.get(name + "_scale")))
    # 2. scales and schemes of every fp8 tensor.
    for qt in plan.quant:
        for part in qt.parts:
            used.add(part.codes)
            if fmt == "transformers-fp8" and _not_converted(ckpt, part.codes.rsplit(".", 1)[0]):
                plan.problems.append(
                    f"{part.codes}: fp8 codes in the file for a module its quantization_config.modules_to_not_convert "
                    "keeps in high precision (a broken export)"
                )
            ce = ents[part.codes]
            if part.scale not in ents:
                plan.problems.append(f"{part.scale}: missing from the file ({ckpt.format} scale of {part.codes})")
                continue
            used.add(part.scale)
            se = ents[part.scale]
            if se.dtype == "F8_E4M3" or se.dtype.startswith("I") or se.dtype in ("U8", "BOOL"):
                plan.problems.append(f"{part.scale}: dtype {se.dtype}; scales are F32, BF16, F16 or F8_E8M0")
                continue
            cshape = ce.shape if part.src_rows is None else (part.src_rows[1] - part.src_rows[0],) + ce.shape[1:]
            want = qt.shape[-2:] if qt.kind == "linear" else qt.shape[1:]
            if qt.kind == "experts" and part.expert is None:
                bad_shape = tuple(ce.shape) != qt.shape
            else:
                bad_shape = (
                    len(cshape) != 2
                    or cshape[1] != want[-1]
                    or (qt.kind == "linear" and cshape[0] != want[0])
                    or (part.expert is not None and part.rows[1] > want[0])
                )
            if bad_shape:
                plan.problems.append(
                    f"{part.codes}: shape {list(cshape)} in the file, "
                    f"the model's {qt.path}.{qt.name} is {list(qt.shape)}"
                )
                continue
            sch = _entry_scheme(ce.shape, se.shape, qt.block)
            if sch is None:
                plan.problems.append(
                    f"{part.scale}: shape {list(se.shape)} is no {ckpt.format} scale layout for codes {list(ce.shape)}"
                    + (f" with blocks {list(qt.block)}" if qt.block else "")
                )
                continue
            if part.src_rows is not None and sch == "block" and part.src_rows[0] % qt.block[0]:
                plan.problems.append(
                    f"{part.codes}: split at row {part.src_rows[0]}, inside a scale block of {qt.block[0]} rows"
                )
                continue
            part.scheme = sch
        schemes = {p.scheme for p in qt.parts}
        if "" in schemes:
            continue
        if qt.kind == "experts" and any(p.expert is not None for p in qt.parts):
            covered = max(p.rows[1] for p in qt.parts)
            if covered != qt.shape[1]:
                plan.problems.append(
                    f"{qt.path}.{qt.name}: the per-expert tensors give {covered} rows, the model has {qt.shape[1]}"
                )
                continue
        per_matrix = {}
        for p in qt.parts:
            per_matrix[p.expert] = per_matrix.get(p.expert, 0) + 1
        if (
            schemes == {"tensorwise"}
            and all(v == 1 for v in per_matrix.values())
            and all(p.src_rows is None for p in qt.parts)
        ):
            qt.scheme = "tensorwise"
        elif "block" not in schemes:
            qt.scheme = "rowwise"  # per-tensor scales of stacked or split parts become exact per-row scales
        elif schemes == {"block"} and all(p.rows[0] % qt.block[0] == 0 for p in qt.parts):
            qt.scheme = "block"
        else:
            plan.problems.append(f"{qt.path}.{qt.name}: parts with scales {sorted(schemes)} cannot be joined exactly")
    # 3. plain tensors.
    for i in order:
        g = groups[i]
        if i in quant_ids:
            continue
        found = next((s for s in map(src_of, g.keys) if s is not None), None)
        if found is None:
            plan.problems.append(f"{join_path(prefix, g.key)}: missing from the file")
            continue
        key, rows = found
        e = ents[key]
        shape = e.shape if rows is None else (rows[1] - rows[0],) + e.shape[1:]
        if tuple(shape) != g.shape:
            plan.problems.append(
                f"{key}: shape {list(shape)} in the file, the model's {join_path(prefix, g.key)} is {list(g.shape)}"
            )
            continue
        if e.dtype == "F8_E4M3":
            plan.problems.append(
                f"{key}: fp8 codes for {join_path(prefix, g.key)}, which is not a Linear weight or experts stack"
            )
            continue
        model_t = getattr(g.holders[0][0], g.holders[0][1])
        if model_t.is_floating_point() != ST_DTYPES[e.dtype].is_floating_point:
            plan.problems.append(f"{key}: dtype {e.dtype} in the file, the model's is {model_t.dtype}")
            continue
        g.source, g.src_rows = key, rows
        used.add(key)
        plan.plain.append(g)
    if fmt == "mpsboost":
        listed = ckpt.info.get("modules", {})
        have = {join_path("", q.path[len(prefix) + 1 :] if prefix else q.path) for q in plan.quant}
        for m in sorted(set(listed) - have):
            plan.problems.append(
                f"{m}: listed among the file's fp8 modules, "
                f"but this {type(root).__name__} has no fp8 codes for it there"
            )
    ignored = tuple(ckpt.info.get("ignored_suffixes", ()))
    plan.ignored = sorted(_ignored_keys(ckpt, root, used))
    skip = set(plan.ignored)
    extra = sorted(k for k in ents if k not in used and k not in skip and k != "scaled_fp8" and not k.endswith(ignored))
    if extra:
        plan.problems.append(
            f"{len(extra)} tensor(s) in the file belong to no tensor of this {type(root).__name__}: {extra[:4]}"
            + (" ..." if len(extra) > 4 else "")
        )
    # The compute dtype of fp8 layers: the dtype most plain floating bytes of the file have.
    counts: dict[str, int] = {}
    for g in plan.plain:
        e = ents[g.source]
        if e.dtype in ("BF16", "F16", "F32"):
            counts[e.dtype] = counts.get(e.dtype, 0) + e.nbytes
    plan.compute_dtype = ST_DTYPES[max(counts, key=counts.get)] if counts else torch.bfloat16
    return plan


# ------------------------------------------------------------------------------------------ describing


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def describe_checkpoint(path: Any, env: Any = None) -> str:
    """Which fp8 path the checkpoint at ``path`` takes in ``env`` (an :class:`mpsboost.Env`, a device
    string, or None for this machine), read from its headers only: format, scale layouts, storage and
    forward. For ``mpsboost plan`` and ``mpsboost doctor``."""
    from ...gate import Env
    from ...ops import fp8 as fp8_ops

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
    storage = fp8_ops.storage_for(env)
    from ...gate import check

    st = check("float8_storage", env)
    for folder in folders:
        ckpt = open_checkpoint(folder)
        head = f"{folder.name}: " if folder is not p else ""
        ents = ckpt.entries
        schemes: dict[str, int] = {}
        shapes: dict[tuple, int] = {}
        experts = 0
        fp8_bytes = 0
        for k, e in ents.items():
            if e.dtype != "F8_E4M3" or k == "scaled_fp8":
                continue
            fp8_bytes += e.nbytes
            sk = _scale_key(ckpt.format, k)
            rel = k.rsplit(".", 1)[0]
            block = _module_block(ckpt, rel)
            sch = _entry_scheme(e.shape, ents[sk].shape, block) if sk in ents else None
            name = (f"block {block[0]}x{block[1]}" if sch == "block" else sch) or "no scale"
            schemes[name] = schemes.get(name, 0) + 1
            if len(e.shape) == 3 or re.search(r"\.experts\.\d+\.", k):
                experts += 1
            elif len(e.shape) == 2:
                shapes[e.shape] = shapes.get(e.shape, 0) + 1
        total = ckpt.nbytes
        lines.append(
            f"  {head}format {ckpt.format}, {len(ckpt.files)} file(s), {_size(total)} "
            f"({_size(fp8_bytes)} fp8 codes); scales: " + ", ".join(f"{v} {k}" for k, v in sorted(schemes.items()))
        )
        lines.append(
            f"  {head}storage: {storage}"
            + ("" if st.ok else f" (the fp8 bytes kept as uint8 and decoded with integer ops: {st.reason})")
        )
        if any(k.startswith("block") for k in schemes):
            lines.append(
                f"  {head}block-scaled layers: dequantise this layer "
                "(code x block scale in float32, rounded once) then linear; "
                "experts: only the hit experts, one at a time"
            )
        if shapes:
            (n, k), _ = max(shapes.items(), key=lambda kv: kv[1])
            lp = fp8_ops.choose_linear_path(env, n=n, k=k, dtype=torch.bfloat16)
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
        if ckpt.format == "scaled_fp8":
            lines.append(
                f"  {head}names mapped onto diffusers' with diffusers' single-file conversion of the target class"
            )
    return "\n".join(lines)
