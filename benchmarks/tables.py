"""Every generated table of the documentation: the benchmark figures, computed from the committed
records in ``benchmarks/results/``, and the tables that describe the tool (which recipe applies on
which Mac and torch build, the recipe list), computed from the registry and the gate by
:mod:`mpsboost.docs`.

    python benchmarks/tables.py            # rewrite the generated blocks of every document in DOCS
    python benchmarks/tables.py --check    # exit 1 and print a diff where a document differs

A generated block sits between ``<!-- tables:NAME:begin -->`` and ``<!-- tables:NAME:end -->``; the
text outside the markers is written by hand and carries no figures. Each block is one function of
:data:`BLOCKS` returning markdown; adding a table is adding such a function.

Rules every figure here follows:

* a ratio is of two records of one workload in one file (one run), put side by side by
  :func:`mpsboost.bench.group_records`, which refuses records whose environments differ;
* every timing is shown with its spread (min..max of the repeats) and the number of repeats, and
  when the two spreads overlap the row says "no difference", whatever the ratio of the medians;
* a record that does not measure what its variant claims (a ``mpsboost`` variant not timed through
  ``mpsboost.patch()``, or one where ``patch()`` changed no layer) is shown as not measured.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import re
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
#: The documents with generated blocks. The figures live in docs/ and benchmarks/README.md; the README
#: holds only the tables that describe the tool.
DOCS = (
    "README.md",
    "benchmarks/README.md",
    "docs/figures.md",
    "docs/known-gaps.md",
    "docs/fp8-checkpoints.md",
    "docs/support.md",
)

if str(ROOT / "src") not in sys.path:  # run from a checkout without an install
    sys.path.insert(0, str(ROOT / "src"))

from mpsboost.bench import Record, read_jsonl  # noqa: E402
from mpsboost.bench.table import Group, group_records  # noqa: E402

NOT_THROUGH_PATCH = "not measured through patch(); re-run pending"
#: Above this many workloads of one name in a file, the file's table summarises them per variant.
SWEEP = 4


# --------------------------------------------------------------------------------------------------
# reading


@lru_cache(maxsize=None)
def _records(path: str) -> tuple[Record, ...]:
    return tuple(read_jsonl(path))


def records(name: str, results: Path | None = None) -> list[Record]:
    return list(_records(str((results or RESULTS) / name)))


def groups(name: str, results: Path | None = None) -> list[Group]:
    """The workloads of one record file, each with its variants; refuses mixed environments."""
    return group_records(records(name, results))


def find(gs: Sequence[Group], workload: str, **shape) -> Group:
    """The one group of ``workload`` whose shape has every given key and value."""
    hits = [
        g for g in gs if g.workload.name == workload and all(g.workload.shape.get(k) == v for k, v in shape.items())
    ]
    if len(hits) != 1:
        raise LookupError(f"{len(hits)} workloads {workload!r} match {shape}; expected exactly one")
    return hits[0]


# --------------------------------------------------------------------------------------------------
# one timing with its spread


@dataclass(frozen=True)
class Stat:
    """Seconds per call (or per token): median, min, max over ``n`` samples; ``how`` names them."""

    median: float
    lo: float | None
    hi: float | None
    n: int | None
    how: str = "repeats"

    @property
    def has_spread(self) -> bool:
        return self.lo is not None and self.hi is not None and (self.n or 0) >= 2

    def cell(self) -> str:
        text = fmt_s(self.median)
        if self.has_spread:
            return f"{text} ({fmt_s(self.lo)} .. {fmt_s(self.hi)}, {self.n} {self.how})"
        return f"{text} (one figure; spread not recorded)"


def fmt_s(s: float) -> str:
    """Four significant figures: enough to tell the two ends of a tight spread apart."""
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us")):
        if s >= scale or unit == "us":
            v = s / scale
            return f"{v:.4g} {unit}" if v < 1000 else f"{v:.0f} {unit}"
    raise AssertionError("unreachable")


def stat(rec: Record, op: str | None = None) -> Stat | None:
    """The time per call of ``rec``: operator ``op``, else its throughput (as time per call)."""
    if op is not None:
        o = (rec.op_time or {}).get(op)
        if o is None:
            return None
        lo = None if o.min_us is None else o.min_us / 1e6
        hi = None if o.max_us is None else o.max_us / 1e6
        return Stat(o.median_us / 1e6, lo, hi, o.repeats)
    t = rec.throughput
    if t is None:
        return None
    steps = rec.extra.get("ms_per_step")
    if isinstance(steps, list) and len(steps) > 2 and t.unit == "ms/token":
        # One generate call's per-step times; step 1 holds the first call's warm-up.
        xs = sorted(float(x) / 1e3 for x in steps[1:])
        mid = len(xs) // 2
        med = xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2
        return Stat(med, xs[0], xs[-1], len(xs), f"decode steps 2-{len(steps)} of one run")
    rounds = rec.extra.get("rounds")
    if isinstance(rounds, list) and len(rounds) >= 2 and all(isinstance(x, (int, float)) for x in rounds):
        # Seconds per call of each round, as the end-to-end runs keep them.
        xs = sorted(float(x) for x in rounds)
        mid = len(xs) // 2
        med = xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2
        return Stat(med, xs[0], xs[-1], len(xs), "rounds")
    sp = t.spread or {}
    if t.seconds_per_call is not None:
        return Stat(t.seconds_per_call, sp.get("min_s"), sp.get("max_s"), t.repeats)
    # No time per call: the spread (seconds per call) cannot be set beside the value; show the value alone.
    if t.higher_is_better is True:
        sec = 1.0 / t.value
    else:
        sec = t.value * {
            "s/call": 1.0,
            "s": 1.0,
            "ms/token": 1e-3,
            "ms/call": 1e-3,
            "ms": 1e-3,
            "us/call": 1e-6,
            "us": 1e-6,
        }.get(t.unit, math.nan)
    return Stat(sec, None, None, t.repeats)


def verdict(base: Stat, var: Stat) -> str:
    if not (base.has_spread and var.has_spread):
        return "spread not recorded: no decision"
    if var.hi < base.lo:
        return "faster"
    if var.lo > base.hi:
        return "slower"
    return "no difference (spreads overlap)"


# --------------------------------------------------------------------------------------------------
# which records can carry a figure


def not_measured(rec: Record, benchmark: str) -> str | None:
    """Why ``rec`` cannot stand for its variant, or None when it can."""
    if rec.variant == "stock" or rec.extra.get("measured_through") == "patch()":
        # Timed through patch(): a layer that patch() left alone is a true "mpsboost" figure too.
        return None
    if rec.extra.get("layers_patched") == 0:
        return f"patch() changed no layer in this record; {NOT_THROUGH_PATCH}"
    if benchmark == "decode_linear" and rec.variant.startswith("mpsboost"):
        return NOT_THROUGH_PATCH
    return None


def benchmark_of(file: str) -> str:
    return file.split("-", 1)[0]


# --------------------------------------------------------------------------------------------------
# a comparison row


@dataclass(frozen=True)
class Cmp:
    file: str
    group: Group
    variant: str
    baseline: str
    base: Stat | None
    var: Stat | None
    reason: str | None  # set when the variant cannot be shown as a number

    @property
    def ratio(self) -> float | None:
        if self.reason or self.base is None or self.var is None or self.var.median <= 0:
            return None
        return self.base.median / self.var.median

    def cells(self) -> list[str]:
        if self.reason:
            return [self.base.cell() if self.base else "n/a", self.reason, "-", "-"]
        r = self.ratio
        return [self.base.cell(), self.var.cell(), "n/a" if r is None else f"{r:.2f}x", verdict(self.base, self.var)]


def compare(file: str, group: Group, variant: str, baseline: str = "stock", op: str | None = None) -> Cmp:
    base_rec = group.variants.get(baseline)
    var_rec = group.variants.get(variant)
    if base_rec is None or var_rec is None:
        raise LookupError(f"{file}: {group.workload.describe()} has no {baseline!r} or {variant!r} record")
    reason = not_measured(var_rec, benchmark_of(file))
    return Cmp(file, group, variant, baseline, stat(base_rec, op), stat(var_rec, op), reason)


def source(file: str, group: Group) -> str:
    e = group.env
    git = e.torch_build.split("git ")[-1].split(",")[0] if "git " in e.torch_build else "?"
    return f"`{file}`; {e.device_name}; torch {e.torch_version} (git {git}); {e.dtype}, {e.compile}"


def md_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    def esc(c: str) -> str:
        return str(c).replace("|", "\\|")

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(esc(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


CMP_HEADER = [
    "what",
    "workload",
    "baseline: time per call (median (min .. max, n))",
    "variant: time per call",
    "speedup",
    "verdict",
    "record",
]


def cmp_row(what: str, c: Cmp) -> list[str]:
    wl = c.group.workload.describe()
    if c.baseline != "stock" or c.variant != "mpsboost":
        what = f"{what} ({c.variant} vs {c.baseline})"
    return [what, wl] + c.cells() + [source(c.file, c.group)]


def sweep_summary(
    file: str, gs: Sequence[Group], variant: str, baseline: str = "stock", op: str | None = None
) -> list[str]:
    """One row for a variant over many workloads of one name: counts by verdict and the range of ratios.

    Each ratio is within one workload; nothing is averaged across workloads.
    """
    cmps = [compare(file, g, variant, baseline, op) for g in gs if variant in g.variants and baseline in g.variants]
    cmps = [c for c in cmps if c.reason or (c.base is not None and c.var is not None)]
    if not cmps:
        raise LookupError(f"{file}: no workload has both {variant!r} and {baseline!r}")
    reasons = {c.reason for c in cmps if c.reason}
    name = gs[0].workload.name
    label = f"{len(cmps)} workloads `{name}`" + (f", op `{op}`" if op else "")
    if reasons:
        return [label, f"{variant} vs {baseline}", sorted(reasons)[0], "-", "-", source(file, cmps[0].group)]
    ratios = [c.ratio for c in cmps if c.ratio is not None]
    verdicts = [verdict(c.base, c.var) for c in cmps]
    counts = ", ".join(
        f"{n} {k}"
        for k in ("faster", "slower", "no difference", "spread not recorded")
        if (n := sum(v.startswith(k) for v in verdicts)) or k != "spread not recorded"
    )
    ns = sorted({c.var.n for c in cmps if c.var and c.var.n})
    return [
        label,
        f"{variant} vs {baseline}",
        f"{min(ratios):.2f}x-{max(ratios):.2f}x",
        counts,
        f"{'/'.join(map(str, ns)) or '?'} repeats each",
        source(file, cmps[0].group),
    ]


SWEEP_HEADER = [
    "workloads",
    "variant",
    "speedup range (per workload)",
    "verdicts (min-max spreads apart?)",
    "repeats",
    "record",
]


# --------------------------------------------------------------------------------------------------
# blocks

#: The record file behind each published figure: one run each. A re-run replaces one name here.
SOURCES = {
    "wan_vae": "wan_vae-cuda-2026-11-29-rerun.jsonl",
    "qwen_image_vae": "qwen_image_vae-cuda-2026-11-29.jsonl",
    "moe": "moe-cuda-2026-11-29.jsonl",
    "decode_linear": "decode_linear-cuda-2026-11-30.jsonl",
    "softmax": "softmax-cuda-2026-11-30.jsonl",
    "fp8": "fp8-cuda-2026-11-29-run2.jsonl",
    "fp8_peers": "fp8-cuda-2026-11-29-run1.jsonl",
    "mps_streams": "mps_streams-cuda-2026-11-30.jsonl",
}


def block_recipes(results: Path | None = None) -> str:
    rows: list[list[str]] = []
    wan = SOURCES["wan_vae"]
    g = groups(wan, results)
    for video, dtype in (
        ("480x832x81 tiled", "fp32"),
        ("480x832x81 tiled", "bf16"),
        ("480x832x81 untiled", "fp32"),
        ("704x1280x21 tiled", "fp32"),
    ):
        rows.append(
            cmp_row(
                "`wan_vae_pad` decode", compare(wan, find(g, "wan22_vae_decode", video=video, dtype=dtype), "mpsboost")
            )
        )
    qw = SOURCES["qwen_image_vae"]
    g = groups(qw, results)
    for shape in ({"image": "1024x1024"}, {"image": "1328x1328"}, {"image": "1024x1024 tiled"}):
        for dtype in ("fp32", "bf16"):
            rows.append(
                cmp_row(
                    "`qwen_image_vae` roundtrip",
                    compare(qw, find(g, "qwen_image_vae_roundtrip", dtype=dtype, **shape), "mpsboost"),
                )
            )
    moe = SOURCES["moe"]
    g = groups(moe, results)
    rows.append(
        cmp_row(
            "`moe_experts` prefill (stock: transformers' default experts)",
            compare(moe, find(g, "moe-prefill", prompt=512), "mpsboost"),
        )
    )
    for ctx in (512, 2048):
        rows.append(
            cmp_row(
                "`moe_experts` decode step (stock: transformers' default experts)",
                compare(moe, find(g, "moe-decode", context=ctx), "mpsboost"),
            )
        )
    dl = SOURCES["decode_linear"]
    gs = [x for x in groups(dl, results) if x.workload.name == "decode_linear"]
    what = "`decode_linear` one-token linear, CUDA-graph replay"
    row = sweep_summary(dl, gs, "mpsboost", op="linear_graph")
    if NOT_THROUGH_PATCH in row[2]:
        rows.append([what, row[0], "-", row[2], "-", "-", row[5]])
    else:
        rows.append([what, row[0], "-", row[4], f"{row[2]} (per shape)", row[3], row[5]])
    gm = find(groups(dl, results), "decode_linear.model")
    rows.append(cmp_row("`decode_linear` whole-model decode step", compare(dl, gm, "mpsboost")))
    sm = SOURCES["softmax"]
    g = groups(sm, results)
    rows.append(
        cmp_row(
            "`softmax` sampling step (the installed draw, called directly)",
            compare(sm, find(g, "softmax.sampling_step", warpers="none", form=None), "mpsboost"),
        )
    )
    rows.append(
        cmp_row(
            "`softmax` sampling step (the installed draw, called directly)",
            compare(sm, find(g, "softmax.sampling_step", warpers="temperature 0.6, top-k 20, top-p 0.95"), "mpsboost"),
        )
    )
    gen = find(g, "softmax.generate")
    ran, now = _path_of(gen.variants["mpsboost"]), _softmax_choice_now(gen.env)
    note = f"path of this record: {ran}" + ("" if now == ran else f"; the recipe now picks {now} here: re-run pending")
    rows.append(cmp_row(f"`softmax` eager `generate()` ({note})", compare(sm, gen, "mpsboost")))
    fp = SOURCES["fp8"]
    g = groups(fp, results)
    rows.append(cmp_row("`fp8_weights` dense LM decode", compare(fp, find(g, "lm_decode_dense"), "mpsboost")))
    moe_g = find(g, "lm_decode_moe")
    impl = moe_g.variants["stock"].extra.get("experts_implementation") or "default"
    rows.append(
        cmp_row(
            f"`fp8_weights` MoE LM decode (stock: bf16, transformers `{impl}` experts)", compare(fp, moe_g, "mpsboost")
        )
    )
    rows.append(cmp_row("`fp8_weights` DiT forward", compare(fp, find(g, "wan_transformer_forward"), "mpsboost")))
    ms = SOURCES["mps_streams"]
    g = find(groups(ms, results), "wan_vae_tiled_decode")
    both = (
        "wan_vae_pad+mps_streams" if "wan_vae_pad+mps_streams" in g.variants else "mpsboost"
    )  # the first run's name for both
    rows.append(cmp_row("`mps_streams` alone", compare(ms, g, "mps_streams")))
    rows.append(cmp_row("`mps_streams` next to `wan_vae_pad`", compare(ms, g, both, baseline="wan_vae_pad")))
    return md_table(CMP_HEADER, rows)


def _softmax_choice_now(env) -> str:
    """The path the softmax recipe of this checkout picks for the device and torch build of ``env``."""
    try:
        import torch
        from transformers import Qwen3Config, Qwen3ForCausalLM

        import mpsboost
        from mpsboost.gate import Env
    except ImportError:
        return "unknown (transformers not installed)"
    with torch.device("meta"):
        model = Qwen3ForCausalLM(
            Qwen3Config(
                vocab_size=64,
                hidden_size=32,
                intermediate_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=1,
                head_dim=16,
            )
        )
    rows = mpsboost.plan(model, env=Env.simulate(env.device_type, env.torch_version), recipes=["softmax"]).rows
    return rows[0].backing if rows and rows[0].backing else "stock sampling (the recipe steps aside)"


def _path_of(rec: Record) -> str:
    if rec.extra.get("path"):
        return str(rec.extra["path"])
    report = str(rec.extra.get("report") or "")
    for line in report.splitlines():
        if line.startswith("softmax"):
            rest = line.split("applied", 1)[-1].strip()
            return rest.split(":", 1)[0].strip()
    return "unknown"


def block_recipe_extras(results: Path | None = None) -> str:
    """Counts, memory and correctness beside the timings: values of single records, no speed ratio."""
    rows = []
    wan = SOURCES["wan_vae"]
    g = find(groups(wan, results), "wan22_vae_decode", video="480x832x81 tiled", dtype="fp32")
    s, m = g.variants["stock"], g.variants["mpsboost"]
    if "pad5d_aten" in s.extra:
        rows.append(
            [
                "`wan_vae_pad`",
                g.workload.describe(),
                "aten-level pads of 5-D tensors in one decode (`extra.pad5d_aten`)",
                str(s.extra["pad5d_aten"]["total"]),
                str(m.extra["pad5d_aten"]["total"]),
                source(wan, g),
            ]
        )
    else:
        rows.append(
            [
                "`wan_vae_pad`",
                g.workload.describe(),
                "`F.pad` calls in one decode (`extra.pad_calls`)",
                str(s.extra.get("pad_calls")),
                str(m.extra.get("pad_calls")),
                source(wan, g),
            ]
        )
    for attr, label in (
        ("tensor_allocated", "tensor-allocated peak"),
        ("allocator_reserved", "allocator-reserved peak"),
        ("driver_level", "driver-level peak"),
    ):
        a, b = getattr(s.memory, attr), getattr(m.memory, attr)
        rows.append(
            [
                "`wan_vae_pad`",
                g.workload.describe(),
                label,
                f"{a / 2**30:.2f} GiB",
                f"{b / 2**30:.2f} GiB ({b / a:.3f}x of stock)",
                source(wan, g),
            ]
        )
    rows.append(
        [
            "`wan_vae_pad`",
            g.workload.describe(),
            f"rel. difference vs {m.correctness.reference}",
            "-",
            f"{m.correctness.rel_error:.1e}",
            source(wan, g),
        ]
    )
    qw = SOURCES["qwen_image_vae"]
    g = find(groups(qw, results), "qwen_image_vae_roundtrip", image="1024x1024", dtype="fp32")
    s, m = g.variants["stock"], g.variants["mpsboost"]
    a, b = s.memory.tensor_allocated, m.memory.tensor_allocated
    rows.append(
        [
            "`qwen_image_vae`",
            g.workload.describe(),
            "tensor-allocated peak",
            f"{a / 2**30:.2f} GiB",
            f"{b / 2**30:.2f} GiB ({b / a:.2f}x of stock)",
            source(qw, g),
        ]
    )
    rows.append(
        [
            "`qwen_image_vae`",
            g.workload.describe(),
            f"PSNR vs {m.correctness.reference}",
            "-",
            f"{m.correctness.psnr_db:.1f} dB",
            source(qw, g),
        ]
    )
    fp = SOURCES["fp8"]
    gs = groups(fp, results)
    for name in ("lm_decode_dense", "lm_decode_moe"):
        g = find(gs, name)
        m = g.variants["mpsboost"]
        for key in ("bytes_ratio_linear", "bytes_ratio_experts", "bytes_ratio_total"):
            v = m.extra.get(key)
            if v is not None:
                rows.append(
                    [
                        "`fp8_weights`",
                        g.workload.describe(),
                        f"weight bytes of fp8 / bf16 (`{key}`)",
                        "1",
                        f"{v:.3f}",
                        source(fp, g),
                    ]
                )
    dec = [x for x in gs if x.workload.name == "decode_linear" and "mpsboost" in x.variants]
    sq = [x.variants["mpsboost"].correctness.sqnr_db for x in dec if x.variants["mpsboost"].correctness]
    if sq:
        rows.append(
            [
                "`fp8_weights`",
                f"{len(sq)} workloads `decode_linear`",
                "SQNR per layer vs float64 reference",
                "-",
                f"{min(sq):.1f}-{max(sq):.1f} dB",
                source(fp, dec[0]),
            ]
        )
    return md_table(["recipe", "workload", "what", "stock", "mpsboost", "record"], rows)


def block_peers(results: Path | None = None) -> str:
    rows = []
    moe = SOURCES["moe"]
    g = groups(moe, results)
    for peer in ("transformers:eager", "transformers:batched_mm"):
        rows.append(cmp_row("MoE prefill", compare(moe, find(g, "moe-prefill", prompt=512), peer)))
        rows.append(cmp_row("MoE decode step", compare(moe, find(g, "moe-decode", context=512), peer)))
    fp = SOURCES["fp8_peers"]
    gs = [x for x in groups(fp, results) if x.workload.name == "decode_linear" and len(x.variants) > 2]
    sweep_rows = [
        sweep_summary(fp, gs, v, op="linear")
        for v in (
            "mpsboost",
            "torchao:float8_weight_only",
            "torchao:float8_dynamic_rowwise",
            "diffusers:layerwise_fp8",
            "quanto:qfloat8",
        )
    ]
    return (
        md_table(CMP_HEADER, rows)
        + "\n\nFP8 one-token linears, on the shapes where the peers ran (run 1 only; mpsboost's own row is"
        " from the same run and shapes):\n\n" + md_table(SWEEP_HEADER, sweep_rows)
    )


#: Targets the project set itself (not measurements): (label, target speedup or fraction).
TARGETS = {
    "wan": 1.5,
    "qwen": 2.5,
    "fp8_decode_fraction": 0.70,
    "moe_compiled_fraction": 0.25,
    "fp8_decode_speedup": 1.3,
    "fp8_decode_shapes": 96,  # over the one-token layer shapes of benchmarks/decode_linear.py
}


def block_gaps(results: Path | None = None) -> str:
    rows = []
    wan = SOURCES["wan_vae"]
    g = groups(wan, results)
    for dtype in ("fp32", "bf16"):
        c = compare(wan, find(g, "wan22_vae_decode", video="480x832x81 tiled", dtype=dtype), "mpsboost")
        rows.append(
            [
                "Wan2.2 decode 480x832x81 tiled, " + dtype,
                f">= {TARGETS['wan']}x",
                f"{c.ratio:.2f}x ({verdict(c.base, c.var)}, n={c.var.n})",
                "met" if c.ratio >= TARGETS["wan"] else "not met",
                source(wan, c.group),
            ]
        )
    qw = SOURCES["qwen_image_vae"]
    g = groups(qw, results)
    for dtype in ("fp32", "bf16"):
        c = compare(qw, find(g, "qwen_image_vae_roundtrip", image="1024x1024", dtype=dtype), "mpsboost")
        rows.append(
            [
                "Qwen-Image 1024x1024 roundtrip, " + dtype,
                f">= {TARGETS['qwen']}x",
                f"{c.ratio:.2f}x ({verdict(c.base, c.var)}, n={c.var.n})",
                "met" if c.ratio >= TARGETS["qwen"] else "not met",
                source(qw, c.group),
            ]
        )
    fp = SOURCES["fp8"]
    gs = [x for x in groups(fp, results) if x.workload.name == "decode_linear" and "mpsboost" in x.variants]
    fr = [x.variants["mpsboost"].extra.get("fraction_of_copy_bandwidth") for x in gs]
    fr = [f for f in fr if f is not None]
    rows.append(
        [
            "`fp8_weights` one-token decode, fraction of copy bandwidth on the largest layers",
            f">= {TARGETS['fp8_decode_fraction']:.0%}",
            f"at most {max(fr):.0%} over the {len(gs)} shapes measured",
            "not met" if max(fr) < TARGETS["fp8_decode_fraction"] else "met",
            source(fp, gs[0]),
        ]
    )
    sw = sweep_summary(fp, gs, "mpsboost", op="linear")
    total = TARGETS["fp8_decode_shapes"]
    rows.append(
        [
            f"`fp8_weights` one-token decode speedup over {total} shapes",
            f">= {TARGETS['fp8_decode_speedup']}x",
            f"{sw[2]} on {sw[0]} ({sw[3]})",
            f"not measured on {total - len(gs)} of the {total} shapes" if len(gs) < total else "see the range",
            sw[5],
        ]
    )
    moe = SOURCES["moe"]
    cg = find(groups(moe, results), "moe-decode-compiled", layers=48)
    r = cg.variants["mpsboost"]
    rows.append(
        [
            "`moe_experts` compiled static-cache decode, 48 layers, fraction of the HBM limit",
            f">= {TARGETS['moe_compiled_fraction']:.0%}",
            f"{r.extra['fraction_of_hbm_limit']:.1%} "
            f"({r.extra.get('ms_per_token', math.nan):.2f} ms/token; {r.extra.get('method')})",
            "met" if r.extra["fraction_of_hbm_limit"] >= TARGETS["moe_compiled_fraction"] else "not met",
            source(moe, cg),
        ]
    )
    return md_table(["figure", "target", "measured", "status", "record"], rows)


def block_results(results: Path | None = None) -> str:
    """The inventory of committed record files."""
    rows = []
    for path in sorted((results or RESULTS).glob("*.jsonl")):
        if _is_diagnostic(path.name):
            continue
        recs = records(path.name, results)
        if not recs:
            continue
        e = recs[0].env
        names = sorted({r.workload.name for r in recs})
        variants = sorted({r.variant for r in recs})
        libs = ", ".join(f"{k} {v}" for k, v in sorted(e.libraries.items()) if v)
        rows.append(
            [
                f"`{path.name}`",
                e.device_name,
                f"torch {e.torch_version} ({e.torch_build})",
                libs,
                str(len(recs)),
                ", ".join(f"`{n}`" for n in names),
                ", ".join(f"`{v}`" for v in variants),
            ]
        )
    return md_table(["file", "device", "torch build", "libraries", "records", "workloads", "variants"], rows)


def file_table(file: str, results: Path | None = None) -> str:
    """Every comparison one record file supports: each non-stock variant against stock of its workload;
    sweeps (more than :data:`SWEEP` workloads of one name) as one summary row per variant."""
    gs = groups(file, results)
    by_name: dict[str, list[Group]] = {}
    for g in gs:
        by_name.setdefault(g.workload.name, []).append(g)
    cmp_rows, sweep_rows = [], []
    for name, members in by_name.items():
        variants = [v for v in dict.fromkeys(v for g in members for v in g.variants) if v != "stock"]
        # Operator times where stock has them (device-synchronised, with their spread), else throughput.
        ops = sorted({op for g in members if "stock" in g.variants for op in (g.variants["stock"].op_time or {})})
        has_tp = any(r.throughput is not None for g in members for r in g.variants.values())
        metrics = ops or ([None] if has_tp else [])
        if not metrics or not any("stock" in g.variants for g in members):
            continue
        for op in metrics:
            if len(members) > SWEEP:
                for v in variants:
                    try:
                        sweep_rows.append(sweep_summary(file, members, v, op=op))
                    except LookupError:
                        pass
                continue
            for g in members:
                for v in variants:
                    if v in g.variants and "stock" in g.variants:
                        c = compare(file, g, v, op=op)
                        if c.reason or (c.base is not None and c.var is not None):
                            cmp_rows.append(cmp_row(f"`{name}`" + (f" op `{op}`" if op else ""), c))
    out = []
    if cmp_rows:
        out.append(md_table(CMP_HEADER, cmp_rows))
    if sweep_rows:
        out.append(md_table(SWEEP_HEADER, sweep_rows))
    return "\n\n".join(out) or "(no comparison: no variant has a stock record of its workload)"


def block_details(results: Path | None = None) -> str:
    parts = []
    for path in sorted((results or RESULTS).glob("*.jsonl")):
        if path.name.startswith("e2e-") or _is_diagnostic(path.name):
            continue
        parts.append(f"**`{path.name}`**\n\n" + file_table(path.name, results))
    return "\n\n".join(parts)


def _mode(rec: Record) -> str:
    return str(rec.workload.shape.get("mode") or rec.extra.get("mode") or rec.env.compile)


def _phase(rec: Record, key: str) -> Stat | None:
    """The prefill or decode-per-token samples an end-to-end generate() record keeps in ``extra[key]``."""
    d = rec.extra.get(key)
    if not isinstance(d, dict) or not d.get("samples"):
        return None
    xs = sorted(float(x) for x in d["samples"])
    mid = len(xs) // 2
    med = xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2
    return Stat(med, xs[0], xs[-1], len(xs), "rounds")


def _applies_nothing(rec: Record) -> bool:
    """A patched variant whose patch() applied no row (its report is in the record): it ran the stock model."""
    p = rec.extra.get("patch")
    return isinstance(p, dict) and p.get("applied") == 0


#: The phases of an end-to-end generate() record: its ``extra`` key of per-round times, and its key in
#: ``extra["paired_rounds"]``.
E2E_PHASES = {"prefill_s": "prefill", "decode_s_per_token": "decode", "generate_call_s": "call"}


@dataclass(frozen=True)
class Paired:
    """A variant's ratios to stock, one per round (stock's time / the variant's, same round; > 1 faster)."""

    per_round: tuple
    median: float
    lo: float
    hi: float
    q1: float
    q3: float
    label: str
    recorded: bool  # taken from the record's paired_rounds (False: paired here from the two records' rounds)

    @property
    def n(self) -> int:
        return len(self.per_round)

    def cell(self) -> str:
        if self.n < 2:
            return f"{self.median:.2f}x (one round: no spread)"
        return (
            f"{self.median:.2f}x median of {self.n} rounds ({self.lo:.2f}x .. {self.hi:.2f}x, "
            f"IQR {self.q1:.2f}x .. {self.q3:.2f}x): {self.label}"
        )


