"""Recipe moe_experts on tiny configs of every covered transformers class (random weights, CPU)."""

from __future__ import annotations

import contextlib
import dataclasses
from unittest import mock

import pytest
import torch
from mpsboost.bench import relative_error

import mpsboost
from mpsboost.ops import moe as moe_ops
from mpsboost.recipes import moe_experts as recipe_mod
from test_moe_zoo import ALL_NAMES, build, routing, tiny_causal_lm

FP32_TOL = 1e-5  # relative, patched vs transformers eager, fp32
BF16_TOL = 2e-2  # relative, patched vs transformers eager, bf16 (different accumulation order and rounding points)


@contextlib.contextmanager
def _patched(module, **options):
    report = mpsboost.patch(module, recipes=["moe_experts"], options={"moe_experts": options} if options else None)
    try:
        yield report
    finally:
        mpsboost.unpatch(module)


SCENARIOS = [
    # (scenario, tokens, top_k): top_k = num_experts (8) and = 1 included
    ("random", 13, 2),
    ("zero_tokens", 9, 2),  # experts 2..7 receive no token at all
    ("one_expert_all", 11, 2),  # expert 3 takes every token
    ("one_expert_all", 7, 1),  # top-1, every token to expert 3
    ("random", 5, 8),  # top-k = number of experts
    ("random", 1, 2),  # one decoding token
]


@pytest.mark.parametrize("name", ALL_NAMES)
def test_patched_matches_eager_fp32_on_every_path(name, rng_seed):
    for scenario, n, k in SCENARIOS:
        case = build(name, top_k=k)
        x = torch.randn(n, case.hidden)
        idx, w = routing(n, case.num_experts, k, scenario=scenario)
        ref = case.call(case.module, x, idx, w)
        for path in ("auto", "grouped_mm", "batched_mm", "fallback", "cpu_loop"):
            with _patched(case.module, path=path):
                out = case.call(case.module, x, idx, w)
            assert out.shape == ref.shape and out.dtype == ref.dtype
            err = relative_error(out, ref)
            assert err <= FP32_TOL, f"{name} {scenario} n={n} k={k} path={path}: rel error {err:.2e}"


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss", "dbrx"])
def test_patched_matches_eager_bf16(name, rng_seed):
    case = build(name, hidden=64, inter=32, dtype=torch.bfloat16)
    for n in (3, 40):
        x = torch.randn(n, case.hidden, dtype=torch.bfloat16)
        idx, w = routing(n, case.num_experts, case.top_k, dtype=torch.bfloat16)
        ref = case.call(case.module, x, idx, w)
        with _patched(case.module) as report:
            out = case.call(case.module, x, idx, w)
        assert report.rows[0].status == "applied"
        assert out.dtype == torch.bfloat16
        assert relative_error(out, ref) <= BF16_TOL


def test_odd_hidden_size_breaks_the_16_byte_rule_and_still_runs(rng_seed):
    """bf16 hidden 33: 66-byte rows. CPU grouped_mm would raise; the recipe must pick a path that works."""
    case = build("qwen3_moe", hidden=33, inter=17, dtype=torch.bfloat16)
    x = torch.randn(50, 33, dtype=torch.bfloat16)
    idx, w = routing(50, case.num_experts, case.top_k, dtype=torch.bfloat16)
    ref = case.call(case.module, x, idx, w)
    with _patched(case.module) as report:
        row = report.rows[0]
        # On CPU the per-expert loop (offsets in host memory) replaces the native kernel.
        assert row.backing.startswith("per-expert loop (CPU") and "16 bytes" in row.reason
        out = case.call(case.module, x, idx, w)
        # Forcing the native path must not crash either: it falls back at call time.
        mpsboost.unpatch(case.module)
        mpsboost.patch(case.module, recipes=["moe_experts"], options={"moe_experts": {"path": "grouped_mm"}})
        forced = case.call(case.module, x, idx, w)
    assert relative_error(out, ref) <= BF16_TOL and relative_error(forced, ref) <= BF16_TOL


