"""benchmarks/e2e.py at tiny size on the CPU: the records it writes, and the byte count behind the bandwidth share."""

from __future__ import annotations

import importlib.util
import statistics
import sys
import types
from pathlib import Path

import pytest
import torch

from mpsboost.bench import check_comparable, read_jsonl

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def e2e():
    spec = importlib.util.spec_from_file_location("mpsboost_bench_e2e", ROOT / "benchmarks" / "e2e.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


@pytest.mark.slow
def test_tiny_generate_eager_records(e2e, tmp_path, capsys, monkeypatch):
    # run() is what `mpsboost bench e2e` calls; the options beyond device/size/out come from the environment.
    monkeypatch.setenv(
        "MPSBOOST_E2E_ARGS",
        "--only qwen3-8b --modes eager --variants mpsboost --decoding greedy --rounds 2 --new-tokens 4",
    )
    returned = e2e.run("cpu", "tiny", tmp_path)
    recs = read_jsonl(tmp_path / "e2e.partial.jsonl")
    assert [r.to_dict() for r in recs] == [r.to_dict() for r in returned]
    assert [r.variant for r in recs] == ["stock", "mpsboost"]
    check_comparable(recs)  # one workload, one environment: only the variant differs
    stock, patched = recs
    assert stock.workload == patched.workload
    shape = stock.workload.shape
    assert shape["mode"] == "eager" and shape["decoding"] == "greedy" and shape["layers"] == 2
    assert shape["prompt_tokens"] == 16 and shape["new_tokens"] == 4
    assert stock.env.device_type == "cpu" and stock.env.compile == "eager" and stock.env.dtype == "bfloat16"
    assert "transformers" in stock.env.libraries and stock.env.device_name

    for r in recs:
        e = r.extra
        assert e["rounds"] == 2 and e["budget_cut"] is False
        for key in ("prefill_s", "decode_s_per_token", "generate_call_s"):
            s = e[key]
            assert s["n"] == 2 and s["best"] <= s["median"] <= s["worst"]
            assert s["spread"] == pytest.approx(s["worst"] - s["best"])
        assert isinstance(e["tokens_equal_stock"], bool)
        assert 0.0 <= e["token_match_fraction"] <= 1.0
        # decode per token is (t(N) - t(1)) / (N - 1) of the same round
        dec = [(c - p) / 3 for c, p in zip(e["generate_call_s"]["samples"], e["prefill_s"]["samples"])]
        assert e["decode_s_per_token"]["samples"] == pytest.approx(dec)
        assert r.throughput.unit == "ms/token"
        assert r.throughput.value == pytest.approx(statistics.median(dec) * 1e3)
        assert set(r.op_time) == {"prefill", "decode_token", "generate_call"}
        bw = e["bandwidth"]
        assert bw["weight_bytes_per_token"] > 0 and bw["copy_bandwidth_bytes_per_s"] > 0
        assert bw["share_of_limit"] == pytest.approx(bw["limit_s_per_token"] / e["decode_s_per_token"]["median"])
        assert r.memory is not None and r.memory.driver_level is not None

    assert stock.extra["tokens_equal_stock"] is True  # the stock rounds agree with the first stock round
    assert "patch" not in stock.extra and stock.correctness is None
    p = patched.extra
    assert p["patch"]["applied"] + p["patch"]["skipped"] > 0
    # the ratio comes from the two records of this run, nothing else
    for key, src in (("decode", "decode_s_per_token"), ("prefill", "prefill_s"), ("call", "generate_call_s")):
        assert p["ratio_vs_stock"][key] == pytest.approx(stock.extra[src]["median"] / p[src]["median"])
    assert patched.correctness.reference.startswith("stock")
    assert patched.correctness.rel_error is not None and patched.correctness.rel_error < 0.05
    out = capsys.readouterr().out
    assert "decode ms/tok" in out and "mpsboost" in out


@pytest.mark.slow
class _Clock:
    """A clock that the test owns: each read advances it by ``tick`` seconds, and ``advance`` moves it on.
    Nothing the machine does (load, a slow core) changes what the benchmark reads."""

    def __init__(self, tick: float = 1e-3):
        self.now = 0.0
        self.tick = tick

    def perf_counter(self) -> float:
        self.now += self.tick
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_patching_is_not_timed(e2e, tmp_path, monkeypatch):
    # Stock and mpsboost share one model and alternate: the patch/unpatch between them is a one-time
    # cost that must stay outside the timed prefill and call (it once added 150-200 ms to the first token).
    # The benchmark reads an injected clock on which a patch() call takes `delay` and everything else one
    # tick per read: a patch inside a timed region shows as `delay` in that region, whatever the load.
    delay = 1000.0
    clock = _Clock()
    monkeypatch.setattr(e2e, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    real_patch = e2e.mpsboost.patch

    def slow_patch(*args, **kw):
        clock.advance(delay)
        return real_patch(*args, **kw)

    monkeypatch.setattr(e2e.mpsboost, "patch", slow_patch)
    monkeypatch.setenv(
        "MPSBOOST_E2E_ARGS",
        "--only qwen3-8b --modes eager --variants mpsboost --decoding greedy --rounds 3 --new-tokens 3",
    )
    recs = e2e.run("cpu", "tiny", tmp_path)
    stock, patched = recs
    assert patched.extra["prefill_s"]["worst"] < delay, patched.extra["prefill_s"]
    assert patched.extra["generate_call_s"]["worst"] < delay
    # the switches happened and were timed on their own: every round after the first re-patches
    assert patched.extra["switch_s"] and min(patched.extra["switch_s"]) >= delay


def test_weight_bytes_count_active_experts_only(e2e):
    cfg = e2e.llm_config("qwen3-30b-a3b", "tiny", 1)
    model = e2e.build_llm(cfg, "cpu", torch.bfloat16, 0)
    every = sum(t.numel() * t.element_size() for t in model.parameters()) + sum(
        b.numel() * b.element_size() for b in model.buffers()
    )
    experts = sum(
        t.numel() * t.element_size() for t in model.parameters() if t.dim() == 3 and t.shape[0] == cfg.num_experts
    )
    emb = model.get_input_embeddings().weight
    assert experts > 0
    expected = (
        every
        - experts
        - emb.numel() * emb.element_size()
        + experts * cfg.num_experts_per_tok // cfg.num_experts
        + emb.shape[1] * emb.element_size()
    )
    assert e2e.weight_bytes_per_token(model) == expected


def test_bad_options_are_refused(e2e):
    with pytest.raises(SystemExit, match="unknown"):
        e2e.parse(["--only", "llama"])
    with pytest.raises(SystemExit, match="new-tokens"):
        e2e.parse(["--device", "cpu", "--new-tokens", "1"])


def test_an_fp8_model_is_freed_after_its_workload(e2e):
    import gc
    import weakref

    import mpsboost

    cfg = e2e.llm_config("qwen3-8b", "tiny", None)
    model = e2e.build_llm(cfg, "cpu", torch.bfloat16, 0)
    report = mpsboost.patch(model, fp8="rowwise")
    assert any(r.recipe == "fp8_weights" for r in report.applied)
    ref = weakref.ref(model)
    del model, report  # mpsboost keeps its records on the model itself: nothing else holds it
    gc.collect()
    assert ref() is None


def test_qwen36_mac_variant_and_breakdown(e2e, tmp_path):
    # The seed's model (Gated DeltaNet + attention + MoE) at toy width: stock, native and Mac decisions in
    # one run, each with its per-module breakdown; the Mac variant says its decisions are simulated.
    a = e2e.parse(
        [
            "--device",
            "cpu",
            "--size",
            "tiny",
            "--only",
            "qwen3.6-35b-a3b",
            "--modes",
            "eager",
            "--variants",
            "mpsboost,mac",
            "--decoding",
            "greedy",
            "--rounds",
            "1",
            "--new-tokens",
            "3",
            "--breakdown-steps",
            "2",
            "--out",
            str(tmp_path),
        ]
    )
    recs = e2e._main(a)
    assert [r.variant for r in recs] == ["stock", "mpsboost", "mpsboost:mac-2.15.0"]
    assert recs[0].workload.shape["layers"] == 4
    for r in recs:
        b = r.extra["breakdown"]
        # 3 Gated DeltaNet layers, 1 attention layer, 4 MoE blocks (each with its experts) in the tiny config
        assert b["modules"] == {"linear_attention": 3, "attention": 1, "experts": 4, "moe_block": 4}
        assert all(v > 0 for v in b["decode_ms_per_token"].values())
        # the kinds are disjoint layers (experts sit inside moe_block), so their sum fits in the hooked step
        parts = b["decode_ms_per_token"]
        assert parts["linear_attention"] + parts["attention"] + parts["moe_block"] <= b["decode_step_ms_hooked"]
    mac = recs[2].extra
    assert "simulated" in mac["decisions"] and mac["patch"]["applied"] + mac["patch"]["skipped"] > 0
    assert recs[2].correctness is not None and recs[2].correctness.rel_error < 0.05
