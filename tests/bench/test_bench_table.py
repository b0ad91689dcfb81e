"""compare_table/plot: ratios to stock per workload, mismatched environments refused; `mpsboost bench`."""

from __future__ import annotations

import dataclasses
import json
import textwrap

import pytest
import torch

from mpsboost.bench import (
    BenchmarkNotFoundError,
    Correctness,
    EnvMismatchError,
    Memory,
    OpTime,
    Record,
    RecordEnv,
    Throughput,
    Workload,
    read_jsonl,
    write_jsonl,
)
from mpsboost.bench import cli as bench_cli
from mpsboost.bench.plot import plot
from mpsboost.bench.table import compare_table, group_records, speed_ratio

GiB = 1 << 30


@pytest.fixture(scope="module")
def env() -> RecordEnv:
    return RecordEnv.capture("cpu", torch.float32)


def _rec(env, variant, *, value=10.0, unit="frames/s", us=100.0, mem=None, corr=None, workload=None):
    return Record(
        workload=workload or Workload("vae_decode", {"frames": 81}),
        variant=variant,
        env=env,
        throughput=Throughput(value=value, unit=unit),
        op_time={"conv3d": OpTime(median_us=us, method="perf_counter")},
        correctness=corr,
        memory=mem,
    )


def _row(table: str, label: str) -> str:
    lines = [line for line in table.splitlines() if line.startswith(label)]
    assert len(lines) == 1, f"{label!r} not found once in:\n{table}"
    return lines[0]


def test_ratios_are_speedups_and_memory_fractions_of_stock(env):
    recs = [
        _rec(
            env,
            "stock",
            value=10.0,
            us=100.0,
            mem=Memory(
                tensor_allocated=8 * GiB, driver_level=270 * GiB, driver_level_source="mps_driver_allocated_memory"
            ),
        ),
        _rec(
            env,
            "mpsboost",
            value=25.0,
            us=40.0,
            mem=Memory(
                tensor_allocated=8 * GiB, driver_level=9 * GiB, driver_level_source="mps_driver_allocated_memory"
            ),
            corr=Correctness(reference="cpu-fp32", psnr_db=49.1, rel_error=2.6e-4, sqnr_db=60.2, max_abs=0.01),
        ),
        _rec(env, "peer:eager", value=5.0, us=400.0),
    ]
    table = compare_table(recs)
    assert _row(table, "metric").split() == ["metric", "stock", "mpsboost", "peer:eager"]
    thr = _row(table, "throughput")
    assert "[2.50x]" in thr and "[0.50x]" in thr
    op = _row(table, "op conv3d")
    assert "[2.50x]" in op and "[0.25x]" in op  # time 100 -> 40 us is a 2.5x speedup
    drv = _row(table, "mem driver-level peak")
    assert "270.000 GiB" in drv and "9.000 GiB [0.03x of stock]" in drv and "mps_driver_allocated_memory" in drv
    assert _row(table, "mem allocator-reserved peak").split()[-3:] == ["n/a", "n/a", "n/a"]
    psnr = _row(table, "vs cpu-fp32: PSNR dB")
    assert psnr.split()[-3:] == ["n/a", "49.1", "n/a"]


def test_time_per_call_units_are_inverted_and_unlike_units_get_no_ratio(env):
    stock = Throughput(value=2.0, unit="s/call")
    fast = Throughput(value=0.5, unit="s/call")
    assert speed_ratio(stock, fast) == pytest.approx(4.0)
    assert speed_ratio(stock, Throughput(value=3.0, unit="frames/s")) is None
    assert speed_ratio(None, fast) is None
    table = compare_table(
        [_rec(env, "stock", value=2.0, unit="s/call"), _rec(env, "mpsboost", value=12.0, unit="frames/s")]
    )
    assert "unit differs from stock's s/call: no ratio" in _row(table, "throughput")


