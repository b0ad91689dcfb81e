"""Dispatch counts and the Mac cost model (mpsboost.bench.decode_cost), and the selftest's calibration of it.

* which aten ops launch a kernel (views, inplace-view ops, storage-sharing relabels and allocations do not);
* which kind of kernel each runs on a Mac per release, from the wheel-read table (data/mps_dispatch_kinds.json);
* the cost model's arithmetic on hand-made steps, and its scaling of a small model's counts to the real one;
* the selftest probe's constants accepted by the validator only within physical bounds.
"""

from __future__ import annotations

import json
import math
from importlib import resources

import pytest
import torch

from mpsboost.bench import decode_cost as dc

aten = torch.ops.aten


def _launch(op, *args, **kwargs) -> bool:
    out = op(*args, **kwargs)
    return dc.launches(op, args, kwargs, out)


# ----------------------------------------------------------------------------- what is a dispatch


def test_views_relabels_and_allocations_are_not_dispatches():
    x = torch.randn(4, 6)
    assert not _launch(aten.view.default, x, [6, 4])
    assert not _launch(aten.view.default, torch.empty(0, 3), [3, 0])  # no storage to share: the schema says view
    assert not _launch(aten.t.default, x)
    assert not _launch(aten.expand.default, x[:1], [3, 6])
    assert not _launch(aten.split.Tensor, x, 2)
    assert not _launch(aten._unsafe_view.default, x, [24])  # no alias annotation: caught on the call's storage
    assert not _launch(aten.empty_like.default, x)
    assert not _launch(aten.squeeze_.dim, torch.randn(4, 1), 1)  # Tag.inplace_view


def test_kernels_are_dispatches():
    x = torch.randn(4, 6)
    assert _launch(aten.add.Tensor, x, x)
    assert _launch(aten.clone.default, x)
    assert _launch(aten.mul_.Tensor, x.clone(), x)
    assert _launch(aten.zeros_like.default, x)
    assert _launch(aten.mm.default, x, x.t())


# ----------------------------------------------------------------------------- which kind, per release


def test_kinds_per_release_from_the_wheels():
    # softmax: MPSGraph in 2.14.1 (its key softmax_mps_out), a Metal kernel in 2.15.0 (softmax_row_*)
    assert dc.kind(aten._softmax.default, "2.14.1") == "mpsgraph"
    assert dc.kind(aten._softmax.default, "2.15.0") == "metal"
    for release in ("2.14.1", "2.15.0"):
        assert dc.kind(aten._prelu_kernel.default, release) == "mpsgraph"
        assert dc.kind(aten.mul.Tensor, release) == "metal"
        assert dc.kind(aten.add_.Scalar, release) == "metal"  # in-place overloads share the kernel
        assert dc.kind(aten.mm.default, release) == "mixed"  # GEMV kernels beside the MPSGraph matmul
    assert dc.kind(aten.addcmul.default, "2.14.1") == "mpsgraph"
    assert dc.kind(aten.addcmul.default, "2.15.0") == "metal"
    assert dc.kind(aten.nonzero.default, "2.15.0") == "unlisted"
    with pytest.raises(ValueError, match="no torch '2.9.0' wheel"):
        dc.kind(aten.mul.Tensor, "2.9.0")


def test_mpsboost_operators_are_metal():
    import mpsboost.ops.affine  # noqa: F401  registers mpsboost::affine_gemv

    assert dc.kind(torch.ops.mpsboost.affine_gemv.default) == "metal"


def test_the_table_names_its_evidence_per_row():
    table = json.loads(resources.files("mpsboost.data").joinpath("mps_dispatch_kinds.json").read_text())
    assert "tools/mps_dispatch_kinds.py" in table["about"]
    assert {w["version"] for w in table["wheels"]} >= {"2.14.1", "2.15.0"}
    for w in table["wheels"]:
        assert len(w["sha256"]) == 64 and w["file"].startswith(f"torch-{w['version']}-")
        for op, row in w["ops"].items():
            metal, graph = row["metal_kernels"] > 0, bool(row["mpsgraph_markers"])
            want = {(1, 0): "metal", (0, 1): "mpsgraph", (1, 1): "mixed", (0, 0): "unknown"}[(metal, graph)]
            assert row["kind"] == want, (w["version"], op)
            assert len(row["metal_sample"]) == min(4, row["metal_kernels"])


def test_a_decode_step_counts_dispatches_by_kind():
    import mpsboost
    from mpsboost.gate import Env

    m = dc.build("tiny")
    mpsboost.patch(m, device=Env.simulate("mps", "2.15.0"))
    cost = dc.decode_cost(m, release="2.15.0")
    disp = {k: sum(b[k] for b in cost["dispatches"].values()) for k in dc.KINDS}
    assert disp["unlisted"] == 0, cost["names"].get("unlisted")  # every kernel of the step has a row
    total = sum(disp.values())
    assert 0 < total < sum(cost["ops"].values())  # views are ops, not dispatches
    assert disp["metal"] > 0 and disp["mixed"] > 0
    assert sum(cost["pointwise"].values()) < total
    for block, n in cost["ops"].items():
        assert sum(cost["dispatches"].get(block, {}).values()) <= n


