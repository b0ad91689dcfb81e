"""THE measure loop of mpsboost, and the parts every measurement shares.

Everything that times a job (``mpsboost demo``, ``mpsboost selftest``, the recipe scripts in ``recipes/`` and
the scripts in ``benchmarks/``) measures through this module, so that warm-up, repeats, device
synchronisation, median and spread, the busy-machine check and the memory pass mean the same everywhere.

* :func:`measure_job`: one job of one variant: an output call (which also warms up), warm-ups, timed
  repeats (:func:`~mpsboost.bench.timing.time_fn`: device-synchronised, median and quartiles), the time of
  its main operators, and a memory pass kept apart from the timing.
* :func:`measure_variants`: times several variants of one workload in alternation (round ``r``
  runs every variant once, in an order rotated by ``r``), so that a machine that slows down or
  speeds up during the run touches every variant alike. Each variant gets a
  :class:`~mpsboost.bench.timing.Timing` (median, min, max, quartiles); the result says whether the
  spread was large enough to call the machine busy, and :func:`verdict` says whether two variants
  differ at all (their min..max ranges apart) before any ratio is read.
* :func:`paired_rounds`: the end-to-end form of the same loop: each round runs every variant once (stock,
  patched; the order reversed every other round, so that drift touches both sides alike), each variant
  possibly in several phases (a prefill call, a whole ``generate()``) sampled back to back in its state;
  :func:`round_ratios` turns the paired samples into one ratio per round, their median, min..max and IQR, and
  a label that never calls a variant faster when its rounds straddle 1.0.
* the busy-machine check: :data:`BUSY_SPREAD`, :func:`machine_load` and :func:`ratio_lines` (each speed
  ratio with its range over the repeats, and a warning when the machine was too busy to read it).
* :func:`copy_bandwidth`: device-to-device copy bandwidth (bytes read plus bytes written over
  time), the ceiling that "fraction of the bandwidth limit" figures refer to.
* :func:`count_pad5d`: counts padding at the aten level on rank-5 inputs (``constant_pad_nd``,
  ``replication_pad3d``, ``reflection_pad3d``), whatever Python function issued it (``F.pad``,
  ``nn.ZeroPad3d``, a library's own helper), through a ``TorchDispatchMode``; ``by_rank`` counts
  every pad operator by input rank (the 4-D pads of 2-D VAEs such as Qwen-Image-2.1's).
* :func:`best_device`, :func:`release` and :func:`frozen_heap`: the device a run defaults to, handing cached memory
  back between workloads, and keeping the garbage collection of each hand-back to what the run itself made.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterator, Mapping, Sequence

from .errors import TimingError
from .timing import Timing, _quantile, _summarise, capture_cuda_graph, device_type_of, synchronize, time_fn

__all__ = [
    "best_device",
    "release",
    "frozen_heap",
    "measure_job",
    "JobMeasurement",
    "machine_load",
    "relative_spread",
    "ratio_lines",
    "copy_bandwidth",
    "PadCount",
    "count_pad5d",
    "PAD_OPS_5D",
    "Measurement",
    "measure_variants",
    "verdict",
    "paired_rounds",
    "mark",
    "Rounds",
    "round_ratios",
    "RoundRatios",
    "round_order",
    "ORDERS",
    "FASTER",
    "SLOWER",
    "NOT_FASTER",
    "ONE_ROUND",
    "BUSY_SPREAD",
    "MIN_REPEATS",
]

#: Fewer repeats than this cannot show a spread worth the name; :func:`measure_variants` refuses.
MIN_REPEATS = 5
#: (max - min) / median of a variant's repeats above which the run is flagged as on a busy machine, and
#: a speed ratio read from it is called meaningless. One threshold for every entry point (the demo and the
#: cookbook used 0.25, the benchmarks 0.10): 0.10, because the effects mpsboost's recipes report are often
#: 1.1x-1.5x, and repeats that spread 25% of their median can move a ratio of two medians by more than such
#: an effect; 0.10 is also the threshold the published benchmark records were judged by.
BUSY_SPREAD = 0.10
#: How the variants of a round are ordered: ``"rotate"`` starts round ``r`` at variant ``r`` (a, b, c / b, c, a
#: / ...); ``"alternate"`` runs them in the given order on even rounds and reversed on odd ones (stock, patched /
#: patched, stock / ...), so that over two rounds every pair has run in both orders.
ORDERS = ("rotate", "alternate")
#: The labels of :attr:`RoundRatios.label`: a variant is "faster" only when every round says so.
FASTER = "faster in every round"
SLOWER = "slower in every round"
NOT_FASTER = "not faster: rounds straddle 1.0"
ONE_ROUND = "one round: no spread to judge"


# --------------------------------------------------------------------------------------------------
# devices


def best_device() -> str:
    """``"mps"``, else ``"cuda"``, else ``"cpu"``: the best device torch sees here."""
    import torch

    if torch.backends.mps.is_available():
        return "mps"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def release(device: Any) -> None:
    """Collect garbage and hand the device allocator's cached blocks back (between workloads: a 16 GB Mac
    must not carry one workload's cache into the next, and memory peaks must start from the same floor)."""
    import gc

    import torch

    gc.collect()
    kind = device_type_of(device)
    if kind == "cuda":
        torch.cuda.empty_cache()
    elif kind == "mps":
        torch.mps.empty_cache()


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Within: every object alive on entry (the imported modules of torch, transformers and diffusers, above all) in
    gc's permanent generation, so that each :func:`release` traverses what the run made since, not the whole heap
    (on a CPU a full ``gc.collect()`` over those libraries takes a few tenths of a second, once per probe and
    workload). What a frozen object refers to stays alive as before; garbage among the frozen objects waits for the
    exit, where they are handed back to the collector. Nested or under a caller's own ``gc.freeze()``: leaves the
    freezing to the outermost."""
    import gc

    if gc.get_freeze_count():
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


# --------------------------------------------------------------------------------------------------
# copy bandwidth


def copy_bandwidth(device: Any, *, nbytes: int = 1 << 30, repeats: int = 10, on_cpu: bool = False) -> float | None:
    """Device-to-device copy bandwidth of ``device`` in bytes/s, counting bytes read plus written.

    ``None`` on the CPU (a memcpy figure is no ceiling for anything measured on a GPU), unless ``on_cpu``:
    a smoke run on the CPU that computes a bandwidth share for its records only to show the code path works.
    """
    import torch

    kind = device_type_of(device)
    if kind == "cpu" and not on_cpu:
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
        return {
            "total": self.total,
            **self.by_op,
            "all_ranks": self.all_ranks,
            "by_rank": {str(k): v for k, v in sorted(self.by_rank.items())},
        }


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


class _Marks:
    """The marks of the sample being taken: ``mark(label)`` inside a timed call records the time since the
    sample began (a CUDA event on the current stream: no synchronisation; elsewhere the device is synchronised
    and the host clock read)."""

    def __init__(self, kind: str, clock: Callable[[], float]):
        self.kind, self.clock = kind, clock
        self.t0: float | None = None
        self.start: Any = None
        self.events: dict[str, Any] = {}

    def begin(self) -> None:
        self.events = {}
        if self.kind == "cuda":
            import torch

            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = self.clock()

    def mark(self, label: str) -> None:
        if label in self.events:
            return  # the first mark of a label counts (e.g. the first token's logits)
        if self.kind == "cuda":
            import torch

            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.events[label] = ev
        else:
            if self.kind == "mps":
                import torch

                torch.mps.synchronize()
            self.events[label] = self.clock() - self.t0

    def read(self) -> dict[str, float]:
        """Seconds from the start of the sample to each mark (after the sample's end was waited for)."""
        if self.kind == "cuda":
            return {k: self.start.elapsed_time(ev) / 1e3 for k, ev in self.events.items()}
        return dict(self.events)


_ACTIVE: list[_Marks] = []  # the sample being taken (a stack: at most one deep in practice)


def mark(label: str) -> None:
    """Inside a call timed by :func:`paired_rounds`: record the time from the start of this sample to now under
    ``label`` (e.g. a logits processor's first call: the prefill is done). Outside a timed call: nothing."""
    if _ACTIVE:
        _ACTIVE[-1].mark(label)


def _marked_sampler(
    fn: Callable[[], Any], device: Any, clock: Callable[[], float]
) -> tuple[Callable[[], tuple[float, dict[str, float]]], str]:
    """A function taking one timed sample of one call of ``fn``: (seconds, {mark label: seconds since the start})."""
    import torch

    kind = device_type_of(device)
    marks = _Marks(kind, clock)

    def sample() -> tuple[float, dict[str, float]]:
        if kind == "mps":
            torch.mps.synchronize()
        _ACTIVE.append(marks)
        try:
            marks.begin()
            fn()
            if kind == "cuda":
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                end.synchronize()
                total = marks.start.elapsed_time(end) / 1e3
            else:
                if kind == "mps":
                    torch.mps.synchronize()
                total = clock() - marks.t0
        finally:
            _ACTIVE.pop()
        return total, marks.read()

    method = {"cuda": "cuda_events", "mps": "mps_synchronize"}.get(kind, "perf_counter")
    return sample, method


def round_order(names: list[str], r: int, order: str) -> list[str]:
    """The variants of round ``r`` in the order they run (see :data:`ORDERS`)."""
    if order == "rotate":
        k = r % len(names)
        return names[k:] + names[:k]
    if order == "alternate":
        return list(names) if r % 2 == 0 else list(reversed(names))
    raise TimingError(f"order must be one of {ORDERS}, got {order!r}")


def _run_rounds(
    names: list[str],
    take: Callable[[str, int], None],
    rounds: int,
    order: str,
    state: Callable[[str], ContextManager],
    stop: Callable[[int], bool] | None = None,
) -> list[tuple[str, ...]]:
    """THE loop: ``rounds`` rounds, each entering every variant's state and taking its samples (``take(name,
    r)``) in the order of :func:`round_order`; ``stop(done)``, asked after each round, ends the loop early.
    Returns the order each round ran in."""
    orders: list[tuple[str, ...]] = []
    for r in range(rounds):
        seq = round_order(names, r, order)
        for name in seq:
            with state(name):
                take(name, r)
        orders.append(tuple(seq))
        if stop is not None and stop(r + 1):
            break
    return orders


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
        out = {
            "alternated_with": [v for v in self.timings if v != variant],
            "order": self.order,
            "busy_machine": self.busy,
            "worst_relative_spread": self.worst_spread,
        }
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
        raise TimingError(
            "contexts cannot be entered around a CUDA-graph replay; time such variants with cuda_graph=False"
        )
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
    _run_rounds(names, lambda name, r: samples[name].append(samplers[name]()), repeats, "rotate", state)
    timings = {n: _summarise(samples[n], calls=calls, warmup=warmup, method=methods[n]) for n in names}
    worst = max((t.max_s - t.min_s) / t.median_s for t in timings.values() if t.median_s > 0)
    del keep
    return Measurement(
        timings=timings,
        order="alternating rounds, start rotated each round",
        busy=worst > busy_spread,
        worst_spread=worst,
        busy_spread=busy_spread,
    )


# --------------------------------------------------------------------------------------------------
# paired rounds: the end-to-end form of the loop, with one ratio per round


@dataclass(frozen=True)
class RoundRatios:
    """Speed ratios of a variant to its baseline, one per round (baseline time / variant time of the same
    round: > 1 is faster), with their median, min..max and quartiles, and a :attr:`label`."""

    per_round: tuple[float, ...]
    median: float
    min: float
    max: float
    q1: float
    q3: float

    @property
    def n(self) -> int:
        return len(self.per_round)

    @property
    def iqr(self) -> float:
        return self.q3 - self.q1

    @property
    def straddles_one(self) -> bool:
        """Some round says faster and some says not (a round at exactly 1.0 is not faster)."""
        return self.min <= 1.0 <= self.max

    @property
    def label(self) -> str:
        """:data:`FASTER` when every round is above 1.0, :data:`SLOWER` when every round is below, else
        :data:`NOT_FASTER` (whatever the median says); :data:`ONE_ROUND` with a single round."""
        if self.n < 2:
            return ONE_ROUND
        if self.min > 1.0:
            return FASTER
        if self.max < 1.0:
            return SLOWER
        return NOT_FASTER

    def to_dict(self) -> dict:
        return {
            "per_round": list(self.per_round),
            "median": self.median,
            "min": self.min,
            "max": self.max,
            "q1": self.q1,
            "q3": self.q3,
            "iqr": self.iqr,
            "n": self.n,
            "label": self.label,
        }

    def __str__(self) -> str:
        return (
            f"{self.median:.2f}x median of {self.n} rounds ({self.min:.2f}x..{self.max:.2f}x, "
            f"IQR {self.q1:.2f}x..{self.q3:.2f}x; {self.label})"
        )


def round_ratios(baseline: Sequence[float], variant: Sequence[float]) -> RoundRatios:
    """The per-round ratios ``baseline[r] / variant[r]`` of two lists of times (seconds, or any time per
    item) taken in the same rounds, and their summary. Both lists must have one positive time per round."""
    b, v = list(baseline), list(variant)
    if not b or len(b) != len(v):
        raise TimingError(
            f"paired ratios need one time per round on both sides, got {len(b)} baseline and {len(v)} variant times"
        )
    if any(not (x > 0) for x in b + v):
        raise TimingError(f"paired ratios need positive times, got baseline {b} and variant {v}")
    per = tuple(x / y for x, y in zip(b, v))
    xs = sorted(per)
    return RoundRatios(
        per_round=per,
        median=statistics.median(xs),
        min=xs[0],
        max=xs[-1],
        q1=_quantile(xs, 0.25),
        q3=_quantile(xs, 0.75),
    )


@dataclass(frozen=True)
class Rounds:
    """What :func:`paired_rounds` took: ``samples[variant][phase]`` holds one time (seconds) per round, in
    round order, so that index ``r`` of two variants comes from the same round."""

    samples: dict  # variant -> phase (or "phase@mark") -> tuple of seconds per call, one per round
    orders: tuple  # the order each round ran its variants in
    order: str  # "alternate" or "rotate"
    methods: dict  # variant -> how a sample was timed ("cuda_events", "mps_synchronize", "perf_counter")
    baseline: str | None

    @property
    def rounds(self) -> int:
        return len(self.orders)

    def timing(self, variant: str, phase: str) -> Timing:
        return _summarise(list(self.samples[variant][phase]), calls=1, warmup=0, method=self.methods[variant])

    def ratios(self, variant: str, phase: str, baseline: str | None = None) -> RoundRatios:
        base = baseline or self.baseline
        if base is None:
            raise TimingError("no baseline: pass baseline= here or to paired_rounds")
        return round_ratios(self.samples[base][phase], self.samples[variant][phase])

    def describe_order(self) -> str:
        return {
            "alternate": "paired rounds, every variant once a round, the order reversed every other round",
            "rotate": "paired rounds, every variant once a round, the start rotated each round",
        }[self.order]


def paired_rounds(
    jobs: Mapping[str, Callable[[], Any] | Mapping[str, Callable[[], Any]]],
    *,
    device: Any,
    rounds: int = MIN_REPEATS,
    warmup: int = 1,
    baseline: str | None = "stock",
    contexts: Mapping[str, Callable[[], ContextManager]] | None = None,
    order: str = "alternate",
    stop: Callable[[int], bool] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> Rounds:
    """Time whole jobs of several variants in paired rounds, in one process.

    ``jobs``: variant -> a no-argument callable, or variant -> {phase: callable} (e.g. ``{"prefill": ...,
    "generate": ...}``): a round enters the variant's state once (``contexts[variant]()``, outside every
    timed region: patching is not timed) and samples each phase once, back to back, in the mapping's order.
    Every variant runs once a round; the order of the variants follows ``order`` (:data:`ORDERS`; default
    ``"alternate"``: stock, patched / patched, stock / ...). A timed call may call :func:`mark` (``label``): the
    time from the start of its sample to that point is kept as the phase ``"<phase>@<label>"`` (e.g. the first
    token of a ``generate()`` call: its prefill). ``warmup`` untimed calls of every phase first,
    in the variant's state. ``stop(rounds_done)``, asked after each round, ends the rounds early (a budget).
    Each sample is timed by the harness's sampler for ``device`` (CUDA events, ``mps.synchronize`` + ``clock``,
    ``clock`` on the CPU). Fewer than :data:`MIN_REPEATS` rounds are allowed (a smoke run) but are no figure to
    publish; the rounds' ratios come from :meth:`Rounds.ratios`.
    """
    if not jobs:
        raise TimingError("paired_rounds needs at least one variant")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise TimingError(f"rounds must be an integer >= 1, got {rounds!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise TimingError(f"warmup must be an integer >= 0, got {warmup!r}")
    if order not in ORDERS:
        raise TimingError(f"order must be one of {ORDERS}, got {order!r}")
    if baseline is not None and baseline not in jobs:
        raise TimingError(f"baseline {baseline!r} is not among the variants {sorted(jobs)}")
    phases: dict[str, dict[str, Callable[[], Any]]] = {
        name: (dict(job) if isinstance(job, Mapping) else {"call": job}) for name, job in jobs.items()
    }
    for name, ph in phases.items():
        if not ph or not all(callable(f) for f in ph.values()):
            raise TimingError(f"variant {name!r}: a callable, or a mapping of phase names to callables, is needed")
    contexts = dict(contexts or {})
    unknown = sorted(set(contexts) - set(jobs))
    if unknown:
        raise TimingError(f"contexts for variants that are not measured: {unknown}; variants: {sorted(jobs)}")
    names = list(phases)

    def state(name: str) -> ContextManager:
        return contexts[name]() if name in contexts else contextlib.nullcontext()

    samplers: dict[str, dict[str, Callable[[], float]]] = {}
    methods: dict[str, str] = {}
    for name in names:
        samplers[name] = {}
        if warmup:
            with state(name):
                for _ in range(warmup):
                    for fn in phases[name].values():
                        fn()
        for phase, fn in phases[name].items():
            samplers[name][phase], methods[name] = _marked_sampler(fn, device, clock)
    samples: dict[str, dict[str, list[float]]] = {n: {p: [] for p in phases[n]} for n in names}

    def take(name: str, r: int) -> None:
        for phase, sample in samplers[name].items():
            total, marks = sample()
            samples[name][phase].append(total)
            for label, s in marks.items():
                samples[name].setdefault(f"{phase}@{label}", []).append(s)

    orders = _run_rounds(names, take, rounds, order, state, stop)
    for name, ph in samples.items():
        uneven = {k: len(v) for k, v in ph.items() if len(v) != len(orders)}
        if uneven:
            raise TimingError(
                f"variant {name!r}: a mark was not reached in every round ({uneven} of {len(orders)} rounds)"
            )
    return Rounds(
        samples={n: {p: tuple(xs) for p, xs in ph.items()} for n, ph in samples.items()},
        orders=tuple(orders),
        order=order,
        methods=methods,
        baseline=baseline,
    )


# --------------------------------------------------------------------------------------------------
# one job of one variant


@dataclass(frozen=True)
class JobMeasurement:
    """What :func:`measure_job` took of one job: its output, the timing, operator timings, memory peaks."""

    output: Any  # the output of the output call (None when no output was asked for)
    timing: Timing  # the whole job, seconds per call
    op_timings: dict  # operator name -> Timing of one call of it alone
    memory: Any  # records.Memory of the memory pass, or None without one
    first_call_s: float | None  # wall seconds of the output call (compilation, lazy initialisation included)


_PASSES = ("first", "last", None)


def measure_job(
    job: Callable[[], Any],
    *,
    device: Any,
    repeats: int,
    warmup: int = 1,
    output: str | None = "first",
    memory: str | None = "last",
    watch: tuple[Callable[[], ContextManager], ...] = (),
    ops: Mapping[str, Callable[[], Any]] | Callable[[], Mapping[str, Callable[[], Any]]] | None = None,
    op_warmup: int = 1,
    op_repeats: int = 5,
    time_cap_s: float | None = None,
) -> JobMeasurement:
    """Measure ``job`` (no arguments: close over the inputs) on ``device``, every pass under ``torch.no_grad``.

    The passes, in order:

    1. the output call (``output="first"``), also the first warm-up: untimed, its output kept (and its wall
       time, compilation included); with ``memory="first"`` it runs under the memory sampler, and is the
       memory pass;
    2. ``warmup`` more untimed calls, then ``repeats`` timed samples (:func:`time_fn`). With ``time_cap_s`` the
       last warm-up call is timed and the repeats are cut so that they take about ``time_cap_s`` (a 40 s
       decode is timed once, not five times; at least one);
    3. each of ``ops`` (name -> no-argument callable, or a function returning that mapping, called after the
       output call: e.g. the operator's inputs captured during it) timed alone, ``op_warmup`` and
       ``op_repeats``;
    4. the memory pass (``memory="last"``), apart from the timing: the memory sampler must not slow the
       timed runs. With ``output="last"`` the output is this call's (no separate output call).

    ``watch`` (functions returning context managers, e.g. :func:`count_pad5d`) are entered around the call
    that gives the output.
    """
    import torch

    from .memory import measure_memory

    if output not in _PASSES or memory not in _PASSES:
        raise TimingError(
            f"output and memory must each be 'first', 'last' or None; got output={output!r}, memory={memory!r}"
        )
    if memory == "first" and output == "last":
        raise TimingError("memory='first' measures the output call; pass output='first' (or None) with it")
    if output == "last" and memory != "last":
        raise TimingError("output='last' takes the output from the memory pass; pass memory='last' with it")
    out = first_s = peaks = None
    with torch.no_grad():
        if output == "first" or memory == "first":
            with contextlib.ExitStack() as stack:
                for w in watch:
                    stack.enter_context(w())
                probe = stack.enter_context(measure_memory(device)) if memory == "first" else None
                t0 = time.perf_counter()
                out = job()
                synchronize(device)
                first_s = time.perf_counter() - t0
            if probe is not None:
                peaks = probe.peaks()
            if output is None:
                out = None
        if time_cap_s is not None:
            last = first_s
            for _ in range(warmup):
                synchronize(device)
                t0 = time.perf_counter()
                job()
                synchronize(device)
                last = time.perf_counter() - t0
            n = repeats if last is None else max(1, min(repeats, int(time_cap_s / max(last, 1e-9))))
            timing = time_fn(job, device=device, warmup=0, repeats=n)
        else:
            timing = time_fn(job, device=device, warmup=warmup, repeats=repeats)
        op_fns = ops() if callable(ops) else (ops or {})
        op_timings = {
            name: time_fn(fn, device=device, warmup=op_warmup, repeats=op_repeats) for name, fn in op_fns.items()
        }
        if memory == "last":
            with contextlib.ExitStack() as stack:
                if output == "last":
                    for w in watch:
                        stack.enter_context(w())
                probe = stack.enter_context(measure_memory(device))
                last_out = job()
            peaks = probe.peaks()
            if output == "last":
                out = last_out
            del last_out
    return JobMeasurement(output=out, timing=timing, op_timings=op_timings, memory=peaks, first_call_s=first_s)


# --------------------------------------------------------------------------------------------------
# the busy-machine check and the ratio lines


def relative_spread(lo: float | None, hi: float | None, median: float | None) -> float | None:
    """``(hi - lo) / median``, or None when a figure is missing."""
    if lo is None or hi is None or not median:
        return None
    return (hi - lo) / median


def machine_load() -> tuple[float, int] | None:
    """(1-minute load average, cores) of this machine now; None where there is no load average (Windows)."""
    import os

    try:
        return os.getloadavg()[0], os.cpu_count() or 1
    except (AttributeError, OSError):
        return None


def ratio_lines(records, *, load_before: tuple[float, int] | None = None) -> list[str]:
    """Each speed ratio to stock with its range over the repeats, and a warning when the machine was too busy.

    The range of a ratio of medians is taken from the extremes of the repeats: stock's fastest over
    the variant's slowest, to stock's slowest over the variant's fastest. A ratio is called meaningless
    when either side's repeats spread more than :data:`BUSY_SPREAD` of its median, or when the load
    average exceeded the number of cores while it ran (``load_before``, taken when the run started, and now).
    """
    groups: dict[str, dict[str, Any]] = {}
    for r in records:
        groups.setdefault(r.workload.name, {})[r.variant] = r
    lines: list[str] = []
    noisy: list[str] = []
    single = False
    for name, variants in groups.items():
        base = variants.get("stock")
        if base is None:
            continue
        for variant, rec in variants.items():
            if rec is base:
                continue
            parts = []
            pairs = []
            bt, vt = base.throughput, rec.throughput
            if bt is not None and vt is not None and bt.seconds_per_call and vt.seconds_per_call:
                pairs.append(
                    (
                        "throughput",
                        bt.seconds_per_call,
                        vt.seconds_per_call,
                        (bt.spread or {}).get("min_s"),
                        (bt.spread or {}).get("max_s"),
                        (vt.spread or {}).get("min_s"),
                        (vt.spread or {}).get("max_s"),
                        bt.repeats,
                        vt.repeats,
                    )
                )
            for op, vo in (rec.op_time or {}).items():
                bo = (base.op_time or {}).get(op)
                if bo is not None:
                    pairs.append(
                        (
                            f"op {op}",
                            bo.median_us,
                            vo.median_us,
                            bo.min_us,
                            bo.max_us,
                            vo.min_us,
                            vo.max_us,
                            bo.repeats,
                            vo.repeats,
                        )
                    )
            for label, b_med, v_med, b_lo, b_hi, v_lo, v_hi, b_n, v_n in pairs:
                text = f"{label} {b_med / v_med:.2f}x"
                if None in (b_lo, b_hi, v_lo, v_hi) or min(b_n or 1, v_n or 1) < 2:
                    text += " (one repeat: no spread)"
                    single = True
                else:
                    text += f" ({b_lo / v_hi:.2f}x-{b_hi / v_lo:.2f}x over the repeats)"
                    worst = max(relative_spread(b_lo, b_hi, b_med) or 0.0, relative_spread(v_lo, v_hi, v_med) or 0.0)
                    if worst > BUSY_SPREAD:
                        noisy.append(f"{name} {label} (repeats spread {100 * worst:.0f}%)")
                parts.append(text)
            if parts:
                lines.append(f"  {name}: {variant} vs stock: " + ", ".join(parts))
    loads = [x for x in (load_before, machine_load()) if x is not None]
    busy_load = [f"load average {load:.1f} on {n} cores" for load, n in loads if load > n]
    if noisy or busy_load:
        why = "; ".join(noisy[:4] + (["..."] if len(noisy) > 4 else []) + busy_load[:1])
        lines.append(
            f"  WARNING: this machine was too busy for these ratios to mean anything ({why}; "
            f"over {100 * BUSY_SPREAD:.0f}% spread, or more load than cores). Rerun on a quiet machine, "
            "with more --repeats."
        )
    elif single:
        lines.append("  (with one repeat there is no spread to judge the ratios by: use --repeats 3 or more)")
    return lines
