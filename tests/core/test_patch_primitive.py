"""The one patch primitive: every kind of change a recipe makes is a Patch from a helper of mpsboost.patching.

Each helper's undo restores the very same original objects (``is``); a failure part-way through a
multi-change patch rolls back every earlier change; and no code of the package but patching.py changes a
module by itself (a scan of the sources, with an allow-list that says why for each exception).
"""

from __future__ import annotations

import ast
import re
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
    call_original,
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

    from mpsboost import patching, registry

    m = torch.nn.Linear(2, 2)
    p = hold_instance_attr(m, "_switch", bound_to(m), True)
    assert m._switch() is m and held_by(m, "_switch") == [True]
    assert registry.matches_class(m, ("torch.nn.modules.linear.Linear",))  # fills the per-class cache
    ref = weakref.ref(m)
    del m, p
    gc.collect()
    assert ref() is None
    # And nothing of it is left in a module-level store: the weak tables there are keyed by classes (the
    # per-class caches of the registry) and hold no module.
    stores = [v for mod in (patching, registry) for v in vars(mod).values() if isinstance(v, weakref.WeakKeyDictionary)]
    assert stores
    for store in stores:
        for key, value in store.items():
            assert isinstance(key, type) and not isinstance(value, torch.nn.Module), (key, value)


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
    p = replace_at_commit(
        lin, ["weight"], lambda n, t: {n: t.detach().half(), n + "_scale": torch.ones(())}, explanation="reload it"
    )
    assert lin.weight is w and not p.reversible and p.explanation == "reload it"
    p()  # a rollback before commit: the very same parameter
    assert lin.weight is w
    p2 = replace_at_commit(
        lin, ["weight"], lambda n, t: {n: t.detach().half(), n + "_scale": torch.ones(())}, explanation="reload it"
    )
    p2.commit()
    assert "weight" in lin._buffers and "weight" not in lin._parameters
    assert lin.weight.dtype == torch.float16 and "weight_scale" in lin._buffers


def test_chain_commit_error_undoes_every_part_and_reports():
    lin = torch.nn.Linear(4, 3)
    w, fwd_before = lin.weight, lin.__dict__.get("forward")

    def fail(name, t):
        raise MemoryError("no room")

    seen = []
    p = Patch.chain(
        [
            bind_forward(lin, "t_chain", lambda self, x: x),
            replace_at_commit(lin, ["weight"], fail, explanation="reload"),
            at_commit(lambda: seen.append("converted"), "after"),
        ],
        on_commit_error=seen.append,
    )
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
            return replace_at_commit(
                match.module,
                ["weight"],
                lambda n, t: {n: t.detach().clone()},
                explanation="load the t_convert checkpoint again",
            )

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


# ------------------------------------------------------------------------------- structure of the package

_PACKAGE = Path(mpsboost.__file__).parent
# Where a torch module keeps what a patch changes: its forward (an instance attribute, or accelerate's
# slot inside its hook), its class, and the containers Module.__setattr__ writes.
_STATE_ATTRS = {
    "forward",
    "_old_forward",
    "__class__",
    "__dict__",
    "_parameters",
    "_buffers",
    "_modules",
    "_non_persistent_buffers_set",
    "_forward_hooks",
    "_forward_pre_hooks",
}
_CONTAINERS = _STATE_ATTRS - {"forward", "_old_forward", "__class__"}
_MUTATORS = {
    "update",
    "pop",
    "popitem",
    "setdefault",
    "clear",
    "__setitem__",
    "__delitem__",
    "add",
    "discard",
    "remove",
}
_SETATTR_CALLS = {"setattr", "delattr", "object.__setattr__", "object.__delattr__"}
_REGISTER_METHODS = {"register_buffer", "register_parameter", "register_module", "add_module", "register"}
_MODULE_ITERATORS = {"modules", "named_modules", "children", "named_children"}
_MODULE_ANNOTATION = re.compile(r"\bnn\.(Module|[A-Z]\w*)\b|\bModule\b")

