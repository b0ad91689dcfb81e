"""Compiled mode: every forward that decode_linear, fp8_weights and softmax install traces with
``torch.compile(fullgraph=True)``, in every simulated environment, and computes what the eager patched
model computes.

Environments: CUDA sm_90 with the CUDA paths forced onto CPU tensors (``decode_linear`` path
``"triton"`` with ``cuda_eager``: the registered operator ``mpsboost::gemv`` in both modes; fp8 ``fused``:
``mpsboost::fp8_gemv`` and ``mpsboost::fp8_quantize_rows``; their CPU kernels are the plain-torch
references), MPS 2.14.1, MPS 2.15.0 and CPU, each with the default patch and with ``fp8="rowwise"``.

``torch.compile(..., fullgraph=True)`` raises on any graph break, so a compiled forward that runs is a
forward without one. The dynamo backend is ``"eager"`` (dynamo traces, fake kernels are used for the
registered operators, then the captured graph runs op by op): it tests what the issue was about (tracing)
without a C++ compiler run per case on a 2-core CPU; the inductor case is ``slow``.

transformers compiles the forward by itself for ``cache_implementation="static"`` only on CUDA/XPU/TPU
devices (``GenerationMixin._valid_auto_compile_criteria``). On CPU the test asks for the same thing
through its own switch: a ``CompileConfig`` with ``_compile_all_devices=True``, which makes
``generate()`` call ``torch.compile(self.__call__, **compile_config.to_dict())`` exactly as on a GPU.

``mac_compile`` (the opt-in compiled decode for a Mac) is tested on the seed's Qwen3.6 structure at toy width
under Mac 2.15.0 decisions, over whatever ``patch()`` installs there: one graph, no break, the eager tokens.

Tolerances: compiled and eager run the same aten ops with backend "eager", so logits agree to float
rounding (fp32: rtol 1e-5, atol 1e-5; bf16: rtol 1e-2, atol 1e-2) and greedy tokens exactly. The eager
reference for ``generate`` uses the same static cache with compilation disabled, so the only difference
is compilation.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import mpsboost
from mpsboost.gate import Env

ENVS = {
    "cuda_sm90": Env.simulate("cuda:9.0", "2.11.0"),
    "mps_2.14.1": Env.simulate("mps", "2.14.1"),
    "mps_2.15.0": Env.simulate("mps", "2.15.0"),
    "cpu": Env.simulate("cpu"),
}
# The CUDA decode path forced onto CPU tensors: the GEMV operator in eager and compiled mode.
# softmax keeps stock sampling on CUDA by default (no end-to-end gain measured); forced here so that its
# sampling step still runs around a compiled forward in the CUDA environment.
FORCE_CUDA = {"decode_linear": {"path": "triton", "cuda_eager": True}, "softmax": {"path": "logits"}}
LAYERS = 2  # generate(): more than one layer, so that a per-layer recompile would show as more than one graph
# A forward compiled alone: one layer. fullgraph=True refuses a break in any layer, and the layers run the same code
# (dynamo traces each one again: a second layer costs a third more tracing and checks nothing new).
FORWARD_LAYERS = 1
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1e-2, atol=1e-2)}


def _qwen3(dtype: torch.dtype, layers: int = LAYERS):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        intermediate_size=64,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return Qwen3ForCausalLM(cfg).to(dtype).eval()


def _patched(env_name: str, fp8: str | None, dtype: torch.dtype | None = None, layers: int = LAYERS):
    # fp8 in bf16: the dtype of the fused large-M path; on CUDA the opt-in quantised activations +
    # scaled_mm, so that both registered fp8 operators are traced (the default large-M path is plain torch).
    model = _qwen3(dtype or (torch.bfloat16 if fp8 else torch.float32), layers)
    options = None
    if env_name == "cuda_sm90":
        options = dict(FORCE_CUDA, **({"fp8_weights": {"activations": "fp8"}} if fp8 else {}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # rows that skip say why in the report
        report = mpsboost.patch(model, device=ENVS[env_name], fp8=fp8, options=options)
    return model, report


class _Counting:
    """A dynamo backend that records every graph it is given (one per compile or recompile)."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __deepcopy__(self, memo):
        return self  # transformers deep-copies its CompileConfig (and the backend in it)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def targets(self) -> set[str]:
        return {str(n.target) for g in self.graphs for n in g.graph.nodes if n.op == "call_function"}


def _mpsboost_ops(names: set[str]) -> set[str]:
    return {n.removesuffix(".default") for n in names if n.startswith("mpsboost.")}


CASES = [(e, f) for e in ENVS for f in (None, "rowwise")]


