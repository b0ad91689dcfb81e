"""Reading fp8 checkpoints as people publish them: where the fp8 recipe's file code is found, re-exported.

The code moved into the quantized-weights package, :mod:`mpsboost.quant`, where every weight format is a row:

* :mod:`mpsboost.quant.io` -- the one safetensors reader (headers, shard indexes, tensor reads);
* :mod:`mpsboost.quant.fp8_formats` -- the four fp8 formats as :class:`~mpsboost.quant.fp8_formats.Fp8Format`
  rows (``mpsboost``, ``transformers-fp8``, ``compressed-tensors``, ``scaled_fp8``: detection, scale keys and
  layouts, key maps, what each ignores), :func:`open_checkpoint`, :func:`detect`, :func:`scale_to_float32`;
* :mod:`mpsboost.quant.fp8_plan` -- :func:`plan_load`, generic over the row, and :func:`describe_checkpoint`.

Every name importable here before the move still is (the same objects: ``read_tensor`` is
:func:`mpsboost.quant.io.read_tensor`). This module imports neither diffusers nor transformers at import time.
"""

from __future__ import annotations

from ...quant.fp8_formats import (  # noqa: F401  (re-exported)
    COMPRESSED_TENSORS,
    FORMATS,
    FP8_FORMATS,
    MPSBOOST,
    SCALED_FP8,
    TRANSFORMERS_FP8,
    Checkpoint,
    Fp8Format,
    detect,
    open_checkpoint,
    scale_to_float32,
)
from ...quant.fp8_plan import LoadPlan, Part, PTensor, QTensor, describe_checkpoint, plan_load  # noqa: F401
from ...quant.io import ST_DTYPES, TORCH_TO_ST, TensorEntry, read_tensor, safetensors_header  # noqa: F401

__all__ = [
    "FORMATS",
    "TensorEntry",
    "Checkpoint",
    "open_checkpoint",
    "detect",
    "read_tensor",
    "scale_to_float32",
    "ST_DTYPES",
    "TORCH_TO_ST",
    "plan_load",
    "describe_checkpoint",
]
