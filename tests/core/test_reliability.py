"""Reliability of patch/unpatch with the real recipes on tiny real models.

- Fault injection: each registered recipe's ``apply`` raises at position k = 1..n of its targets, in a
  transaction with every other recipe that covers the model; afterwards every parameter, buffer,
  instance attribute and forward is exactly as before.
- 300 patch/unpatch cycles on a tiny pipeline (after 100 to warm up): no growth in Python objects or process memory.
- The bad-input list of the reliability issue, each with its specific error and nothing changed
  (tests/core/test_api.py covers the same list with test-only recipes; here the real recipes and models).

Recipes are discovered from the registry, and the tiny models that hold their targets from each
recipe's own ``find`` (tests/tiny_models.py), so a recipe that lands later is covered as it is.
"""

from __future__ import annotations

import collections
import gc
import threading
import time

import pytest
import torch

import mpsboost
import tiny_models as tm
from mpsboost.errors import (
    MpsboostError,
    NotPatchedError,
    PatchError,
    RecipeSkippedError,
    UnknownRecipeError,
    UnsupportedTargetError,
)
from mpsboost.registry import all_recipes

RECIPES = all_recipes()
NAMES = [r.name for r in RECIPES]


def _recipe(name: str):
    return next(r for r in RECIPES if r.name == name)


def test_every_registered_recipe_has_a_tiny_model():
    missing = tm.uncovered_recipes(RECIPES)
    assert not missing, f"no tiny model in tests/tiny_models.py holds the targets of {missing}: add one there"


# ---------------------------------------------------------------------------------- fault injection


class _Injected(RuntimeError):
    pass


def _fault_models(recipe) -> list[str]:
    """One standalone model and one pipeline (where any) in which the recipe applies in some env."""
    cov = [n for n in tm.covering(recipe) if tm.applying_env(recipe, tm._probe(n), runnable_on_cpu=False)]
    models = [n for n in cov if tm.TINY[n].kind != "pipeline"][:1]
    models += [n for n in cov if tm.TINY[n].kind == "pipeline"][:1]
    return models


@pytest.mark.parametrize("name", NAMES)
def test_failure_at_every_position_leaves_everything_as_before(name):
    recipe = _recipe(name)
    models = _fault_models(recipe)
    assert models, f"no tiny model covers {name}"
    checked = 0
    for model_name in models:
        obj = tm.build(model_name)
        found = tm.applying_env(recipe, obj, runnable_on_cpu=False)
        if found is None:
            continue
        label, env, _ = found
        # The whole transaction: every recipe that covers this model, so that a failure of this one
        # also has to roll back what the others applied before it (they run in order).
        # Two lossy weight stores (fp8_weights, low_bit_weights) never share one call: each refuses the other's layers.
        together = [r for r in RECIPES if r is recipe or (r.lossless and tm.covering(r, [model_name]))]
        fp8 = next((tm.fp8_for(r) for r in together if tm.fp8_for(r)), None)
        kw = dict(recipes=[r.name for r in together], fp8=fp8, device=env)
        plan = mpsboost.plan(obj, recipes=kw["recipes"], fp8=fp8, env=env)
        paths = [r.target for r in plan.rows if r.recipe == name and r.status == "would apply"]
        n = len(paths)
        assert n > 0
        before = tm.snapshot(obj)
        real_apply = recipe.apply
        for k in range(1, n + 1):
            calls = [0]

            def faulty(match, decision, env_, options, k=k, calls=calls):
                calls[0] += 1
                if calls[0] == k:
                    raise _Injected(f"injected failure at target {k} of {n}")
                return real_apply(match, decision, env_, options)

            recipe.apply = faulty  # instance attribute on the registered recipe, removed below
            try:
                with pytest.raises(PatchError) as info:
                    mpsboost.patch(obj, **kw)
            finally:
                del recipe.apply
            err = info.value
            assert err.recipe == name, f"{model_name} ({label}), k={k}: error names {err.recipe}"
            assert err.target == paths[k - 1], (
                f"{model_name} ({label}), k={k}: error names {err.target}, expected {paths[k - 1]}"
            )
            assert isinstance(err.__cause__, _Injected)
            diff = tm.diff_snapshot(before, tm.snapshot(obj))
            assert not diff, f"{model_name} ({label}): failure at target {k}/{n} left changes: {diff[:5]}"
            with pytest.raises(NotPatchedError):
                mpsboost.unpatch(obj)
            checked += 1
        # Control: without the fault, the same patch does change the model (the snapshot can see it).
        report = mpsboost.patch(obj, **kw)
        assert report.applied
        assert tm.diff_snapshot(before, tm.snapshot(obj))
        if all(r.reversible for r in together if r.name in {row.recipe for row in report.applied}):
            mpsboost.unpatch(obj)
            assert not tm.diff_snapshot(before, tm.snapshot(obj))
    assert checked, f"{name} applied in no candidate env on {models}"


