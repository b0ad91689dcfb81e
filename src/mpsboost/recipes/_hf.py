"""Helpers the transformers-facing recipes share (imports no transformers: it reads duck-typed objects).

The attention recipes change no config. transformers records the attention implementation in
``config._attn_implementation``, and a config object is shared: by every module of one model, and by
every model built from it (``Model(config)`` keeps the very object). Writing another implementation there
would make the patch escape its instance (a model built later from the same config would run it too)
and make the config say something else than what users, transformers' mask selection and its own tests
read (``config._attn_implementation == "sdpa"``). Instead each attention module of the patched instance
gets a forward of its own: its class's forward, unchanged, whose lookup of transformers' attention
functions (the module global ``ALL_ATTENTION_FUNCTIONS``, and ``eager_attention_forward`` for eager
models) resolves the names a recipe routes to mpsboost's functions (:func:`route_attention`). The config
keeps saying what it said, and transformers picks its mask for that implementation.
"""

from __future__ import annotations

import functools
import inspect
import types
from typing import Any, Callable, Iterator, Mapping

import torch

from ..patching import Patch, bind_forward

# The module global through which transformers' attention modules (5.x) look up their attention function.
LOOKUP = "ALL_ATTENTION_FUNCTIONS"
EAGER = "eager_attention_forward"
_PRETRAINED = "transformers.modeling_utils.PreTrainedModel"


def configs(model: torch.nn.Module) -> list[Any]:
    """The model's config and every sub-config (identity-deduplicated): where an attention or experts
    implementation choice is recorded."""
    out, seen, todo = [], set(), [getattr(model, "config", None)]
    while todo:
        cfg = todo.pop()
        if cfg is None or id(cfg) in seen:
            continue
        seen.add(id(cfg))
        out.append(cfg)
        for key in getattr(cfg, "sub_configs", {}) or {}:
            todo.append(getattr(cfg, key, None))
    return out


def _class_forward(module: torch.nn.Module) -> Any:
    return getattr(type(module), "forward", None)


def _looks_up_attention(module: torch.nn.Module) -> bool:
    code = getattr(inspect.unwrap(_class_forward(module) or (lambda: None)), "__code__", None)
    return code is not None and LOOKUP in code.co_names


def attention_modules(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """(path, module) of every module of ``model`` whose class forward looks up transformers' attention
    functions (``ALL_ATTENTION_FUNCTIONS``) by its ``config._attn_implementation``."""
    for name, mod in model.named_modules():
        if getattr(mod, "config", None) is not None and _looks_up_attention(mod):
            yield name, mod


def implementation(module: torch.nn.Module) -> Any:
    """The attention implementation ``module``'s config names (what transformers dispatches on)."""
    return getattr(getattr(module, "config", None), "_attn_implementation", None)


class RoutedAttentionFunctions:
    """transformers' ``ALL_ATTENTION_FUNCTIONS`` as the attention modules of one patched instance see it:
    the implementation names in ``routes`` resolve to the given functions, every other to transformers' own.
    Nothing of transformers' registry changes; other instances and models see it as it is."""

    def __init__(self, base: Any, routes: Mapping[str, Callable[..., Any]]) -> None:
        self._base = base
        self._routes = dict(routes)

    def get_interface(self, name: str, default: Callable[..., Any]) -> Callable[..., Any]:
        fn = self._routes.get(name)
        return fn if fn is not None else self._base.get_interface(name, default)

    def __getitem__(self, name: str) -> Callable[..., Any]:
        fn = self._routes.get(name)
        return fn if fn is not None else self._base[name]

    def get(self, name: str, default: Any = None) -> Any:
        fn = self._routes.get(name)
        return fn if fn is not None else self._base.get(name, default)

    def __contains__(self, name: object) -> bool:
        return name in self._routes or name in self._base

    def __getattr__(self, name: str) -> Any:
        return getattr(self._base, name)


def _rewrap(fn: Any, inner: types.FunctionType, new_inner: types.FunctionType) -> types.FunctionType:
    """``fn`` (a chain of ``functools.wraps`` decorators around ``inner``, e.g. transformers'
    ``deprecate_kwarg``) with ``inner`` replaced by ``new_inner``: every decorator keeps working."""
    if fn is inner:
        return new_inner
    wrapped = getattr(fn, "__wrapped__", None)
    if wrapped is None or not isinstance(fn, types.FunctionType) or not fn.__closure__:
        raise RuntimeError(f"cannot see through the decorator {getattr(fn, '__qualname__', fn)!r}")
    replacement = _rewrap(wrapped, inner, new_inner)

    def swap(cell: types.CellType) -> types.CellType:
        try:
            held = cell.cell_contents
        except ValueError:  # an empty cell
            return cell
        return types.CellType(replacement) if held is wrapped else cell

    cells = tuple(swap(c) for c in fn.__closure__)
    if all(a is b for a, b in zip(cells, fn.__closure__)):
        raise RuntimeError(f"the decorator {fn.__qualname__!r} does not hold the function it wraps in its closure")
    new = _copy_meta(types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, cells), fn)
    # The chain stays walkable (inspect.unwrap) down to the routed function.
    return functools.update_wrapper(new, replacement, assigned=(), updated=())


