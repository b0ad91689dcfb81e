"""Saving and loading fp8 weights (``mpsboost.save_fp8`` / ``mpsboost.load_fp8``): safetensors only.

A file holds, for every module that ``fp8_weights`` converted, its codes as ``F8_E4M3`` (whatever
the storage on the device: uint8 bytes are the same bits) and its float32 scales, named like the
module's own state (``<path>.weight``, ``<path>.weight_scale``; experts: ``<path>.gate_up_proj``,
``<path>.gate_up_proj_scale``, ``<path>.down_proj``, ``<path>.down_proj_scale``), where ``<path>``
is the module path of the patch report (``transformer.blocks.0.attn1.to_q`` in a pipeline). The
header's metadata says what the file is (``format = mpsboost.fp8``, its version, the mpsboost version,
the granularity) and, per module, its kind, original dtype and tensor names.

The file is written tensor by tensor (the safetensors layout is a JSON header then raw bytes), so
saving never holds a second copy of the model in memory. Loading reads the header first and checks
every module path, kind, tensor name, shape and dtype against the model before anything changes;
any mismatch raises :class:`Fp8MismatchError` (or :class:`Fp8FileError` for a file that is not an
mpsboost fp8 safetensors file) naming the file, and the model stays exactly as it was. Then modules
that are not converted yet are converted from the file by ``mpsboost.patch`` (one transaction, the
report row says ``loaded from <file>``), and modules converted already get the file's values.
"""
from __future__ import annotations

import json
import os
import struct
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch

from .errors import MpsboostError

__all__ = ["save_fp8", "load_fp8", "Fp8FileError", "Fp8MismatchError", "Fp8ConversionError", "Fp8StateError", "FORMAT", "FORMAT_VERSION"]

FORMAT = "mpsboost.fp8"
FORMAT_VERSION = "1"
_RECIPE = "fp8_weights"
_ST_DTYPES = {torch.float8_e4m3fn: "F8_E4M3", torch.float32: "F32"}


class Fp8FileError(MpsboostError, ValueError):
    """The path is not a readable mpsboost fp8 safetensors file (not safetensors, truncated, other format)."""


class Fp8MismatchError(MpsboostError, ValueError):
    """An fp8 file does not fit the model it is loaded into (module paths, kinds, tensor names, shapes, dtypes)."""


class Fp8ConversionError(MpsboostError, ValueError):
    """A weight cannot be converted to fp8 (no data on the meta device, inf or NaN values)."""


class Fp8StateError(MpsboostError, RuntimeError):
    """A converted module no longer holds fp8 codes (the model was cast after patching), or holds none to save."""


# ------------------------------------------------------------------------------------------ helpers

def _roots(obj: Any) -> list[tuple[str, torch.nn.Module]]:
    from .api import _targets

    return _targets(obj, action="save or load fp8 weights of")


def _converted(obj: Any) -> Iterator[tuple[str, torch.nn.Module, tuple[str, ...], Any]]:
    """(report path, module, tensor names, recipe state) of every module whose weights fp8_weights converted."""
    from .recipes.fp8_weights import _expert_weight_names
    from .registry import ATTR, join_path

    for prefix, root in _roots(obj):
        for name, mod in root.named_modules():
            entry = mod.__dict__.get(ATTR, {}).get(_RECIPE)
            state = entry.get("fp8") if entry else None
            if state is None or not state.converted:
                continue
            names = ("weight",) if isinstance(mod, torch.nn.Linear) else _expert_weight_names(mod)
            yield join_path(prefix, name), mod, names, state


def _module_at(obj: Any, path: str) -> torch.nn.Module | None:
    for prefix, root in _roots(obj):
        if prefix and not (path == prefix or path.startswith(prefix + ".")):
            continue
        rel = path[len(prefix) + 1:] if prefix else path
        if rel == "<root>" or path == prefix:
            rel = ""
        try:
            return root.get_submodule(rel)
        except AttributeError:
            continue
    return None


def _as_path(path: Any) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}: {path!r}")
    return Path(path)


# ------------------------------------------------------------------------------------------ save

