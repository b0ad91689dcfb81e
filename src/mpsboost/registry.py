"""Recipes: their declaration, their registry, and the one way they patch a module instance.

A recipe module opens with its declaration::

    @register
    class WanVaePad(Recipe):
        name = "wan_vae_pad"
        summary = "fold spatial zero padding into each causal Conv3d; no F.pad on 5-D tensors"
        targets = ("diffusers.models.autoencoders.autoencoder_kl_wan.WanCausalConv3d",)
        lossless = True
        reversible = True
        requires = ()

then implements :meth:`Recipe.decide` (pure: which backing path, or why not) and :meth:`Recipe.apply`
(changes one instance, returns an :class:`Undo`). ``plan()`` calls only ``find`` and ``decide``;
``patch()`` calls ``apply`` for every applicable match, as one transaction.

Targets are matched by class path strings against each module's MRO, so matching imports nothing:
``import mpsboost`` never imports diffusers or transformers.
"""
from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterable, Iterator, Mapping

import torch

from .errors import UnknownRecipeError
from .gate import Env, check_all

__all__ = [
    "Recipe",
    "Match",
    "Decision",
    "Undo",
    "register",
    "unregister",
    "get_recipe",
    "recipe_names",
    "all_recipes",
    "class_path",
    "matches_class",
    "join_path",
    "bind_forward",
    "call_original",
    "ATTR",
]

# The one namespaced attribute on a patched module instance: {recipe name: what it saved}.
ATTR = "_mpsboost_patches"


def class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def matches_class(obj: Any, targets: Iterable[str]) -> bool:
    """True when any class in ``type(obj).__mro__`` has one of the dotted paths in ``targets``."""
    wanted = set(targets)
    return any(class_path(c) in wanted for c in type(obj).__mro__)


@dataclass
class Match:
    """One target a recipe found: the module, its dotted path in the report, and recipe data."""

    module: torch.nn.Module
    path: str
    data: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Decision:
    """What a recipe would do to one match in one environment.

    ``applicable=False``: the recipe has a reason not to touch it here (gate failed, nothing to gain).
    ``backing``: the backing path the report names, e.g. ``"conv padding fold"``.
    """

    applicable: bool
    backing: str = ""
    reason: str = ""
    details: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def apply(cls, backing: str, reason: str, **details: Any) -> "Decision":
        return cls(True, backing, reason, details)

    @classmethod
    def skip(cls, reason: str, **details: Any) -> "Decision":
        return cls(False, "", reason, details)


class Undo:
    """Returned by :meth:`Recipe.apply`. Calling it restores what apply changed.

    ``commit`` (optional) runs once the whole ``patch()`` transaction succeeded, e.g. to free the
    original weights that an irreversible recipe kept only so that a failed transaction could roll back.
    After commit, an irreversible recipe's undo may no longer be possible: ``reversible`` says so.
    """

    __slots__ = ("_undo", "_commit", "reversible", "description", "done")

    def __init__(
        self,
        undo: Callable[[], None],
        *,
        commit: Callable[[], None] | None = None,
        reversible: bool = True,
        description: str = "",
    ):
        self._undo = undo
        self._commit = commit
        self.reversible = reversible
        self.description = description
        self.done = False

    def __call__(self) -> None:
        if not self.done:
            self._undo()
            self.done = True

    def commit(self) -> None:
        if self._commit is not None:
            self._commit()
            self._commit = None

    @staticmethod
    def chain(undos: "list[Undo]", **kw: Any) -> "Undo":
        """One undo that runs ``undos`` in reverse order."""

        def run() -> None:
            for u in reversed(undos):
                u()

        def commit() -> None:
            for u in undos:
                u.commit()

        return Undo(run, commit=commit, **kw)


