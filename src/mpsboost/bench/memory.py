"""Memory peaks during a block: tensor-allocated, allocator-reserved and driver-level, kept apart.

    with measure_memory("cuda") as probe:
        vae.decode(z)
    mem = probe.peaks()          # a records.Memory; None in a field: no such counter here

Why three numbers: on MPS a Wan2.2 VAE decode once held 270 GiB at the driver while the allocator
reported 8 GiB (MPSGraph kept its own buffers for every ``F.pad``; pytorch#195368). One figure
would have hidden it.

* CUDA: ``torch.cuda.reset_peak_memory_stats`` on entry, ``max_memory_allocated`` and
  ``max_memory_reserved`` on exit (exact peaks kept by the allocator), and the device memory in use
  sampled in a background thread: NVML (``pynvml`` from nvidia-ml-py) where importable, else
  ``torch.cuda.mem_get_info``. Both are device-wide: other processes on the GPU count too.
* MPS: ``torch.mps.current_allocated_memory`` (tensors) and ``torch.mps.driver_allocated_memory``
  (everything Metal holds for this process, MPSGraph included) sampled in a background thread.
  MPS has no public allocator-reserved counter: that field is None.
* CPU: the process resident set size sampled in a background thread (``/proc/self/statm`` on
  Linux, ``psutil`` elsewhere when installed). ``getrusage().ru_maxrss`` is a lifetime peak, useless
  for one block, so it is only the last resort (and then named so in ``driver_level_source``).
  Tensor-allocated and allocator-reserved are None on CPU.

Sampled peaks can miss spikes shorter than the interval; a sample is also taken on entry and exit.
The sampler thread competes for the GIL, so never time inside this block: memory and timing are
separate passes.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any, Callable

from .errors import MemoryProbeError
from .records import Memory

__all__ = ["measure_memory", "MemoryProbe", "process_rss_bytes"]

DEFAULT_INTERVAL_S = 0.002


def _statm_rss() -> int | None:
    try:
        with open("/proc/self/statm", "rb") as fh:
            fields = fh.read().split()
        return int(fields[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _rss_reader() -> tuple[Callable[[], int] | None, str]:
    if _statm_rss() is not None:
        return _statm_rss, "process_rss"  # type: ignore[return-value]
    try:
        import psutil  # optional

        proc = psutil.Process()
        return (lambda: int(proc.memory_info().rss)), "process_rss"
    except Exception:  # noqa: BLE001 - psutil absent or refusing: fall through to getrusage
        pass
    try:
        import resource

        # ru_maxrss is in kilobytes on Linux and bytes on macOS; it is the lifetime peak.
        scale = 1 if sys.platform == "darwin" else 1024
        return (lambda: int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * scale), "process_maxrss_lifetime"
    except (ImportError, OSError):
        return None, "none"


def process_rss_bytes() -> int | None:
    """The current resident set size of this process in bytes, or None where it cannot be read."""
    read, source = _rss_reader()
    if read is None or source != "process_rss":
        return None
    return read()


class _Sampler(threading.Thread):
    """Calls each reader every ``interval_s`` and keeps the maximum of each."""

    def __init__(self, readers: dict[str, Callable[[], int | None]], interval_s: float):
        super().__init__(name="mpsboost-memory-sampler", daemon=True)
        self.readers = readers
        self.interval_s = interval_s
        self.peaks: dict[str, int | None] = {k: None for k in readers}
        self.count = 0
        self.error: BaseException | None = None
        self._stop_event = threading.Event()

    def sample(self) -> None:
        for name, read in self.readers.items():
            value = read()
            if value is not None and (self.peaks[name] is None or value > self.peaks[name]):
                self.peaks[name] = value
        self.count += 1

    def run(self) -> None:
        try:
            while not self._stop_event.wait(self.interval_s):
                self.sample()
        except BaseException as exc:  # noqa: BLE001 - reported on the main thread by stop()
            self.error = exc

    def stop(self) -> None:
        self._stop_event.set()
        self.join()
        if self.error is not None:
            raise MemoryProbeError(
                f"the memory sampler failed: {type(self.error).__name__}: {self.error}"
            ) from self.error


def _nvml_reader(index: int) -> Callable[[], int] | None:
    """Device memory in use by NVML for torch's CUDA device ``index``, or None without NVML."""
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return None
    try:
        import torch

        pynvml.nvmlInit()
        props = torch.cuda.get_device_properties(index)
        handle = None
        # Match by PCI address: CUDA_VISIBLE_DEVICES renumbers devices for CUDA but not for NVML.
        bus = getattr(props, "pci_bus_id", None)
        dev = getattr(props, "pci_device_id", None)
        dom = getattr(props, "pci_domain_id", None)
        if bus is not None and dev is not None and dom is not None:
            handle = pynvml.nvmlDeviceGetHandleByPciBusId(f"{dom:08x}:{bus:02x}:{dev:02x}.0".encode())
        elif "CUDA_VISIBLE_DEVICES" not in os.environ:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        if handle is None:
            return None
        pynvml.nvmlDeviceGetMemoryInfo(handle)  # fail here, not in the thread
        return lambda: int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
    except Exception:  # noqa: BLE001 - any NVML trouble: use torch.cuda.mem_get_info instead
        return None


