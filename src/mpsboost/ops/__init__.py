"""Tensor functions: one module per operation, the paths of that operation and nothing else.

Policy stays out: which path a layer takes (asked of the gate, a Metal kernel's patch-time self-check and the
Mac's timings), thresholds, tuning files and device constants are decided by the recipes (e.g.
:mod:`mpsboost.recipes.fp8.paths`, :mod:`mpsboost.recipes.low_bit.paths`) and arrive here as arguments. How a
library's code is reached (rebinding a forward, a function's globals) is integration and lives with the recipes
too. Of mpsboost, ``ops`` imports only ``mpsboost.errors`` (the exception classes a user catches): not the gate,
tuning, registry, patching, a recipe, the API or a checkpoint module. It never imports or names diffusers or
transformers. ``tests/core/test_import.py`` holds it to both.
"""
