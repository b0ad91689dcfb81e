"""Shared by the diagnostic scripts (fp8_gemv.py, profile_decode.py): they write plain JSON lines, one
dict per line, which benchmarks/tables.py renders in blocks of their own (they are not mpsboost records)."""

from __future__ import annotations

import json
from pathlib import Path


def append_jsonl(out: str | Path | None, name: str, rows: list[dict]) -> Path | None:
    """Append ``rows`` to ``OUT/name`` (the folder is created); nothing when ``out`` is None."""
    if not out:
        return None
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    with open(path, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path
