"""The documentation tables that describe the tool, computed from the tool itself.

Two tables in ``README.md`` and ``docs/support.md`` say what mpsboost does; they are not written by
hand, so they cannot drift from the code:

* :func:`support_table` -- which recipe applies on which Mac and torch build ("what applies on my
  Mac and torch"): :func:`mpsboost.plan` of the seed's workloads under simulated environments
  (:data:`ENVS`), one row per registered recipe;
* :func:`recipe_table` -- every registered recipe with its targets, the backing paths it takes on
  those workloads, and how it is selected (``Recipe.default``, ``lossless``, ``keyword``).

``python benchmarks/tables.py`` writes them between ``<!-- tables:NAME:begin -->`` markers together
with the benchmark figures; ``--check`` (and ``tests/core/test_tables.py``) fails when a document differs.
A recipe registered later (by a new module in ``mpsboost/recipes/``) gets its rows on the next run.

The workloads (:data:`SAMPLES`) are tiny configs of the real classes built on the meta device: no
weights, no memory, about three seconds for every recipe in every environment. A decision never
depends on the width of a layer except where a recipe measured a threshold (its reason says so).
This module imports diffusers and transformers only when a table is computed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Mapping, Sequence

from .gate import Env
from .registry import Recipe, all_recipes
from .report import NOT_APPLICABLE, SKIPPED, WOULD_APPLY

__all__ = [
    "Sample",
    "SAMPLES",
    "Column",
    "ENVS",
    "README_ENVS",
    "Cell",
    "decide",
    "support_table",
    "support_details",
    "recipe_table",
    "samples_line",
    "headline",
    "build_samples",
    "options_table",
    "gate_table",
    "selection",
    "blocks",
    "APPLIES",
    "OPT_IN",
    "STEPS_ASIDE",
    "NO_TARGET",
]


# ------------------------------------------------------------------------------------ the workloads


@dataclass(frozen=True)
class Sample:
    """One workload of the tables: a label for people and the row of the tiny-model zoo
    (:data:`mpsboost.bench.models.MODELS`) that builds it, in bfloat16."""

    key: str
    label: str
    model: str

    def build(self) -> Any:
        import torch

        from .bench.models import build

        return build(self.model).to(torch.bfloat16)


#: The seed's workloads, and one other video VAE (``video_vae_pad``'s targets). Labels name the
#: published model; the classes are the real ones at toy width (rows of the zoo: its ``:tiny`` rows where one serves).
SAMPLES: tuple[Sample, ...] = (
    Sample("qwen3_6", "Qwen3.6-35B-A3B text model (`Qwen3_5MoeForCausalLM`)", "qwen3_5_moe:docs"),
    Sample("wan2_2_vae", "Wan2.2 VAE (`AutoencoderKLWan`)", "wan22_vae:tiny"),
    Sample("wan2_2_dit", "Wan2.2 transformer (`WanTransformer3DModel`)", "wan22_transformer:tiny"),
    Sample("qwen_image_vae", "Qwen-Image VAE (`AutoencoderKLQwenImage`)", "qwen_image_vae:tiny"),
    Sample("qwen_image_2_1_vae", "Qwen-Image-2.1 VAE (`AutoencoderKLQwenImage21`)", "qwen_image21_vae:docs"),
    Sample("hunyuanvideo_vae", "HunyuanVideo VAE (`AutoencoderKLHunyuanVideo`)", "hunyuan_video_vae:tiny"),
)


def build_samples(samples: Sequence[Sample] = SAMPLES) -> dict[str, Any]:
    """{key: model} of ``samples``, built on the meta device (no weights are allocated)."""
    import torch
    from diffusers.utils import logging as diffusers_logging

    # diffusers logs a warning for every model cast with .to(dtype) (it prefers from_pretrained(dtype=...),
    # which keeps some modules in float32); these models are never run, so it is noise here.
    verbosity = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()
    try:
        with torch.device("meta"):
            return {s.key: s.build() for s in samples}
    finally:
        diffusers_logging.set_verbosity(verbosity)


# ------------------------------------------------------------------------------------ environments


@dataclass(frozen=True)
class Column:
    """One environment of the tables: its heading, the simulated :class:`~mpsboost.gate.Env`, and its
    heading in the README's narrower table ("" where the README leaves it out)."""

    heading: str
    device: str
    torch_version: str
    short: str = ""

    @property
    def key(self) -> tuple[str, str]:
        return (self.device, self.torch_version)

    def env(self) -> Env:
        return Env.simulate(self.device, self.torch_version)