def test_batch_above_one_whole_model_and_unpatch_identity(rng_seed):
    model = tiny_causal_lm("qwen3_moe").eval()
    experts = [m for m in model.modules() if type(m).__name__ == "Qwen3MoeExperts"]
    assert len(experts) == 2
    class_forward = type(experts[0]).forward
    ids = torch.randint(0, 96, (3, 10))
    with torch.no_grad():
        ref = model(ids).logits
        report = mpsboost.patch(model)
        rows = [r for r in report.rows if r.recipe == "moe_experts"]
        assert len(rows) == 2 and all(r.status == "applied" for r in rows)
        assert all("forward" in m.__dict__ for m in experts)
        out = model(ids).logits
    assert relative_error(out, ref) <= FP32_TOL
    mpsboost.unpatch(model)
    for m in experts:
        assert "forward" not in m.__dict__
        assert m.forward.__func__ is class_forward
        assert recipe_mod.NAME not in m.__dict__.get("_mpsboost_patches", {})


def test_unpatch_restores_an_instance_forward_object_exactly():
    case = build("mixtral")
    sentinel = case.module.forward  # a bound method object set on the instance, like accelerate's hooks do
    case.module.forward = sentinel
    with _patched(case.module):
        assert case.module.__dict__["forward"] is not sentinel
    assert case.module.__dict__["forward"] is sentinel


def test_jetmoe_router_keeps_sizes_on_device_and_matches(rng_seed):
    model = tiny_causal_lm("jetmoe").eval()
    ids = torch.randint(0, 96, (2, 12))
    with torch.no_grad():
        ref = model(ids).logits
        originals = {
            id(m): m.forward
            for m in model.modules()
            if type(m).__name__ in ("JetMoeTopKGating", "JetMoeParallelExperts")
        }
        for path in ("auto", "batched_mm", "fallback"):
            with _patched(model, path=path) as report:
                rows = [r for r in report.rows if r.recipe == "moe_experts"]
                assert {r.target.rsplit(".", 1)[-1] for r in rows} == {"mlp", "experts"}
                router = model.model.layers[0].mlp.router
                sizes = router(torch.randn(5, 32))[3]
                assert isinstance(sizes, torch.Tensor) and sizes.dtype == torch.int32
                out = model(ids).logits
            assert relative_error(out, ref) <= FP32_TOL, path
    for m in model.modules():
        if id(m) in originals:
            assert "forward" not in m.__dict__


def test_patched_forward_compiles_fullgraph(rng_seed):
    """No graph break (so no .item()/.tolist()/nonzero host sync) on each path, fp32 and bf16. The backend is
    ``aot_eager`` (dynamo's capture, AOT autograd's functionalisation over the fakes, then torch's kernels):
    inductor's lowering of the recipe is tests/recipes/moe/test_moe_modes.py's, once."""
    torch._dynamo.reset()
    for name, dtype, n in (
        ("qwen3_moe", torch.bfloat16, 40),
        ("gpt_oss", torch.float32, 40),
        ("qwen3_moe", torch.float32, 3),
    ):
        case = build(name, dtype=dtype)
        x = torch.randn(n, case.hidden, dtype=dtype)
        idx, w = routing(n, case.num_experts, case.top_k, dtype=dtype)
        ref = case.call(case.module, x, idx, w)
        with _patched(case.module):
            compiled = torch.compile(case.module, fullgraph=True, dynamic=False, backend="aot_eager")
            out = compiled(x, idx, w)
        assert relative_error(out, ref) <= (BF16_TOL if dtype == torch.bfloat16 else FP32_TOL), name


def _force_decode_switch(original):
    """generate()'s decode-time switch runs only off CPU; make it run here by showing it a CUDA device."""

    @contextlib.contextmanager
    def forced(self):
        with mock.patch.object(type(self), "device", new=property(lambda s: torch.device("cuda"))):
            cm = original(self)
            cm.__enter__()
        try:
            yield
        finally:
            cm.__exit__(None, None, None)

    return forced


