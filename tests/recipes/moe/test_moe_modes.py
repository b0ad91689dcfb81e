"""moe_experts across the ways a user runs a model: explicit experts implementations, odd widths,
torch.compile(fullgraph=True) and generate() with a static cache, in simulated environments (CPU tensors).

Random weights and inputs (seed per test from ``rng_seed``); tolerances are relative errors of whole outputs.
"""

from __future__ import annotations

import copy

import contextlib
from unittest import mock

import pytest
import torch
from mpsboost.bench import relative_error

import mpsboost
from mpsboost import patching
from mpsboost.ops import moe as moe_ops
from mpsboost.recipes import moe_experts as recipe_mod
from test_moe_zoo import _init

FP32_TOL = 1e-5  # patched vs transformers eager, fp32 (different summation order only)
BF16_TOL = 2e-2  # bf16: different accumulation order and rounding points
# Eager against compiled in bf16: inductor keeps fused intermediates in fp32, so the two round at
# different points; each lands about 1e-2 from the fp32 model and, over some 60 seeds, up to 2.4e-2 from
# the other (a token near a top-k tie can take another expert). A broken path is at ~1.
COMPILED_BF16_TOL = 5e-2
COMPILED_FP32_TOL = 1e-4  # inductor's fused reductions reorder fp32 sums


def _lm(
    kind: str,
    *,
    dtype=torch.float32,
    layers: int = 2,
    inter: int = 16,
    impl: str | None = None,
    decisive_router: bool | None = None,
):
    """A tiny causal LM of ``kind`` with random weights; ``impl``: an experts implementation set in the
    config before the model is built (as ``from_pretrained(..., experts_implementation=...)`` does).

    ``decisive_router`` (default: in bf16) scales the router weights by 20 so that no token's top-k is a
    near tie: two evaluation orders of one bf16 model may otherwise pick different experts for a token
    (about one seed in eight here), which changes that token's output entirely and is not what the
    patched-vs-stock comparisons measure."""
    import transformers as T

    common = dict(
        vocab_size=96,
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    )
    if kind == "mixtral":
        cfg = T.MixtralConfig(intermediate_size=inter, num_local_experts=8, head_dim=8, **common)
    elif kind == "olmoe":
        cfg = T.OlmoeConfig(intermediate_size=inter, num_experts=8, **common)
    elif kind == "qwen2_moe":
        cfg = T.Qwen2MoeConfig(
            intermediate_size=48,
            moe_intermediate_size=inter,
            shared_expert_intermediate_size=32,
            num_experts=8,
            **common,
        )
    elif kind == "qwen3_moe":
        cfg = T.Qwen3MoeConfig(intermediate_size=48, moe_intermediate_size=inter, num_experts=8, head_dim=8, **common)
    else:
        raise KeyError(kind)
    if impl is not None:
        cfg._experts_implementation = impl
    model = _init(T.AutoModelForCausalLM.from_config(cfg), 0.3)
    if decisive_router if decisive_router is not None else dtype == torch.bfloat16:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.gate.weight.mul_(20)
    return model.to(dtype)


def _experts_modules(model):
    return [m for m in model.modules() if recipe_mod._is_hf_experts(m)]


@contextlib.contextmanager
def _spy_recipe(unique: bool = False):
    """The paths of the recipe's calls, in order; ``unique``: each path once (a dict's keys), for compiled code: a
    call that appends to a list changes its length, which dynamo guards on, and recompiles the next step."""
    calls = {} if unique else []
    real = moe_ops.routed_experts

    def spy(*a, **k):
        if unique:
            calls[k["path"]] = None
        else:
            calls.append(k["path"])
        return real(*a, **k)

    with mock.patch.object(recipe_mod.moe_ops, "routed_experts", spy):
        yield calls