# Code outside patching.py that changes a module's state itself, each entry with why. Keyed by the file
# (relative to src/mpsboost) and the statement as ast.unparse prints it, or None for every statement of
# the file. An entry that matches nothing any more fails the guard: remove it when its code changes.
_ALLOWED: dict[tuple[str, str | None], str] = {
    # The log of each patch() call (the Patches to undo, the report) lives on the object passed to
    # patch(), a pipeline or a model, as `_mpsboost_records`; a copy gets none (see patching's docstring).
    ("api.py", None): "patch()'s own records on the patched object, not a change to a module",
    # The VidTok causal conv keeps its frame cache on the module at run time, as the stock forward does.
    ("ops/pad5d.py", "module.causal_cache = x.clone()"): "the stock forward's own run-time cache",
    (
        "ops/pad5d.py",
        "module.causal_cache = x[:, :, :-module.cache_offset].clone()",
    ): "the stock forward's own run-time cache",
    # A copy of a function (new globals) gets the original's attributes, as functools.update_wrapper does.
    ("recipes/_hf_sample.py", "new.__dict__.update(fn.__dict__)"): "a function's attributes, no module",
}


def _recipe_classes(tree: ast.Module) -> set[str]:
    return {
        n.name
        for n in ast.walk(tree)
        if isinstance(n, ast.ClassDef) and any(isinstance(b, ast.Name) and b.id == "Recipe" for b in n.bases)
    }


def _scopes(tree: ast.Module) -> list[ast.AST]:
    """The outermost functions (methods included) and the module body outside them: aliases and module
    names are tracked per scope, nested functions (a bound forward, an undo) belong to their outer one."""
    out: list[ast.AST] = []
    rest: list[ast.stmt] = []

    def visit(body: list[ast.stmt]) -> None:
        for st in body:
            if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append(st)
            elif isinstance(st, ast.ClassDef):
                visit(st.body)
            else:
                rest.append(st)

    visit(tree.body)
    return out + [ast.Module(body=rest, type_ignores=[])]


def _root(node: ast.AST) -> ast.AST:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node


def _chain_names(node: ast.AST) -> list[str]:
    names = []
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        if isinstance(node, ast.Attribute):
            names.append(node.attr)
        node = node.value
    return names


def _offences(path: Path, rel: str | None = None) -> list[str]:
    """Statements of ``path`` that change a torch module's state without a helper of mpsboost.patching.

    An offence writes (assigns, deletes, updates in place):
    - a module's forward, ``_old_forward``, ``__class__``, ``__dict__``, ``_parameters``, ``_buffers``,
      ``_modules`` or hook dicts, on any object, or an item of such a container (also through
      ``vars(x)`` and through a local name bound to one: ``d = m.__dict__; d[k] = v``), or calls a
      mutating method of one (``m.__dict__.update(...)``, ``vars(m).update(...)``, ``m._buffers.pop(...)``);
    - any attribute of an evident module, or of what hangs off one (its config, a submodule):
      ``match.module`` / ``x.module``, a parameter annotated with a ``torch.nn`` class, a loop variable
      over ``.modules()`` / ``.named_modules()`` / ``.children()``, a name bound to any of these or to an
      attribute of one (``cfg = model.config``); or any attribute to ``nn.Parameter(...)``;
    - calls ``setattr`` / ``delattr`` / ``object.__setattr__`` / any ``__setattr__`` / ``__delattr__``,
      ``register_buffer`` / ``register_parameter`` / ``register_module`` / ``add_module`` or an
      interface's ``register``; or builds a ``Patch`` by hand.

    Allowed: a class of the package (not a Recipe) setting its own attributes in its methods
    (``self.x = ...``, ``object.__setattr__(self, ...)`` in a frozen dataclass's ``__post_init__``,
    ``super().__setattr__``); attribute writes on plain objects (a plan, a record, a config the code
    built itself). ``rel`` names the file in messages and in :data:`_ALLOWED`.
    """
    rel = rel or path.name
    tree = ast.parse(path.read_text(), filename=str(path))
    recipes = _recipe_classes(tree)
    own_self: set[int] = set()  # nodes inside methods of the package's own non-Recipe classes
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name not in recipes):
        for fn in (f for f in cls.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))):
            own_self.update(id(n) for n in ast.walk(fn))
    found: dict[tuple[int, str], str] = {}
    for scope in _scopes(tree):
        scan = _Scan(rel, own_self, found)
        nodes = list(ast.walk(scope))
        for node in nodes:
            scan.bind(node)
        for node in nodes:
            scan.check_writes(node)
            if isinstance(node, ast.Call):
                scan.check_call(node)
    return sorted(found.values(), key=lambda o: int(o.split(":")[1]))


