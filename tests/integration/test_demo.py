"""`mpsboost demo --device cpu` runs to the end as a subprocess and prints all four record kinds (slow),
its missing-extra check comes before any work, and its ratio lines carry their range and a busy warning."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mpsboost.bench import read_jsonl


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    env = dict(os.environ, MPSBOOST_PROGRESS="0")
    proc = subprocess.run(
        [sys.executable, "-m", "mpsboost.cli", "demo", "--device", "cpu", "--repeats", "2", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,  # a minute on a quiet 2-core machine; generous for a loaded one
        env=env,
    )
    return proc, out


@pytest.mark.slow  # the full demo, as a subprocess
def test_demo_runs_to_the_end(demo_run):
    proc, _ = demo_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "demo finished in" in proc.stdout


@pytest.mark.slow  # the full demo, as a subprocess
def test_demo_prints_reports_and_the_four_record_kinds(demo_run):
    proc, _ = demo_run
    text = proc.stdout
    assert text.count("mpsboost patch for") == 2  # one patch report per model
    assert "AutoencoderKLWan" in text and "Qwen3MoeForCausalLM" in text
    for workload in ("== wan22_vae_decode", "== qwen3_moe_prefill", "== qwen3_moe_decode"):
        assert workload in text
    assert text.count("metric ") == 3
    # the four kinds, each on its own rows
    assert "throughput (median, ±IQR/2)" in text
    assert "op WanCausalConv3d" in text and "op Qwen3MoeExperts" in text
    assert "vs cpu-fp32: SQNR dB" in text and "vs cpu-fp32: PSNR dB" in text
    assert "mem driver-level peak (process_rss)" in text and "mem tensor-allocated peak" in text
    assert "mpsboost vs stock" in text
    # every speed ratio again with its range over the repeats, per workload
    assert "speed ratios with their range over the repeats:" in text
    assert "what the speed rows measure:" in text and "  throughput: the whole job" in text
    for workload in ("wan22_vae_decode", "qwen3_moe_prefill", "qwen3_moe_decode"):
        assert f"  {workload}: mpsboost vs stock: throughput " in text
    assert text.count("over the repeats)") >= 6  # throughput and the operator, three workloads


@pytest.mark.slow  # the full demo, as a subprocess
def test_demo_records_hold_every_section(demo_run):
    _, out = demo_run
    recs = read_jsonl(out / "demo.jsonl")
    assert sorted((r.workload.name, r.variant) for r in recs) == sorted(
        (w, v) for w in ("wan22_vae_decode", "qwen3_moe_prefill", "qwen3_moe_decode") for v in ("stock", "mpsboost")
    )
    for r in recs:
        assert r.throughput.value > 0 and r.throughput.unit in ("frames/s", "tokens/s")
        (op,) = r.op_time.values()
        assert op.median_us > 0 and op.method == "perf_counter"
        assert r.correctness.reference == "cpu-fp32"
        # CPU fp32 against a CPU fp32 copy: stock is the same computation; patched recipes are lossless
        assert r.correctness.rel_error < 1e-4, (r.workload.name, r.variant, r.correctness)
        assert r.memory.driver_level > 0 and r.memory.allocator_reserved is None
        assert r.env.device_type == "cpu" and r.env.dtype == "float32"
    wan = [r for r in recs if r.workload.name == "wan22_vae_decode"]
    assert wan[0].workload.shape["frames"] == 5 and wan[0].workload.shape["latent"][1] == 48
    assert all(isinstance(r.extra["pad_calls_5d"], int) for r in wan)
    assert (out / "demo.png").read_bytes()[:4] == b"\x89PNG"


def test_missing_library_message_installs_this_project():
    from mpsboost.demo import _need

    with pytest.raises(SystemExit) as info:
        _need("mpsboost_no_such_package", "diffusers")
    msg = str(info.value)
    assert "needs mpsboost_no_such_package" in msg and "another project" in msg
    assert "[diffusers]'" in msg and "pip install -e '" in msg  # this checkout, editable, with the extra
    assert "pip install 'mpsboost[" not in msg  # never the index's other project


def test_missing_extras_are_found_before_any_work(monkeypatch, capsys):
    import importlib.util

    from mpsboost import demo

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real(name, *a)
    )

    def no_work(*a, **k):
        raise AssertionError("the demo started working before checking its extras")

    monkeypatch.setattr(demo, "run_demo", no_work)
    assert demo.main(["--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "needs transformers" in err and "transformers extra" in err and "diffusers" not in err.split("needs")[1][:20]


def _rec(name, variant, samples_s, op_us=None):
    """A record whose timing came from these per-call seconds (and operator microseconds)."""
    import torch

    from mpsboost.bench import Record, RecordEnv, Workload
    from mpsboost.bench.timing import _summarise

    t = _summarise(list(samples_s), calls=1, warmup=0, method="perf_counter")
    op = None
    if op_us is not None:
        o = _summarise([u * 1e-6 for u in op_us], calls=1, warmup=0, method="perf_counter")
        op = {"conv": o.op_time()}
    return Record(
        workload=Workload(name, {"n": 1}),
        variant=variant,
        env=RecordEnv.capture("cpu", torch.float32),
        throughput=t.throughput(4, "frames/s"),
        op_time=op,
    )


def test_ratio_lines_give_a_range_and_stay_quiet_on_a_quiet_machine():
    from mpsboost.demo import ratio_lines

    recs = [
        _rec("w", "stock", [2.0, 2.02, 2.04], [100, 101, 102]),
        _rec("w", "mpsboost", [1.0, 1.01, 1.02], [50, 50, 51]),
    ]
    lines = ratio_lines(recs, load_before=(0.1, 2))
    text = "\n".join(lines)
    assert "w: mpsboost vs stock: throughput 2.00x (1.96x-2.04x over the repeats)" in text
    assert "op conv 2.02x (1.96x-2.04x over the repeats)" in text
    if "load average" not in text:  # the machine running the tests may itself be busy
        assert "WARNING" not in text


def test_ratio_lines_warn_when_the_repeats_spread_too_far():
    from mpsboost.demo import BUSY_SPREAD, ratio_lines

    # stock's repeats spread 100% of its median: the ratio (here 2x) means nothing, and the text says so
    recs = [_rec("w", "stock", [1.0, 2.0, 3.0]), _rec("w", "mpsboost", [1.0, 1.0, 1.0])]
    text = "\n".join(ratio_lines(recs, load_before=(0.1, 2)))
    assert "throughput 2.00x (1.00x-3.00x over the repeats)" in text
    assert "WARNING: this machine was too busy" in text and "w throughput (repeats spread 100%)" in text
    assert BUSY_SPREAD < 1.0
    busy = "\n".join(
        ratio_lines([_rec("w", "stock", [1.0, 1.0]), _rec("w", "mpsboost", [1.0, 1.0])], load_before=(9.0, 2))
    )
    assert "WARNING" in busy and "load average 9.0 on 2 cores" in busy
    one = "\n".join(ratio_lines([_rec("w", "stock", [1.0]), _rec("w", "mpsboost", [0.5])], load_before=(0.1, 64)))
    assert "throughput 2.00x (one repeat: no spread)" in one


def test_measure_lines_explain_an_op_ratio_that_goes_the_other_way():
    from mpsboost.demo import measure_lines

    # The whole job 2x faster, its operator alone 4x slower: the text says what each measures and why.
    recs = [
        _rec("w", "stock", [2.0, 2.0, 2.0], [100, 100, 100]),
        _rec("w", "mpsboost", [1.0, 1.0, 1.0], [400, 400, 400]),
    ]
    text = "\n".join(measure_lines(recs))
    assert "throughput: the whole job" in text and "op conv: one call of that module alone" in text
    assert "w: mpsboost vs stock: op conv 0.25x but throughput 2.00x. These time different work" in text
    assert "Throughput is faster and op conv slower here" in text
    # The other way round is explained too.
    recs = [_rec("w", "stock", [1.0, 1.0], [400, 400]), _rec("w", "mpsboost", [2.0, 2.0], [100, 100])]
    text = "\n".join(measure_lines(recs))
    assert "op conv 4.00x but throughput 0.50x" in text and "Op conv is faster and throughput slower here" in text
    # Same direction: the legend only, no explanation line.
    same = measure_lines([_rec("w", "stock", [2.0, 2.0], [100, 100]), _rec("w", "mpsboost", [1.0, 1.0], [50, 50])])
    assert not any("These time different work" in line for line in same)
    assert any(line.startswith("  throughput: the whole job") for line in same)


def test_each_variant_times_its_operator_on_its_own_inputs(monkeypatch):
    """The patched job's operator is timed on the inputs the patched job hands it (captured in its own
    run), never on stock's captured inputs (which may differ in layout from what the patched job uses)."""
    import torch

    from mpsboost import demo

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    job = demo._Job(
        name="w",
        shape={},
        run=lambda: model(torch.ones(1, 4)),
        items=1,
        unit="frames/s",
        op_name="Linear",
        op_class="Linear",
        psnr=False,
        data_range=None,
        root=model,
    )
    monkeypatch.setattr(demo, "_wan_vae", lambda device, dtype: (model, [job], lambda: job.run()))
    seen = []

    class _Rec:
        extra: dict = {}

        def replace(self, **kw):
            return self

    def fake_measure(j, variant, env, device, *, op, **kw):
        seen.append((variant, op))
        return _Rec(), torch.zeros(1)

    monkeypatch.setattr(demo, "_measure", fake_measure)
    demo.run_demo("cpu", torch.float32, repeats=1, models=("wan_vae",))
    (v1, op1), (v2, op2) = seen
    assert (v1, v2) == ("stock", "mpsboost")
    assert op1 is not op2 and op2.module is None  # the patched run captures its own call
