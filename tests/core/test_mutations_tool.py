"""``tools/mutations.py``, the project's mutation list: every entry still matches the code it breaks (a stale
entry fails here, in the test suite, not only when someone runs the tool), a stale entry stops the tool loudly
before any test runs, and CI runs its quick set after the README's test command."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("mpsboost_mutations_tool", ROOT / "tools" / "mutations.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_every_entry_matches_the_tree(tool):
    assert tool.stale(tool.MUTATIONS) == []
    assert tool.main(["--check"]) == 0


def test_a_stale_entry_stops_the_tool_before_any_test_runs(tool, monkeypatch, capsys):
    moved = tool.Mutation(
        name="moved-code",
        why="an entry whose text is no longer in its file",
        edits=(tool.Edit("src/mpsboost/api.py", "text that is not in api.py\n", "pass\n"),),
        tests=("tests/core/test_api.py",),
    )
    twice = tool.Mutation(
        name="twice",
        why="an entry whose text is in its file twice",
        edits=(tool.Edit("src/mpsboost/api.py", "\n", "\n\n"),),
        tests=("tests/core/test_absent.py",),
    )
    monkeypatch.setattr(tool, "MUTATIONS", tool.MUTATIONS + (moved, twice))
    ran = []
    monkeypatch.setattr(tool, "run", lambda m, **kw: ran.append(m.name) or ("caught", ""))
    # even when only another entry is asked for: the list as a whole must match
    assert tool.main([tool.MUTATIONS[0].name]) == 1
    err = capsys.readouterr().err
    assert ran == []
    assert "STALE     moved-code: src/mpsboost/api.py: the text to replace occurs 0 times" in err
    assert "STALE     twice: src/mpsboost/api.py: the text to replace occurs" in err
    assert "twice: its test tests/core/test_absent.py does not exist" in err
    assert tool.main(["--check"]) == 1


def test_a_repeated_name_is_refused(tool):
    m = tool.MUTATIONS[0]
    assert tool.stale((m, m)) == [f"{m.name}: a second entry of this name"]


def test_the_quick_set_is_what_quick_runs(tool, monkeypatch, capsys):
    quick = [m.name for m in tool.MUTATIONS if m.quick]
    assert quick and len(quick) < len(tool.MUTATIONS)
    ran = []
    monkeypatch.setattr(tool, "run", lambda m, **kw: ran.append(m.name) or ("caught", "-"))
    assert tool.main(["--quick"]) == 0
    assert ran == quick
    assert f"{len(quick)} of {len(quick)} mutations caught" in capsys.readouterr().out


def test_a_survivor_fails_the_run(tool, monkeypatch):
    monkeypatch.setattr(tool, "run", lambda m, **kw: ("SURVIVED", "1 passed"))
    assert tool.main(["--quick"]) == 1


def test_ci_runs_the_quick_set_after_the_readme_test_command():
    lines = [ln for ln in (ROOT / ".ci" / "run").read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    tests = [i for i, ln in enumerate(lines) if "python -m pytest" in ln]
    assert len(tests) == 1 and lines[tests[0] + 1 :] == ["python tools/mutations.py --quick"]
