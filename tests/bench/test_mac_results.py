"""benchmarks/mac_results.py: contributed selftest files become docs/mac-results.md; an empty folder says how to
add a row."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from mpsboost.selftest import SCHEMA

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def mac_results():
    spec = importlib.util.spec_from_file_location("mpsboost_mac_results", ROOT / "benchmarks" / "mac_results.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop(spec.name, None)


def _machine(**kw):
    m = {
        "os": "Darwin",
        "arch": "arm64",
        "macos": "15.1",
        "chip": "Apple M3 Max",
        "memory_bytes": 64 * 2**30,
        "cpu_count": 16,
        "torch": "2.15.0",
        "torch_build": "no cuda, git 0123456789, release",
        "mps_built": True,
        "mps_available": True,
        "python": "3.12.7",
        "mpsboost": "0.1.0",
        "libraries": {"diffusers": "0.42.1", "transformers": "5.24.0"},
        "device": "mps",
        "device_name": "Apple MPS (Apple M3 Max)",
        "simulated": False,
    }
    m.update(kw)
    return m


def _probe(name, feature, verdict, upstream):
    return {
        "kind": "probe",
        "name": name,
        "upstream": upstream,
        "feature": feature,
        "verdict": verdict,
        "detail": "synthetic",
        "measured": {},
    }


def _workload(name, ratios, status="pass"):
    return {
        "kind": "workload",
        "name": name,
        "status": status,
        "reason": "",
        "recipes": ["wan_vae_pad"],
        "stock": {"seconds": [1.0] * len(ratios)},
        "patched": {"seconds": [1.0 / r for r in ratios]},
        "vs_stock": {"rel_error": 1e-6},
        "ratio": {
            "median": sorted(ratios)[len(ratios) // 2],
            "min": min(ratios),
            "max": max(ratios),
            "processes": len(ratios),
        },
    }


def _write(path: Path, machine: dict) -> Path:
    """A synthetic Mac file: torch 2.15.0 with the rank-5 pad bug still present (the gate believes it fixed),
    fp8 casts fixed, torch.mps.Stream present (the version rule says no), one workload over three processes."""
    lines = [
        {
            "kind": "selftest",
            "schema": SCHEMA,
            "machine": machine,
            "size": "quick",
            "processes": 3,
            "repeats": 3,
            "budget_s": 480,
            "duration_s": 412.0,
            "date": "2026-12-02",
            "command": "mpsboost selftest",
        },
        {
            "kind": "gate",
            "feature": "cross_stream_events",  # not in 2.15.0 by the gate; present by this probe
            "ok": True,
            "decided_by": "probed",
            "reason": "probed on mps: present",
            "probe": True,
        },
        _probe("pad_rank5_65536", "pad_rank5_correct", "has the bug", ["pytorch#194922"]),
        _probe("fp8_cast", "float8_storage", "fixed", ["pytorch#194074"]),
        _probe("a_future_probe", None, "fixed", ["pytorch#200000"]),
        _workload("wan22_vae_tiled_decode", [1.4, 1.5, 1.6]),
        _workload("qwen36_decode", [1.0], status="not applicable") | {"ratio": None},
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_empty_folder_says_no_results_and_how_to_add_a_row(mac_results, tmp_path):
    entries, rejected = mac_results.collect(tmp_path)
    text = mac_results.render(entries, rejected)
    assert entries == [] and rejected == []
    assert "No results yet" in text and "How to add a row" in text and "mpsboost selftest" in text
    assert "benchmarks/results/mac/" in text and "--validate" in text
    # the decisions a selftest would overturn are listed even before any file arrives
    assert "| pad_rank5_correct | pad_rank5_65536 |" in text and "| device_streams | none yet | yes |" in text


def test_a_synthetic_mac_file_renders_the_tables(mac_results, tmp_path, capsys):
    folder = tmp_path / "mac"
    folder.mkdir()
    _write(folder / "mpsboost-selftest-mps-2.15.0.jsonl", _machine())
    _write(folder / "mpsboost-selftest-mps-2.15.0-fake.jsonl", _machine(os="Linux", arch="x86_64"))  # rejected
    _write(
        folder / "mpsboost-selftest-cpu-2.15.0.jsonl",
        _machine(device="cpu", os="Linux", arch="x86_64", macos=None, chip="x86_64", device_name="cpu"),
    )  # valid, not a Mac run
    out = tmp_path / "docs" / "mac-results.md"
    assert mac_results.main(["--folder", str(folder), "--out", str(out)]) == 0
    text = out.read_text()
    assert "No results yet" not in text
    assert "| 1 | Apple M3 Max | 64 GB | 15.1 | 2.15.0 | 0.1.0 | quick | 3 | 2026-12-02 |" in text
    header = next(line for line in text.splitlines() if line.startswith("| # | pad_rank5_65536"))
    assert (
        header == "| # | pad_rank5_65536 | fp8_cast | a_future_probe |"
    )  # known probes first, then new ones from the file
    assert "| 1 | has the bug | fixed | fixed |" in text
    assert "1.50x (1.40-1.60, 3 processes)" in text and "not applicable" in text
    assert (
        "## Files left out" in text
        and "mpsboost-selftest-mps-2.15.0-fake.jsonl" in text
        and "claims device 'mps'" in text
    )
    assert "mpsboost-selftest-cpu-2.15.0.jsonl`: a selftest on cpu, not on MPS" in text
    (folder / "mpsboost-selftest-cpu-2.15.0.jsonl").unlink()
    printed = capsys.readouterr()
    # the file disagrees with the gate twice: the pad bug on 2.15.0, and streams found by the probe
    assert "revisit gate feature 'pad_rank5_correct'" in printed.out and "pad_rank5_65536" in printed.out
    assert "revisit gate feature 'cross_stream_events'" in printed.out and "found it present" in printed.out
    assert "rejected mpsboost-selftest-mps-2.15.0-fake.jsonl" in printed.err
    assert "revisit gate feature 'pad_rank5_correct'" in text
    # --check: up to date -> 1 only because a file is rejected; stale -> 1
    (folder / "mpsboost-selftest-mps-2.15.0-fake.jsonl").unlink()
    assert (
        mac_results.main(["--folder", str(folder), "--out", str(out), "--check"]) == 1
    )  # stale: the rejected file left
    assert mac_results.main(["--folder", str(folder), "--out", str(out)]) == 0
    assert mac_results.main(["--folder", str(folder), "--out", str(out), "--check"]) == 0


def test_an_agreeing_file_has_nothing_to_revisit(mac_results, tmp_path):
    folder = tmp_path / "mac"
    folder.mkdir()
    _write(folder / "a.jsonl", _machine(torch="2.14.1"))
    lines = [json.loads(x) for x in (folder / "a.jsonl").read_text().splitlines()]
    # on 2.14.1 the gate believes both bugs present and no streams: the same verdicts agree
    lines = [dict(x, verdict="has the bug") if x.get("name") == "fp8_cast" else x for x in lines if x["kind"] != "gate"]
    (folder / "a.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    entries, rejected = mac_results.collect(folder)
    assert not rejected and mac_results.revisit_all(entries) == []
    assert "none: every probe agrees with the gate" in mac_results.render(entries)


def test_the_published_document_is_up_to_date(mac_results):
    """docs/mac-results.md is what the script renders from benchmarks/results/mac/ and gate.FEATURES, the whole
    page: regenerate it (`python benchmarks/mac_results.py`) after adding a file or a gate feature."""
    entries, rejected = mac_results.collect(mac_results.FOLDER)
    assert not rejected, rejected
    stale = mac_results.OUT.read_text(encoding="utf-8") != mac_results.render(entries, rejected)
    assert not stale, "docs/mac-results.md is out of date: run `python benchmarks/mac_results.py`"
