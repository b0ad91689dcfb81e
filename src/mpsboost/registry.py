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
(changes one instance through :mod:`mpsboost.patching`'s helpers, returns a :class:`Patch`). ``plan()`` calls
only ``find`` and ``decide``; ``patch()`` calls ``apply`` for every applicable match, as one transaction.

What a recipe learns travels typed: ``find`` may put its own frozen dataclass in :attr:`Match.data` (what
it saw in the target), and ``decide`` hands ``apply`` its own frozen plan dataclass
(``Decision.apply(backing, reason, plan=MyPlan(...))``, read as ``decision.plan.x``). The report shows a
decision's :attr:`~Decision.details`, derived from the plan's fields (see :func:`plan_details`).

An option that takes one of fixed values is annotated ``Literal[...]`` in the recipe's Options dataclass
(``fused: Literal["auto", "static", "off"] = "auto"``): :func:`make_options` refuses any other value, naming the
recipe, the option, the value and the values accepted, and :func:`register` refuses a default outside it. The
recipe reads the values back with :func:`option_choices` where it checks them itself.

Targets are matched by class path strings against each module's MRO, so matching imports nothing:
``import mpsboost`` never imports diffusers or transformers.
"""

from __future__ import annotations

import dataclasses
import types
import typing
import weakref
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterable, Iterator, Mapping

import torch

from .errors import RecipeOptionError, UnknownRecipeError
from .gate import Env, check_all
from .patching import Patch, class_path

__all__ = [
    "Recipe",
    "Match",
    "Decision",
    "NoOptions",
    "make_options",
    "accepted_options",
    "option_choices",
    "check_option_defaults",
    "value_fits",
    "type_text",
    "register",
    "unregister",
    "get_recipe",
    "recipe_names",
    "all_recipes",
    "class_path",
    "matches_class",
    "join_path",
    "plan_details",
    "NOT_REPORTED",
]


# The dotted paths of each class's MRO, computed once per class: ``patch()`` asks for every module of a model and
# every recipe. Weakly keyed (a per-instance class that patching made goes with its instance); the values are strings.
_MRO_PATHS: weakref.WeakKeyDictionary[type, frozenset[str]] = weakref.WeakKeyDictionary()


def _mro_paths(cls: type) -> frozenset[str]:
    paths = _MRO_PATHS.get(cls)
    if paths is None:
        paths = _MRO_PATHS[cls] = frozenset(class_path(c) for c in cls.__mro__)
    return paths


def matches_class(obj: Any, targets: Iterable[str]) -> bool:
    """True when any class in ``type(obj).__mro__`` has one of the dotted paths in ``targets``."""
    return not _mro_paths(type(obj)).isdisjoint(targets)


@dataclass
class Match:
    """One target a recipe found: the module, its dotted path in the report, and what ``find`` learnt.

    ``data``: the recipe's own frozen dataclass (e.g. which kind of target this is), or None. Recipes
    that still pass a dict keep working: a Match built without data gets an empty dict.
    """

    module: torch.nn.Module
    path: str
    data: Any = field(default_factory=dict)


# Field metadata of a plan field that ``apply`` needs but the report does not show:
# ``eps: float = field(metadata=NOT_REPORTED)``.
NOT_REPORTED: Mapping[str, Any] = types.MappingProxyType({"report": False})


def plan_details(plan: Any) -> dict[str, Any]:
    """What the report shows of a recipe's plan: its ``report_details()`` where it defines one, else
    every dataclass field in declaration order except those declared with ``metadata=NOT_REPORTED``."""
    if plan is None:
        return {}
    if not dataclasses.is_dataclass(plan) or isinstance(plan, type):
        raise TypeError(
            f"a Decision's plan is a recipe's frozen dataclass instance (or None), got {type(plan).__name__}: {plan!r}"
        )
    custom = getattr(plan, "report_details", None)
    if custom is not None:
        return dict(custom())
    return {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan) if f.metadata.get("report", True)}


@dataclass(frozen=True)
class Decision:
    """What a recipe would do to one match in one environment.

    ``applicable=False``: the recipe has a reason not to touch it here (gate failed, nothing to gain).
    ``backing``: the backing path the report names, e.g. ``"conv padding fold"``.
    ``plan``: the recipe's own frozen dataclass, everything ``apply`` needs (``decision.plan.x``).
    ``details``: what the report row shows besides backing and reason: the plan's reported fields
    (:func:`plan_details`), then any keywords given to :meth:`apply` / :meth:`skip`.
    """

    applicable: bool
    backing: str = ""
    reason: str = ""
    details: Mapping[str, Any] = field(default_factory=dict)
    plan: Any = None

    def __post_init__(self) -> None:
        if self.plan is not None:
            # frozen: the derived details are set once, here, as dataclasses do for derived fields
            object.__setattr__(self, "details", {**plan_details(self.plan), **self.details})

    @classmethod
    def apply(cls, backing: str, reason: str, plan: Any = None, **details: Any) -> "Decision":
        return cls(True, backing, reason, details, plan)

    @classmethod
    def skip(cls, reason: str, plan: Any = None, **details: Any) -> "Decision":
        return cls(False, "", reason, details, plan)


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
    # The frozen dataclass of the options it takes (``patch(..., options={name: {...}})``); api checks
    # the keys, types and Literal values against it and hands the recipe an instance. None: it takes no options.
    Options: ClassVar[type | None] = None
    # A public keyword of patch()/plan() that selects this recipe (e.g. ``fp8``) and the option field
    # its value fills (``fp8="rowwise"`` is sugar for ``options={"fp8_weights": {"granularity": "rowwise"}}``).
    keyword: ClassVar[str | None] = None
    keyword_field: ClassVar[str | None] = None
    # The values that keyword accepts (patch() checks them before anything else); empty: any value.
    keyword_values: ClassVar[tuple[str, ...]] = ()

    # ------------------------------------------------------------------ finding targets
    def find(self, root: torch.nn.Module, prefix: str = "") -> Iterator[Match]:
        """Every module under ``root`` whose class matches ``targets`` (MRO by class path)."""
        for name, mod in root.named_modules():
            if matches_class(mod, self.targets):
                yield Match(mod, join_path(prefix, name))

    # ------------------------------------------------------------------ deciding
    def decide(self, match: Match, env: Env, options: Any) -> Decision:
        """Which backing path this match gets in ``env``, or why it is skipped. Must not change anything.

        ``options``: an instance of :attr:`Options` (its defaults where the user gave none), or of
        :class:`NoOptions` for a recipe that takes none."""
        raise NotImplementedError

    def gate(self, env: Env) -> Decision | None:
        """The declared ``requires`` as a Decision.skip, or None when they all pass."""
        if not self.requires:
            return None
        v = check_all(self.requires, env)
        return None if v.ok else Decision.skip(v.reason)

    # ------------------------------------------------------------------ applying
    def apply(self, match: Match, decision: Decision, env: Env, options: Any) -> Patch:
        """Change ``match.module`` (the instance only) through :mod:`mpsboost.patching`'s helpers, as
        ``decision.plan`` says; return the Patch."""
        raise NotImplementedError

    def unpatch_hint(self) -> str:
        """For irreversible recipes: what the user must do instead of unpatch()."""
        return "reload the model from its checkpoint"

    def __repr__(self) -> str:
        return f"<recipe {self.name}>"


@dataclass(frozen=True)
class NoOptions:
    """The options of a recipe that takes none."""


def _type_text(tp: Any) -> str:
    if tp is type(None):
        return "None"
    if isinstance(tp, type):
        return tp.__name__
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_text(a) for a in typing.get_args(tp))
    if origin is typing.Literal:  # str ('auto' | 'static' | 'off'): the type, then the values it takes
        args = typing.get_args(tp)
        kinds = {type(a) for a in args}
        values = " | ".join(repr(a) for a in args)
        return f"{kinds.pop().__name__} ({values})" if len(kinds) == 1 else values
    return str(tp).replace("typing.", "")


def _literal_parts(tp: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]] | None:
    """(the values, the other types) of an annotation that names fixed values: ``Literal[...]``, alone or in a
    union (``Literal["fused", "bmm"] | None``: the values and ``(NoneType,)``); None when it names none."""
    if typing.get_origin(tp) is typing.Literal:
        return typing.get_args(tp), ()
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        parts = typing.get_args(tp)
        values = tuple(v for a in parts if typing.get_origin(a) is typing.Literal for v in typing.get_args(a))
        if values:
            return values, tuple(a for a in parts if typing.get_origin(a) is not typing.Literal)
    return None


def _mentions_literal(tp: Any) -> bool:
    return typing.get_origin(tp) is typing.Literal or any(_mentions_literal(a) for a in typing.get_args(tp))


def _choices_text(values: tuple[Any, ...], others: tuple[Any, ...]) -> str:
    """``auto, static, off`` (strings bare), then ``None`` or the other types a union takes."""
    shown = [v if isinstance(v, str) else repr(v) for v in values]
    shown += ["None" if a is type(None) else f"any {_type_text(a)}" for a in others]
    return ", ".join(shown)


def _fits(value: Any, tp: Any) -> bool:
    """``value`` is of the annotated type ``tp`` (builtins, unions, ``tuple[X, ...]``, ``Literal[...]``, ``Any``)."""
    if tp is Any or tp is object:
        return True
    if tp is type(None):
        return value is None
    origin = typing.get_origin(tp)
    if origin is typing.Literal:  # one of its values, of the same type (1 is not True, "1" is not 1)
        return any(type(value) is type(a) and value == a for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, a) for a in typing.get_args(tp))
    if origin in (tuple, list):
        args = typing.get_args(tp)
        if not isinstance(value, origin):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_fits(v, args[0]) for v in value)
        return len(args) == len(value) and all(_fits(v, a) for v, a in zip(value, args))
    if tp is int:  # True is an int to Python, not to a user setting a count
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, tp)


def value_fits(value: Any, tp: Any) -> bool:
    """``value`` is of the annotated type ``tp``, as :func:`make_options` reads an annotation (builtins, unions,
    ``tuple[X, ...]``, ``Literal[...]``: one of its values); the recipes' family rows check their fields with it."""
    return _fits(value, tp)


def type_text(tp: Any) -> str:
    """An annotation as error messages show it: ``int | None``, ``str ('auto' | 'static' | 'off')``."""
    return _type_text(tp)


def option_types(recipe: Recipe) -> dict[str, Any]:
    """{option name: its annotated type} of ``recipe`` (empty for a recipe that takes none)."""
    cls = recipe.Options
    if cls is None:
        return {}
    types_ = _OPTION_TYPES.get(cls)
    if types_ is None:
        hints = typing.get_type_hints(cls)
        types_ = _OPTION_TYPES[cls] = {f.name: hints[f.name] for f in dataclasses.fields(cls)}
    return dict(types_)


_OPTION_TYPES: weakref.WeakKeyDictionary[type, dict[str, Any]] = weakref.WeakKeyDictionary()


def option_choices(options: type, name: str) -> tuple[Any, ...]:
    """The values that field ``name`` of an Options dataclass takes, from its ``Literal[...]`` annotation (with
    None where the annotation is ``Literal[...] | None``): the recipe's own checks read them from here, so the
    annotation is the one list."""
    hints = typing.get_type_hints(options)
    if name not in hints:
        raise KeyError(f"{options.__qualname__} has no option {name!r}; its options: {', '.join(hints)}")
    parts = _literal_parts(hints[name])
    if parts is None:
        raise TypeError(f"{options.__qualname__}.{name} is annotated {_type_text(hints[name])}, not Literal[...]")
    values, others = parts
    return values + ((None,) if type(None) in others else ())


def check_option_defaults(recipe_name: str, options: type) -> None:
    """Every default of ``options`` (a recipe's Options dataclass) whose annotation names fixed values
    (``Literal[...]``) is one of them; else a ValueError naming the recipe, the field, the default and the
    values. :func:`register` runs it, so a recipe whose defaults its own annotations refuse never registers."""
    try:
        hints = typing.get_type_hints(options)
    except NameError as e:
        raise TypeError(
            f"recipe {recipe_name}: the annotations of {options.__qualname__} do not resolve at registration ({e}); "
            "define the names they use before the recipe's declaration"
        ) from e
    for f in dataclasses.fields(options):
        tp = hints[f.name]
        if not _mentions_literal(tp):
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            continue  # no default: the value is the user's, checked by make_options
        if not _fits(default, tp):
            parts = _literal_parts(tp)
            allowed = _choices_text(*parts) if parts else _type_text(tp)
            raise ValueError(
                f"recipe {recipe_name}: {options.__qualname__}.{f.name} defaults to {default!r}, which its annotation "
                f"{_type_text(tp)} does not take; make the default one of {allowed} (or add it to the Literal)"
            )


def accepted_options(recipe: Recipe) -> str:
    """The option names of ``recipe`` with their types, for error messages and ``mpsboost doctor``."""
    types_ = option_types(recipe)
    if not types_:
        return "none (this recipe takes no options)"
    return ", ".join(types_) + " (" + "; ".join(f"{k}: {_type_text(t)}" for k, t in types_.items()) + ")"


def make_options(recipe: Recipe, given: Mapping[str, Any] | None) -> Any:
    """``recipe``'s Options instance from the user's dict: an unknown key, a value of the wrong type or a value
    outside a ``Literal[...]`` annotation raises :class:`~mpsboost.errors.RecipeOptionError` (a ``TypeError``)
    naming the recipe, the key and value passed and what is accepted (the keys with their types; the values of
    the Literal). Other values (ranges, device names) are checked further by the recipe."""
    given = dict(given or {})
    cls = recipe.Options or NoOptions
    types_ = option_types(recipe)
    unknown = sorted(k for k in given if k not in types_)
    if unknown:
        shown = ", ".join(f"{k}={given[k]!r}" for k in unknown)
        raise RecipeOptionError(
            f"unknown {recipe.name} option(s) {unknown} (passed {shown}); accepted: {accepted_options(recipe)}",
            recipe=recipe.name,
        )
    for key, value in given.items():
        parts = _literal_parts(types_[key])
        if parts is not None and not _fits(value, types_[key]):
            # a value outside the fixed ones the annotation names (Literal[...]): which ones, and where they live
            raise RecipeOptionError(
                f"{recipe.name} option {key}={value!r}: expected one of {_choices_text(*parts)}; {key!r} must be "
                f"one of the values {cls.__qualname__}.{key} declares. Accepted options: {accepted_options(recipe)}",
                recipe=recipe.name,
            )
        if not _fits(value, types_[key]):
            raise RecipeOptionError(
                f"{recipe.name} option {key}={value!r} has type {type(value).__name__}; {key} takes "
                f"{_type_text(types_[key])}. Accepted options: {accepted_options(recipe)}",
                recipe=recipe.name,
            )
    return cls(**given)


def join_path(prefix: str, name: str) -> str:
    """The dotted report path of module ``name`` under a component ``prefix`` (for custom ``find``)."""
    if not prefix:
        return name or "<root>"
    return f"{prefix}.{name}" if name else prefix


_REGISTRY: dict[str, Recipe] = {}


def register(cls: type[Recipe]) -> type[Recipe]:
    """Class decorator: register one instance of ``cls`` under ``cls.name``. Its Options' defaults must be within
    their ``Literal[...]`` annotations (:func:`check_option_defaults`), checked here, at import."""
    if not (isinstance(cls, type) and issubclass(cls, Recipe)):
        raise TypeError(f"@register takes a Recipe subclass, got {cls!r}")
    if not cls.name or not cls.name.isidentifier():
        raise ValueError(f"recipe {cls.__qualname__} needs a 'name' that is a Python identifier, got {cls.name!r}")
    if cls.name in _REGISTRY and type(_REGISTRY[cls.name]) is not cls:
        old = type(_REGISTRY[cls.name])
        if class_path(old) != class_path(cls):
            raise ValueError(f"recipe name {cls.name!r} is taken by {class_path(old)}")
    if cls.Options is not None:
        check_option_defaults(cls.name, cls.Options)
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
