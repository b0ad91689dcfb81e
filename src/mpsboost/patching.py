"""Patch, Changes and every write helper: the one way mpsboost changes a module instance.

Every change a recipe (or ``load_fp8``) makes goes through a helper of this module that returns a
:class:`Patch`; ``mpsboost.api`` alone applies, commits and undoes them. Nothing global holds a module,
so a model the user drops is freed.

What a patched module must remember lives in one store per module, the instance attribute
``_mpsboost_patches`` (:data:`ATTR`): {key: record}, written and cleared only here (``_record`` /
``_forget``), read by others through :func:`saved_state`, :func:`is_patched_by`, :func:`held_by` and
:func:`without_record`. Its keys:

- ``"<recipe>"``: the forward :func:`bind_forward` replaced (and what the recipe saved with it);
- ``"<recipe>:<name>"``: the previous value of an attribute :func:`set_instance_attr` set;
- ``"<recipe>:__class__"``: the class :func:`swap_class` replaced (:func:`swapped_class_key`);
- ``"<held>:<name>"``: a value several matches share and its holders (:func:`hold_instance_attr`).

Two other records are not per-module state and stay where they are: ``mpsboost.api`` keeps the log of
each ``patch()`` call (the Patches to undo, the report) on the object passed to it, which may be a
pipeline rather than a module, and which a copy must not inherit; and :func:`register_in_interface`
remembers, process-wide, which keys it added to a library's function registry (functions, no module).

The AST guard in ``tests/core/test_patch_primitive.py`` checks that no other file of the package
writes a module's ``forward``, ``__class__``, ``_parameters``, ``_buffers``, ``_modules`` or ``__dict__``
itself.
"""

from __future__ import annotations

import types
from typing import Any, Callable, Iterable, Mapping

import torch

__all__ = [
    "ATTR",
    "class_path",
    "Patch",
    "Changes",
    "bind_forward",
    "saved_state",
    "without_record",
    "original_forward",
    "call_original",
    "is_patched_by",
    "set_instance_attr",
    "hold_instance_attr",
    "held_by",
    "set_attr",
    "keep_attrs",
    "swap_class",
    "swapped_class_key",
    "register_in_interface",
    "relayout_param",
    "replace_at_commit",
    "replace_tensors",
    "at_commit",
    "no_change",
]

# The one namespaced attribute on a patched module instance: {recipe name: what it saved}.
ATTR = "_mpsboost_patches"


def class_path(cls: type) -> str:
    """``module.QualName`` of a class: how recipes name their targets and the report names classes."""
    return f"{cls.__module__}.{cls.__qualname__}"