def _paired(base: Record, rec: Record, key: str) -> Paired | None:
    """The per-round ratios of ``rec`` to ``base`` for the phase ``key`` (see :data:`E2E_PHASES`): from the
    record's ``paired_rounds`` where it has them, else paired here round by round from both records' samples
    (the end-to-end runs keep them in round order; older runs rotated the order instead of alternating it)."""
    from mpsboost.bench.harness import round_ratios

    p = (rec.extra.get("paired_rounds") or {}).get(E2E_PHASES.get(key, key))
    if isinstance(p, dict) and p.get("per_round"):
        return Paired(
            tuple(p["per_round"]), p["median"], p["min"], p["max"], p["q1"], p["q3"], p["label"], recorded=True
        )
    b, x = (r.extra.get(key) for r in (base, rec))
    if not (isinstance(b, dict) and isinstance(x, dict)):
        return None
    bs, xs = b.get("samples") or [], x.get("samples") or []
    if not bs or len(bs) != len(xs):
        return None
    r = round_ratios(bs, xs)
    return Paired(r.per_round, r.median, r.min, r.max, r.q1, r.q3, r.label, recorded=False)


def block_e2e_generate(results: Path | None = None) -> str:
    """transformers ``generate()`` in the end-to-end matrix: prefill (time to the first token) and decode
    per token, each as medians with their spread, and the variant's ratio to stock of the same model, mode and
    decoding in the same file as the median of its per-round ratios (stock and the variant ran in the same
    rounds) with their min..max and IQR; a variant whose rounds straddle 1.0 reads "not faster" whatever its
    median; the decode's share of the bandwidth limit; whether greedy tokens equal stock's."""
    rows = []
    for path in sorted((results or RESULTS).glob("e2e-*.jsonl")):
        for g in groups(path.name, results):
            base = g.variants.get("stock")
            if base is None or _phase(base, "decode_s_per_token") is None:
                continue
            sh = g.workload.shape
            what = f"{sh.get('model')} ({sh.get('layers')} layers), {_mode(base)}, {sh.get('decoding')}"
            for v, rec in g.variants.items():
                if v == "stock":
                    continue
                cells = []
                for key in ("prefill_s", "decode_s_per_token"):
                    b, x = _phase(base, key), _phase(rec, key)
                    if x is None:
                        cells += ["not measured: " + str(rec.extra.get("error") or "no rounds"), "-"]
                        continue
                    pr = _paired(base, rec, key)
                    cells += [f"{x.cell()} vs {b.cell()}", pr.cell() if pr else f"{b.median / x.median:.2f}x"]
                share = lambda r: (r.extra.get("bandwidth") or {}).get("share_of_limit")  # noqa: E731
                bw = (
                    f"{share(rec):.1%} (stock {share(base):.1%})"
                    if share(rec) is not None and share(base) is not None
                    else "-"
                )
                same = rec.extra.get("tokens_equal_stock")
                tokens = (
                    "-"
                    if sh.get("decoding") != "greedy" or same is None
                    else ("equal" if same else f"{rec.extra.get('token_match_fraction', 0):.0%} equal")
                )
                label = f"{v} (applies nothing here: stock against itself)" if _applies_nothing(rec) else v
                rows.append([what, label] + cells + [bw, tokens, source(path.name, g)])
    if not rows:
        return "No end-to-end generate() records (`e2e-*.jsonl`) committed yet."
    return md_table(
        [
            "model, mode, decoding",
            "variant",
            "prefill: variant vs stock (median (min .. max, rounds))",
            "prefill speedup: per-round ratios",
            "decode per token: variant vs stock",
            "decode speedup: per-round ratios",
            "share of the bandwidth limit (decode)",
            "greedy tokens vs stock",
            "record",
        ],
        rows,
    )


