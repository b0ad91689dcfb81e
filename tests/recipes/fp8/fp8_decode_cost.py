"""What one decode step costs (aten ops and bytes moved, per block): :mod:`mpsboost.bench.decode_cost`, and the
names of the aten ops a call dispatches (:class:`AtenOps`)."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode

from mpsboost.bench.decode_cost import BLOCKS, build, decode_cost

__all__ = ["AtenOps", "BLOCKS", "build", "decode_cost"]


class AtenOps(TorchDispatchMode):
    """Records the name of every aten op dispatched inside it (``_scaled_mm``, ``_scaled_mm_v2``, ...): how a test
    sees which fp8 matmul a path calls. The torch 2.15.0 macOS wheel has an MPS kernel for ``_scaled_mm_v2`` only."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))
