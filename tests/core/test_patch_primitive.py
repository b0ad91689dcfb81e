"""registry's one patch primitive: every kind of change a recipe makes is a Patch from a registry helper.

Each helper's undo restores the very same original objects (``is``); a failure part-way through a
multi-change patch rolls back every earlier change; and no recipe changes a module by itself (a scan
of the recipe sources).
"""
from __future__ import annotations

import ast
import types
import warnings
from pathlib import Path

import pytest
import torch

import mpsboost
from mpsboost import patching, registry
from mpsboost.errors import IrreversiblePatchError, PatchError
from mpsboost.registry import Decision, Recipe
from mpsboost.patching import (
    ATTR,
    Changes,
    Patch,
    at_commit,
    bind_forward,
    held_by,
    hold_instance_attr,
    keep_attrs,
    register_in_interface,
    relayout_param,
    replace_at_commit,
    set_attr,
    set_instance_attr,
    swap_class,
)


# ------------------------------------------------------------------------------- each helper

def test_bind_forward_restores_the_same_forward():
    lin = torch.nn.Linear(4, 3)
    own = types.MethodType(lambda self, x: x, lin)
    object.__setattr__(lin, "forward", own)  # an instance forward someone set before us
    p = bind_forward(lin, "t_fwd", lambda self, x: x * 2)
    x = torch.randn(2, 4)
    torch.testing.assert_close(lin(x), x * 2)
    p()
    assert lin.__dict__["forward"] is own
    assert ATTR not in lin.__dict__


def test_set_instance_attr_restores_the_same_value_or_absence():
    lin = torch.nn.Linear(4, 3)
    before = object()
    lin.__dict__["_marker"] = before
    p1 = set_instance_attr(lin, "t_attr", "_marker", 1)
    p2 = set_instance_attr(lin, "t_attr", "_fresh", 2)
    assert lin._marker == 1 and lin._fresh == 2
    Patch.chain([p1, p2])()
    assert lin.__dict__["_marker"] is before
    assert "_fresh" not in lin.__dict__ and ATTR not in lin.__dict__


def test_set_attr_restores_previous_unless_changed_since():
    class Cfg:
        pass

    cfg = Cfg()
    old, new = object(), object()
    cfg.impl = old
    p = set_attr(cfg, "impl", new)
    assert cfg.impl is new
    p()
    assert cfg.impl is old
    # Someone chose another value after the patch: theirs stays.
    p = set_attr(cfg, "impl", new)
    theirs = object()
    cfg.impl = theirs
    p()
    assert cfg.impl is theirs
    # An attribute the object did not have is removed again; nothing of mpsboost stays on the object.
    p = set_attr(cfg, "fresh", new)
    p()
    assert "fresh" not in cfg.__dict__ and ATTR not in cfg.__dict__


def test_keep_attrs_puts_back_what_a_library_call_changed():
    class Cfg:
        pass

    a, b = Cfg(), Cfg()
    va = object()
    a.x = va
    p = keep_attrs([a, b], "x")
    a.x, b.x = 1, 2  # the library call
    p()
    assert a.x is va and b.x is None


def test_swap_class_restores_the_same_class():
    class Sub(torch.nn.Linear):
        pass

    lin = torch.nn.Linear(4, 3)
    other = torch.nn.Linear(4, 3)
    p = swap_class(lin, "t_cls", Sub)
    assert type(lin) is Sub and type(other) is torch.nn.Linear
    assert patching.is_patched_by(lin, "t_cls")
    p()
    assert type(lin) is torch.nn.Linear
    assert ATTR not in lin.__dict__
    with pytest.raises(TypeError, match="subclass"):
        swap_class(lin, "t_cls", torch.nn.Conv2d)


def test_hold_instance_attr_is_shared_and_removed_by_the_last_holder():
    m = torch.nn.Linear(2, 2)
    made = []

    def make():
        made.append(object())
        return made[-1]

    p1 = hold_instance_attr(m, "_shared", make, True)
    p2 = hold_instance_attr(m, "_shared", make, False)
    assert len(made) == 1 and m.__dict__["_shared"] is made[0]
    assert held_by(m, "_shared") == [True, False]
    p1()
    assert m.__dict__["_shared"] is made[0] and held_by(m, "_shared") == [False]
    p2()
    assert "_shared" not in m.__dict__ and held_by(m, "_shared") is None
    # Bound by someone else: left in place, and the Patch changes nothing.
    theirs = object()
    m.__dict__["_shared"] = theirs
    hold_instance_attr(m, "_shared", make)()
    assert m.__dict__["_shared"] is theirs and held_by(m, "_shared") is None


def test_a_held_method_bound_to_its_module_does_not_keep_the_module_alive():
    # The moe_experts decode switch: a method bound to the very module that holds it. Kept in a
    # process-wide table (even a WeakKeyDictionary keyed by the module) the value references its key
    # and the module is never freed; kept on the module it is a cycle the collector frees.
    import gc
    import types
    import weakref

    def bound_to(mod):
        return lambda: types.MethodType(lambda self: self, mod)

    m = torch.nn.Linear(2, 2)
    p = hold_instance_attr(m, "_switch", bound_to(m), True)
    assert m._switch() is m and held_by(m, "_switch") == [True]
    ref = weakref.ref(m)
    del m, p
    gc.collect()
    assert ref() is None
    # And nothing of it is left in a module-level store.
    from mpsboost import patching, registry

    for mod in (patching, registry):
        assert not [k for k, v in vars(mod).items() if isinstance(v, weakref.WeakKeyDictionary)]


