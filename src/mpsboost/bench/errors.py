"""Exceptions of the measurement harness. Each message says what was passed, what is accepted and
what to do."""

from __future__ import annotations

from ..errors import MpsboostError

__all__ = [
    "BenchError",
    "RecordError",
    "EnvMismatchError",
    "TimingError",
    "CudaGraphCaptureError",
    "MemoryProbeError",
    "QualityError",
    "BenchmarkNotFoundError",
]


class BenchError(MpsboostError):
    """Base class of every error of :mod:`mpsboost.bench`."""


class RecordError(BenchError, ValueError):
    """A record, or a line of a JSONL file, that does not follow the record schema."""


class EnvMismatchError(BenchError, ValueError):
    """Records put side by side whose environments differ in something other than the variant.

    ``field`` names the first differing environment field; ``values`` holds the two values.
    """

    def __init__(self, message: str, *, field: str, values: tuple[object, object]):
        super().__init__(message)
        self.field = field
        self.values = values


class TimingError(BenchError, ValueError):
    """Bad arguments to the timer, or a device the timer cannot synchronise."""


class CudaGraphCaptureError(TimingError):
    """``cuda_graph=True`` and the timed function could not be captured into a CUDA graph."""


class MemoryProbeError(BenchError, ValueError):
    """Bad arguments to the memory probe, or peaks read before the block ended."""


class QualityError(BenchError, ValueError):
    """Tensors that cannot be compared: different shapes, no floating data, nothing to compare."""


class BenchmarkNotFoundError(BenchError, LookupError):
    """``mpsboost bench NAME`` with a NAME that has no benchmarks/NAME.py script."""
