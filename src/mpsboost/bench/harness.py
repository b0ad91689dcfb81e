"""Parts every benchmark script shares: the copy-bandwidth probe, the 5-D pad counter and the
measure loop.

* :func:`copy_bandwidth`: device-to-device copy bandwidth (bytes read plus bytes written over
  time), the ceiling that "fraction of the bandwidth limit" figures refer to.
* :func:`count_pad5d`: counts padding at the aten level on rank-5 inputs (``constant_pad_nd``,
  ``replication_pad3d``, ``reflection_pad3d``), whatever Python function issued it (``F.pad``,
  ``nn.ZeroPad3d``, a library's own helper), through a ``TorchDispatchMode``; ``by_rank`` counts
  every pad operator by input rank (the 4-D pads of 2-D VAEs such as Qwen-Image-2.1's).
* :func:`measure_variants`: times several variants of one workload in alternation (round ``r``
  runs every variant once, in an order rotated by ``r``), so that a machine that slows down or
  speeds up during the run touches every variant alike. Each variant gets a
  :class:`~mpsboost.bench.timing.Timing` (median, min, max, quartiles); the result says whether the
  spread was large enough to call the machine busy, and :func:`verdict` says whether two variants
  differ at all (their min..max ranges apart) before any ratio is read.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterator, Mapping

from .errors import TimingError
from .timing import Timing, _summarise, capture_cuda_graph, device_type_of, time_fn

__all__ = [
    "copy_bandwidth",
    "PadCount",
    "count_pad5d",
    "PAD_OPS_5D",
    "Measurement",
    "measure_variants",
    "verdict",
    "BUSY_SPREAD",
    "MIN_REPEATS",
]

#: Fewer repeats than this cannot show a spread worth the name; :func:`measure_variants` refuses.
MIN_REPEATS = 5
#: (max - min) / median of a variant above which the run is flagged as on a busy machine.
BUSY_SPREAD = 0.10


# --------------------------------------------------------------------------------------------------
# copy bandwidth


def copy_bandwidth(device: Any, *, nbytes: int = 1 << 30, repeats: int = 10) -> float | None:
    """Device-to-device copy bandwidth of ``device`` in bytes/s, counting bytes read plus written.

    ``None`` off CUDA and MPS (a CPU memcpy figure is no ceiling for anything measured here).
    """
    import torch

    kind = device_type_of(device)
    if kind == "cpu":
        return None
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    a.fill_(1)
    b = torch.empty_like(a)
    t = time_fn(lambda: b.copy_(a), device=device, warmup=3, repeats=repeats)
    a = b = None  # free both buffers (the timed closure names them)
    return 2 * nbytes / t.median_s


# --------------------------------------------------------------------------------------------------
# 5-D padding counter

#: The aten overloads that pad; counted when their input has rank 5.
PAD_OPS_5D = ("constant_pad_nd", "replication_pad3d", "reflection_pad3d")
#: Every aten pad overload; counted per input rank in ``PadCount.by_rank`` (e.g. the 4-D pads of a
#: 2-D VAE such as Qwen-Image-2.1's, which also go through MPSGraph before torch 2.15: pytorch#195368).
PAD_OPS_ANY = PAD_OPS_5D + ("replication_pad1d", "replication_pad2d", "reflection_pad1d", "reflection_pad2d")


@dataclass
class PadCount:
    """Calls of each aten pad operator on rank-5 inputs seen inside :func:`count_pad5d`, and
    (``by_rank``) of every pad operator by the rank of its input."""

    by_op: dict = field(default_factory=lambda: {name: 0 for name in PAD_OPS_5D})
    by_rank: dict = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    @property
    def all_ranks(self) -> int:
        return sum(self.by_rank.values())

    def to_dict(self) -> dict:
        return {"total": self.total, **self.by_op, "all_ranks": self.all_ranks, "by_rank": {str(k): v for k, v in sorted(self.by_rank.items())}}


@contextlib.contextmanager
def count_pad5d() -> Iterator[PadCount]:
    """Count aten-level padding of rank-5 tensors inside the block (and of any rank in ``by_rank``).

    Counting at the dispatcher sees every route to a pad kernel: ``F.pad`` in any mode, the
    ``nn.*Pad3d`` modules, and direct ``torch.ops.aten`` calls, which patching ``F.pad`` would miss.
    """
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    count = PadCount()
    aten = torch.ops.aten
    watched = {getattr(aten, name).default: name for name in PAD_OPS_ANY if hasattr(aten, name)}
    packets = {getattr(aten, name): name for name in PAD_OPS_ANY if hasattr(aten, name)}

    class _Counter(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = watched.get(func) or packets.get(getattr(func, "overloadpacket", None))
            if name is not None and args and isinstance(args[0], torch.Tensor):
                rank = args[0].dim()
                count.by_rank[rank] = count.by_rank.get(rank, 0) + 1
                if rank == 5 and name in count.by_op:
                    count.by_op[name] += 1
            return func(*args, **(kwargs or {}))

    with _Counter():
        yield count


# --------------------------------------------------------------------------------------------------
# the measure loop


def _sampler(fn: Callable[[], Any], device: Any, calls: int, cuda_graph: bool) -> tuple[Callable[[], float], str, Any]:
    """A function taking one timed sample of ``calls`` calls of ``fn`` (seconds), and the method name."""
    import torch

    kind = device_type_of(device)
    if kind == "cuda":
        if cuda_graph:
            graph = capture_cuda_graph(fn, calls=calls)
            graph.replay()
            torch.cuda.synchronize()

            def sample() -> float:
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                graph.replay()
                e.record()
                e.synchronize()
                return s.elapsed_time(e) / 1e3

            return sample, "cuda_graph", graph

        def sample() -> float:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(calls):
                fn()
            e.record()
            e.synchronize()
            return s.elapsed_time(e) / 1e3

        return sample, "cuda_events", None
    if kind == "mps":

        def sample() -> float:
            torch.mps.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            torch.mps.synchronize()
            return time.perf_counter() - t0

        return sample, "mps_synchronize", None

    def sample() -> float:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return time.perf_counter() - t0

    return sample, "perf_counter", None


@dataclass(frozen=True)
class Measurement:
    """Timings of the variants of one workload taken in alternation, and how noisy they were."""

    timings: dict  # variant -> Timing
    order: str  # how the rounds were ordered
    busy: bool  # some variant's (max - min) / median exceeded busy_spread
    worst_spread: float  # that largest (max - min) / median
    busy_spread: float

    def ratio(self, variant: str, baseline: str = "stock") -> float:
        """Speedup of ``variant`` over ``baseline`` (medians of this one run; > 1 is faster)."""
        return self.timings[baseline].median_s / self.timings[variant].median_s

    def verdict(self, variant: str, baseline: str = "stock") -> str:
        return verdict(self.timings[baseline], self.timings[variant])

    def extra(self, variant: str, baseline: str = "stock") -> dict:
        """What a record of ``variant`` should carry about this measurement."""
        out = {"alternated_with": [v for v in self.timings if v != variant], "order": self.order,
               "busy_machine": self.busy, "worst_relative_spread": self.worst_spread}
        if baseline in self.timings and variant != baseline:
            out["speedup_vs_" + baseline] = self.ratio(variant, baseline)
            out["verdict_vs_" + baseline] = self.verdict(variant, baseline)
        return out


def verdict(baseline: Timing, variant: Timing) -> str:
    """``"faster"``/``"slower"`` when the two min..max ranges are apart; ``"no difference"`` when they overlap."""
    if variant.max_s < baseline.min_s:
        return "faster"
    if variant.min_s > baseline.max_s:
        return "slower"
    return "no difference"


def measure_variants(
    variants: Mapping[str, Callable[[], Any]],
    *,
    device: Any,
    repeats: int = MIN_REPEATS,
    warmup: int = 2,
    calls: int = 1,
    cuda_graph: bool = False,
    busy_spread: float = BUSY_SPREAD,
    contexts: Mapping[str, Callable[[], ContextManager]] | None = None,
) -> Measurement:
    """Time each of ``variants`` (name -> no-argument callable) in alternating rounds.

    Every variant is warmed up ``warmup`` times (and, with ``cuda_graph``, captured once into a
    graph of ``calls`` calls), then ``repeats`` rounds each take one sample of every variant, the
    starting variant rotating from round to round. Figures are per call.

    ``contexts`` (name -> a function returning a context manager) puts a variant into its state around
    each of its warm-ups and samples, outside the timed region: e.g. ``mpsboost.patched(model)`` where
    every variant is the one model, patched differently. Not with ``cuda_graph``.
    """
    if not variants:
        raise TimingError("measure_variants needs at least one variant")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < MIN_REPEATS:
        raise TimingError(f"repeats must be an integer >= {MIN_REPEATS} (a spread needs samples), got {repeats!r}")
    if isinstance(calls, bool) or not isinstance(calls, int) or calls < 1:
        raise TimingError(f"calls must be an integer >= 1, got {calls!r}")
    contexts = dict(contexts or {})
    unknown = sorted(set(contexts) - set(variants))
    if unknown:
        raise TimingError(f"contexts for variants that are not measured: {unknown}; variants: {sorted(variants)}")
    if contexts and cuda_graph:
        raise TimingError("contexts cannot be entered around a CUDA-graph replay; time such variants with cuda_graph=False")
    names = list(variants)

    def state(name: str) -> ContextManager:
        return contexts[name]() if name in contexts else contextlib.nullcontext()

    samplers, methods, keep = {}, {}, []
    for name in names:
        with state(name):
            for _ in range(warmup):
                variants[name]()
            samplers[name], methods[name], handle = _sampler(variants[name], device, calls, cuda_graph)
        keep.append(handle)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            with state(name):
                samples[name].append(samplers[name]())
    timings = {n: _summarise(samples[n], calls=calls, warmup=warmup, method=methods[n]) for n in names}
    worst = max((t.max_s - t.min_s) / t.median_s for t in timings.values() if t.median_s > 0)
    del keep
    return Measurement(timings=timings, order="alternating rounds, start rotated each round", busy=worst > busy_spread,
                       worst_spread=worst, busy_spread=busy_spread)