class Recipe:
    """Base class of every recipe. Subclasses set the declarative attributes and implement decide/apply."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    targets: ClassVar[tuple[str, ...]] = ()
    lossless: ClassVar[bool] = True
    reversible: ClassVar[bool] = True
    requires: ClassVar[tuple[str, ...]] = ()  # gate features every path needs
    # Applied by patch() when no recipe list is given (lossless recipes only; lossy ones are opt-in).
    default: ClassVar[bool] = True
    # Recipes run in ascending order; irreversible ones should run last (see api.patch).
    order: ClassVar[int] = 100

    # ------------------------------------------------------------------ finding targets
    def find(self, root: torch.nn.Module, prefix: str = "") -> Iterator[Match]:
        """Every module under ``root`` whose class matches ``targets`` (MRO by class path)."""
        for name, mod in root.named_modules():
            if matches_class(mod, self.targets):
                yield Match(mod, join_path(prefix, name))

    # ------------------------------------------------------------------ deciding
    def decide(self, match: Match, env: Env, options: Mapping[str, Any]) -> Decision:
        """Which backing path this match gets in ``env``, or why it is skipped. Must not change anything."""
        raise NotImplementedError

    def gate(self, env: Env) -> Decision | None:
        """The declared ``requires`` as a Decision.skip, or None when they all pass."""
        if not self.requires:
            return None
        v = check_all(self.requires, env)
        return None if v.ok else Decision.skip(v.reason)

    # ------------------------------------------------------------------ applying
    def apply(self, match: Match, decision: Decision, env: Env, options: Mapping[str, Any]) -> Undo:
        """Change ``match.module`` (the instance only) and return how to undo it."""
        raise NotImplementedError

    def unpatch_hint(self) -> str:
        """For irreversible recipes: what the user must do instead of unpatch()."""
        return "reload the model from its checkpoint"

    def __repr__(self) -> str:
        return f"<recipe {self.name}>"


def join_path(prefix: str, name: str) -> str:
    """The dotted report path of module ``name`` under a component ``prefix`` (for custom ``find``)."""
    if not prefix:
        return name or "<root>"
    return f"{prefix}.{name}" if name else prefix


_REGISTRY: dict[str, Recipe] = {}


def register(cls: type[Recipe]) -> type[Recipe]:
    """Class decorator: register one instance of ``cls`` under ``cls.name``."""
    if not (isinstance(cls, type) and issubclass(cls, Recipe)):
        raise TypeError(f"@register takes a Recipe subclass, got {cls!r}")
    if not cls.name or not cls.name.isidentifier():
        raise ValueError(f"recipe {cls.__qualname__} needs a 'name' that is a Python identifier, got {cls.name!r}")
    if cls.name in _REGISTRY and type(_REGISTRY[cls.name]) is not cls:
        old = type(_REGISTRY[cls.name])
        if class_path(old) != class_path(cls):
            raise ValueError(f"recipe name {cls.name!r} is taken by {class_path(old)}")
    _REGISTRY[cls.name] = cls()
    return cls


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)


_LOADED = False


def _load_builtin() -> None:
    """Import mpsboost.recipes (every module in it registers itself). Imports no diffusers/transformers."""
    global _LOADED
    if not _LOADED:
        _LOADED = True
        from . import recipes  # noqa: F401


def all_recipes() -> list[Recipe]:
    _load_builtin()
    return sorted(_REGISTRY.values(), key=lambda r: (r.order, r.name))


def recipe_names() -> list[str]:
    return [r.name for r in all_recipes()]


def get_recipe(name: str) -> Recipe:
    _load_builtin()
    if not isinstance(name, str):
        raise TypeError(f"recipe names are str, got {type(name).__name__}: {name!r}")
    try:
        return _REGISTRY[name]
    except KeyError:
        import difflib

        names = sorted(_REGISTRY)
        close = difflib.get_close_matches(name, names, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise UnknownRecipeError(f"unknown recipe {name!r}.{hint} Registered recipes: {', '.join(names)}") from None


# ---------------------------------------------------------------------- the one way to patch a forward

class _Missing:
    """Marks "the instance had no such attribute". One object, kept through copy, deepcopy and pickle."""

    _instance: "_Missing | None" = None

    def __new__(cls) -> "_Missing":
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __reduce__(self):
        return (_Missing, ())

    def __copy__(self) -> "_Missing":
        return self

    def __deepcopy__(self, memo: dict) -> "_Missing":
        return self

    def __repr__(self) -> str:
        return "<missing>"


_MISSING = _Missing()


# accelerate's add_hook_to_module keeps the wrapped forward on this attribute and calls it from its
# hook (after moving weights onto the execution device). A recipe's forward belongs there, inside the
# hook, never outside it.
_ACCELERATE_SLOT = "_old_forward"


def _forward_slot(module: torch.nn.Module) -> str:
    d = module.__dict__
    return _ACCELERATE_SLOT if ("_hf_hook" in d and _ACCELERATE_SLOT in d) else "forward"


def bind_forward(module: torch.nn.Module, recipe: str, new_forward: Callable[..., Any], **saved: Any) -> Undo:
    """Bind ``new_forward(self, *args, **kw)`` as the forward of this instance only.

    The previous instance attribute (if any) is kept under ``module._mpsboost_patches[recipe]`` and put
    back by the returned undo, so that after the undo ``module.forward`` resolves to the very same object
    as before. Under accelerate hooks (offloading, ``device_map``) the recipe's forward goes inside the
    hook (``module._old_forward``), so weights are still moved in before it runs; a hook added after
    patching is kept on unpatch. ``saved`` lets a recipe keep more state (read it with :func:`saved_state`).
    """
    store = module.__dict__.setdefault(ATTR, {})
    if recipe in store:
        raise RuntimeError(f"{recipe} already patched this module")
    slot = _forward_slot(module)
    previous = module.__dict__.get(slot, _MISSING)
    bound = types.MethodType(new_forward, module)
    store[recipe] = {"forward": previous, "slot": slot, "bound": bound, **saved}
    object.__setattr__(module, slot, bound)

    def undo() -> None:
        entry = module.__dict__.get(ATTR, {}).get(recipe)
        if entry is None:
            return
        d = module.__dict__
        prev = entry["forward"]
        if d.get(entry["slot"]) is bound:
            where = entry["slot"]
        elif entry["slot"] == "forward" and d.get(_ACCELERATE_SLOT) is bound:
            # accelerate wrapped our forward after we patched: keep its hook, put the original inside it.
            where = _ACCELERATE_SLOT
            if prev is _MISSING:
                prev = types.MethodType(type(module).forward, module)
        else:
            raise RuntimeError(
                f"the forward of this {type(module).__name__} was replaced after mpsboost's {recipe} patched it "
                "(by something other than an accelerate hook); mpsboost cannot restore it without undoing that change"
            )
        d[ATTR].pop(recipe, None)
        if prev is _MISSING:
            d.pop(where, None)
        else:
            object.__setattr__(module, where, prev)
        if not d.get(ATTR):
            d.pop(ATTR, None)

    return Undo(undo, description=f"{recipe}: restore forward")


def saved_state(module: torch.nn.Module, recipe: str) -> dict:
    """What :func:`bind_forward` (or a recipe) stored on ``module`` for ``recipe``."""
    return module.__dict__[ATTR][recipe]


def original_forward(module: torch.nn.Module, recipe: str) -> Callable[..., Any]:
    """The forward ``module`` had before ``recipe`` bound its own (instance attribute or class method)."""
    prev = module.__dict__[ATTR][recipe]["forward"]
    if prev is _MISSING:
        return types.MethodType(type(module).forward, module)
    return prev


def call_original(module: torch.nn.Module, recipe: str, *args: Any, **kwargs: Any) -> Any:
    """Call the forward ``recipe`` replaced on ``module``, without building a bound method first (so that
    torch.compile traces straight through it): the saved instance attribute, or the class's forward."""
    prev = module.__dict__[ATTR][recipe]["forward"]
    if prev is _MISSING:
        return type(module).forward(module, *args, **kwargs)
    return prev(*args, **kwargs)