@pytest.mark.parametrize("env_name,fp8", CASES, ids=[f"{e}-{f or 'default'}" for e, f in CASES])
def test_fullgraph_forward_prefill_and_decode(env_name, fp8, rng_seed):
    model, report = _patched(env_name, fp8, layers=FORWARD_LAYERS)
    applied = {r.recipe for r in report.applied}
    if fp8:
        assert "fp8_weights" in applied
    if env_name in ("cuda_sm90", "mps_2.14.1"):
        assert "decode_linear" in applied
    ids = torch.randint(3, 128, (1, 20))  # 20 rows: above the GEMV's 16, so the fused large-M path runs
    step = torch.randint(3, 128, (1, 1))
    backend = _Counting()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=backend)  # raises on any graph break
    tol = TOL[model.dtype]
    with torch.no_grad():
        for x in (ids, step):  # prefill shape, then the one-token decode shape
            eager = model(input_ids=x).logits
            got = compiled(input_ids=x).logits
            torch.testing.assert_close(got, eager, **tol)
    ops = _mpsboost_ops(backend.targets())
    if env_name == "cuda_sm90":
        # The CUDA kernels were traced as registered operators, not skipped.
        assert "mpsboost.gemv" in ops, ops
        if fp8:
            assert {"mpsboost.fp8_gemv", "mpsboost.fp8_quantize_rows"} <= ops, ops
    elif env_name.startswith("mps"):
        # A Mac's attention decode step (attention_decode, traced as the recipe's step) runs its q/k norm and rotary
        # as mpsboost::attn_qk_rope_cache, and its fp8 decode mpsboost's Metal GEMV: each traced as the registered
        # operator (its fake gives the shape).
        assert ops == {"mpsboost.attn_qk_rope_cache"} | ({"mpsboost.fp8_gemv"} if fp8 else set()), ops
    else:
        assert not ops, ops
    torch._dynamo.reset()


def _generate(model, *, compiled_backend=None, new_tokens: int = 6, seed: int = 1) -> torch.Tensor:
    from transformers import CompileConfig

    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(seed))
    kw = dict(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
        cache_implementation="static",
    )
    if compiled_backend is None:
        kw["disable_compile"] = True
    else:
        # What generate() does by itself on a GPU (see the module docstring), asked for on CPU.
        cc = CompileConfig(fullgraph=True, backend=compiled_backend, mode=None)
        cc._compile_all_devices = True
        kw["compile_config"] = cc
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), **kw)


def _static_generate_case(env_name: str, fp8: str | None) -> None:
    """Greedy static-cache generate() with its compiled decode step equals eager's tokens, in one graph for the
    decode step of all LAYERS layers, and dynamo's own counters show no graph break and no recompilation (the 0.1.0
    failure was a break in every layer, then a recompile of every layer's resume function until the cache limit)."""
    from torch._dynamo.utils import counters

    model, _ = _patched(env_name, fp8)
    eager = _generate(model)
    backend = _Counting()
    torch._dynamo.reset()
    counters.clear()
    got = _generate(model, compiled_backend=backend)
    breaks, recompiles, stats = dict(counters["graph_break"]), dict(counters["recompiles"]), dict(counters["stats"])
    torch._dynamo.reset()
    assert torch.equal(got, eager), (got.tolist(), eager.tolist())
    assert len(backend.graphs) == 1, f"{len(backend.graphs)} graphs compiled for {LAYERS} layers"
    assert not breaks and not recompiles and stats.get("unique_graphs") == 1, (breaks, recompiles, stats)
    ops = _mpsboost_ops(backend.targets())
    if env_name == "cuda_sm90":
        assert ("mpsboost.fp8_gemv" if fp8 else "mpsboost.gemv") in ops, ops


@pytest.mark.parametrize("fp8", [None, "rowwise"], ids=["default", "rowwise"])
def test_static_cache_generate_compiled_cuda_path(fp8):
    _static_generate_case("cuda_sm90", fp8)


SLOW_GEN = [(e, f) for e in ENVS if e != "cuda_sm90" for f in (None, "rowwise")]


@pytest.mark.slow
@pytest.mark.parametrize("env_name,fp8", SLOW_GEN, ids=[f"{e}-{f or 'default'}" for e, f in SLOW_GEN])
def test_static_cache_generate_compiled_other_envs(env_name, fp8):
    _static_generate_case(env_name, fp8)