#: Every environment of ``docs/support.md``. The versions are fixed (not the installed torch), so the
#: tables are the same on every machine that generates them. ``short``: a column of the README too.
ENVS: tuple[Column, ...] = (
    Column("MPS, torch 2.13.0", "mps", "2.13.0"),
    Column("MPS, torch 2.14.1", "mps", "2.14.1", "MPS, torch 2.14.x"),
    Column("MPS, torch 2.15.0", "mps", "2.15.0", "MPS, torch 2.15.0"),
    Column("MPS, torch 2.16 nightly (2.16.0.dev20261201)", "mps", "2.16.0.dev20261201", "MPS, 2.16 nightly"),
    Column("CUDA sm_90, torch 2.15.0", "cuda:9.0", "2.15.0"),
    Column("CPU, torch 2.15.0", "cpu", "2.15.0", "CPU"),
)

#: The columns of the README's table: the Mac builds a user has today, and the CPU.
README_ENVS: tuple[Column, ...] = tuple(c for c in ENVS if c.short)


# ------------------------------------------------------------------------------------ decisions

APPLIES = "applies"
OPT_IN = "opt-in"
STEPS_ASIDE = "steps aside"
NO_TARGET = "no target"


@dataclass(frozen=True)
class Cell:
    """What one recipe does to the workloads in one environment."""

    status: str  # APPLIES, OPT_IN, STEPS_ASIDE or NO_TARGET
    backings: tuple[str, ...] = ()  # the backing paths of the targets it applies to, first seen first
    reason: str = ""  # the first target's reason (applying, or stepping aside)
    applied: int = 0
    skipped: int = 0
    workloads: tuple[str, ...] = ()  # sample keys it applies to (or, stepping aside, the ones it found)
    other_reasons: int = 0  # stepping aside: how many other reasons its other targets gave


def selection(recipe: Recipe) -> str:
    """How a user gets ``recipe``: by default, or by its keyword / by name."""
    if recipe.default and recipe.lossless:
        return "default"
    if recipe.keyword:
        return f"opt-in: `{recipe.keyword}=`"
    return f'opt-in: `recipes=["{recipe.name}"]`'


def _keyword_args(recipe: Recipe) -> dict:
    # A recipe selected by a public keyword (fp8=) gets its first accepted value; one selected by name needs none.
    if recipe.keyword is not None and recipe.keyword_values:
        return {recipe.keyword: recipe.keyword_values[0]}
    return {}


def _registry_key() -> tuple:
    return tuple((r.name, id(type(r))) for r in all_recipes())


@lru_cache(maxsize=4)
def _decisions(registry: tuple, samples: tuple[Sample, ...]) -> dict[tuple[str, tuple[str, str]], Cell]:
    del registry  # the cache key: a recipe registered or replaced since gives new tables
    from .api import plan

    models = build_samples(samples)
    out: dict[tuple[str, tuple[str, str]], Cell] = {}
    for recipe in all_recipes():
        for col in ENVS:
            report = plan(models, env=col.env(), recipes=[recipe.name], **_keyword_args(recipe))
            rows = [r for r in report.rows if r.recipe == recipe.name]
            out[(recipe.name, col.key)] = _cell(recipe, rows)
    return out


def _sample_of(target: str) -> str:
    return target.split(".", 1)[0]  # plan() prefixes every target path with its sample's key


