"""Compatibility: torch.compile, diffusers/accelerate offloading, isolation between instances, device_map.

- ``torch.compile(fullgraph=True)``: every patched module of the tiny models compiles without a graph
  break that the stock module does not have (counted with ``torch._dynamo.explain``), and the compiled
  module computes what the eager patched one does.
- Offloading: diffusers ``enable_model_cpu_offload`` after patching and patching after it; sequential
  offloading (accelerate ``cpu_offload``, what ``enable_sequential_cpu_offload`` installs per component)
  likewise, and unpatching under it (accelerate's hooks stay, with the original forwards inside).
  diffusers' own ``enable_sequential_cpu_offload()`` needs an accelerator (on the CPU its
  meta-to-CPU reload fails in stock diffusers), so that test is ``cuda``-marked, as is the default
  accelerator form of both calls.
- Isolation: patching one pipeline changes no other pipeline, no freshly built model of the same class,
  no class attribute and no library module attribute.
- ``device_map="auto"`` across two GPUs: ``cuda``-marked, skipped unless two CUDA devices exist.
"""

from __future__ import annotations

import copy
import functools
import sys
import warnings

import pytest
import torch

import mpsboost
from mpsboost.bench import relative_error
import tiny_models as tm
from mpsboost.registry import all_recipes

RECIPES = {r.name: r for r in all_recipes()}
MPS_214 = mpsboost.Env.simulate("mps", "2.14.1")