class Patch:
    """The handle of one change (or one group of changes) a recipe made; calling it undoes the change.

    Every change a recipe makes goes through a helper of this module that returns a Patch: a bound
    forward (:func:`bind_forward`), an instance attribute (:func:`set_instance_attr`,
    :func:`hold_instance_attr`), an attribute of a non-module object (:func:`set_attr`,
    :func:`keep_attrs`), a per-instance class swap (:func:`swap_class`), a key in a library's function
    registry (:func:`register_in_interface`), a parameter's memory layout (:func:`relayout_param`) and the
    replacement of parameters by buffers (:func:`replace_at_commit`). ``mpsboost.api`` alone applies,
    commits and undoes them.

    ``commit`` (optional) runs once the whole ``patch()`` transaction succeeded, e.g. to convert weights
    that an irreversible recipe kept unchanged only so that a failed transaction could roll back. After
    commit an irreversible change cannot be undone: ``reversible`` is False and ``explanation`` says what
    to do instead (``unpatch`` shows it).
    """

    __slots__ = ("_undo", "_commit", "reversible", "description", "explanation", "done")

    def __init__(
        self,
        undo: Callable[[], None],
        *,
        commit: Callable[[], None] | None = None,
        reversible: bool = True,
        description: str = "",
        explanation: str = "",
    ):
        self._undo = undo
        self._commit = commit
        self.reversible = reversible
        self.description = description
        self.explanation = explanation
        self.done = False

    def __call__(self) -> None:
        if not self.done:
            self._undo()
            self.done = True

    def commit(self) -> None:
        if self._commit is not None:
            fn, self._commit = self._commit, None
            fn()

    def __repr__(self) -> str:
        state = "undone" if self.done else ("reversible" if self.reversible else "irreversible after commit")
        return f"<Patch {self.description or '(no description)'}: {state}>"

    @staticmethod
    def chain(
        parts: "Iterable[Patch]",
        *,
        on_commit_error: Callable[[BaseException], None] | None = None,
        **kw: Any,
    ) -> "Patch":
        """One Patch that undoes ``parts`` in reverse order and commits them in order.

        ``reversible`` defaults to every part's; ``explanation`` to the first part's that has one.
        ``on_commit_error``: when a part's commit raises, the parts are undone instead (nothing of the
        failed commit stayed: each commit helper leaves its change undone when it fails) and this is
        called with the exception; without it, the exception propagates.
        """
        parts = list(parts)
        kw.setdefault("reversible", all(p.reversible for p in parts))
        kw.setdefault("explanation", next((p.explanation for p in parts if p.explanation), ""))

        def run() -> None:
            for p in reversed(parts):
                p()

        def commit() -> None:
            try:
                for p in parts:
                    p.commit()
            except Exception as exc:
                if on_commit_error is None:
                    raise
                run()
                handle.reversible = True  # nothing of it is left to undo
                handle.done = True
                on_commit_error(exc)

        handle = Patch(run, commit=commit, **kw)
        return handle


class Changes:
    """Collects the Patches of one ``apply`` as they are made; on an exception inside the ``with``
    block every change made so far is undone (in reverse) before the exception propagates::

        with Changes() as ch:
            ch.add(bind_forward(m, NAME, fwd))
            ch.add(set_instance_attr(root, NAME, "_flag", True))
        return ch.patch(description="...")
    """

    def __init__(self) -> None:
        self.parts: list[Patch] = []

    def add(self, part: Patch) -> Patch:
        if not isinstance(part, Patch):
            raise TypeError(f"Changes.add takes an mpsboost.patching.Patch, got {type(part).__name__}")
        self.parts.append(part)
        return part

    def __enter__(self) -> "Changes":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        if exc_type is not None:
            for p in reversed(self.parts):
                try:
                    p()
                except Exception:  # keep undoing the rest; the original exception is the one to see
                    pass
            self.parts.clear()
        return False

    def patch(self, **kw: Any) -> Patch:
        return Patch.chain(self.parts, **kw)


# ---------------------------------------------------------------------- instance changes


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


# ---------------------------------------------------------------------- the per-module store


def _records(module: Any) -> dict:
    """The store of ``module`` (empty and unattached when it has none): read it, never write it."""
    return module.__dict__.get(ATTR, {})


def _record(module: Any, key: str, record: Any, *, again: str) -> None:
    """Keep ``record`` under ``key`` in ``module``'s store (created on first use); a key taken already is
    the error ``again`` (one recipe changing one thing twice)."""
    store = module.__dict__.setdefault(ATTR, {})
    if key in store:
        raise RuntimeError(again)
    store[key] = record


def _forget(module: Any, key: str, record: Any = _MISSING) -> Any:
    """Remove and return the record under ``key`` (None when absent; only when it is ``record``, if
    given); the store itself goes once empty, so an unpatched module has no trace of mpsboost."""
    d = module.__dict__
    store = d.get(ATTR)
    if not store or key not in store or (record is not _MISSING and store[key] is not record):
        return None
    found = store.pop(key)
    if not store:
        d.pop(ATTR, None)
    return found


def _attr_key(recipe: str, name: str) -> str:
    return f"{recipe}:{name}"


