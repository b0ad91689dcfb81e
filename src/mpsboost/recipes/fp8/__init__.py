"""FP8 weight storage: the recipe (``fp8_weights``), its layers and the checkpoint formats it reads."""

from . import recipe  # noqa: F401  (registers fp8_weights)
