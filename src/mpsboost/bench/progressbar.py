"""A progress bar for long benchmark runs: tqdm where installed and wanted, silent otherwise.

Set ``MPSBOOST_PROGRESS=0`` to silence it (CI logs), ``=1`` to force it on a non-terminal.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Iterable, Iterator, TypeVar

__all__ = ["progress", "enabled", "activity", "tick"]

T = TypeVar("T")


def enabled() -> bool:
    flag = os.environ.get("MPSBOOST_PROGRESS")
    if flag is not None:
        return flag.strip().lower() not in ("0", "false", "no", "off", "")
    return sys.stderr.isatty()


def progress(iterable: Iterable[T], *, desc: str | None = None, total: int | None = None, **kw: Any) -> Iterator[T]:
    """Iterate over ``iterable`` with a tqdm bar on stderr when enabled and tqdm is importable."""
    if enabled():
        try:
            from tqdm.auto import tqdm  # optional extra `bench`, imported only here
        except ImportError:
            return iter(iterable)
        return iter(tqdm(iterable, desc=desc, total=total, file=sys.stderr, leave=False, **kw))
    return iter(iterable)


# A bar shown while a whole benchmark runs (mpsboost bench): it counts timed samples, so a long
# run shows it is moving. time_fn ticks it outside its timed regions only.
_ACTIVE: Any = None


@contextlib.contextmanager
def activity(desc: str) -> Iterator[None]:
    """Show a bar counting timed samples (``tick``) during the block, when enabled."""
    global _ACTIVE
    bar = None
    if enabled() and _ACTIVE is None:
        try:
            from tqdm.auto import tqdm
        except ImportError:
            bar = None
        else:
            bar = tqdm(desc=desc, unit=" samples", file=sys.stderr, leave=False)
    _ACTIVE = bar if bar is not None else _ACTIVE
    try:
        yield
    finally:
        if bar is not None:
            bar.close()
            _ACTIVE = None


def tick(n: int = 1) -> None:
    """Advance the active bar by ``n`` timed samples (no-op without one)."""
    if _ACTIVE is not None:
        _ACTIVE.update(n)
