"""PNG charts of records: per workload, speedup vs stock, memory peaks and correctness.

Built on the grouping of :mod:`.table`: every bar is a ratio of two records of one workload, and
records whose environments differ are refused there.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Iterable

from .errors import BenchError, RecordError
from .records import OpTime, Record, Throughput
from .table import BASELINE, Group, group_records, speed_ratio

__all__ = ["plot", "ratio_range", "MAX_DETAILED_GROUPS"]

#: Above this many workloads the chart switches to one row of three panels, workloads on the x axis.
MAX_DETAILED_GROUPS = 8


def plot(records: Iterable[Record], path: str | os.PathLike, *, title: str | None = None) -> Path:
    """Save a PNG chart of ``records``: per workload, speedup vs stock, memory peaks and correctness.

    Needs matplotlib (``pip install -e ".[bench]"`` in the checkout). Returns the path written.
    """
    groups = group_records(records)
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise BenchError(
            "plot() needs matplotlib: pip install -e '.[bench]' in the mpsboost checkout (or pip install matplotlib)"
        ) from exc
    if not groups:
        raise RecordError("plot() got no records")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if len(groups) > MAX_DETAILED_GROUPS:
        return _plot_compact(groups, path, plt, title)
    n = len(groups)
    fig, axes = plt.subplots(n, 3, figsize=(15, 3.6 * n), squeeze=False)
    for row, g in enumerate(groups):
        names = list(g.variants)
        recs = [g.variants[v] for v in names]
        base = g.baseline
        colors = [plt.cm.tab10(i % 10) for i in range(len(names))]

        # 1: speed ratios vs stock (throughput and each op), one bar per variant per metric
        ax = axes[row][0]
        metrics = []
        if any(r.throughput for r in recs):
            metrics.append(("throughput", lambda r: r.throughput, lambda r: base.throughput if base else None))
        ops = []
        for r in recs:
            for k in r.op_time or {}:
                if k not in ops:
                    ops.append(k)
        for op in ops:
            metrics.append(
                (
                    f"op {op}",
                    (lambda o: lambda r: (r.op_time or {}).get(o))(op),
                    (lambda o: lambda r: (base.op_time or {}).get(o) if base else None)(op),
                )
            )
        width = 0.8 / max(len(names), 1)
        any_bar = False
        for j, (name, rec) in enumerate(zip(names, recs)):
            xs, ys, lows, highs = [], [], [], []
            for i, (_, get, get_base) in enumerate(metrics):
                ratio = speed_ratio(get_base(rec), get(rec))
                if ratio is not None:
                    xs.append(i + j * width)
                    ys.append(ratio)
                    lo, hi = ratio_range(get_base(rec), get(rec)) or (ratio, ratio)
                    lows.append(max(ratio - lo, 0.0))
                    highs.append(max(hi - ratio, 0.0))
            if xs:
                any_bar = True
                # Error bars: the ratio's range over the two spreads (stock's min..max against the
                # variant's); a bar whose range crosses 1 is no measured difference.
                bars = ax.bar(
                    xs, ys, width, label=name, color=colors[j], yerr=[lows, highs], capsize=2, error_kw={"lw": 0.8}
                )
                ax.bar_label(bars, fmt="%.2fx", fontsize=7)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(metrics))])
        ax.set_xticklabels([m[0] for m in metrics], fontsize=8, rotation=15)
        ax.set_ylabel("speedup vs stock (>1 faster)")
        ax.set_title(
            f"{g.workload.describe()}\nspeed" if any_bar else f"{g.workload.describe()}\nspeed: no stock baseline",
            fontsize=9,
        )
        if any_bar:
            ax.legend(fontsize=7)

        # 2: memory peaks in GiB, absolute (ratios of memory across counters would mislead)
        ax = axes[row][1]
        counters = [
            ("tensor_allocated", "tensor-allocated"),
            ("allocator_reserved", "allocator-reserved"),
            ("driver_level", "driver-level"),
        ]
        for j, (name, rec) in enumerate(zip(names, recs)):
            m = rec.memory
            xs, ys = [], []
            for i, (attr, _) in enumerate(counters):
                v = None if m is None else getattr(m, attr)
                if v is not None:
                    xs.append(i + j * width)
                    ys.append(v / (1 << 30))
            if xs:
                bars = ax.bar(xs, ys, width, label=name, color=colors[j])
                ax.bar_label(bars, fmt="%.2f", fontsize=7)
        ax.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(counters))])
        ax.set_xticklabels([c[1] for c in counters], fontsize=8)
        ax.set_ylabel("peak GiB (missing bar: no such counter)")
        ax.set_title("memory peaks", fontsize=9)

        # 3: correctness in dB (PSNR where present, else SQNR); identical outputs drawn at a cap
        ax = axes[row][2]
        labels, values, texts = [], [], []
        for name, rec in zip(names, recs):
            c = rec.correctness
            if c is None:
                continue
            metric, v = ("PSNR", c.psnr_db) if c.psnr_db is not None else ("SQNR", c.sqnr_db)
            if v is None:
                continue
            labels.append(f"{name}\nvs {c.reference}\n{metric}")
            values.append(v)
            texts.append("identical (inf)" if math.isinf(v) and v > 0 else f"{v:.1f} dB")
        if values:
            # Identical outputs have an infinite PSNR: draw them hatched just above the highest
            # finite bar, labelled, rather than at an invented number of dB.
            finite = [v for v in values if math.isfinite(v)]
            cap = max(finite + [40.0]) * 1.15
            heights = [cap if (math.isinf(v) and v > 0) else (v if math.isfinite(v) else 0.0) for v in values]
            bars = ax.bar(
                range(len(values)),
                heights,
                color=[colors[names.index(lbl.split(chr(10))[0])] for lbl in labels],
                hatch=None,
            )
            for b, v in zip(bars, values):
                if math.isinf(v) and v > 0:
                    b.set_hatch("//")
            ax.bar_label(bars, labels=texts, fontsize=7)
            ax.set_xticks(range(len(values)))
            ax.set_xticklabels(labels, fontsize=7)
        else:
            ax.text(0.5, 0.5, "no correctness record", ha="center", va="center", transform=ax.transAxes)
        ax.set_ylabel("dB (higher: closer to reference)")
        ax.set_title("correctness", fontsize=9)
    env = groups[0].env
    fig.suptitle(
        title or f"{env.device_type} ({env.device_name}), torch {env.torch_version}, {env.dtype}, {env.compile}",
        fontsize=10,
    )
    fig.tight_layout()
    _unclutter(fig)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def ratio_range(stock: Throughput | OpTime | None, variant: Throughput | OpTime | None) -> tuple[float, float] | None:
    """(lowest, highest) speedup that the two spreads allow: stock's fastest over the variant's slowest,
    and stock's slowest over the variant's fastest. None where a spread is missing."""
    if isinstance(stock, OpTime) and isinstance(variant, OpTime):
        vals = (stock.min_us, stock.max_us, variant.min_us, variant.max_us)
    elif isinstance(stock, Throughput) and isinstance(variant, Throughput) and stock.unit == variant.unit:
        vals = (
            stock.spread.get("min_s"),
            stock.spread.get("max_s"),
            variant.spread.get("min_s"),
            variant.spread.get("max_s"),
        )
    else:
        return None
    if any(v is None or v <= 0 for v in vals):
        return None
    s_min, s_max, v_min, v_max = vals
    return s_min / v_max, s_max / v_min


def _primary_speed(rec: Record | None, base: Record | None) -> float | None:
    """Speedup vs stock of a record's main speed figure: throughput, else its first operator."""
    if rec is None or base is None:
        return None
    if rec.throughput is not None and base.throughput is not None:
        return speed_ratio(base.throughput, rec.throughput)
    for op, t in (rec.op_time or {}).items():
        return speed_ratio((base.op_time or {}).get(op), t)
    return None


