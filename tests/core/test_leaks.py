"""Nothing mpsboost keeps holds a patched object: a model the user drops is freed, and every part of it.

For every registered recipe, on every candidate environment where it applies to a tiny real model
(:func:`tiny_models.applying_env` picks the models, the environments are the runnable ones of
:func:`tiny_models.candidate_envs`), the model is patched, run once on fresh inputs, dropped, and a weak
reference to every part of it must be dead after ``gc.collect()``: the object passed to patch(), every
module of its tree (each module the report names among them), and every parameter and buffer. A
submodule does not keep its parent alive, so a weak reference to the root alone would miss a patched
layer kept in some module-level table; these catch it (``python tools/mutations.py leak`` appends each
patched layer of two recipes to a module-level list, and these tests go red). Likewise for
``fp8="rowwise"`` with Mac decisions, a tiny diffusers pipeline (its pipeline object and each
component), and a model filled by ``load_fp8``. (The moe_experts decode switch once leaked: a
``WeakKeyDictionary`` whose value was a method bound to its own key.)

The slow group checks resident memory over 6 build + patch + run + del cycles of a small MoE model.
"""

from __future__ import annotations

import gc
import os
import weakref

import pytest

import mpsboost
from mpsboost.gate import Env
from mpsboost.registry import all_recipes

import tiny_models as tm

pytest.importorskip("transformers")
pytest.importorskip("diffusers")


def _parts(obj) -> dict:
    """{path: part} of everything a dropped ``obj`` must free: itself, every module of its tree (a
    pipeline: of each component; path ``component.sub.module``), every parameter and buffer."""
    parts = {"<object>": obj}
    for prefix, root in tm.modules_of(obj):
        for name, mod in root.named_modules():
            path = ".".join(p for p in (prefix, name) if p) or "<root>"
            parts[path] = mod
            for tname, t in list(mod._parameters.items()) + list(mod._buffers.items()):
                if t is not None:
                    parts[f"{path}:{tname}"] = t
    return parts


def _refs(obj, report=None) -> list[tuple[str, weakref.ref]]:
    """Weak references to every part of ``obj`` (see :func:`_parts`); each module ``report`` names as
    applied must be one of them (the report's paths are the tree's)."""
    parts = _parts(obj)
    if report is not None:
        named = {r.target for r in report.rows if r.status == "applied"}
        assert named, str(report)
        missing = sorted(p for p in named if p not in parts)
        assert not missing, f"the report names modules that are not in the tree: {missing}"
    return [(path, weakref.ref(part)) for path, part in parts.items()]


