"""Device-synchronised timing: warm-up, repeats, median and spread.

* CUDA: CUDA events around every call on the current stream, read after one final synchronise
  (device time, no host round trip between repeats); optionally by replaying a captured CUDA
  graph, which removes launch overhead for launch-bound operators (one-token GEMV, small kernels).
* MPS: ``torch.mps.synchronize()`` before and after every call, timed with ``time.perf_counter``
  (MPS events exist but a synchronised wall clock is what every MPS build supports).
* CPU: ``time.perf_counter`` around every call.

Never time with the memory sampler running: :mod:`mpsboost.bench.memory` is a separate pass.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable

from .errors import CudaGraphCaptureError, TimingError
from .progressbar import tick
from .records import OpTime, Throughput

__all__ = ["Timing", "time_fn", "synchronize", "device_type_of"]


def device_type_of(device: Any) -> str:
    """``"cuda"``, ``"mps"`` or ``"cpu"`` for a device string or ``torch.device``; a clear error otherwise."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise TimingError(f"device {device!r} is not a torch device; pass 'cuda', 'cuda:0', 'mps' or 'cpu'") from exc
    if dev.type not in ("cuda", "mps", "cpu"):
        raise TimingError(f"device type {dev.type!r} is not supported by the timer; accepted: cuda, mps, cpu")
    return dev.type


def synchronize(device: Any) -> None:
    """Wait for all queued work on ``device`` (no-op on CPU)."""
    import torch

    kind = device_type_of(device)
    if kind == "cuda":
        torch.cuda.synchronize(torch.device(device))
    elif kind == "mps":
        torch.mps.synchronize()


@dataclass(frozen=True)
class Timing:
    """Seconds per call of a timed function: median and spread over ``repeats`` samples."""

    median_s: float
    min_s: float
    max_s: float
    q1_s: float
    q3_s: float
    mean_s: float
    repeats: int
    warmup: int
    method: str  # "cuda_events", "cuda_graph", "mps_synchronize", "perf_counter"
    calls: int  # calls of fn per sample (the figures above are per call)
    samples_s: tuple[float, ...]
    note: str | None = None  # e.g. why CUDA-graph capture fell back to events

    @property
    def iqr_s(self) -> float:
        return self.q3_s - self.q1_s

    @property
    def median_us(self) -> float:
        return self.median_s * 1e6

    def op_time(self) -> OpTime:
        """This timing as an operator-time record section (microseconds per call)."""
        return OpTime(
            median_us=self.median_s * 1e6,
            min_us=self.min_s * 1e6,
            max_us=self.max_s * 1e6,
            iqr_us=self.iqr_s * 1e6,
            repeats=self.repeats,
            warmup=self.warmup,
            method=self.method,
            calls=self.calls,
        )

    # The planned name used by benchmark scripts.
    to_op_time = op_time

    def throughput(self, items_per_call: float | None = None, unit: str = "s/call") -> Throughput:
        """This timing as a throughput record section.

        With ``items_per_call`` (tokens or frames one call produces) and a rate ``unit`` such as
        ``"tokens/s"`` the value is ``items_per_call / median_s``; without, the value is the median
        seconds per call in ``unit="s/call"`` (or ``"ms/call"``).
        """
        spread = {"min_s": self.min_s, "max_s": self.max_s, "iqr_s": self.iqr_s}
        if items_per_call is None:
            scale = {"s/call": 1.0, "ms/call": 1e3, "us/call": 1e6}.get(unit)
            if scale is None:
                raise TimingError(
                    f"throughput unit {unit!r} needs items_per_call (how many tokens/frames one call makes); "
                    "without it the accepted units are 's/call', 'ms/call', 'us/call'"
                )
            value = self.median_s * scale
        else:
            if not (isinstance(items_per_call, (int, float)) and items_per_call > 0):
                raise TimingError(f"items_per_call must be a positive number, got {items_per_call!r}")
            if unit in ("s/call", "ms/call", "us/call"):
                raise TimingError(
                    f"unit {unit!r} is a time per call; with items_per_call give a rate such as 'tokens/s'"
                )
            value = items_per_call / self.median_s
        return Throughput(
            value=value,
            unit=unit,
            seconds_per_call=self.median_s,
            items_per_call=items_per_call,
            repeats=self.repeats,
            warmup=self.warmup,
            spread=spread,
        )

    def __str__(self) -> str:
        return (
            f"{_fmt_s(self.median_s)} median ({_fmt_s(self.min_s)}..{_fmt_s(self.max_s)}, IQR {_fmt_s(self.iqr_s)}; "
            f"{self.repeats} repeats, {self.method})"
        )


def _fmt_s(s: float) -> str:
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3f} ms"
    return f"{s * 1e6:.1f} us"