def test_refuses_records_whose_environment_differs(env):
    for field, value in (
        ("dtype", "bfloat16"),
        ("torch_version", "2.14.1"),
        ("device_name", "Apple M3 Ultra"),
        ("compile", "default"),
    ):
        other = dataclasses.replace(env, **{field: value})
        with pytest.raises(EnvMismatchError) as info:
            compare_table([_rec(env, "stock"), _rec(other, "mpsboost")])
        assert info.value.field == field
        assert info.value.values == (getattr(env, field), value)
        assert f"environments differ in {field!r}" in str(info.value) and "'mpsboost'" in str(info.value)
    with pytest.raises(EnvMismatchError, match="libraries"):
        group_records(
            [_rec(env, "stock"), _rec(dataclasses.replace(env, libraries={"diffusers": "0.30.0"}), "mpsboost")]
        )


def test_groups_are_per_workload_and_only_compare_within_one(env):
    other_env = dataclasses.replace(env, dtype="bfloat16")
    w2 = Workload("vae_decode", {"frames": 17})
    recs = [_rec(env, "stock"), _rec(env, "mpsboost", value=20.0), _rec(other_env, "mpsboost", workload=w2, value=7.0)]
    groups = group_records(recs)
    assert [g.workload.shape for g in groups] == [{"frames": 81}, {"frames": 17}]
    table = compare_table(recs)
    assert table.count("environment:") == 2  # one per group when they differ
    assert "no 'stock' record for this workload: no ratios" in table
    assert "[2.00x]" in table  # the ratio exists only inside the first group


def test_sections_of_separate_passes_merge(env):
    timing = Record(workload=Workload("w"), variant="stock", env=env, throughput=Throughput(value=1.0, unit="tokens/s"))
    memory = Record(workload=Workload("w"), variant="stock", env=env, memory=Memory(driver_level=GiB))
    (g,) = group_records([timing, memory])
    merged = g.variants["stock"]
    assert merged.throughput.value == 1.0 and merged.memory.driver_level == GiB and not g.notes
    (g,) = group_records([timing, timing.replace(throughput=Throughput(value=2.0, unit="tokens/s"))])
    assert g.variants["stock"].throughput.value == 2.0 and "two different throughput sections" in g.notes[0]