def save_fp8(obj: Any, path: Any) -> Path:
    """Write the fp8 codes and scales of every module of ``obj`` converted by ``fp8_weights`` to ``path``.

    Safetensors format (no pickle). Returns the path. Raises :class:`Fp8StateError` when ``obj`` has
    no converted module (patch it with ``fp8="rowwise"`` or ``"tensorwise"`` first).
    """
    from . import __version__

    target = _as_path(path)
    entries = list(_converted(obj))
    if not entries:
        raise Fp8StateError(
            f"this {type(obj).__name__} has no weights converted by fp8_weights, so there is nothing to save to {target.name}; "
            "call mpsboost.patch(obj, fp8='rowwise') (or 'tensorwise') first"
        )
    tensors: list[tuple[str, torch.Tensor]] = []
    modules: dict[str, dict] = {}
    grans = set()
    for mpath, mod, names, state in entries:
        info = {"kind": "linear" if isinstance(mod, torch.nn.Linear) else "experts", "tensors": list(names),
                "granularity": state.granularity, "compute_dtype": str(state.compute_dtype).replace("torch.", "")}
        grans.add(state.granularity)
        for n in names:
            q, s = mod._buffers[n], mod._buffers[n + "_scale"]
            if q.dtype not in (torch.float8_e4m3fn, torch.uint8):
                raise Fp8StateError(f"{mpath}.{n} is {q.dtype}, not fp8 codes: the model was cast after patching; nothing was written")
            tensors.append((f"{mpath}.{n}", q))
            tensors.append((f"{mpath}.{n}_scale", s))
        modules[mpath] = info
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "mpsboost_version": __version__,
        "granularity": grans.pop() if len(grans) == 1 else "mixed",
        "modules": json.dumps(modules, sort_keys=True),
        # The class of each root (a pipeline component, or the model): files only fit the same architecture.
        "architectures": json.dumps({prefix: type(root).__name__ for prefix, root in _roots(obj)}, sort_keys=True),
    }
    _write_safetensors(target, tensors, meta)
    return target


def _write_safetensors(target: Path, tensors: list[tuple[str, torch.Tensor]], meta: dict[str, str]) -> None:
    """The safetensors layout, one tensor at a time: u64 header size, JSON header, raw little-endian bytes."""
    tensors = sorted(tensors, key=lambda kv: kv[0])
    header: dict[str, Any] = {"__metadata__": meta}
    offset = 0
    for name, t in tensors:
        dt = torch.float8_e4m3fn if t.dtype == torch.uint8 else t.dtype
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[dt], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    tmp = target.with_name(target.name + ".partial")
    try:
        with open(tmp, "wb") as fh:
            fh.write(struct.pack("<Q", len(raw)))
            fh.write(raw)
            for _, t in tensors:
                cpu = t.detach().to("cpu").contiguous()
                fh.write(memoryview(cpu.reshape(-1).view(torch.uint8).numpy()))
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()


# ------------------------------------------------------------------------------------------ load

