"""decode_linear: plans per env, the [B,K] fold path against stock on tiny real models, unpatch identity,
the Triton GEMV kernel (CPU interpreter; and on CUDA where present)."""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

import mpsboost
from mpsboost.gate import Env
from mpsboost.ops import gemv_triton
from mpsboost.recipes import decode_linear as recipe_mod
from mpsboost.registry import Match, get_recipe, make_options

from tiny_models import build, run

FOLD = {"decode_linear": {"path": "fold"}}


def _linears(model):
    return [(n, m) for n, m in model.named_modules() if type(m) is torch.nn.Linear]


@pytest.fixture(scope="module")
def qwen3():
    return build("qwen3").eval()


def test_plan_per_env(qwen3):
    n_lin = len(_linears(qwen3))
    cases = {
        ("mps", "2.14.1"): ("would apply", "[B,K] layout", "pytorch#189855"),
        ("mps", "2.15.0"): ("skipped", None, "native path"),
        ("mps", "2.16.0.dev20261201"): ("skipped", None, "native path"),
        ("cpu", "2.13.0"): ("skipped", None, "nothing to gain"),
    }
    for (dev, tv), (status, backing, why) in cases.items():
        rows = mpsboost.plan(qwen3, device=dev, torch_version=tv, recipes=["decode_linear"]).rows
        assert len(rows) == n_lin, (dev, tv)
        for r in rows:
            assert r.status == status, (dev, tv, r)
            if backing:
                assert r.backing.startswith(backing)
            assert why in r.reason, (dev, tv, r.reason)


def _fake_table(monkeypatch, graph: dict, compiled: dict | None = None):
    """Replace the decode_linear_gemv tuning file by one with these entries (same provenance fields)."""
    import dataclasses

    from mpsboost import tuning

    real = tuning.load(recipe_mod.TUNING)
    rows = lambda t: [{"n": n, "k": k, "bias": b, "dtype": dt, "speedup": v} for (n, k, b, dt), v in t.items()]  # noqa: E731
    fake = dataclasses.replace(
        real,
        source="benchmarks/results/decode_linear-cuda-test.jsonl",
        entries={"cuda_graph": rows(graph), "compiled": rows(compiled or {})},
    )
    orig = tuning.load
    monkeypatch.setattr(tuning, "load", lambda name: fake if name == recipe_mod.TUNING else orig(name))
    return fake


def test_plan_cuda_follows_the_measured_table(qwen3, monkeypatch):
    # Which shapes get Triton on CUDA is data (the tuning file), not a guess: fake one entry.
    q = qwen3.model.layers[0].self_attn.q_proj
    key = (q.out_features, q.in_features, q.bias is not None, "float32")
    _fake_table(monkeypatch, {key: 1.4})
    # By default nothing is bound: the win is inside CUDA graphs captured by hand, a mode neither eager
    # generate() nor torch.compile reaches.
    default = mpsboost.plan(qwen3, device="cuda:9.0", torch_version="2.11.0", recipes=["decode_linear"]).rows
    assert {r.status for r in default} == {"skipped"}
    graph_only = [r for r in default if "only inside CUDA graphs you capture yourself" in r.reason]
    assert graph_only and all("1.40x over cuBLAS" in r.reason and "cuda_graphs" in r.reason for r in graph_only)
    rows = mpsboost.plan(
        qwen3,
        device="cuda:9.0",
        torch_version="2.11.0",
        recipes=["decode_linear"],
        options={"decode_linear": {"cuda_graphs": True}},
    ).rows
    applied = {r.target for r in rows if r.status == "would apply"}
    q_paths = {n for n, m in _linears(qwen3) if (m.out_features, m.in_features, m.bias is not None, "float32") == key}
    assert applied == q_paths and applied
    for r in rows:
        if r.status == "would apply":
            assert "1.40x over cuBLAS" in r.reason and "decode_linear-cuda-test.jsonl" in r.reason, r.reason
            # Compiled mode was not measured: it steps aside, and says so.
            assert "compiled: stock F.linear; no compiled end-to-end measurement shows a gain" in r.reason
            assert "H200" in r.reason  # the device the file names, not a hard-coded label
        else:
            assert "cuBLAS" in r.reason
    # Another GPU generation was not measured: cuBLAS everywhere, and the reason names the file used.
    rows80 = mpsboost.plan(qwen3, device="cuda:8.0", torch_version="2.11.0", recipes=["decode_linear"]).rows
    assert {r.status for r in rows80} == {"skipped"}
    assert "decode_linear_gemv" in rows80[0].reason and "this is sm_80" in rows80[0].reason, rows80[0].reason