def _cell(recipe: Recipe, rows: Sequence[Any]) -> Cell:
    applied = [r for r in rows if r.status == WOULD_APPLY]
    skipped = [r for r in rows if r.status == SKIPPED]
    if applied:
        status = APPLIES if selection(recipe) == "default" else OPT_IN
        backings = tuple(dict.fromkeys(r.backing for r in applied))
        workloads = tuple(dict.fromkeys(_sample_of(r.target) for r in applied))
        return Cell(status, backings, applied[0].reason, len(applied), len(skipped), workloads)
    if skipped:
        # The first workload's reason (the seed's LM comes first): the one a reader of the row expects.
        reasons = list(dict.fromkeys(r.reason for r in skipped))
        workloads = tuple(dict.fromkeys(_sample_of(r.target) for r in skipped))
        return Cell(STEPS_ASIDE, (), reasons[0], 0, len(skipped), workloads, len(reasons) - 1)
    assert all(r.status == NOT_APPLICABLE for r in rows), rows
    return Cell(NO_TARGET)


def decide(samples: Sequence[Sample] = SAMPLES) -> dict[tuple[str, tuple[str, str]], Cell]:
    """{(recipe name, column key): Cell} for every registered recipe in every column of :data:`ENVS`,
    computed by :func:`mpsboost.plan` (once per process and registry)."""
    return _decisions(_registry_key(), tuple(samples))


# ------------------------------------------------------------------------------------ text


def _strip_long_parens(text: str, limit: int = 40) -> str:
    """``text`` without parenthesised asides longer than ``limit`` characters (upstream lists, figures)."""
    out, stack = [], []
    for ch in text:
        if ch == "(":
            stack.append(len(out))
        out.append(ch)
        if ch == ")" and stack:
            start = stack.pop()
            if len(out) - start > limit:
                del out[start:]
    return re.sub(r"\s+([,;:])", r"\1", re.sub(r"\s{2,}", " ", "".join(out))).strip()


def _clauses(text: str) -> list[str]:
    """``text`` split at the semicolons outside parentheses and braces."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
        if ch == ";" and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur).strip())
    return [p for p in parts if p]


def headline(reason: str, limit: int = 120) -> str:
    """The first clause of a decision's reason, without long asides: a table cell's short reason.

    The whole reason stays in ``docs/support.md``; a clause that names an option to opt in is kept.
    """
    clauses = _clauses(reason)
    if not clauses:
        return ""
    keep = [clauses[0]] + [c for c in clauses[1:] if "options=" in c or c.startswith("opt in")][:1]
    text = "; ".join(_strip_long_parens(c) for c in keep)
    if len(text) > limit:
        text = text[: limit - 1].rsplit(" ", 1)[0].rstrip(",;:") + "…"
    return text


def _backing_text(backings: Sequence[str]) -> str:
    return "; ".join(dict.fromkeys(_strip_long_parens(b, limit=0) for b in backings))


def _esc(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _md(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_esc(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _short_cell(cell: Cell, recipe: Recipe) -> str:
    if cell.status == APPLIES:
        return f"**applies**: {_backing_text(cell.backings)}"
    if cell.status == OPT_IN:
        return f"opt-in: {_backing_text(cell.backings)}"
    if cell.status == STEPS_ASIDE:
        return f"steps aside: {headline(cell.reason)}"
    return "no target in these workloads"


def support_table(samples: Sequence[Sample] = SAMPLES, columns: Sequence[Column] = README_ENVS) -> str:
    """The README's "what applies on my Mac and torch": one row per recipe, one column per build."""
    cells = decide(samples)
    rows = []
    for recipe in all_recipes():
        rows.append(
            [f"`{recipe.name}`", selection(recipe)]
            + [_short_cell(cells[(recipe.name, c.key)], recipe) for c in columns]
        )
    return _md(["recipe", "selected"] + [c.short or c.heading for c in columns], rows)