# ---------------------------------------------------------------------------------- 300 cycles


def _rss() -> int:
    from mpsboost.bench.memory import process_rss_bytes

    rss = process_rss_bytes()
    assert rss is not None, "no RSS reader on this platform"
    return rss


def _objects() -> "collections.Counter[str]":
    gc.collect()
    gc.collect()
    return collections.Counter(type(o).__qualname__ for o in gc.get_objects())


CYCLES = 300


@pytest.mark.slow
def test_300_patch_unpatch_cycles_do_not_grow_objects_or_memory(record_property):
    pipe = tm.build("wan22_ti2v_pipeline")
    reversible = [r.name for r in RECIPES if r.reversible]
    # The env in which the most reversible recipes apply to this pipeline (the real CPU may skip most);
    # only the recipes that apply there are asked for, so that no "requested but skipped" warning is
    # issued (pytest keeps every warning, which would read as growth).
    best = None
    for label, env in tm.candidate_envs(runnable_on_cpu=False):
        applied = mpsboost.plan(pipe, recipes=reversible, env=env).applied
        if best is None or len(applied) > len(best[2]):
            best = (label, env, applied)
    label, env, applied = best
    assert applied
    names = sorted({r.recipe for r in applied})
    n_applied = len(applied)
    original = {k: v for k, v in tm.snapshot(pipe)["modules"].items()}

    def cycle():
        report = mpsboost.patch(pipe, recipes=names, device=env)
        assert len(report.applied) == n_applied
        mpsboost.unpatch(pipe)

    _rss(), _objects()  # the measurement's own first-call allocations (imports, caches) happen now, not inside
    for _ in range(100):  # warm-up: lazy imports, caches, logging and warnings registries fill once
        cycle()
    rss0 = _rss()
    objs0 = _objects()
    t0 = time.perf_counter()
    for _ in range(CYCLES):
        cycle()
    seconds = time.perf_counter() - t0
    objs1 = _objects()
    rss1 = _rss()
    grew_objects, grew_rss = sum(objs1.values()) - sum(objs0.values()), rss1 - rss0
    grew_types = sorted(
        ((k, objs1[k] - objs0[k]) for k in objs1 | objs0 if objs1[k] != objs0[k]), key=lambda kv: -abs(kv[1])
    )[:8]
    figures = (
        f"{CYCLES} cycles of {', '.join(names)} ({n_applied} patches each, {label}): "
        f"{seconds:.2f} s ({seconds / CYCLES * 1e3:.2f} ms/cycle); "
        f"gc objects {sum(objs0.values())} -> {sum(objs1.values())} ({grew_objects:+d}: {grew_types}); "
        f"RSS {rss0 / 2**20:.1f} -> {rss1 / 2**20:.1f} MiB "
        f"({grew_rss / 2**20:+.2f} MiB)"
    )
    print(figures)
    record_property("cycles", figures)
    # A leak of one object per cycle would show as +300; allow a little noise from interpreter caches. Resident
    # memory: 16 MiB is 55 KiB a cycle.
    assert grew_objects < 100, figures
    assert grew_rss < 16 * 2**20, figures
    after = tm.snapshot(pipe)["modules"]
    assert all(after[k][1] is original[k][1] and after[k][0] == original[k][0] for k in original)


# ---------------------------------------------------------------------------------- bad inputs


def _lm():
    return tm.build("qwen3_moe")


def test_non_module_inputs_are_refused_by_name():
    from transformers import Qwen3MoeForCausalLM

    model = _lm()
    for bad in (Qwen3MoeForCausalLM, model.config, model.state_dict(), torch.zeros(3), [model], (model,)):
        with pytest.raises(UnsupportedTargetError) as info:
            mpsboost.patch(bad)
        assert type(bad).__name__ in str(info.value) and "torch.nn.Module" in str(info.value)
        with pytest.raises(UnsupportedTargetError):
            mpsboost.plan(bad) if not isinstance(bad, dict) else mpsboost.unpatch(bad)


