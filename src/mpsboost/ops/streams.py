"""A side stream for independent work, through device-generic APIs only.

``torch.Stream``, ``torch.accelerator.current_stream`` and ``Tensor.record_stream`` are the same
calls on CUDA today and on MPS in the 2.16 nightlies that carry pytorch#191415 (``torch.mps.Stream``),
#193464 (``record_stream``) and #194111 (multi-stream events). The version gate decides where this
is used (feature ``device_streams``); this module only runs it.

    side = SideStream(z.device)
    side.fork()                 # the side stream waits for what the main stream queued so far
    with side:                  # kernels queued here run on the side stream
        ...
    side.keep(tile)             # tile was made on the main stream and is used on the side one
    side.join()                 # the main stream waits for the side stream

On the CPU (no streams) the same object runs everything in order, so the code path stays testable
where no accelerator is present.
"""

from __future__ import annotations

import torch

__all__ = ["SideStream"]


class SideStream:
    """A side stream next to the current stream of ``device``."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.accelerated = self.device.type != "cpu"
        if self.accelerated:
            self.main = torch.accelerator.current_stream(self.device)
            self.side = torch.Stream(device=self.device)
        else:
            self.main = None
            self.side = None
        self._entered = None

    def fork(self) -> None:
        """Make the side stream wait for the work queued on the main stream up to now."""
        if self.accelerated:
            self.side.wait_stream(self.main)

    def join(self) -> None:
        """Make the main stream wait for the work queued on the side stream up to now."""
        if self.accelerated:
            self.main.wait_stream(self.side)

    def keep(self, tensor: torch.Tensor) -> None:
        """``tensor`` came from the main stream and is used on the side stream: keep its memory
        from being handed out again before the side stream is done with it."""
        if self.accelerated and tensor.device.type != "cpu":
            tensor.record_stream(self.side)

    def __enter__(self) -> "SideStream":
        if self.accelerated:
            if self._entered is not None:
                raise RuntimeError("SideStream blocks do not nest; leave the current `with` block first")
            self._entered = self.side
            self._entered.__enter__()
        return self

    def __exit__(self, *exc) -> bool:
        if self._entered is not None:
            entered, self._entered = self._entered, None
            entered.__exit__(*exc)
        return False
