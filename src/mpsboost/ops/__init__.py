"""Tensor functions: one module per operation, the paths of that operation and nothing else.

Policy stays out: which path a model takes, thresholds, tuning files and device constants are decided by
the recipes (and read from ``mpsboost.tuning``) and arrive here as arguments. How a library's code is
reached (rebinding a forward, a function's globals) is integration and lives with the recipes too.
Of mpsboost, ``ops`` imports only ``mpsboost.errors``, ``mpsboost.gate`` and ``mpsboost.tuning`` (the
measured-data reader, at the gate's level): no registry, patching, recipe, API or checkpoint module. It
never imports or names diffusers or transformers. ``tests/core/test_import.py`` holds it to both.
"""