def test_compiled_measurement_flips_the_compiled_decision(qwen3, monkeypatch):
    """A compiled-mode entry in the data file (and nothing in code) turns the operator on under torch.compile."""
    q = qwen3.model.layers[0].self_attn.q_proj
    key = (q.out_features, q.in_features, q.bias is not None, "float32")
    recipe = get_recipe("decode_linear")
    env = Env.simulate("cuda:9.0", "2.11.0")
    _fake_table(monkeypatch, {}, {key: 1.3})
    d = recipe.decide(Match(q, "q"), env, make_options(recipe, {}))
    assert d.applicable and d.details["eager"] == "stock" and d.details["compiled"] == "gemv", d
    assert "1.30x over cuBLAS measured under torch.compile" in d.reason
    _fake_table(monkeypatch, {key: 1.4}, {})
    assert not recipe.decide(Match(q, "q"), env, make_options(recipe, {})).applicable
    d = recipe.decide(Match(q, "q"), env, make_options(recipe, {"cuda_graphs": True}))
    assert d.details["eager"] == "gemv_graph" and d.details["compiled"] == "stock", d


def test_committed_h200_table_picks_small_projections():
    """The committed table: Qwen2.5-0.5B's q/k/o projections won on the H200, its MLP and lm_head did not."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=1,
        num_attention_heads=14,
        num_key_value_heads=2,
    )
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    rows = {
        r.target.rsplit(".", 1)[-1]: r
        for r in mpsboost.plan(
            model,
            device="cuda:9.0",
            torch_version="2.11.0",
            recipes=["decode_linear"],
            options={"decode_linear": {"cuda_graphs": True}},
        ).rows
    }
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert rows[name].status == "would apply" and rows[name].backing == "triton GEMV, fused bias", rows[name]
        assert "inside CUDA graphs only" in rows[name].reason
        assert "compiled: stock F.linear" in rows[name].reason
    for name in ("gate_proj", "up_proj", "down_proj", "lm_head"):
        assert rows[name].status == "skipped" and "cuBLAS measured as fast or faster" in rows[name].reason


def test_only_model_linears_are_targets():
    stray = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    rows = mpsboost.plan(stray, device="mps", torch_version="2.14.1", recipes=["decode_linear"]).rows
    assert [r.status for r in rows] == ["not applicable"]


@pytest.mark.parametrize("name,dtype,tol", [("qwen3", "float32", 1e-6), ("llama", "bfloat16", 2e-2)])
def test_fold_matches_stock_on_tiny_lms(name, dtype, tol, rng_seed):
    model = build(name, dtype=dtype).eval()
    ref = run(name, model, rng_seed, batch=2, prompt=5, steps=3)
    report = mpsboost.patch(model, recipes=["decode_linear"], options=FOLD)
    assert len(report.by_status("applied")) == len(_linears(model))
    got = run(name, model, rng_seed, batch=2, prompt=5, steps=3)
    err = ((got - ref).norm() / ref.norm()).item()
    assert err <= tol, err
    mpsboost.unpatch(model)


def test_fold_matches_stock_on_tiny_diffusers_transformer(rng_seed):
    tr = build("wan_transformer").eval()
    ref = run("wan_transformer", tr, rng_seed)
    report = mpsboost.patch(tr, recipes=["decode_linear"], options=FOLD)
    assert report.by_status("applied")
    got = run("wan_transformer", tr, rng_seed)
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-6), (got - ref).abs().max()
    mpsboost.unpatch(tr)


def test_decode_step_feeds_linear_2d_rows_only(qwen3):
    """Structural proof of the fold: in a one-token step every F.linear sees a 2-D [B, K] input."""
    ids = torch.randint(3, 128, (2, 1))
    mpsboost.patch(qwen3, recipes=["decode_linear"], options=FOLD)
    try:
        with mock.patch("torch.nn.functional.linear", wraps=F.linear) as spy, torch.no_grad():
            qwen3(input_ids=ids)
        ranks = [c.args[0].dim() for c in spy.call_args_list]
        assert len(ranks) == len(_linears(qwen3)) and set(ranks) == {2}, ranks
        # Prefill (rows > 1) keeps the stock 3-D call.
        with mock.patch("torch.nn.functional.linear", wraps=F.linear) as spy, torch.no_grad():
            qwen3(input_ids=torch.randint(3, 128, (2, 4)))
        assert {c.args[0].dim() for c in spy.call_args_list} == {3}
    finally:
        mpsboost.unpatch(qwen3)


def test_unpatch_restores_identical_forwards():
    model = build("qwen3").eval()
    lin = model.model.layers[0].mlp.down_proj
    hooked = model.model.layers[1].mlp.down_proj
    sentinel = hooked.forward  # a bound method stored on the instance, as accelerate's hooks do
    hooked.forward = sentinel
    before = {n: m.__dict__.get("forward") for n, m in _linears(model)}
    report = mpsboost.patch(model, recipes=["decode_linear"], options=FOLD)
    skipped = [r for r in report.rows if r.status == "skipped"]
    assert [r.target for r in skipped] == ["model.layers.1.mlp.down_proj"]
    assert "wrapped on this instance" in skipped[0].reason
    assert "forward" in lin.__dict__
    mpsboost.unpatch(model)
    after = {n: m.__dict__.get("forward") for n, m in _linears(model)}
    assert after.keys() == before.keys()
    assert all(after[k] is before[k] for k in before)
    assert "forward" not in lin.__dict__ and lin.forward.__func__ is torch.nn.Linear.forward
    assert hooked.forward is sentinel


def test_bad_option_is_a_clear_error(qwen3):
    with pytest.raises(mpsboost.PatchError, match="path"):
        mpsboost.plan(qwen3, recipes=["decode_linear"], options={"decode_linear": {"path": "fast"}})


# ------------------------------------------------------------------------------ the Triton kernel

_INTERPRETED = r"""
import sys
import torch, torch.nn.functional as F
import triton.runtime.interpreter as ti
# numpy >= 2.4 refuses int() of the 1-element arrays the triton 3.6 interpreter uses for scalars.
_orig = ti._patch_lang_tensor
def _patch(tensor, scope):
    _orig(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
ti._patch_lang_tensor = _patch
from mpsboost.ops import gemv_triton
torch.manual_seed(int(sys.argv[1]))
for n, k, bias, dtype, tol in [(96, 200, True, torch.bfloat16, 8e-3), (37, 1030, False, torch.float32, 1e-6),
                               (16, 64, True, torch.float32, 1e-6), (40, 520, True, torch.float16, 3e-3)]:
    x = torch.randn(1, k, dtype=dtype)
    w = torch.randn(n, k, dtype=dtype)
    b = torch.randn(n, dtype=dtype) if bias else None
    # The Triton launch itself: on CPU tensors the registered operator would run its torch reference.
    y = gemv_triton._launch(x, w, b, gemv_triton.block_n_for(n, 264))
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    err = ((y.double() - ref).norm() / ref.norm()).item()
    assert y.dtype == dtype and y.shape == (1, n), (y.dtype, y.shape)
    assert err < tol, (n, k, bias, dtype, err)
    print(n, k, bias, dtype, err)
"""


def test_triton_gemv_interpreted(rng_seed):
    """The kernel itself, run by Triton's CPU interpreter (which must be on before triton is imported)."""
    pytest.importorskip("triton")
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run(
        [sys.executable, "-c", _INTERPRETED, str(rng_seed)], env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert len(res.stdout.strip().splitlines()) == 4


def test_gemv_operator_reference_and_fake(rng_seed):
    """torch.ops.mpsboost.gemv on CPU runs its reference (fp32 sums, bias in fp32, one rounding);
    opcheck verifies schema, fake kernel and dispatch."""
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 8e-3)):
        x = torch.randn(1, 96, dtype=dtype)
        w = torch.randn(40, 96, dtype=dtype)
        b = torch.randn(40, dtype=dtype)
        y = gemv_triton.gemv(x, w, b, 4)
        ref = F.linear(x.double(), w.double(), b.double())
        assert y.dtype == dtype and y.shape == (1, 40)
        assert ((y.double() - ref).norm() / ref.norm()).item() < tol
        torch.library.opcheck(torch.ops.mpsboost.gemv.default, (x, w, b, 4))
        torch.library.opcheck(torch.ops.mpsboost.gemv.default, (x, w, None, 1))


