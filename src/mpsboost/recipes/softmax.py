"""softmax: the token-sampling step of transformers ``generate(do_sample=True)`` on the fastest correct path.

Stock, each generated token runs ``probs = softmax(scores)`` then ``torch.multinomial(probs, 1)``,
whose input check costs two host syncs and five extra full-vocabulary reductions per token (see
:mod:`mpsboost.ops.sampling`; the MPS kernel, aten/src/ATen/native/mps/operations/Distributions.mm, runs
the same two ``.item()`` checks). The patched model draws the very same exponential race without the syncs
(same generator calls, so the same tokens for the same seed) and checks the rows once per ``generate()``.

Host reads per sampled token, counted from the loop's source (:func:`host_reads_per_token`): the loop's
stop check reads one value (``unfinished_sequences.max() == 0``) except where transformers defers it
(``DeferredStopCheck``, transformers 5.23+, MPS only: the flag is copied asynchronously and read one step
late), and ``torch.multinomial`` reads two. transformers 5.24 on MPS: 2 stock, 0 patched, so the host
never waits on the GPU between tokens only with the recipe; on CUDA and CPU, and with transformers < 5.23:
3 stock, 1 patched (the stop check still waits every token).
Where the softmax itself is slow the race runs on the logits and no softmax is computed at all
(Gumbel-max: the same distribution; the same tokens up to rounding of near ties): on MPS before torch
2.15, whose softmax still ran through MPSGraph (pytorch#196071 moved it to a Metal kernel in 2.15), and
on the CUDA GPU of the tuning file ``softmax_sampling``, where one 128,256-wide row is softmaxed by a single
thread block (33.5 us of a 66.9 us step; 35.1 us for the whole step on logits). Other GPUs keep the
native softmax with the sync-free draw until they are measured.

Compiled mode: the recipe binds no forward; ``generate()`` compiles the model's forward (static cache)
and runs the sampling step eagerly around it, so the compiled graph is the stock forward's.

How it is bound: ``generate()`` looks its decoding method up on ``type(model)`` (transformers 5), so an
instance attribute would be ignored. The recipe gives this one model instance a subclass of its own
class (same name and module) whose ``_sample`` is transformers' own function, its code untouched, with
``torch.multinomial`` and ``nn.functional.softmax`` resolved to the draws above. transformers, torch and
every other instance are unchanged; ``unpatch`` restores the original class. Pickling a whole patched
model object (not its ``state_dict``) needs ``unpatch`` first.

Options (``options={"softmax": {...}}``): ``path``: ``"auto"`` (default), ``"probs"`` (native softmax,
sync-free draw) or ``"logits"`` (no softmax), forced on any env.
"""

from __future__ import annotations

import copyreg
import functools
import inspect
import re
import types
from dataclasses import dataclass
from typing import Any, Iterator, Literal

import torch

from .. import tuning
from ..gate import Env, check
from ._hf_sample import CURRENT, SamplingState, sampling_globals, with_globals
from ..registry import Decision, Match, Recipe, class_path, matches_class, option_choices, register
from ..patching import Patch, swap_class, swapped_class_key, without_record

_GENERATIVE = "transformers.generation.utils.GenerationMixin"
_SOFTMAX_LINE = re.compile(r"(\w+)\s*=\s*nn\.functional\.softmax\(\s*next_token_scores\s*,\s*dim\s*=\s*-1\s*\)")
_TUNING = "softmax_sampling"  # mpsboost/data/tuning/softmax_sampling.json
_DRAW_LINE = r"torch\.multinomial\(\s*{probs}\s*,\s*num_samples\s*=\s*1\s*\)"


@dataclass(frozen=True)
class SoftmaxOptions:
    """``options={"softmax": {...}}``: ``path`` "auto", "probs" or "logits" (see the module docstring)."""

    path: Literal["auto", "probs", "logits"] = "auto"


_PATHS = option_choices(SoftmaxOptions, "path")


@dataclass(frozen=True)
class SoftmaxPlan:
    """``logits``: the draw races on the logits (no softmax at all); else native softmax, sync-free draw."""

    logits: bool