def test_real_pipeline_without_modules_is_refused():
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    pipe = WanPipeline(
        tokenizer=None, text_encoder=None, vae=None, scheduler=FlowMatchEulerDiscreteScheduler(), transformer=None
    )
    with pytest.raises(UnsupportedTargetError, match="no torch.nn.Module"):
        mpsboost.patch(pipe)
    with pytest.raises(UnsupportedTargetError):
        mpsboost.plan(pipe)


@pytest.mark.parametrize(
    "kw,err,words",
    [
        (dict(recipes=[NAMES[0] + "x"]), UnknownRecipeError, [repr(NAMES[0])]),
        (dict(exclude=["no_such_recipe"]), UnknownRecipeError, NAMES[:1]),
        (dict(options={"no_such_recipe": {}}), UnknownRecipeError, NAMES[:1]),
        (dict(fp8="blockwise"), ValueError, ["rowwise", "tensorwise", "blockwise"]),
        (dict(fp8="ROWWISE"), ValueError, ["rowwise"]),
        (dict(fp8=True), ValueError, ["rowwise"]),
        (dict(strict=1), TypeError, ["strict"]),
        (dict(recipes="decode_linear, softmax"), UnknownRecipeError, []),
    ],
    ids=[
        "recipe-typo",
        "exclude-unknown",
        "options-unknown",
        "fp8-blockwise",
        "fp8-case",
        "fp8-bool",
        "strict-int",
        "recipes-one-string",
    ],
)
def test_bad_arguments_raise_specific_errors_and_change_nothing(kw, err, words):
    model = _lm()
    before = tm.snapshot(model)
    with pytest.raises(err) as info:
        mpsboost.patch(model, **kw)
    for w in words:
        assert w in str(info.value), f"{w!r} not in: {info.value}"
    assert not tm.diff_snapshot(before, tm.snapshot(model))
    with pytest.raises(NotPatchedError):
        mpsboost.unpatch(model)


def _skipping_case(recipe):
    """(model name, env) where ``recipe`` is selected but skipped (gate closed), or None."""
    from mpsboost.gate import Env

    envs = [Env.detect("cpu"), Env.simulate("mps", "2.14.1"), Env.simulate("mps", "2.15.0"), Env.simulate("cuda:8.0")]
    for model_name in tm.covering(recipe)[:3]:
        obj = tm._probe(model_name)
        for env in envs:
            rows = mpsboost.plan(obj, recipes=[recipe.name], env=env, fp8=tm.fp8_for(recipe)).rows_for(recipe.name)
            if rows and any(r.status == "skipped" for r in rows):
                return model_name, env
    return None


def test_strict_with_an_unavailable_recipe_raises_before_any_change():
    cases = [(r, _skipping_case(r)) for r in RECIPES]
    cases = [(r, c) for r, c in cases if c is not None]
    assert cases, "no registered recipe is ever skipped in the candidate envs (the gate would never close)"
    for recipe, (model_name, env) in cases:
        obj = tm.build(model_name)
        before = tm.snapshot(obj)
        with pytest.raises(RecipeSkippedError) as info:
            mpsboost.patch(obj, recipes=[recipe.name], fp8=tm.fp8_for(recipe), strict=True, device=env)
        assert recipe.name in str(info.value) and "nothing was changed" in str(info.value).lower()
        assert not tm.diff_snapshot(before, tm.snapshot(obj)), f"{recipe.name} on {model_name}"


@pytest.mark.parametrize("model_name", ["qwen3_moe", "wan22_vae"])
def test_meta_device_model_plans_but_is_not_patched(model_name):
    with torch.device("meta"):
        obj = tm.TINY[model_name].make()
    env = mpsboost.Env.simulate("mps", "2.14.1")
    report = mpsboost.plan(obj, env=env)
    assert report.mode == "plan" and report.rows
    before = {k: v for k, v in tm.snapshot(obj)["modules"].items()}
    with pytest.raises(UnsupportedTargetError, match="meta"):
        mpsboost.patch(obj, device=env)
    after = tm.snapshot(obj)["modules"]
    assert all(after[k][0] == before[k][0] and after[k][1] is before[k][1] for k in before)