def without_record(state: Mapping[str, Any], key: str) -> dict:
    """A module's ``__dict__`` (as ``__reduce_ex__`` hands it to pickle or copy) without the store record
    ``key``, and without the store when nothing else is left in it."""
    out = dict(state)
    if ATTR in out:
        rest = {k: v for k, v in out[ATTR].items() if k != key}
        if rest:
            out[ATTR] = rest
        else:
            del out[ATTR]
    return out


# accelerate's add_hook_to_module keeps the wrapped forward on this attribute and calls it from its
# hook (after moving weights onto the execution device). A recipe's forward belongs there, inside the
# hook, never outside it.
_ACCELERATE_SLOT = "_old_forward"


def _forward_slot(module: torch.nn.Module) -> str:
    d = module.__dict__
    return _ACCELERATE_SLOT if ("_hf_hook" in d and _ACCELERATE_SLOT in d) else "forward"


def bind_forward(module: torch.nn.Module, recipe: str, new_forward: Callable[..., Any], **saved: Any) -> Patch:
    """Bind ``new_forward(self, *args, **kw)`` as the forward of this instance only.

    The previous instance attribute (if any) is kept under ``module._mpsboost_patches[recipe]`` and put
    back by the returned undo, so that after the undo ``module.forward`` resolves to the very same object
    as before. Under accelerate hooks (offloading, ``device_map``) the recipe's forward goes inside the
    hook (``module._old_forward``), so weights are still moved in before it runs; a hook added after
    patching is kept on unpatch. ``saved`` lets a recipe keep more state (read it with :func:`saved_state`).
    """
    slot = _forward_slot(module)
    previous = module.__dict__.get(slot, _MISSING)
    bound = types.MethodType(new_forward, module)
    _record(
        module,
        recipe,
        # The class's forward as a plain function: call_original calls it without resolving type(module) inside
        # traced code (dynamo treats some classes, diffusers' Attention, as in-graph callables: type(m).forward breaks).
        {"forward": previous, "class_forward": type(module).forward, "slot": slot, "bound": bound, **saved},
        again=f"{recipe} already patched this module",
    )
    object.__setattr__(module, slot, bound)

    def undo() -> None:
        entry = _records(module).get(recipe)
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
        _forget(module, recipe)
        if prev is _MISSING:
            d.pop(where, None)
        else:
            object.__setattr__(module, where, prev)

    return Patch(undo, description=f"{recipe}: restore forward")


def saved_state(module: torch.nn.Module, recipe: str) -> dict | None:
    """What :func:`bind_forward` stored on ``module`` for ``recipe`` (the replaced forward and the
    recipe's ``saved`` keywords), or None when ``recipe`` bound no forward there."""
    return _records(module).get(recipe)


def original_forward(module: torch.nn.Module, recipe: str) -> Callable[..., Any]:
    """The forward ``module`` had before ``recipe`` bound its own (instance attribute or class method)."""
    entry = module.__dict__[ATTR][recipe]
    prev = entry["forward"]
    if prev is _MISSING:
        return types.MethodType(entry["class_forward"], module)
    return prev


def call_original(module: torch.nn.Module, recipe: str, *args: Any, **kwargs: Any) -> Any:
    """Call the forward ``recipe`` replaced on ``module``, without building a bound method first (so that
    torch.compile traces straight through it): the saved instance attribute, or the class's forward as it was when
    the forward was bound (a later ``swap_class`` keeps it: mpsboost's swapped classes inherit their base's forward)."""
    entry = module.__dict__[ATTR][recipe]
    prev = entry["forward"]
    if prev is _MISSING:
        return entry["class_forward"](module, *args, **kwargs)
    return prev(*args, **kwargs)


def is_patched_by(module: torch.nn.Module, recipe: str) -> bool:
    """True when ``recipe`` bound a forward or set an attribute on this instance."""
    store = _records(module)
    return recipe in store or any(k.startswith(recipe + ":") for k in store)


