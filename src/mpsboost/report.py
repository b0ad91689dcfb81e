"""PatchReport: what patch() or plan() did or would do, row by row.

One row per (recipe, module path). ``str(report)`` is for people: at most 120 characters a line, one
line per recipe and outcome with its targets counted per model and their paths folded over layer
indices (``transformer.blocks.*.attn``), reasons cut to two lines, a footnote on the notation.
``report.to_dict()`` / ``report.to_json()`` keep every row, target and reason for tools.
"""

from __future__ import annotations

import json
import re
import textwrap
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Mapping

from .gate import Env

__all__ = ["Row", "PatchReport", "APPLIED", "WOULD_APPLY", "SKIPPED", "NOT_APPLICABLE", "ALREADY_PATCHED"]

APPLIED = "applied"
WOULD_APPLY = "would apply"
SKIPPED = "skipped"
NOT_APPLICABLE = "not applicable"
ALREADY_PATCHED = "already patched"

_STATUSES = (APPLIED, WOULD_APPLY, SKIPPED, NOT_APPLICABLE, ALREADY_PATCHED)


@dataclass(frozen=True)
class Row:
    recipe: str
    target: str
    status: str
    backing: str = ""
    reason: str = ""
    details: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in _STATUSES:
            raise ValueError(f"row status {self.status!r} is not one of {_STATUSES}")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["details"] = dict(self.details)
        return d


_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)")
# Lines of a backing path or reason in str(report); the rest is in to_json().
_REASON_LINES = 2


