"""Recipe ``attention_split``: no SDPA call above 2^31 attention scores on MPS.

MPS computes wrong attention once one ``scaled_dot_product_attention`` call holds more than 2^31
score elements (B * H * Lq * Lk), as Wan video workflows hit (ComfyUI#14837: Wan2.2 at 720p and 121
frames attends over about 27,000 tokens with 24 heads). This recipe splits such calls along the
queries (:mod:`mpsboost.ops.attention_split`); each slice attends to every key, so each output row
is computed as before. Calls within the budget pass through unchanged.

- diffusers: every attention module (``Attention``, and the ``AttentionModuleMixin`` classes such as
  ``WanAttention``) of a model gets a forward that runs its processor with
  ``F.scaled_dot_product_attention`` routed to the split (``WanAttnProcessor`` and Qwen-Image's
  processor reach it through ``dispatch_attention_fn``'s native backend, ``AttnProcessor2_0``
  directly). One report row per model.
- transformers: every attention module on ``sdpa`` gets a forward of its own that runs its class's
  forward with SDPA routed to the split, only for calls that may exceed the budget (a bound from the
  shapes: batch, heads, queries and the key length the mask has). No config changes: the model's
  ``config._attn_implementation`` still reads ``"sdpa"`` (transformers picks its mask by it; its own
  tests assert it), and a model built later from the same config object is untouched.

Gate: the ``sdpa_large_scores_correct`` feature where the gate has it; without it, every MPS build
is taken to have the fault (no fix is known). On CUDA and CPU it steps aside. Options:
``max_scores`` (the per-call budget, default 2^31), ``force`` (apply in any environment).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator

import torch

from ..gate import FEATURES, Env, check
from ..ops.attention_split import SdpaSplitMode
from . import _hf
from ..registry import Decision, Match, Recipe, matches_class, register
from ..patching import Changes, Patch, bind_forward, call_original, set_instance_attr

NAME = "attention_split"

_PRETRAINED = "transformers.modeling_utils.PreTrainedModel"
_MODELMIXIN = "diffusers.models.modeling_utils.ModelMixin"
_DIFFUSERS_ATTENTION = (
    "diffusers.models.attention_processor.Attention",
    "diffusers.models.attention.AttentionModuleMixin",
)

# The MPSGraph SDPA path (and bmm) index the score matrix with 32 bits: from about 2^31 elements the
# results are silently wrong (gate feature ``sdpa_large_scores_correct``: issue pytorch#179352,
# ComfyUI#14837; not fixed as of 2026-11-30). The default budget of one SDPA call, B * H * Lq * Lk.
MAX_SCORES = 2**31


@dataclass(frozen=True)
class AttentionSplitOptions:
    """``options={"attention_split": {...}}``: the score budget of one SDPA call, and force on any env."""

    max_scores: int = MAX_SCORES
    force: bool = False


@dataclass(frozen=True)
class SplitTarget:
    """What ``find`` saw: a transformers model (``"transformers"``) or a diffusers model (``"diffusers"``)."""

    kind: str


@dataclass(frozen=True)
class SplitPlan:
    """What ``apply`` does: bind the split forward on ``attention_modules`` modules, at ``max_scores``."""

    max_scores: int
    attention_modules: int
    dense: bool = False  # every split call gets contiguous q/k/v (gate feature sdpa_strided_correct)


@register
class AttentionSplit(Recipe):
    name = NAME
    summary = "SDPA split along the queries so that no call holds more than 2^31 scores (wrong results on MPS beyond)"
    targets = (_PRETRAINED, _MODELMIXIN)
    lossless = True
    reversible = True
    requires = ()
    default = True
    order = 110  # after metal_attention: it wraps whatever attention implementation that one chose
    Options = AttentionSplitOptions

    def find(self, root: torch.nn.Module, prefix: str = "") -> Iterator[Match]:
        covered: set[int] = set()  # the ids of every module inside a match: an outer model covers the inner ones
        for name, mod in root.named_modules():
            if id(mod) in covered:
                continue
            path = ".".join(p for p in (prefix, name) if p) or "<root>"
            if matches_class(mod, (_PRETRAINED,)):
                covered.update(id(m) for m in mod.modules())
                yield Match(mod, path, SplitTarget("transformers"))
            elif matches_class(mod, (_MODELMIXIN,)) and _attention_modules(mod):
                covered.update(id(m) for m in mod.modules())
                yield Match(mod, path, SplitTarget("diffusers"))

    def decide(self, match: Match, env: Env, options: AttentionSplitOptions) -> Decision:
        limit, force = _options(options)
        if match.data.kind == "transformers":
            impl = getattr(getattr(match.module, "config", None), "_attn_implementation", None)
            if impl != "sdpa":
                return Decision.skip(
                    f"attention implementation {impl!r}: only 'sdpa' calls the kernel this recipe splits"
                )
            mods = [m for _, m in _hf.attention_modules(match.module) if _hf.implementation(m) == "sdpa"]
            if not mods:
                return Decision.skip("no attention module on 'sdpa' that looks up transformers' attention functions")
            found = Decision.apply(
                "sdpa split along queries (attention module forwards)",
                f"'sdpa' kept in the config; {len(mods)} attention modules",
                plan=SplitPlan(max_scores=limit, attention_modules=len(mods)),
            )
        else:
            n = len(_attention_modules(match.module))
            found = Decision.apply(
                "sdpa split along queries (attention processors)",
                f"{n} attention modules",
                plan=SplitPlan(max_scores=limit, attention_modules=n),
            )
        if force:
            return Decision.apply(found.backing, f"forced by options (force=True); {found.reason}", plan=found.plan)
        if env.device_type != "mps":
            return Decision.skip(f"SDPA is correct beyond 2^31 scores on {env.device_type}; stock kept")
        if "sdpa_large_scores_correct" in FEATURES:
            v = check("sdpa_large_scores_correct", env)
            if v.ok:
                return Decision.skip(f"{v.reason}; stock kept")
            why = v.reason
        else:
            why = "no MPS build is known to compute SDPA over more than 2^31 scores correctly (ComfyUI#14837)"
        plan, strided = found.plan, check("sdpa_strided_correct", env)
        if not strided.ok:  # a query slice is a strided view: each split call gets contiguous inputs
            plan, why = replace(plan, dense=True), f"{why}; each split call gets contiguous q/k/v ({strided.reason})"
        return Decision.apply(found.backing, f"{why}; calls above {limit} scores are split; {found.reason}", plan=plan)

    def apply(self, match: Match, decision: Decision, env: Env, options: AttentionSplitOptions) -> Patch:
        plan: SplitPlan = decision.plan
        limit = plan.max_scores
        if match.data.kind == "transformers":
            modules = [m for _, m in _hf.attention_modules(match.module) if _hf.implementation(m) == "sdpa"]
            bounds: dict[type, Callable] = {}
            forwards = [
                _split_forward(limit, bounds.setdefault(type(m), _hf_may_exceed_for(m)), plan.dense) for m in modules
            ]
        else:
            modules = _attention_modules(match.module)
            forwards = [_split_forward(limit, _may_exceed, plan.dense)] * len(modules)
        with Changes() as ch:
            # A mark on the model itself: patch() sees it patched (a second call is a no-op).
            ch.add(set_instance_attr(match.module, NAME, "_mpsboost_split_limit", limit))
            for m, forward in zip(modules, forwards):
                ch.add(bind_forward(m, NAME, forward))
        return ch.patch(description=f"{NAME}: restore attention forwards")


def _options(options: AttentionSplitOptions) -> tuple[int, bool]:
    limit = options.max_scores
    if limit < 1:
        raise ValueError(f"{NAME} option max_scores={limit!r} is not accepted; pass a positive int (default 2**31)")
    return limit, options.force


def _positions(module: torch.nn.Module) -> tuple[int | None, int | None]:
    """Where ``hidden_states`` and ``attention_mask`` sit among the positional arguments of ``module``'s
    class forward (self excluded), or None. Read at patch time, from the signature: attention classes
    differ (T5-style ones take ``mask`` and ``key_value_states``), and a tensor in the wrong slot must
    never be read as the mask."""
    fwd = inspect.unwrap(getattr(type(module), "forward"))
    try:
        names = [
            p.name
            for p in inspect.signature(fwd).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ][1:]
    except (TypeError, ValueError):
        return None, None
    pos = {n: i for i, n in enumerate(names)}
    return pos.get("hidden_states"), pos.get("attention_mask")


def _hf_may_exceed_for(module: torch.nn.Module) -> Callable[[torch.nn.Module, tuple, dict, int], bool]:
    """The bound of one transformers attention class: False when a call surely stays within ``limit``
    scores: B * query heads * Lq * Lk, with Lq from ``hidden_states`` and Lk the key length of the attention
    mask (transformers' masks span every key, cached ones included). Without a mask the keys are bounded
    by the longest of Lq, the config's ``max_position_embeddings`` and any other sequence passed (cross
    attention). True when the shapes cannot be read: then every SDPA call of the module is checked."""
    at_hidden, at_mask = _positions(module)

    def may_exceed(module: torch.nn.Module, args: tuple, kwargs: dict, limit: int) -> bool:
        hidden = args[at_hidden] if at_hidden is not None and len(args) > at_hidden else kwargs.get("hidden_states")
        cfg = getattr(module, "config", None)
        heads = getattr(module, "num_heads", None) or getattr(cfg, "num_attention_heads", None)
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3 or not isinstance(heads, int):
            return True
        mask = args[at_mask] if at_mask is not None and len(args) > at_mask else kwargs.get("attention_mask")
        lq = hidden.shape[1]
        if isinstance(mask, torch.Tensor) and mask.dim() >= 2:
            lk = mask.shape[-1]
        else:
            longest = getattr(cfg, "max_position_embeddings", None)
            if not isinstance(longest, int):
                return True
            others = [v.shape[1] for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor) and v.dim() == 3]
            lk = max([lq, longest, *others])
        return hidden.shape[0] * heads * lq * lk > limit

    return may_exceed


def _split_forward(limit: int, may_exceed: Callable[[torch.nn.Module, tuple, dict, int], bool], dense: bool):
    def forward(self_: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        # Shapes are static under torch.compile: calls that cannot exceed the budget trace the stock
        # forward untouched; only the large ones run with SDPA routed to the split.
        if not may_exceed(self_, args, kwargs, limit):
            return call_original(self_, NAME, *args, **kwargs)
        with SdpaSplitMode(limit, dense):
            return call_original(self_, NAME, *args, **kwargs)

    return forward


def _may_exceed(module: torch.nn.Module, args: tuple, kwargs: dict, limit: int) -> bool:
    """False when this attention call surely stays within ``limit`` scores: B * heads * (Lq + Lk)^2
    bounds self, cross and joint attention alike (Lq from ``hidden_states``, Lk from
    ``encoder_hidden_states``). True when the shapes cannot be read (then every SDPA call is checked)."""
    hidden = args[0] if args else kwargs.get("hidden_states")
    enc = args[1] if len(args) > 1 else kwargs.get("encoder_hidden_states")
    heads = getattr(module, "heads", None)
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 3 or not isinstance(heads, int):
        return True
    # [B, L, C], or an image [B, C, H, W] that the processor flattens to H * W tokens
    tokens = hidden.shape[1] if hidden.dim() == 3 else math.prod(hidden.shape[2:])
    if isinstance(enc, torch.Tensor) and enc.dim() == 3:
        tokens += enc.shape[1]
    return hidden.shape[0] * heads * tokens * tokens > limit


def _attention_modules(root: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in root.modules() if matches_class(m, _DIFFUSERS_ATTENTION)]