def set_instance_attr(module: torch.nn.Module, recipe: str, name: str, value: Any) -> Patch:
    """Set a plain (non-parameter, non-module) instance attribute reversibly, recorded under ``recipe``."""
    if isinstance(value, (torch.nn.Parameter, torch.nn.Module)):
        raise TypeError(f"set_instance_attr is for plain values; {name} would be a {type(value).__name__}")
    key = _attr_key(recipe, name)
    _record(
        module, key, {"value": module.__dict__.get(name, _MISSING)}, again=f"{recipe} already set {name} on this module"
    )
    object.__setattr__(module, name, value)

    def undo() -> None:
        entry = _forget(module, key)
        if entry is None:
            return
        if entry["value"] is _MISSING:
            module.__dict__.pop(name, None)
        else:
            object.__setattr__(module, name, entry["value"])

    return Patch(undo, description=f"{recipe}: restore {name}")


def no_change(description: str) -> Patch:
    """A Patch for a match where the recipe decided at apply time that nothing needs changing."""
    return Patch(lambda: None, description=description)


def at_commit(fn: Callable[[], None], description: str) -> Patch:
    """A Patch that changes nothing now and runs ``fn`` when the ``patch()`` transaction commits (e.g. to
    mark a recipe's state converted or to warm a kernel once the weights are in place)."""
    return Patch(lambda: None, commit=fn, description=description)


# ---------------------------------------------------------------------- shared instance attributes

# A shared attribute's record lives on the module itself, in its store under ``_HOLD + name``:
# [value, [(token, holder data), ...]]. The value is often a method bound to that very
# module; kept in any process-wide table, even a WeakKeyDictionary keyed by the module, the value would
# reference its key and keep the model alive forever. On the instance it is a plain reference cycle that
# the garbage collector frees with the model.
_HOLD = "<held>:"


def _hold_entry(module: torch.nn.Module, name: str) -> list | None:
    entry = _records(module).get(_HOLD + name)
    return entry if isinstance(entry, list) else None


def hold_instance_attr(
    module: torch.nn.Module, name: str, make_value: Callable[[], Any], data: Any = None, *, description: str = ""
) -> Patch:
    """Set one instance attribute that several matches of a recipe share (e.g. one method on the model
    for all its experts modules): the first holder sets ``make_value()``, every holder adds ``data``
    (read with :func:`held_by`), the last holder's undo removes the attribute if it is still the one set.

    An attribute already on the instance that mpsboost did not set is left alone (the Patch changes
    nothing, and :func:`held_by` gives ``None``): someone else bound it, and mpsboost follows theirs.
    The record of the holders lives on ``module`` (nothing process-wide refers to it).
    """
    entry = _hold_entry(module, name)
    if entry is None:
        if name in module.__dict__:
            return no_change(description or f"{name} already bound on the instance")
        value = make_value()
        entry = [value, []]
        _record(module, _HOLD + name, entry, again=f"{name} is held already")
        module.__dict__[name] = value
    token = (object(), data)
    entry[1].append(token)

    def undo() -> None:
        entry[1][:] = [t for t in entry[1] if t is not token]
        if entry[1]:
            return
        _forget(module, _HOLD + name, entry)
        if module.__dict__.get(name) is entry[0]:
            del module.__dict__[name]

    return Patch(undo, description=description or f"restore {name}")


def held_by(module: torch.nn.Module, name: str) -> list | None:
    """The ``data`` of every live holder of ``name`` on ``module`` (see :func:`hold_instance_attr`), or
    None when mpsboost does not hold it."""
    entry = _hold_entry(module, name)
    return None if entry is None else [d for _, d in entry[1]]


# ---------------------------------------------------------------------- objects that are not modules


def set_attr(obj: Any, name: str, value: Any, *, restore: Any = _MISSING, description: str = "") -> Patch:
    """Set ``obj.name = value`` on an object that is not a module (a model's config), through the
    object's own ``__setattr__``; nothing is stored on ``obj`` (its serialisation stays as it was).

    The undo runs only if the attribute still holds ``value`` (someone who chose another value since
    keeps theirs) and puts back the previous value, or ``restore`` when given.
    """
    previous = obj.__dict__.get(name, _MISSING)
    if getattr(obj, name, _MISSING) is not value:
        setattr(obj, name, value)
    back = previous if restore is _MISSING else restore

    def undo() -> None:
        if obj.__dict__.get(name, _MISSING) is not value:
            return
        if back is _MISSING:
            delattr(obj, name)
        else:
            setattr(obj, name, back)

    return Patch(undo, description=description or f"restore {type(obj).__name__}.{name}")