@register
class Softmax(Recipe):
    name = "softmax"
    summary = (
        "sampling step of generate(): native softmax and a sync-free multinomial draw (no softmax at all on MPS < 2.15)"
    )
    targets = (_GENERATIVE,)
    lossless = True
    reversible = True
    requires = ()
    default = True
    order = 100
    Options = SoftmaxOptions

    def find(self, root: torch.nn.Module, prefix: str = "") -> Iterator[Match]:
        for name, mod in root.named_modules():
            if matches_class(mod, self.targets) and hasattr(type(mod), "_sample"):
                yield Match(mod, ".".join(p for p in (prefix, name) if p) or "<root>")

    def decide(self, match: Match, env: Env, options: SoftmaxOptions) -> Decision:
        path = options.path
        if path not in _PATHS:
            raise ValueError(f"softmax option 'path' must be one of {_PATHS}, got {path!r}")
        cls = type(match.module)
        if getattr(cls, "_mpsboost_base_class", None) is not None:
            return Decision.skip("this model's class was already given the sync-free sampling step")
        fn = getattr(cls, "_sample", None)
        if not isinstance(fn, types.FunctionType):
            return Decision.skip(f"{class_path(cls)}._sample is not a plain function; left alone")
        unknown = _known_sampling_step(fn)
        if unknown is not None:
            return Decision.skip(f"{class_path(cls)}: {unknown}; this transformers version is left alone")

        syncs = _reads_text(fn, env.device_type)
        if path == "probs":
            return Decision.apply(
                "native softmax, sync-free draw",
                f"forced by options (path='probs'); {syncs}",
                plan=SoftmaxPlan(logits=False),
            )
        if path == "logits":
            return Decision.apply(
                "draw on logits (no softmax), sync-free",
                f"forced by options (path='logits'); {syncs}",
                plan=SoftmaxPlan(logits=True),
            )
        v = check("softmax_native", env)
        if env.device_type == "mps" and not v.ok:
            return Decision.apply(
                "draw on logits (no softmax), sync-free", f"{v.reason}; {syncs}", plan=SoftmaxPlan(logits=True)
            )
        if env.device_type == "cuda":
            # A faster sampling step is not a faster generate(): the whole-job measurement on the one GPU
            # measured (tuning file softmax_sampling, entry end_to_end) decides, and stock is kept where it
            # shows no gain; a GPU not measured keeps stock too. options path='probs'|'logits' forces it.
            t, why = tuning.for_env(_TUNING, env)
            if t is None:
                return Decision.skip(
                    f"{why}; stock sampling kept (options={{'softmax': {{'path': 'probs'}}}} forces the sync-free draw)"
                )
            e = t.entries
            e2e = e.get("end_to_end") or {}
            if e2e.get("default") == "off":
                return Decision.skip(
                    f"no end-to-end gain measured: {e2e['finding']} ({e2e['source']}); "
                    "stock sampling kept (options={'softmax': {'path': 'logits'}} forces it)"
                )
            step = e["step_us"]
            return Decision.apply(
                "draw on logits (no softmax), sync-free",
                f"one {e['dtype']} row of {e['vocab']:,}: sampling step {step['stock']} us stock, "
                f"{step['logits']} us on logits ({_TUNING}: {t.describe()}); {syncs}",
                plan=SoftmaxPlan(logits=True),
            )
        return Decision.apply("native softmax, sync-free draw", f"{v.reason}; {syncs}", plan=SoftmaxPlan(logits=False))

    def apply(self, match: Match, decision: Decision, env: Env, options: SoftmaxOptions) -> Patch:
        model = match.module
        plan: SoftmaxPlan = decision.plan
        return swap_class(model, self.name, _subclass(type(model), plan.logits))