def _generate_spied(model, ids):
    """generate() on a patched model with transformers' decode switch forced on (as off CPU).

    Returns (tokens, recipe paths per experts call, config values seen by the first experts module,
    implementations transformers' dispatcher was asked for, calls of transformers' own switch)."""
    from transformers.generation.utils import GenerationMixin
    from transformers.integrations import moe as hf_moe

    seen_paths, seen_impl, interface_calls, class_switch = [], [], [], []
    real = moe_ops.routed_experts

    def spy(*args, **kwargs):
        seen_paths.append(kwargs["path"])
        return real(*args, **kwargs)

    real_get = hf_moe.ExpertsInterface.get_interface

    def get_spy(self, impl, default):
        interface_calls.append(str(impl))
        return real_get(self, impl, default)

    forced = _force_decode_switch(GenerationMixin._optimize_model_for_decode)

    def counted(self):
        class_switch.append(1)
        return forced(self)

    experts = model.model.layers[0].mlp.experts
    real_fwd = experts.forward

    def record_impl(*a, **k):
        seen_impl.append(experts.config._experts_implementation)
        return real_fwd(*a, **k)

    with (
        mock.patch.object(GenerationMixin, "_optimize_model_for_decode", counted),
        mock.patch.object(recipe_mod.moe_ops, "routed_experts", spy),
        mock.patch.object(hf_moe.ExpertsInterface, "get_interface", get_spy),
    ):
        experts.__dict__["forward"] = record_impl
        try:
            tokens = model.generate(ids, max_new_tokens=6, do_sample=False)
        finally:
            experts.__dict__["forward"] = real_fwd
    return tokens, seen_paths, seen_impl, interface_calls, class_switch


def test_generate_keeps_the_chosen_path_through_the_decode_switch(rng_seed):
    """Measured thresholds: transformers' decode switch is no user choice; the recipe keeps choosing."""
    model = tiny_causal_lm("qwen3_moe").eval()
    ids = torch.randint(0, 96, (1, 12))
    with torch.no_grad():
        stock = model.generate(ids, max_new_tokens=6, do_sample=False)
        # Prefill 12 tokens x top-2 = 24 pairs -> grouped_mm; decode 2 pairs -> batched_mm (threshold 4).
        with _patched(model, batched_max_tokens=4):
            experts = model.model.layers[0].mlp.experts
            assert experts.config._experts_implementation is recipe_mod.OWNED
            assert "_optimize_model_for_decode" in model.__dict__
            patched, seen_paths, seen_impl, interface_calls, class_switch = _generate_spied(model, ids)
            assert experts.config._experts_implementation is recipe_mod.OWNED
        assert "_optimize_model_for_decode" not in model.__dict__
        assert (
            type(model.config._experts_implementation) is str and model.config._experts_implementation == "grouped_mm"
        )
    assert class_switch == [], "transformers' switch ran on a model whose experts the recipe owns"
    assert seen_impl == ["grouped_mm"] * 6 and all(v is recipe_mod.OWNED for v in seen_impl)
    assert interface_calls == [], "transformers' experts interface was consulted by a patched module"
    # 2 layers: prefill (grouped_mm) once each, then 5 decode steps (batched_mm) each.
    assert seen_paths[:2] == ["grouped_mm", "grouped_mm"] and set(seen_paths[2:]) == {"batched_mm"}
    assert len(seen_paths) == 12
    assert torch.equal(patched, stock)


def test_generate_follows_the_decode_switch_where_no_thresholds_were_measured(rng_seed):
    """Conservative choice (no measurement for the device): transformers' switch runs, the recipe
    steps aside while it is active (transformers' batched_mm decodes) and takes over again after."""
    model = tiny_causal_lm("qwen3_moe").eval()
    ids = torch.randint(0, 96, (1, 12))
    conservative = dataclasses.replace(recipe_mod.CONSERVATIVE, source="test: no data")
    with torch.no_grad():
        stock = model.generate(ids, max_new_tokens=6, do_sample=False)
        with mock.patch.object(recipe_mod, "thresholds_for_env", lambda env, native: conservative):
            report = mpsboost.patch(model, recipes=["moe_experts"])
        try:
            assert "decode switch to batched_mm kept" in report.rows[0].reason
            patched, seen_paths, seen_impl, interface_calls, class_switch = _generate_spied(model, ids)
            assert model.config._experts_implementation is recipe_mod.OWNED
        finally:
            mpsboost.unpatch(model)
    assert class_switch == [1]
    assert seen_impl[0] is recipe_mod.OWNED and seen_impl[1:] == ["batched_mm"] * 5
    assert interface_calls == ["batched_mm"] * 10  # 2 layers x 5 decode steps, through transformers
    assert seen_paths == ["grouped_mm", "grouped_mm"]  # prefill only
    assert torch.equal(patched, stock)


def test_greedy_tokens_identical_fp32_over_32_steps(rng_seed):
    model = tiny_causal_lm("qwen3_moe", experts=16, top_k=4).eval()
    ids = torch.randint(0, 96, (2, 7))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        stock = model.generate(
            ids, attention_mask=mask, max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0
        )
        with _patched(model):
            patched = model.generate(
                ids, attention_mask=mask, max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0
            )
    assert patched.shape == (2, 39)
    assert torch.equal(patched, stock)


