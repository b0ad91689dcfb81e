"""The recipe scripts (recipes/*.py, the cookbook) in their tiny offline mode, as a user runs them: in this process
(tests/cookbook.py), and one in a fresh interpreter.

Each script builds its real architecture from the shipped tiny config with random weights, runs the
job stock and patched, prints the patch report and the records, and writes them as JSON Lines; the
records must carry all four sections (throughput, operator time, correctness, memory) and the
correctness of the lossless recipes must be at rounding level.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from mpsboost.bench import read_jsonl

from cookbook import RECIPES, ROOT, run_script

SCRIPTS = {
    "wan22_video": ["wan22_video"],
    "qwen_image": ["qwen_image_vae_roundtrip", "qwen_image_generate"],
    "qwen3_moe_chat": ["qwen3_moe_chat"],
    "fp8_any": ["fp8_any"],
    "fp8_checkpoint": ["fp8_checkpoint"],
    "qwen36_fp8": ["qwen36_fp8"],
}
#: Scripts that do not write the four records (they load a checkpoint format rather than time a job), tested by
#: their own group: the test module that runs them end to end.
TESTED_ELSEWHERE = {"qwen36_4bit": "tests/quant/test_low_bit_docs.py"}


# Timeouts catch a hung script, nothing else, so they are far above any run time seen. A script's wall time
# grows with the machine's load, not with its own work: wan22_video took 16.6 s of CPU and 88.6 s of wall
# time on a 2-core machine at load average 14, so the former 120 s timeout (and 60 s for the scripts that
# stop at argument checks: 2.8 s of CPU, 22.6 s of wall there) could expire on a loaded machine while the
# same run passed on a quiet one.
TIMEOUT = 900


class _LogRecords(logging.Handler):
    """The messages of the records that reach the logger it is added to (past the logger's own filters)."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _run(script: str, *args: str, timeout: int = TIMEOUT) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    return subprocess.run(
        [sys.executable, str(RECIPES / f"{script}.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


def test_every_cookbook_script_is_tested():
    scripts = {p.stem for p in RECIPES.glob("*.py") if not p.name.startswith("_")}
    assert scripts == set(SCRIPTS) | set(TESTED_ELSEWHERE)
    for script, module in TESTED_ELSEWHERE.items():  # that module runs the script, --help and its offline mode
        text = (ROOT / module).read_text()
        assert f"recipes/{script}.py" in text and "--random-weights" in text and "--help" in text, (script, module)


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_script_runs_offline_and_writes_the_four_records(script, tmp_path, monkeypatch, capsys):
    # In this process (a fresh interpreter per script cost more than the script: the subprocess test is
    # test_fp8_any_saves_where_asked_and_reloads_other_architectures). diffusers' empty-list notice is looked for
    # where the script's filter acts: on the records of its logger.
    seen = _LogRecords()
    logger = logging.getLogger("diffusers.models.modeling_utils")
    logger.addHandler(seen)
    try:
        rc, out, _, err = run_script(
            monkeypatch,
            capsys,
            script,
            "--random-weights",
            "tiny",
            "--device",
            "cpu",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--out",
            str(tmp_path),
            "--plan",
            "mps:2.14.1",
        )
    finally:
        logger.removeHandler(seen)
    assert rc == 0, out[-3000:] + err[-3000:]
    assert "mpsboost plan for" in out and "torch 2.14.1 on mps" in out  # --plan: the simulated dry run
    assert "mpsboost patch for" in out  # the patch report of this machine
    assert "speed ratios with their range over the repeats:" in out and "(one repeat: no spread)" in out
    noise = "should be kept in float32: []"  # diffusers' empty-list notice
    assert noise not in out + err and not any(noise in m for m in seen.messages), seen.messages
    records = read_jsonl(tmp_path / f"{script}.jsonl")
    by_workload: dict = {}
    for r in records:
        by_workload.setdefault(r.workload.name, {})[r.variant] = r
    assert set(by_workload) == set(SCRIPTS[script])
    for name, variants in by_workload.items():
        assert "stock" in variants and len(variants) == 2, variants.keys()
        patched = next(v for k, v in variants.items() if k != "stock")
        for r in variants.values():
            assert r.throughput is not None and r.throughput.value > 0
            assert r.memory is not None and r.memory.driver_level is not None
            assert r.env.device_type == "cpu"
            assert "random" in str(r.workload.shape.get("weights", r.workload.shape.get("model")))
        assert patched.correctness is not None
        if name != "qwen_image_generate":
            assert patched.op_time, f"{name}: no operator time"
        tol = 0.1 if script == "fp8_any" else 1e-4  # fp8 storage is lossy; the rest is lossless
        assert patched.correctness.rel_error <= tol, (name, patched.correctness)
    if script == "fp8_any":
        assert "reloaded output identical to the converted model: True" in out
        assert "fp8 file: a temporary file, deleted now (--save FILE keeps it)" in out
        assert patched.extra["weight_bytes_fp8"] < patched.extra["weight_bytes_stock"]


def test_fp8_any_saves_where_asked_and_reloads_other_architectures(tmp_path):
    """As a user runs a script: a fresh interpreter (the one subprocess test of the cookbook)."""
    target = tmp_path / "wan.fp8.safetensors"
    proc = _run(
        "fp8_any",
        "--random-weights",
        "tiny",
        "--arch",
        "wan_transformer",
        "--granularity",
        "tensorwise",
        "--repeats",
        "1",
        "--warmup",
        "0",
        "--save",
        str(target),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert target.is_file() and target.stat().st_size > 0
    assert f"fp8 file: {target} (" in proc.stdout
    assert "reloaded output identical to the converted model: True" in proc.stdout


def test_missing_local_model_fails_with_a_clear_message(tmp_path, monkeypatch, capsys):
    # In this process (the scripts' runs as a user runs them are the subprocess tests above): the error a
    # missing folder raises out of the script, the last line of the traceback a user would see.
    missing = tmp_path / "no-such-model"
    try:
        args = ("--model", str(missing), "--device", "cpu")
        rc, _, _, message = run_script(monkeypatch, capsys, "qwen3_moe_chat", *args)
    except Exception as exc:  # an uncaught error: a user's run exits 1 with this as its traceback's last line
        rc, message = 1, f"{type(exc).__name__}: {exc}"
    assert rc != 0
    assert str(missing) in message or "no-such-model" in message


def test_model_and_random_weights_exclude_each_other(monkeypatch, capsys):
    rc, _, _, err = run_script(monkeypatch, capsys, "wan22_video", "--model", "x", "--random-weights", "tiny")
    assert rc == 2 and "not allowed with argument" in err


#: Each script's recipe-level benchmark (`mpsboost bench NAME`, run by its --bench).
BENCHMARKS = {
    "wan22_video": "wan_vae_pad",
    "qwen_image": "qwen_image_vae",
    "qwen3_moe_chat": "moe_experts",
    "fp8_any": "fp8_weights",
    "fp8_checkpoint": "fp8_load",
    "qwen36_fp8": "fp8_load",
}


def test_the_recipe_scripts_live_in_the_top_level_recipes_folder():
    """The design's layout: src/mpsboost/, recipes/, tests/, benchmarks/ at the top level; the recipe
    scripts in recipes/ (examples/ is gone)."""
    assert RECIPES == ROOT / "recipes" and RECIPES.is_dir() and (RECIPES / "README.md").is_file()
    assert not (ROOT / "examples").exists()
    assert set(BENCHMARKS) == set(SCRIPTS)


def _in_process(monkeypatch, capsys, script: str, *args: str) -> tuple[int, str, dict]:
    """``python recipes/SCRIPT.py ARGS`` in this process (its --help needs no fresh interpreter; that it imports
    no torch is tests/core/test_cli.py's fresh-interpreter check): (exit status, stdout, its globals)."""
    return run_script(monkeypatch, capsys, script, *args)[:3]


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_every_script_has_help_random_weights_and_its_benchmark(script, monkeypatch, capsys):
    from mpsboost.bench.cli import catalogue

    rc, out, _ = _in_process(monkeypatch, capsys, script, "--help")
    assert rc == 0, out[-2000:]
    text = " ".join(out.split())
    assert "--random-weights" in text and "--bench" in text
    name = BENCHMARKS[script]
    assert f"'mpsboost bench {name}'" in text, text
    assert name in {n for n, _, path in catalogue(None) if path is not None}  # a benchmark of this checkout


def test_fp8_checkpoint_offers_every_published_format(monkeypatch):
    """recipes/fp8_checkpoint.py names the formats itself (its --help answers before torch loads): the same as
    the writers of mpsboost.bench.published."""
    import runpy

    from mpsboost.bench.published import FORMATS

    monkeypatch.setattr(sys, "path", list(sys.path))
    names = runpy.run_path(str(RECIPES / "fp8_checkpoint.py"), run_name="fp8_checkpoint_module")
    sys.modules.pop("_common", None)
    assert names["FORMATS"] == FORMATS


@pytest.mark.slow
def test_bench_runs_the_recipe_level_benchmark_after_the_job(tmp_path, monkeypatch, capsys):
    args = ("--random-weights", "tiny", "--device", "cpu", "--repeats", "1", "--warmup", "0", "--out", str(tmp_path))
    rc, out, _, err = run_script(monkeypatch, capsys, "qwen3_moe_chat", *args, "--bench")
    assert rc == 0, out[-3000:] + err[-3000:]
    assert "recipe-level benchmark: mpsboost bench moe_experts --device cpu --size tiny" in out
    assert read_jsonl(tmp_path / "qwen3_moe_chat.jsonl")  # the job's own records
    bench = read_jsonl(tmp_path / "moe.jsonl")  # the benchmark's, beside them
    assert bench and {r.env.device_type for r in bench} == {"cpu"} and "mpsboost" in {r.variant for r in bench}
