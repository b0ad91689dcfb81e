"""A progress bar for long benchmark runs: tqdm where installed and wanted, silent otherwise.

Set ``MPSBOOST_PROGRESS=0`` to silence it (CI logs), ``=1`` to force it on a non-terminal.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Iterable, Iterator, TypeVar

__all__ = ["progress", "enabled"]

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