def test_register_in_interface_adds_a_key_once_and_never_replaces():
    class Interface:
        _global_mapping: dict = {"stock": "stock-fn"}

        @classmethod
        def register(cls, key, fn):
            cls._global_mapping[key] = fn

    calls = []
    fn = lambda: None  # noqa: E731

    def make():
        calls.append(1)
        return fn

    p = register_in_interface(Interface, "t_key", make)
    register_in_interface(Interface, "t_key", make)
    assert Interface._global_mapping["t_key"] is fn and len(calls) == 1
    p()  # the key stays (a copy of a patched model may still name it)
    assert Interface._global_mapping["t_key"] is fn
    with pytest.raises(RuntimeError, match="did not register"):
        register_in_interface(Interface, "stock", make)
    assert Interface._global_mapping["stock"] == "stock-fn"


def test_relayout_param_keeps_the_parameter_and_values():
    conv = torch.nn.Conv2d(3, 4, 3)
    w = conv.weight
    values = w.detach().clone()
    p = relayout_param(w, torch.channels_last)
    assert conv.weight is w and w.is_contiguous(memory_format=torch.channels_last)
    p()
    assert conv.weight is w and w.is_contiguous()
    torch.testing.assert_close(w.detach(), values, rtol=0, atol=0)


def test_replace_at_commit_keeps_the_original_until_commit():
    lin = torch.nn.Linear(4, 3)
    w = lin.weight
    p = replace_at_commit(lin, ["weight"], lambda n, t: {n: t.detach().half(), n + "_scale": torch.ones(())},
                          explanation="reload it")
    assert lin.weight is w and not p.reversible and p.explanation == "reload it"
    p()  # a rollback before commit: the very same parameter
    assert lin.weight is w
    p2 = replace_at_commit(lin, ["weight"], lambda n, t: {n: t.detach().half(), n + "_scale": torch.ones(())},
                           explanation="reload it")
    p2.commit()
    assert "weight" in lin._buffers and "weight" not in lin._parameters
    assert lin.weight.dtype == torch.float16 and "weight_scale" in lin._buffers


def test_chain_commit_error_undoes_every_part_and_reports():
    lin = torch.nn.Linear(4, 3)
    w, fwd_before = lin.weight, lin.__dict__.get("forward")

    def fail(name, t):
        raise MemoryError("no room")

    seen = []
    p = Patch.chain([bind_forward(lin, "t_chain", lambda self, x: x),
                     replace_at_commit(lin, ["weight"], fail, explanation="reload"),
                     at_commit(lambda: seen.append("converted"), "after")],
                    on_commit_error=seen.append)
    assert not p.reversible
    p.commit()
    assert isinstance(seen[0], MemoryError) and "converted" not in seen
    assert lin.weight is w and lin.__dict__.get("forward") is fwd_before and ATTR not in lin.__dict__
    assert p.reversible  # nothing of it is left


# ------------------------------------------------------------------------------- rollback in a transaction

def test_changes_rolls_back_earlier_changes_on_a_failure_part_way():
    class Cfg:
        pass

    root = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Conv2d(3, 3, 3))
    cfg = Cfg()
    cfg.impl = before_impl = object()
    w = root[1].weight
    with pytest.raises(ValueError, match="half-way"):
        with Changes() as ch:
            ch.add(bind_forward(root[0], "t_tx", lambda self, x: x))
            ch.add(set_instance_attr(root, "t_tx", "_flag", True))
            ch.add(set_attr(cfg, "impl", "mine"))
            ch.add(relayout_param(w, torch.channels_last))
            raise ValueError("half-way")
    assert "forward" not in root[0].__dict__ and "_flag" not in root.__dict__
    assert cfg.impl is before_impl and w.is_contiguous() and root[1].weight is w
    assert all(ATTR not in m.__dict__ for m in root.modules())


class _TwoStep(Recipe):
    """A recipe whose apply changes several things, then fails on the second linear."""

    name = "t_two_step"
    targets = ("torch.nn.modules.linear.Linear",)
    default = False

    def decide(self, match, env, options):
        return Decision.apply("test", "test")

    def apply(self, match, decision, env, options):
        with Changes() as ch:
            ch.add(bind_forward(match.module, self.name, lambda self_, x: x))
            ch.add(set_instance_attr(match.module, self.name, "_t_mark", 1))
            if match.path.endswith("1"):
                raise RuntimeError("boom on the second module")
        return ch.patch(description=self.name)