def _quantile(sorted_xs: list[float], q: float) -> float:
    # Linear interpolation between closest ranks (numpy's default), robust for tiny samples.
    if len(sorted_xs) == 1:
        return sorted_xs[0]
    pos = q * (len(sorted_xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def _summarise(samples: list[float], *, calls: int, warmup: int, method: str, note: str | None = None) -> Timing:
    per_call = [s / calls for s in samples]
    xs = sorted(per_call)
    return Timing(
        median_s=statistics.median(xs),
        min_s=xs[0],
        max_s=xs[-1],
        q1_s=_quantile(xs, 0.25),
        q3_s=_quantile(xs, 0.75),
        mean_s=statistics.fmean(xs),
        repeats=len(xs),
        warmup=warmup,
        method=method,
        calls=calls,
        samples_s=tuple(per_call),
        note=note,
    )


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TimingError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def time_fn(
    fn: Callable[[], Any],
    *,
    device: Any,
    warmup: int = 3,
    repeats: int = 10,
    cuda_graph: bool | str = False,
    calls: int = 1,
    progress: Callable[[int], None] | None = None,
) -> Timing:
    """Time ``fn()`` (no arguments: close over the inputs) on ``device``; returns a :class:`Timing`.

    ``warmup`` untimed calls first (kernel selection, caches, compilation), then ``repeats`` timed
    samples of ``calls`` calls each; figures are per call. ``cuda_graph``: ``False``; ``True`` to
    capture ``calls`` calls of ``fn`` into one CUDA graph and time its replay (raises
    :class:`CudaGraphCaptureError` when capture fails); ``"auto"`` to try the graph and fall back to
    events with a warning and a ``note`` on the result. ``progress(i)`` is called after each timed
    sample (for a progress bar).
    """
    import torch

    if not callable(fn):
        raise TimingError(f"fn must be a callable taking no arguments, got {type(fn).__name__}")
    warmup = _check_int("warmup", warmup, 0)
    repeats = _check_int("repeats", repeats, 1)
    calls = _check_int("calls", calls, 1)
    if cuda_graph not in (False, True, "auto"):
        raise TimingError(f"cuda_graph must be False, True or 'auto', got {cuda_graph!r}")
    kind = device_type_of(device)
    if cuda_graph and kind != "cuda":
        if cuda_graph is True:
            raise TimingError(f"cuda_graph=True needs a CUDA device, got {device!r}; use cuda_graph=False or 'auto'")
        cuda_graph = False

    if kind == "cuda":
        dev = torch.device(device)
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        with torch.cuda.device(dev):
            if cuda_graph:
                try:
                    return _time_cuda_graph(fn, warmup=warmup, repeats=repeats, calls=calls, progress=progress)
                except CudaGraphCaptureError as exc:
                    if cuda_graph is True:
                        raise
                    note = f"CUDA-graph capture failed, timed with events instead: {exc.__cause__ or exc}"
                    warnings.warn(note, RuntimeWarning, stacklevel=2)
                    t = _time_cuda_events(fn, warmup=warmup, repeats=repeats, calls=calls, progress=progress)
                    return dataclasses.replace(t, note=note)
            return _time_cuda_events(fn, warmup=warmup, repeats=repeats, calls=calls, progress=progress)

    for _ in range(warmup):
        fn()
    samples: list[float] = []
    if kind == "mps":
        for i in range(repeats):
            torch.mps.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            torch.mps.synchronize()
            samples.append(time.perf_counter() - t0)
            tick()
            if progress is not None:
                progress(i)
        return _summarise(samples, calls=calls, warmup=warmup, method="mps_synchronize")
    for i in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append(time.perf_counter() - t0)
        tick()
        if progress is not None:
            progress(i)
    return _summarise(samples, calls=calls, warmup=warmup, method="perf_counter")


def _time_cuda_events(fn, *, warmup: int, repeats: int, calls: int, progress) -> Timing:
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    for i in range(repeats):
        starts[i].record()
        for _ in range(calls):
            fn()
        ends[i].record()
        if progress is not None:
            progress(i)
    torch.cuda.synchronize()
    tick(repeats)  # after the timed region: host work between events would skew device time
    samples = [s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends)]  # elapsed_time is in ms
    return _summarise(samples, calls=calls, warmup=warmup, method="cuda_events")


class _HostSync(Exception):
    """fn synchronised with the host during the pre-capture check."""


def capture_cuda_graph(fn, *, warmup: int = 1, calls: int = 1):
    """``calls`` calls of ``fn`` captured into one ``torch.cuda.CUDAGraph``, after ``warmup`` calls on a
    side stream (capture needs the allocator and cuBLAS workspaces set up outside the graph) and one
    call under ``set_sync_debug_mode("error")``: a function that synchronises with the host is refused
    before any capture is attempted (a failed capture can leave the stream in capture state).
    Raises :class:`CudaGraphCaptureError` saying why."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(side):
            for _ in range(max(warmup, 1)):
                fn()
            previous = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")
            try:
                fn()
            except RuntimeError as exc:
                raise _HostSync(exc) from exc
            finally:
                torch.cuda.set_sync_debug_mode(previous)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        torch.cuda.synchronize()
    except _HostSync as sync:
        raise CudaGraphCaptureError(
            f"could not capture the timed function into a CUDA graph: it synchronises with the host "
            f"({sync.__cause__}); capture was not attempted. "
            "Time with cuda_graph=False, or cuda_graph='auto' to fall back"
        ) from sync.__cause__
    except Exception as exc:  # capture fails with RuntimeError/CUDA errors of many kinds
        # A failed capture can leave the stream in capture mode or with a sticky error; sync to
        # surface it here rather than in the caller's next op.
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001 - the original capture error is the one to report
            pass
        raise CudaGraphCaptureError(
            f"could not capture the timed function into a CUDA graph ({type(exc).__name__}: {exc}). "
            "Graphs need static shapes, no host synchronisation (.item(), .tolist(), nonzero, printing) "
            "and no CPU tensors inside; time with cuda_graph=False, or cuda_graph='auto' to fall back"
        ) from exc
    return graph


def _time_cuda_graph(fn, *, warmup: int, repeats: int, calls: int, progress) -> Timing:
    import torch

    graph = capture_cuda_graph(fn, warmup=warmup, calls=calls)
    graph.replay()  # one untimed replay: first replay uploads the graph
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    for i in range(repeats):
        starts[i].record()
        graph.replay()
        ends[i].record()
        if progress is not None:
            progress(i)
    torch.cuda.synchronize()
    tick(repeats)
    samples = [s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends)]
    del graph
    return _summarise(samples, calls=calls, warmup=warmup, method="cuda_graph")
