"""low_bit_weights: MLX affine low-bit weight storage (2-8 bits, one scale and bias per group), the path of each
layer decided per device, torch build and layer.

Opt-in and lossy. Two ways in:

* ``mpsboost.from_pretrained(folder)`` of an MLX checkpoint (or of a bf16 checkpoint with ``quantize={...}``): the
  layers are built here from the file's codes (:meth:`LowBitWeights.decide_loaded`), committed through
  :func:`mpsboost.api.adopt` with the lossless recipes, one report;
* ``mpsboost.patch(model, recipes=["low_bit_weights"], options={"low_bit_weights": {"bits": 4, "group_size":
  64}})`` quantises a model in memory: every plain ``nn.Linear`` of a transformers model whose in_features is a
  multiple of the group size (the head included; routers and norms stay) and the experts' stacks; codes equal to
  ``mx.quantize``'s.

Paths (the report names the one each layer takes; the policy is :mod:`.paths`): decode (at most 4 rows) on
``torch.ops.mpsboost.affine_*`` where those operators are registered (``mpsboost.ops.affine``: mpsboost's Metal
kernels on a Mac), else and for more rows the layer dequantised per call, then the matmul (``dequantize then
linear``; for experts in eager mode only the hit experts). Irreversible: ``unpatch`` says to reload.

A dense linear on MPS may instead decode on torch's own kernels, fed from MLX's layout: ``_weight_int4pack_mm`` at
4 bits (the same codes, ``zero = bias + 8 * scale``), ``_weight_int8pack_mm`` at 8 bits where the codes are exactly
its format (one scale a row, ``bias = -128 * scale``; MLX's ordinary 8-bit groups are not, and stay). Option
``mps_kernel``: "auto" (default): where both serve a layer, on a real Mac the two are timed at the layer's decode
shape at patch time (:func:`mpsboost.ondevice.choose`, cached per chip, macOS, torch build and shape) and the Metal
GEMV is taken only where faster (a tie, a slower kernel or a timing error keeps torch's); a simulated Mac, or nothing
to time against, keeps the static choice, mpsboost's Metal GEMV. "metal": the static choice, untimed. "torch":
torch's kernel wherever it serves the layer. The layer then also holds torch's packed copy of its weight
(non-persistent buffers ``pack_weight`` and ``pack_scales``; the codes stay for longer inputs and for saving).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterator, Literal, Optional

import torch

from ...gate import Env
from ...ops.affine import torch_pack_for
from ...patching import is_patched_by
from ...registry import NOT_REPORTED, Decision, Match, Recipe, matches_class, register
from .layers import RECIPE, AffineState, QParams, affine_state, build_layer, check_params, quantize
from .paths import LayerPath, linear_path, module_path, pack_path

__all__ = ["LowBitWeights", "LowBitOptions", "LowBitPlan"]

_PRETRAINED = ("transformers.modeling_utils.PreTrainedModel",)


@dataclass(frozen=True)
class LowBitOptions:
    bits: int = 4
    group_size: int = 64
    include_lm_head: bool = True
    # A dense linear's decode on MPS: "auto" (where both mpsboost's Metal GEMV and torch's int4pack/int8pack serve
    # it, on a real Mac the faster at its shape, timed at patch time; else the Metal GEMV), "metal" (the Metal GEMV
    # untimed: the static choice), "torch" (torch's _weight_int4pack_mm / _weight_int8pack_mm wherever they serve it)
    mps_kernel: Literal["auto", "metal", "torch"] = "auto"


@dataclass(frozen=True)
class LowBitPlan:
    kind: str
    bits: int
    group_size: int
    kernel: bool
    # a dense linear's few rows on torch's "int4pack" / "int8pack" (else ""; the backing names it), and whether its
    # static choice is the Metal kernel (where a repack turns out inexact at build time)
    pack: str = field(default="", metadata=NOT_REPORTED)
    static_kernel: bool = field(default=False, metadata=NOT_REPORTED)


def _metal_or_pack(env: Env, static: LayerPath, pack: str, n: int, k: int, p: QParams, dtype: torch.dtype):
    """Where both mpsboost's Metal GEMV (``static``, the static choice) and torch's ``pack`` serve an ``[n, k]``
    linear on MPS: the faster at its decode shape on the user's Mac (:func:`mpsboost.ondevice.choose`, cached per
    chip, macOS, torch and shape); a tie, a slower Metal GEMV or a timing error keeps torch's kernel. Nothing is timed
    on a simulated Mac: the static choice, the Metal GEMV (one dispatch on the codes as stored, with MLX's own
    numerics, and no second copy of the weight)."""
    from ... import ondevice
    from ...ops import affine as affine_ops

    stock, metal = affine_ops.gemv_contenders(n, k, p.bits, p.group_size, dtype)
    choice = ondevice.choose(
        "affine_gemv",
        f"M1 N{n} K{k} {p.bits}-bit g{p.group_size} {str(dtype).removeprefix('torch.')} vs {pack}",
        env=env,
        stock=ondevice.Contender(f"torch's {pack}", stock),
        candidate=ondevice.Contender("mpsboost's Metal affine GEMV", metal),
        static=True,
    )
    if choice.taken:  # the static choice (nothing timed) keeps the reason as it was
        return static if choice.source == "static" else dataclasses.replace(static, note=choice.describe())
    return pack_path(pack, choice.describe())


def _int8_unrepresentable(w: torch.Tensor, p: QParams, dtype: torch.dtype) -> Optional[str]:
    """Why the 8-bit codes ``quantize`` gives ``w`` are not torch's int8pack's, or None (patch time, MPS, only where
    int8pack is a candidate: the weight is quantised once more for this check)."""
    from ...errors import UserInputError
    from ...ops.affine import to_int8pack

    q, s, b = quantize(w.detach(), p.bits, p.group_size)
    try:
        to_int8pack(q, s, b, p.group_size, dtype=dtype)
    except UserInputError as exc:
        return str(exc)
    return None


def _linear(
    env: Env,
    n: int,
    k: int,
    p: QParams,
    dtype: torch.dtype,
    mps_kernel: str,
    unrepresentable: Optional[str] = None,
) -> LayerPath:
    path, pack = linear_path(
        env,
        n=n,
        k=k,
        bits=p.bits,
        group_size=p.group_size,
        dtype=dtype,
        mps_kernel=mps_kernel,
        unrepresentable=unrepresentable,
    )
    return _metal_or_pack(env, path, pack, n, k, p, dtype) if pack is not None else path


def _with_note(reason: str, path: LayerPath) -> str:
    return f"{reason}; {path.note}" if path.note else reason


def _params(path: str, options: Any) -> QParams:
    """The quantisation of the layer at ``path`` (``options``: the options or the plan, with bits and group_size)."""
    if path.endswith("shared_expert_gate"):
        return QParams(8, 64)  # as mlx-lm's quant_predicate and quantize-at-load
    return QParams(options.bits, options.group_size)


@register
class LowBitWeights(Recipe):
    name = RECIPE
    summary = "MLX affine low-bit weights (2-8 bits, group scales and biases): loaded by from_pretrained or quantized"
    targets = ("torch.nn.modules.linear.Linear", "torch.nn.modules.sparse.Embedding")
    lossless = False
    reversible = False
    default = False
    order = 900
    Options = LowBitOptions

    def unpatch_hint(self) -> str:
        return "load the model again (from_pretrained, or mpsboost.from_pretrained for a low-bit folder)"

    # ------------------------------------------------------------------ loaded layers
    def decide_loaded(
        self,
        kind: str,
        params: dict,
        compute: torch.dtype,
        env: Env,
        source: str,
        *,
        shape: Optional[tuple[int, int]] = None,
        mps_kernel: str = "auto",
    ):
        """The state and decision of a layer filled from a file. ``shape`` (``[out, in]`` of a dense linear) lets a
        4-bit linear on MPS take torch's int4pack (:func:`_metal_or_pack`); without it the static path. An 8-bit
        loaded layer keeps the static path: its codes are read after the plan, and MLX's 8-bit groups each carry a
        scale and bias that int8pack cannot hold."""
        path = module_path(env)
        if kind == "linear" and shape is not None and env.device_type == "mps":
            p = params["weight"]
            why = "a loaded 8-bit layer's codes are read after the plan" if p.bits == 8 else None
            path = _linear(env, shape[0], shape[1], p, compute, mps_kernel, why)
        bits = sorted({p.bits for p in params.values()})
        groups = sorted({p.group_size for p in params.values()})
        static = module_path(env).kernel
        state = AffineState(
            kind, dict(params), compute, kernel=path.kernel, backing=path.backing, source=source, pack=path.pack
        )
        state.extra["static_kernel"] = static
        reason = f"{'/'.join(map(str, bits))}-bit affine, groups of {'/'.join(map(str, groups))}, from {source}"
        plan = LowBitPlan(kind, bits[0], groups[0], path.kernel, path.pack, static)
        return state, Decision.apply(path.backing, _with_note(reason, path), plan=plan)

    # ------------------------------------------------------------------ patch(): quantize in memory
    def find(self, root: torch.nn.Module, prefix: str = "") -> Iterator[Match]:
        from ...registry import join_path
        from ..fp8.layers import is_hf_experts

        if not matches_class(root, _PRETRAINED):
            return
        for name, mod in root.named_modules():
            if type(mod) in (torch.nn.Linear, torch.nn.Embedding) or is_hf_experts(mod):
                yield Match(mod, join_path(prefix, name))

    def decide(self, match: Match, env: Env, options: Any) -> Decision:
        try:
            check_params(options.bits, options.group_size, "low_bit_weights options")
        except ValueError as exc:
            return Decision.skip(str(exc))
        mod = match.module
        if affine_state(mod) is not None:
            return Decision.skip("stored in low bits already")
        kind = {torch.nn.Linear: "linear", torch.nn.Embedding: "embedding"}.get(type(mod), "experts")
        if kind == "embedding":
            w, k = mod.weight, mod.embedding_dim
        elif kind == "linear":
            if not options.include_lm_head and match.path.endswith("lm_head"):
                return Decision.skip("the output head stays (include_lm_head=False)")
            w = mod.weight
            k = mod.in_features
        else:
            from ..fp8.layers import expert_weight_names

            w = mod.down_proj
            k = next(
                (n for n in (getattr(mod, m).shape[-1] for m in expert_weight_names(mod)) if n % options.group_size),
                w.shape[-1],
            )
            if getattr(mod, "is_transposed", False) or getattr(mod, "has_bias", False):
                return Decision.skip("transposed or biased expert stacks are not stored in low bits yet")
        if not isinstance(w, torch.Tensor) or not w.is_floating_point():
            return Decision.skip("the weight is not a floating tensor (quantized already?)")
        if k % options.group_size:
            return Decision.skip(f"in_features {k} is not a multiple of group_size={options.group_size}")
        path = static = module_path(env)
        if kind == "linear" and env.device_type == "mps":
            p = _params(match.path, options)
            why = None
            if p.bits == 8 and options.mps_kernel != "metal":
                pack, _ = torch_pack_for(8, mod.out_features, k, p.group_size, w.dtype)
                why = _int8_unrepresentable(w, p, w.dtype) if pack == "int8pack" else None
            path = _linear(env, mod.out_features, k, p, w.dtype, options.mps_kernel, why)
        return Decision.apply(
            path.backing,
            _with_note(f"{options.bits}-bit affine, groups of {options.group_size}", path),
            plan=LowBitPlan(kind, options.bits, options.group_size, path.kernel, path.pack, static.kernel),
        )

    def apply(self, match: Match, decision: Decision, env: Env, options: Any):
        from ..fp8.layers import expert_weight_names

        mod, plan = match.module, decision.plan
        if is_patched_by(mod, "fp8_weights"):
            raise ValueError(
                "fp8_weights stores this layer's weights already (fp8= and low_bit_weights in one patch() call); "
                "choose one weight format"
            )
        p = _params(match.path, plan)
        if plan.kind in ("linear", "embedding"):
            w = mod.weight.detach()
            q, s, b = quantize(w, p.bits, p.group_size)
            state = AffineState(
                plan.kind,
                {"weight": p},
                w.dtype,
                kernel=plan.kernel,
                backing=decision.backing,
                source="patch()",
                pack=plan.pack,
                extra={"static_kernel": plan.static_kernel},
            )
            return build_layer(mod, state, {"weight": q, "scales": s, "biases": b}, f"quantize {match.path}")
        up, down = expert_weight_names(mod)
        tensors = {}
        dtype = getattr(mod, down).dtype
        for n in (up, down):
            q, s, b = quantize(getattr(mod, n).detach(), p.bits, p.group_size)
            tensors.update({n: q, f"{n}_scales": s, f"{n}_biases": b})
        state = AffineState(
            "experts", {up: p, down: p}, dtype, kernel=plan.kernel, backing=decision.backing, source="patch()"
        )
        return build_layer(mod, state, tensors, f"quantize {match.path}")