# ----------------------------------------------------------------------------------------- 1. explicit choices

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["mixtral", "olmoe", "qwen2_moe", "qwen3_moe"])
def test_explicit_choice_after_patch_takes_effect(kind, device, rng_seed):
    """What transformers' test_eager_matches_batched_and_grouped_inference checks, on a patched model:
    each set_experts_implementation() runs that implementation (and nothing else), results match eager."""
    from transformers.integrations.moe import batched_mm_experts_forward, grouped_mm_experts_forward

    model = _lm(kind).eval().to(device)
    ids = torch.randint(0, 96, (3, 9), device=device)
    with torch.no_grad():
        model.set_experts_implementation("eager")
        eager = model(ids).logits
        model.set_experts_implementation("grouped_mm")
        # Eager on CUDA the recipe's default hands calls to transformers' own kernels (bound at patch
        # time, so the mocks below could not see them); cuda_eager=True takes the recipe's paths, which
        # is what "the recipe ran" counts.
        options = {"moe_experts": {"cuda_eager": True}} if device == "cuda" else None
        report = mpsboost.patch(model, recipes=["moe_experts"], options=options)
        rows = [r for r in report.rows if r.recipe == "moe_experts"]
        assert rows and all(r.status == "applied" for r in rows), report
        assert model.config._experts_implementation is recipe_mod.OWNED
        with _spy_recipe() as recipe_calls:
            ours = model(ids).logits
        assert len(recipe_calls) == 2  # both layers ran the recipe
        assert relative_error(ours, eager) <= FP32_TOL

        mocks = {
            "batched_mm": mock.Mock(wraps=batched_mm_experts_forward),
            "grouped_mm": mock.Mock(wraps=grouped_mm_experts_forward),
        }
        outs = {}
        with (
            mock.patch.dict("transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS._global_mapping", mocks),
            _spy_recipe() as recipe_calls,
        ):
            for impl in ("eager", "batched_mm", "grouped_mm"):
                model.set_experts_implementation(impl)
                assert model.config._experts_implementation == impl
                assert type(model.config._experts_implementation) is str  # the user's value, not the recipe's
                outs[impl] = model(ids).logits
                for name, m in mocks.items():
                    assert m.called == (name == impl), f"{impl}: {name} called={m.called}"
                    m.reset_mock()
        assert recipe_calls == [], "the recipe ran after an explicit choice"
    for impl, out in outs.items():
        assert relative_error(out, eager) <= FP32_TOL, impl
    mpsboost.unpatch(model)
    assert model.config._experts_implementation == "grouped_mm"  # the user's last choice stays


@pytest.mark.parametrize("impl", ["eager", "batched_mm"])
def test_choice_before_patch_makes_the_recipe_step_aside(impl, rng_seed):
    model = _lm("qwen3_moe", impl=impl).eval()
    assert model.config._experts_implementation == impl
    ids = torch.randint(0, 96, (2, 7))
    with torch.no_grad():
        ref = model(ids).logits
        report = mpsboost.patch(model)
        rows = [r for r in report.rows if r.recipe == "moe_experts"]
        assert len(rows) == 2 and all(r.status != "applied" for r in rows)
        assert all(f"experts_implementation={impl!r}" in r.reason and "explicitly" in r.reason for r in rows)
        assert all("forward" not in m.__dict__ for m in _experts_modules(model))
        assert "_optimize_model_for_decode" not in model.__dict__
        with _spy_recipe() as calls:
            out = model(ids).logits
    assert calls == []
    assert torch.equal(out, ref)
    assert model.config._experts_implementation == impl


def test_unpatch_gives_back_the_plain_default_and_the_decode_switch(rng_seed):
    model = _lm("mixtral").eval()
    mpsboost.patch(model, recipes=["moe_experts"])
    assert model.config._experts_implementation is recipe_mod.OWNED
    assert "_optimize_model_for_decode" in model.__dict__
    mpsboost.unpatch(model)
    assert type(model.config._experts_implementation) is str and model.config._experts_implementation == "grouped_mm"
    assert "_optimize_model_for_decode" not in model.__dict__
    assert patching.held_by(model, "_optimize_model_for_decode") is None


# ----------------------------------------------------------------------------------------- 2. alignment