def samples_line(samples: Sequence[Sample] = SAMPLES) -> str:
    return "Decided by `mpsboost.plan` for: " + "; ".join(s.label for s in samples) + "."


def support_details(samples: Sequence[Sample] = SAMPLES, columns: Sequence[Column] = ENVS) -> str:
    """``docs/support.md``: per recipe, per environment, the status, backing paths, the workloads it
    applies to and the whole reason the recipe gives."""
    cells = decide(samples)
    labels = {s.key: s.label for s in samples}
    out = []
    for recipe in all_recipes():
        rows = []
        for col in columns:
            cell = cells[(recipe.name, col.key)]
            where = ", ".join(labels.get(k, k) for k in cell.workloads) or "-"
            count = f"{cell.applied} applied, {cell.skipped} stepped aside" if cell.status != NO_TARGET else "-"
            reason = cell.reason or "-"
            if cell.other_reasons:
                reason += (
                    f" (and {cell.other_reasons} other reason{'s' if cell.other_reasons > 1 else ''} "
                    "on other targets: `plan()` gives each)"
                )
            rows.append([col.heading, cell.status, _backing_text(cell.backings) or "-", where, count, reason])
        out.append(
            f"#### `{recipe.name}` ({selection(recipe)})\n\n{recipe.summary}\n\n"
            + _md(
                ["environment", "status", "backing paths", "workloads", "targets", "reason (as the report gives it)"],
                rows,
            )
        )
    return "\n\n".join(out)


def _short_class(path: str) -> str:
    return path.rsplit(".", 1)[-1]


def _targets_text(recipe: Recipe, fold: int | None) -> str:
    names = list(dict.fromkeys(_short_class(t) for t in recipe.targets)) or ["(found by the recipe's own find)"]
    if fold is not None and len(names) > fold:
        names = names[:fold] + [f"and {len(names) - fold} more"]
    return ", ".join(f"`{n}`" if not n.startswith(("and ", "(")) else n for n in names)


def _properties(recipe: Recipe) -> str:
    return ", ".join(
        ("lossless" if recipe.lossless else "lossy", "reversible" if recipe.reversible else "irreversible")
    )


def recipe_table(
    samples: Sequence[Sample] = SAMPLES, columns: Sequence[Column] = ENVS, *, fold: int | None = 3, summary: bool = True
) -> str:
    """Every registered recipe: what it does, its targets, the backing paths it takes on the workloads
    in ``columns`` (all of them together), and how it is selected."""
    cells = decide(samples)
    rows = []
    for recipe in all_recipes():
        backings = [b for c in columns for b in cells[(recipe.name, c.key)].backings]
        row = (
            [f"`{recipe.name}`"]
            + ([recipe.summary] if summary else [])
            + [
                _targets_text(recipe, fold),
                _backing_text(backings) or "none on these workloads",
                f"{selection(recipe)} ({_properties(recipe)})",
            ]
        )
        rows.append(row)
    header = ["recipe"] + (["what it does"] if summary else []) + ["targets", "backing paths", "selected"]
    return _md(header, rows)


def options_table() -> str:
    """Every recipe's options (``patch(..., options={name: {...}})``), from its ``Options`` dataclass."""
    import dataclasses

    rows = []
    for recipe in all_recipes():
        opts = recipe.Options
        if opts is None or not dataclasses.is_dataclass(opts):
            rows.append([f"`{recipe.name}`", "none"])
            continue
        fields = []
        for f in dataclasses.fields(opts):
            default = f.default if f.default is not dataclasses.MISSING else "(required)"
            fields.append(f"`{f.name}` ({f.type}, default `{default!r}`)")
        rows.append([f"`{recipe.name}`", "; ".join(fields)])
    return _md(["recipe", "options"], rows)


