"""What ``mpsboost bench`` prints and draws: the busy-machine warning of the harness (every other entry point has
it), and a chart whose x labels do not overlap."""

from __future__ import annotations

import pytest
import torch

from mpsboost.bench import Correctness, OpTime, Record, RecordEnv, Throughput, Workload
from mpsboost.bench import cli as bench_cli
from mpsboost.bench import harness


@pytest.fixture(scope="module")
def env() -> RecordEnv:
    return RecordEnv.capture("cpu", torch.float32)


def _rec(env, variant, median_us, spread, ops=("conv3d",), workload="vae_decode"):
    return Record(
        workload=Workload(workload, {"frames": 9}),
        variant=variant,
        env=env,
        throughput=Throughput(value=10.0, unit="frames/s"),
        op_time={
            op: OpTime(
                median_us=median_us,
                min_us=median_us * (1 - spread),
                max_us=median_us * (1 + spread),
                repeats=5,
                method="perf_counter",
            )
            for op in ops
        },
        correctness=Correctness(reference="cpu-fp32", rel_error=1e-6, sqnr_db=120.0) if variant != "stock" else None,
    )


@pytest.mark.parametrize("spread, load, busy", [(0.02, 0.1, False), (0.5, 0.1, True), (0.02, 64.0, True)])
def test_bench_prints_each_ratio_and_warns_on_a_busy_machine(env, tmp_path, monkeypatch, spread, load, busy):
    monkeypatch.setattr(harness, "machine_load", lambda: (load, 2))
    printed: list[str] = []
    recs = [_rec(env, "stock", 100.0, spread), _rec(env, "mpsboost", 50.0, spread)]
    bench_cli.run_benchmark(
        "x", lambda d, s, o: recs, device="cpu", size="tiny", out=tmp_path, plot=False, echo=printed.append
    )
    text = "\n".join(printed)
    assert "vae_decode: mpsboost vs stock: op conv3d 2.00x" in text
    assert ("WARNING: this machine was too busy" in text) == busy, text


def test_the_chart_labels_do_not_overlap(env, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from mpsboost.bench import plot as plot_mod

    ops = tuple(f"aten::{n}_with_a_long_name_{i}" for i, n in enumerate(["conv3d", "linear", "pad", "softmax"] * 2))
    variants = ["stock", "mpsboost", "mpsboost fp8 rowwise", "mpsboost, compiled", "peer quanto"]
    recs = [_rec(env, v, 100.0 / (i + 1), 0.02, ops) for i, v in enumerate(variants)]
    seen: list[list[str]] = []
    save = Figure.savefig

    def checked_save(self, *a, **kw):
        seen.append(plot_mod.label_overlaps(self))
        return save(self, *a, **kw)

    monkeypatch.setattr(Figure, "savefig", checked_save)
    plot_mod.plot(recs, tmp_path / "x.png")
    assert seen == [[]], seen
    # the same check sees overlaps where there are some (the labels as plot() drew them before)
    monkeypatch.setattr(plot_mod, "_unclutter", lambda fig: None)
    plot_mod.plot(recs, tmp_path / "y.png")
    assert seen[-1], "this chart's labels should crowd without _unclutter"
