"""The measurement harness: records, timing, memory, quality, table and plot; harness.py is THE measure loop;
models.py the models every measurement builds (the shipped configs and the small ones).

Four separate records per measurement, never merged into one number: throughput of the whole job,
device-synchronised operator time, correctness against a named reference, memory peaks split into
tensor-allocated, allocator-reserved and driver-level. Each record carries the environment that
produced it, and :func:`compare_table` refuses to put side by side records whose environment
differs in anything but the variant.

Importing this package is cheap: matplotlib, tqdm and pynvml (the ``bench`` extra) are imported
only by the functions that need them.
"""

from __future__ import annotations

from typing import Any

from .errors import (
    BenchError,
    BenchmarkNotFoundError,
    CudaGraphCaptureError,
    EnvMismatchError,
    MemoryProbeError,
    QualityError,
    RecordError,
    TimingError,
)
from .memory import MemoryProbe, measure_memory
from .progressbar import progress
from .quality import as_tensor, correctness, cpu_reference, max_abs, max_relative_error, psnr, relative_error, sqnr
from .records import (
    SCHEMA_VERSION,
    Correctness,
    Memory,
    OpTime,
    Record,
    RecordEnv,
    Throughput,
    Workload,
    append_jsonl,
    read_jsonl,
    write_jsonl,
)
from .timing import Timing, synchronize, time_fn

_LAZY = {
    "compare_table": "table",
    "check_comparable": "table",
    "group_records": "table",
    "plot": "plot",
    "measure_variants": "harness",
    "copy_bandwidth": "harness",
    "count_pad5d": "harness",
    "measure_job": "harness",
    "best_device": "harness",
    "ratio_lines": "harness",
    "paired_rounds": "harness",
    "round_ratios": "harness",
    "ModuleOps": "decode_cost",
}


def __getattr__(name: str) -> Any:
    # table and plot pull in nothing heavy at import either, but keeping it lazy keeps `import
    # mpsboost.bench` down to what a benchmark script needs while it measures.
    if name in _LAZY:
        import importlib

        module = importlib.import_module(f".{_LAZY[name]}", __name__)
        return getattr(module, name)
    raise AttributeError(f"module 'mpsboost.bench' has no attribute {name!r}")


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
    "Timing",
    "time_fn",
    "synchronize",
    "measure_memory",
    "MemoryProbe",
    "progress",
    "psnr",
    "relative_error",
    "max_relative_error",
    "sqnr",
    "max_abs",
    "correctness",
    "as_tensor",
    "cpu_reference",
    "compare_table",
    "plot",
    "check_comparable",
    "group_records",
    "measure_variants",
    "copy_bandwidth",
    "count_pad5d",
    "measure_job",
    "best_device",
    "ratio_lines",
    "paired_rounds",
    "round_ratios",
    "ModuleOps",
    "BenchError",
    "RecordError",
    "EnvMismatchError",
    "TimingError",
    "CudaGraphCaptureError",
    "MemoryProbeError",
    "QualityError",
    "BenchmarkNotFoundError",
]
