"""Records: JSONL round trip, schema checks, environment capture; timing results and their sections."""

from __future__ import annotations

import json
import math

import pytest
import torch

from mpsboost.bench import (
    SCHEMA_VERSION,
    Correctness,
    CudaGraphCaptureError,
    Memory,
    OpTime,
    Record,
    RecordEnv,
    RecordError,
    Throughput,
    TimingError,
    Workload,
    append_jsonl,
    read_jsonl,
    time_fn,
    write_jsonl,
)


@pytest.fixture(scope="module")
def env() -> RecordEnv:
    return RecordEnv.capture("cpu", torch.bfloat16, compile=False)


def _full_record(env: RecordEnv, variant: str = "stock") -> Record:
    return Record(
        workload=Workload(
            "wan22_vae_decode", {"frames": 81, "height": 480, "width": 832, "latent": (1, 48, 21, 30, 52)}
        ),
        variant=variant,
        env=env,
        throughput=Throughput(
            value=11.8,
            unit="frames/s",
            seconds_per_call=6.86,
            items_per_call=81,
            repeats=5,
            warmup=1,
            spread={"min_s": 6.8, "max_s": 7.0, "iqr_s": 0.05},
        ),
        op_time={
            "conv3d": OpTime(
                median_us=812.5,
                min_us=800.0,
                max_us=900.25,
                iqr_us=12.0,
                repeats=10,
                warmup=3,
                method="perf_counter",
                calls=1,
            )
        },
        correctness=Correctness(
            reference="cpu-fp32", psnr_db=math.inf, rel_error=0.0, sqnr_db=math.inf, max_abs=0.0, data_range=2.0
        ),
        memory=Memory(
            tensor_allocated=12 << 30,
            allocator_reserved=None,
            driver_level=270 << 30,
            driver_level_at_start=1 << 30,
            driver_level_source="mps_driver_allocated_memory",
            samples=42,
            interval_s=0.002,
        ),
        extra={"pad_calls_5d": 10995, "note": float("nan")},
    )


def test_env_capture_describes_this_process(env):
    assert env.torch_version == torch.__version__
    assert env.device_type == "cpu"
    assert env.dtype == "bfloat16"
    assert env.compile == "eager"
    assert env.torch_git == getattr(torch.version, "git_version", None)
    assert env.torch_cuda == torch.version.cuda
    assert ("debug" in env.torch_build) == bool(torch.version.debug)
    import mpsboost

    assert env.mpsboost_version == mpsboost.__version__
    assert env.python.count(".") == 2 and env.os and env.device_name
    assert RecordEnv.capture("cpu", "float32", compile="max-autotune").compile == "max-autotune"
    assert RecordEnv.capture(torch.device("cpu"), torch.float32, compile=True).compile == "default"


def test_env_capture_rejects_bad_input():
    with pytest.raises(RecordError, match="not a torch device"):
        RecordEnv.capture("gpu7", torch.float32)
    with pytest.raises(RecordError, match="compile must be"):
        RecordEnv.capture("cpu", torch.float32, compile=3)


def test_jsonl_round_trip_is_exact_and_strict_json(tmp_path, env):
    recs = [_full_record(env), _full_record(env, "mpsboost").replace(memory=None, correctness=None, op_time=None)]
    path = write_jsonl(tmp_path / "sub" / "r.jsonl", recs)
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    # Strict JSON: no NaN/Infinity literals anywhere (jq and other readers refuse them).
    for line in lines:
        data = json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
        assert data["schema"] == SCHEMA_VERSION
    back = read_jsonl(path)
    assert back == recs
    assert math.isinf(back[0].correctness.psnr_db) and back[0].correctness.psnr_db > 0
    assert back[0].memory.allocator_reserved is None  # "no such counter" survives as None
    assert back[0].workload.shape["latent"] == [1, 48, 21, 30, 52]
    assert back[0].op_time["conv3d"].median_us == 812.5


def test_append_adds_lines(tmp_path, env):
    path = tmp_path / "a.jsonl"
    append_jsonl(path, [_full_record(env)])
    append_jsonl(path, [_full_record(env, "mpsboost")])
    assert [r.variant for r in read_jsonl(path)] == ["stock", "mpsboost"]