@pytest.mark.parametrize(
    "device,version,expected",
    [
        (("mps", "2.14.1"), None, "per-expert loop, offsets read on the host"),
        (("mps", "2.15.0"), None, "grouped_mm, offsets on device"),
        (("mps", "2.16.0.dev20261201"), None, "grouped_mm, offsets on device"),
        (("cpu", "2.9.0"), None, "per-expert loop (CPU"),
        (("cpu", "2.13.0"), None, "grouped_mm, offsets on device"),
        (("cuda:9.0", "2.11.0"), "bf16", "grouped_mm, offsets on device"),
        (("cuda:9.0", "2.11.0"), "fp32", "sync-free fallback"),
        (("cuda:7.5", "2.11.0"), "bf16", "sync-free fallback"),
    ],
)
def test_plan_on_simulated_envs(device, version, expected):
    dtype = torch.float32 if version in (None, "fp32") else torch.bfloat16
    with torch.device("meta"):
        model = tiny_causal_lm("qwen3_moe", dtype=dtype)
    report = mpsboost.plan(model, device=device[0], torch_version=device[1], recipes=["moe_experts"])
    rows = [r for r in report.rows if r.recipe == "moe_experts"]
    assert len(rows) == 2 and all(r.status == "would apply" for r in rows)
    assert rows[0].backing.startswith(expected), rows[0].backing
    if device == ("mps", "2.14.1"):
        assert "pytorch#194917" in rows[0].reason and "batched_mm at <= 32" in rows[0].backing
    if device == ("mps", "2.15.0"):
        assert "batched_mm" not in rows[0].backing  # grouped_mm from the first token on MPS 2.15


def test_every_use_experts_implementation_class_is_found():
    """The recipe finds experts by transformers' decorator, so every decorated class is covered."""
    import importlib

    names = ("qwen3_moe", "qwen3_5_moe", "qwen3_next", "mixtral", "deepseek_v3", "gpt_oss", "olmoe", "qwen2_moe")
    for mod_name in names:
        mod = importlib.import_module(f"transformers.models.{mod_name}.modeling_{mod_name}")
        classes = [
            c
            for c in vars(mod).values()
            if isinstance(c, type) and c.__name__.endswith("Experts") and c.__module__ == mod.__name__
        ]
        assert classes, mod_name
        for cls in classes:
            inst = cls.__new__(cls)  # no __init__: only the class's forward matters for detection
            torch.nn.Module.__init__(inst)
            inst.down_proj = torch.nn.Parameter(torch.empty(0))
            assert recipe_mod._is_hf_experts(inst), cls

    class LookAlike(torch.nn.Module):  # same attributes, no decorator
        def __init__(self):
            super().__init__()
            self.down_proj = torch.nn.Parameter(torch.empty(0))

        def forward(self, x):
            return x

    assert not recipe_mod._is_hf_experts(LookAlike())


def test_option_errors_name_what_is_accepted():
    case = build("qwen3_moe")
    with pytest.raises(mpsboost.PatchError, match="batched_max_tokens=-1"):
        mpsboost.patch(case.module, recipes=["moe_experts"], options={"moe_experts": {"batched_max_tokens": -1}})
    with pytest.raises(
        mpsboost.PatchError,
        match="path='loop': expected one of auto, grouped_mm, batched_mm, fallback, cpu_loop, host_loop",
    ):
        mpsboost.patch(case.module, recipes=["moe_experts"], options={"moe_experts": {"path": "loop"}})
    with pytest.raises(mpsboost.PatchError, match="unknown moe_experts option"):
        mpsboost.patch(case.module, recipes=["moe_experts"], options={"moe_experts": {"threshold": 3}})
    assert "forward" not in case.module.__dict__


def test_user_threshold_override_changes_the_path(rng_seed):
    case = build("qwen3_moe")
    x = torch.randn(4, case.hidden)
    idx, w = routing(4, case.num_experts, case.top_k)
    seen = []
    real = moe_ops.routed_experts

    def spy(*a, **k):
        seen.append(k["path"])
        return real(*a, **k)

    with mock.patch.object(recipe_mod.moe_ops, "routed_experts", spy):
        for bound in (0, 8):
            with _patched(case.module, batched_max_tokens=bound) as report:
                case.module(x, idx, w)
                assert report.rows[0].details["batched_max_tokens"] == bound
    assert seen == ["grouped_mm", "batched_mm"]