# ----------------------------------------------------------------------------- the cost model


def _step(**kw):
    step = dict.fromkeys(("bytes", "ops", "pointwise", *dc.KINDS), 0.0)
    step.update(kw)
    return step


def test_predict_adds_bytes_metal_and_mpsgraph_terms():
    # 500 MB at eta 0.5 of 1000 GB/s: 1 ms; 1000 Metal dispatches at 2 us: 2 ms; 100 MPSGraph at 20 us: 2 ms
    step = _step(bytes=5e8, metal=1000, mpsgraph=100)
    assert dc.predict(step, 1000.0, 0.5, 2.0, 20.0) == pytest.approx(5.0)
    assert dc.predict(_step(bytes=5e8), 1000.0, 0.5, 2.0, 20.0) == pytest.approx(1.0)
    assert dc.predict(_step(metal=1000), 1000.0, 0.5, 2.0, 20.0) == pytest.approx(2.0)
    assert dc.predict(_step(mpsgraph=100), 1000.0, 0.5, 2.0, 20.0) == pytest.approx(2.0)


def test_predict_prices_mixed_both_ways_and_fusion_removes_pointwise():
    step = _step(metal=100, mixed=40, unknown=10, pointwise=30)
    assert dc.predict(step, 800.0, 0.8, 1.0, 10.0, mixed="metal") == pytest.approx(0.15)
    assert dc.predict(step, 800.0, 0.8, 1.0, 10.0, mixed="mpsgraph") == pytest.approx(0.1 + 0.5)
    assert dc.predict(step, 800.0, 0.8, 1.0, 10.0, fused=True) == pytest.approx(0.12)
    with pytest.raises(ValueError, match="eta"):
        dc.predict(step, 800.0, 1.5, 1.0, 10.0)
    with pytest.raises(ValueError, match="mixed"):
        dc.predict(step, 800.0, 0.5, 1.0, 10.0, mixed="cpu")


def test_scale_multiplies_counts_per_block_by_the_real_blocks():
    cost = {
        "ops": {"linear_attn": 30, "self_attn": 10, "mlp": 40, "rest": 7},
        "bytes": {"linear_attn": 300, "self_attn": 50, "mlp": 400, "rest": 9},
        "pointwise": {"linear_attn": 6},
        "dispatches": {"mlp": {"metal": 20, "mixed": 4}, "rest": {"mpsgraph": 1}},
    }
    got = dc.scale(cost, {"linear_attn": 3, "self_attn": 1, "mlp": 4}, extra_bytes=1000)
    assert got["ops"] == pytest.approx(30 / 3 * 30 + 10 * 10 + 40 / 4 * 40 + 7)
    assert got["bytes"] == pytest.approx(300 / 3 * 30 + 50 * 10 + 400 / 4 * 40 + 9 + 1000)
    assert got["metal"] == pytest.approx(20 / 4 * 40) and got["mixed"] == pytest.approx(4 / 4 * 40)
    assert got["mpsgraph"] == 1 and got["pointwise"] == pytest.approx(6 / 3 * 30)


def test_every_constant_and_chip_names_its_source():
    for value, source in dc.CONSTANTS.values():
        assert value > 0 and ("#" in source or "FACTS" in source)
    for bw, eta_key, source in dc.CHIPS.values():
        assert bw > 0 and eta_key in dc.CONSTANTS and "Apple" in source
        assert 0 < dc.CONSTANTS[eta_key][0] <= 1


# ----------------------------------------------------------------------------- the selftest calibrates it


def _probe_line(**measured):
    return {"kind": "probe", "name": "dispatch_cost", "upstream": ["pytorch#148219"], "verdict": "fixed",
            "detail": "measured", "measured": measured}  # fmt: skip


@pytest.mark.parametrize(
    "measured",
    [
        {"c_metal_us": 0.05},
        {"c_metal_us": 250.0},
        {"c_graph_us": 0.0},
        {"c_graph_us": math.inf},
        {"eta": 0.0},
        {"eta": 1.2},
        {"eta": -0.3},
        {"c_metal_us": "2"},
        {"achieved_gbs": 0},
    ],
)
def test_the_validator_refuses_constants_outside_physical_bounds(measured):
    from mpsboost.selftest.report import SelftestFormatError, _check_line

    with pytest.raises(SelftestFormatError, match="dispatch_cost"):
        _check_line("f.jsonl:3", _probe_line(**measured), {})


def test_the_validator_accepts_constants_within_bounds():
    from mpsboost.selftest.report import _check_line

    seen: dict = {}
    line = _probe_line(c_metal_us=0.1, c_graph_us=200.0, eta=1.0, achieved_gbs=300.0, chip_model="M3 Max")
    _check_line("f.jsonl:3", line, seen)
    _check_line("f.jsonl:4", dict(_probe_line(c_metal_us=2.0, eta=None), name="other"), seen)
    assert seen["probe"] == {"dispatch_cost": "fixed", "other": "fixed"}


