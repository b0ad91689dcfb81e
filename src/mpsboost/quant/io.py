"""File I/O that knows no format: safetensors headers, shard indexes, tensors streamed onto a device, and a writer.

The one safetensors reader of mpsboost: the low-bit rows (:mod:`mpsboost.quant.formats`) and the fp8 rows
(:mod:`mpsboost.quant.fp8_formats`) read through it. :func:`open_folder` reads the headers of every shard of a folder
(or of one file) and its ``config.json``; no tensor data is read. A :class:`Layout` says which file names a folder's
weights go by (the shard index, the single file), which error class the messages are raised as and what they call
the checkpoint. :func:`read_tensor` reads one tensor straight into its own CPU memory (or into a caller's buffer) and
:func:`read_to` puts it on a device, so a load holds at most one tensor on the host at a time. :func:`write_folder`
writes tensors shard by shard, each tensor from the device as it is written (never a second copy of the model).
What the tensors mean is the rows' business (:mod:`mpsboost.quant.formats`, :mod:`mpsboost.quant.fp8_formats`).
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

from .errors import QuantFileError

__all__ = [
    "ST_DTYPES",
    "TORCH_TO_ST",
    "TensorEntry",
    "Folder",
    "Layout",
    "HF_LAYOUT",
    "open_folder",
    "safetensors_header",
    "read_tensor",
    "read_rows",
    "read_to",
    "write_safetensors",
    "write_folder",
]

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
    "U32": torch.uint32,
    "BOOL": torch.bool,
}
if hasattr(torch, "float8_e8m0fnu"):
    ST_DTYPES["F8_E8M0"] = torch.float8_e8m0fnu
TORCH_TO_ST = {v: k for k, v in ST_DTYPES.items()}
_ITEMSIZE = {k: torch.empty((), dtype=v).element_size() for k, v in ST_DTYPES.items()}
_ITEMSIZE.setdefault("F8_E8M0", 1)  # UE8M0 scales are read (as bytes) even where torch has no float8_e8m0fnu
_SHARD = re.compile(r"-\d{5}-of-\d{5}\.safetensors$")


@dataclass(frozen=True)
class Layout:
    """The file names of a family of checkpoints and how their errors read.

    ``index_names`` and ``single_names`` are looked for in a folder in this order (the first index found is the
    folder's, unless every shard it names carries ``decoy_mark``: an index written to stop other loaders, not this
    folder's own); ``error`` is the class every message is raised as (a :class:`QuantFileError`) and ``noun`` what
    they call the checkpoint ("checkpoint", "fp8 checkpoint")."""

    index_names: tuple[str, ...] = ("model.safetensors.index.json",)
    single_names: tuple[str, ...] = ("model.safetensors",)
    decoy_mark: Optional[str] = None
    error: type = QuantFileError
    noun: str = "checkpoint"


HF_LAYOUT = Layout()


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes are: file, safetensors dtype, shape and absolute byte range."""

    key: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def torch_dtype(self) -> torch.dtype:
        return ST_DTYPES[self.dtype]


@dataclass
class Folder:
    """A safetensors checkpoint (a folder of shards with an index, one file, or a folder with one file): headers
    read, no data. ``config`` is its ``config.json`` (or None)."""

    path: Path
    files: list[Path]
    entries: dict[str, TensorEntry]
    metadata: dict[str, str]
    config: Optional[dict] = None
    extra: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def nbytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)


