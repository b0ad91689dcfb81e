"""Measured tuning data with its provenance, apart from the code that reads it.

Each file ``mpsboost/data/tuning/<name>.json`` holds one measurement: where it was taken (device name,
device type, compute capability), with which torch build, when, from which committed records
(``source``, a path under ``benchmarks/results/``), by which ``command``, with what ``spread``, and its
``entries`` (the table itself; its shape belongs to the reader). Decisions read these files at patch
time, never inside a traced forward, and say which file they used.

A table measured on one machine speaks for that machine only: :func:`for_env` gives it to an
environment of the same device type and compute capability, and ``None`` with the reason to any other,
which then takes the conservative choice (usually: the stock op).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from .gate import Env

__all__ = ["Tuning", "load", "names", "for_env", "TuningError"]

_REQUIRED = ("name", "device", "device_type", "torch", "date", "source", "command", "spread", "entries")


class TuningError(ValueError):
    """A tuning file is missing or malformed (a packaging or editing mistake, never user input)."""


@dataclass(frozen=True)
class Tuning:
    name: str
    device: str
    device_type: str
    torch: str
    date: str
    source: str
    command: str
    spread: Any
    entries: Any
    capability: tuple[int, int] | None = None
    notes: str = ""
    extra: dict = field(default_factory=dict)

    def describe(self) -> str:
        """One line for a report reason: where, with what, when, from which records."""
        cap = f" (sm_{self.capability[0]}{self.capability[1]})" if self.capability else ""
        return f"measured on {self.device}{cap}, torch {self.torch}, {self.date} ({self.source})"

    def applies_to(self, env: Env) -> bool:
        if env.device_type != self.device_type:
            return False
        return self.capability is None or env.capability == self.capability


def names() -> list[str]:
    """Every tuning file shipped with this mpsboost."""
    root = resources.files("mpsboost") / "data" / "tuning"
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".json"))


@functools.lru_cache(maxsize=None)
def load(name: str) -> Tuning:
    """The tuning file ``name`` (read once per process; patch time only)."""
    path = resources.files("mpsboost") / "data" / "tuning" / f"{name}.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise TuningError(f"no tuning file {name!r}; shipped: {', '.join(names()) or 'none'}") from None
    except json.JSONDecodeError as exc:
        raise TuningError(f"tuning file {name}.json is not valid JSON: {exc}") from None
    missing = [k for k in _REQUIRED if k not in raw]
    if missing:
        raise TuningError(f"tuning file {name}.json lacks {', '.join(missing)}")
    cap = raw.get("capability")
    known = set(_REQUIRED) | {"capability", "notes"}
    return Tuning(
        **{k: raw[k] for k in _REQUIRED},
        capability=tuple(cap) if cap else None,
        notes=raw.get("notes", ""),
        extra={k: v for k, v in raw.items() if k not in known},
    )


def for_env(name: str, env: Env) -> tuple[Tuning | None, str]:
    """(the tuning, "") where it was measured on this kind of device, else (None, why not)."""
    t = load(name)
    if t.applies_to(env):
        return t, ""
    here = env.device_type
    if env.device_type == "cuda":
        here = f"sm_{env.capability[0]}{env.capability[1]}" if env.capability else "an unknown CUDA GPU"
    return None, f"{name} was {t.describe()}; this is {here}, so the conservative choice is kept"