class _Source:
    """A validated fp8 file, handed to the recipe (``options={"fp8_weights": {"load": source}}``)."""

    def __init__(self, path: Path, modules: dict[str, dict]):
        self.path = path
        self.name = path.name
        self.modules = modules

    def has(self, mpath: str) -> bool:
        return mpath in self.modules

    def granularity(self, mpath: str) -> str:
        return self.modules[mpath]["granularity"]

    def tensors(self, mpath: str, name: str, *, storage: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        from safetensors import safe_open

        with safe_open(str(self.path), framework="pt") as f:
            q = f.get_tensor(f"{mpath}.{name}")
            s = f.get_tensor(f"{mpath}.{name}_scale")
        if storage == "uint8":
            q = q.view(torch.uint8)
        return q.to(device), s.to(device)


def _read_header(target: Path) -> tuple[dict[str, str], dict[str, tuple[str, tuple[int, ...]]]]:
    """(metadata, {tensor name: (safetensors dtype, shape)}) without reading any tensor data."""
    if not target.exists():
        raise FileNotFoundError(f"fp8 file {str(target)!r} does not exist; write one with mpsboost.save_fp8(model, path)")
    size = target.stat().st_size
    what = f"{target.name} is not an mpsboost fp8 safetensors file"
    try:
        with open(target, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise Fp8FileError(f"{what}: it has {size} bytes, fewer than a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, 100 * 2**20):
                raise Fp8FileError(f"{what}: its first 8 bytes announce a {n}-byte header in a {size}-byte file")
            header = json.loads(fh.read(n).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise Fp8FileError(f"{what}: its header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise Fp8FileError(f"{what}: its header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    shapes: dict[str, tuple[str, tuple[int, ...]]] = {}
    end = 0
    for name, info in header.items():
        try:
            dt, shape, (a, b) = info["dtype"], tuple(int(x) for x in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise Fp8FileError(f"{what}: malformed entry for tensor {name!r}") from None
        shapes[name] = (dt, shape)
        end = max(end, int(b))
    if 8 + n + end != size:
        raise Fp8FileError(f"{what}: the header describes {8 + n + end} bytes but the file has {size} (truncated or padded)")
    # The safetensors library checks the rest (offsets, dtype sizes) the same way it will when reading.
    try:
        from safetensors import safe_open

        with safe_open(str(target), framework="pt") as f:
            f.metadata()
    except Exception as exc:  # safetensors raises its own SafetensorError for malformed files
        raise Fp8FileError(f"{what}: {exc}") from None
    return meta, shapes


def _expected_shapes(mod: torch.nn.Module, name: str) -> tuple[tuple[int, ...], set[tuple[int, ...]]]:
    """(codes shape, accepted scale shapes) for tensor ``name`` of ``mod`` in its current state."""
    t = getattr(mod, name)
    shape = tuple(t.shape)
    if len(shape) == 2:
        return shape, {(shape[0], 1), ()}
    e = shape[0]
    tr = bool(getattr(mod, "is_transposed", False))
    row = (e, 1, shape[2]) if tr else (e, shape[1], 1)
    return shape, {row, (e, 1, 1)}


def load_fp8(obj: Any, path: Any):
    """Load fp8 codes and scales written by :func:`save_fp8` into ``obj``; validated before anything changes.

    ``obj`` is the same architecture, loaded normally (e.g. ``from_pretrained`` in bf16) or already
    patched with ``fp8=``. Returns the :class:`~mpsboost.report.PatchReport` of the conversion; when
    every module was converted already and only received the file's values, its rows say "already patched".
    """
    from .api import patch
    from .recipes.fp8_weights import _expert_weight_names, _is_hf_experts
    from .registry import ATTR

    target = _as_path(path)
    meta, shapes = _read_header(target)
    fname = target.name
    if meta.get("format") != FORMAT:
        raise Fp8FileError(
            f"{fname} is a safetensors file but not an mpsboost fp8 file (metadata format={meta.get('format')!r}); "
            "write one with mpsboost.save_fp8(model, path)"
        )
    if meta.get("format_version") != FORMAT_VERSION:
        raise Fp8FileError(f"{fname} has mpsboost fp8 format version {meta.get('format_version')!r}; this mpsboost reads {FORMAT_VERSION!r}")
    try:
        modules = json.loads(meta["modules"])
    except (KeyError, TypeError, json.JSONDecodeError):
        modules = None
    if not isinstance(modules, dict):
        raise Fp8FileError(f"{fname}: its module list (metadata 'modules') is missing or not a JSON object")

    problems: list[str] = []
    try:
        archs = json.loads(meta.get("architectures", "{}"))
    except json.JSONDecodeError:
        archs = None
    if not isinstance(archs, dict):
        raise Fp8FileError(f"{fname}: its metadata 'architectures' is not a JSON object")
    have = {prefix: type(root).__name__ for prefix, root in _roots(obj)}
    for prefix, cls in sorted(archs.items()):
        if prefix in have and have[prefix] != cls:
            problems.append(f"{prefix or 'the model'} is a {have[prefix]}, the file was saved from a {cls}")
    expected: set[str] = set()
    fresh: list[str] = []
    converted: list[tuple[str, torch.nn.Module, str]] = []
    for mpath, info in sorted(modules.items()):
        kind = info.get("kind") if isinstance(info, dict) else None
        names = info.get("tensors") if isinstance(info, dict) else None
        gran = info.get("granularity") if isinstance(info, dict) else None
        if kind not in ("linear", "experts") or not isinstance(names, list) or gran not in ("rowwise", "tensorwise"):
            problems.append(f"{mpath}: malformed module entry {info!r}")
            continue
        mod = _module_at(obj, mpath)
        if mod is None:
            problems.append(f"{mpath}: no such module in this {type(obj).__name__}")
            continue
        if kind == "linear" and type(mod) is not torch.nn.Linear:
            problems.append(f"{mpath}: the file holds a linear layer, the model has a {type(mod).__name__}")
            continue
        if kind == "experts" and not _is_hf_experts(mod):
            problems.append(f"{mpath}: the file holds experts weights, the model has a {type(mod).__name__}")
            continue
        want = ["weight"] if kind == "linear" else list(_expert_weight_names(mod))
        if names != want:
            problems.append(f"{mpath}: the file holds tensors {names}, the model's are {want}")
            continue
        entry = mod.__dict__.get(ATTR, {}).get(_RECIPE)
        is_conv = bool(entry) and entry.get("fp8") is not None and entry["fp8"].converted
        for n in names:
            key, skey = f"{mpath}.{n}", f"{mpath}.{n}_scale"
            expected.update((key, skey))
            if not isinstance(getattr(mod, n, None), torch.Tensor):
                problems.append(f"{key}: the model has no tensor {n}")
                continue
            shape, scale_shapes = _expected_shapes(mod, n)
            for k, want_dt in ((key, "F8_E4M3"), (skey, "F32")):
                if k not in shapes:
                    problems.append(f"{k}: missing from the file")
                elif shapes[k][0] != want_dt:
                    problems.append(f"{k}: dtype {shapes[k][0]} in the file, expected {want_dt}")
            if key in shapes and shapes[key][1] != shape:
                problems.append(f"{key}: shape {list(shapes[key][1])} in the file, the model's is {list(shape)}")
            if skey in shapes:
                got = shapes[skey][1]
                if got not in scale_shapes:
                    problems.append(f"{skey}: shape {list(got)} in the file, expected one of {sorted(list(s) for s in scale_shapes)}")
                elif is_conv and got != tuple(mod._buffers[n + '_scale'].shape):
                    problems.append(f"{skey}: {gran} in the file, but the module was converted with other scales {list(mod._buffers[n + '_scale'].shape)}")
            if is_conv:
                converted.append((mpath, mod, n))
        if not is_conv:
            if _RECIPE in mod.__dict__.get(ATTR, {}):
                problems.append(f"{mpath}: patched by fp8_weights but not converted (a failed conversion); reload the model")
            fresh.append(mpath)
    extra = sorted(set(shapes) - expected)
    if extra:
        problems.append(f"tensors in the file that belong to no listed module: {extra[:5]}" + (" ..." if len(extra) > 5 else ""))
    if problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise Fp8MismatchError(f"{fname} does not fit this {type(obj).__name__} ({len(problems)} problem(s)): {shown}. Nothing was changed.")

    source = _Source(target, {m: modules[m] for m in fresh})
    report = None
    if fresh:
        grans = {modules[m]["granularity"] for m in fresh}
        with warnings.catch_warnings():
            # Modules not in the file are reported as skipped ("not in the fp8 file"): expected here.
            warnings.simplefilter("ignore")
            report = patch(obj, recipes=[_RECIPE], fp8=sorted(grans)[0], options={_RECIPE: {"load": source}})
        missing = [m for m in fresh if not any(r.target == m and r.status == "applied" for r in report.rows)]
        if missing:
            raise Fp8MismatchError(f"{fname}: modules {missing[:5]} could not be converted from the file (see the report rows)")
    if converted:
        from safetensors import safe_open

        with safe_open(str(target), framework="pt") as f:
            for mpath, mod, n in converted:
                q = f.get_tensor(f"{mpath}.{n}")
                buf = mod._buffers[n]
                buf.copy_(q.view(torch.uint8) if buf.dtype == torch.uint8 else q)
                mod._buffers[n + "_scale"].copy_(f.get_tensor(f"{mpath}.{n}_scale"))
    from .api import loaded_report

    return loaded_report(obj, report, list(dict.fromkeys(mpath for mpath, _, _ in converted)), _RECIPE)