def test_expert_parallel_sentinels_contribute_nothing(rng_seed):
    """Under transformers' expert parallelism, ids == num_experts mark pairs owned by another rank."""
    case = build("qwen3_moe")
    case.module._is_expert_parallel = True
    x = torch.randn(12, case.hidden)
    idx, w = routing(12, case.num_experts, case.top_k)
    idx[::3, 1] = case.num_experts
    ref = case.call(case.module, x, idx, w)  # transformers' eager loop skips the sentinel expert
    for path in ("grouped_mm", "batched_mm", "fallback", "cpu_loop"):
        with _patched(case.module, path=path):
            out = case.call(case.module, x, idx, w)
        assert torch.isfinite(out).all() and relative_error(out, ref) <= FP32_TOL, path


def test_deterministic_mode_gives_the_same_result(rng_seed):
    case = build("mixtral")
    x = torch.randn(30, case.hidden)
    idx, w = routing(30, case.num_experts, case.top_k)
    with _patched(case.module, path="grouped_mm"):
        fast = case.call(case.module, x, idx, w)
        torch.use_deterministic_algorithms(True)
        try:
            det = case.call(case.module, x, idx, w)
        finally:
            torch.use_deterministic_algorithms(False)
    assert torch.equal(fast, det)


def test_compiled_batched_form_option(rng_seed):
    case = build("qwen3_moe")
    x = torch.randn(2, case.hidden)
    idx, w = routing(2, case.num_experts, case.top_k)
    ref = case.call(case.module, x, idx, w)
    torch._dynamo.reset()
    with _patched(case.module, compiled_batched_form="bmm"):
        out = torch.compile(case.module, fullgraph=True, backend="aot_eager")(x, idx, w)
    assert relative_error(out, ref) <= FP32_TOL
    with pytest.raises(mpsboost.PatchError, match="compiled_batched_form='gemv'"):
        mpsboost.patch(case.module, recipes=["moe_experts"], options={"moe_experts": {"compiled_batched_form": "gemv"}})


def test_thresholds_for_every_device_type():
    for dev in ("cpu", "cuda", "mps"):
        for native in (True, False):
            t = recipe_mod.thresholds_for(dev, native)
            assert t.batched_max_tokens >= 0 and t.source
    with pytest.raises(ValueError, match="known"):
        recipe_mod.thresholds_for("xpu", True)


def test_thresholds_come_from_tuning_files_with_provenance():
    from mpsboost import tuning
    from mpsboost.gate import Env

    for dev, names in recipe_mod.TUNING_FILES.items():
        for name in names:
            t = tuning.load(name)
            assert t.device_type == dev and t.name == name
            for key in ("native", "no_native"):
                e = t.entries[key]
                assert isinstance(e["batched_max_tokens"], int) and isinstance(e["compiled_batched_max_tokens"], int)
                assert e["compiled_batched_form"] in ("fused", "bmm")
            if t.extra.get("measured", True):
                assert t.source.startswith("benchmarks/results/") and t.command and t.spread
    h200 = Env.simulate("cuda:9.0", "2.11.0")
    thr = recipe_mod.thresholds_for_env(h200, True)
    assert thr.batched_max_tokens == 32
    assert "moe_thresholds_cuda_h200.json" in thr.source and "NVIDIA H200" in thr.source
    assert not thr.follow_decode_switch
    # Another GPU: the measured table does not speak for it; the reason names the data and the choice.
    a100 = recipe_mod.thresholds_for_env(Env.simulate("cuda:8.0", "2.11.0"), True)
    assert a100.batched_max_tokens == 0 and a100.compiled_batched_max_tokens == 0 and a100.follow_decode_switch
    assert "moe_thresholds_cuda_h200" in a100.source and "sm_80" in a100.source and "conservative" in a100.source
    mps = recipe_mod.thresholds_for_env(Env.simulate("mps", "2.15.0"), True)
    assert "unmeasured default" in mps.source and mps.batched_max_tokens == 0
    assert recipe_mod.thresholds_for_env(Env.simulate("mps", "2.14.1"), False).batched_max_tokens == 32
    cpu = recipe_mod.thresholds_for_env(Env.simulate("cpu", "2.13.0"), True)
    assert cpu.batched_max_tokens == 0 and "moe_thresholds_cpu.json" in cpu.source