def block_e2e_breakdown(results: Path | None = None) -> str:
    """The hooked per-module breakdown of decode (``e2e-breakdown`` records: synchronising hooks, never mixed
    with the throughput): each module kind's ms per decoded token, median over the rounds (min .. max), per
    variant, with its per-round ratio to stock."""
    rows = []
    for path in sorted((results or RESULTS).glob("e2e-*.jsonl")):
        for g in groups(path.name, results):
            if g.workload.name != "e2e-breakdown" or "stock" not in g.variants:
                continue
            sh = g.workload.shape
            what = f"{sh.get('model')} ({sh.get('layers')} layers), {sh.get('decode_steps')} hooked decode steps"
            base = g.variants["stock"].extra["breakdown"]
            for v, rec in g.variants.items():
                b = rec.extra["breakdown"]
                for kind, ms in b["decode_ms_per_token"].items():
                    xs = sorted(b.get("decode_ms_per_token_rounds", {}).get(kind) or [ms])
                    spread = f" ({xs[0]:.2f} .. {xs[-1]:.2f}, {len(xs)} rounds)" if len(xs) > 1 else ""
                    pr = (rec.extra.get("paired_rounds") or {}).get(kind)
                    if v == "stock":
                        ratio = "-"
                    elif ms > 0:
                        ratio = f"{base['decode_ms_per_token'][kind] / ms:.2f}x"
                    else:  # the variant never calls this kind on its own (experts inside moe_block)
                        ratio = "not called on its own"
                    if pr:
                        ratio = (
                            f"{pr['median']:.2f}x median of {pr['n']} rounds ({pr['min']:.2f}x .. {pr['max']:.2f}x): "
                            f"{pr['label']}"
                        )
                    rows.append([what, v, kind, f"{ms:.2f} ms{spread}", ratio, source(path.name, g)])
    if not rows:
        return "No hooked breakdown records (`e2e-breakdown` in `e2e-*.jsonl`) committed yet."
    return md_table(
        ["model", "variant", "module kind", "ms per decoded token (hooked)", "vs stock: per-round ratios", "record"],
        rows,
    )


