"""Measurement records: one frozen dataclass per measurement, four separate sections, JSONL I/O.

A :class:`Record` says what was measured (:class:`Workload`: a name and its shape), which variant
ran (``"stock"``, ``"mpsboost"`` or a peer such as ``"transformers:batched_mm"``), where
(:class:`RecordEnv`: versions, torch build, device, dtype, compile setting, OS) and what was seen,
in four sections that are each optional and never merged into one number:

* ``throughput`` (:class:`Throughput`): the whole job, with its unit (tokens/s, frames/s, s/call);
* ``op_time`` (operator name -> :class:`OpTime`): device-synchronised microseconds per call;
* ``correctness`` (:class:`Correctness`): PSNR, relative error, SQNR, max abs error against a
  named reference;
* ``memory`` (:class:`Memory`): peaks in bytes, split into tensor-allocated, allocator-reserved and
  driver-level; ``None`` in a field means the device has no such counter.

Files are JSON Lines, one record per line, each carrying :data:`SCHEMA_VERSION`. Non-finite floats
(a PSNR of identical tensors is ``inf``) are written as the strings ``"inf"``, ``"-inf"``,
``"nan"`` so that every line is strict JSON that any reader (``jq``, pandas) accepts.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import math
import os
import platform
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from .errors import RecordError

__all__ = [
    "SCHEMA_VERSION",
    "Workload",
    "RecordEnv",
    "Throughput",
    "OpTime",
    "Correctness",
    "Memory",
    "Record",
    "write_jsonl",
    "append_jsonl",
    "read_jsonl",
    "HIGHER_IS_BETTER_UNITS",
    "LOWER_IS_BETTER_UNITS",
]

#: Version of the record layout. Bump it when a field changes meaning or is removed; readers refuse
#: files of a newer schema instead of misreading them.
SCHEMA_VERSION = 1

#: Throughput units where more is faster, and units where less is faster (time per call). The
#: comparison uses this to state every speed ratio as "speedup vs stock" (> 1 means faster).
HIGHER_IS_BETTER_UNITS = frozenset(
    {"tokens/s", "frames/s", "images/s", "samples/s", "calls/s", "it/s", "tiles/s", "GB/s", "TFLOP/s"}
)
LOWER_IS_BETTER_UNITS = frozenset({"s/call", "ms/call", "us/call", "s/token", "ms/token", "s", "ms", "us"})


# --------------------------------------------------------------------------------------------------
# JSON helpers: strict JSON with non-finite floats as strings


def _encode(value: Any) -> Any:
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return value
    if isinstance(value, Mapping):
        return {str(k): _encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _encode(value.to_dict() if hasattr(value, "to_dict") else dataclasses.asdict(value))
    if value is None or isinstance(value, (str, int, bool)):
        return value
    # torch.dtype, torch.Size, Path, numpy scalars...: keep them readable rather than failing late.
    item = getattr(value, "item", None)
    if callable(item):
        try:
            return _encode(item())
        except (TypeError, ValueError, RuntimeError):
            pass
    if isinstance(value, Path):
        return str(value)
    return str(value)


_NONFINITE = {
    "nan": math.nan,
    "inf": math.inf,
    "-inf": -math.inf,
    "Infinity": math.inf,
    "-Infinity": -math.inf,
    "NaN": math.nan,
}


def _float(value: Any, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool):
        raise RecordError(f"{where}: expected a number or None, got a bool ({value!r})")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value in _NONFINITE:
        return _NONFINITE[value]
    item = getattr(value, "item", None)  # 0-d tensors and numpy scalars
    if callable(item):
        return _float(item(), where)
    raise RecordError(f"{where}: expected a number, 'inf', '-inf', 'nan' or None, got {type(value).__name__} {value!r}")


def _int(value: Any, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool):
        raise RecordError(f"{where}: expected an integer or None, got a bool ({value!r})")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    item = getattr(value, "item", None)
    if callable(item):
        return _int(item(), where)
    raise RecordError(f"{where}: expected an integer number of bytes or None, got {type(value).__name__} {value!r}")


def _str(value: Any, where: str, *, empty_ok: bool = False) -> str:
    if not isinstance(value, str) or (not empty_ok and not value):
        raise RecordError(f"{where}: expected a non-empty str, got {type(value).__name__} {value!r}")
    return value


def _mapping(value: Any, where: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise RecordError(f"{where}: expected a dict, got {type(value).__name__} {value!r}")
    return dict(value)


def _known(cls: type, data: Mapping[str, Any], where: str) -> None:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise RecordError(
            f"{where}: unknown field(s) {unknown} for {cls.__name__}; accepted: {sorted(names)}. "
            "The file may come from a newer mpsboost: upgrade, or drop those fields."
        )


# --------------------------------------------------------------------------------------------------
# Sections


@dataclass(frozen=True)
class Workload:
    """What was measured: a name (``"wan22_vae_decode"``) and its shape (``{"frames": 81, ...}``).

    ``shape`` is a plain dict of JSON-able values; two workloads are the same when name and shape
    are equal.
    """

    name: str
    shape: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        _str(self.name, "Workload.name")
        object.__setattr__(self, "shape", _encode(_mapping(self.shape, "Workload.shape")))

    @property
    def key(self) -> str:
        """A canonical text key (name plus sorted shape) for grouping."""
        return self.name + json.dumps(self.shape, sort_keys=True, separators=(",", ":"))

    def describe(self) -> str:
        if not self.shape:
            return self.name
        return f"{self.name} (" + ", ".join(f"{k}={v}" for k, v in self.shape.items()) + ")"

    def to_dict(self) -> dict:
        return {"name": self.name, "shape": dict(self.shape)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Workload":
        data = _mapping(data, "workload")
        _known(cls, data, "workload")
        return cls(name=data.get("name"), shape=data.get("shape") or {})


def _device_name(device_type: str, index: int | None) -> str:
    import torch

    if device_type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(index if index is not None else torch.cuda.current_device())
    if device_type in ("mps", "cpu"):
        if sys.platform == "darwin":
            try:
                out = subprocess.run(
                    ["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True, timeout=5
                )
                if out.returncode == 0 and out.stdout.strip():
                    return out.stdout.strip()  # "Apple M3 Ultra": the GPU is part of the chip
            except (OSError, subprocess.SubprocessError):
                pass
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    if line.lower().startswith("model name"):
                        return line.split(":", 1)[1].strip()
        except OSError:
            pass
        return platform.processor() or platform.machine() or "unknown"
    return "unknown"


def _dtype_name(dtype: Any) -> str:
    if dtype is None:
        return "none"
    text = str(dtype)
    return text[len("torch.") :] if text.startswith("torch.") else text


def _library_versions() -> dict:
    # importlib.metadata reads installed metadata without importing the libraries (importing
    # diffusers or transformers here would make every record capture slow and heavy).
    from importlib import metadata

    out = {}
    for name in ("diffusers", "transformers", "accelerate", "triton"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


@dataclass(frozen=True)
class RecordEnv:
    """The environment of a measurement. Two records are comparable only when these are equal.

    Build with :meth:`capture`; every field is a plain string, bool or dict so that environments
    compare and serialise exactly.
    """

    mpsboost_version: str
    torch_version: str
    torch_build: str  # one line: "cuda 13.0, git 1234abc, release" / "cpu, git ..., debug"
    torch_cuda: str | None
    torch_git: str | None
    torch_debug: bool
    device_type: str
    device_name: str
    dtype: str
    compile: str  # "eager", or the torch.compile setting ("default", "max-autotune", ...)
    os: str
    platform: str
    python: str
    libraries: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in (
            "mpsboost_version",
            "torch_version",
            "torch_build",
            "device_type",
            "device_name",
            "dtype",
            "compile",
            "os",
            "platform",
            "python",
        ):
            _str(getattr(self, name), f"RecordEnv.{name}")
        object.__setattr__(self, "libraries", _mapping(self.libraries, "RecordEnv.libraries"))

    @classmethod
    def capture(cls, device: Any, dtype: Any, compile: bool | str = False) -> "RecordEnv":
        """The environment of this process for a run on ``device`` in ``dtype``.

        ``device``: ``"cuda"``, ``"cuda:1"``, ``"mps"``, ``"cpu"`` or a ``torch.device``.
        ``compile``: ``False`` (eager), ``True`` (``torch.compile`` defaults) or a mode string.
        """
        import torch

        import mpsboost

        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise RecordError(
                f"device {device!r} is not a torch device; pass 'cuda', 'cuda:0', 'mps', 'cpu' or a torch.device"
            ) from exc
        if compile is False or compile is None:
            comp = "eager"
        elif compile is True:
            comp = "default"
        elif isinstance(compile, str) and compile:
            comp = compile
        else:
            raise RecordError(f"compile must be False, True or a torch.compile mode string, got {compile!r}")
        cuda = torch.version.cuda
        git = getattr(torch.version, "git_version", None)
        debug = bool(getattr(torch.version, "debug", False))
        hip = getattr(torch.version, "hip", None)
        backend = f"cuda {cuda}" if cuda else (f"rocm {hip}" if hip else "no cuda")
        build = f"{backend}, git {git[:10] if git else 'unknown'}, {'debug' if debug else 'release'}"
        return cls(
            mpsboost_version=mpsboost.__version__,
            torch_version=torch.__version__,
            torch_build=build,
            torch_cuda=cuda,
            torch_git=git,
            torch_debug=debug,
            device_type=dev.type,
            device_name=_device_name(dev.type, dev.index),
            dtype=_dtype_name(dtype),
            compile=comp,
            os=f"{platform.system()} {platform.release()}",
            platform=platform.platform(),
            python=platform.python_version(),
            libraries=_library_versions(),
        )

    def differences(self, other: "RecordEnv") -> list[tuple[str, Any, Any]]:
        """(field, mine, theirs) for every field that differs, in declaration order."""
        out = []
        for f in dataclasses.fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if a != b:
                out.append((f.name, a, b))
        return out

    def describe(self) -> str:
        return (
            f"{self.device_type} ({self.device_name}), torch {self.torch_version} [{self.torch_build}], "
            f"{self.dtype}, {self.compile}, mpsboost {self.mpsboost_version}, {self.os}, python {self.python}"
        )

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "RecordEnv":
        data = _mapping(data, "env")
        _known(cls, data, "env")
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in data and f.name != "libraries"]
        if missing:
            raise RecordError(
                f"env: missing field(s) {missing}; build environments with RecordEnv.capture(device, dtype)"
            )
        return cls(**data)


@dataclass(frozen=True)
class Throughput:
    """Throughput of the whole job: ``value`` in ``unit`` (``"tokens/s"``, ``"frames/s"``, ``"s/call"``).

    ``seconds_per_call`` is the median wall time of one call of the job and ``items_per_call`` how
    many units of work (tokens, frames) one call does, where that applies; ``repeats``/``warmup``
    say how it was measured and ``spread`` holds min/max/iqr of the per-call seconds.
    """

    value: float
    unit: str
    seconds_per_call: float | None = None
    items_per_call: float | None = None
    repeats: int | None = None
    warmup: int | None = None
    spread: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "value", _float(self.value, "Throughput.value"))
        if self.value is None:
            raise RecordError(
                "Throughput.value: expected a number, got None; leave the whole throughput section None instead"
            )
        _str(self.unit, "Throughput.unit")
        object.__setattr__(self, "seconds_per_call", _float(self.seconds_per_call, "Throughput.seconds_per_call"))
        object.__setattr__(self, "items_per_call", _float(self.items_per_call, "Throughput.items_per_call"))
        object.__setattr__(self, "repeats", _int(self.repeats, "Throughput.repeats"))
        object.__setattr__(self, "warmup", _int(self.warmup, "Throughput.warmup"))
        object.__setattr__(
            self,
            "spread",
            {k: _float(v, f"Throughput.spread[{k!r}]") for k, v in _mapping(self.spread, "Throughput.spread").items()},
        )

    @property
    def higher_is_better(self) -> bool | None:
        """True for rates, False for times per call, None for a unit the harness does not know."""
        if self.unit in HIGHER_IS_BETTER_UNITS or self.unit.endswith("/s"):
            return True
        if self.unit in LOWER_IS_BETTER_UNITS or self.unit.endswith("/call") or self.unit.endswith("/token"):
            return False
        return None

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Throughput":
        data = _mapping(data, "throughput")
        _known(cls, data, "throughput")
        return cls(**data)


@dataclass(frozen=True)
class OpTime:
    """Device-synchronised time of one operator call, in microseconds: median and spread.

    ``method`` says how it was taken: ``"cuda_events"``, ``"cuda_graph"`` (replay of a captured
    graph: device time without launch overhead), ``"mps_synchronize"`` or ``"perf_counter"``.
    """

    median_us: float
    min_us: float | None = None
    max_us: float | None = None
    iqr_us: float | None = None
    repeats: int | None = None
    warmup: int | None = None
    method: str = "unknown"
    calls: int | None = None  # operator calls per timed sample, where one sample runs several

    def __post_init__(self) -> None:
        for name in ("median_us", "min_us", "max_us", "iqr_us"):
            object.__setattr__(self, name, _float(getattr(self, name), f"OpTime.{name}"))
        if self.median_us is None:
            raise RecordError("OpTime.median_us: expected a number of microseconds, got None")
        object.__setattr__(self, "repeats", _int(self.repeats, "OpTime.repeats"))
        object.__setattr__(self, "warmup", _int(self.warmup, "OpTime.warmup"))
        object.__setattr__(self, "calls", _int(self.calls, "OpTime.calls"))
        _str(self.method, "OpTime.method")

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "OpTime":
        data = _mapping(data, "op_time entry")
        _known(cls, data, "op_time entry")
        return cls(**data)


@dataclass(frozen=True)
class Correctness:
    """Agreement with a named reference (``"cpu-fp32"``, ``"stock"``): each metric optional.

    ``psnr_db`` (images/video; ``inf`` when identical), ``rel_error`` (‖x-ref‖/‖ref‖), ``sqnr_db``
    (10·log10 of signal over error power), ``max_abs``. ``data_range`` is the peak-to-peak range the
    PSNR was computed with.
    """

    reference: str
    psnr_db: float | None = None
    rel_error: float | None = None
    sqnr_db: float | None = None
    max_abs: float | None = None
    data_range: float | None = None

    def __post_init__(self) -> None:
        _str(self.reference, "Correctness.reference")
        for name in ("psnr_db", "rel_error", "sqnr_db", "max_abs", "data_range"):
            object.__setattr__(self, name, _float(getattr(self, name), f"Correctness.{name}"))

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Correctness":
        data = _mapping(data, "correctness")
        _known(cls, data, "correctness")
        return cls(**data)


@dataclass(frozen=True)
class Memory:
    """Memory peaks during a block, in bytes. ``None``: this device has no such counter.

    * ``tensor_allocated``: bytes held by live tensors (CUDA ``max_memory_allocated``; MPS
      ``current_allocated_memory`` sampled).
    * ``allocator_reserved``: bytes the caching allocator holds, used or cached (CUDA
      ``max_memory_reserved``; no public counter on MPS).
    * ``driver_level``: what the driver/OS sees (CUDA device memory in use, from NVML or
      ``mem_get_info``; MPS ``driver_allocated_memory``, which includes MPSGraph's own buffers;
      CPU process RSS).

    ``*_at_start`` hold the same counters when the block began, so that ``peak - start`` is what the
    block added. ``driver_level_source`` names the counter behind ``driver_level``; ``samples`` and
    ``interval_s`` describe the background sampler.
    """

    tensor_allocated: int | None = None
    allocator_reserved: int | None = None
    driver_level: int | None = None
    tensor_allocated_at_start: int | None = None
    allocator_reserved_at_start: int | None = None
    driver_level_at_start: int | None = None
    driver_level_source: str | None = None
    samples: int | None = None
    interval_s: float | None = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.name in ("driver_level_source",):
                if self.driver_level_source is not None:
                    _str(self.driver_level_source, "Memory.driver_level_source")
            elif f.name == "interval_s":
                object.__setattr__(self, f.name, _float(self.interval_s, "Memory.interval_s"))
            else:
                object.__setattr__(self, f.name, _int(getattr(self, f.name), f"Memory.{f.name}"))

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Memory":
        data = _mapping(data, "memory")
        _known(cls, data, "memory")
        return cls(**data)


# --------------------------------------------------------------------------------------------------
# The record


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


@dataclass(frozen=True)
class Record:
    """One measurement: workload, variant, environment, and four separate optional sections.

    ``extra`` is free JSON-able detail (counts of ``F.pad`` calls, the patch report...). ``created``
    (UTC ISO time) and ``schema`` are filled in automatically and are not part of the environment.
    """

    workload: Workload
    variant: str
    env: RecordEnv
    throughput: Throughput | None = None
    op_time: dict | None = None  # operator name -> OpTime
    correctness: Correctness | None = None
    memory: Memory | None = None
    extra: dict = field(default_factory=dict)
    created: str = field(default_factory=_now)
    schema: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if not isinstance(self.workload, Workload):
            raise RecordError(
                "Record.workload: expected a Workload(name, shape), "
                f"got {type(self.workload).__name__} {self.workload!r}"
            )
        _str(self.variant, "Record.variant")
        if not isinstance(self.env, RecordEnv):
            raise RecordError(
                f"Record.env: expected a RecordEnv (RecordEnv.capture(device, dtype)), got {type(self.env).__name__}"
            )
        for name, cls in (("throughput", Throughput), ("correctness", Correctness), ("memory", Memory)):
            value = getattr(self, name)
            if value is not None and not isinstance(value, cls):
                raise RecordError(
                    f"Record.{name}: expected {cls.__name__} or None, got {type(value).__name__} {value!r}"
                )
        if self.op_time is not None:
            ops = _mapping(self.op_time, "Record.op_time")
            for k, v in ops.items():
                if not isinstance(k, str) or not k:
                    raise RecordError(f"Record.op_time: keys are operator names (non-empty str), got {k!r}")
                if not isinstance(v, OpTime):
                    raise RecordError(f"Record.op_time[{k!r}]: expected an OpTime, got {type(v).__name__} {v!r}")
            object.__setattr__(self, "op_time", ops)
        object.__setattr__(self, "extra", _encode(_mapping(self.extra, "Record.extra")))
        if not isinstance(self.schema, int) or isinstance(self.schema, bool):
            raise RecordError(f"Record.schema: expected an int, got {self.schema!r}")

    def replace(self, **changes: Any) -> "Record":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return {
            "schema": self.schema,
            "created": self.created,
            "workload": self.workload.to_dict(),
            "variant": self.variant,
            "env": self.env.to_dict(),
            "throughput": None if self.throughput is None else self.throughput.to_dict(),
            "op_time": None if self.op_time is None else {k: v.to_dict() for k, v in self.op_time.items()},
            "correctness": None if self.correctness is None else self.correctness.to_dict(),
            "memory": None if self.memory is None else self.memory.to_dict(),
            "extra": dict(self.extra),
        }

    def to_json(self) -> str:
        return json.dumps(_encode(self.to_dict()), sort_keys=False, allow_nan=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Record":
        data = _mapping(data, "record")
        schema = data.get("schema")
        if not isinstance(schema, int) or isinstance(schema, bool):
            raise RecordError(f"record: missing or non-integer 'schema' ({schema!r}); is this an mpsboost record file?")
        if schema > SCHEMA_VERSION:
            raise RecordError(
                f"record: schema {schema} is newer than this mpsboost reads (schema {SCHEMA_VERSION}); upgrade mpsboost"
            )
        _known(cls, data, "record")
        for key in ("workload", "variant", "env"):
            if key not in data:
                raise RecordError(f"record: missing required field {key!r}")
        op = data.get("op_time")
        return cls(
            workload=Workload.from_dict(data["workload"]),
            variant=data["variant"],
            env=RecordEnv.from_dict(data["env"]),
            throughput=None if data.get("throughput") is None else Throughput.from_dict(data["throughput"]),
            op_time=None if op is None else {k: OpTime.from_dict(v) for k, v in _mapping(op, "op_time").items()},
            correctness=None if data.get("correctness") is None else Correctness.from_dict(data["correctness"]),
            memory=None if data.get("memory") is None else Memory.from_dict(data["memory"]),
            extra=data.get("extra") or {},
            created=data.get("created") or _now(),
            schema=schema,
        )

    @classmethod
    def from_json(cls, line: str) -> "Record":
        try:
            data = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RecordError(f"not a JSON line: {exc}") from exc
        return cls.from_dict(data)


# --------------------------------------------------------------------------------------------------
# JSONL


def write_jsonl(path: str | os.PathLike, records: Iterable[Record]) -> Path:
    """Write ``records`` to ``path`` (one JSON object per line), replacing the file; returns the path.

    The parent folder is created. The file is written to a temporary name first and renamed, so an
    interrupted run never leaves half a file under the final name.
    """
    path = Path(path)
    lines = []
    for i, rec in enumerate(records):
        if not isinstance(rec, Record):
            raise RecordError(f"write_jsonl: item {i} is a {type(rec).__name__}, not a Record")
        lines.append(rec.to_json())
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    os.replace(tmp, path)
    return path


def append_jsonl(path: str | os.PathLike, records: Iterable[Record]) -> Path:
    """Append ``records`` to ``path`` (created if absent), for runs that add records as they go."""
    path = Path(path)
    lines = []
    for i, rec in enumerate(records):
        if not isinstance(rec, Record):
            raise RecordError(f"append_jsonl: item {i} is a {type(rec).__name__}, not a Record")
        lines.append(rec.to_json())
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as fh:
        fh.write("".join(line + "\n" for line in lines))
    return path


def read_jsonl(path: str | os.PathLike) -> list[Record]:
    """Read every record of a JSONL file; blank lines are skipped; errors name the line number."""
    path = Path(path)
    out = []
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                out.append(Record.from_json(line))
            except RecordError as exc:
                raise RecordError(f"{path}:{n}: {exc}") from exc
            except TypeError as exc:  # a field of the wrong kind reaching a dataclass constructor
                raise RecordError(f"{path}:{n}: {exc}") from exc
    return out