def gate_table(device: str = "mps") -> str:
    """Every feature of the gate that ``device`` has rules for: what it is, the upstream change, the first
    release, and the table's verdict on each build of :data:`ENVS` for that device (a real device also
    runs the feature's probe, which can only say no). For MPS a column says what the released macOS
    wheels show for each rule (data/mps_wheels.json, written by tools/wheel_facts.py): the kernel, symbol
    or API and the first wheel that has it, or that the fix is behavioural (no symbol shows it)."""
    from .gate import FEATURES, check, evidence_text, feature_info, wheel_evidence

    columns = [c for c in ENVS if c.device.partition(":")[0] == device]
    rows = []
    for name, feat in FEATURES.items():
        if device not in feat.rules:
            continue
        info = feature_info(name, device)
        upstream = "; ".join(r["upstream"] for r in info["rules"] if r["upstream"]) or "-"
        first = "; ".join(dict.fromkeys(r["first_release"] for r in info["rules"]))
        marks = ["yes" if check(name, c.env()).ok else "no" for c in columns]
        row = [f"`{name}`", feat.description, upstream, first + (" (probed on the device)" if info["probe"] else "")]
        if device == "mps":
            row.append("; ".join(evidence_text(r) for r in feat.rules[device]) or "-")
        rows.append(row + marks)
    head = ["feature", "what", "upstream", "first release"] + (["macOS wheels"] if device == "mps" else [])
    table = _md(head + [c.short or c.heading for c in columns], rows)
    if device != "mps":
        return table
    wheels = wheel_evidence()["wheels"]
    files = ", ".join(f"`{w['file']}` (sha256 `{w['sha256'][:12]}`)" for w in wheels)
    macos = sorted({w["min_macos"] for w in wheels})
    return (
        table
        + "\n\nmacOS wheels read (`python tools/wheel_facts.py` regenerates `src/mpsboost/data/mps_wheels.json`): "
        + files
        + f". Their platform tags need macOS {' / '.join(macos)} or later."
    )


def gate_releases(device: str = "mps") -> str:
    """What each build of :data:`ENVS` for ``device`` adds, by the gate's own verdicts (the same ``check`` as
    :func:`gate_table`, so the list and the table cannot disagree): one bullet per build with the features
    that are "yes" there and "no" in the build before it, then the features no build of the table has."""
    from .gate import FEATURES, check, feature_info

    columns = [c for c in ENVS if c.device.partition(":")[0] == device]
    names = [n for n, f in FEATURES.items() if device in f.rules]
    ok = {n: [check(n, c.env()).ok for c in columns] for n in names}

    def item(name: str) -> str:
        ups = "; ".join(r["upstream"] for r in feature_info(name, device)["rules"] if r["upstream"])
        refs = ", ".join(dict.fromkeys(re.findall(r"(?:[\w-]+/)?[\w.-]*#\d+", ups)))
        return f"  - `{name}`: {FEATURES[name].description}" + (f" ({refs})" if refs else "")

    out = []
    for i, c in enumerate(columns):
        new = [n for n in names if ok[n][i] and (i == 0 or not ok[n][i - 1])]
        if new:
            out.append(f"- **{'in ' + c.heading + ' (the oldest build here)' if i == 0 else 'new in ' + c.heading}:**")
            out += [item(n) for n in new]
    never = [n for n in names if not any(ok[n])]
    if never:
        out.append("- **in none of these builds, the nightly included:**")
        out += [item(n) for n in never]
    return "\n".join(out)


def blocks() -> Mapping[str, Callable[..., str]]:
    """The generated blocks of this module by marker name (``benchmarks/tables.py`` adds them to its own)."""
    return {
        "support": lambda results=None: support_table() + "\n\n" + samples_line(),
        "support-details": lambda results=None: samples_line(SAMPLES) + "\n\n" + support_details(),
        "recipe-list": lambda results=None: recipe_table(columns=README_ENVS, fold=3, summary=False),
        "recipe-details": lambda results=None: recipe_table(columns=ENVS, fold=None, summary=True),
        "recipe-options": lambda results=None: options_table(),
        "gate-mps": lambda results=None: gate_table("mps"),
        "gate-mps-releases": lambda results=None: gate_releases("mps"),
    }