def test_patch_failure_part_way_rolls_back_every_earlier_change():
    registry.register(_TwoStep)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        forwards = [m.__dict__.get("forward") for m in model]
        x = torch.randn(2, 4)
        ref = model(x)
        with pytest.raises(PatchError, match="t_two_step failed on 1"):
            mpsboost.patch(model, recipes=["t_two_step"])
        assert [m.__dict__.get("forward") for m in model] == forwards
        assert all("_t_mark" not in m.__dict__ and ATTR not in m.__dict__ for m in model)
        torch.testing.assert_close(model(x), ref, rtol=0, atol=0)
        assert not mpsboost.api.is_patched(model)
    finally:
        registry.unregister("t_two_step")


def test_irreversible_patch_unpatch_shows_its_explanation():
    class Convert(Recipe):
        name = "t_convert"
        targets = ("torch.nn.modules.linear.Linear",)
        default = False
        reversible = False

        def decide(self, match, env, options):
            return Decision.apply("test", "test")

        def apply(self, match, decision, env, options):
            return replace_at_commit(match.module, ["weight"], lambda n, t: {n: t.detach().clone()},
                                     explanation="load the t_convert checkpoint again")

    registry.register(Convert)
    try:
        lin = torch.nn.Linear(4, 3)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            mpsboost.patch(lin, recipes=["t_convert"])
        assert "weight" in lin._buffers
        with pytest.raises(IrreversiblePatchError, match="load the t_convert checkpoint again"):
            mpsboost.unpatch(lin)
    finally:
        registry.unregister("t_convert")


# ------------------------------------------------------------------------------- structure of the recipes

_RECIPES = Path(mpsboost.__file__).parent / "recipes"
_FORBIDDEN_CALLS = {"setattr", "delattr", "object.__setattr__", "object.__delattr__"}
_FORBIDDEN_METHODS = {"__setattr__", "__delattr__", "register_buffer", "register_parameter", "register_module", "add_module", "register"}


def _recipe_classes(tree: ast.Module) -> set[str]:
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)
            and any(isinstance(b, ast.Name) and b.id == "Recipe" for b in n.bases)}


def _offences(path: Path) -> list[str]:
    """Changes a recipe module makes by itself instead of through a registry helper.

    Allowed: a helper class setting its own attributes in its methods (``self.x = ...`` directly in a
    class body's method, not a Recipe's); local dicts and lists. Everything else that assigns or deletes
    an attribute, writes ``__dict__``, swaps ``__class__``, or calls setattr / object.__setattr__ /
    register_buffer / an interface's register is an offence, and so is building a Patch by hand.
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    recipes = _recipe_classes(tree)
    allowed_self: set[int] = set()  # ids of assignment nodes on self inside helper-class methods
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name not in recipes):
        for fn in (f for f in cls.body if isinstance(f, ast.FunctionDef)):
            for node in ast.walk(fn):
                allowed_self.add(id(node))
    out = []

    def where(node: ast.AST) -> str:
        return f"{path.name}:{node.lineno}: {ast.unparse(node)[:80]}"

    for node in ast.walk(tree):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = list(node.targets)
        flat = []
        for t in targets:
            flat += list(t.elts) if isinstance(t, (ast.Tuple, ast.List)) else [t]
        for t in flat:
            if isinstance(t, ast.Attribute):
                on_self = isinstance(t.value, ast.Name) and t.value.id == "self"
                if t.attr == "__class__" or not (on_self and id(node) in allowed_self):
                    out.append(where(node))
            elif isinstance(t, ast.Subscript) and "__dict__" in ast.unparse(t.value):
                out.append(where(node))
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if name in ("Patch", "Undo", "patching.Patch", "patching.Undo"):
                out.append(where(node))
            elif name in _FORBIDDEN_CALLS:
                first = node.args[0] if node.args else None
                self_in_helper = isinstance(first, ast.Name) and first.id == "self" and id(node) in allowed_self
                if not (name == "setattr" and self_in_helper):
                    out.append(where(node))
            elif isinstance(node.func, ast.Attribute) and node.func.attr in _FORBIDDEN_METHODS:
                out.append(where(node))
    return out


def test_recipes_change_modules_only_through_registry_helpers():
    files = sorted(f for f in _RECIPES.rglob("*.py") if f.name != "formats.py")  # formats: plain data classes
    assert len(files) >= 10
    offences = [o for f in files for o in _offences(f)]
    assert not offences, "recipe code that changes objects without a registry helper:\n" + "\n".join(offences)


def test_the_structure_scan_catches_direct_changes(tmp_path):
    bad = tmp_path / "bad_recipe.py"
    bad.write_text(
        "class R(Recipe):\n"
        "    def apply(self, match, decision, env, options):\n"
        "        m = match.module\n"
        "        m.__class__ = object\n"
        "        m.forward = None\n"
        "        setattr(m, 'x', 1)\n"
        "        object.__setattr__(m, 'y', 2)\n"
        "        m.__dict__['z'] = 3\n"
        "        m.register_buffer('b', None)\n"
        "        return Undo(lambda: None)\n"
        "class Helper:\n"
        "    def __init__(self, **kw):\n"
        "        self.ok = 1\n"
        "        for k, v in kw.items():\n"
        "            setattr(self, k, v)\n"
    )
    found = _offences(bad)
    assert len(found) == 7, found
    assert not any(":13:" in o or ":15:" in o for o in found)