class _Scan:
    """One scope of :func:`_offences`: the local names it binds to a module's state container (``aliases``) or to
    an evident torch module (``modules``), then the offences of its statements, into ``found``."""

    def __init__(self, rel: str, own_self: set[int], found: dict[tuple[int, str], str]):
        self.rel, self.own_self, self.found = rel, own_self, found
        self.aliases: set[str] = set()  # local names bound to a module's state container
        self.modules: set[str] = set()  # local names that evidently hold a torch module

    def offend(self, node: ast.AST) -> None:
        rel, text = self.rel, ast.unparse(node)
        if (rel, None) in _ALLOWED or (rel, text) in _ALLOWED:
            _used.add((rel, None) if (rel, None) in _ALLOWED else (rel, text))
            return
        self.found[(node.lineno, text)] = f"{rel}:{node.lineno}: {text[:100]}"

    def is_self(self, node: ast.AST, at: ast.AST) -> bool:
        own = id(at) in self.own_self
        if isinstance(node, ast.Name) and node.id == "self":
            return own
        return own and isinstance(node, ast.Call) and ast.unparse(node.func) == "super"

    def container(self, node: ast.AST) -> bool:
        if isinstance(node, ast.Attribute):
            return node.attr in _CONTAINERS
        if isinstance(node, ast.Call):
            fn = ast.unparse(node.func)
            named = node.args[1] if fn == "getattr" and len(node.args) > 1 else None
            return fn == "vars" or (isinstance(named, ast.Constant) and named.value in _CONTAINERS)
        return isinstance(node, ast.Name) and node.id in self.aliases

    def evident_module(self, node: ast.AST) -> bool:
        root = _root(node)
        return (isinstance(root, ast.Name) and root.id in self.modules) or "module" in _chain_names(node)[1:]

    def bind(self, node: ast.AST) -> None:
        """The names ``node`` binds: an annotated module parameter, an alias of a state container, a module taken
        off another (``x.module``, its config, a submodule), a loop variable over a module iterator."""
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            args = node.args
            for a in (*args.posonlyargs, *args.args, *args.kwonlyargs):
                if a.annotation is not None and _MODULE_ANNOTATION.search(ast.unparse(a.annotation)):
                    self.modules.add(a.arg)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name):
                    if self.container(node.value):
                        self.aliases.add(t.id)
                    # x.module, and what hangs off an evident module (its config, its submodules)
                    if isinstance(node.value, (ast.Attribute, ast.Subscript)) and (
                        self.evident_module(node.value) or _chain_names(node.value)[:1] == ["module"]
                    ):
                        self.modules.add(t.id)
        elif isinstance(node, (ast.For, ast.comprehension)):
            it = node.iter
            over = it.func.attr if isinstance(it, ast.Call) and isinstance(it.func, ast.Attribute) else None
            if over in _MODULE_ITERATORS:
                t = node.target
                last = t.elts[-1] if isinstance(t, ast.Tuple) and t.elts else t
                if isinstance(last, ast.Name):
                    self.modules.add(last.id)

    def check_writes(self, node: ast.AST) -> None:
        """An assignment, augmented assignment or ``del`` that writes a module's state."""
        targets: list[ast.AST] = []
        value = None
        if isinstance(node, ast.Assign):
            targets, value = list(node.targets), node.value
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets, value = [node.target], node.value
        elif isinstance(node, ast.Delete):
            targets = list(node.targets)
        flat: list[ast.AST] = []
        for t in targets:
            flat += list(t.elts) if isinstance(t, (ast.Tuple, ast.List)) else [t]
        for t in flat:
            if isinstance(t, ast.Attribute):
                if self.is_self(t.value, node) and t.attr != "__class__":
                    continue
                parameter = isinstance(value, ast.Call) and ast.unparse(value.func).split(".")[-1] == "Parameter"
                if t.attr in _STATE_ATTRS or self.evident_module(t) or parameter:
                    self.offend(node)
            elif isinstance(t, ast.Subscript) and self.container(t.value):
                self.offend(node)
            elif isinstance(t, ast.Name) and isinstance(node, ast.AugAssign) and t.id in self.aliases:
                self.offend(node)

    def check_call(self, node: ast.Call) -> None:
        """A call that changes a module: a hand-built ``Patch``, ``setattr``-like calls, ``register_*``, a
        mutating method of a state container."""
        name = ast.unparse(node.func)
        first = node.args[0] if node.args else None
        if name in ("Patch", "patching.Patch", "mpsboost.patching.Patch"):
            self.offend(node)
        elif name in _SETATTR_CALLS or (
            isinstance(node.func, ast.Attribute) and node.func.attr in ("__setattr__", "__delattr__")
        ):
            receiver = node.func.value if name.endswith(("super().__setattr__", "super().__delattr__")) else first
            if not (receiver is not None and self.is_self(receiver, node)):
                self.offend(node)
        elif isinstance(node.func, ast.Attribute) and node.func.attr in _REGISTER_METHODS:
            if not self.is_self(node.func.value, node):
                self.offend(node)
        elif isinstance(node.func, ast.Attribute) and node.func.attr in _MUTATORS and self.container(node.func.value):
            self.offend(node)


