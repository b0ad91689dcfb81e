"""benchmarks/decode_linear.py: every patched variant is made by mpsboost.patch() and timed with spread."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("transformers")


def _load():
    spec = importlib.util.spec_from_file_location("bench_decode_linear", ROOT / "benchmarks" / "decode_linear.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_variants_come_from_patch_on_a_transformers_model(tmp_path, monkeypatch):
    dl = _load()
    monkeypatch.setattr(dl, "shapes", lambda: [("layer", 16 * 64, 32 * 64, True)])
    records = dl.run("cpu", "tiny", tmp_path)
    by_variant = {r.variant: r for r in records if r.workload.name == "decode_linear"}
    assert set(by_variant) == {"stock", "mpsboost", "mpsboost:fold"}
    copies = by_variant["stock"].extra["weight_copies_rotated"]
    # patch() with its defaults leaves CPU linears alone and says why; the forced path patches every copy.
    assert by_variant["mpsboost"].extra["measured_through"] == "patch()"
    assert by_variant["mpsboost"].extra["layers_patched"] == 0
    assert by_variant["mpsboost"].extra["patch_row"]["status"] == "skipped"
    assert by_variant["mpsboost:fold"].extra["layers_patched"] == copies
    assert by_variant["mpsboost:fold"].extra["patch_row"]["backing"].startswith("[B,K] layout")
    for r in by_variant.values():
        t = r.op_time["linear_eager"]
        assert t.repeats >= 5 and t.min_us <= t.median_us <= t.max_us
        assert r.correctness.rel_error < 1e-2
    eager = by_variant["mpsboost:fold"].extra["eager"]
    assert eager["alternated_with"] == ["stock", "mpsboost"] and eager["verdict_vs_stock"] in (
        "faster",
        "slower",
        "no difference",
    )
