"""The quantized-weights package's exceptions (each message names the file, key or config field, and what to do)."""

from __future__ import annotations

from ..errors import MpsboostError

__all__ = ["QuantFileError", "QuantMismatchError"]


class QuantFileError(MpsboostError, ValueError):
    """A checkpoint that cannot be read: not safetensors, truncated, a shard missing, or of no format mpsboost knows."""


class QuantMismatchError(MpsboostError, ValueError):
    """A checkpoint that does not fit the model built from its config: a key, shape, dtype or config field that
    cannot be mapped. Raised before anything changes."""