_used: set[tuple[str, str | None]] = set()


def test_the_package_changes_modules_only_through_patching_helpers():
    """Every file of src/mpsboost but patching.py (recipes, API, checkpoints, ops, bench, CLI, ...)."""
    files = sorted(f for f in _PACKAGE.rglob("*.py") if f != _PACKAGE / "patching.py")
    rels = {f.relative_to(_PACKAGE).as_posix() for f in files}
    assert (
        len(files) >= 40
        and "recipes/fp8/formats.py" in rels
        and "ops/sampling.py" in rels
        and "recipes/_hf_sample.py" in rels
    )
    _used.clear()
    offences = [o for f in files for o in _offences(f, f.relative_to(_PACKAGE).as_posix())]
    assert not offences, "code that changes a module without a helper of mpsboost.patching:\n" + "\n".join(offences)
    stale = sorted(f"{f}: {s or '(whole file)'}" for f, s in set(_ALLOWED) - _used)
    assert not stale, "allow-list entries that match nothing any more (remove them):\n" + "\n".join(stale)


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
        "        return Patch(lambda: None)\n"
        "class Helper:\n"
        "    def __init__(self, **kw):\n"
        "        self.ok = 1\n"
        "        for k, v in kw.items():\n"
        "            setattr(self, k, v)\n"
        "def holes(module: torch.nn.Module, match, root, plan):\n"
        "    module._buffers['w'] = None\n"
        "    match.module._parameters['w'] = None\n"
        "    module.__dict__.update(x=1)\n"
        "    vars(module)['x'] = 1\n"
        "    vars(root).update(x=1)\n"
        "    torch.nn.Module.__setattr__(root, 'x', 1)\n"
        "    d = root.__dict__\n"
        "    d['x'] = 1\n"
        "    del module._modules['a']\n"
        "    module.extra = 1\n"
        "    match.module.extra = 1\n"
        "    for name, sub in root.named_modules():\n"
        "        sub.flag = True\n"
        "    plan.weight = torch.nn.Parameter(None)\n"
        "    plan.ignored = ['a']\n"
        "    plan.problems += ['b']\n"
        "    cfg = object()\n"
        "    cfg.x = 1\n"
        "    conf = module.config\n"
        "    conf._attn_implementation = 'eager'\n"
        "    getattr(plan, '__dict__')['x'] = 1\n"
        "@dataclass(frozen=True)\n"
        "class Record:\n"
        "    x: int\n"
        "    def __post_init__(self):\n"
        "        object.__setattr__(self, 'x', int(self.x))\n"
    )
    found = _offences(bad)
    lines = sorted(int(o.split(":")[1]) for o in found)
    # Every line of R.apply but the first, every hole in holes() (the line of `d = root.__dict__` binds an
    # alias, its write is the offence; a config reached from a module is the module's); never Helper, the
    # writes on plain objects the code built (plan, cfg) or the frozen dataclass initialising itself.
    assert lines == [4, 5, 6, 7, 8, 9, 10, 17, 18, 19, 20, 21, 22, 24, 25, 26, 27, 29, 30, 36, 37], found


