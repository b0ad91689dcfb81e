"""One-token ``F.linear``: the forwards that ``decode_linear`` binds on ``nn.Linear`` instances.

Decoding runs every projection of a model on a single row, ``[B, 1, K]``. These forwards route that row
to the fastest path of the environment and leave every other input (prefill, ``rows > 1``) on the stock
``F.linear`` call after one cheap shape test, so prefill pays well under a microsecond per layer.

- :func:`forward_fold_rows` (MPS before torch 2.15): ``F.linear`` on ``[B, 1, K]`` ran 8.5x slower than on
  ``[B, K]`` (issue pytorch#189847, fixed by pytorch#189855), so the singleton row dimension is folded
  away before the call and restored after it. Both reshapes are views: no copy.
- :func:`forward_triton_gemv` (CUDA): a Triton matrix-vector kernel with fused bias, used for one-row
  inputs of the layers where it measured faster than cuBLAS; see :mod:`mpsboost.ops.gemv_triton`.

``ops`` never imports diffusers or transformers.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

__all__ = ["forward_fold_rows", "forward_triton_gemv", "forward_triton_gemv_graph", "make_triton_forward", "one_row"]


def one_row(x: torch.Tensor, k: int) -> bool:
    """True for a single-token activation: exactly one row of ``k`` features, in any rank."""
    return x.numel() == k and x.dim() >= 2


def forward_fold_rows(self: torch.nn.Linear, input: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward`` that feeds ``[..., 1, K]`` to ``F.linear`` as ``[rows, K]`` (pytorch#189847)."""
    # Only the decode layout is touched: a singleton second-to-last dim in a tensor of rank >= 3.
    if input.dim() >= 3 and input.shape[-2] == 1:
        lead = input.shape[:-1]
        out = F.linear(input.reshape(-1, input.shape[-1]), self.weight, self.bias)
        return out.view(*lead, out.shape[-1])
    return F.linear(input, self.weight, self.bias)


def make_triton_forward(*, graph_only: bool) -> Callable[[torch.nn.Linear, torch.Tensor], torch.Tensor]:
    """The CUDA forward: Triton GEMV for one-row inputs, cuBLAS (stock ``F.linear``) for the rest.

    ``graph_only=True`` uses the kernel only while a CUDA graph is being captured: inside a graph a
    launch costs nothing on the host, while in eager mode Triton's Python launcher costs more host time
    than cuBLAS's, and decoding small models in eager mode is bound by exactly that host time.
    """
    from . import gemv_triton

    is_capturing = torch.cuda.is_current_stream_capturing

    def forward(self: torch.nn.Linear, input: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        k = weight.shape[1]
        # Cheapest and most selective tests first: prefill (rows > 1) leaves after one numel() compare,
        # an eager decode step (graph_only) after one capture query (asked of CUDA tensors only: a
        # CPU-only torch build has no capture state to ask).
        if (
            input.numel() == k
            and input.is_cuda
            and (not graph_only or is_capturing())
            and input.dtype == weight.dtype
            and input.stride(-1) == 1
            and not (torch.is_grad_enabled() and (input.requires_grad or weight.requires_grad))
        ):
            out = gemv_triton.gemv(input.reshape(1, k), weight, self.bias)
            return out.view(*input.shape[:-1], weight.shape[0])
        return F.linear(input, weight, self.bias)

    forward.__name__ = "forward_triton_gemv_graph" if graph_only else "forward_triton_gemv"
    return forward


forward_triton_gemv = make_triton_forward(graph_only=False)
forward_triton_gemv_graph = make_triton_forward(graph_only=True)
