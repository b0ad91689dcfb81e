"""`mpsboost demo --device cpu` runs to the end (in this process, as the command calls it) and prints all four
record kinds in lines a terminal shows (slow), its models are the seed's (a Qwen3.6-architecture LM whose DeltaNet
state crosses a chunk, a Qwen-Image VAE), its missing-extra check comes before any work, and its ratio lines carry
their range and a busy warning."""

from __future__ import annotations

import contextlib
import io
import os

import pytest

from mpsboost.bench import read_jsonl

WORKLOADS = ("qwen36_prefill", "qwen36_decode", "qwen_image_vae_decode")


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    from mpsboost.cli import main

    out = tmp_path_factory.mktemp("demo")
    text = io.StringIO()
    old = os.environ.get("MPSBOOST_PROGRESS")
    os.environ["MPSBOOST_PROGRESS"] = "0"
    try:
        with contextlib.redirect_stdout(text):
            rc = main(["demo", "--device", "cpu", "--repeats", "2", "--out", str(out)])
    finally:
        if old is None:
            os.environ.pop("MPSBOOST_PROGRESS", None)
        else:
            os.environ["MPSBOOST_PROGRESS"] = old
    return rc, text.getvalue(), out


@pytest.mark.slow  # the full demo
def test_demo_runs_to_the_end_and_says_what_to_run_next(demo_run):
    rc, text, _ = demo_run
    assert rc == 0, text[-3000:]
    assert "demo finished in" in text
    rows = text.rstrip().splitlines()
    assert rows[-2].startswith("next: mpsboost doctor ") and "mpsboost plan Qwen/Qwen3.6-35B-A3B" in rows[-1]
    too_wide = [r for r in rows if len(r) > 100]
    assert not too_wide, too_wide


@pytest.mark.slow  # the full demo
def test_demo_prints_reports_and_the_four_record_kinds(demo_run):
    _, text, _ = demo_run
    flat = " ".join(text.split())  # the same words, whatever the line breaks
    assert text.count("mpsboost patch for") == 2  # one patch report per model
    assert "AutoencoderKLQwenImage" in text and "Qwen3_5MoeForCausalLM" in text
    for workload in WORKLOADS:
        assert f"== {workload}" in text
    assert text.count("metric ") == 3
    # the four kinds, each on its own rows
    assert "throughput (median, ±IQR/2)" in text
    assert "op QwenImageCausalConv3d" in text and "op Qwen3_5MoeGatedDeltaNet" in text
    assert "op Qwen3_5MoeSparseMoeBlock" in text
    assert "vs cpu-fp32: SQNR dB" in text and "vs cpu-fp32: PSNR dB" in text
    assert "mem driver-level peak (process_rss)" in text and "mem tensor-allocated peak" in text
    assert "mpsboost vs stock" in text
    # every speed ratio again with its range over the repeats, per workload
    assert "speed ratios with their range over the repeats:" in text
    assert "what the speed rows measure:" in text and "  throughput: the whole job" in text
    for workload in WORKLOADS:
        assert f"\n  {workload}: mpsboost vs stock: throughput " in text
    assert flat.count("over the repeats)") >= 6  # throughput and the operator, three workloads


@pytest.mark.slow  # the full demo
def test_demo_records_hold_every_section(demo_run):
    _, _, out = demo_run
    recs = read_jsonl(out / "demo.jsonl")
    assert sorted((r.workload.name, r.variant) for r in recs) == sorted(
        (w, v) for w in WORKLOADS for v in ("stock", "mpsboost")
    )
    for r in recs:
        assert r.throughput.value > 0 and r.throughput.unit in ("images/s", "tokens/s")
        (op,) = r.op_time.values()
        assert op.median_us > 0 and op.method == "perf_counter"
        assert r.correctness.reference == "cpu-fp32"
        # CPU fp32 against a CPU fp32 copy: stock is the same computation; patched recipes are lossless
        assert r.correctness.rel_error < 1e-4, (r.workload.name, r.variant, r.correctness)
        assert r.memory.driver_level > 0 and r.memory.allocator_reserved is None
        assert r.env.device_type == "cpu" and r.env.dtype == "float32"
    by = {(r.workload.name, r.variant): r for r in recs}
    vae = by["qwen_image_vae_decode", "stock"]
    assert vae.workload.shape["latent"] == [1, 16, 1, 16, 16] and vae.workload.shape["height"] == 128
    # the Qwen-Image VAE recipe takes every 5-D pad away
    assert vae.extra["pad_calls_5d"] > 0 and by["qwen_image_vae_decode", "mpsboost"].extra["pad_calls_5d"] == 0
    lm = by["qwen36_prefill", "mpsboost"]
    assert lm.workload.shape["prompt"] > 64 and lm.workload.shape["deltanet_layers"] == 3
    patched = {p.split(" @ ")[0] for p in lm.extra["patched"]}
    assert {"linear_attention", "moe_block", "moe_experts"} <= patched, patched
    assert (out / "demo.png").read_bytes()[:4] == b"\x89PNG"