def keep_attrs(objs: Iterable[Any], name: str, *, description: str = "") -> Patch:
    """Remember ``name`` of every object in ``objs`` as it is now (absent counts as None); the undo
    writes those values back. For a library call that changes them (e.g. transformers'
    ``set_attn_implementation`` writing every sub-config): take this Patch first, then make the call."""
    before = [(o, o.__dict__.get(name)) for o in objs]

    def undo() -> None:
        for o, v in before:
            setattr(o, name, v)

    return Patch(undo, description=description or f"restore {name}")


# ---------------------------------------------------------------------- class swap


def swap_class(obj: torch.nn.Module, recipe: str, new_cls: type) -> Patch:
    """Make ``obj`` an instance of ``new_cls`` (a subclass of its class, cached by the recipe so that
    every instance of one class gets the same subclass); the undo restores the very same original
    class. The class of other instances is not touched."""
    original = type(obj)
    if not (isinstance(new_cls, type) and issubclass(new_cls, original)):
        raise TypeError(f"swap_class needs a subclass of {class_path(original)}, got {new_cls!r}")
    key = swapped_class_key(recipe)
    _record(obj, key, {"class": original}, again=f"{recipe} already swapped the class of this module")
    object.__setattr__(obj, "__class__", new_cls)

    def undo() -> None:
        entry = _records(obj).get(key)
        if entry is None:
            return
        if type(obj) is not new_cls:
            raise RuntimeError(
                f"the class of this {original.__name__} was changed after mpsboost's {recipe} patched it "
                f"(now {class_path(type(obj))}); cannot restore {class_path(entry['class'])}"
            )
        object.__setattr__(obj, "__class__", entry["class"])
        _forget(obj, key)

    return Patch(undo, description=f"{recipe}: restore the class {class_path(original)}")


def swapped_class_key(recipe: str) -> str:
    """The key under which :func:`swap_class` records the original class in a module's store."""
    return _attr_key(recipe, "__class__")


# ---------------------------------------------------------------------- library function registries

# (id of the interface, key) -> the function mpsboost registered there.
_INTERFACE_KEYS: dict[tuple[int, str], Callable[..., Any]] = {}


def register_in_interface(
    interface: Any, key: str, make_fn: Callable[[], Callable[..., Any]], *, description: str = ""
) -> Patch:
    """Add ``key`` to a library's function registry (``interface.register(key, fn)``, e.g. transformers'
    ``AttentionInterface``), once per process: a key mpsboost registered already is reused.

    Only a new key is added; no function of the library is replaced (a key the library or the user
    registered already is refused). The key stays registered after undo, by design: it is the name a
    model's config refers to, and a copy of a patched model (``copy.deepcopy``) may still use it after
    the original was unpatched; an unused key changes nothing.
    """
    slot = (id(interface), key)
    if slot not in _INTERFACE_KEYS:
        existing = getattr(interface, "_global_mapping", {})
        if key in existing:
            raise RuntimeError(
                f"{getattr(interface, '__name__', interface)!r} already has a function named {key!r} "
                "that mpsboost did not register"
            )
        fn = make_fn()
        interface.register(key, fn)
        _INTERFACE_KEYS[slot] = fn
    return Patch(lambda: None, description=description or f"{key} stays registered (a new key only)")


# ---------------------------------------------------------------------- tensors


def relayout_param(param: torch.nn.Parameter, memory_format: torch.memory_format) -> Patch:
    """Re-lay ``param``'s data in ``memory_format`` (same Parameter object, same values); the undo puts
    it back in the contiguous layout. No copy of the old layout is kept (that would double the memory)."""
    with torch.no_grad():
        param.data = param.data.contiguous(memory_format=memory_format)

    def undo() -> None:
        with torch.no_grad():
            param.data = param.data.contiguous()

    return Patch(undo, description="weight back to the contiguous layout")