@dataclass(frozen=True)
class PatchReport:
    """The outcome of one patch() or plan() call."""

    mode: str  # "patch" or "plan"
    env: Env
    rows: tuple[Row, ...]
    target_type: str = ""
    note: str = ""
    # The component names of a pipeline (the first part of its rows' targets); empty for a model.
    components: tuple[str, ...] = ()

    # ----------------------------------------------------------------- views
    def by_status(self, status: str) -> list[Row]:
        return [r for r in self.rows if r.status == status]

    @property
    def applied(self) -> list[Row]:
        return self.by_status(APPLIED) + self.by_status(WOULD_APPLY)

    @property
    def skipped(self) -> list[Row]:
        return self.by_status(SKIPPED)

    @property
    def noop(self) -> bool:
        """True when this call changed nothing (everything already patched, skipped or not applicable)."""
        return not self.by_status(APPLIED)

    def recipes(self, status: str | None = None) -> list[str]:
        seen: dict[str, None] = {}
        for r in self.rows:
            if status is None or r.status == status:
                seen.setdefault(r.recipe)
        return list(seen)

    def rows_for(self, recipe: str) -> list[Row]:
        return [r for r in self.rows if r.recipe == recipe]

    # ----------------------------------------------------------------- output
    def to_dict(self) -> dict:
        return {
            "mode": self.mode,
            "target_type": self.target_type,
            "env": self.env.to_dict(),
            "note": self.note,
            "rows": [r.to_dict() for r in self.rows],
        }

    def to_json(self, **kw: Any) -> str:
        return json.dumps(self.to_dict(), default=str, **kw)

    def _model_of(self, target: str) -> str:
        """The model a row's target belongs to: its pipeline component, or the object itself."""
        head = target.split(".", 1)[0]
        return head if head in self.components else (self.target_type or "object")

    def _groups(self) -> list[tuple[Row, list[Row], list[str]]]:
        """Rows of one recipe with the same status, backing path and reason: (first row, rows, their
        paths with layer indices folded to ``*``, each once, in order)."""
        groups: dict[tuple, list[Row]] = {}
        for r in self.rows:
            groups.setdefault((r.recipe, r.status, r.backing, r.reason), []).append(r)
        out = []
        for rows in groups.values():
            paths = list(dict.fromkeys(_INDEX.sub("*", r.target) for r in rows))
            out.append((rows[0], rows, paths))
        return out

    def _where(self, rows: list[Row], paths: list[str]) -> str:
        """Where one group applies: targets counted per model, then the paths (folded, abridged)."""
        shown = ", ".join(paths) if len(paths) <= 3 else f"{paths[0]} ... {paths[-1]} ({len(paths)} paths)"
        per_model: dict[str, int] = {}
        for r in rows:
            m = self._model_of(r.target)
            per_model[m] = per_model.get(m, 0) + 1
        if self.components and all(p in self.components for p in paths):
            return ", ".join(paths)  # whole components, one target each
        if self.components and any(m in self.components for m in per_model):
            counts = ", ".join(f"{m} {n}" for m, n in per_model.items())
            return f"{counts}: {shown}" if len(rows) > 1 or len(paths) > 1 else shown
        return f"{len(rows)} targets: {shown}" if len(rows) > 1 else shown

    def format(self, width: int | None = 120) -> str:
        """The report as text, no line longer than ``width`` characters (None: nothing is cut).

        One line per recipe and outcome (``where``: targets counted per model, then their module paths
        with layer indices as ``*``), its backing path or reason on the next line; recipes with no target
        in the object on one line; a summary of recipes per model; a footnote on the notation.
        ``to_dict()`` / ``to_json()`` keep every row, every target and every full reason.
        """

        def clip(text: str, indent: str = "", limit: int | None = _REASON_LINES) -> list[str]:
            if width is None:
                return [indent + text]
            room = max(20, width - len(indent))
            lines = textwrap.wrap(text, room, break_long_words=True, break_on_hyphens=False) or [""]
            if limit is not None and len(lines) > limit:
                last = lines[limit - 1]
                lines = lines[: limit - 1] + [last[: room - 3].rstrip() + "..."]
            return [indent + ln for ln in lines]

        head = f"mpsboost {self.mode} for {self.target_type or 'object'}: {self.env.describe()}"
        out = clip(head)
        if not self.rows:
            return "\n".join(out + ["(no recipe selected)"])
        groups = self._groups()
        shown = [g for g in groups if g[0].status != NOT_APPLICABLE]
        w_recipe = max([len(g[0].recipe) for g in shown] + [len("recipe")])
        w_status = max([len(g[0].status) for g in shown] + [len("status")])
        lead = " " * (w_recipe + 2)
        if shown:
            out.append(f"{'recipe'.ljust(w_recipe)}  {'status'.ljust(w_status)}  where (targets)")
            for first, rows, paths in shown:
                line = f"{first.recipe.ljust(w_recipe)}  {first.status.ljust(w_status)}  {self._where(rows, paths)}"
                out += clip(line)[:1] if width is None or len(line) <= width else [line[: width - 3] + "..."]
                what = first.backing if first.status in (APPLIED, WOULD_APPLY) else first.reason
                if first.status in (APPLIED, WOULD_APPLY) and first.reason:
                    what = f"{first.backing}: {first.reason}"
                if what:
                    out += clip(what, lead)
        missing = [g[0] for g in groups if g[0].status == NOT_APPLICABLE]
        if missing:
            out += clip(
                "not applicable (no target in this object): " + ", ".join(r.recipe for r in missing), limit=None
            )
        out += clip(self._summary(), limit=None)
        if self.note:
            out += clip(self.note, limit=None)
        out += clip(
            limit=None,
            text="Notation: * stands for any layer index; 'N targets' counts the modules a line covers; 'vae 3' "
            "counts a pipeline component's; text cut at the line width ends in '...'; "
            "report.to_json() has every target and full reason, report.format(width=None) prints all.",
        )
        return "\n".join(out)

    def _summary(self) -> str:
        """Recipes per outcome (a recipe counts once, by its best outcome), then per model the recipes
        that apply there with their target counts."""
        rank = {APPLIED: 0, WOULD_APPLY: 0, ALREADY_PATCHED: 1, SKIPPED: 2, NOT_APPLICABLE: 3}
        best: dict[str, str] = {}
        for r in self.rows:
            if r.recipe not in best or rank[r.status] < rank[best[r.recipe]]:
                best[r.recipe] = r.status
        order = (APPLIED, WOULD_APPLY, ALREADY_PATCHED, SKIPPED, NOT_APPLICABLE)
        counts = [(s, sum(1 for v in best.values() if v == s)) for s in order]
        parts = [f"{n} {s}" for s, n in counts if n]
        text = f"{len(best)} recipe{'s' if len(best) != 1 else ''}: " + ", ".join(parts)
        per_model: dict[str, dict[str, int]] = {}
        for r in self.rows:
            if r.status in (APPLIED, WOULD_APPLY):
                m = per_model.setdefault(self._model_of(r.target), {})
                m[r.recipe] = m.get(r.recipe, 0) + 1
        if per_model:
            verb = "applied" if self.mode == "patch" else "would apply"
            text += f". {verb.capitalize()}: " + "; ".join(
                f"{m}: " + ", ".join(f"{rec} ({n})" for rec, n in recs.items()) for m, recs in per_model.items()
            )
        return text + "."

    def __str__(self) -> str:
        return self.format()

    __repr__ = __str__

    @staticmethod
    def from_rows(
        mode: str, env: Env, rows: Iterable[Row], target_type: str = "", note: str = "", components: Iterable[str] = ()
    ) -> "PatchReport":
        return PatchReport(
            mode=mode, env=env, rows=tuple(rows), target_type=target_type, note=note, components=tuple(components)
        )
