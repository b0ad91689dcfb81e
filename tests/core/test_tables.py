"""benchmarks/tables.py: the published figures are the ones the committed records give."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from mpsboost.bench import EnvMismatchError, OpTime, Record, RecordEnv, Throughput, Workload, write_jsonl

ROOT = Path(__file__).resolve().parents[2]


def _load_tables():
    spec = importlib.util.spec_from_file_location("mpsboost_tables", ROOT / "benchmarks" / "tables.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


tables = _load_tables()


@pytest.fixture(scope="module")
def env() -> RecordEnv:
    return RecordEnv(
        mpsboost_version="0.1.0",
        torch_version="2.11.0+cu130",
        torch_build="cuda 13.0, git 70d99e998b, release",
        torch_cuda="13.0",
        torch_git="70d99e998b",
        torch_debug=False,
        device_type="cuda",
        device_name="NVIDIA H200",
        dtype="bfloat16",
        compile="eager",
        os="Linux",
        platform="Linux",
        python="3.12",
        libraries={},
    )


def _tp(median: float, lo: float, hi: float, n: int = 5) -> Throughput:
    return Throughput(
        value=median, unit="s/call", seconds_per_call=median, repeats=n, spread={"min_s": lo, "max_s": hi}
    )


def test_committed_documents_match_the_records():
    diffs = tables.check()
    assert not diffs, "generated tables are stale; run `python benchmarks/tables.py`:\n" + "".join(diffs)[:4000]


def test_check_reports_a_hand_edited_figure(tmp_path):
    for doc in tables.DOCS:
        (tmp_path / doc).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / doc).write_text((ROOT / doc).read_text())
    assert tables.check(root=tmp_path) == []
    figures = tmp_path / "docs" / "figures.md"
    text = figures.read_text()
    begin = text.index("<!-- tables:recipes:begin -->")
    end = text.index("<!-- tables:recipes:end -->")
    edited = text[:begin] + text[begin:end].replace("1.86x", "3.60x", 1) + text[end:]
    assert edited != text
    figures.write_text(edited)
    diffs = tables.check(root=tmp_path)
    assert len(diffs) == 1 and "-" in diffs[0] and "3.60x" in diffs[0]
    assert tables.write(root=tmp_path) == ["docs/figures.md"]
    assert figures.read_text() == text


def test_the_readme_carries_no_benchmark_figures():
    """The front door holds the tables that describe the tool; every record-derived table lives in docs/
    or benchmarks/README.md."""
    readme = (ROOT / "README.md").read_text()
    blocks = set(re.findall(r"<!-- tables:([a-z0-9-]+):begin -->", readme))
    assert blocks and not blocks & set(tables.BLOCKS), sorted(blocks & set(tables.BLOCKS))
    everywhere = set()
    for doc in tables.DOCS:
        everywhere |= set(re.findall(r"<!-- tables:([a-z0-9-]+):begin -->", (ROOT / doc).read_text()))
    assert set(tables.BLOCKS) <= everywhere, (
        f"figure blocks published nowhere: {sorted(set(tables.BLOCKS) - everywhere)}"
    )


def test_the_command_line_check_exits_non_zero_on_a_stale_document(tmp_path, capsys):
    for doc in tables.DOCS:
        (tmp_path / doc).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / doc).write_text((ROOT / doc).read_text())
    assert tables.main(["--check", "--root", str(tmp_path)]) == 0
    p = tmp_path / "benchmarks" / "README.md"
    p.write_text(p.read_text().replace("<!-- tables:results:end -->", "| stale | row |\n<!-- tables:results:end -->"))
    assert tables.main(["--check", "--root", str(tmp_path)]) == 1
    assert "stale" in capsys.readouterr().out


def test_softmax_figure_is_the_same_workload_ratio_not_across_workloads():
    # The published ratio is stock over mpsboost of one workload; dividing stock by the time of another
    # variant's workload (the logits form, or another warper setting) once gave a figure twice as large.
    file = tables.SOURCES["softmax"]
    g = tables.find(tables.groups(file), "softmax.sampling_step", warpers="none")
    stock, mine, logits = (g.variants[v].throughput.value for v in ("stock", "mpsboost", "mpsboost-logits"))
    same = f"{mine / stock:.2f}x" if g.variants["stock"].throughput.unit.endswith("/s") else f"{stock / mine:.2f}x"
    other = f"{logits / stock:.2f}x" if g.variants["stock"].throughput.unit.endswith("/s") else f"{stock / logits:.2f}x"
    assert same != other
    block = tables.block_recipes()
    row = next(
        line for line in block.splitlines() if "softmax.sampling_step (rows=1, vocab=128256, warpers=none)" in line
    )
    assert same in row and other not in row


def test_decode_linear_copied_variant_is_shown_as_not_measured(monkeypatch):
    # The 2026-11-29 run copied stock's or Triton's timing into its mpsboost variant: shown as not measured.
    monkeypatch.setitem(tables.SOURCES, "decode_linear", "decode_linear-cuda-2026-11-29.jsonl")
    block = tables.block_recipes()
    rows = [line for line in block.splitlines() if "`decode_linear`" in line]
    assert rows and all(tables.NOT_THROUGH_PATCH in r for r in rows)
    assert not any("1.13x" in r or "1.00x" in r for r in rows)


def test_overlapping_spreads_read_no_difference(tmp_path, env):
    w = Workload("job", {"n": 1})
    write_jsonl(
        tmp_path / "x-cuda.jsonl",
        [
            Record(w, "stock", env, throughput=_tp(1.00, 0.95, 1.10)),
            Record(w, "mpsboost", env, throughput=_tp(0.90, 0.85, 0.97)),  # 1.11x by medians, spreads overlap
        ],
    )
    g = tables.groups("x-cuda.jsonl", tmp_path)[0]
    c = tables.compare("x-cuda.jsonl", g, "mpsboost")
    assert round(c.ratio, 2) == 1.11
    assert c.cells()[3] == "no difference (spreads overlap)"
    write_jsonl(
        tmp_path / "y-cuda.jsonl",
        [
            Record(w, "stock", env, throughput=_tp(1.00, 0.98, 1.02)),
            Record(w, "mpsboost", env, throughput=_tp(0.90, 0.89, 0.91)),
        ],
    )
    g = tables.groups("y-cuda.jsonl", tmp_path)[0]
    assert tables.compare("y-cuda.jsonl", g, "mpsboost").cells()[3] == "faster"


def test_a_single_figure_gives_no_decision(tmp_path, env):
    w = Workload("job", {})
    write_jsonl(
        tmp_path / "z-cuda.jsonl",
        [
            Record(w, "stock", env, throughput=Throughput(value=2.0, unit="s/call", seconds_per_call=2.0)),
            Record(w, "mpsboost", env, throughput=Throughput(value=1.0, unit="s/call", seconds_per_call=1.0)),
        ],
    )
    c = tables.compare("z-cuda.jsonl", tables.groups("z-cuda.jsonl", tmp_path)[0], "mpsboost")
    assert c.cells()[1].endswith("spread not recorded)") and c.cells()[3].startswith("spread not recorded")


def test_records_of_different_environments_are_refused(tmp_path, env):
    w = Workload("job", {})
    other = RecordEnv.from_dict({**env.to_dict(), "torch_version": "2.12.0"})
    write_jsonl(
        tmp_path / "m-cuda.jsonl",
        [Record(w, "stock", env, throughput=_tp(1, 1, 1)), Record(w, "mpsboost", other, throughput=_tp(1, 1, 1))],
    )
    with pytest.raises(EnvMismatchError):
        tables.file_table("m-cuda.jsonl", tmp_path)


def test_decode_linear_records_measured_through_patch_are_shown(tmp_path, env):
    def rec(variant: str, us: float, **extra) -> Record:
        op = OpTime(median_us=us, min_us=us * 0.99, max_us=us * 1.01, repeats=5, method="cuda_graph")
        return Record(
            Workload("decode_linear", {"N": 8, "K": 8}), variant, env, op_time={"linear_graph": op}, extra=extra
        )

    write_jsonl(
        tmp_path / "decode_linear-cuda.jsonl", [rec("stock", 10.0), rec("mpsboost", 5.0, measured_through="patch()")]
    )
    c = tables.compare(
        "decode_linear-cuda.jsonl",
        tables.groups("decode_linear-cuda.jsonl", tmp_path)[0],
        "mpsboost",
        op="linear_graph",
    )
    assert c.reason is None and round(c.ratio, 2) == 2.0
    write_jsonl(tmp_path / "decode_linear-cuda.jsonl", [rec("stock", 10.0), rec("mpsboost", 5.0)])
    tables._records.cache_clear()
    c = tables.compare(
        "decode_linear-cuda.jsonl",
        tables.groups("decode_linear-cuda.jsonl", tmp_path)[0],
        "mpsboost",
        op="linear_graph",
    )
    assert c.reason == tables.NOT_THROUGH_PATCH and c.ratio is None


def test_sweeps_are_summarised_by_range_and_verdict_counts_never_an_average(tmp_path, env):
    recs = []
    for n, (s, m) in enumerate([(10, 5), (10, 10), (10, 20), (10, 9.0), (10, 4)]):
        w = Workload("lin", {"n": n})
        for variant, us in (("stock", s), ("mpsboost", m)):
            recs.append(
                Record(
                    w, variant, env, op_time={"op": OpTime(median_us=us, min_us=us * 0.98, max_us=us * 1.02, repeats=5)}
                )
            )
    write_jsonl(tmp_path / "s-cuda.jsonl", recs)
    row = tables.sweep_summary("s-cuda.jsonl", tables.groups("s-cuda.jsonl", tmp_path), "mpsboost", op="op")
    assert row[2] == "0.50x-2.50x"
    assert row[3] == "3 faster, 1 slower, 1 no difference"


def test_e2e_table_from_a_fake_record(tmp_path, env):
    rows = []
    for mode in ("eager", "static-cache"):
        w = Workload("qwen3_moe_generate", {"model": "Qwen3-30B-A3B-shaped", "mode": mode, "new_tokens": 64})
        rows.append(Record(w, "stock", env, throughput=_tp(2.0, 1.9, 2.1, n=5)))
        rows.append(
            Record(
                w,
                "mpsboost",
                env,
                throughput=_tp(1.0, 0.98, 1.03, n=5) if mode == "eager" else _tp(2.0, 1.95, 2.05, n=5),
            )
        )
    write_jsonl(tmp_path / "e2e-cuda-2026-12-01.jsonl", rows)
    write_jsonl(tmp_path / "other-cuda.jsonl", [rows[0]])  # not an e2e file: not in the table
    block = tables.block_e2e(tmp_path)
    lines = [line for line in block.splitlines() if line.startswith("| `qwen3_moe_generate`")]
    assert len(lines) == 2
    eager = next(line for line in lines if "| eager |" in line)
    static = next(line for line in lines if "| static-cache |" in line)
    assert "2.00x" in eager and "| faster |" in eager and "e2e-cuda-2026-12-01.jsonl" in eager and "5 repeats" in eager
    assert "1.00x" in static and "no difference" in static


def test_e2e_table_without_records_says_so(tmp_path):
    assert "No end-to-end records" in tables.block_e2e(tmp_path)


def test_unknown_block_name_is_an_error():
    with pytest.raises(KeyError, match="unknown generated block"):
        tables.render("<!-- tables:nope:begin -->\n<!-- tables:nope:end -->\n")


def test_a_decode_linear_rerun_through_patch_replaces_not_measured_with_figures(tmp_path, env, monkeypatch):
    import shutil

    results = tmp_path / "results"
    shutil.copytree(tables.RESULTS, results, ignore=shutil.ignore_patterns("decode_linear-*"))
    recs = []
    for n, (s, m) in enumerate([(10.0, 6.0), (10.0, 10.1)]):
        w = Workload("decode_linear", {"N": 64 * (n + 1), "K": 64})
        for variant, us in (("stock", s), ("mpsboost", m)):
            op = OpTime(median_us=us, min_us=us * 0.99, max_us=us * 1.01, repeats=10, method="cuda_graph")
            recs.append(
                Record(
                    w,
                    variant,
                    env,
                    op_time={"linear_graph": op},
                    extra={"measured_through": "patch()" if variant != "stock" else "stock module"},
                )
            )
    wm = Workload("decode_linear.model", {"mode": "eager"})
    recs.append(Record(wm, "stock", env, throughput=_tp(0.020, 0.019, 0.021)))
    recs.append(
        Record(
            wm,
            "mpsboost",
            env,
            throughput=_tp(0.020, 0.0195, 0.0205),
            extra={"measured_through": "patch()", "layers_patched": 0},
        )
    )
    write_jsonl(results / "decode_linear-cuda-2026-12-01.jsonl", recs)
    monkeypatch.setitem(tables.SOURCES, "decode_linear", "decode_linear-cuda-2026-12-01.jsonl")
    block = tables.block_recipes(results)
    rows = [line for line in block.splitlines() if "`decode_linear`" in line]
    assert len(rows) == 2 and not any(tables.NOT_THROUGH_PATCH in r for r in rows)
    assert "0.99x-1.67x (per shape)" in rows[0] and "1 faster, 0 slower, 1 no difference" in rows[0]
    assert "1.00x" in rows[1] and "no difference" in rows[1]


def test_e2e_rounds_kept_in_extra_give_the_spread(tmp_path, env):
    w = Workload("wan_t2v", {"mode": "compile"})
    tp = Throughput(value=10.0, unit="frames/s", seconds_per_call=8.1, items_per_call=81)
    write_jsonl(
        tmp_path / "e2e-cuda.jsonl",
        [
            Record(w, "stock", env, throughput=tp, extra={"rounds": [8.0, 8.1, 8.3, 8.2, 8.1]}),
            Record(w, "mpsboost", env, throughput=tp, extra={"rounds": [6.0, 6.1, 6.2, 6.05, 6.1]}),
        ],
    )
    row = next(line for line in tables.block_e2e(tmp_path).splitlines() if "`wan_t2v`" in line)
    assert "| compile |" in row and "5 rounds" in row and "1.33x" in row and "| faster |" in row
