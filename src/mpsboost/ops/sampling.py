"""The token-sampling step of generation (softmax, then one multinomial draw per row) without host syncs.

``torch.multinomial(probs, 1)`` draws by the exponential race ``argmax(probs / q)``, ``q ~ Exp(1)``
(aten/src/ATen/native/Distributions.cpp and mps/operations/Distributions.mm), but first checks the
input with two ``.item()`` calls (``max < inf and min >= 0``, then ``sum != 0``): two host syncs and
five extra full-vocabulary reductions per generated token. On an accelerator each sync stalls the host
until the whole forward pass has finished, so the next token's kernels cannot be queued ahead.

:func:`draw` performs the very same race (same ``exponential_`` call on a tensor of the same shape, so
the same generator state gives the same tokens as ``torch.multinomial``) and defers the validity check:
the winning ``probs / q`` value of each row is kept, and :class:`DeferredCheck` looks at all of them
once, at the end of generation. A NaN or inf anywhere in a row makes that row's winner NaN or inf, so
the same inputs that make ``torch.multinomial`` raise still raise, one sync per ``generate()`` call
instead of two per token.

:func:`draw_from_logits` races on the logits instead (``argmax(logits - log q)``, the Gumbel-max form of
the same draw, equal up to rounding): no softmax at all, for MPS builds before 2.15, whose softmax still
ran through MPSGraph (57.4 us for one fp32 row of 128,256; the Metal kernel of pytorch#196071: 7.1 us).

:func:`with_globals` rebinds a function's global names (used to give transformers' ``_sample`` these
draws in place of ``torch.multinomial`` on one model instance, leaving transformers itself untouched).

``ops`` never imports diffusers or transformers.
"""
from __future__ import annotations

import contextvars
import types
from typing import Any, Callable

import torch

__all__ = [
    "draw",
    "draw_from_logits",
    "DeferredCheck",
    "SamplingState",
    "CURRENT",
    "with_globals",
    "MULTINOMIAL_ERROR",
]

MULTINOMIAL_ERROR = "probability tensor contains either `inf`, `nan` or element < 0"


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sample per row of ``probs`` (``[V]`` or ``[B, V]``), as ``torch.multinomial(probs, 1)`` without its syncs.

    Returns ``(tokens, winners)``: ``tokens`` shaped like ``torch.multinomial``'s result (``[1]`` or ``[B, 1]``,
    int64) and the winning ``probs / q`` value per row for :class:`DeferredCheck`.
    """
    # Same allocation and the same exponential_ call as ATen's n_sample == 1 path, so the generator
    # advances identically and the draws are the same tokens.
    q = torch.empty_like(probs).exponential_(1, generator=generator)
    torch.div(probs, q, out=q)
    winners, tokens = q.max(dim=-1, keepdim=True)
    return tokens, winners


def draw_from_logits(logits: torch.Tensor, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sample per row of ``softmax(logits)`` without computing the softmax (Gumbel-max).

    ``argmax(p / q) = argmax(log p - log q) = argmax(logits - log q)``: the normaliser is the same for
    the whole row, so it never changes the winner. ``-inf`` logits (masked by top-k / top-p) never win.
    """
    q = torch.empty_like(logits).exponential_(1, generator=generator)
    q.log_()
    torch.sub(logits, q, out=q)
    winners, tokens = q.max(dim=-1, keepdim=True)
    return tokens, winners


class DeferredCheck:
    """Collects each step's winners; :meth:`check` raises what ``torch.multinomial`` would have raised.

    Valid rows have a finite winner that is > 0 (``probs / q`` form) or > -inf (logits form). A NaN
    anywhere in a row propagates to its ``max``; an inf in probs makes the winner inf.
    """

    __slots__ = ("winners", "logits_form")

    def __init__(self) -> None:
        self.winners: list[torch.Tensor] = []
        self.logits_form = False

    def add(self, winners: torch.Tensor, *, logits_form: bool = False) -> None:
        self.winners.append(winners.reshape(-1))
        self.logits_form = self.logits_form or logits_form

    def ok(self) -> bool:
        if not self.winners:
            return True
        w = torch.cat(self.winners)
        finite = torch.isfinite(w)
        good = finite if self.logits_form else finite & (w > 0)
        return bool(good.all())  # the one host sync of the whole generation

    def check(self) -> None:
        if not self.ok():
            raise RuntimeError(
                f"{MULTINOMIAL_ERROR} (found after generation: mpsboost's softmax recipe checks the sampled "
                "rows once per generate() call instead of syncing twice per token; the scores contained NaN/inf, "
                "as torch.multinomial would have reported)"
            )


class SamplingState:
    """What one ``_sample`` call needs: the path and its deferred check."""

    __slots__ = ("logits_path", "check", "pending_logits")

    def __init__(self, logits_path: bool) -> None:
        self.logits_path = logits_path
        self.check = DeferredCheck()
        self.pending_logits: torch.Tensor | None = None


# The sampling state of the _sample call running in this context (None outside one).
CURRENT: contextvars.ContextVar[SamplingState | None] = contextvars.ContextVar("mpsboost_sampling", default=None)


def _softmax(input: torch.Tensor, dim: int | None = None, _stacklevel: int = 3, dtype: torch.dtype | None = None) -> torch.Tensor:
    state = CURRENT.get()
    if state is not None and state.logits_path and dim in (-1, input.dim() - 1) and dtype is None:
        # The probabilities only feed the draw (checked when the recipe decided): skip the softmax and
        # hand the logits on; the draw recognises them by identity.
        state.pending_logits = input
        return input
    return torch.nn.functional.softmax(input, dim=dim, _stacklevel=_stacklevel, dtype=dtype)


def _multinomial(input: torch.Tensor, num_samples: int, replacement: bool = False, *, generator: torch.Generator | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
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
    module, so nothing of that module is copied or changed.
    """
    if not isinstance(fn, types.FunctionType):
        raise TypeError(f"with_globals needs a plain Python function, got {type(fn).__name__}")
    new = types.FunctionType(fn.__code__, _Globals(fn.__globals__, overrides), fn.__name__, fn.__defaults__, fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__dict__.update(fn.__dict__)
    new.__qualname__ = fn.__qualname__
    new.__module__ = fn.__module__
    new.__doc__ = fn.__doc__
    return new