class MemoryProbe:
    """Context manager returned by :func:`measure_memory`; read :meth:`peaks` after the block."""

    def __init__(self, device: Any, interval_s: float = DEFAULT_INTERVAL_S):
        import torch

        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise MemoryProbeError(
                f"device {device!r} is not a torch device; pass 'cuda', 'cuda:0', 'mps' or 'cpu'"
            ) from exc
        if dev.type not in ("cuda", "mps", "cpu"):
            raise MemoryProbeError(f"device type {dev.type!r} has no memory probe; accepted: cuda, mps, cpu")
        if isinstance(interval_s, bool) or not isinstance(interval_s, (int, float)) or not (0 < interval_s <= 10):
            raise MemoryProbeError(f"interval_s must be a number of seconds in (0, 10], got {interval_s!r}")
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise MemoryProbeError(
                "measure_memory('cuda') but torch sees no CUDA device; pass the device the block runs on"
            )
        if dev.type == "mps" and not torch.backends.mps.is_available():
            raise MemoryProbeError(
                "measure_memory('mps') but torch sees no MPS device; pass the device the block runs on"
            )
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.device = dev
        self.interval_s = float(interval_s)
        self._sampler: _Sampler | None = None
        self._result: Memory | None = None
        self._start: dict[str, int | None] = {}
        self._source: str | None = None

    # -- per device -------------------------------------------------------------------------------
    def _readers(self) -> dict[str, Callable[[], int | None]]:
        import torch

        kind = self.device.type
        if kind == "cuda":
            index = self.device.index
            read = _nvml_reader(index)
            if read is not None:
                self._source = "nvml_device_used"
            else:

                def read() -> int:
                    free, total = torch.cuda.mem_get_info(index)
                    return int(total - free)

                self._source = "cuda_mem_get_info"
            return {"driver_level": read}
        if kind == "mps":
            self._source = "mps_driver_allocated_memory"
            return {
                "tensor_allocated": lambda: int(torch.mps.current_allocated_memory()),
                "driver_level": lambda: int(torch.mps.driver_allocated_memory()),
            }
        read, source = _rss_reader()
        self._source = source
        return {} if read is None else {"driver_level": read}

    def __enter__(self) -> "MemoryProbe":
        import torch

        if self._sampler is not None:
            raise MemoryProbeError("this memory probe is already in use; create a new one with measure_memory(device)")
        kind = self.device.type
        if kind == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start["tensor_allocated"] = int(torch.cuda.memory_allocated(self.device))
            self._start["allocator_reserved"] = int(torch.cuda.memory_reserved(self.device))
        elif kind == "mps":
            torch.mps.synchronize()
        readers = self._readers()
        for name, read in readers.items():
            self._start[name] = read()
        self._sampler = _Sampler(readers, self.interval_s)
        self._sampler.sample()
        self._sampler.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        import torch

        sampler = self._sampler
        assert sampler is not None  # internal invariant: __enter__ ran
        kind = self.device.type
        try:
            if kind == "cuda":
                torch.cuda.synchronize(self.device)
            elif kind == "mps":
                torch.mps.synchronize()
        finally:
            sampler.stop()
        sampler.sample()  # the state at the end of the block (tensors still alive count)
        peaks = dict(sampler.peaks)
        tensor = peaks.get("tensor_allocated")
        reserved = None
        if kind == "cuda":
            tensor = int(torch.cuda.max_memory_allocated(self.device))
            reserved = int(torch.cuda.max_memory_reserved(self.device))
        self._result = Memory(
            tensor_allocated=tensor,
            allocator_reserved=reserved,
            driver_level=peaks.get("driver_level"),
            tensor_allocated_at_start=self._start.get("tensor_allocated"),
            allocator_reserved_at_start=self._start.get("allocator_reserved"),
            driver_level_at_start=self._start.get("driver_level"),
            driver_level_source=self._source,
            samples=sampler.count,
            interval_s=self.interval_s,
        )
        return False

    def peaks(self) -> Memory:
        """The peaks seen during the block, as a :class:`~mpsboost.bench.records.Memory`."""
        if self._result is None:
            raise MemoryProbeError(
                "peaks() read before the `with measure_memory(...)` block ended; read it after the block"
            )
        return self._result


def measure_memory(device: Any, *, interval_s: float = DEFAULT_INTERVAL_S) -> MemoryProbe:
    """A context manager that records the memory peaks of ``device`` during its block.

    ``interval_s`` is the background sampling period. Read ``probe.peaks()`` after the block.
    """
    return MemoryProbe(device, interval_s=interval_s)
