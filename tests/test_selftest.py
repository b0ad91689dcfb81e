"""``mpsboost selftest`` on this CPU: the whole run, its files, and the validator on good and broken files."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mpsboost import selftest
from mpsboost.cli import main as cli_main
from mpsboost.registry import all_recipes
from mpsboost.selftest import SelftestFormatError, validate

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One full selftest on the CPU (every registered recipe), shared by the tests below."""
    out = tmp_path_factory.mktemp("selftest")
    lines: list[str] = []
    results, jsonl, md = selftest.run_selftest("cpu", out_dir=out, repeats=2, echo=lines.append)
    return results, jsonl, md, "\n".join(lines)


def test_every_recipe_has_a_row_and_the_cpu_ones_pass(run):
    results, jsonl, md, printed = run
    by = {r.recipe: r for r in results}
    assert set(by) == {r.name for r in all_recipes()}
    # On the CPU: the VAE, MoE, sampling and fp8 recipes apply; the MPS-only ones do not, with the gate's reason.
    for name in ("wan_vae_pad", "qwen_image_vae", "moe_experts", "softmax", "fp8_weights"):
        assert by[name].status == "pass", (name, by[name].reason)
        assert by[name].speed_ratio is not None and by[name].speed_ratio > 0
    assert by["metal_attention"].status == "not applicable" and "not available on cpu" in by["metal_attention"].reason
    assert by["mps_streams"].status == "not applicable"
    # The MPS workarounds of older builds step aside on the CPU, each with its reason.
    for name in ("video_vae_pad", "attention_split"):
        assert by[name].status == "not applicable" and by[name].reason, (name, by[name])
    assert all(r.status in selftest.STATUSES for r in results)
    assert not [r for r in results if r.status in ("fail", "error")]
    # the lossless ones agree with stock far inside the tolerance; fp8 is lossy but bounded
    assert by["wan_vae_pad"].vs_stock.rel_error < 1e-5
    assert 0 < by["fp8_weights"].vs_stock.rel_error < selftest.LOSSY
    assert "recipe" in printed and "speed" in printed and "driver peak" in printed


def test_files_are_named_for_device_and_torch_and_validate(run):
    results, jsonl, md, _ = run
    assert jsonl.name == f"mpsboost-selftest-cpu-{torch.__version__}.jsonl"
    assert md.name == jsonl.name.replace(".jsonl", ".md")
    summary = validate(jsonl)
    assert summary["env"]["device_type"] == "cpu" and summary["env"]["torch_version"] == torch.__version__
    assert summary["recipes"] == {r.recipe: r.status for r in results}
    text = md.read_text()
    assert f"torch {torch.__version__}" in text and jsonl.name in text and "wan_vae_pad" in text and "pass" in text


def test_records_carry_the_four_separate_measurements(run):
    _, jsonl, _, _ = run
    recs = [json.loads(line) for line in jsonl.read_text().splitlines()]
    ran = [r for r in recs if r["extra"]["selftest"]["status"] == "pass"]
    assert {r["variant"] for r in ran} == {"stock", "mpsboost"}
    for r in ran:
        assert r["throughput"]["seconds_per_call"] > 0
        assert set(r["memory"]) >= {"tensor_allocated", "allocator_reserved", "driver_level"}
        assert r["memory"]["driver_level"] is not None  # process RSS on the CPU
        if r["extra"]["selftest"]["metric"] != "ids":
            assert r["correctness"]["reference"] == "cpu-fp32"
        if r["variant"] == "mpsboost":
            assert r["extra"]["selftest"]["vs_stock"]["reference"] == "stock"


def _rewrite(src: Path, dst: Path, edit) -> Path:
    recs = [json.loads(line) for line in src.read_text().splitlines()]
    recs = edit(recs)
    dst.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return dst


def _first_ran(recs, variant="mpsboost"):
    return next(r for r in recs if r["extra"]["selftest"]["status"] == "pass" and r["variant"] == variant)


