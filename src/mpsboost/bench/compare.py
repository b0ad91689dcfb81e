"""Side-by-side comparison of records: the text table (:mod:`.table`) and the chart (:mod:`.plot`).

Records are grouped by workload (name and shape); within a group each variant's figures carry their
ratio to the ``stock`` variant of the *same* workload, and records whose environments differ in
anything but the variant are refused with an :class:`~mpsboost.bench.errors.EnvMismatchError`.
This module keeps the names importable from one place.
"""
from __future__ import annotations

from .plot import MAX_DETAILED_GROUPS, plot
from .table import (
    BASELINE,
    NA,
    Group,
    check_comparable,
    compare_table,
    fmt_bytes,
    fmt_number,
    fmt_us,
    group_records,
    speed_ratio,
)

__all__ = [
    "Group",
    "group_records",
    "check_comparable",
    "compare_table",
    "plot",
    "speed_ratio",
    "BASELINE",
    "NA",
    "MAX_DETAILED_GROUPS",
    "fmt_number",
    "fmt_bytes",
    "fmt_us",
]