def _e2e_generate(results: Path | None, variant: str = "mpsboost", **shape) -> tuple[str, Group] | None:
    """The one generate() group of the committed e2e files whose shape has these fields and that ran
    ``variant`` next to stock (latest file first)."""
    for path in sorted((results or RESULTS).glob("e2e-*.jsonl"), reverse=True):
        for g in groups(path.name, results):
            if (
                g.workload.name == "e2e-generate"
                and variant in g.variants
                and "stock" in g.variants
                and _phase(g.variants[variant], "decode_s_per_token") is not None
                and all(g.workload.shape.get(k) == v for k, v in shape.items())
            ):
                return path.name, g
    return None


def _e2e_breakdown(results: Path | None, **shape) -> tuple[str, Group] | None:
    """The latest hooked breakdown group (``e2e-breakdown``) whose shape has these fields."""
    for path in sorted((results or RESULTS).glob("e2e-*.jsonl"), reverse=True):
        for g in groups(path.name, results):
            if g.workload.name == "e2e-breakdown" and all(g.workload.shape.get(k) == v for k, v in shape.items()):
                return path.name, g
    return None


def _paired_status(p: Paired, target: float, *, min_rounds: int = 5, floor: float | None = None) -> str:
    """A paired-rounds target: the median at least ``target`` over at least ``min_rounds`` rounds, and with
    ``floor`` no round below it. A speedup target (above 1.0x) is never met by rounds that straddle 1.0: such a
    mode is not faster, whatever its median."""
    why = []
    if p.median < target:
        why.append(f"median below {target}x")
    if target > 1.0 and p.lo <= 1.0 <= p.hi:
        why.append("rounds straddle 1.0")
    if p.n < min_rounds:
        why.append(f"{p.n} rounds (at least {min_rounds} needed)")
    if floor is not None and p.lo < floor:
        why.append(f"a round below {floor}x")
    return "met" if not why else "not met: " + ", ".join(why)


