"""docs/low-bit.md's budget table is the one benchmarks/low_bit_budget.py computes; the cookbook script answers
--help without importing torch and runs its offline mode end to end."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_budget_table_is_computed(capsys):
    # The script's own main() in this process (what `python benchmarks/low_bit_budget.py --check` runs; no import
    # property is tested here, so no fresh interpreter).
    import runpy

    script = runpy.run_path(str(ROOT / "benchmarks/low_bit_budget.py"), run_name="low_bit_budget")
    assert script["main"](["--check"]) == 0, capsys.readouterr().err


def test_cookbook_help_imports_no_torch():
    code = (
        "import runpy, sys; sys.argv = ['qwen36_4bit.py', '--help']\n"
        "try:\n    runpy.run_path(sys.argv[0] if False else %r, run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        "print('torch' in sys.modules)\n"
    ) % str(ROOT / "recipes/qwen36_4bit.py")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "--random-weights" in out.stdout and out.stdout.strip().endswith("False")


@pytest.mark.slow
def test_cookbook_random_weights_runs(tmp_path, monkeypatch, capsys):
    from cookbook import run_script

    args = ("--random-weights", "tiny", "--write", str(tmp_path), "--new-tokens", "4", "--device", "cpu")
    rc, out, _, err = run_script(monkeypatch, capsys, "qwen36_4bit", *args)
    assert rc == 0, err[-2000:]
    assert "low_bit_weights" in out and "tokens:" in out
    assert (tmp_path / "config.json").is_file() and (tmp_path / "model.safetensors").is_file()