def routable(module: torch.nn.Module) -> str:
    """Why :func:`route_attention` cannot route ``module`` ("" when it can). Changes nothing."""
    fwd = _class_forward(module)
    inner = inspect.unwrap(fwd)
    if not isinstance(inner, types.FunctionType) or LOOKUP not in inner.__globals__:
        return f"{type(module).__name__}.forward does not look up {LOOKUP} as a module global"
    d = module.__dict__
    own = d.get("forward")
    if own is not None and not ("_hf_hook" in d and "_old_forward" in d):
        return f"this {type(module).__name__} has a forward of its own (set by something else); left alone"
    try:
        _rewrap(fwd, inner, inner)
    except RuntimeError as exc:
        return str(exc)
    return ""


def route_attention(module: torch.nn.Module, recipe: str, routes: Mapping[str, Callable[..., Any]]) -> Patch:
    """Bind on ``module`` (this instance only) its class's forward with transformers' attention lookup
    resolving the implementation names in ``routes`` to the given functions (``"eager"`` also through the
    modeling file's ``eager_attention_forward``). Decorators on the class forward keep working; the config
    and transformers' registry are not touched. Undone by the returned Patch (the very same forward again)."""
    why = routable(module)
    if why:
        raise RuntimeError(why)
    fwd = _class_forward(module)
    inner = inspect.unwrap(fwd)
    overrides: dict[str, Any] = {LOOKUP: RoutedAttentionFunctions(inner.__globals__[LOOKUP], routes)}
    if "eager" in routes and EAGER in inner.__globals__:
        overrides[EAGER] = routes["eager"]
    routed = _rewrap(fwd, inner, _with_globals(inner, overrides))
    return bind_forward(module, recipe, routed)


def _with_globals(fn: types.FunctionType, overrides: Mapping[str, Any]) -> types.FunctionType:
    """A copy of ``fn`` whose globals are a plain dict: the modeling module's globals as they are now, with
    ``overrides``. The modeling module itself is not changed.

    Two details make it trace with ``torch.compile(fullgraph=True)``: a plain dict (dynamo reads globals by
    plain lookups; a mapping with a ``__missing__`` fallback to the live module fails), and no ``__name__``
    in it (dynamo reads the globals of a function whose globals name a module from that module in
    ``sys.modules``, which would bypass the overrides; without a name it guards on this very dict)."""
    g = dict(fn.__globals__)
    g.update(overrides)
    g.pop("__name__", None)
    return _copy_meta(types.FunctionType(fn.__code__, g, fn.__name__, fn.__defaults__, fn.__closure__), fn)


def _copy_meta(new: types.FunctionType, fn: types.FunctionType) -> types.FunctionType:
    """``new`` (a fresh copy of ``fn``'s code) with ``fn``'s keyword defaults, names, docstring and
    attributes (``__wrapped__`` included, so a decorator chain stays walkable)."""
    return functools.update_wrapper(
        new, fn, assigned=("__kwdefaults__", "__qualname__", "__module__", "__doc__"), updated=("__dict__",)
    )


def eager_function(module: torch.nn.Module) -> Callable[..., Any] | None:
    """The modeling file's own ``eager_attention_forward`` of ``module``'s class (None when it has none)."""
    inner = inspect.unwrap(_class_forward(module))
    return getattr(inner, "__globals__", {}).get(EAGER)


def attention_collector() -> Any:
    """transformers' collector of captured outputs (``utils.output_capturing._active_collector``), or None
    where the installed transformers has none. Read at patch time; :func:`weights_wanted` reads it per call."""
    try:
        from transformers.utils import output_capturing
    except ImportError:
        return None
    return getattr(output_capturing, "_active_collector", None)


def _collecting_attentions(collector: Any) -> bool:
    if collector is None:
        return False
    if torch.compiler.is_compiling():
        # dynamo cannot trace ContextVar.get; a capture set while compiling lives on the plain attribute
        got = getattr(collector, "global_var", None) if getattr(collector, "compiling", False) else None
    else:
        got = collector.get()
    return isinstance(got, dict) and any(str(k).endswith("attentions") for k in got)


def weights_wanted(module: torch.nn.Module, kwargs: Mapping[str, Any], collector: Any) -> bool:
    """True when the caller may read this attention call's weights, however they were asked for: the call's
    ``output_attentions`` argument, else the module's ``config.output_attentions`` (transformers reads the
    argument first, then the config), or transformers' output capture collecting attentions right now (its
    hooks read the attention modules' second output; the config that asked may be an outer model's)."""
    flag = kwargs.get("output_attentions")
    if flag is None:
        flag = getattr(getattr(module, "config", None), "output_attentions", False)
    return bool(flag) or _collecting_attentions(collector)