def test_grouped_mm_widths_ok_covers_every_operand():
    ok = moe_ops.grouped_mm_widths_ok
    assert ok({32, 24, 12}, torch.float32, "cpu") == (True, "")
    good, why = ok({32, 24, 12}, torch.bfloat16, "cpu")  # 12 x 2 bytes = 24: not a multiple of 16
    assert not good and "[12]" in why and "16 bytes" in why
    assert ok({33}, torch.float32, "cuda")[0] is False  # CUDA: bf16 only reads offsets on the device
    assert ok({33}, torch.bfloat16, "cuda") == (True, "")


def test_misaligned_down_projection_takes_a_working_path(rng_seed):
    """bf16, hidden 32 (64-byte rows) and gate_up 24 (48 bytes) are aligned, the down projection's
    input width 12 (24 bytes) is not: CPU grouped_mm would raise on the down projection."""
    model = _lm("qwen3_moe", dtype=torch.bfloat16, inter=12).eval()
    experts = _experts_modules(model)[0]
    assert (experts.gate_up_proj.shape[1] * 2) % 16 == 0 and (experts.down_proj.shape[2] * 2) % 16 != 0
    ids = torch.randint(0, 96, (2, 20))
    x = torch.randn(40, 32, dtype=torch.bfloat16)
    k_idx = torch.stack([torch.randperm(8)[:2] for _ in range(40)])
    k_w = torch.rand(40, 2).softmax(-1).to(torch.bfloat16)
    with torch.no_grad():
        model.set_experts_implementation("eager")
        ref = model(ids).logits
        ref_experts = experts(x, k_idx, k_w)
        model.set_experts_implementation("grouped_mm")
        report = mpsboost.patch(model, recipes=["moe_experts"])
        row = [r for r in report.rows if r.recipe == "moe_experts"][0]
        assert row.backing.startswith("per-expert loop (CPU"), row.backing
        assert "[12]" in row.reason and "16 bytes" in row.reason
        with _spy_recipe() as calls:
            out = model(ids).logits
            out_experts = experts(x, k_idx, k_w)
    assert set(calls) == {"cpu_loop"}
    assert relative_error(out_experts, ref_experts) <= BF16_TOL
    assert relative_error(out, ref) <= BF16_TOL
    mpsboost.unpatch(model)


# ----------------------------------------------------------------------------------------- 3. compile

ENVS = {
    "cpu": ("cpu", None, torch.float32),
    "cuda_sm90": ("cuda:9.0", "2.11.0", torch.bfloat16),
    "mps_2.14.1": ("mps", "2.14.1", torch.float32),
    "mps_2.15.0": ("mps", "2.15.0", torch.bfloat16),
}


def _grouped_mm_calls(gm: torch.fx.GraphModule) -> int:
    """Calls of the native grouped matmul in a graph dynamo captured (the recipe's grouped path)."""
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and "grouped_mm" in str(n.target))


# Inductor (C++ code generation and compilation on the CPU: 15-30 s a model) once, where its lowering is what is
# checked: the compiled forward with the native grouped matmul in bf16 under Mac 2.15.0 decisions. Everything else
# traces through AOT autograd with the eager backend: the same fullgraph capture and functionalisation, the ops
# run as they are.
INDUCTOR_ENVS = ("mps_2.15.0",)


def _backend(env_name: str, test: str = "forward") -> str:
    return "inductor" if env_name in INDUCTOR_ENVS and test == "forward" else "aot_eager"


def _env(name):
    device, version, _ = ENVS[name]
    return mpsboost.Env.simulate(device, version) if version else None