def test_sampling_step_around_a_compiled_forward():
    """softmax binds no forward: with do_sample=True, generate() runs the patched (sync-free) sampling step
    eagerly around the compiled forward; the same seed gives the same tokens as without compilation."""
    from transformers import CompileConfig

    model, report = _patched("cuda_sm90", None, layers=FORWARD_LAYERS)
    assert any(r.recipe == "softmax" for r in report.applied)
    ids = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(2))
    kw = dict(
        attention_mask=torch.ones_like(ids),
        max_new_tokens=5,
        min_new_tokens=5,
        do_sample=True,
        pad_token_id=0,
        cache_implementation="static",
    )
    cc = CompileConfig(fullgraph=True, backend="eager", mode=None)
    cc._compile_all_devices = True
    with torch.no_grad():
        torch.manual_seed(11)
        eager = model.generate(ids, disable_compile=True, **kw)
        torch._dynamo.reset()
        torch.manual_seed(11)
        compiled = model.generate(ids, compile_config=cc, **kw)
    torch._dynamo.reset()
    assert torch.equal(compiled, eager), (compiled.tolist(), eager.tolist())


@pytest.mark.parametrize("env_name", ["cuda_sm90", pytest.param("mps_2.15.0", marks=pytest.mark.slow)])
def test_fp8_experts_forward_compiles(env_name, rng_seed):
    """The fp8 experts forward: decode (few pairs: gather) and prefill (many pairs: the traceable stack
    path where eager mode would read the hit experts on the host), fullgraph, equal to eager."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=FORWARD_LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        norm_topk_prob=True,
    )
    model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = mpsboost.patch(model, recipes=["fp8_weights"], fp8="rowwise", device=ENVS[env_name])
    experts = [r for r in report.applied if r.target.endswith("experts")]
    assert experts and all("compiled:" in r.reason for r in experts), [r.reason for r in experts]
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with torch.no_grad():
        for x in (torch.randint(3, 128, (2, 12)), torch.randint(3, 128, (1, 1))):
            torch.testing.assert_close(compiled(input_ids=x).logits, model(input_ids=x).logits, **TOL[torch.bfloat16])
    torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.parametrize("fp8", [None, "rowwise"], ids=["default", "rowwise"])
def test_inductor_compiles_the_forced_cuda_path(fp8):
    """The forced CUDA paths through inductor (fake kernels, then the CPU reference kernels), bf16.

    Inductor fuses the bf16 elementwise work between operators and keeps it in fp32 where eager mode
    rounds after every op, so bounds are on whole tensors. Default patch: relative error (norm) <= 1e-2
    against eager. fp8: the activations are quantised per row, which turns those roundings into different
    fp8 codes (measured: 2.3% at a 20-token prefill), so both are held to the same quality against the
    stock bf16 model instead: SQNR >= 20 dB and within 1 dB of each other, and <= 5e-2 apart.
    """
    from mpsboost.ops.fp8 import sqnr_db

    model, _ = _patched("cuda_sm90", fp8, dtype=torch.bfloat16, layers=FORWARD_LAYERS)
    stock = _qwen3(torch.bfloat16, layers=FORWARD_LAYERS)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        for x in (torch.randint(3, 128, (1, 20)), torch.randint(3, 128, (1, 1))):
            got, ref = compiled(input_ids=x).logits.float(), model(input_ids=x).logits.float()
            err = ((got - ref).norm() / ref.norm()).item()
            if fp8 is None:
                assert err <= 1e-2, err
            else:
                base = stock(input_ids=x).logits.float()
                q_got, q_ref = sqnr_db(got, base), sqnr_db(ref, base)
                assert err <= 5e-2 and q_got >= 20.0 and abs(q_got - q_ref) <= 1.0, (err, q_got, q_ref)
    torch._dynamo.reset()


# ------------------------------------------------------------------------------------------ real GPU


def _cuda_model(dtype=torch.bfloat16):
    model = _qwen3(dtype)
    return model.to("cuda")


def _cuda_generate(model, compiled: bool) -> tuple[torch.Tensor, dict]:
    """Greedy static-cache generate(); with ``compiled`` transformers compiles the forward by itself (on
    CUDA no compile_config is needed). Returns the tokens and dynamo's break/recompile/graph counts."""
    from torch._dynamo.utils import counters

    ids = torch.randint(3, 128, (1, 8), generator=torch.Generator().manual_seed(3)).to("cuda")
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=16,
            min_new_tokens=16,
            do_sample=False,
            pad_token_id=0,
            cache_implementation="static",
            disable_compile=not compiled,
        )
    stats = {
        "breaks": sum(counters["graph_break"].values()),
        "recompiles": sum(counters["recompiles"].values()),
        "graphs": counters["stats"]["unique_graphs"],
    }
    torch._dynamo.reset()
    return out, stats


