"""The quantized-weights package's exceptions (each message names the file, key or config field, and what to do)."""

from __future__ import annotations

from ..errors import Fp8FileError, MpsboostError, QuantFileError

__all__ = ["QuantFileError", "QuantMismatchError", "Fp8FileError"]

# QuantFileError is defined in mpsboost.errors, next to its subclass Fp8FileError (what the fp8 rows raise): an
# ``except QuantFileError`` catches both, an ``except Fp8FileError`` what fp8 checkpoints raise, as before.


class QuantMismatchError(MpsboostError, ValueError):
    """A checkpoint that does not fit the model built from its config: a key, shape, dtype or config field that
    cannot be mapped. Raised before anything changes."""
