"""low_bit_weights: MLX affine low-bit weights. ``recipe.py`` (the recipe: decisions per device and layer),
``layers.py`` (one state type, the forwards of linear, experts and embedding layers, the layer classes, the decode
operand). Loading, quantising at load and saving live in :mod:`mpsboost.quant`."""

from __future__ import annotations

from .recipe import LowBitWeights  # noqa: F401  (registers low_bit_weights)
