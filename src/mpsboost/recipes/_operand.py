"""The one decode-operand protocol that decode recipes (linear_attention, attention_decode, moe_block) read, for every
stored-weight format: fp8 (:mod:`mpsboost.recipes.fp8.layers`) and MLX affine low bits
(:mod:`mpsboost.recipes.low_bit.layers`).

:func:`decode_operand` gives, for a projection, what an eager decode step calls every token: an operand object where
the module's few-rows path is a kernel of its own format, else the module itself. An operand

* is called as ``op(x)`` or ``op(x, out=buffer)`` (a 2-D input of at most ``max_rows`` rows in ``dtype``; other
  inputs go to its ``layer``), and writes into ``out`` when given (``writes_out``);
* may stack its rows with another operand's into one product (``op.beside(other)`` -> an operand or None), which a
  recipe uses where the bf16 step fuses two projections (DeltaNet's ``in_proj_b`` / ``in_proj_a``).

A recipe keeps operands with its other eager constants and rebuilds them when the layer's tensors change; traced code
never sees them.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, runtime_checkable

import torch

__all__ = ["DecodeOperand", "decode_operand", "beside"]


@runtime_checkable
class DecodeOperand(Protocol):
    layer: Any
    max_rows: int
    dtype: torch.dtype
    writes_out: bool

    def __call__(self, x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor: ...


def decode_operand(module: Any) -> Any:
    """The decode operand of ``module`` (a low-bit layer's, an fp8 layer's), or ``module`` itself."""
    from .low_bit.layers import affine_state
    from .low_bit.layers import decode_operand as low_bit_operand

    if isinstance(module, torch.nn.Module) and affine_state(module) is not None:
        return low_bit_operand(module)
    from .fp8.layers import decode_operand as fp8_operand

    return fp8_operand(module)


def beside(a: Any, b: Any) -> Any:
    """One operand for ``a``'s and ``b``'s rows side by side where their format can stack them, else None."""
    fn = getattr(a, "beside", None)
    return fn(b) if fn is not None else None