def test_forced_triton_path_compiles_fullgraph_on_cpu_tensors(rng_seed):
    """The CUDA decode forward forced onto CPU tensors: eager and compiled run the operator, equal."""
    lin = torch.nn.Linear(64, 48).requires_grad_(False)
    recipe = get_recipe("decode_linear")
    env = Env.simulate("cuda:9.0", "2.11.0")
    opts = make_options(recipe, {"path": "triton", "cuda_eager": True})
    m = Match(lin, "lin")
    undo = recipe.apply(m, recipe.decide(m, env, opts), env, opts)
    x = torch.randn(1, 1, 64)
    with mock.patch.object(gemv_triton, "gemv", wraps=gemv_triton.gemv) as spy:
        eager = lin(x)
    assert spy.call_count == 1
    torch._dynamo.reset()
    compiled = torch.compile(lin, fullgraph=True, backend="eager")(x)
    torch._dynamo.reset()
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(eager, F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    undo()


def test_block_n_gives_every_sm_work():
    programs = recipe_mod.GEMV_PROGRAMS
    assert programs == 264  # two per SM of the H200 the tuning file was measured on
    assert gemv_triton.block_n_for(151936, programs) == 16
    assert gemv_triton.block_n_for(1024, programs) == 2
    assert gemv_triton.block_n_for(128, programs) == 1
    assert all(-(-n // gemv_triton.block_n_for(n, programs)) >= min(n, programs) for n in (32, 512, 2048, 4096, 30720))
    assert gemv_triton.block_n_for(1024, 64) == 16


def test_make_forward_needs_the_gemv_launch_width():
    from mpsboost.ops.linear import make_forward

    with pytest.raises(ValueError, match="gemv_block_n"):
        make_forward("gemv_graph", "stock")
    with pytest.raises(ValueError, match="eager path only"):
        make_forward("stock", "gemv_graph", gemv_block_n=4)
    assert make_forward("fold", "stock").__name__ == "forward_fold_compiled_stock"


@pytest.mark.cuda
@pytest.mark.parametrize(
    "n,k,bias", [(1024, 1024, False), (512, 2880, True), (151936, 1024, False), (18432, 3072, True), (37, 100, True)]
)
def test_triton_gemv_cuda_matches_cublas(n, k, bias):
    pytest.importorskip("triton")
    torch.manual_seed(n + k)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None
    y = gemv_triton.gemv(x, w, b, gemv_triton.block_n_for(n, recipe_mod.GEMV_PROGRAMS))
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    stock = F.linear(x, w, b)
    err = ((y.double() - ref).norm() / ref.norm()).item()
    err_stock = ((stock.double() - ref).norm() / ref.norm()).item()
    assert err < 8e-3 and err < 3 * err_stock + 1e-3, (err, err_stock)


@pytest.mark.cuda
def test_triton_path_in_cuda_graph_only_by_default():
    pytest.importorskip("triton")
    lin = torch.nn.Linear(256, 512, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
    recipe = get_recipe("decode_linear")
    env = Env.detect("cuda")
    m = Match(lin, "lin")
    opts = make_options(recipe, {"path": "triton"})
    d = recipe.decide(m, env, opts)
    undo = recipe.apply(m, d, env, opts)
    x = torch.randn(1, 1, 256, device="cuda", dtype=torch.bfloat16)
    with mock.patch.object(gemv_triton, "gemv", wraps=gemv_triton.gemv) as spy:
        eager = lin(x)
        assert spy.call_count == 0  # eager stays on cuBLAS
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            lin(x)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = lin(x)
        g.replay()
        torch.cuda.synchronize()
        assert spy.call_count >= 1
    assert torch.allclose(out, eager, rtol=2e-2, atol=2e-2)
    undo()
    assert "forward" not in lin.__dict__


@pytest.mark.cuda
@pytest.mark.parametrize("compiled_path", ["stock", "gemv"])
def test_compiled_forward_on_cuda_inductor(compiled_path):
    """On a GPU, inductor compiles the bound forward (fullgraph) with the compiled-mode path either way,
    and equals the eager forward."""
    pytest.importorskip("triton")
    from mpsboost.ops.linear import make_forward
    from mpsboost.patching import bind_forward

    torch.manual_seed(0)
    lin = torch.nn.Linear(1024, 2048, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
    block_n = gemv_triton.block_n_for(lin.out_features, recipe_mod.GEMV_PROGRAMS)
    undo = bind_forward(lin, "decode_linear", make_forward("gemv_graph", compiled_path, gemv_block_n=block_n))
    x = torch.randn(1, 1, 1024, device="cuda", dtype=torch.bfloat16)
    eager = F.linear(x, lin.weight, lin.bias)
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(lin, fullgraph=True)(x)
    torch._dynamo.reset()
    torch.testing.assert_close(got, eager, rtol=2e-2, atol=2e-2)
    undo()


@pytest.mark.parametrize("name", ["decode_linear_gemv", "fp8_gemv", "softmax_sampling"])
def test_tuning_files_carry_their_provenance(name):
    """The tuning files these recipes read: every provenance field filled, the source records committed,
    and the file applies to its own device only (an sm_80 GPU is told which file it did not match)."""
    from pathlib import Path

    from mpsboost import tuning

    t = tuning.load(name)
    assert t.name == name and t.device and t.torch and t.date and t.command and t.spread and t.entries
    assert (Path(__file__).resolve().parents[2] / t.source).is_file(), t.source
    own = Env.simulate(f"cuda:{t.capability[0]}.{t.capability[1]}", "2.11.0")
    assert tuning.for_env(name, own)[0] is t
    none, why = tuning.for_env(name, Env.simulate("cuda:8.0", "2.11.0"))
    assert none is None and name in why and "sm_80" in why