def test_the_demo_models_are_the_seeds():
    """Qwen3.6's text model layout (3 Gated DeltaNet : 1 attention, routed + shared experts) whose gates keep
    the DeltaNet state across a 64-token chunk (transformers' random init decays it to zero within one)."""
    import torch
    import torch.nn.functional as F

    from mpsboost import demo
    from mpsboost.bench.models import build

    torch.manual_seed(0)
    lm, jobs, _ = demo._qwen36("cpu", torch.float32)  # the model the demo runs
    assert [j.name for j in jobs] == ["qwen36_prefill", "qwen36_decode"]
    layers = lm.model.layers
    kinds = [type(lay.linear_attn if hasattr(lay, "linear_attn") else lay.self_attn).__name__ for lay in layers]
    assert kinds == ["Qwen3_5MoeGatedDeltaNet"] * 3 + ["Qwen3_5MoeAttention"]
    assert layers[0].mlp.shared_expert is not None
    assert demo.PROMPT_TOKENS > 64

    def kept_over_a_chunk(deltanets) -> float:
        """The smallest fraction of the state a 64-token chunk keeps: exp(sum of the per-token gates)."""
        x = torch.randn(1, 64, lm.config.hidden_size, generator=torch.Generator().manual_seed(1))
        worst = 1.0
        with torch.no_grad():
            for m in deltanets:
                g = -m.A_log.float().exp() * F.softplus(m.in_proj_a(x).float() + m.dt_bias)
                worst = min(worst, g.sum(1).exp().min().item())
        return worst

    shown = [m for m in lm.modules() if type(m).__name__ == "Qwen3_5MoeGatedDeltaNet"]
    assert len(shown) == 3 and kept_over_a_chunk(shown) > 1e-2
    fresh = type(shown[0])(lm.config, 0)  # transformers' init: nothing crosses a chunk
    assert kept_over_a_chunk([fresh]) < 1e-20
    vae = build("qwen_image_vae:demo")
    assert type(vae).__name__ == "AutoencoderKLQwenImage" and vae.config.z_dim == 16
    assert vae.config.dim_mult == [1, 2, 4, 4] and vae.config.num_res_blocks == 2


def test_demo_lines_fit_a_terminal():
    from mpsboost.demo import WIDTH, fit, next_lines

    long = "  qwen36_decode: mpsboost vs stock: " + "throughput 1.00x (0.90x-1.10x over the repeats), " * 6
    wrapped = fit("short line\n" + long).splitlines()
    assert wrapped[0] == "short line" and len(wrapped) > 2
    assert all(len(r) <= WIDTH for r in wrapped) and all(r.startswith("    ") for r in wrapped[2:])
    assert " ".join(" ".join(wrapped[1:]).split()) == " ".join(long.split())  # nothing lost
    for device in ("mps", "cpu", "cuda"):
        lines = next_lines(device)
        assert lines[0].startswith("next: mpsboost doctor") and all(len(r) <= WIDTH for r in lines)
    assert "mpsboost selftest" in next_lines("mps")[1] and "--device mps" in next_lines("cpu")[1]


def test_missing_library_message_installs_this_project():
    from mpsboost.demo import _need

    with pytest.raises(SystemExit) as info:
        _need("mpsboost_no_such_package", "diffusers")
    msg = str(info.value)
    assert "needs mpsboost_no_such_package" in msg and "another project" in msg
    assert "[diffusers]'" in msg and "pip install -e '" in msg  # this checkout, editable, with the extra
    assert "pip install 'mpsboost[" not in msg  # never the index's other project