@pytest.fixture(autouse=True, scope="module")
def _frozen_imports():
    """Everything alive before this module's tests (the imported modules, the collection's probe models) moved to
    gc's permanent generation: each ``gc.collect()`` below then traverses what the tests made, not the whole heap of
    torch, transformers and diffusers (half a second a call). A frozen object still keeps alive whatever it refers to,
    so a part held by a module-level table stays alive and is reported; only garbage among the frozen ones is never
    freed, which can only make a part outlive its test (a failure), never hide one."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


def _assert_freed(refs: list[tuple[str, weakref.ref]], what: str) -> None:
    gc.collect()
    alive = [f"{path} ({type(r()).__name__})" for path, r in refs if r() is not None]
    assert not alive, f"{what}: {len(alive)} of {len(refs)} parts still alive after del + gc.collect(): {alive[:8]}"


def _cases() -> list[tuple[str, str, str]]:
    """(recipe, tiny model, env label) for every recipe and every runnable env where it applies."""
    cases = []
    for recipe in all_recipes():
        # the first tiny model it applies to somewhere (tm.covering, one model at a time: no model past it built)
        for model in (name for name in tm.TINY if tm.covering(recipe, [name])):
            obj = tm._probe(model)
            found = [
                (recipe.name, model, label)
                for label, env in tm.candidate_envs(runnable_on_cpu=True)
                if mpsboost.plan(obj, recipes=[recipe.name], env=env, fp8=tm.fp8_for(recipe)).recipes("would apply")
            ]
            if found:
                cases += found
                break
    return cases


_ENVS = dict(tm.candidate_envs(runnable_on_cpu=True))
CASES = _cases()


def _params() -> list:
    """The first env of each recipe in the quick group; the other envs in the slow group (CI runs both)."""
    seen: set[str] = set()
    out = []
    for case in CASES:
        out.append(pytest.param(*case, marks=() if case[0] not in seen else pytest.mark.slow))
        seen.add(case[0])
    return out


def test_every_recipe_has_a_case():
    assert {r for r, _, _ in CASES} == {r.name for r in all_recipes()}, tm.uncovered_recipes(all_recipes())


@pytest.mark.parametrize("recipe,model,label", _params())
def test_a_dropped_patched_model_is_freed(recipe, model, label):
    obj = tm.build(model)
    fp8 = tm.fp8_for(mpsboost.registry.get_recipe(recipe))
    report = mpsboost.patch(obj, recipes=[recipe], device=_ENVS[label], fp8=fp8)
    assert report.recipes("applied") == [recipe], str(report)
    tm.run(model, obj, 0)
    refs = _refs(obj, report)
    del obj, report
    _assert_freed(refs, f"{recipe} on {model} ({label})")


@pytest.mark.parametrize(
    "model,tv",
    [
        ("qwen3_moe", "2.15.0"),
        ("qwen3_moe", "2.14.1"),
        pytest.param("mixtral", "2.15.0", marks=pytest.mark.slow),
        pytest.param("gpt_oss", "2.14.1", marks=pytest.mark.slow),
    ],
)
def test_default_patch_and_fp8_with_mac_decisions_free_the_model(model, tv):
    for fp8 in (None, "rowwise"):
        obj = tm.build(model)
        report = mpsboost.patch(obj, device=Env.simulate("mps", tv), fp8=fp8)
        assert "moe_experts" in report.recipes("applied"), str(report)
        tm.generate(obj, 0, new_tokens=2)  # generate() takes the decode switch the recipe binds
        refs = _refs(obj, report)
        del obj, report
        _assert_freed(refs, f"{model} fp8={fp8} on mps {tv}")


def test_a_dropped_patched_pipeline_is_freed():
    pipe = tm.build("wan22_a14b_pipeline")
    report = mpsboost.patch(pipe, device=Env.simulate("mps", "2.14.1"))
    assert len(report.recipes("applied")) >= 2, str(report)
    tm.run("wan22_a14b_pipeline", pipe, 0, steps=1)
    refs = _refs(pipe, report)
    del pipe, report
    _assert_freed(refs, "wan22_a14b_pipeline")


def test_a_model_filled_by_load_fp8_is_freed(tmp_path):
    src = tm.build("qwen3_moe")
    mpsboost.patch(src, fp8="rowwise")
    mpsboost.save_fp8(src, tmp_path / "ckpt")
    del src
    fresh = tm.build("qwen3_moe", seed=1)
    report = mpsboost.load_fp8(fresh, tmp_path / "ckpt", device=Env.simulate("mps", "2.15.0"))
    assert report.recipes("applied"), str(report)
    tm.run("qwen3_moe", fresh, 0)
    refs = _refs(fresh, report)
    del fresh, report
    _assert_freed(refs, "qwen3_moe after load_fp8")


def test_unpatched_and_noop_patched_models_are_freed():
    obj = tm.build("qwen3_moe")
    mpsboost.patch(obj, device=Env.simulate("mps", "2.15.0"))
    mpsboost.unpatch(obj)
    dense = tm.build("qwen3")
    mpsboost.patch(dense, device=Env.simulate("cuda:9.0"), exclude=["rms_norm"])  # applies nothing; report stays
    refs = _refs(obj) + _refs(dense)
    del obj, dense
    _assert_freed(refs, "unpatched / no-op")


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _small_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    # About 27 MiB of fp32 weights (7.0 M parameters): large enough that keeping one per cycle shows.
    cfg = Qwen3MoeConfig(
        vocab_size=512,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_experts=32,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return Qwen3MoeForCausalLM(cfg).eval()


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads resident memory from /proc (Linux)")
def test_resident_memory_stays_flat_over_6_cycles():
    """6 x (build, patch with Mac decisions, one prefill and one decode step, del). A model kept per
    cycle would add 6 x 27 MiB = 160 MiB; the bound, 60 MiB over the level after 3 warm-up cycles,
    leaves room for the allocator's and torch's own caches (which level off after the first cycles) and
    is three eighths of that growth. (The 0.1.0 leak grew it by one model per cycle: 357 -> 623 MiB over 5. Seen
    2026-12-03: 0.1 MiB; with a copy of each cycle's weights kept, 160 MiB.)"""

    def cycle(i: int) -> list[tuple[str, weakref.ref]]:
        model = _small_moe()
        assert sum(p.numel() for p in model.parameters()) > 6_500_000
        report = mpsboost.patch(model, device=Env.simulate("mps", "2.15.0"))
        assert "moe_experts" in report.recipes("applied")
        tm._run_lm(model, 0, batch=1, prompt=4, steps=1)
        refs = [(f"cycle {i}: {path}", r) for path, r in _refs(model, report)]
        del model, report
        gc.collect()  # each cycle's cyclic garbage freed before the next builds
        return refs

    for i in range(3):
        _assert_freed(cycle(i), "warm-up cycle")
    base = _rss_mib()
    refs = [r for i in range(6) for r in cycle(i)]
    grown = _rss_mib() - base
    _assert_freed(refs, "6 cycles")
    assert grown < 60, f"resident memory grew by {grown:.0f} MiB over 6 cycles"