def test_partly_meta_model_is_refused_naming_the_tensor():
    model = _lm()
    # The embedding (first parameter) is real; the last layer is left on the meta device, as when a
    # checkpoint was loaded only in part into a model built under init_empty_weights.
    model.model.layers[-1].to_empty(device="meta")
    before = tm.snapshot(model)
    with pytest.raises(UnsupportedTargetError, match="meta") as info:
        mpsboost.patch(model, device=mpsboost.Env.simulate("mps", "2.14.1"))
    assert f"layers.{len(model.model.layers) - 1}." in str(info.value)
    assert not tm.diff_snapshot(before, tm.snapshot(model))


# ---------------------------------------------------------------------------------- fp8 files


def _fp8_recipe():
    return next((r for r in RECIPES if getattr(r, "keyword", None) == "fp8"), None)


def _fp8_saved(tmp_path, model_name="qwen3_moe"):
    model = tm.build(model_name)
    mpsboost.patch(model, fp8="rowwise")
    path = tmp_path / f"{model_name}.fp8.safetensors"
    mpsboost.save_fp8(model, path)
    return model, path


def _fresh_fp8_target(model_name="qwen3_moe"):
    model = tm.build(model_name, seed=1)
    return model, tm.snapshot(model)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "missing"])
def test_corrupted_fp8_file_raises_and_changes_nothing(tmp_path, damage):
    if _fp8_recipe() is None:
        pytest.fail("mpsboost.save_fp8/load_fp8 need the fp8_weights recipe, which is not registered")
    _, path = _fp8_saved(tmp_path)
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        path.write_bytes(b"\x00\x01not a safetensors file" * 64)
    elif damage == "empty":
        path.write_bytes(b"")
    else:
        path.unlink()
    target, before = _fresh_fp8_target()
    with pytest.raises((MpsboostError, FileNotFoundError)) as info:
        mpsboost.load_fp8(target, path)
    assert str(path.name) in str(info.value) or damage == "missing"
    assert not tm.diff_snapshot(before, tm.snapshot(target))


def test_mismatched_fp8_file_raises_and_changes_nothing(tmp_path):
    if _fp8_recipe() is None:
        pytest.fail("mpsboost.save_fp8/load_fp8 need the fp8_weights recipe, which is not registered")
    _, path = _fp8_saved(tmp_path, "mixtral")  # another architecture: other names and shapes
    target, before = _fresh_fp8_target("qwen3_moe")
    with pytest.raises(MpsboostError) as info:
        mpsboost.load_fp8(target, path)
    assert path.name in str(info.value)
    assert not tm.diff_snapshot(before, tm.snapshot(target))


# ---------------------------------------------------------------------------------- threads


def test_threads_patching_one_pipeline_serialise_to_one_patch():
    pipe = tm.build("wan22_ti2v_pipeline")
    env = mpsboost.Env.simulate("mps", "2.14.1")
    names = [r.name for r in RECIPES if r.reversible]
    before = tm.snapshot(pipe)
    barrier = threading.Barrier(4)
    reports, errors = [], []

    def work():
        try:
            barrier.wait()
            reports.append(mpsboost.patch(pipe, recipes=names, device=env))
        except BaseException as e:  # collected and asserted on below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Serialised: one call applied everything, the others saw it patched (never an error, never mixed).
    assert not errors, errors
    applied = [r for r in reports if not r.noop]
    assert len(applied) == 1
    assert all(r.noop for r in reports if r is not applied[0])
    mpsboost.unpatch(pipe)
    assert not tm.diff_snapshot(before, tm.snapshot(pipe))


def test_threads_patching_and_unpatching_different_models_never_corrupt():
    env = mpsboost.Env.simulate("mps", "2.14.1")
    names = [r.name for r in RECIPES if r.reversible]
    models = [tm.build("qwen3_moe") for _ in range(3)]
    befores = [tm.snapshot(m) for m in models]
    x = tm.run("qwen3_moe", models[0], 5)
    errors = []

    def churn(m):
        try:
            for _ in range(25):
                mpsboost.patch(m, recipes=names, device=env)
                mpsboost.unpatch(m)
        except BaseException as e:  # collected and asserted on below
            errors.append(e)

    threads = [threading.Thread(target=churn, args=(m,)) for m in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for m, b in zip(models, befores):
        assert not tm.diff_snapshot(b, tm.snapshot(m))
        torch.testing.assert_close(tm.run("qwen3_moe", m, 5), x, rtol=0, atol=0)