@pytest.mark.cuda
@pytest.mark.parametrize("fp8", [None, "rowwise"], ids=["default", "rowwise"])
def test_cuda_static_cache_generate_compiled(fp8):
    """On a real GPU: transformers' own compiled static-cache generate() of the patched model gives the
    tokens of the stock compiled model (default patch: lossless; fp8: against the patched model's eager
    static-cache run, since fp8 changes the numbers), without a graph break and with no more graphs or
    recompiles than the stock model (0.1.0: a break in every layer, then a recompile of each)."""
    if fp8 and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability >= 8.9")
    ref, stock_stats = _cuda_generate(_cuda_model(), compiled=True)
    assert stock_stats["graphs"] >= 1, stock_stats  # transformers did compile the forward
    model = _cuda_model()
    report = mpsboost.patch(model, fp8=fp8)
    if fp8:
        ref, _ = _cuda_generate(model, compiled=False)
    got, stats = _cuda_generate(model, compiled=True)
    assert stats["breaks"] == 0, stats
    assert stats["graphs"] <= stock_stats["graphs"] and stats["recompiles"] <= stock_stats["recompiles"], (
        stats,
        stock_stats,
    )
    assert torch.equal(got, ref), (got.tolist(), ref.tolist(), str(report))


@pytest.mark.cuda
def test_cuda_static_cache_generate_compiled_with_the_gemv_operator():
    """decode_linear forced onto its Triton operator in both modes (fp32, so that cuBLAS and the kernel
    agree far below any greedy margin): transformers' compiled static-cache generate() (inductor,
    reduce-overhead) runs it inside the graph and gives the stock compiled tokens."""
    pytest.importorskip("triton")
    ref, stock_stats = _cuda_generate(_cuda_model(torch.float32), compiled=True)
    model = _cuda_model(torch.float32)
    mpsboost.patch(model, recipes=["decode_linear"], options=FORCE_CUDA)
    got, stats = _cuda_generate(model, compiled=True)
    assert stats["breaks"] == 0, stats
    assert stats["graphs"] <= stock_stats["graphs"] and stats["recompiles"] <= stock_stats["recompiles"], (
        stats,
        stock_stats,
    )
    assert torch.equal(got, ref), (got.tolist(), ref.tolist())


# ------------------------------------------------------------------------------------------ mac_compile


def _qwen36_tiny(dtype: torch.dtype = torch.float32):
    """The seed's Qwen3.6-35B-A3B structure at toy width (3 Gated DeltaNet + 1 attention layer, a MoE block with
    a shared expert in each): the shipped tiny config, random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from mpsboost.bench import models

    data = models.config("qwen3_5_moe", "tiny", "config.json")
    cfg = AutoConfig.for_model(data.pop("model_type"), **data)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()


def test_mac_compile_decode_step_is_one_graph_without_breaks_and_gives_the_eager_tokens():
    """``mac_compile`` under Mac 2.15.0 decisions (whatever ``patch()`` installs there): transformers compiles the
    static-cache decode step itself, as it would on a Mac with mac_compile. Counted by dynamo without
    ``fullgraph`` (a break would be counted, not raised): 0 graph breaks, one graph for every decode step of every
    layer, no recompilation; then with ``fullgraph=True`` (which raises on any break). Greedy tokens equal the
    eager patched model's and stock's (fp32, lossless recipes)."""
    from torch._dynamo.utils import counters

    from mpsboost.recipes.linear_attention import mac_compile

    model = _qwen36_tiny()
    ids = torch.randint(3, 256, (1, 7), generator=torch.Generator().manual_seed(3))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        stock = model.generate(ids, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = mpsboost.patch(model, device=ENVS["mps_2.15.0"])
    applied = {r.recipe for r in report.applied}
    assert {"linear_attention", "moe_experts"} <= applied, str(report)
    with torch.no_grad():
        eager = model.generate(ids, **kw)  # what a Mac runs without mac_compile: eager, dynamic cache
    assert torch.equal(eager, stock), (eager.tolist(), stock.tolist())
    for fullgraph in (False, True):
        undo = mac_compile(model, backend="eager", fullgraph=fullgraph)
        torch._dynamo.reset()
        counters.clear()
        try:
            with torch.no_grad():
                compiled = model.generate(ids, cache_implementation="static", **kw)
            breaks = dict(counters["graph_break"])
            graphs = counters["stats"]["unique_graphs"]
            recompiles = dict(counters["recompiles"])
        finally:
            undo()
            torch._dynamo.reset()
        assert not breaks, breaks
        assert graphs == 1, f"{graphs} graphs for the decode step (fullgraph={fullgraph})"
        assert not recompiles, recompiles
        assert torch.equal(compiled, eager), (fullgraph, compiled.tolist(), eager.tolist())
    assert model.generation_config.compile_config is None  # undo() put the model's own config back