def test_plot_writes_a_png(tmp_path, env):
    recs = [
        _rec(env, "stock", mem=Memory(driver_level=GiB), corr=Correctness(reference="cpu-fp32", psnr_db=float("inf"))),
        _rec(
            env,
            "mpsboost",
            value=15.0,
            us=80.0,
            mem=Memory(driver_level=GiB // 2),
            corr=Correctness(reference="cpu-fp32", psnr_db=42.0),
        ),
    ]
    path = plot(recs, tmp_path / "c" / "chart.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


# ------------------------------------------------------------------------------- mpsboost bench

BENCH_SCRIPT = textwrap.dedent(
    """
    from mpsboost.bench import Record, RecordEnv, Workload, time_fn
    import torch

    CALLS = []

    def run(device, size, out):
        CALLS.append((device, size, str(out)))
        env = RecordEnv.capture(device, torch.float32)
        n = {"tiny": 8, "small": 64, "real": 512}[size]
        x = torch.randn(n, n)
        recs = []
        for variant in ("stock", "mpsboost"):
            t = time_fn(lambda: x @ x, device=device, warmup=1, repeats=3)
            recs.append(Record(workload=Workload("mm", {"n": n}), variant=variant, env=env,
                               throughput=t.throughput(), op_time={"mm": t.op_time()}))
        return recs
    """
)


@pytest.fixture
def bench_dir(tmp_path):
    d = tmp_path / "benches"
    d.mkdir()
    (d / "mmtest.py").write_text(BENCH_SCRIPT)
    (d / "_helpers.py").write_text("X = 1\n")  # private helper modules are not benchmarks
    return d


def test_bench_command_writes_records_table_and_chart(bench_dir, tmp_path, capsys):
    out = tmp_path / "out"
    rc = bench_cli.main(
        ["mmtest", "--benchmarks-dir", str(bench_dir), "--device", "cpu", "--size", "tiny", "--out", str(out)]
    )
    assert rc == 0
    recs = read_jsonl(out / "mmtest.jsonl")
    assert [r.variant for r in recs] == ["stock", "mpsboost"] and recs[0].workload.shape == {"n": 8}
    printed = capsys.readouterr().out
    assert "== mm (n=8)" in printed and (out / "mmtest.txt").read_text() in printed
    assert (out / "mmtest.png").read_bytes()[:4] == b"\x89PNG"
    # --table reprints from the JSONL without running anything
    assert bench_cli.main(["--table", str(out / "mmtest.jsonl"), "--no-plot"]) == 0
    assert "== mm (n=8)" in capsys.readouterr().out


def test_unknown_benchmark_lists_what_exists(bench_dir, capsys):
    rc = bench_cli.main(["nosuch", "--benchmarks-dir", str(bench_dir), "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 2 and "no benchmark named 'nosuch'" in err and "mmtest" in err and "_helpers" not in err
    with pytest.raises(BenchmarkNotFoundError, match="not a benchmark name"):
        bench_cli.find_benchmark("../etc/passwd", bench_dir)


def test_search_order_explicit_then_env_then_cwd(bench_dir, tmp_path, monkeypatch):
    env_dir = tmp_path / "from_env"
    env_dir.mkdir()
    (env_dir / "mmtest.py").write_text(BENCH_SCRIPT)
    (env_dir / "only_env.py").write_text(BENCH_SCRIPT)
    cwd = tmp_path / "cwd"
    (cwd / "benchmarks").mkdir(parents=True)
    (cwd / "benchmarks" / "only_cwd.py").write_text(BENCH_SCRIPT)
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("MPSBOOST_BENCHMARKS", str(env_dir))
    assert bench_cli.find_benchmark("mmtest", bench_dir) == (bench_dir / "mmtest.py").resolve()
    assert bench_cli.find_benchmark("mmtest") == (env_dir / "mmtest.py").resolve()
    assert bench_cli.find_benchmark("only_cwd") == (cwd / "benchmarks" / "only_cwd.py").resolve()
    dirs = bench_cli.benchmark_dirs(bench_dir)
    assert dirs[:3] == [bench_dir.resolve(), env_dir.resolve(), (cwd / "benchmarks").resolve()]


def test_bad_run_results_and_devices_are_refused(bench_dir, tmp_path, monkeypatch):
    from mpsboost.bench import BenchError

    with pytest.raises(BenchError, match="must return a list of Record"):
        bench_cli.run_benchmark("x", lambda d, s, o: None, device="cpu", size="tiny", out=tmp_path)
    with pytest.raises(BenchError, match="non-Record items \\(dict\\)"):
        bench_cli.run_benchmark("x", lambda d, s, o: [{}], device="cpu", size="tiny", out=tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(BenchError, match="sees no CUDA device"):
        bench_cli.run_benchmark("x", lambda d, s, o: [], device="cuda", size="tiny", out=tmp_path)


def test_script_main_matches_the_command(bench_dir, tmp_path):
    module = bench_cli.load_benchmark(bench_dir / "mmtest.py")
    out = tmp_path / "direct"
    assert (
        bench_cli.script_main(
            str(bench_dir / "mmtest.py"),
            module.run,
            ["--device", "cpu", "--size", "tiny", "--out", str(out), "--no-plot"],
        )
        == 0
    )
    assert module.CALLS[-1] == ("cpu", "tiny", str(out))
    lines = (out / "mmtest.jsonl").read_text().splitlines()
    assert [json.loads(line)["variant"] for line in lines] == ["stock", "mpsboost"]
    assert not (out / "mmtest.png").exists()


def test_records_written_by_write_jsonl_compare_after_reading(tmp_path, env):
    path = write_jsonl(tmp_path / "r.jsonl", [_rec(env, "stock"), _rec(env, "mpsboost", value=30.0)])
    assert "[3.00x]" in compare_table(read_jsonl(path))


def test_many_workloads_get_the_compact_chart(tmp_path, env):
    from mpsboost.bench import plot as compare_mod

    recs = []
    for n in range(compare_mod.MAX_DETAILED_GROUPS + 4):
        w = Workload("linear", {"n": n})
        recs += [_rec(env, "stock", workload=w), _rec(env, "mpsboost", workload=w, us=50.0)]
    path = plot(recs, tmp_path / "many.png")
    import struct

    data = path.read_bytes()
    width, height = struct.unpack(">II", data[16:24])  # PNG IHDR
    assert data[:4] == b"\x89PNG" and height <= 1300  # one row of three panels, not one row per workload
