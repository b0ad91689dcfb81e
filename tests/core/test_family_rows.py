"""The decode recipes' typed family rows and the recipes' Literal options.

``moe_block``, ``linear_attention`` and ``attention_decode`` keep one table each of frozen rows
(``MoeFamily``, ``DeltaNetFamily``, ``AttentionFamily``) checked when they are made; a recipe option that takes
one of fixed strings is annotated ``Literal[...]`` and the registry refuses any other value, generically, for
every recipe (``patch(..., options=...)``), and refuses at registration a default outside its own Literal."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import typing
from pathlib import Path

import pytest

import mpsboost
from mpsboost import registry
from mpsboost.errors import RecipeOptionError
from mpsboost.ops.attn_ref import MODES
from mpsboost.recipes import _rows, attention_decode, linear_attention, moe_block
from mpsboost.recipes.attention_decode import AttentionFamily
from mpsboost.recipes.linear_attention import DeltaNetFamily
from mpsboost.recipes.moe_block import MoeFamily

import tiny_models as tm

_TM = "transformers.models."
_MIXTRAL = _TM + "mixtral.modeling_mixtral."
_QWEN3 = _TM + "qwen3.modeling_qwen3."

# (recipe module, its row type, the field holding the target class)
TABLES = [
    (moe_block, MoeFamily, "block"),
    (linear_attention, DeltaNetFamily, "cls"),
    (attention_decode, AttentionFamily, "cls"),
]


# ------------------------------------------------------------------------------------------ malformed rows


def _good_moe(**change):
    kw = dict(
        block=_MIXTRAL + "MixtralSparseMoeBlock",
        router=_MIXTRAL + "MixtralTopKRouter",
        norm=True,
        cast=False,
        shared=False,
    )
    return MoeFamily(**{**kw, **change})


def _good_deltanet(**change):
    kw = dict(cls=_TM + "x.modeling_x.XGatedDeltaNet", layout="qkvz", proj=("in_proj_qkvz", "in_proj_ba"))
    return DeltaNetFamily(**{**kw, **change})


def _good_attention(**change):
    kw = dict(cls=_QWEN3 + "Qwen3Attention", kind="qk_norm", norms=(_QWEN3 + "Qwen3RMSNorm",))
    return AttentionFamily(**{**kw, **change})


MALFORMED = [
    # (make a row, the field the message must name, what else it must say)
    (lambda: _good_moe(block="MixtralSparseMoeBlock"), "block", "not a dotted class path"),
    (lambda: _good_moe(router=_MIXTRAL + "mixtral_router"), "router", "not a dotted class path"),
    (lambda: _good_moe(norm="always"), "norm='always'", "bool | str ('attr')"),
    (lambda: _good_moe(cast=1), "cast=1", "is not bool"),
    (lambda: _good_moe(shared="yes"), "shared='yes'", "is not bool"),
    (lambda: _good_deltanet(layout="fused"), "layout='fused'", "'split' | 'qkvz' | 'olmo'"),
    (lambda: _good_deltanet(proj=("in_proj_qkvz",)), "proj", "layout 'qkvz' has 2"),
    (lambda: _good_deltanet(proj=["in_proj_qkvz", "in_proj_ba"]), "proj=", "tuple[str, ...]"),
    (lambda: _good_deltanet(norm="o-norm"), "'o-norm'", "not an attribute name"),
    (lambda: _good_deltanet(cls=_TM + "x.modeling_x"), "cls", "not a dotted class path"),
    (lambda: _good_attention(kind="sliding"), "kind='sliding'", "'gated' | 'qk_norm' | 'plain'"),
    (lambda: _good_attention(norms=()), "norms=()", "names its q/k norm classes"),
    (lambda: _good_attention(kind="plain"), "kind='plain'", "names no norm classes"),
    (lambda: _good_attention(norms=("Qwen3RMSNorm",)), "norms", "not a dotted class path"),
]


@pytest.mark.parametrize("make,field,says", MALFORMED)
def test_a_malformed_row_raises_at_construction_naming_row_and_field(make, field, says):
    with pytest.raises(ValueError) as info:
        make()
    msg = str(info.value)
    row_type = msg.split(" ", 1)[0]
    assert row_type in ("MoeFamily", "DeltaNetFamily", "AttentionFamily"), msg
    assert " row '" in msg and field in msg and says in msg, msg


def test_the_good_rows_above_are_good():
    """The malformed rows differ from these in one field only: each error above is that field's."""
    assert _good_moe().shared is False and _good_deltanet().norm == "norm" and _good_attention().kind == "qk_norm"
    assert _good_moe(norm="attr").norm == "attr" and _good_attention(kind="plain", norms=()).norms == ()