def test_reader_refuses_newer_schema_and_unknown_fields_naming_the_line(tmp_path, env):
    good = json.loads(_full_record(env).to_json())
    newer = dict(good, schema=SCHEMA_VERSION + 1)
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(good) + "\n\n" + json.dumps(newer) + "\n")
    with pytest.raises(RecordError, match=r"bad\.jsonl:3: .*schema 2 is newer"):
        read_jsonl(path)
    odd = json.loads(json.dumps(good))
    odd["memory"]["gpu_magic"] = 1
    path.write_text(json.dumps(odd) + "\n")
    with pytest.raises(RecordError, match=r"unknown field.*gpu_magic"):
        read_jsonl(path)
    no_env = json.loads(json.dumps(good))
    del no_env["env"]["torch_version"]
    path.write_text(json.dumps(no_env) + "\n")
    with pytest.raises(RecordError, match="missing field.*torch_version"):
        read_jsonl(path)
    path.write_text("{not json\n")
    with pytest.raises(RecordError, match=r"bad\.jsonl:1: not a JSON line"):
        read_jsonl(path)


def test_record_validation_messages(env):
    with pytest.raises(RecordError, match="Record.workload: expected a Workload"):
        Record(workload="wan", variant="stock", env=env)
    with pytest.raises(RecordError, match="Record.variant"):
        Record(workload=Workload("w"), variant="", env=env)
    with pytest.raises(RecordError, match=r"op_time\['mm'\]: expected an OpTime"):
        Record(workload=Workload("w"), variant="stock", env=env, op_time={"mm": 3.0})
    with pytest.raises(RecordError, match="Memory.driver_level: expected an integer"):
        Memory(driver_level="lots")
    with pytest.raises(RecordError, match="Throughput.value"):
        Throughput(value=None, unit="tokens/s")


# -------------------------------------------------------------------------------------- timing


def test_time_fn_counts_calls_and_orders_its_statistics():
    calls = []
    t = time_fn(lambda: calls.append(1), device="cpu", warmup=2, repeats=7, calls=3)
    assert len(calls) == 2 + 7 * 3
    assert t.repeats == 7 and t.calls == 3 and t.method == "perf_counter" and len(t.samples_s) == 7
    assert t.min_s <= t.q1_s <= t.median_s <= t.q3_s <= t.max_s
    assert t.iqr_s == pytest.approx(t.q3_s - t.q1_s)


def test_time_fn_measures_wall_time_and_converts_to_sections(monkeypatch):
    # An injected clock that only the timed function moves (10 ms a call): the median is exactly that, in
    # seconds (not milliseconds), whatever the machine's load.
    import types

    from mpsboost.bench import timing

    now = [0.0]
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))

    def work():
        now[0] += 0.01

    t = time_fn(work, device="cpu", warmup=0, repeats=3)
    assert t.median_s == pytest.approx(0.01) and t.samples_s == pytest.approx([0.01] * 3)
    op = t.op_time()
    assert op.median_us == pytest.approx(t.median_s * 1e6) and op.method == "perf_counter"
    thr = t.throughput(items_per_call=8, unit="tokens/s")
    assert thr.value == pytest.approx(8 / t.median_s) and thr.higher_is_better is True
    per_call = t.throughput()
    assert (
        per_call.unit == "s/call" and per_call.value == pytest.approx(t.median_s) and per_call.higher_is_better is False
    )
    with pytest.raises(TimingError, match="needs items_per_call"):
        t.throughput(unit="tokens/s")


def test_time_fn_rejects_bad_arguments():
    with pytest.raises(TimingError, match="repeats must be an integer >= 1"):
        time_fn(lambda: None, device="cpu", repeats=0)
    with pytest.raises(TimingError, match="cuda_graph=True needs a CUDA device"):
        time_fn(lambda: None, device="cpu", cuda_graph=True)
    with pytest.raises(TimingError, match="not a torch device"):
        time_fn(lambda: None, device="tpu9")
    # 'auto' on a device without graphs times normally
    assert time_fn(lambda: None, device="cpu", repeats=2, cuda_graph="auto").method == "perf_counter"


