"""docs/fp8-checkpoints.md's 64 GB budget of Qwen3.6-35B-A3B-FP8 is the output of benchmarks/fp8_budget.py, which
computes it from the shipped config: the page and the script agree, and the script accounts for every weight."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _script():
    spec = importlib.util.spec_from_file_location("mpsboost_fp8_budget", ROOT / "benchmarks" / "fp8_budget.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_page_holds_the_scripts_table():
    s = _script()
    assert s.doc_section() == s.table(), "run: python benchmarks/fp8_budget.py and paste it between the markers"
    assert s.main(["--check"]) == 0


def test_every_weight_is_counted_once_as_fp8_or_bf16():
    s = _script()
    b = s.budget()
    # fp8 codes are 1 byte per weight, the kept modules 2 (A_log 4: 32 values per DeltaNet layer, 2 more bytes each).
    a_log = b["n_lin"] * s._config()["linear_num_value_heads"] * 2
    assert 2 * b["fp8_codes"] + b["bf16_kept"] - a_log - b["buffers"] == b["params_bf16"]
    # The published file: about 35 GB; its bf16 model about 70 GB (GiB here).
    assert 31 < (b["fp8_codes"] + b["bf16_kept"]) / 2**30 < 34 and 64 < b["params_bf16"] / 2**30 < 65