def test_a_class_in_two_rows_is_refused():
    row = _good_moe()
    with pytest.raises(ValueError, match="both name block=.*MixtralSparseMoeBlock.*one row per class"):
        _rows.by_class([row, _good_moe(cast=True)], "block")


# ------------------------------------------------------------------------------------------ the tables


@pytest.mark.parametrize("module,row_type,key", TABLES, ids=lambda v: getattr(v, "__name__", v))
def test_every_row_names_real_classes_and_is_the_recipes_targets(module, row_type, key):
    rows = module.FAMILIES
    assert rows and all(type(r) is row_type for r in rows)
    recipe = registry.get_recipe(module.NAME)
    assert recipe.targets == tuple(getattr(r, key) for r in rows)  # a new row is a new target, in table order
    assert module._FAMILIES == {getattr(r, key): r for r in rows}
    for row in rows:
        for f in dataclasses.fields(row):
            if not f.metadata.get("class_path"):
                continue
            value = getattr(row, f.name)
            for path in value if isinstance(value, tuple) else (value,):
                assert _rows.is_class_path(path), (row, f.name, path)
                parts = path.split(".")
                # transformers' layout: transformers.models.<model>.modeling_<model>.<Class>
                assert parts[:2] == ["transformers", "models"] and parts[3] == f"modeling_{parts[2]}", path
                mod, cls = path.rsplit(".", 1)
                assert isinstance(getattr(importlib.import_module(mod), cls, None), type), path


def test_row_kinds_are_the_kinds_the_code_implements():
    kinds = typing.get_args(typing.get_type_hints(AttentionFamily)["kind"])
    assert set(kinds) == set(MODES)  # the fused operator's mode per kind
    layouts = typing.get_args(typing.get_type_hints(DeltaNetFamily)["layout"])
    assert set(layouts) == set(linear_attention._LAYOUT_PROJECTIONS)
    for row in linear_attention.FAMILIES:
        assert len(row.proj) == linear_attention._LAYOUT_PROJECTIONS[row.layout]


def test_is_class_path():
    assert _rows.is_class_path(_MIXTRAL + "MixtralSparseMoeBlock")
    for bad in ("MixtralSparseMoeBlock", "a..B", "a.b", "a.1B", "", None, 3, "a.b c.D"):
        assert not _rows.is_class_path(bad), bad


# ------------------------------------------------------------------------------------------ Literal options


def _literal_fields() -> list[tuple[str, str, tuple]]:
    out = []
    for recipe in registry.all_recipes():
        for name, tp in registry.option_types(recipe).items():
            if registry._literal_parts(tp) is not None:
                out.append((recipe.name, name, registry.option_choices(recipe.Options, name)))
    return out


def test_the_fixed_string_options_are_literals():
    found = {(r, f) for r, f, _ in _literal_fields()}
    assert found >= {
        ("moe_block", "path"),
        ("moe_block", "fused"),
        ("linear_attention", "prefill"),
        ("linear_attention", "compiled"),
        ("linear_attention", "fused_step"),
        ("attention_decode", "compiled"),
        ("attention_decode", "fused"),
        ("decode_linear", "path"),
        ("softmax", "path"),
        ("moe_experts", "compiled_batched_form"),
        ("moe_experts", "path"),
        ("fp8_weights", "moe_path"),
        ("fp8_weights", "activations"),
        ("fp8_weights", "mps_kernel"),
        ("wan_vae_pad", "layout"),
        ("qwen_image_vae", "layout"),
        ("low_bit_weights", "mps_kernel"),
    }
    assert registry.option_choices(moe_block.MoeBlockOptions, "fused") == ("auto", "static", "off")
    assert registry.option_choices(type(registry.get_recipe("moe_experts").Options()), "compiled_batched_form") == (
        "fused",
        "bmm",
        None,
    )
    # the recipes' own checks read the same values
    assert moe_block._PATHS == ("auto", "grouped_mm", "gather") and attention_decode._COMPILED == (
        "auto",
        "recipe",
        "stock",
    )
    assert linear_attention._CHOICES["prefill"] == ("auto", "matmul", "triangular", "stock")
    from mpsboost.ops import fp8_moe, moe as moe_ops
    from mpsboost.recipes.fp8 import paths as fp8_paths
    from mpsboost.recipes.vae import common as vae_common

    def choices(recipe, field):
        return registry.option_choices(type(registry.get_recipe(recipe).Options()), field)

    assert choices("moe_experts", "path") == ("auto", *moe_ops.PATHS)
    assert choices("fp8_weights", "moe_path") == ("auto", *fp8_moe.PATHS)
    assert choices("fp8_weights", "activations") == fp8_paths.ACTIVATIONS
    assert choices("fp8_weights", "mps_kernel") == fp8_paths.MPS_KERNELS
    assert choices("wan_vae_pad", "layout") == choices("qwen_image_vae", "layout") == vae_common.LAYOUTS


