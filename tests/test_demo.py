"""`mpsboost demo --device cpu` runs to the end as a subprocess and prints all four record kinds."""
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
        timeout=240,
        env=env,
    )
    return proc, out


def test_demo_runs_to_the_end(demo_run):
    proc, _ = demo_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "demo finished in" in proc.stdout


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


def test_missing_library_message():
    from mpsboost.demo import _need

    with pytest.raises(SystemExit, match=r"pip install 'mpsboost\[diffusers\]'"):
        _need("mpsboost_no_such_package", "diffusers")
