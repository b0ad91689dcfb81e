"""Side-by-side comparison of records as a text table (the chart is :mod:`.plot`).

Records are grouped by workload (name and shape). Within a group the variants (``stock``,
``mpsboost``, peers) stand side by side, each metric with its ratio to the ``stock`` variant of the
*same* workload:

* speed (throughput and operator time): speedup vs stock, > 1 means faster (a time per call is
  inverted so that every speed ratio reads the same way);
* memory: the variant's peak divided by stock's, < 1 means less memory;
* correctness: no ratio; each variant against its named reference.

Ratios are never multiplied or averaged across workloads or baselines: each one is a ratio of two
records of one group. Records whose environments differ in anything but the variant are refused
with an :class:`~mpsboost.bench.errors.EnvMismatchError` naming the field.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from .errors import EnvMismatchError, RecordError
from .records import OpTime, Record, RecordEnv, Throughput, Workload

__all__ = [
    "Group",
    "group_records",
    "check_comparable",
    "compare_table",
    "speed_ratio",
    "BASELINE",
    "fmt_number",
    "fmt_bytes",
    "fmt_us",
]

BASELINE = "stock"
NA = "n/a"


@dataclass
class Group:
    """The records of one workload, merged per variant (sections of several records of the same
    variant, e.g. a timing pass and a memory pass, are combined)."""

    workload: Workload
    env: RecordEnv
    variants: dict = field(default_factory=dict)  # variant -> Record (merged), in first-seen order
    notes: list = field(default_factory=list)

    @property
    def baseline(self) -> Record | None:
        return self.variants.get(BASELINE)


def _merge(a: Record, b: Record, notes: list) -> Record:
    """Combine the sections of two records of the same workload and variant."""
    changes = {}
    for name in ("throughput", "correctness", "memory"):
        mine, theirs = getattr(a, name), getattr(b, name)
        if theirs is not None:
            if mine is not None and mine != theirs:
                notes.append(f"{a.variant}: two different {name} sections; the later record's is shown")
            changes[name] = theirs
    if b.op_time:
        ops = dict(a.op_time or {})
        for k, v in b.op_time.items():
            if k in ops and ops[k] != v:
                notes.append(f"{a.variant}: two timings of op {k!r}; the later record's is shown")
            ops[k] = v
        changes["op_time"] = ops
    if b.extra:
        changes["extra"] = {**a.extra, **b.extra}
    return dataclasses.replace(a, **changes) if changes else a


def _mismatch(first: Record, other: Record) -> EnvMismatchError:
    diffs = first.env.differences(other.env)
    name, va, vb = diffs[0]
    more = f" (and {len(diffs) - 1} more: {', '.join(d[0] for d in diffs[1:])})" if len(diffs) > 1 else ""
    return EnvMismatchError(
        f"cannot compare {first.workload.describe()}: environments differ in {name!r}{more}: "
        f"{first.variant!r} ran with {name}={va!r}, {other.variant!r} with {name}={vb!r}. "
        "Only the variant may differ between records put side by side; rerun both in one environment.",
        field=name,
        values=(va, vb),
    )


def group_records(records: Iterable[Record]) -> list[Group]:
    """Group records by workload, in first-seen order, checking that each group shares one env."""
    groups: dict[str, Group] = {}
    firsts: dict[str, Record] = {}
    for i, rec in enumerate(records):
        if not isinstance(rec, Record):
            raise RecordError(f"item {i} is a {type(rec).__name__}, not a Record")
        key = rec.workload.key
        g = groups.get(key)
        if g is None:
            groups[key] = Group(workload=rec.workload, env=rec.env, variants={rec.variant: rec})
            firsts[key] = rec
            continue
        if rec.env != g.env:
            raise _mismatch(firsts[key], rec)
        if rec.variant in g.variants:
            g.variants[rec.variant] = _merge(g.variants[rec.variant], rec, g.notes)
        else:
            g.variants[rec.variant] = rec
    return list(groups.values())


def check_comparable(records: Sequence[Record]) -> None:
    """Raise :class:`EnvMismatchError` if records of one workload differ in environment."""
    group_records(records)


# --------------------------------------------------------------------------------------------------
# ratios and formatting


def speed_ratio(stock: Throughput | OpTime | None, variant: Throughput | OpTime | None) -> float | None:
    """Speedup of ``variant`` over ``stock`` (> 1: faster), or None when it cannot be stated."""
    if stock is None or variant is None:
        return None
    if isinstance(stock, OpTime) and isinstance(variant, OpTime):
        if variant.median_us > 0 and stock.median_us > 0:
            return stock.median_us / variant.median_us
        return None
    if isinstance(stock, Throughput) and isinstance(variant, Throughput):
        if stock.unit != variant.unit or stock.value <= 0 or variant.value <= 0:
            return None
        hib = stock.higher_is_better
        if hib is True:
            return variant.value / stock.value
        if hib is False:
            return stock.value / variant.value
    return None


def fmt_number(x: float | None, digits: int = 4) -> str:
    if x is None:
        return NA
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if x == 0:
        return "0"
    if abs(x) >= 1e5 or abs(x) < 1e-3:
        return f"{x:.{digits - 1}e}"
    return f"{x:.{digits}g}"


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return NA
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.3f} {unit}"
    return f"{n} B"


def fmt_us(us: float | None) -> str:
    if us is None:
        return NA
    if us >= 1e6:
        return f"{us / 1e6:.4g} s"
    if us >= 1e3:
        return f"{us / 1e3:.4g} ms"
    return f"{us:.4g} us"


def _ratio_text(r: float | None, kind: str) -> str:
    if r is None:
        return ""
    return f" [{r:.2f}x]" if kind == "speed" else f" [{r:.2f}x of stock]"


def _rows(group: Group) -> list[tuple[str, list[str]]]:
    """(label, cell per variant) for every metric any variant of the group has: throughput, operator times,
    correctness per reference, memory per counter (the four sections, never folded into one)."""
    variants = list(group.variants.values())
    base = group.baseline
    return (
        _throughput_rows(variants, base)
        + _op_rows(variants, base)
        + _correctness_rows(variants)
        + _memory_rows(variants, base)
    )


def _throughput_rows(variants: list, base: Any) -> list[tuple[str, list[str]]]:
    if not any(r.throughput is not None for r in variants):
        return []
    cells = []
    for r in variants:
        t = r.throughput
        if t is None:
            cells.append(NA)
            continue
        text = f"{fmt_number(t.value)} {t.unit}"
        iqr = t.spread.get("iqr_s") if t.spread else None
        if iqr is not None and t.seconds_per_call:
            # The spread of the per-call time, relative: noise on a shared machine shows here.
            text += f" ±{100 * iqr / 2 / t.seconds_per_call:.0f}%"
        if r is not base and base is not None and base.throughput is not None:
            ratio = speed_ratio(base.throughput, t)
            if ratio is None and base.throughput.unit != t.unit:
                text += f" [unit differs from stock's {base.throughput.unit}: no ratio]"
            else:
                text += _ratio_text(ratio, "speed")
        cells.append(text)
    return [("throughput (median, ±IQR/2)", cells)]


def _op_rows(variants: list, base: Any) -> list[tuple[str, list[str]]]:
    op_names: list[str] = []
    for r in variants:
        for k in r.op_time or {}:
            if k not in op_names:
                op_names.append(k)
    rows = []
    for op in op_names:
        cells = []
        for r in variants:
            o = (r.op_time or {}).get(op)
            if o is None:
                cells.append(NA)
                continue
            text = fmt_us(o.median_us)
            if o.iqr_us is not None:
                text += f" ±{fmt_us(o.iqr_us / 2)}"
            if r is not base and base is not None:
                text += _ratio_text(speed_ratio((base.op_time or {}).get(op), o), "speed")
            cells.append(text)
        rows.append((f"op {op} (median, ±IQR/2)", cells))
    return rows


_CORRECTNESS = (
    ("psnr_db", "PSNR dB", lambda v: fmt_number(v)),
    ("sqnr_db", "SQNR dB", lambda v: fmt_number(v)),
    ("rel_error", "rel error", lambda v: fmt_number(v, 3)),
    ("max_abs", "max abs", lambda v: fmt_number(v, 3)),
)


def _correctness_rows(variants: list) -> list[tuple[str, list[str]]]:
    refs: list[str] = []
    for r in variants:
        if r.correctness is not None and r.correctness.reference not in refs:
            refs.append(r.correctness.reference)
    rows = []
    for ref in refs:
        for metric, label, fmt in _CORRECTNESS:
            values = [
                getattr(r.correctness, metric) if r.correctness is not None and r.correctness.reference == ref else None
                for r in variants
            ]
            if all(v is None for v in values):
                continue
            rows.append((f"vs {ref}: {label}", [NA if v is None else fmt(v) for v in values]))
    return rows


_MEMORY = (
    ("tensor_allocated", "mem tensor-allocated peak"),
    ("allocator_reserved", "mem allocator-reserved peak"),
    ("driver_level", "mem driver-level peak"),
)


def _memory_rows(variants: list, base: Any) -> list[tuple[str, list[str]]]:
    if not any(r.memory is not None for r in variants):
        return []
    rows = []
    for metric, label in _MEMORY:
        cells = []
        for r in variants:
            m = r.memory
            v = None if m is None else getattr(m, metric)
            text = fmt_bytes(v)
            if v is not None and r is not base and base is not None and base.memory is not None:
                b = getattr(base.memory, metric)
                if b:
                    text += _ratio_text(v / b, "memory")
            cells.append(text)
        sources = {
            r.memory.driver_level_source for r in variants if r.memory is not None and r.memory.driver_level_source
        }
        if metric == "driver_level" and sources:
            label += f" ({', '.join(sorted(sources))})"
        rows.append((label, cells))
    return rows


def _render(header: list[str], rows: list[tuple[str, list[str]]]) -> str:
    table = [header] + [[label] + cells for label, cells in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = []
    for n, row in enumerate(table):
        lines.append("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def compare_table(records: Iterable[Record]) -> str:
    """The side-by-side text table of ``records``: one block per workload, variants as columns.

    Raises :class:`EnvMismatchError` when records of one workload come from different environments.
    """
    groups = group_records(records)
    if not groups:
        return "(no records)"
    one_env = _single_env(groups)
    out = []
    if one_env:
        out.append(f"environment: {groups[0].env.describe()}")
    out.append(
        "ratios in [..]: speed = speedup vs stock of the same workload (>1 faster); memory = fraction of stock's peak. "
        "n/a = not measured or no such counter on this device."
    )
    for g in groups:
        out.append("")
        out.append(f"== {g.workload.describe()}")
        if not one_env:
            out.append(f"   environment: {g.env.describe()}")
        if g.baseline is None:
            out.append(f"   (no '{BASELINE}' record for this workload: no ratios)")
        header = ["metric"] + list(g.variants)
        out.append(_render(header, _rows(g)))
        for note in g.notes:
            out.append(f"   note: {note}")
    return "\n".join(out) + "\n"


# RecordEnv holds a dict (libraries) and so is unhashable; compare by a frozen key instead.
def _env_key(env: RecordEnv) -> tuple:
    return tuple((k, tuple(sorted(v.items())) if isinstance(v, dict) else v) for k, v in env.to_dict().items())


def _single_env(groups: list[Group]) -> bool:
    return len({_env_key(g.env) for g in groups}) == 1