@pytest.mark.parametrize("recipe,field,allowed", _literal_fields(), ids=lambda v: v if isinstance(v, str) else "")
def test_a_value_outside_the_literal_is_refused_through_patch(recipe, field, allowed):
    model = tm.build("qwen3_moe")
    before = tm.snapshot(model)
    with pytest.raises(RecipeOptionError) as info:
        mpsboost.patch(model, recipes=[recipe], options={recipe: {field: "not-a-choice"}})
    msg = str(info.value)
    assert info.value.recipe == recipe
    assert msg.startswith(f"{recipe} option {field}='not-a-choice': expected one of "), msg
    for value in allowed:
        assert (value if isinstance(value, str) else repr(value)) in msg.split("expected one of ", 1)[1], (value, msg)
    assert f"{field!r} must be one of the values" in msg
    assert not mpsboost.api.is_patched(model) and tm.same_snapshot(before, tm.snapshot(model))
    # plan() checks the same way, and a value of another type is named with the same values
    with pytest.raises(RecipeOptionError, match=f"{field}=1: expected one of"):
        mpsboost.plan(model, recipes=[recipe], options={recipe: {field: 1}})
    mpsboost.plan(model, recipes=[recipe], options={recipe: {field: allowed[-1]}})  # a listed value passes


def test_accepted_options_show_the_literal_values():
    text = registry.accepted_options(registry.get_recipe("moe_block"))
    assert "path: str ('auto' | 'grouped_mm' | 'gather')" in text and "fused: str ('auto' | 'static' | 'off')" in text
    text = registry.accepted_options(registry.get_recipe("moe_experts"))
    assert "compiled_batched_form: str ('fused' | 'bmm') | None" in text


def test_every_default_is_within_its_literal():
    for recipe in registry.all_recipes():
        if recipe.Options is None:
            continue
        registry.check_option_defaults(recipe.name, recipe.Options)
        defaults = recipe.Options()
        for name, tp in registry.option_types(recipe).items():
            if registry._literal_parts(tp) is not None:
                assert getattr(defaults, name) in registry.option_choices(recipe.Options, name), (recipe.name, name)


class _BadDefault(registry.Recipe):
    name = "t_bad_literal_default"
    targets = ("torch.nn.modules.linear.Linear",)
    default = False

    @dataclasses.dataclass(frozen=True)
    class Options:
        mode: typing.Literal["fast", "exact"] = "quick"


def test_a_default_outside_its_literal_is_refused_at_registration():
    with pytest.raises(ValueError) as info:
        registry.register(_BadDefault)
    msg = str(info.value)
    assert "t_bad_literal_default" in msg and "Options.mode defaults to 'quick'" in msg and "fast, exact" in msg
    with pytest.raises(Exception, match="unknown recipe"):
        registry.get_recipe("t_bad_literal_default")  # not registered


# ------------------------------------------------------------------------------------------ declaration first

DECLARED_FIRST = [
    "moe_block",
    "linear_attention",
    "attention_decode",
    "moe_experts",
    "rms_norm",
    "softmax",
    "decode_linear",
    "attention_split",
    "metal_attention",
]


@pytest.mark.parametrize("name", DECLARED_FIRST)
def test_the_recipe_module_opens_with_its_declaration(name):
    """No module-level function comes before the registered recipe class (its rows, options and plans may)."""
    module = importlib.import_module(f"mpsboost.recipes.{name}")
    tree = ast.parse(Path(inspect.getfile(module)).read_text())
    first_def = next(i for i, n in enumerate(tree.body) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
    registered = [
        i
        for i, n in enumerate(tree.body)
        if isinstance(n, ast.ClassDef) and any(getattr(d, "id", None) == "register" for d in n.decorator_list)
    ]
    assert len(registered) == 1 and registered[0] < first_def, (name, registered, first_def)