def block_gaps_e2e(results: Path | None = None) -> str:
    """The end-to-end targets (whole generate() calls, stock and patched in one run)."""
    rows = []

    def ratio(file: str, g: Group, variant: str, key: str) -> tuple[float, str]:
        b, x = _phase(g.variants["stock"], key), _phase(g.variants[variant], key)
        return b.median / x.median, verdict(b, x)

    def status(r: float, v: str, target: float) -> str:
        if r >= target:
            return "met"
        return "met within noise" if target == 1.0 and v.startswith("no difference") and r >= 0.97 else "not met"

    for model, label in (("qwen3-8b", "dense"), ("qwen3-30b-a3b", "MoE")):
        for decoding in ("greedy", "sampled"):
            hit = _e2e_generate(results, model=model, mode="static", decoding=decoding)
            if hit is None:
                continue
            f, g = hit
            r, v = ratio(f, g, "mpsboost", "decode_s_per_token")
            noop = _applies_nothing(g.variants["mpsboost"])
            rows.append(
                [
                    f"static-cache (compiled) decode, default patch, {label} "
                    f"{g.workload.shape['layers']} layers, {decoding}",
                    ">= 1.0x of stock",
                    f"{r:.2f}x ({v})"
                    + ("; the default patch applies nothing here, so this is stock against itself" if noop else ""),
                    "met (nothing applied)" if noop else status(r, v, 1.0),
                    source(f, g),
                ]
            )
            fp8_hit = _e2e_generate(
                results, variant="mpsboost:fp8-rowwise", model=model, mode="static", decoding=decoding
            )
            if fp8_hit is not None:
                f, g = fp8_hit
                r, v = ratio(f, g, "mpsboost:fp8-rowwise", "decode_s_per_token")
                rows.append(
                    [
                        f'static-cache decode, `fp8="rowwise"`, {label} '
                        f"{g.workload.shape['layers']} layers, {decoding}",
                        ">= 1.3x of bf16 stock",
                        f"{r:.2f}x ({v})",
                        status(r, v, 1.3),
                        source(f, g),
                    ]
                )
    hit = _e2e_generate(results, model="qwen3-30b-a3b", mode="static", decoding="greedy")
    if hit is not None:
        f, g = hit
        share = g.variants["mpsboost"].extra["bandwidth"]["share_of_limit"]
        layers = g.workload.shape["layers"]
        rows.append(
            [
                f"MoE static-cache decode, share of the bandwidth limit "
                f"({layers} layers measured; the target is at 48)",
                ">= 25%",
                f"{share:.1%} (stock {g.variants['stock'].extra['bandwidth']['share_of_limit']:.1%})",
                "not met" if share < 0.25 else ("met" if layers == 48 else f"met at {layers} layers"),
                source(f, g),
            ]
        )
    hit = _e2e_generate(results, model="qwen3-30b-a3b", mode="eager", decoding="greedy")
    if hit is not None:
        f, g = hit
        for key, name, target in (("prefill_s", "prefill", 1.0), ("decode_s_per_token", "decode", 1.3)):
            r, v = ratio(f, g, "mpsboost", key)
            rows.append(
                [
                    f"eager `generate()` {name}, MoE {g.workload.shape['layers']} layers "
                    "(stock: transformers' default, "
                    "which switches decode to batched_mm)",
                    f">= {target}x of stock",
                    f"{r:.2f}x ({v})",
                    status(r, v, target),
                    source(f, g),
                ]
            )
    # Qwen3.6-35B-A3B (Gated DeltaNet + attention + MoE): the targets of its recipes, from the latest record
    # that ran each decision set; ratios are medians of paired rounds, with their spread and label.
    mac = "mpsboost:mac-2.15.0"
    targets = [
        ("eager", "mpsboost", "decode_s_per_token", "default patch", 1.5, None),
        ("eager", mac, "decode_s_per_token", "Mac 2.15.0 decisions on the GPU", 2.0, None),
        ("static", "mpsboost", "decode_s_per_token", "default patch", 1.2, 1.0),
        ("static", mac, "decode_s_per_token", "Mac 2.15.0 decisions on the GPU", 1.2, 1.0),
    ] + [
        (mode, v, "prefill_s", name, 1.0, None)
        for mode in ("eager", "static")
        for v, name in (("mpsboost", "default patch"), (mac, "Mac 2.15.0 decisions on the GPU"))
    ]
    for mode, variant, key, name, target, floor in targets:
        hit = _e2e_generate(results, variant=variant, model="qwen3.6-35b-a3b", mode=mode, decoding="greedy")
        if hit is None:
            continue
        f, g = hit
        p = _paired(g.variants["stock"], g.variants[variant], key)
        if p is None:
            continue
        phase = "decode" if key == "decode_s_per_token" else "prefill"
        mode_name = "eager `generate()`" if mode == "eager" else "static-cache (compiled)"
        rows.append(
            [
                f"{mode_name} {phase}, Qwen3.6-35B-A3B {g.workload.shape['layers']} layers, {name}",
                f"median >= {target}x of stock over >= 5 paired rounds"
                + (f", no round below {floor}x" if floor is not None else ""),
                p.cell(),
                _paired_status(p, target, floor=floor),
                source(f, g),
            ]
        )
    hit = _e2e_breakdown(results, model="qwen3.6-35b-a3b")
    if hit is not None:
        f, g = hit
        parts = {n: g.variants[n].extra["breakdown"]["decode_ms_per_token"] for n in ("stock", "mpsboost")}
    else:  # older runs kept the breakdown inside the eager generate() records
        hit = _e2e_generate(results, model="qwen3.6-35b-a3b", mode="eager", decoding="greedy")
        parts = {}
        if hit is not None:
            f, g = hit
            parts = {
                n: (g.variants[n].extra.get("breakdown") or {}).get("decode_ms_per_token", {})
                for n in ("stock", "mpsboost")
            }
    if hit is not None and parts and all("linear_attention" in p for p in parts.values()):
        s_ms, p_ms = parts["stock"]["linear_attention"], parts["mpsboost"]["linear_attention"]
        rows.append(
            [
                f"Gated DeltaNet layers per decoded token (synchronised hooks), Qwen3.6-35B-A3B "
                f"{g.workload.shape['layers']} layers",
                "at most half of stock's",
                f"{p_ms:.1f} ms against {s_ms:.1f} ms ({s_ms / p_ms:.2f}x)",
                "met" if p_ms <= s_ms / 2 else "not met",
                source(f, g),
            ]
        )
    if not rows:
        return "No end-to-end generate() records committed yet."
    return md_table(["figure", "target", "measured", "status", "record"], rows)


