"""benchmarks/conversion.py at tiny size on the CPU, in process: its records carry the variants the docstring names,
and mpsboost's codes are bit for bit those of the formula (fp8) and of ``mx.quantize`` (MLX 4/8-bit), which the
record says; a wrong conversion would say otherwise."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("mpsboost_bench_conversion", ROOT / "benchmarks" / "conversion.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_records_name_the_variants_and_the_codes_are_identical(tmp_path):
    pytest.importorskip("mlx.core")
    records = _bench().run("cpu", "tiny", tmp_path)
    by = {(r.workload.name, r.workload.shape.get("bits"), r.variant): r for r in records}
    assert set(by) == {
        ("conversion.fp8_rowwise", None, "stock"),
        ("conversion.fp8_rowwise", None, "mpsboost"),
        *(("conversion.affine", bits, v) for bits in (4, 8) for v in ("mpsboost", "mlx")),
    }
    for r in records:
        assert r.throughput.value > 0 and r.extra["identical"] is True, (r.workload.key, r.variant)
        assert r.correctness.max_abs == 0.0
    assert by[("conversion.affine", 4, "mpsboost")].extra["alternated_with"] == ["mlx"]


def test_the_fp8_formula_is_an_independent_reference(monkeypatch):
    """The baseline's codes are the formula's, not mpsboost's: a conversion off by one code is reported."""
    bench = _bench()
    from mpsboost.ops import fp8 as fp8_ops

    w = bench._weight("tiny", "cpu")
    q, s = fp8_ops.quantize(w, "rowwise")
    q_ref, s_ref = bench.fp8_formula(w)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
    monkeypatch.setattr(fp8_ops, "quantize", lambda w, g: (q.view(torch.uint8).add(1).view(q.dtype), s))
    records = bench.run("cpu", "tiny", Path("/nonexistent"))
    fp8 = {r.variant: r for r in records if r.workload.name == "conversion.fp8_rowwise"}
    assert fp8["mpsboost"].extra["identical"] is False and fp8["mpsboost"].correctness.max_abs is None