def test_the_probe_measures_the_constants_here():
    from mpsboost.selftest.probes import PROBES, run_probe

    rec = run_probe(PROBES["dispatch_cost"], "cpu", small=True, repeats=3)
    assert rec["verdict"] == "not applicable"  # the CPU's figures: not evidence for a Mac
    m = rec["measured"]
    assert m["c_metal_us"] > 0 and m["c_graph_us"] > 0 and m["achieved_gbs"] > 0 and m["eta"] is None
    # Not held to the validator's physical bounds: those are a Mac's, and a dispatch on a loaded CPU can take
    # longer than 200 us (a wall-clock bound); the bounds' own tests feed them values.


def _mac_file(path, **measured):
    from mpsboost.selftest import SCHEMA

    machine = {
        "os": "Darwin", "arch": "arm64", "macos": "15.1", "chip": "Apple M3 Max", "memory_bytes": 64 * 2**30,
        "cpu_count": 16, "torch": "2.15.0", "torch_build": "no cuda, git 0123456789, release", "mps_built": True,
        "mps_available": True, "python": "3.12.7", "mpsboost": "0.1.0",
        "libraries": {"diffusers": "0.42.1", "transformers": "5.24.0"}, "device": "mps",
        "device_name": "Apple MPS (Apple M3 Max)", "simulated": False,
    }  # fmt: skip
    head = {"kind": "selftest", "schema": SCHEMA, "machine": machine, "size": "quick", "processes": 1,
            "repeats": 3, "budget_s": 480, "duration_s": 60.0, "date": "2026-12-02",
            "command": "mpsboost selftest"}  # fmt: skip
    path.write_text("".join(json.dumps(x) + "\n" for x in (head, _probe_line(**measured))))
    return path


def test_a_macs_selftest_file_calibrates_the_prediction(tmp_path):
    import importlib.util
    from pathlib import Path

    from mpsboost.selftest.report import calibration

    f = _mac_file(tmp_path / "m.jsonl", c_metal_us=4.0, c_graph_us=30.0, eta=0.5, achieved_gbs=200.0,
                  chip_model="M3 Max")  # fmt: skip
    cal = calibration(f)
    assert cal["chip"] == "M3 Max" and cal["c_metal_us"] == 4.0 and cal["c_graph_us"] == 30.0 and cal["eta"] == 0.5
    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("mpsboost_decode_cost_bench", root / "benchmarks" / "decode_cost.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    step = _step(bytes=4e8, metal=1000, mpsgraph=10)
    (row,) = bench.calibrated_rows({"patched": step}, cal)
    # 400 MB at 0.5 of 400 GB/s: 2 ms; 1000 Metal at 4 us: 4 ms; 10 MPSGraph at 30 us: 0.3 ms
    assert row["ms_mixed_as_metal"] == pytest.approx(6.3) and row["chip"] == "M3 Max" and row["file"] == str(f)


@pytest.mark.parametrize(
    "measured, match",
    [
        ({"c_metal_us": 500.0, "c_graph_us": 20.0, "eta": 0.5}, "dispatch_cost"),  # outside physical bounds
        ({"eta": 0.5}, "no measured dispatch_cost"),  # the probe line without the constants
    ],
)
def test_a_selftest_file_outside_bounds_or_without_the_probe_calibrates_nothing(tmp_path, measured, match):
    from mpsboost.selftest.report import SelftestFormatError, calibration

    with pytest.raises(SelftestFormatError, match=match):
        calibration(_mac_file(tmp_path / "m.jsonl", **measured))


def test_a_selftest_file_from_another_device_calibrates_nothing(tmp_path):
    from mpsboost.selftest.report import SelftestFormatError, calibration

    f = _mac_file(tmp_path / "m.jsonl", c_metal_us=4.0, c_graph_us=30.0, eta=0.5)
    text = f.read_text().replace('"device": "mps"', '"device": "cpu"').replace("Apple MPS (Apple M3 Max)", "cpu")
    f.write_text(text)
    with pytest.raises(SelftestFormatError):
        calibration(f)


@pytest.mark.parametrize("verdict", ["not applicable", "error", "skipped"])
def test_a_probe_that_measured_no_mac_is_not_held_to_a_macs_bounds(verdict):
    # A fast CPU dispatches under 0.1 us: its selftest file is valid, and never evidence (calibration refuses it).
    from mpsboost.selftest.report import SelftestFormatError, _check_line

    _check_line("f.jsonl:3", dict(_probe_line(c_metal_us=0.04, c_graph_us=0.08), verdict=verdict), {})
    with pytest.raises(SelftestFormatError, match="outside its physical bounds"):
        _check_line("f.jsonl:3", _probe_line(c_metal_us=0.04, c_graph_us=0.08), {})
    with pytest.raises(SelftestFormatError, match="c_metal_us"):
        _check_line("f.jsonl:3", dict(_probe_line(c_metal_us=math.nan), verdict=verdict), {})