def _quiet_patch(obj, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # requested-but-skipped warnings: the rows say why
        return mpsboost.patch(obj, **kw)


# ---------------------------------------------------------------------------------- torch.compile


def _compile_cases() -> list[tuple[str, str]]:
    out = []
    for name, recipe in RECIPES.items():
        for model_name in tm.covering(recipe):
            if tm.TINY[model_name].kind != "pipeline" and tm.applying_env(
                recipe, tm._probe(model_name), runnable_on_cpu=True
            ):
                out.append((name, model_name))
                break
    return out


COMPILE_CASES = _compile_cases()


def _module_at(model: torch.nn.Module, path: str) -> torch.nn.Module:
    return model if path in ("", "<root>") else model.get_submodule(path)


# Small workloads for tracing: dynamo's cost grows with the number of calls it traces (VAE frames).
COMPILE_SHAPE = {"vae": {"frames": 1, "size": 32}, "lm": {"batch": 1, "prompt": 4, "steps": 1}}


def _capture_inputs(model_name: str, model: torch.nn.Module, paths: list[str], seed: int, **shape) -> dict:
    """The (args, kwargs) of the first call of each module in ``paths`` during one run."""
    seen: dict = {}
    handles = []
    for p in paths:

        def hook(mod, args, kwargs, p=p):
            if p not in seen:
                clone = lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t  # noqa: E731
                seen[p] = (torch.utils._pytree.tree_map(clone, args), torch.utils._pytree.tree_map(clone, kwargs))

        handles.append(_module_at(model, p).register_forward_pre_hook(hook, with_kwargs=True))
    try:
        tm.run(model_name, model, seed, **shape)
    finally:
        for h in handles:
            h.remove()
    return seen


def _first_tensor(out):
    leaves = [x for x in torch.utils._pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]
    assert leaves, f"no tensor in output {type(out).__name__}"
    return leaves[0]


@pytest.mark.parametrize("name,model_name", COMPILE_CASES, ids=[f"{a}-{b}" for a, b in COMPILE_CASES])
def test_fullgraph_compile_has_no_graph_break_from_mpsboost(name, model_name):
    recipe = RECIPES[name]
    stock = tm.build(model_name)
    patched = copy.deepcopy(stock)
    label, env, _ = tm.applying_env(recipe, stock, runnable_on_cpu=True)
    report = _quiet_patch(patched, recipes=[name], fp8=tm.fp8_for(recipe), device=env)
    # One patched module per class (the same code compiles the same way), at most three.
    paths, classes = [], set()
    for row in report.applied:
        mod = _module_at(patched, row.target)
        if type(mod) not in classes:
            classes.add(type(mod))
            paths.append(row.target)
    paths = paths[:3]
    inputs = _capture_inputs(model_name, patched, paths, seed=5, **COMPILE_SHAPE.get(tm.TINY[model_name].kind, {}))
    checked = 0
    for path in paths:
        if path not in inputs:
            continue  # not called in this run (e.g. a decode-only path); the recipe's own tests cover it
        args, kwargs = inputs[path]
        mod_p, mod_s = _module_at(patched, path), _module_at(stock, path)
        torch._dynamo.reset()
        # Each call gets its own copy of the inputs: a recurrent layer's cache (linear attention) changes
        # state with every call, so the two calls must start from the same one.
        fresh = copy.deepcopy
        with torch.no_grad():
            eager = _first_tensor(mod_p(*args, **fresh(kwargs)))
            try:
                compiled = _first_tensor(torch.compile(mod_p, fullgraph=True, backend="eager")(*args, **fresh(kwargs)))
            except Exception as exc:  # a graph break under fullgraph=True: is it mpsboost's?
                torch._dynamo.reset()
                ex = torch._dynamo.explain(mod_p)(*args, **kwargs)
                torch._dynamo.reset()
                stock_breaks = torch._dynamo.explain(mod_s)(*args, **kwargs).graph_break_count
                reasons = [str(b.reason)[:200] for b in ex.break_reasons]
                assert ex.graph_break_count <= stock_breaks, (
                    f"{name} on {model_name}.{path} ({label}): {ex.graph_break_count} graph breaks, "
                    f"stock has {stock_breaks}: {reasons} ({type(exc).__name__})"
                )
                assert stock_breaks > 0  # stock breaks there too: not caused by mpsboost
            else:
                torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
        checked += 1
    torch._dynamo.reset()
    assert checked, f"none of {paths} ran during a {model_name} forward"


# ---------------------------------------------------------------------------------- offloading

PIPES = ["wan22_ti2v_pipeline", "qwen_image_pipeline"]


def _close(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    err = relative_error(out, ref)
    # Lossless recipes on fp32: the order of a few additions at most.
    assert err <= 1e-5, f"{what}: relative error {err:.3g}"


def _offloaded(pipe) -> bool:
    """Every model component is under an accelerate hook (its forward wrapped on the instance)."""
    comps = [c for c in pipe.components.values() if isinstance(c, torch.nn.Module)]
    return bool(comps) and all(
        hasattr(c, "_hf_hook") and isinstance(c.__dict__.get("forward"), functools.partial) for c in comps
    )


@pytest.mark.parametrize("pipe_name", PIPES)
@pytest.mark.parametrize("order", ["patch-then-offload", "offload-then-patch"])
def test_model_cpu_offload(pipe_name, order):
    stock = tm.build(pipe_name)
    stock.enable_model_cpu_offload(device="cpu")  # the execution device is the CPU here
    ref = tm.run(pipe_name, stock, 3)
    pipe = tm.build(pipe_name)
    if order == "patch-then-offload":
        report = _quiet_patch(pipe, device=MPS_214)
        pipe.enable_model_cpu_offload(device="cpu")
    else:
        pipe.enable_model_cpu_offload(device="cpu")
        report = _quiet_patch(pipe, device=MPS_214)
    assert report.applied
    assert _offloaded(pipe)
    _close(tm.run(pipe_name, pipe, 3), ref, f"{pipe_name} {order}")
    mpsboost.unpatch(pipe)
    # The pipeline re-installs its hooks after every call (maybe_free_model_hooks), so their identity
    # changes; what must hold is that every component is still under an offload hook.
    assert _offloaded(pipe), "unpatch removed an offload hook"
    _close(tm.run(pipe_name, pipe, 3), ref, f"{pipe_name} {order}, unpatched")


def _sequential_offload(pipe) -> None:
    """What enable_sequential_cpu_offload installs, with the CPU as execution device."""
    from accelerate import cpu_offload

    for comp in pipe.components.values():
        if isinstance(comp, torch.nn.Module):
            cpu_offload(comp, execution_device=torch.device("cpu"))


@pytest.mark.parametrize("pipe_name", PIPES)
def test_patch_then_sequential_offload(pipe_name):
    stock = tm.build(pipe_name)
    _sequential_offload(stock)
    ref = tm.run(pipe_name, stock, 4)
    pipe = tm.build(pipe_name)
    report = _quiet_patch(pipe, device=MPS_214)
    assert report.applied
    _sequential_offload(pipe)
    assert any(p.device.type == "meta" for p in pipe.vae.parameters())  # weights really offloaded
    _close(tm.run(pipe_name, pipe, 4), ref, f"{pipe_name} patched then sequentially offloaded")


@pytest.mark.parametrize("pipe_name", PIPES)
def test_sequential_offload_then_patch(pipe_name):
    stock = tm.build(pipe_name)
    _sequential_offload(stock)
    ref = tm.run(pipe_name, stock, 4)
    pipe = tm.build(pipe_name)
    _sequential_offload(pipe)
    report = _quiet_patch(pipe, device=MPS_214)  # weights on meta, held by accelerate's hooks
    assert report.applied
    _close(tm.run(pipe_name, pipe, 4), ref, f"{pipe_name} offloaded then patched")
    mpsboost.unpatch(pipe)
    _close(tm.run(pipe_name, pipe, 4), ref, f"{pipe_name} offloaded, patched, unpatched")


def test_unpatch_after_sequential_offload_keeps_offload_working():
    stock = tm.build("wan22_vae")
    ref = tm.run("wan22_vae", stock, 4)
    vae = tm.build("wan22_vae")
    _quiet_patch(vae, device=MPS_214)
    from accelerate import cpu_offload

    cpu_offload(vae, execution_device=torch.device("cpu"))
    hooked = [m for m in vae.modules() if hasattr(m, "_hf_hook")]
    _close(tm.run("wan22_vae", vae, 4), ref, "wan22_vae patched, then offloaded")
    mpsboost.unpatch(vae)
    # accelerate's hooks stay (the weights live in them); inside each, the original forward is back.
    assert all(isinstance(m.__dict__.get("forward"), functools.partial) for m in hooked)
    assert all(
        getattr(m._old_forward, "__func__", None) is type(m).forward for m in hooked if hasattr(m, "_old_forward")
    )
    _close(tm.run("wan22_vae", vae, 4), ref, "wan22_vae patched, offloaded, unpatched")


@pytest.mark.cuda
@pytest.mark.parametrize("pipe_name", PIPES)
@pytest.mark.parametrize("kind", ["model", "sequential"])
@pytest.mark.parametrize("order", ["patch-then-offload", "offload-then-patch"])
def test_diffusers_offload_on_an_accelerator(pipe_name, kind, order):
    def offload(p):
        p.enable_model_cpu_offload() if kind == "model" else p.enable_sequential_cpu_offload()

    stock = tm.build(pipe_name)
    offload(stock)
    ref = tm.run(pipe_name, stock, 3)
    pipe = tm.build(pipe_name)
    if order == "patch-then-offload":
        _quiet_patch(pipe, device="cuda")
        offload(pipe)
    else:
        offload(pipe)
        _quiet_patch(pipe, device="cuda")
    out = tm.run(pipe_name, pipe, 3)
    assert relative_error(out, ref) <= 1e-3  # TF32 convolutions may differ in order


# ---------------------------------------------------------------------------------- isolation

_WATCHED_MODULES = (
    "torch",
    "torch.nn.functional",
    "torch.nn.modules.linear",
    "torch.nn.modules.conv",
    "transformers.integrations.moe",
    "transformers.generation.utils",
    "transformers.modeling_utils",
    "diffusers.models.attention_processor",
    "diffusers.models.attention_dispatch",
)


def _library_state(objs) -> dict:
    """Identity of every attribute of the classes in play and of the watched library modules."""
    classes = set()
    for obj in objs:
        for _, root in tm.modules_of(obj):
            for mod in root.modules():
                classes.update(c for c in type(mod).__mro__ if c is not object)
        classes.update(type(obj).__mro__[:-1])
    mods = {m for m in _WATCHED_MODULES if m in sys.modules}
    mods.update(c.__module__ for c in classes if c.__module__ in sys.modules)
    state = {}
    for c in classes:
        state[f"class {c.__module__}.{c.__qualname__}"] = {k: id(v) for k, v in vars(c).items()}
    for m in mods:
        state[f"module {m}"] = {k: id(v) for k, v in vars(sys.modules[m]).items() if not k.startswith("__")}
    return state


def _state_diff(a: dict, b: dict) -> list[str]:
    out = []
    for key in a:
        x, y = a[key], b.get(key, {})
        changed = sorted(k for k in set(x) | set(y) if x.get(k) != y.get(k))
        if changed:
            out.append(f"{key}: {changed[:6]}")
    return out


def test_patching_one_pipeline_changes_no_other_instance_class_or_library_module():
    name = "wan22_ti2v_pipeline"
    other = tm.build(name)
    ref = tm.run(name, other, 7)
    # A first patch/run/unpatch fills every lazy cache (imports, registries) before the state is read.
    warm = tm.build(name)
    _quiet_patch(warm, device=MPS_214)
    tm.run(name, warm, 7)
    mpsboost.unpatch(warm)
    lib_before = _library_state([other])
    other_before = tm.snapshot(other)

    pipe = tm.build(name)
    report = _quiet_patch(pipe, device=MPS_214)
    assert report.applied
    tm.run(name, pipe, 7)

    assert not tm.diff_snapshot(other_before, tm.snapshot(other)), "another pipeline changed"
    torch.testing.assert_close(tm.run(name, other, 7), ref, rtol=0, atol=0)
    fresh = tm.build(name)  # built after the patch, from the same seed: must be the stock pipeline
    assert all(registry_free(m) for _, root in tm.modules_of(fresh) for m in root.modules())
    torch.testing.assert_close(tm.run(name, fresh, 7), ref, rtol=0, atol=0)
    diff = _state_diff(lib_before, _library_state([other]))
    assert not diff, f"class or module state changed by patching another instance: {diff}"
    mpsboost.unpatch(pipe)


def registry_free(mod: torch.nn.Module) -> bool:
    from mpsboost.patching import ATTR

    return ATTR not in mod.__dict__ and "forward" not in mod.__dict__


@pytest.mark.parametrize("model_name", ["qwen3_moe", "wan22_vae"])
def test_patching_one_model_leaves_a_fresh_model_of_the_same_class_stock(model_name):
    ref_model = tm.build(model_name)
    ref = tm.run(model_name, ref_model, 9)
    model = tm.build(model_name)
    _quiet_patch(model, device=MPS_214)
    fresh = tm.build(model_name)
    assert all(registry_free(m) for m in fresh.modules())
    torch.testing.assert_close(tm.run(model_name, fresh, 9), ref, rtol=0, atol=0)
    mpsboost.unpatch(model)


# ---------------------------------------------------------------------------------- device_map="auto"


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices for device_map='auto' across GPUs")
@pytest.mark.parametrize("model_name", ["qwen3_moe", "mixtral"])
def test_device_map_auto_across_two_gpus(model_name, tmp_path):
    from transformers import AutoModelForCausalLM

    tm.build(model_name).save_pretrained(tmp_path)
    # Half the tiny model on each GPU: a per-device budget just under the whole model's size.
    size = sum(p.numel() * p.element_size() for p in tm.build(model_name).parameters())
    budget = {0: int(size * 0.6), 1: int(size * 2)}

    def load():
        return AutoModelForCausalLM.from_pretrained(
            tmp_path, device_map="auto", max_memory=budget, dtype=torch.float32
        ).eval()

    stock, patched = load(), load()
    assert {p.device.index for p in patched.parameters()} == {0, 1}, "the model was not split across both GPUs"
    report = _quiet_patch(patched)
    assert report.rows
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, stock.config.vocab_size, (2, 9), generator=g).to("cuda:0")
    with torch.no_grad():
        ref = stock(input_ids=ids).logits.float().cpu()
        out = patched(input_ids=ids).logits.float().cpu()
        gen_ref = stock.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        gen_out = patched.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert relative_error(out, ref) <= 1e-4
    assert torch.equal(gen_out, gen_ref)
    mpsboost.unpatch(patched)
