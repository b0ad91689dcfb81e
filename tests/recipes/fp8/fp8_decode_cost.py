"""What one decode step costs (aten ops and bytes moved, per block): :mod:`mpsboost.bench.decode_cost`, for the fp8
tests (the names of the ops a call dispatches: ``tiny_models.ModuleOps``)."""

from __future__ import annotations

from mpsboost.bench.decode_cost import BLOCKS, build, decode_cost

__all__ = ["BLOCKS", "build", "decode_cost"]