def safetensors_header(path: Path, what: str, error: type = QuantFileError) -> tuple[int, dict]:
    """(header length, the JSON header as a dict) of a safetensors file, read from its first bytes only; ``what``
    opens every error message (a truncated file, a wrong length, a header that is not JSON)."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise error(f"{what}: it has {size} bytes, fewer than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, 100 * 2**20):
            raise error(
                f"{what}: its first 8 bytes announce a {n}-byte header in a {size}-byte file "
                "(truncated, or not safetensors)"
            )
        try:
            header = json.loads(fh.read(n).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise error(f"{what}: its header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise error(f"{what}: its header is not a JSON object")
    return n, header


def _header(path: Path, error: type = QuantFileError) -> tuple[dict[str, str], dict[str, TensorEntry]]:
    what = f"{path.name} is not a readable safetensors file"
    n, header = safetensors_header(path, what, error)
    size = path.stat().st_size
    meta = header.pop("__metadata__", None) or {}
    entries: dict[str, TensorEntry] = {}
    base, end = 8 + n, 0
    for key, info in header.items():
        try:
            dt, shape, (a, b) = info["dtype"], tuple(int(x) for x in info["shape"]), info["data_offsets"]
            a, b = int(a), int(b)
        except (KeyError, TypeError, ValueError):
            raise error(f"{what}: malformed header entry for tensor {key!r}") from None
        if dt not in _ITEMSIZE:
            raise error(f"{path.name}: tensor {key!r} has dtype {dt}, which mpsboost does not read")
        numel = 1
        for s in shape:
            numel *= s
        if b - a != numel * _ITEMSIZE[dt] or a < 0:
            raise error(
                f"{what}: tensor {key!r} {dt} {list(shape)} spans {b - a} bytes, expected {numel * _ITEMSIZE[dt]}"
            )
        entries[key] = TensorEntry(key, path, dt, shape, base + a, base + b)
        end = max(end, b)
    if base + end != size:
        raise error(
            f"{path.name}: the header describes {base + end} bytes but the file has {size} (truncated or padded)"
        )
    return {str(k): str(v) for k, v in meta.items()}, entries


def _index(folder: Path, layout: Layout) -> Optional[tuple[list[Path], dict[str, str]]]:
    """The shards and weight map of the folder's own shard index (the first of ``layout.index_names``), or None."""
    for name in layout.index_names:
        idx = folder / name
        if not idx.is_file():
            continue
        try:
            weight_map = json.loads(idx.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError
        except (json.JSONDecodeError, KeyError, TypeError):
            raise layout.error(f"{idx}: not a shard index (a JSON object with a 'weight_map')") from None
        files = sorted({str(v) for v in weight_map.values()})
        if layout.decoy_mark and files and all(layout.decoy_mark in f for f in files):
            continue  # an index that stops other loaders (save_fp8's guard), not an index of this folder's weights
        missing = [f for f in files if not (folder / f).is_file()]
        if missing:
            raise layout.error(
                f"{folder.name}: partial checkpoint: the index {name} lists shard(s) {missing[:3]} "
                "that are not in the folder"
            )
        return [folder / f for f in files], {str(k): str(v) for k, v in weight_map.items()}
    return None


def _shards(folder: Path, layout: Layout) -> tuple[list[Path], Optional[dict[str, str]]]:
    indexed = _index(folder, layout)
    if indexed is not None:
        return indexed
    for name in layout.single_names:
        if (folder / name).is_file():
            return [folder / name], None
    found = sorted(folder.glob("*.safetensors"))
    if len(found) == 1:
        return found, None
    if not found:
        raise layout.error(f"{folder}: no safetensors file ({', '.join(layout.single_names)}, or a shard index)")
    if all(_SHARD.search(f.name) for f in found):
        raise layout.error(
            f"{folder}: shards {[f.name for f in found[:3]]} without their index "
            f"({layout.index_names[0]}): partial checkpoint"
        )
    raise layout.error(
        f"{folder}: several safetensors files {[f.name for f in found[:4]]} and no index; pass the one to load"
    )


def open_folder(path: Any, *, layout: Layout = HF_LAYOUT, config: Optional[dict] = None) -> Folder:
    """The headers of every shard at ``path`` (a folder or a ``.safetensors`` file) and its ``config.json`` (not
    read where the caller gives ``config``). Every error is a ``layout.error``."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}: {path!r}")
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{layout.noun} {str(p)!r} does not exist")
    if p.is_dir():
        files, weight_map = _shards(p, layout)
        cfg_file = p / "config.json"
    else:
        files, weight_map = [p], None
        cfg_file = p.parent / "config.json"
    if config is None and cfg_file.is_file():
        try:
            config = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as exc:
            raise layout.error(f"{cfg_file}: not JSON ({exc})") from None
    entries: dict[str, TensorEntry] = {}
    metadata: dict[str, str] = {}
    for f in files:
        meta, ents = _header(f, layout.error)
        dup = next((k for k in ents if k in entries), None)
        if dup is not None:
            raise layout.error(f"{p.name}: tensor {dup!r} is in both {entries[dup].file.name} and {f.name}")
        entries.update(ents)
        for k, v in meta.items():
            metadata.setdefault(k, v)
    if weight_map is not None:
        lost = [k for k, f in weight_map.items() if k not in entries or entries[k].file.name != Path(f).name]
        if lost:
            raise layout.error(
                f"{p.name}: partial checkpoint: {len(lost)} tensor(s) of the index are not in their shard, "
                f"e.g. {lost[:3]}"
            )
    return Folder(p, files, entries, metadata, config)


def read_tensor(entry: TensorEntry, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The tensor of ``entry`` on the CPU, read straight into its own memory (or into ``out``: CPU, contiguous, the
    same number of bytes)."""
    t = out if out is not None else torch.empty(entry.shape, dtype=entry.torch_dtype)
    if t.numel() * t.element_size() != entry.nbytes or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"read_tensor: the destination does not fit {entry.key} {entry.dtype} {list(entry.shape)}")
    if entry.nbytes:
        buf = memoryview(t.view(-1).view(torch.uint8).numpy())
        with open(entry.file, "rb") as fh:
            fh.seek(entry.begin)
            got = fh.readinto(buf)
        if got != entry.nbytes:
            raise QuantFileError(
                f"{entry.file.name}: short read of {entry.key} at byte {entry.begin} ({got} of {entry.nbytes} bytes): "
                "the file changed or is truncated"
            )
    return t