# Files that read the per-module store by its name instead of through patching's readers (saved_state,
# is_patched_by, held_by, without_record), each with why. An entry that matches nothing fails the test.
_STORE_READERS = {
    "api.py": "unpatch() tells a copy of a patched model by the store on its modules (_patched_modules)",
}


def test_only_patching_names_the_per_module_store():
    """The store (``_mpsboost_patches``) has one owner: no other file imports ``patching.ATTR`` or spells
    the attribute's name, so its layout can change in one place."""
    found = set()
    for f in sorted(_PACKAGE.rglob("*.py")):
        rel = f.relative_to(_PACKAGE).as_posix()
        if rel == "patching.py":
            continue
        tree = ast.parse(f.read_text(), filename=str(f))
        for node in ast.walk(tree):
            imports = (
                isinstance(node, ast.ImportFrom)
                and (node.module or "").endswith("patching")
                and any(a.name == "ATTR" for a in node.names)
            )
            spelled = isinstance(node, ast.Constant) and node.value == patching.ATTR
            if imports or spelled:
                found.add(rel)
    assert found - set(_STORE_READERS) == set(), sorted(found - set(_STORE_READERS))
    assert set(_STORE_READERS) - found == set(), f"remove {sorted(set(_STORE_READERS) - found)} from _STORE_READERS"


def test_replace_tensors_keeps_non_persistent_buffers_out_of_the_state_dict_until_undone():
    # A derived copy (torch's int4pack of low-bit codes) rides along as a buffer that no saved file may hold.
    from mpsboost.patching import replace_tensors

    lin = torch.nn.Linear(4, 3)
    keys = set(lin.state_dict())
    packed = torch.arange(6.0)
    p = replace_tensors(lin, {"pack": packed, "extra": torch.ones(2)}, explanation="reload", non_persistent=("pack",))
    assert lin.pack is packed and "pack" not in lin.state_dict() and set(lin.state_dict()) == keys | {"extra"}
    p()
    assert "pack" not in lin._buffers and not lin._non_persistent_buffers_set and set(lin.state_dict()) == keys
    for bad in ({"pack": None}, {"pack": torch.nn.Parameter(torch.ones(1))}, {}):
        with pytest.raises(ValueError, match="non_persistent names 'pack'"):
            replace_tensors(lin, bad, explanation="reload", non_persistent=("pack",))
    assert set(lin.state_dict()) == keys and not lin._non_persistent_buffers_set


def test_call_original_traces_where_dynamo_calls_the_class_an_in_graph_function():
    # dynamo resolves type(module) of diffusers' Attention (the mid-block attention of HunyuanVideo's VAE and of
    # every classic diffusers VAE) to an in-graph callable, whose `.forward` it cannot trace: call_original calls
    # the class's forward saved at patch time instead.
    pytest.importorskip("diffusers")
    from diffusers.models.attention_processor import Attention

    torch.manual_seed(0)
    attn = Attention(query_dim=8, heads=2, dim_head=4).eval()
    x = torch.randn(1, 5, 8)
    with torch.no_grad():
        want = attn(x)

    def through(self_, *args, **kwargs):
        return 2 * call_original(self_, "t", *args, **kwargs)

    undo = bind_forward(attn, "t", through)
    try:
        torch._dynamo.reset()
        with torch.no_grad():
            got = torch.compile(attn, fullgraph=True, backend="eager")(x)
        torch.testing.assert_close(got, 2 * want, rtol=1e-5, atol=1e-6)
    finally:
        undo()
        torch._dynamo.reset()
    assert "forward" not in attn.__dict__