def _fp8_load_error_note(latest: dict, name: str, label: str, var) -> str:
    """What stands beside a load's error against the file's exact dequantisation: "bit-equal", or, where the
    same workload's load of the fp8 layers alone is bit-equal and this one (with the default lossless recipes)
    is not, that the difference is those recipes', not the fp8 layers'."""
    if var.extra.get("logits_equal"):
        return " (bit-equal)"
    alone_label = "mpsboost load_fp8, no other recipes"
    alone = latest.get((name, alone_label))
    if label == "mpsboost load_fp8" and alone is not None and alone[1].variants[alone_label].extra.get("logits_equal"):
        return (
            ": not the fp8 layers' (loaded alone they are bit-equal: the row of the fp8 layers alone); the other "
            "default recipes change summation orders against the stock forward, and this random-weight model's "
            "routers, on near ties, amplify that to the noise floor (docs/known-gaps.md)"
        )
    return ""


def block_fp8_load(results: Path | None = None) -> str:
    """``load_fp8`` onto a meta-built model against loading the bf16 model and converting (``fp8_load-*.jsonl``):
    load time, peak memory on the device and the host, the decode (denoising) step, errors against the
    file's exact dequantisation and against a float32 forward. One row per workload from its newest
    record file (files sort by date and letter); the older files are listed below the table."""
    latest: dict[str, tuple] = {}
    seen: list[str] = []
    gib = lambda b: f"{b / 2**30:.2f} GiB"  # noqa: E731
    for path in sorted((results or RESULTS).glob("fp8_load-*.jsonl")):
        gs = groups(path.name, results)
        steps = {g.workload.shape["workload"]: g for g in gs if g.workload.name == "fp8_decode_step"}
        for g in gs:
            if g.workload.name != "fp8_load" or g.variants.get("bf16 load + convert") is None:
                continue
            # load_fp8 with the default lossless recipes, or (fp8_load.py --no-lossless-recipes) the fp8 layers alone
            for label in ("mpsboost load_fp8", "mpsboost load_fp8, no other recipes"):
                if g.variants.get(label) is not None:
                    latest[(g.workload.shape["workload"], label)] = (
                        path.name,
                        g,
                        steps.get(g.workload.shape["workload"]),
                    )
                    seen.append(path.name)
    rows = []
    for (name, label), (fname, g, step) in latest.items():
        base, var = g.variants["bf16 load + convert"], g.variants[label]
        sh = g.workload.shape
        dev_b, dev_v = base.memory.tensor_allocated, var.memory.tensor_allocated
        host_b, host_v = base.extra["host_peak_bytes"], var.extra["host_peak_bytes"]
        rel = var.correctness.rel_error if var.correctness else None
        f32, floor = var.extra.get("rel_error_vs_fp32"), var.extra.get("bf16_reference_vs_fp32")
        floor_text = "not recorded" if f32 is None else f"{f32:.1e} (stock bf16: {floor:.1e})"
        step_text = "-"
        if step is not None and {"bf16", label} <= set(step.variants):
            a, b = step.variants["bf16"].throughput.value, step.variants[label].throughput.value
            step_text = f"{a:.1f} ms -> {b:.1f} ms ({b / a:.2f}x the time; one median each)"
        path_text = "; ".join(var.extra.get("backing") or []) or "-"
        rows.append(
            [
                f"{sh['workload']} ({sh['layers']} layers), {sh['format']}; "
                f"files: bf16 {gib(sh['bf16_bytes'])}, fp8 {gib(sh['fp8_bytes'])}"
                + ("" if label == "mpsboost load_fp8" else "; the fp8 layers alone (no other recipe)"),
                path_text,
                f"{base.throughput.value:.1f} s -> {var.throughput.value:.1f} s (one run each)",
                f"{gib(dev_b)} -> {gib(dev_v)} ({dev_v / dev_b:.3f}x)",
                f"{gib(host_b)} -> {gib(host_v)} ({host_v / host_b:.3f}x)",
                step_text,
                "-" if rel is None else f"{rel:.1e}" + _fp8_load_error_note(latest, name, label, var),
                floor_text,
                source(fname, g),
            ]
        )
    if not rows:
        return "No fp8_load records committed yet."
    older = sorted(set(seen) - {v[0] for v in latest.values()})
    table = md_table(
        [
            "workload",
            "fp8 forward path (as recorded)",
            "load time: bf16 + convert -> load_fp8",
            "device tensor peak",
            "host peak",
            "decode step (LMs: one token after 128; Qwen-Image: one 512x512 denoising forward), bf16 -> fp8",
            "output rel. error vs the file's exact dequantisation (stock bf16 forward)",
            "rel. error vs a float32 forward of the same weights",
            "record",
        ],
        rows,
    )
    if older:
        table += (
            "\n\nOlder records of this table (earlier code; see their commits in the NOTES): "
            + ", ".join(f"`{f}`" for f in older)
            + "."
        )
    return table


def block_e2e(results: Path | None = None) -> str:
    """End-to-end matrix (``e2e-*.jsonl``), pipelines: one row per (workload, mode, variant) against stock
    of the same workload and mode in the same file (generate() records have their own table)."""
    rows = []
    for path in sorted((results or RESULTS).glob("e2e-*.jsonl")):
        for g in groups(path.name, results):
            if (
                "stock" not in g.variants
                or g.workload.name == "e2e-breakdown"
                or _phase(g.variants["stock"], "decode_s_per_token") is not None
            ):
                continue
            for v in g.variants:
                if v == "stock":
                    continue
                c = compare(path.name, g, v)
                rows.append([f"`{g.workload.name}`", _mode(g.variants[v]), v] + c.cells() + [source(path.name, g)])
    if not rows:
        return "No end-to-end records (`e2e-*.jsonl`) committed yet."
    return md_table(
        [
            "workload",
            "mode",
            "variant",
            "stock: time per call (median (min .. max, n))",
            "variant: time per call",
            "speedup",
            "verdict",
            "record",
        ],
        rows,
    )


