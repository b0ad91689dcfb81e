"""transformers' ``_sample`` with the sync-free draws of :mod:`mpsboost.ops.sampling` (the softmax recipe).

The recipe gives one model instance a subclass whose ``_sample`` is transformers' own function, its code
untouched, run with globals in which ``torch.multinomial`` and ``nn.functional.softmax`` resolve to the
functions here (:func:`sampling_globals`, :func:`with_globals`). They read the :class:`SamplingState`
of the ``_sample`` call running in this context (:data:`CURRENT`); outside one they are torch's own.

This module imports no transformers: it rebinds whatever function it is handed.
"""

from __future__ import annotations

import contextvars
import types
from typing import Any, Callable

import torch

from ..ops.sampling import DeferredCheck, draw, draw_from_logits

__all__ = ["SamplingState", "CURRENT", "sampling_globals", "with_globals"]


class SamplingState:
    """What one ``_sample`` call needs: the path and its deferred check."""

    __slots__ = ("logits_path", "check", "pending_logits")

    def __init__(self, logits_path: bool) -> None:
        self.logits_path = logits_path
        self.check = DeferredCheck()
        self.pending_logits: torch.Tensor | None = None


# The sampling state of the _sample call running in this context (None outside one).
CURRENT: contextvars.ContextVar[SamplingState | None] = contextvars.ContextVar("mpsboost_sampling", default=None)


def _softmax(
    input: torch.Tensor, dim: int | None = None, _stacklevel: int = 3, dtype: torch.dtype | None = None
) -> torch.Tensor:
    state = CURRENT.get()
    if state is not None and state.logits_path and dim in (-1, input.dim() - 1) and dtype is None:
        # The probabilities only feed the draw (checked when the recipe decided): skip the softmax and
        # hand the logits on; the draw recognises them by identity.
        state.pending_logits = input
        return input
    return torch.nn.functional.softmax(input, dim=dim, _stacklevel=_stacklevel, dtype=dtype)


def _multinomial(
    input: torch.Tensor,
    num_samples: int,
    replacement: bool = False,
    *,
    generator: torch.Generator | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    state = CURRENT.get()
    if state is None or num_samples != 1 or out is not None or input.dim() not in (1, 2):
        return torch.multinomial(input, num_samples, replacement, generator=generator, out=out)
    if state.pending_logits is not None and input is state.pending_logits:
        state.pending_logits = None
        tokens, winners = draw_from_logits(input, generator)
        state.check.add(winners, logits_form=True)
    else:
        tokens, winners = draw(input, generator)
        state.check.add(winners)
    return tokens


class _ModuleProxy:
    """Stands in for a module inside one rebound function: some names replaced, the rest forwarded."""

    def __init__(self, module: Any, replaced: dict[str, Any]) -> None:
        object.__setattr__(self, "_module", module)
        for k, v in replaced.items():
            object.__setattr__(self, k, v)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._module, name)
        # Cache: later lookups of the same name are a plain instance-dict hit.
        object.__setattr__(self, name, value)
        return value

    def __repr__(self) -> str:
        return f"<mpsboost proxy of {self._module!r}>"


class _Globals(dict):
    """A function's globals: our few names first, the defining module's live globals for the rest."""

    def __init__(self, base: dict, overrides: dict) -> None:
        super().__init__(overrides)
        self.base = base
        self["__builtins__"] = base.get("__builtins__", __builtins__)

    def __missing__(self, key: str) -> Any:
        return self.base[key]


def sampling_globals() -> dict[str, Any]:
    """The names a transformers ``_sample`` sees through :func:`with_globals`: ``torch`` and ``nn`` proxies."""
    functional = _ModuleProxy(torch.nn.functional, {"softmax": _softmax})
    return {
        "torch": _ModuleProxy(torch, {"multinomial": _multinomial}),
        "nn": _ModuleProxy(torch.nn, {"functional": functional}),
    }


def with_globals(fn: Callable[..., Any], overrides: dict[str, Any]) -> types.FunctionType:
    """A copy of ``fn`` whose global names ``overrides`` resolve to the given objects.

    The copy shares ``fn``'s code, defaults and closure; every other global is looked up live in ``fn``'s
    module, so nothing of that module is copied or changed. (Unlike ``_hf._with_globals``, whose snapshot
    dict is what ``torch.compile`` needs: ``generate()`` runs ``_sample`` eagerly, so live lookups cost nothing
    and follow later changes of the modeling module.)
    """
    if not isinstance(fn, types.FunctionType):
        raise TypeError(f"with_globals needs a plain Python function, got {type(fn).__name__}")
    g = _Globals(fn.__globals__, overrides)
    new = types.FunctionType(fn.__code__, g, fn.__name__, fn.__defaults__, fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__dict__.update(fn.__dict__)
    new.__qualname__ = fn.__qualname__
    new.__module__ = fn.__module__
    new.__doc__ = fn.__doc__
    return new