def _bars(ax, xs, ys, width, label, color) -> None:
    pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
    if pts:  # an empty bar call would still add a legend entry
        ax.bar([p[0] for p in pts], [p[1] for p in pts], width, label=label, color=color)


def _plot_compact(groups: list[Group], path: Path, plt, title: str | None) -> Path:
    """Many workloads (a sweep of layer shapes): per workload, one bar per non-stock variant.

    Each bar is a ratio within its own workload; nothing is averaged across workloads.
    """
    variants: list[str] = []
    for g in groups:
        for v in g.variants:
            if v != BASELINE and v not in variants:
                variants.append(v)
    n = len(groups)
    width_in = min(max(12.0, 0.35 * n * max(len(variants), 1)), 120.0)
    fig, axes = plt.subplots(3, 1, figsize=(width_in, 12), squeeze=False)
    labels = [g.workload.describe() for g in groups]
    w = 0.8 / max(len(variants), 1)
    for j, v in enumerate(variants):
        color = plt.cm.tab10(j % 10)
        xs = [i + j * w for i in range(n)]
        speed = [_primary_speed(g.variants.get(v), g.baseline) for g in groups]
        _bars(axes[0][0], xs, speed, w, v, color)
        mem = []
        for g in groups:
            r, b = g.variants.get(v), g.baseline
            m = None
            if r is not None and b is not None and r.memory is not None and b.memory is not None:
                for attr in ("driver_level", "allocator_reserved", "tensor_allocated"):
                    mv, bv = getattr(r.memory, attr), getattr(b.memory, attr)
                    if mv is not None and bv:
                        m = mv / bv
                        break
            mem.append(m)
        _bars(axes[1][0], xs, mem, w, v, color)
        db = []
        for g in groups:
            c = g.variants[v].correctness if v in g.variants else None
            val = None if c is None else (c.psnr_db if c.psnr_db is not None else c.sqnr_db)
            db.append(None if val is None or not math.isfinite(val) else val)
        _bars(axes[2][0], xs, db, w, v, color)
    for ax, ylabel in zip(
        (axes[0][0], axes[1][0], axes[2][0]),
        (
            "speedup vs stock (>1 faster)",
            "peak memory / stock's (driver-level first)",
            "correctness dB (PSNR, else SQNR; identical not drawn)",
        ),
    ):
        ax.set_ylabel(ylabel, fontsize=8)
        ax.set_xticks([i + w * (len(variants) - 1) / 2 for i in range(n)])
        ax.set_xticklabels(labels, fontsize=6, rotation=75, ha="right")
        if ax.containers:
            ax.legend(fontsize=7)
    axes[0][0].axhline(1.0, color="grey", lw=0.8, ls="--")
    axes[1][0].axhline(1.0, color="grey", lw=0.8, ls="--")
    env = groups[0].env
    fig.suptitle(
        title
        or (
            f"{env.device_type} ({env.device_name}), torch {env.torch_version}, "
            f"{env.dtype}, {env.compile}: {n} workloads"
        ),
        fontsize=10,
    )
    fig.tight_layout()
    _unclutter(fig)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def label_overlaps(fig) -> list[str]:
    """The x tick labels of ``fig`` whose boxes (as drawn) overlap a neighbour's: "axes title: a / b" each."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    out = []
    for ax in fig.axes:
        labels = [t for t in ax.get_xticklabels() if t.get_visible() and t.get_text()]
        boxes = [t.get_window_extent(renderer) for t in labels]
        for (a, ba), (b, bb) in zip(zip(labels, boxes), list(zip(labels, boxes))[1:]):
            if ba.overlaps(bb):
                out.append(f"{ax.get_title() or '-'}: {a.get_text()!r} / {b.get_text()!r}")
    return out


def _unclutter(fig) -> None:
    """Turn the x tick labels of every axes whose labels overlap upright (one line of text wide each), then lay
    the figure out again for the taller labels."""
    crowded = {line.split(": ", 1)[0] for line in label_overlaps(fig)}
    if not crowded:
        return
    for ax in fig.axes:
        if (ax.get_title() or "-") in crowded:
            for t in ax.get_xticklabels():
                t.set_rotation(90)
                t.set_horizontalalignment("center")
    fig.tight_layout()