def test_missing_extras_are_found_before_any_work(monkeypatch, capsys):
    import importlib.util

    from mpsboost import demo

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real(name, *a)
    )

    def no_work(*a, **k):
        raise AssertionError("the demo started working before checking its extras")

    monkeypatch.setattr(demo, "run_demo", no_work)
    assert demo.main(["--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "needs transformers" in err and "transformers extra" in err and "diffusers" not in err.split("needs")[1][:20]


def _rec(name, variant, samples_s, op_us=None):
    """A record whose timing came from these per-call seconds (and operator microseconds)."""
    import torch

    from mpsboost.bench import Record, RecordEnv, Workload
    from mpsboost.bench.timing import _summarise

    t = _summarise(list(samples_s), calls=1, warmup=0, method="perf_counter")
    op = None
    if op_us is not None:
        o = _summarise([u * 1e-6 for u in op_us], calls=1, warmup=0, method="perf_counter")
        op = {"conv": o.op_time()}
    return Record(
        workload=Workload(name, {"n": 1}),
        variant=variant,
        env=RecordEnv.capture("cpu", torch.float32),
        throughput=t.throughput(4, "frames/s"),
        op_time=op,
    )


def test_ratio_lines_give_a_range_and_stay_quiet_on_a_quiet_machine():
    from mpsboost.demo import ratio_lines

    recs = [
        _rec("w", "stock", [2.0, 2.02, 2.04], [100, 101, 102]),
        _rec("w", "mpsboost", [1.0, 1.01, 1.02], [50, 50, 51]),
    ]
    lines = ratio_lines(recs, load_before=(0.1, 2))
    text = "\n".join(lines)
    assert "w: mpsboost vs stock: throughput 2.00x (1.96x-2.04x over the repeats)" in text
    assert "op conv 2.02x (1.96x-2.04x over the repeats)" in text
    if "load average" not in text:  # the machine running the tests may itself be busy
        assert "WARNING" not in text


def test_ratio_lines_warn_when_the_repeats_spread_too_far():
    from mpsboost.demo import BUSY_SPREAD, ratio_lines

    # stock's repeats spread 100% of its median: the ratio (here 2x) means nothing, and the text says so
    recs = [_rec("w", "stock", [1.0, 2.0, 3.0]), _rec("w", "mpsboost", [1.0, 1.0, 1.0])]
    text = "\n".join(ratio_lines(recs, load_before=(0.1, 2)))
    assert "throughput 2.00x (1.00x-3.00x over the repeats)" in text
    assert "WARNING: this machine was too busy" in text and "w throughput (repeats spread 100%)" in text
    assert BUSY_SPREAD < 1.0
    busy = "\n".join(
        ratio_lines([_rec("w", "stock", [1.0, 1.0]), _rec("w", "mpsboost", [1.0, 1.0])], load_before=(9.0, 2))
    )
    assert "WARNING" in busy and "load average 9.0 on 2 cores" in busy
    one = "\n".join(ratio_lines([_rec("w", "stock", [1.0]), _rec("w", "mpsboost", [0.5])], load_before=(0.1, 64)))
    assert "throughput 2.00x (one repeat: no spread)" in one


def test_measure_lines_explain_an_op_ratio_that_goes_the_other_way():
    from mpsboost.demo import measure_lines

    # The whole job 2x faster, its operator alone 4x slower: the text says what each measures and why.
    recs = [
        _rec("w", "stock", [2.0, 2.0, 2.0], [100, 100, 100]),
        _rec("w", "mpsboost", [1.0, 1.0, 1.0], [400, 400, 400]),
    ]
    text = "\n".join(measure_lines(recs))
    assert "throughput: the whole job" in text and "op conv: one call of that module alone" in text
    assert "w: mpsboost vs stock: op conv 0.25x but throughput 2.00x. These time different work" in text
    assert "Throughput is faster and op conv slower here" in text
    # The other way round is explained too.
    recs = [_rec("w", "stock", [1.0, 1.0], [400, 400]), _rec("w", "mpsboost", [2.0, 2.0], [100, 100])]
    text = "\n".join(measure_lines(recs))
    assert "op conv 4.00x but throughput 0.50x" in text and "Op conv is faster and throughput slower here" in text
    # Same direction: the legend only, no explanation line.
    same = measure_lines([_rec("w", "stock", [2.0, 2.0], [100, 100]), _rec("w", "mpsboost", [1.0, 1.0], [50, 50])])
    assert not any("These time different work" in line for line in same)
    assert any(line.startswith("  throughput: the whole job") for line in same)


def test_each_variant_times_its_operator_on_its_own_inputs(monkeypatch):
    """The patched job's operator is timed on the inputs the patched job hands it (captured in its own
    run), never on stock's captured inputs (which may differ in layout from what the patched job uses)."""
    import torch

    from mpsboost import demo

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    job = demo._Job(
        name="w",
        shape={},
        run=lambda: model(torch.ones(1, 4)),
        items=1,
        unit="frames/s",
        op_name="Linear",
        op_class="Linear",
        psnr=False,
        data_range=None,
        root=model,
    )
    monkeypatch.setattr(demo, "_qwen_image_vae", lambda device, dtype: (model, [job], lambda: job.run()))
    seen = []

    class _Rec:
        extra: dict = {}

        def replace(self, **kw):
            return self

    def fake_measure(j, variant, env, device, *, op, **kw):
        seen.append((variant, op))
        return _Rec(), torch.zeros(1)

    monkeypatch.setattr(demo, "_measure", fake_measure)
    demo.run_demo("cpu", torch.float32, repeats=1, models=("qwen_image_vae",))
    (v1, op1), (v2, op2) = seen
    assert (v1, v2) == ("stock", "mpsboost")
    assert op1 is not op2 and op2.module is None  # the patched run captures its own call