def read_rows(entry: TensorEntry, r0: int, r1: int) -> torch.Tensor:
    """Rows ``[r0, r1)`` (along the first dimension) of ``entry``'s tensor, read from the file alone: a caller that
    quantises a large tensor slice by slice never holds the whole of it."""
    if not 0 <= r0 <= r1 <= (entry.shape[0] if entry.shape else 1):
        raise ValueError(f"read_rows: rows [{r0}, {r1}) of {entry.key} {list(entry.shape)}")
    row = entry.nbytes // max(1, entry.shape[0]) if entry.shape else entry.nbytes
    part = TensorEntry(
        entry.key, entry.file, entry.dtype, (r1 - r0, *entry.shape[1:]), entry.begin + r0 * row, entry.begin + r1 * row
    )
    return read_tensor(part)


def read_to(entry: TensorEntry, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``entry``'s tensor on ``device`` (cast to ``dtype`` where given), through one host copy of it."""
    t = read_tensor(entry)
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    return t if t.device == device else t.to(device)


def write_safetensors(target: Path, tensors: list[tuple[str, torch.Tensor]], meta: dict[str, str]) -> None:
    """One safetensors file, tensor by tensor (each copied to the host as it is written); written to a
    ``.partial`` name first, then moved into place."""
    tensors = sorted(tensors, key=lambda kv: kv[0])
    header: dict[str, Any] = {"__metadata__": meta}
    offset = 0
    for name, t in tensors:
        st = TORCH_TO_ST.get(t.dtype)
        if st is None:
            raise TypeError(f"{name} has dtype {t.dtype}, which safetensors cannot hold")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": st, "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    tmp = target.with_name(target.name + ".partial")
    try:
        with open(tmp, "wb") as fh:
            fh.write(struct.pack("<Q", len(raw)))
            fh.write(raw)
            for _, t in tensors:
                cpu = t.detach().to("cpu").contiguous()
                if cpu.numel():
                    fh.write(memoryview(cpu.reshape(-1).view(torch.uint8).numpy()))
                del cpu
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_folder(
    folder: Path,
    tensors: list[tuple[str, torch.Tensor]],
    *,
    meta: dict[str, str],
    max_shard_bytes: int = 5 * 2**30,
    stem: str = "model",
    index_meta: dict | None = None,
) -> list[Path]:
    """``stem.safetensors``, or shards ``stem-0000k-of-0000n.safetensors`` of at most ``max_shard_bytes`` and
    ``stem.safetensors.index.json`` (always written, as mlx-lm does). Returns the files written."""
    folder.mkdir(parents=True, exist_ok=True)
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for item in sorted(tensors, key=lambda kv: kv[0]):
        nbytes = item[1].numel() * item[1].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += nbytes
    n = len(shards)
    files, weight_map, total = [], {}, 0
    for i, shard in enumerate(shards, 1):
        fname = f"{stem}.safetensors" if n == 1 else f"{stem}-{i:05d}-of-{n:05d}.safetensors"
        write_safetensors(folder / fname, shard, meta)
        files.append(folder / fname)
        for key, t in shard:
            weight_map[key] = fname
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total, **(index_meta or {})}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / f"{stem}.safetensors.index.json").write_text(json.dumps(index, indent=4) + "\n")
    return files
