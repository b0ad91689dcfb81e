"""benchmarks/fp8_load.py's paired decode (the GPU proxy's fp8-vs-bf16 decode record) at tiny size on CPU: the
written Qwen3.6-FP8-layout file loads with requantize="rowwise", both models decode in alternating rounds, natively
and with a simulated Mac's decisions, and the records name the decisions and the fp8 paths."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _bench():
    spec = importlib.util.spec_from_file_location("mpsboost_bench_fp8_load", ROOT / "benchmarks" / "fp8_load.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_paired_decode_runs_natively_and_with_mac_decisions_and_writes_records(tmp_path):
    b = _bench()
    cfg = b._config("qwen3.6", 4, tiny=True)
    files = b.write_checkpoints("qwen3.6", cfg, tmp_path, "cpu")
    results = [b.decode_phase("qwen3.6", 4, files, "cpu", mac, 5, True) for mac in (None, "2.15.0")]
    native, mac = results
    assert native["decisions"] == "native" and mac["decisions"] == "mac-2.15.0"
    for r in results:
        assert len(r["bf16_samples_ms"]) == len(r["fp8_samples_ms"]) == 5
        assert r["measurement"]["alternated_with"] == ["bf16 patched"] and r["speedup"] > 0
    # The Mac's fp8 layers take mpsboost's Metal GEMV (dense) and grouped GEMV (routed experts); CPU's own dequantise.
    assert any(x.startswith("fp8 GEMV (mpsboost's Metal kernel") for x in mac["fp8_backing"]), mac["fp8_backing"]
    assert any("Metal fp8 grouped GEMV" in x for x in mac["fp8_backing"]), mac["fp8_backing"]
    assert not any("Metal" in x for x in native["fp8_backing"]), native["fp8_backing"]
    recs = b._decode_records("qwen3.6", 4, files, results, "cpu")
    assert [(r.workload.shape["decisions"], r.variant) for r in recs] == [
        ("native", "bf16 patched"),
        ("native", "mpsboost fp8"),
        ("mac-2.15.0", "bf16 patched"),
        ("mac-2.15.0", "mpsboost fp8"),
    ]
    assert all(r.throughput.value > 0 for r in recs)