@pytest.mark.parametrize(
    "what, edit, message",
    [
        ("missing stock record", lambda rs: [r for r in rs if not (r["workload"]["name"] == "selftest:wan_vae_pad" and r["variant"] == "stock")],
         "only \\['mpsboost'\\]"),
        ("bad status", lambda rs: [dict(r, extra={"selftest": dict(r["extra"]["selftest"], status="great")}) for r in rs], "status 'great'"),
        ("no findings", lambda rs: [dict(r, extra={}) for r in rs], "missing extra"),
        ("mixed environments", lambda rs: rs[:-1] + [dict(rs[-1], env=dict(rs[-1]["env"], torch_version="2.15.0"))], "environment differs"),
        ("no memory", lambda rs: [dict(r, memory=None) if r is _first_ran(rs) else r for r in rs], "lacks throughput or memory"),
        ("bad speed ratio", lambda rs: [dict(r, extra={"selftest": dict(r["extra"]["selftest"], speed_ratio=-1)}) if r is _first_ran(rs) else r for r in rs],
         "speed_ratio -1"),
        ("wrong reference", lambda rs: [dict(r, correctness=dict(r["correctness"], reference="mps-bf16")) if r is _first_ran(rs, "stock") and r["correctness"] else r for r in rs],
         "expected 'cpu-fp32'"),
        ("duplicate", lambda rs: rs + [rs[-1]], "a second"),
        ("not a record", lambda rs: [{"hello": 1}], "not an mpsboost bench record"),
    ],
)
def test_validator_rejects_broken_files(run, tmp_path, what, edit, message):
    _, jsonl, _, _ = run
    bad = _rewrite(jsonl, tmp_path / "bad.jsonl", edit)
    with pytest.raises(SelftestFormatError, match=message):
        validate(bad)


def test_validator_names_file_and_line(run, tmp_path):
    _, jsonl, _, _ = run
    bad = tmp_path / "bad.jsonl"
    bad.write_text(jsonl.read_text() + "{not json\n")
    n = len(jsonl.read_text().splitlines()) + 1
    with pytest.raises(SelftestFormatError, match=rf"bad.jsonl:{n}: not an mpsboost bench record"):
        validate(bad)
    with pytest.raises(SelftestFormatError, match="no such file"):
        validate(tmp_path / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(SelftestFormatError, match="empty file"):
        validate(tmp_path / "empty.jsonl")


def test_validator_on_benchmark_results():
    """benchmarks/results/ holds selftest files too once users contribute them; other kinds are refused clearly."""
    files = sorted(RESULTS.glob("*.jsonl"))
    assert files, RESULTS
    for f in files:
        if f.name.startswith("mpsboost-selftest-"):
            assert validate(f)["recipes"]
        else:
            with pytest.raises(SelftestFormatError, match="not a selftest workload|not an mpsboost bench record"):
                validate(f)


def test_cli_selftest_and_validate(tmp_path, capsys):
    rc = cli_main(["selftest", "--device", "cpu", "--recipes", "wan_vae_pad", "metal_attention", "--repeats", "1", "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "wan_vae_pad" in out and "pass" in out and "not applicable" in out
    (jsonl,) = tmp_path.glob("mpsboost-selftest-cpu-*.jsonl")
    assert cli_main(["selftest", "--validate", str(jsonl)]) == 0
    assert '"wan_vae_pad": "pass"' in capsys.readouterr().out
    assert cli_main(["selftest", "--recipes", "nope", "--out", str(tmp_path)]) == 2
    assert "unknown recipe" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text("[]\n")
    assert cli_main(["selftest", "--validate", str(bad)]) == 2


def test_a_failing_recipe_is_reported_not_raised(tmp_path, monkeypatch):
    """A recipe whose patched output drifts from stock fails the selftest, and the run still writes its files."""
    real = selftest._compare

    def drifting(x, ref, metric, reference):
        return real(x + 1.0, ref, metric, reference) if reference == "stock" else real(x, ref, metric, reference)

    monkeypatch.setattr(selftest, "_compare", drifting)
    results, jsonl, _ = selftest.run_selftest("cpu", recipes=["wan_vae_pad"], out_dir=tmp_path, repeats=1, echo=lambda s: None)
    (res,) = results
    assert res.status == "fail" and "patched vs stock" in res.reason
    assert validate(jsonl)["recipes"] == {"wan_vae_pad": "fail"}
    assert cli_main(["selftest", "--validate", str(jsonl)]) == 0
