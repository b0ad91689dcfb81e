"""One-token ``F.linear``: the forwards that ``decode_linear`` binds on ``nn.Linear`` instances.

Decoding runs every projection of a model on a single row, ``[B, 1, K]``. These forwards route that row
to the fastest path of the environment and leave every other input (prefill, ``rows > 1``) on the stock
``F.linear`` call after one cheap shape test, so prefill pays well under a microsecond per layer.

Paths (:data:`PATHS`), chosen per layer at patch time, separately for eager and compiled execution:

- ``"fold"`` (MPS before torch 2.15): ``F.linear`` on ``[B, 1, K]`` ran 8.5x slower than on ``[B, K]``
  (issue pytorch#189847, fixed by pytorch#189855), so the singleton row dimension is folded away before
  the call and restored after it. Both reshapes are views: no copy.
- ``"gemv"`` / ``"gemv_graph"`` (CUDA): the Triton matrix-vector kernel with fused bias
  (``torch.ops.mpsboost.gemv``, see :mod:`mpsboost.ops.gemv_triton`) for one-row inputs; ``gemv_graph``
  only while a CUDA graph is being captured (in eager mode Triton's Python launcher costs more host time
  than cuBLAS's, and decoding small models eagerly is bound by exactly that host time).
- ``"stock"``: ``F.linear`` unchanged.

:func:`make_forward` binds one eager and one compiled path (and, for the GEMV paths, the kernel's launch
width ``gemv_block_n``, decided by the recipe). The compiled one is selected by
``torch.compiler.is_compiling()``, a constant while dynamo traces, so a compiled forward contains no host
query at all (``torch.cuda.is_current_stream_capturing()`` is asked only in eager mode).

``ops`` never imports diffusers or transformers.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from . import gemv_triton

__all__ = ["PATHS", "forward_fold_rows", "make_forward"]

PATHS = ("stock", "fold", "gemv", "gemv_graph")

Forward = Callable[[torch.nn.Linear, torch.Tensor], torch.Tensor]


def _stock(self: torch.nn.Linear, input: torch.Tensor) -> torch.Tensor:
    return F.linear(input, self.weight, self.bias)


def forward_fold_rows(self: torch.nn.Linear, input: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward`` that feeds ``[..., 1, K]`` to ``F.linear`` as ``[rows, K]`` (pytorch#189847)."""
    # Only the decode layout is touched: a singleton second-to-last dim in a tensor of rank >= 3.
    if input.dim() >= 3 and input.shape[-2] == 1:
        lead = input.shape[:-1]
        out = F.linear(input.reshape(-1, input.shape[-1]), self.weight, self.bias)
        return out.view(*lead, out.shape[-1])
    return F.linear(input, self.weight, self.bias)


def _gemv_ok(self: torch.nn.Linear, input: torch.Tensor) -> bool:
    # Cheapest and most selective test first: prefill (rows > 1) leaves after one numel() compare.
    # Under torch.compile each of these is a trace-time fact (a shape guard, dtype, stride, grad mode).
    weight = self.weight
    return (
        input.numel() == weight.shape[1]
        and input.dtype == weight.dtype
        and input.stride(-1) == 1
        and not (torch.is_grad_enabled() and (input.requires_grad or weight.requires_grad))
    )


def _forward_gemv(self: torch.nn.Linear, input: torch.Tensor, block_n: int) -> torch.Tensor:
    if _gemv_ok(self, input):
        weight = self.weight
        out = gemv_triton.gemv(input.reshape(1, weight.shape[1]), weight, self.bias, block_n)
        return out.view(*input.shape[:-1], weight.shape[0])
    return F.linear(input, self.weight, self.bias)


def _forward_gemv_graph(self: torch.nn.Linear, input: torch.Tensor, block_n: int) -> torch.Tensor:
    # Eager only (make_forward never binds this as the compiled path): the capture query is a host call.
    # Asked of CUDA tensors only: a CPU-only torch build has no capture state to ask.
    if input.is_cuda and torch.cuda.is_current_stream_capturing():
        return _forward_gemv(self, input, block_n)
    return F.linear(input, self.weight, self.bias)


_BY_PATH: dict[str, Forward] = {"stock": _stock, "fold": forward_fold_rows}
_GEMV_PATHS: dict[str, Callable[[torch.nn.Linear, torch.Tensor, int], torch.Tensor]] = {
    "gemv": _forward_gemv,
    "gemv_graph": _forward_gemv_graph,
}


def _path_forward(path: str, block_n: int | None) -> Forward:
    if path in _BY_PATH:
        return _BY_PATH[path]
    gemv_fn = _GEMV_PATHS[path]

    def forward(self: torch.nn.Linear, input: torch.Tensor) -> torch.Tensor:
        return gemv_fn(self, input, block_n)

    return forward


def make_forward(eager: str, compiled: str, *, gemv_block_n: int | None = None) -> Forward:
    """The forward with path ``eager`` outside ``torch.compile`` and ``compiled`` inside it (:data:`PATHS`).

    ``gemv_block_n``: output features per program of the GEMV kernel (``gemv_triton.block_n_for``); needed
    when either path is a GEMV path."""
    for label, path in (("eager", eager), ("compiled", compiled)):
        if path not in PATHS:
            raise ValueError(f"decode_linear {label} path must be one of {PATHS}, got {path!r}")
    if compiled == "gemv_graph":
        raise ValueError("'gemv_graph' asks the host about CUDA-graph capture: it is an eager path only; use 'gemv'")
    if gemv_block_n is None and (eager in _GEMV_PATHS or compiled in _GEMV_PATHS):
        raise ValueError(
            f"make_forward({eager!r}, {compiled!r}) runs the GEMV kernel: pass gemv_block_n "
            "(gemv_triton.block_n_for(out_features, programs))"
        )
    eager_fn, compiled_fn = _path_forward(eager, gemv_block_n), _path_forward(compiled, gemv_block_n)

    def forward(self: torch.nn.Linear, input: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return compiled_fn(self, input)
        return eager_fn(self, input)

    forward.__name__ = f"forward_{eager}_compiled_{compiled}"
    return forward
