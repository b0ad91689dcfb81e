"""The cookbook scripts (recipes/*.py) run in this process as ``python recipes/SCRIPT.py ARGS`` would run them: a
fresh interpreter per script costs more than the script (one subprocess test, in tests/integration/test_examples.py,
runs one as a user does; tests/core/test_cli.py's fresh interpreters check that ``--help`` imports no torch)."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"


def run_script(monkeypatch, capsys, script: str, *args: str) -> tuple[int, str, dict, str]:
    """``python recipes/SCRIPT.py ARGS`` here: (exit status, stdout, the script's globals, stderr). An exception other
    than SystemExit propagates (what a user's run would print as its traceback)."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts recipes/ first; undone after the test
    monkeypatch.setattr(sys, "argv", [str(RECIPES / f"{script}.py"), *args])
    monkeypatch.delitem(sys.modules, "_common", raising=False)
    capsys.readouterr()
    names: dict = {}
    try:
        names = runpy.run_path(str(RECIPES / f"{script}.py"), run_name="__main__")
        rc = 0
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else 1
    finally:
        sys.modules.pop("_common", None)
    out, err = capsys.readouterr()
    return rc, out, names, err
