"""metal_attention: attention of transformers and diffusers models on the Metal SDPA kernels of MPS.

- transformers models on ``eager`` (or ``sdpa``, forced) attention: each attention module of the instance
  gets its class's forward with the attention function looked up for its implementation routed to
  Metal SDPA (:func:`mpsboost.recipes._hf.route_attention`): K/V left grouped, bool or query-dtype masks
  (transformers' own mask for the configured implementation). Cases it does not cover (softcap, position
  bias, attention sinks, attention weights the caller may read) go to the function the implementation names
  (transformers' eager or SDPA one). Weights count however they were asked for: the call's
  ``output_attentions``, the config's, or transformers' output capture collecting them
  (:func:`mpsboost.recipes._hf.weights_wanted`; transformers 5.x asks the config and records the attention
  modules' outputs through hooks, so nothing in the call's arguments may say so). No config changes:
  ``config._attn_implementation`` still reads what it read (transformers picks its mask by it), and a model
  built later from the same config object is untouched. ``unpatch`` restores the very same forwards.
- diffusers ``Attention`` modules on the matmul processors (``AttnProcessor``, ``SlicedAttnProcessor``
  from ``enable_attention_slicing()``, and their added-KV variants) get diffusers' SDPA processors; the
  flash-style Metal prefill kernels keep memory linear in sequence length, which is what slicing was for.
  Processors already on SDPA are left as they are.

What each torch build runs natively decides what routing buys (gate features):

- before 2.13 (``sdpa_metal_prefill``, pytorch#181575): SDPA prefill runs the MPSGraph path, which
  materialises the full score matrix: nothing to gain by routing; the recipe skips with the reason.
- 2.13 to 2.15: flash-style Metal prefill kernels (#181575), grouped K/V without repeating them
  (``sdpa_metal_gqa``, #183280, merged 2026-05-11), MPP kernels on macOS 26.2+ for fp16/bf16 and head dims
  64-256 (``sdpa_mpp_attention``, #182256), a macOS 26 fix in 2.14 (#191794). Eager transformers models and
  diffusers matmul/sliced processors are routed to them; a transformers model already on ``sdpa`` reaches the
  same kernels itself (transformers passes ``enable_gqa`` on MPS from torch 2.13).
- 2.16 nightlies (``metal_attention``): attention fully on Metal, every SDPA path.

Strided inputs (``sdpa_strided_correct``, pytorch#163597 / #181133; no build is known to be fixed): the MPS
kernels read some head-transposed or permuted views wrong (black images, ComfyUI#10681). Under MPS decisions the
route makes q/k/v contiguous before SDPA, and a transformers model on ``sdpa`` is routed for that copy alone
(stock's function hands the kernels the transposed views). diffusers' SDPA processors pass such views
themselves, so a matmul processor is kept there.

On CPU and CUDA it does not apply. ``options={"metal_attention": {"force": True}}`` applies it on any env
(the code path is ordinary SDPA there; used by the tests).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Iterator

import torch

from ..gate import Env, Verdict, check
from ..ops.attention import sdpa
from . import _hf
from ..registry import Decision, Match, Recipe, class_path, matches_class, register
from ..patching import Changes, Patch, set_instance_attr

IMPLEMENTATION = "mpsboost_metal"
_PRETRAINED = "transformers.modeling_utils.PreTrainedModel"
_MODELMIXIN = "diffusers.models.modeling_utils.ModelMixin"
_DIFFUSERS_ATTENTION = "diffusers.models.attention_processor.Attention"
# matmul processor -> its SDPA counterpart (diffusers.models.attention_processor)
_SDPA_PROCESSOR = {
    "AttnProcessor": "AttnProcessor2_0",
    "SlicedAttnProcessor": "AttnProcessor2_0",
    "AttnAddedKVProcessor": "AttnAddedKVProcessor2_0",
    "SlicedAttnAddedKVProcessor": "AttnAddedKVProcessor2_0",
}
_SWITCHABLE = ("eager", "sdpa")
# Head dims with a Metal SDPA kernel (aten/src/ATen/native/mps/operations/Attention.mm): the prefill kernels
# (query length > 8) take all of these, the decode vector kernels (<= 8) 64, 96, 128 and 256. Any other
# head dim falls back to the MPSGraph path, so routing gains nothing there.
METAL_HEAD_DIMS = (32, 64, 72, 80, 96, 128, 256)


@dataclass(frozen=True)
class MetalAttentionOptions:
    """``options={"metal_attention": {...}}``: ``force`` applies it on any env (tests, CUDA)."""

    force: bool = False


@dataclass(frozen=True)
class MetalTarget:
    """What ``find`` saw: the outermost transformers model (``"transformers"``) or one diffusers
    ``Attention`` module (``"diffusers"``)."""

    kind: str


@dataclass(frozen=True)
class RoutePlan:
    """A transformers model: route the attention modules' lookup; ``previous`` is the implementation its
    config names (kept there), ``attention_modules`` how many modules get a forward of their own."""

    previous: str
    attention_modules: int
    dense: bool = False  # q/k/v made contiguous before SDPA (the build reads strided views wrong)


@dataclass(frozen=True)
class ProcessorPlan:
    """A diffusers ``Attention`` module: give it ``processor`` (the name of a diffusers SDPA processor class)."""

    processor: str


@register
class MetalAttention(Recipe):
    name = "metal_attention"
    summary = (
        "attention on the Metal SDPA kernels (2.13+; fully on Metal in 2.16 nightlies): "
        "grouped K/V, bool or same-dtype masks, no matmul/sliced processors"
    )
    targets = (_PRETRAINED, _DIFFUSERS_ATTENTION)
    lossless = True
    reversible = True
    requires = ()
    default = True
    order = 100
    Options = MetalAttentionOptions

    def find(self, root: torch.nn.Module, prefix: str = "") -> Iterator[Match]:
        covered: list[torch.nn.Module] = []
        for name, mod in root.named_modules():
            path = ".".join(p for p in (prefix, name) if p) or "<root>"
            if matches_class(mod, (_PRETRAINED,)):
                # The outermost transformers model only: its implementation setting reaches every layer.
                if any(mod is c or _contains(c, mod) for c in covered):
                    continue
                covered.append(mod)
                yield Match(mod, path, MetalTarget("transformers"))
            elif matches_class(mod, (_DIFFUSERS_ATTENTION,)):
                yield Match(mod, path, MetalTarget("diffusers"))

    def decide(self, match: Match, env: Env, options: MetalAttentionOptions) -> Decision:
        kind = match.data.kind
        found = self._decide_transformers(match) if kind == "transformers" else self._decide_diffusers(match)
        if not found.applicable:
            return found
        strided = _strided_inputs(env)
        if strided is not None and kind == "diffusers":
            # diffusers' SDPA processors hand SDPA the head-transposed views themselves: routing the matmul
            # processor onto them would bring the wrong-values bug in.
            return Decision.skip(f"the SDPA processors pass strided q/k/v, which this build may read wrong: {strided}")
        plan, backing, dense = found.plan, found.backing, ""
        if strided is not None:
            plan, backing = replace(plan, dense=True), f"{backing}, q/k/v made contiguous"
            dense = f"; q/k/v made contiguous before SDPA ({strided})"
        if options.force:
            return Decision.apply(backing, f"forced by options (force=True); {found.reason}{dense}", plan=plan)
        v = _native_kernels(env)
        if isinstance(plan, RoutePlan) and plan.previous == "sdpa":
            if strided is None:
                return Decision.skip(
                    f"stock already does it: the model is on 'sdpa', which reaches the same Metal kernels ({v.reason})"
                )
            # Stock's SDPA function hands the kernels head-transposed views: the route's only change is the copy.
            return Decision.apply(backing, f"stock's 'sdpa' passes strided q/k/v; {found.reason}{dense}", plan=plan)
        if not v.ok:
            return Decision.skip(v.reason)
        return Decision.apply(backing, f"{v.reason}; {found.reason}{dense}", plan=plan)

    # -------------------------------------------------------------- what the model allows
    def _decide_transformers(self, match: Match) -> Decision:
        model = match.module
        cfg = getattr(model, "config", None)
        impl = getattr(cfg, "_attn_implementation", None)
        if impl == IMPLEMENTATION:
            return Decision.skip("already on mpsboost_metal attention")
        if impl not in _SWITCHABLE:
            return Decision.skip(f"attention implementation {impl!r} chosen for this model; left alone")
        if not getattr(type(model), "_supports_sdpa", False):
            return Decision.skip(f"{class_path(type(model))} does not support SDPA attention")
        hd = _head_dim(cfg)
        if hd is not None and not metal_head_dim_ok(hd):
            return Decision.skip(f"head_dim {hd} has no Metal kernel (kernels: {METAL_HEAD_DIMS}); stock kept")
        mods = [m for _, m in _hf.attention_modules(model) if _hf.implementation(m) in _SWITCHABLE]
        if not mods:
            return Decision.skip("no attention module that looks up transformers' attention functions; left alone")
        why = next((w for w in map(_hf.routable, mods) if w), "") or next(
            (
                f"{type(m).__name__}'s modeling file has no eager_attention_forward to fall back on"
                for m in mods
                if _hf.implementation(m) == "eager" and _hf.eager_function(m) is None
            ),
            "",
        )
        if why:
            return Decision.skip(f"cannot route its attention modules: {why}")
        return Decision.apply(
            "sdpa, grouped K/V (attention module forwards)",
            f"{impl!r} kept in the config; {len(mods)} attention modules",
            plan=RoutePlan(previous=impl, attention_modules=len(mods)),
        )

    def _decide_diffusers(self, match: Match) -> Decision:
        attn = match.module
        proc = getattr(attn, "processor", None)
        pname = type(proc).__name__
        if type(proc).__module__ != "diffusers.models.attention_processor" or pname not in _SDPA_PROCESSOR:
            return Decision.skip(f"processor {pname} is not a matmul processor this recipe replaces; left alone")
        if not getattr(attn, "scale_qk", True):
            return Decision.skip("scale_qk=False: the SDPA processors always scale q.k; matmul processor kept")
        heads = getattr(attn, "heads", None)
        inner = getattr(getattr(attn, "to_q", None), "out_features", None)
        if isinstance(heads, int) and isinstance(inner, int) and heads > 0:
            hd = inner // heads
            if not metal_head_dim_ok(hd):
                return Decision.skip(f"head_dim {hd} has no Metal kernel (kernels: {METAL_HEAD_DIMS}); stock kept")
        return Decision.apply(
            f"sdpa ({_SDPA_PROCESSOR[pname]})", f"was {pname}", plan=ProcessorPlan(processor=_SDPA_PROCESSOR[pname])
        )

    # -------------------------------------------------------------- applying
    def apply(self, match: Match, decision: Decision, env: Env, options: MetalAttentionOptions) -> Patch:
        plan: RoutePlan | ProcessorPlan = decision.plan
        if isinstance(plan, RoutePlan):
            return self._apply_transformers(match.module, plan.dense)
        import diffusers.models.attention_processor as ap

        processor = getattr(ap, plan.processor)()
        return set_instance_attr(match.module, self.name, "processor", processor)

    def _apply_transformers(self, model: torch.nn.Module, dense: bool) -> Patch:
        with Changes() as ch:
            # A mark on the model itself: patch() sees it patched (a second call is a no-op).
            ch.add(set_instance_attr(model, self.name, "_mpsboost_metal_attention", True))
            for _, m in _hf.attention_modules(model):
                if _hf.implementation(m) in _SWITCHABLE:
                    ch.add(_hf.route_attention(m, self.name, _routes(m, dense)))
        return ch.patch(description="metal_attention: restore attention forwards")


def metal_head_dim_ok(head_dim: int) -> bool:
    return int(head_dim) in METAL_HEAD_DIMS


def _uncovered(module: torch.nn.Module, kwargs: dict, collector: Any) -> bool:
    """Cases SDPA does not cover. Attention weights count however they were asked for: the call's flag, the
    config's ``output_attentions``, or transformers' output capture (hooks on the attention modules,
    driven by the config; nothing in the call's arguments says so)."""
    return (
        kwargs.get("softcap") is not None
        or kwargs.get("position_bias") is not None
        or kwargs.get("s_aux") is not None
        or kwargs.get("sinks") is not None
        or _hf.weights_wanted(module, kwargs, collector)
    )


def _sdpa_routed(collector: Any, dense: bool):
    """The function an ``sdpa`` model's attention modules get (``collector``: transformers' output capture,
    read at patch time: see :func:`mpsboost.recipes._hf.weights_wanted`; ``dense``: q/k/v made contiguous)."""

    def metal_attention_forward(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        is_causal: bool | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        """transformers attention function: ``[B, H, L, D]`` in, ``[B, L, H, D]`` out, as ``sdpa_attention_forward``."""
        if _uncovered(module, kwargs, collector):
            from transformers.integrations.sdpa_attention import sdpa_attention_forward

            return sdpa_attention_forward(
                module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs
            )
        return _metal(module, query, key, value, attention_mask, dropout, scaling, is_causal, dense)

    return metal_attention_forward


def _metal(module, query, key, value, attention_mask, dropout, scaling, is_causal, dense):
    q_len, kv_len = query.shape[2], key.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # As transformers' SDPA function: the causal flag only for a prefill without mask; an empty static
    # cache's slots past the prompt are cropped (upper-left aligned causal mask).
    causal = bool(q_len > 1 and attention_mask is None and causal)
    if causal and kv_len > q_len:
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    out = sdpa(
        query,
        key,
        value,
        attention_mask,
        dropout_p=dropout if module.training else 0.0,
        is_causal=causal,
        scale=scaling,
        dense=dense,
    )
    return out.transpose(1, 2).contiguous(), None


def _eager_routed(eager: Any, dense: bool):
    """The function an eager model's attention modules get: Metal SDPA on transformers' eager mask (a
    query-dtype additive mask, always materialised); the modeling file's own eager function for the cases
    SDPA does not cover (returned attention weights among them: an eager model's users may read them)."""
    collector = _hf.attention_collector()

    def eager_to_metal(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        if _uncovered(module, kwargs, collector):
            return eager(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        return _metal(module, query, key, value, attention_mask, dropout, scaling, kwargs.get("is_causal"), dense)

    return eager_to_metal


def _routes(module: torch.nn.Module, dense: bool) -> dict[str, Any]:
    """implementation name -> the function ``module``'s forward gets for it (``dense``: SDPA's inputs made
    contiguous first)."""
    if _hf.implementation(module) == "eager":
        return {"eager": _eager_routed(_hf.eager_function(module), dense)}
    return {"sdpa": _sdpa_routed(_hf.attention_collector(), dense)}


def _head_dim(cfg: Any) -> int | None:
    hd = getattr(cfg, "head_dim", None)
    if isinstance(hd, int) and hd > 0:
        return hd
    hidden, heads = getattr(cfg, "hidden_size", None), getattr(cfg, "num_attention_heads", None)
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        return hidden // heads
    return None


def _strided_inputs(env: Env) -> str | None:
    """Why SDPA's inputs must be made contiguous on ``env`` (None: they need not)."""
    if env.device_type != "mps":
        return None
    v = check("sdpa_strided_correct", env)
    return None if v.ok else f"sdpa_strided_correct: {v.reason}"


def _native_kernels(env: Env) -> Verdict:
    """What this build's SDPA runs on Metal; a failing verdict where routing buys nothing."""
    full = check("metal_attention", env)
    if full.ok:
        return full
    prefill = check("sdpa_metal_prefill", env)
    if not prefill.ok:
        return Verdict(False, f"{prefill.reason}; attention fully on Metal needs torch 2.16 nightlies")
    parts = [prefill.reason]
    gqa = check("sdpa_metal_gqa", env)
    parts.append(gqa.reason if gqa.ok else f"K/V repeated before SDPA: {gqa.reason}")
    mpp = check("sdpa_mpp_attention", env)
    if mpp.ok:
        parts.append(mpp.reason)
    fix = check("sdpa_metal_macos26_fixed", env)
    if not fix.ok and (env.macos is None or env.macos[0] >= 26):
        parts.append(f"on macOS 26 without the fix: {fix.reason}")
    parts.append("attention fully on Metal only in torch 2.16 nightlies")
    return Verdict(True, "; ".join(parts), decided_by=prefill.decided_by)


def _contains(parent: torch.nn.Module, child: torch.nn.Module) -> bool:
    return any(m is child for m in parent.modules())