# Diagnostics: operator sweeps and profiles written as plain JSON lines (one dict per line with its
# environment), not mpsboost records; each has its own block below.
DIAGNOSTICS = ("fp8_gemv-", "profile_decode-")


def _is_diagnostic(name: str) -> bool:
    return name.startswith(DIAGNOSTICS)


def _raw(name: str, results: Path | None = None) -> list[dict]:
    import json

    with open((results or RESULTS) / name) as f:
        return [json.loads(line) for line in f if line.strip()]


def block_fp8_gemv(results: Path | None = None) -> str:
    """``benchmarks/fp8_gemv.py``: per Qwen3-8B layer shape, bf16 ``F.linear`` against the best launch
    configuration of each fp8 kernel and the tuner's pick, as time per layer over a cycle of distinct
    weights (CUDA-graph replay), its share of the copy bandwidth and the speedup over bf16."""
    out = []
    for path in sorted((results or RESULTS).glob("fp8_gemv-*.jsonl")):
        recs = [r for r in _raw(path.name, results) if "us_per_layer_median" in r]
        if not recs:
            continue
        env = recs[0]["env"]
        rows = []
        for shape in dict.fromkeys(r["shape"] for r in recs):
            rs = [r for r in recs if r["shape"] == shape]
            picks = [
                ("bf16 F.linear (cuBLAS)", [r for r in rs if r["variant"] == "bf16"]),
                ("fp8 tile kernel (16-row MMA), best config", [r for r in rs if r["variant"].startswith("fp8 mma")]),
                ("fp8 single-row kernel, best config", [r for r in rs if r["variant"].startswith("fp8 row")]),
                ("fp8 tuner's pick (shipped)", [r for r in rs if r["variant"].startswith("fp8 tuned")]),
            ]
            for label, cands in picks:
                if not cands:
                    continue
                r = min(cands, key=lambda x: x["us_per_layer_median"])
                rows.append(
                    [
                        f"`{shape}` {r['n']}x{r['k']}",
                        label,
                        r["variant"].split(" ", 2)[-1] if label.startswith("fp8") else "-",
                        f"{r['us_per_layer_median']:.1f} "
                        f"({r['us_per_layer_min']:.1f} .. {r['us_per_layer_max']:.1f}, n={r['repeats']})",
                        f"{r['share_of_copy_bandwidth']:.0%}" if r.get("share_of_copy_bandwidth") else "-",
                        f"{r['speedup_vs_bf16']:.2f}x" if r.get("speedup_vs_bf16") else "-",
                        f"{r['rel_err_vs_fp32_dequant']:.1e}",
                    ]
                )
        out.append(
            f"`{path.name}`: {env['device']}, torch {env['torch']}, triton {env['triton']}, {env['date']}; "
            f"`{env['command']}`\n\n"
            + md_table(
                [
                    "layer",
                    "kernel",
                    "config",
                    "us per layer, median (min .. max)",
                    "share of copy bandwidth",
                    "vs bf16",
                    "rel. error vs fp32 dequant",
                ],
                rows,
            )
        )
    return "\n\n".join(out) or "No fp8_gemv records committed yet."


def block_profile_decode(results: Path | None = None) -> str:
    """``benchmarks/profile_decode.py``: GPU kernel time of one static-cache ``generate()`` by group,
    against the wall time of the call."""
    out = []
    for path in sorted((results or RESULTS).glob("profile_decode-*.jsonl")):
        recs = _raw(path.name, results)
        if recs and recs[0].get("workload") == "qwen3.6-eager":
            out.append(_profile_eager(path.name, recs))
            continue
        rows = []
        for r in recs:
            groups_ = ", ".join(
                f"{k} {v / r['new_tokens']:.2f}" for k, v in sorted(r["groups_ms"].items(), key=lambda x: -x[1])
            )
            if r.get("unit", "token") == "token":
                call = (
                    f"{r.get('workload', 'qwen3-8b')} static-cache generate(), "
                    f"{r['layers']} layers, {r['new_tokens']} new tokens"
                )
            else:
                call = f"{r['workload']} transformer, {r['layers']} layers, one 512x512 denoising forward"
            plain = f"; {r['plain_wall_ms']:.1f} ms without the profiler (median of 5)" if "plain_wall_ms" in r else ""
            rows.append(
                [
                    r["variant"],
                    call,
                    f"{r['wall_ms']:.1f} ms{plain}",
                    f"{r['kernel_ms']:.1f} ms ({r['kernel_ms'] / r['wall_ms']:.0%} of the wall)",
                    groups_,
                ]
            )
        if rows:
            out.append(
                f"`{path.name}`: {recs[0]['device']}, torch {recs[0]['torch']}\n\n"
                + md_table(
                    [
                        "variant",
                        "call",
                        "wall time of the profiled call",
                        "summed GPU kernel time",
                        "kernel time per new token (generate(), prefill included) or per forward, by group (ms)",
                    ],
                    rows,
                )
            )
    return "\n\n".join(out) or "No profile_decode records committed yet."


