"""Typed per-recipe options: each recipe declares a frozen dataclass, api checks the user's dict against
it (unknown key or wrong type: a TypeError naming the recipe, the key and what is accepted), and the
recipe receives an instance; ``fp8=`` is sugar for the fp8_weights recipe's option."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import mpsboost
from mpsboost import patching, registry
from mpsboost.errors import PatchError, RecipeOptionError
from mpsboost.registry import Decision, Recipe, all_recipes, get_recipe

import tiny_models as tm


def test_every_recipe_declares_frozen_options_or_none():
    for recipe in all_recipes():
        cls = recipe.Options
        if cls is None:
            continue
        assert dataclasses.is_dataclass(cls), recipe.name
        assert cls.__dataclass_params__.frozen, recipe.name
        inst = cls()  # every option has a default
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(inst, dataclasses.fields(cls)[0].name, None)
    assert get_recipe("fp8_weights").keyword == "fp8"
    assert {r.name for r in all_recipes() if r.Options is not None} >= {
        "decode_linear",
        "softmax",
        "moe_experts",
        "fp8_weights",
        "wan_vae_pad",
        "qwen_image_vae",
        "attention_split",
        "metal_attention",
        "video_vae_pad",
        "mps_streams",
    }


def test_unknown_key_is_a_type_error_naming_recipe_key_and_accepted():
    model = tm.build("qwen3_moe")
    with pytest.raises(TypeError) as info:
        mpsboost.plan(model, options={"decode_linear": {"pth": "fold"}})
    msg = str(info.value)
    assert isinstance(info.value, RecipeOptionError) and isinstance(info.value, PatchError)
    assert "decode_linear" in msg and "'pth'" in msg and "pth='fold'" in msg
    assert "accepted: path, cuda_eager, cuda_graphs" in msg and "path: str" in msg and "cuda_eager: bool" in msg


def test_wrong_type_is_a_type_error_naming_the_type_taken():
    model = tm.build("qwen3_moe")
    cases = [
        ("decode_linear", {"cuda_eager": "yes"}, "cuda_eager='yes' has type str; cuda_eager takes bool"),
        (
            "moe_experts",
            {"batched_max_tokens": True},
            "batched_max_tokens=True has type bool; batched_max_tokens takes int | None",
        ),
        ("moe_experts", {"batched_max_tokens": 2.5}, "takes int | None"),
        ("fp8_weights", {"include": 3}, "include=3 has type int"),
        ("attention_split", {"max_scores": "big"}, "max_scores takes int"),
    ]
    for name, given, expected in cases:
        with pytest.raises(TypeError, match="Accepted options") as info:
            mpsboost.patch(model, recipes=[name], options={name: given})
        assert name in str(info.value) and expected in str(info.value), str(info.value)
    assert not mpsboost.api.is_patched(model)
    # A recipe that takes no options says so; the options of a recipe not selected are checked too.
    with pytest.raises(TypeError, match="options\\['softmax'\\] must be a dict"):
        mpsboost.plan(model, options={"softmax": ["probs"]})
    with pytest.raises(TypeError, match="unknown softmax option"):
        mpsboost.plan(model, recipes=["decode_linear"], options={"softmax": {"paths": "probs"}})


def test_value_checks_stay_with_the_recipe():
    model = tm.build("qwen3_moe")
    with pytest.raises(PatchError, match="batched_max_tokens=-1") as info:
        mpsboost.patch(model, recipes=["moe_experts"], options={"moe_experts": {"batched_max_tokens": -1}})
    assert not isinstance(info.value, TypeError)


class _Opts(Recipe):
    name = "t_opts"
    targets = ("torch.nn.modules.linear.Linear",)
    default = False

    @dataclasses.dataclass(frozen=True)
    class Options:
        scale: float = 1.0
        tag: str | None = None

    seen: list = []

    def decide(self, match, env, options):
        type(self).seen.append(options)
        return Decision.apply("test", f"scale {options.scale}")

    def apply(self, match, decision, env, options):
        s = options.scale
        return patching.bind_forward(
            match.module, self.name, lambda self_, x: patching.call_original(self_, "t_opts", x) * s
        )


def test_options_reach_the_recipe_as_its_dataclass():
    registry.register(_Opts)
    try:
        _Opts.seen.clear()
        lin = torch.nn.Linear(8, 4)
        x = torch.randn(3, 8)
        ref = lin(x)
        mpsboost.patch(lin, recipes=["t_opts"], options={"t_opts": {"scale": 3, "tag": "a"}})
        got = _Opts.seen[-1]
        assert isinstance(got, _Opts.Options) and got.scale == 3 and got.tag == "a"
        torch.testing.assert_close(lin(x), ref * 3, rtol=1e-6, atol=1e-6)
        mpsboost.unpatch(lin)
        torch.testing.assert_close(lin(x), ref, rtol=0, atol=0)
        mpsboost.plan(lin, recipes=["t_opts"])
        assert _Opts.seen[-1] == _Opts.Options()  # defaults where none were given
    finally:
        registry.unregister("t_opts")


def test_fp8_keyword_is_sugar_for_the_recipe_option(monkeypatch):
    recipe = get_recipe("fp8_weights")
    seen = []
    real = type(recipe).decide

    def spy(self, match, env, options):
        seen.append(options)
        return real(self, match, env, options)

    monkeypatch.setattr(type(recipe), "decide", spy)
    model = tm.build("qwen3_moe")
    report = mpsboost.plan(model, fp8="tensorwise", options={"fp8_weights": {"experts": False}})
    assert seen and all(o.fp8 == "tensorwise" and o.experts is False for o in seen)
    assert any(r.details.get("granularity") == "tensorwise" for r in report.rows_for("fp8_weights"))
    seen.clear()
    mpsboost.plan(model, options={"fp8_weights": {"fp8": "rowwise"}}, recipes=["fp8_weights"])
    assert seen and all(o.fp8 == "rowwise" for o in seen)
    with pytest.raises(TypeError, match="disagree"):
        mpsboost.plan(model, fp8="rowwise", options={"fp8_weights": {"fp8": "tensorwise"}})
    # The public keyword's own check and message are unchanged.
    with pytest.raises(ValueError, match="fp8 must be None, 'rowwise' or 'tensorwise'; got 'blockwise'"):
        mpsboost.plan(model, fp8="blockwise")
