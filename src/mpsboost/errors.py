"""mpsboost's exceptions. Each message says what was passed, what is accepted, and what to do."""

from __future__ import annotations


class MpsboostError(Exception):
    """Base class of every mpsboost error."""


class GateError(MpsboostError, ValueError):
    """A version string, device or feature name the gate cannot read."""


class PatchError(MpsboostError):
    """A recipe failed while applying; everything applied so far was undone.

    ``recipe`` and ``target`` name where; the original exception is chained as ``__cause__``.
    """

    def __init__(self, message: str, *, recipe: str | None = None, target: str | None = None):
        super().__init__(message)
        self.recipe = recipe
        self.target = target


class RecipeOptionError(PatchError, TypeError):
    """An option a recipe does not know, or a value of a type it does not take (``options={recipe: {...}}``).
    A TypeError; also a PatchError (raised before anything changes)."""


class UnsupportedTargetError(MpsboostError, TypeError):
    """The object handed to patch/unpatch/plan is not something mpsboost can patch."""


class UnknownRecipeError(MpsboostError, KeyError):
    """A recipe name that is not registered."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class RecipeSkippedError(MpsboostError):
    """strict=True and a requested recipe was skipped."""


class NotPatchedError(MpsboostError):
    """unpatch() on an object that mpsboost never patched."""


class PatchedCopyError(NotPatchedError):
    """unpatch() on a copy (copy.deepcopy) of a patched object: the patches came with the copy, their undo did not."""


class UserInputError(MpsboostError, ValueError):
    """A command-line input that cannot be used: a folder or config file that cannot be read, a bad value.

    The ``mpsboost`` command prints it as one line and exits with status 2 (every user error does).
    """


class IrreversiblePatchError(MpsboostError):
    """unpatch() met a recipe that cannot be undone (weights converted in place)."""


class QuantFileError(MpsboostError, ValueError):
    """A checkpoint that cannot be read: not safetensors, truncated, a shard missing, or of no format mpsboost knows.
    Raised by the quantized-weights package (:mod:`mpsboost.quant`; also there as ``mpsboost.quant.errors``)."""


class Fp8FileError(QuantFileError):
    """The path is not a readable fp8 safetensors checkpoint (not safetensors, truncated, partial, other format).
    A :class:`QuantFileError` (fp8's formats are rows of :mod:`mpsboost.quant`), and a ValueError."""


class Fp8MismatchError(MpsboostError, ValueError):
    """An fp8 file does not fit the model it is loaded into (module paths, kinds, tensor names, shapes, dtypes)."""


class Fp8ConversionError(MpsboostError, ValueError):
    """A weight cannot be converted to fp8 (no data on the meta device, inf or NaN values)."""


class Fp8StateError(MpsboostError, RuntimeError):
    """A converted module no longer holds fp8 codes (the model was cast after patching), or holds none to save."""