def _profile_eager(name: str, recs: list[dict]) -> str:
    """``profile_decode.py --workload qwen3.6-eager``: per variant and round, where the host time of an eager
    decode step goes, against the kernel time (the GPU waits for the host when the kernel time is far below
    the step)."""
    rows = []
    per_round = len({r["variant"] for r in recs}) or 1  # every variant once per round
    for i, r in enumerate(recs):
        steps = r["step_all_ms"]
        kinds = ", ".join(f"{k} {v:.2f}" for k, v in r["host_ms_per_step"].items())
        copies = ", ".join(f"{k.split(' (')[0]} {v:g}" for k, v in r["device_copies_per_step"].items())
        to_host = sum(v for k, v in r["device_copies_per_step"].items() if "DtoH" in k)
        top = ", ".join(f"{k[6:]} {c:g}x {ms:.2f}" for k, (c, ms) in list(r["top_own_host_ms_per_step"].items())[:5])
        rows.append(
            [
                str(i // per_round + 1),
                r["variant"],
                f"{r['step_ms']:.1f} ({steps[0]:.1f} .. {steps[-1]:.1f}, n={len(steps)})",
                str(r["aten_ops_per_step"]),
                f"{r['kernels_per_step']:.0f}",
                f"{r['kernel_ms_per_step']:.2f}",
                kinds,
                f"{copies}; device-to-host: {to_host:g}",
                top,
            ]
        )
    r0 = recs[0]
    return (
        f"`{name}`: {r0['device']}, torch {r0['torch']}; the Qwen3.6-35B-A3B shape at {r0['layers']} layers, "
        "eager decode steps on a 512-token cache, variants alternated on one model in each round (times in ms "
        "per step; the host time per module kind and the ops' own host time come from the profiled steps, "
        "which the profiler slows)\n\n"
        + md_table(
            [
                "round",
                "variant",
                "step, median (min .. max) without the profiler",
                "aten ops",
                "kernels",
                "summed kernel time",
                "host time inside each module kind",
                "device copies per step",
                "aten ops by own host time (calls, ms)",
            ],
            rows,
        )
    )


def block_fp8_decode_cost(results: Path | None = None) -> str:
    """One decode step's aten ops (tiny) and bytes moved (medium) under a Mac's decisions, per block, from the
    newest ``decode_cost-cpu-*.json`` (``benchmarks/decode_cost.py``): patched against the fp8 variants."""
    paths = sorted((results or RESULTS).glob("decode_cost-cpu-*.json"))
    if not paths:
        return "No decode_cost records committed yet."
    rec = json.loads(paths[-1].read_text())
    rows = rec["rows"]
    out = []
    for dec in sorted({r["decisions"] for r in rows}, reverse=True):
        for what, unit in (("bytes", "MiB moved, medium size (bfloat16)"), ("ops", "aten ops, tiny size")):
            sel = [r for r in rows if r["decisions"] == dec and r["measure"] == what]
            if not sel:
                continue
            names = [r["variant"] for r in sel]
            base = {"ops": {"fp8 as published": "patched, bfloat16"}}.get(what, {})
            blocks = ["linear_attn", "self_attn", "mlp", "rest"]

            def cell(r, v, what=what):
                return f"{v / 2**20:.1f}" if what == "bytes" else str(v)

            out.append(f"{dec.replace('mac-', 'Mac ')} decisions, {unit}:")
            out.append("")
            out.append("| block | " + " | ".join(names) + " |")
            out.append("|---|" + "---|" * len(names))
            for b in blocks:
                out.append(f"| {b} | " + " | ".join(cell(r, r["blocks"].get(b, 0)) for r in sel) + " |")
            totals = []
            for r in sel:
                ref = next(x for x in sel if x["variant"] == base.get(r["variant"], "patched"))
                fp8 = r["variant"].startswith("fp8")
                ratio = f" ({r['total'] / ref['total']:.2f}x of {ref['variant']})" if fp8 else ""
                totals.append(cell(r, r["total"]) + ratio)
            out.append("| whole step | " + " | ".join(totals) + " |")
            out.append("")
    env = rec["env"]
    out.append(
        f"Record `{paths[-1].name}` (`{rec['command']}`): torch {env['torch']}, transformers "
        f"{env['transformers']}, counted on the CPU by {rec['rules']}."
    )
    return "\n".join(out)


def block_decode_predict(results: Path | None = None) -> str:
    """The Mac cost model's prediction for Qwen3.6-35B-A3B's decode step (predicted, not measured), from the newest
    ``decode_cost-predict-*.json`` (``benchmarks/decode_cost.py --predict``), beside the published figures."""
    paths = sorted((results or RESULTS).glob("decode_cost-predict-*.json"))
    if not paths:
        return "No decode_cost prediction committed yet."
    rec = json.loads(paths[-1].read_text())
    assert rec["label"] == "predicted, not measured", paths[-1]
    chips = list(rec["chips"])
    out = [
        "**Predicted, not measured.** Tokens a second of one decode step (batch 1, 40-token context), eager, "
        "as the range from the dispatches both paths ship priced as MPSGraph to priced as Metal. " + rec["model"],
        "",
    ]
    rows = []
    for variant in rec["steps"]:
        cells = [variant]
        for chip in chips:
            (r,) = [r for r in rec["rows"] if r["variant"] == variant and r["chip"] == chip]
            lo, hi = r["tok_s"]
            cells.append(f"{lo:.0f}-{hi:.0f}")
        rows.append(cells)
    out.append(md_table(["predicted tok/s", *chips], rows))
    steps = rec["steps"]
    out += ["", "What the prediction counts (the real model's step, scaled from the medium size):", ""]
    srows = []
    for variant, st in steps.items():
        srows.append(
            [
                variant,
                f"{st['bytes'] / 1e9:.2f}",
                f"{st['ops']:.0f}",
                f"{st['metal']:.0f}",
                f"{st['mpsgraph']:.0f}",
                f"{st['mixed'] + st['unknown'] + st['unlisted']:.0f}",
                f"{st['pointwise']:.0f}",
            ]
        )
    out.append(md_table(["step", "GB moved", "aten ops", "Metal", "MPSGraph", "mixed", "of them pointwise"], srows))
    ultra = {r["variant"]: r for r in rec["rows"] if r["chip"] == "M3 Ultra"}
    if ultra:
        st, pa = ultra.get("stock"), ultra.get("patched, bfloat16")
        seed = rec["seed"]
        out += ["", "The seed's setup (Qwen3.6-35B-A3B, bf16, M3 Ultra; the seed measured with torch.compile):", ""]
        srows = []
        for label, r, meas in (("before the grouped decode / stock", st, seed["before"]),
                               ("after the grouped decode / patched bf16", pa, seed["after"])):  # fmt: skip
            if r is None:
                continue
            lo, hi = r["tok_s"]
            srows.append(
                [label, f"{meas}", f"{lo:.0f}-{hi:.0f}", f"{r['tok_s_pointwise_fused']:.0f}",
                 f"{1e3 / meas:.1f}", f"{r['ms_mixed_as_metal']:.1f}-{r['ms_mixed_as_mpsgraph']:.1f}",
                 f"{r['bytes_ms']:.1f}"]
            )  # fmt: skip
        out.append(
            md_table(
                [
                    "seed / model",
                    "seed tok/s (measured)",
                    "predicted eager",
                    "predicted, pointwise fused",
                    "seed ms",
                    "predicted ms",
                    "of it bytes",
                ],
                srows,
            )  # fmt: skip
        )
    out += ["", "Published figures for the same model (measured by others):", ""]
    out.append(md_table(["what", "chip", "tok/s", "source"],
                        [[p["what"], p["chip"], f"{p['tok_s']}", p["source"]] for p in rec["peers"]]))  # fmt: skip
    out += ["", "Constants:", ""]
    out.append(md_table(["constant", "value", "source"],
                        [[k, f"{v['value']}", v["source"]] for k, v in rec["constants"].items()]
                        + [[f"{k} bandwidth", f"{v['bandwidth_gbs']:.0f} GB/s", v["source"]]
                           for k, v in rec["chips"].items()]))  # fmt: skip
    env = rec["env"]
    out += [
        "",
        f"Record `{paths[-1].name}` (`{rec['command']}`): counts on the CPU, torch {env['torch']}, transformers "
        f"{env['transformers']}, {env['decisions']} decisions, dispatch kinds from {env['dispatch kinds']}.",
    ]
    return "\n".join(out)


BLOCKS: dict[str, Callable[..., str]] = {
    "decode-predict": block_decode_predict,
    "fp8-decode-cost": block_fp8_decode_cost,
    "fp8-gemv": block_fp8_gemv,
    "profile-decode": block_profile_decode,
    "recipes": block_recipes,
    "recipe-extras": block_recipe_extras,
    "peers": block_peers,
    "gaps": block_gaps,
    "results": block_results,
    "details": block_details,
    "e2e": block_e2e,
    "e2e-generate": block_e2e_generate,
    "e2e-breakdown": block_e2e_breakdown,
    "gaps-e2e": block_gaps_e2e,
    "fp8-load": block_fp8_load,
}


def _tool_blocks() -> dict[str, Callable[..., str]]:
    """The blocks computed from the registry and the gate (mpsboost.docs), not from records."""
    from mpsboost import docs

    return dict(docs.blocks())


def all_blocks() -> dict[str, Callable[..., str]]:
    return {**BLOCKS, **_tool_blocks()}


_MARKER = re.compile(
    r"(<!-- tables:(?P<name>[a-z0-9-]+):begin -->\n)(?P<body>.*?)(\n?<!-- tables:(?P=name):end -->)", re.S
)


def render(text: str, results: Path | None = None, blocks: dict[str, Callable[..., str]] | None = None) -> str:
    """``text`` with every generated block recomputed from the records."""
    blocks = blocks or all_blocks()

    def sub(m: re.Match) -> str:
        name = m.group("name")
        if name not in blocks:
            raise KeyError(f"unknown generated block {name!r}; known: {sorted(blocks)}")
        return m.group(1) + blocks[name](results).rstrip() + "\n" + m.group(4).lstrip("\n")

    return _MARKER.sub(sub, text)


def _stale(root: Path, results: Path | None, docs: Sequence[str]) -> Iterator[tuple[str, Path, str, str]]:
    """(doc, path, committed text, text from the records) of every document whose generated blocks differ."""
    for doc in docs:
        path = root / doc
        old = path.read_text(encoding="utf-8")
        new = render(old, results)
        if new != old:
            yield doc, path, old, new


def check(root: Path = ROOT, results: Path | None = None, docs: Sequence[str] = DOCS) -> list[str]:
    """Unified diffs of every document whose generated blocks differ from the records (empty: all current)."""
    return [
        "".join(
            difflib.unified_diff(
                old.splitlines(True), new.splitlines(True), f"{doc} (committed)", f"{doc} (from records)"
            )
        )
        for doc, _, old, new in _stale(root, results, docs)
    ]


def write(root: Path = ROOT, results: Path | None = None, docs: Sequence[str] = DOCS) -> list[str]:
    changed = []
    for doc, path, _, new in list(_stale(root, results, docs)):
        path.write_text(new, encoding="utf-8")
        changed.append(doc)
    return changed


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--check", action="store_true", help="exit 1 and print a diff where a document differs from the records"
    )
    ap.add_argument(
        "--root",
        type=Path,
        default=ROOT,
        help="the checkout whose documents (README.md, benchmarks/README.md, docs/) to check or rewrite",
    )
    args = ap.parse_args(argv)
    if args.check:
        diffs = check(args.root)
        for d in diffs:
            sys.stdout.write(d)
        if diffs:
            print("\ngenerated tables are stale: run `python benchmarks/tables.py`", file=sys.stderr)
        return 1 if diffs else 0
    for doc in write(args.root):
        print(f"rewrote {doc}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