@pytest.mark.cuda
def test_cuda_events_and_graph_replay():
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    ev = time_fn(lambda: torch.nn.functional.linear(x, a), device="cuda", repeats=20)
    gr = time_fn(lambda: torch.nn.functional.linear(x, a), device="cuda", repeats=20, cuda_graph=True, calls=10)
    assert ev.method == "cuda_events" and gr.method == "cuda_graph" and gr.calls == 10
    # Both are seconds per call of the same kernel: within a factor of 100 of each other (graph replay saves
    # the launch overhead, a few microseconds a call; a unit error would be a factor of 1000).
    assert gr.median_s > 0 and ev.median_s > 0
    assert 1 / 100 < gr.median_s / ev.median_s < 100, (gr.median_s, ev.median_s)
    # A host sync inside cannot be captured: a clear error, or a fallback with a note on 'auto'.
    with pytest.raises(CudaGraphCaptureError, match="could not capture"):
        time_fn(lambda: (a @ a).sum().item(), device="cuda", repeats=2, cuda_graph=True)
    with pytest.warns(RuntimeWarning, match="capture failed"):
        fb = time_fn(lambda: (a @ a).sum().item(), device="cuda", repeats=2, cuda_graph="auto")
    assert fb.method == "cuda_events" and "capture failed" in fb.note


@pytest.mark.mps
def test_mps_timing_synchronises():
    a = torch.randn(1024, 1024, device="mps")
    t = time_fn(lambda: a @ a, device="mps", repeats=5)
    assert t.method == "mps_synchronize" and t.median_s > 0


# What `import mpsboost.bench` (and the demo and bench CLI) may add to what `import torch` loaded already:
# mpsboost itself, the standard library and packaging. torch imports some optional packages by itself when
# they are installed (pynvml from nvidia-ml-py, which the `bench` extra brings): those are torch's imports,
# present before mpsboost is imported, and not counted against it.
_HARNESS_IMPORT_PROBE = (
    "import sys, json, torch; before = set(sys.modules); "
    "import mpsboost.bench, mpsboost.bench.cli, mpsboost.demo; "
    "new = sorted({m.split('.')[0] for m in set(sys.modules) - before}); "
    "print(json.dumps({'third_party': [n for n in new if n not in sys.stdlib_module_names], "
    "'with_torch': sorted(m for m in ('pynvml', 'matplotlib', 'tqdm') if m in before)}))"
)


@pytest.mark.parametrize("torch_extras", ["as installed", "pynvml importable"])
def test_importing_the_harness_stays_light(torch_extras, tmp_path):
    """Importing the harness imports no heavy package (matplotlib, tqdm, pynvml, diffusers, transformers)
    of its own, whatever else is installed: with "pynvml importable" a stand-in ``pynvml`` module lies on
    the path, as after `pip install -e ".[bench]"`, and torch imports it by itself."""
    import os
    import subprocess
    import sys

    env = dict(os.environ)
    if torch_extras == "pynvml importable":
        (tmp_path / "pynvml.py").write_text("# stand-in for nvidia-ml-py\n", encoding="utf-8")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tmp_path), env.get("PYTHONPATH")) if p)
    out = subprocess.run(
        [sys.executable, "-c", _HARNESS_IMPORT_PROBE], capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0, out.stderr
    probe = json.loads(out.stdout)
    assert set(probe["third_party"]) <= {"mpsboost", "packaging"}, probe
    if torch_extras == "pynvml importable":
        assert "pynvml" in probe["with_torch"], probe  # the case this parameter is for did happen


def test_progress_bar_counts_timed_samples_only_when_enabled(monkeypatch):
    from mpsboost.bench import progressbar

    monkeypatch.setenv("MPSBOOST_PROGRESS", "1")
    with progressbar.activity("bench"):
        time_fn(lambda: None, device="cpu", warmup=2, repeats=7)
        assert progressbar._ACTIVE.n == 7  # warm-up calls are not samples
    assert progressbar._ACTIVE is None
    monkeypatch.setenv("MPSBOOST_PROGRESS", "0")
    with progressbar.activity("bench"):
        assert progressbar._ACTIVE is None
    assert list(progressbar.progress(range(3))) == [0, 1, 2]