def replace_at_commit(
    module: torch.nn.Module,
    names: Iterable[str],
    convert: Callable[[str, torch.Tensor], Mapping[str, torch.Tensor]],
    *,
    explanation: str,
    description: str = "",
) -> Patch:
    """Replace parameters of ``module`` by buffers, irreversibly, when the ``patch()`` transaction commits.

    Until then the originals stay in place untouched, so a rolled-back transaction leaves the very same
    tensors. At commit, for each name in turn: ``convert(name, tensor)`` gives the new buffers
    ({buffer name: tensor}); the parameter leaves the module first, so the original is freed as soon as
    nothing else holds it (one tensor at a time, never a second copy of the model). After commit the
    Patch is irreversible; ``explanation`` is what ``unpatch`` tells the user to do instead.
    """
    names = tuple(names)

    def commit() -> None:
        for name in names:
            new = convert(name, getattr(module, name))
            delattr(module, name)
            for buf_name, t in new.items():
                module.register_buffer(buf_name, t)

    return Patch(
        lambda: None,
        commit=commit,
        reversible=False,
        explanation=explanation,
        description=description or f"{type(module).__name__}: {', '.join(names)} replaced at commit",
    )


def replace_tensors(
    module: torch.nn.Module,
    tensors: Mapping[str, "torch.Tensor | None"],
    *,
    explanation: str,
    description: str = "",
    non_persistent: Iterable[str] = (),
) -> Patch:
    """Put ``tensors`` into ``module`` now (values read from a file at load time): a
    ``torch.nn.Parameter`` becomes a parameter, any other tensor a buffer (taking the place of a
    parameter of that name), ``None`` removes the name. A name that stays a parameter or a buffer keeps
    its place in the module (and in ``state_dict``). ``non_persistent``: buffers of ``tensors`` kept out of
    ``state_dict`` (a derived copy that no saved file may hold), as ``register_buffer(..., persistent=False)``.

    Until the transaction commits, the undo gives back the very same parameters and buffers, in their
    order. At commit the originals are let go (nothing keeps a second copy of a loaded model): the
    change is then irreversible, and ``explanation`` is what ``unpatch`` tells the user to do instead.
    """
    bad = next(((n, v) for n, v in tensors.items() if v is not None and not isinstance(v, torch.Tensor)), None)
    if bad is not None:
        raise TypeError(f"replace_tensors takes tensors or None, got {type(bad[1]).__name__} for {bad[0]!r}")
    hidden = tuple(non_persistent)
    bad = next((n for n in hidden if tensors.get(n) is None or isinstance(tensors[n], torch.nn.Parameter)), None)
    if bad is not None:
        raise ValueError(f"replace_tensors: non_persistent names {bad!r}, which is not a buffer of this call")
    params, bufs = module._parameters, module._buffers
    hidden_set = module._non_persistent_buffers_set
    saved: list = [dict(params), dict(bufs), set(hidden_set)]
    for name, value in tensors.items():
        home, other = (params, bufs) if isinstance(value, torch.nn.Parameter) else (bufs, params)
        other.pop(name, None)
        if value is None:
            home.pop(name, None)
        else:
            home[name] = value
    hidden_set.update(hidden)

    def undo() -> None:
        if not saved:
            raise RuntimeError(f"{description or 'replace_tensors'}: committed already; the original tensors are gone")
        params.clear()
        params.update(saved[0])
        bufs.clear()
        bufs.update(saved[1])
        hidden_set.clear()
        hidden_set.update(saved[2])
        saved.clear()

    def commit() -> None:
        saved.clear()

    return Patch(
        undo,
        commit=commit,
        reversible=False,
        explanation=explanation,
        description=description or f"{type(module).__name__}: {', '.join(tensors)} replaced",
    )
