"""mpsboost's quantized-weights package: low-bit checkpoints loaded into transformers models, quantised, saved.

* :mod:`.io` - file I/O that knows no format (safetensors headers, shard indexes, streaming reads, a writer);
* :mod:`.codec` - MLX's affine code in plain torch (bit for bit ``mx.quantize`` / ``mx.dequantize``);
* :mod:`.formats` - formats as rows (detection, the model they hold, key map and tensor decoders, checks);
  :mod:`.families` - the model families of MLX checkpoints and every rewrite mlx-lm's converter made;
* :mod:`.fp8_formats` - the fp8 formats as rows (detection, scale keys and layouts, key maps, what each ignores);
  :mod:`.fp8_plan` - their load plan, generic over the row (``mpsboost.load_fp8`` reads it);
* :mod:`.plan` - the load plan, generic over the row; :mod:`.load` - :func:`from_pretrained`;
* :mod:`.layers` - the quantized layer family (linear, experts, embedding) and its decode operand;
  :mod:`.operand` - the one decode-operand protocol decode recipes read;
* :mod:`.quantize` / :mod:`.save` - quantise at load, save in the MLX layout (mlx-lm loads it).

Importing it imports neither diffusers nor transformers (and not :mod:`mpsboost.api`): everything is lazy.
"""

from __future__ import annotations

from typing import Any

__all__ = ["from_pretrained", "save_mlx"]


def from_pretrained(path: Any, **kw: Any):
    """See :func:`mpsboost.quant.load.from_pretrained`."""
    from .load import from_pretrained as _load

    return _load(path, **kw)


def save_mlx(model: Any, path: Any, **kw: Any):
    """See :func:`mpsboost.quant.save.save_mlx`."""
    from .save import save_mlx as _save

    return _save(model, path, **kw)
