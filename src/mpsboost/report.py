"""PatchReport: what patch() or plan() did or would do, row by row.

One row per (recipe, module path). ``str(report)`` folds rows that differ only in a layer index
(``transformer.blocks.*.attn``, with a count) so that a 48-layer model reads at a glance;
``report.to_dict()`` / ``report.to_json()`` keep every row for tools.
"""
from __future__ import annotations

import json
import re
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


@dataclass(frozen=True)
class PatchReport:
    """The outcome of one patch() or plan() call."""

    mode: str  # "patch" or "plan"
    env: Env
    rows: tuple[Row, ...]
    target_type: str = ""
    note: str = ""

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

    def folded(self) -> list[tuple[Row, int]]:
        """Rows with layer indices folded to ``*``: (representative row, count).

        Then rows of one recipe with the same status, path and reason fold into one line whose target
        lists them (``a, b, c`` or ``a ... z (N targets)``): a 36-layer model's report fits a screen and
        a reason repeated on every row is printed once.
        """
        groups: dict[tuple, list[Row]] = {}
        for r in self.rows:
            key = (r.recipe, _INDEX.sub("*", r.target), r.status, r.backing, r.reason)
            groups.setdefault(key, []).append(r)
        by_reason: dict[tuple, list[tuple[str, list[Row]]]] = {}
        for (recipe, target, status, backing, reason), rows in groups.items():
            by_reason.setdefault((recipe, status, backing, reason), []).append((target, rows))
        out = []
        for (recipe, status, backing, reason), parts in by_reason.items():
            rows = [r for _, rs in parts for r in rs]
            if len(parts) == 1:
                target = parts[0][0]
            else:
                names = [t for t, _ in parts]
                target = ", ".join(names) if len(names) <= 3 else f"{names[0]} ... {names[-1]} ({len(names)} targets)"
            rep = rows[0] if len(rows) == 1 else Row(recipe, target, status, backing, reason, rows[0].details)
            out.append((rep, len(rows)))
        return out

    def __str__(self) -> str:
        head = f"mpsboost {self.mode} for {self.target_type or 'object'}: {self.env.describe()}"
        if not self.rows:
            return head + "\n(no recipe selected)"
        table = [("recipe", "target", "status", "path / reason")]
        for row, n in self.folded():
            target = row.target + (f" (x{n})" if n > 1 else "")
            what = row.backing if row.status in (APPLIED, WOULD_APPLY) else row.reason
            if row.status in (APPLIED, WOULD_APPLY) and row.reason:
                what = f"{row.backing}: {row.reason}"
            table.append((row.recipe, target, row.status, what))
        widths = [max(len(r[i]) for r in table) for i in range(3)]
        lines = [head]
        for i, r in enumerate(table):
            lines.append("  ".join(c.ljust(widths[j]) for j, c in enumerate(r[:3])) + "  " + r[3])
            if i == 0:
                lines.append("  ".join("-" * w for w in widths) + "  " + "-" * 13)
        counts = {s: len(self.by_status(s)) for s in _STATUSES if self.by_status(s)}
        lines.append(", ".join(f"{n} {s}" for s, n in counts.items()) + (f". {self.note}" if self.note else ""))
        return "\n".join(lines)

    __repr__ = __str__

    @staticmethod
    def from_rows(mode: str, env: Env, rows: Iterable[Row], target_type: str = "", note: str = "") -> "PatchReport":
        return PatchReport(mode=mode, env=env, rows=tuple(rows), target_type=target_type, note=note)