def test_several_layers_compile_into_one_graph_without_recompiles(rng_seed):
    """4 MoE layers, fullgraph: one frame, one graph; a second call with new values and the same
    shapes compiles nothing more (no per-layer recompiles, no host sync, no Python-side caches)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    model = _lm("qwen3_moe", dtype=torch.bfloat16, layers=4).eval()
    ids = torch.randint(0, 96, (2, 24))  # 96 pairs per call: grouped_mm (bf16) while compiling
    with torch.no_grad():
        mpsboost.patch(model, recipes=["moe_experts"])
        eager = model(ids).logits
        torch._dynamo.reset()
        cnt = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(model, backend=cnt, fullgraph=True, dynamic=False)
        out = compiled(ids).logits
        ids2 = torch.randint(0, 96, (2, 24))
        out2 = compiled(ids2).logits
        eager2 = model(ids2).logits
    assert cnt.frame_count == 1, f"{cnt.frame_count} frames compiled"
    assert _grouped_mm_calls(cnt.graphs[0]) == 8  # up and down projections of 4 layers
    assert relative_error(out, eager) <= COMPILED_BF16_TOL and relative_error(out2, eager2) <= COMPILED_BF16_TOL
    mpsboost.unpatch(model)
    torch._dynamo.reset()


@pytest.mark.parametrize("env_name", list(ENVS))
def test_compiled_forward_equals_eager_patched(env_name, rng_seed):
    from torch._dynamo.testing import CompileCounterWithBackend

    dtype = ENVS[env_name][2]
    # One layer: fullgraph refuses a break in any layer; one graph for several layers is the test above's.
    model = _lm("qwen3_moe", dtype=dtype, layers=1).eval()
    ref32 = copy.deepcopy(model).float()  # the same weights, unpatched, in fp32: the truth both are held to
    ids = torch.randint(0, 96, (2, 40))  # 160 pairs: above every compiled batched threshold
    with torch.no_grad():
        truth = ref32(ids).logits
        report = mpsboost.patch(model, recipes=["moe_experts"], device=_env(env_name))
        assert all(r.status == "applied" for r in report.rows if r.recipe == "moe_experts"), report
        eager = model(ids).logits
        torch._dynamo.reset()
        cnt = CompileCounterWithBackend(_backend(env_name))
        out = torch.compile(model, backend=cnt, fullgraph=True, dynamic=False)(ids).logits
    assert cnt.frame_count == 1
    # grouped_mm traces in bf16 only (and MPS before 2.15 has none): the dense fallback otherwise.
    native = dtype == torch.bfloat16 and env_name != "mps_2.14.1"
    assert _grouped_mm_calls(cnt.graphs[0]) == (2 if native else 0)  # up and down projections
    if dtype == torch.bfloat16:
        # Both held to the fp32 truth as well as to each other (see COMPILED_BF16_TOL).
        assert relative_error(out, truth) <= COMPILED_BF16_TOL and relative_error(eager, truth) <= COMPILED_BF16_TOL
        assert relative_error(out, eager) <= COMPILED_BF16_TOL
    else:
        assert relative_error(out, eager) <= COMPILED_FP32_TOL
    mpsboost.unpatch(model)
    torch._dynamo.reset()


@pytest.mark.parametrize("env_name", list(ENVS))
def test_static_cache_generate_compiled_equals_eager(env_name, rng_seed):
    """transformers compiles the decode step for a static cache on CUDA/XPU only; on CPU the same
    compilation is asked for with CompileConfig(_compile_all_devices=True), fullgraph. fp32, so greedy
    tokens are comparable exactly."""
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    model = _lm("qwen3_moe").eval()
    ids = torch.randint(0, 96, (2, 10))
    mask = torch.ones_like(ids)
    kw = dict(
        attention_mask=mask,
        max_new_tokens=8,
        min_new_tokens=8,
        do_sample=False,
        pad_token_id=0,
        cache_implementation="static",
    )
    with torch.no_grad():
        stock = model.generate(ids, disable_compile=True, **kw)
        mpsboost.patch(model, recipes=["moe_experts"], device=_env(env_name))
        eager = model.generate(ids, disable_compile=True, **kw)
        torch._dynamo.reset()
        counters.clear()
        cc = CompileConfig(fullgraph=True, dynamic=False, backend=_backend(env_name, "generate"))
        cc._compile_all_devices = True
        with _spy_recipe(unique=True) as paths:
            compiled = model.generate(ids, compile_config=cc, **kw)
    assert counters["stats"]["unique_graphs"] >= 1, "generate() did not compile the decode step"
    assert not counters["recompiles"], dict(counters["recompiles"])  # one graph serves every decode step
    assert paths, "the recipe did not run"  # eager prefill; the compiled decode steps record at trace time
    assert torch.equal(eager, stock)
    assert torch.equal(compiled, eager)
    mpsboost.unpatch(model)
    torch._dynamo.reset()


# ----------------------------------------------------------------------------------------- on a real GPU


@pytest.mark.cuda
def test_cuda_generate_keeps_the_recipe_through_transformers_decode_switch(rng_seed):
    """On CUDA generate() really switches grouped_mm to batched_mm for decoding; on a patched model
    the recipe keeps choosing (H200 thresholds: batched_mm at <= 32 pairs), tokens equal stock (fp32)."""
    from transformers.integrations import moe as hf_moe

    model = _lm("qwen3_moe").eval().cuda()
    ids = torch.randint(0, 96, (2, 24), device="cuda")
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    asked = []
    real_get = hf_moe.ExpertsInterface.get_interface

    def get_spy(self, impl, default):
        asked.append(str(impl))
        return real_get(self, impl, default)

    with torch.no_grad():
        with mock.patch.object(hf_moe.ExpertsInterface, "get_interface", get_spy):
            stock = model.generate(ids, **kw)
        assert "batched_mm" in asked, "transformers' decode switch did not run on CUDA"
        # By default eager CUDA runs transformers' own kernels (the whole eager generate() showed no gain
        # from the recipe's paths); compiled forwards take them. cuda_eager=True takes them in eager too.
        mpsboost.patch(model, recipes=["moe_experts"])
        with _spy_recipe() as default_paths:
            default = model.generate(ids, **kw)
        assert default_paths == [] and torch.equal(default, stock)
        mpsboost.unpatch(model)
        asked.clear()
        mpsboost.patch(model, recipes=["moe_experts"], options={"moe_experts": {"cuda_eager": True}})
        with mock.patch.object(hf_moe.ExpertsInterface, "get_interface", get_spy), _spy_recipe() as paths:
            patched = model.generate(ids, **kw)
    assert asked == []
    assert paths[:2] == ["fallback", "fallback"]  # prefill, 96 pairs, fp32 (CUDA grouped_mm: bf16 only)
    assert set(paths[2:]) == {"batched_mm"}  # decode, 4 pairs
    assert torch.equal(patched, stock)
    mpsboost.unpatch(model)


@pytest.mark.cuda
def test_cuda_bf16_forward_and_static_cache_generate(rng_seed):
    """bf16 on CUDA: grouped_mm for prefill, compiled fullgraph forward equals eager patched. fp32:
    transformers compiles the static-cache decode step itself on CUDA; greedy tokens equal eager patched."""
    model = _lm("qwen3_moe", dtype=torch.bfloat16).eval().cuda()
    ids = torch.randint(0, 96, (2, 40), device="cuda")
    with torch.no_grad():
        model.set_experts_implementation("eager")
        ref = model(ids).logits
        model.set_experts_implementation("grouped_mm")
        mpsboost.patch(model, recipes=["moe_experts"], options={"moe_experts": {"cuda_eager": True}})
        with _spy_recipe() as paths:
            eager = model(ids).logits
        assert paths == ["grouped_mm", "grouped_mm"]
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, dynamic=False)(ids).logits
    assert relative_error(eager, ref) <= BF16_TOL and relative_error(compiled, eager) <= COMPILED_BF16_TOL
    mpsboost.unpatch(model)
    # Greedy tokens compared in fp32 (bf16 rounding differences could flip an argmax).
    model = _lm("qwen3_moe").eval().cuda()
    kw = dict(
        attention_mask=torch.ones_like(ids),
        max_new_tokens=8,
        min_new_tokens=8,
        do_sample=False,
        pad_token_id=0,
        cache_implementation="static",
    )
    with torch.no_grad():
        stock = model.generate(ids, disable_compile=True, **kw)
        mpsboost.patch(model, recipes=["moe_experts"])
        gen_eager = model.generate(ids, disable_compile=True, **kw)
        torch._dynamo.reset()
        gen_compiled = model.generate(ids, **kw)
    assert torch.equal(gen_eager, stock)
    assert torch.equal(gen_compiled, gen_eager)
    mpsboost.unpatch(model)
    torch._dynamo.reset()