@functools.lru_cache(maxsize=16)
def _known_sampling_step(fn: types.FunctionType) -> str | None:
    """None when ``fn`` (a ``_sample``) has the sampling step this recipe knows, else why not.

    Known: ``probs = nn.functional.softmax(next_token_scores, dim=-1)`` whose result is used exactly once,
    by ``torch.multinomial(probs, num_samples=1)``. That single use is what allows the logits path to hand
    the logits on in place of the probabilities.
    """
    try:
        src = inspect.getsource(fn)
    except (OSError, TypeError):
        return "the source of its _sample is not available to verify the sampling step"
    m = _SOFTMAX_LINE.search(src)
    if m is None:
        return "its _sample has no 'nn.functional.softmax(next_token_scores, dim=-1)' step"
    name = m.group(1)
    if not re.search(_DRAW_LINE.format(probs=re.escape(name)), src):
        return f"its _sample does not draw with torch.multinomial({name}, num_samples=1)"
    uses = len(re.findall(rf"\b{re.escape(name)}\b", src))
    if uses != 2:
        return f"its _sample uses '{name}' {uses} times (expected: computed once, drawn from once)"
    return None


@functools.lru_cache(maxsize=None)
def _subclass(cls: type, logits_path: bool) -> type:
    """``cls`` with a ``_sample`` that draws without host syncs. Cached: one subclass per class and path."""
    stock = cls._sample
    rebound = with_globals(stock, sampling_globals())

    @functools.wraps(stock)
    def _sample(self, *args: Any, **kwargs: Any) -> Any:
        state = SamplingState(logits_path)
        token = CURRENT.set(state)
        try:
            out = rebound(self, *args, **kwargs)
        finally:
            CURRENT.reset(token)
        state.check.check()
        return out

    def __reduce_ex__(self, protocol: int) -> Any:
        # A copy or pickle of a patched model is a plain, unpatched instance of the original class (the
        # dynamic subclass cannot be found by name when unpickling).
        rv = super(sub, self).__reduce_ex__(protocol)
        if not isinstance(rv, tuple) or len(rv) < 2:
            return rv
        if rv[0] in (copyreg.__newobj__, getattr(copyreg, "__newobj_ex__", None)):
            # pickle insists that __newobj__ builds type(self): rebuild through the protocol-0 route.
            func, args = copyreg._reconstructor, (cls, object, None)
        else:
            func, args = rv[0], tuple(cls if a is sub else a for a in rv[1])
        rest = list(rv[2:])
        if rest and isinstance(rest[0], dict):
            rest[0] = without_record(rest[0], swapped_class_key("softmax"))
        return (func, args, *rest)

    namespace = {
        "__reduce_ex__": __reduce_ex__,
        "_sample": _sample,
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__,
        "_mpsboost_base_class": cls,
    }
    sub = type(cls.__name__, (cls,), namespace)
    return sub


#: host values torch.multinomial(probs, 1) reads per call: ``(max < inf & min >= 0).item()`` and
#: ``(sum == 0).item()`` (ATen's n_sample == 1 path, CPU, CUDA and MPS alike).
MULTINOMIAL_HOST_READS = 2


@functools.lru_cache(maxsize=16)
def _defers_stop_check(fn: types.FunctionType) -> bool:
    """Does this ``_sample`` defer its stop check where the device allows (``DeferredStopCheck``, 5.23+)?"""
    try:
        src = inspect.getsource(fn)
    except (OSError, TypeError):
        return False
    return "DeferredStopCheck.is_supported(" in src


def host_reads_per_token(fn: types.FunctionType, device_type: str) -> tuple[int, int]:
    """(stock, patched) host reads per sampled token of ``generate()``'s loop ``fn`` on ``device_type``.

    The stop check reads one value per token unless the loop defers it, which transformers does on MPS
    only (``DeferredStopCheck.is_supported``: ``device.type != "mps"`` returns False); the stock draw reads
    :data:`MULTINOMIAL_HOST_READS`, the patched draw none (its check runs once per ``generate()``).
    """
    stop = 0 if device_type == "mps" and _defers_stop_check(fn) else 1
    return stop + MULTINOMIAL_HOST_READS, stop


def _reads_text(fn: types.FunctionType, device_type: str) -> str:
    stock, patched = host_reads_per_token(fn, device_type)
    where = (
        "transformers defers its stop check here (DeferredStopCheck)"
        if stock == MULTINOMIAL_HOST_READS
        else "the loop's stop check still reads one"
    )
    return (
        f"host reads per sampled token: {stock} stock (torch.multinomial's input check: {MULTINOMIAL_HOST_READS}; "
        f"{where}), {patched} patched; the rows are checked once per generate()"
    )