def is_patched_by(module: torch.nn.Module, recipe: str) -> bool:
    """True when ``recipe`` bound a forward or set an attribute on this instance."""
    store = module.__dict__.get(ATTR, {})
    return recipe in store or any(k.startswith(recipe + ":") for k in store)


def set_instance_attr(module: torch.nn.Module, recipe: str, name: str, value: Any) -> Undo:
    """Set a plain (non-parameter, non-module) instance attribute reversibly, recorded under ``recipe``."""
    if isinstance(value, (torch.nn.Parameter, torch.nn.Module)):
        raise TypeError(f"set_instance_attr is for plain values; {name} would be a {type(value).__name__}")
    store = module.__dict__.setdefault(ATTR, {})
    key = f"{recipe}:{name}"
    if key in store:
        raise RuntimeError(f"{recipe} already set {name} on this module")
    store[key] = {"value": module.__dict__.get(name, _MISSING)}
    object.__setattr__(module, name, value)

    def undo() -> None:
        entry = module.__dict__.get(ATTR, {}).pop(key, None)
        if entry is None:
            return
        if entry["value"] is _MISSING:
            module.__dict__.pop(name, None)
        else:
            object.__setattr__(module, name, entry["value"])
        if not module.__dict__.get(ATTR):
            module.__dict__.pop(ATTR, None)

    return Undo(undo, description=f"{recipe}: restore {name}")
