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

Paths (the report names the one each layer takes): decode (at most 4 rows) on ``torch.ops.mpsboost.affine_*`` where
those operators are registered (``mpsboost.ops.affine``: mpsboost's Metal kernels on a Mac), else and for more rows
the layer dequantised per call, then the matmul (``dequantize then linear``; for experts in eager mode only the hit
experts). Irreversible: ``unpatch`` says to reload.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch

from ...gate import Env
from ...patching import is_patched_by
from ...registry import Decision, Match, Recipe, matches_class, register
from .layers import RECIPE, AffineState, QParams, affine_state, build_layer, check_params, kernels_available, quantize

__all__ = ["LowBitWeights", "LowBitOptions", "LowBitPlan"]

_PRETRAINED = ("transformers.modeling_utils.PreTrainedModel",)


@dataclass(frozen=True)
class LowBitOptions:
    bits: int = 4
    group_size: int = 64
    include_lm_head: bool = True


@dataclass(frozen=True)
class LowBitPlan:
    kind: str
    bits: int
    group_size: int
    kernel: bool


def _path(env: Env) -> tuple[bool, str]:
    """(decode on the registered kernels?, the backing text) for ``env``. On a Mac whose gate and patch-time
    self-check allow mpsboost's Metal low-bit kernels (``mpsboost.ops.affine.metal_verdict``), decode runs on them;
    elsewhere the layer is dequantised exactly (float32, rounded once) and multiplied: on the CPU and CUDA that is
    both faster and closer to MLX than the operators' reference, which rounds each weight in the scales' dtype."""
    if env.device_type == "mps" and kernels_available():
        from ...ops.affine import metal_verdict

        v = metal_verdict(env)
        if v.ok:
            return True, "affine GEMV (metal) at <= 4 rows, dequantize then matmul above"
        return False, f"dequantize then matmul (the Metal low-bit kernels: {v.reason})"
    return False, "dequantize then matmul"


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
    def decide_loaded(self, kind: str, params: dict, compute: torch.dtype, env: Env, source: str):
        kernel, backing = _path(env)
        bits = sorted({p.bits for p in params.values()})
        groups = sorted({p.group_size for p in params.values()})
        state = AffineState(kind, dict(params), compute, kernel=kernel, backing=backing, source=source)
        reason = f"{'/'.join(map(str, bits))}-bit affine, groups of {'/'.join(map(str, groups))}, from {source}"
        plan = LowBitPlan(kind, bits[0], groups[0], kernel)
        return state, Decision.apply(backing, reason, plan=plan)

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
        kernel, backing = _path(env)
        return Decision.apply(
            backing,
            f"{options.bits}-bit affine, groups of {options.group_size}",
            plan=LowBitPlan(kind, options.bits, options.group_size, kernel),
        )

    def apply(self, match: Match, decision: Decision, env: Env, options: Any):
        from ..fp8.layers import expert_weight_names

        mod, plan = match.module, decision.plan
        if is_patched_by(mod, "fp8_weights"):
            raise ValueError(
                "fp8_weights stores this layer's weights already (fp8= and low_bit_weights in one patch() call); "
                "choose one weight format"
            )
        p = QParams(plan.bits, plan.group_size)
        if match.path.endswith("shared_expert_gate"):
            p = QParams(8, 64)  # as mlx-lm's quant_predicate and quantize-at-load
        if plan.kind in ("linear", "embedding"):
            w = mod.weight.detach()
            q, s, b = quantize(w, p.bits, p.group_size)
            state = AffineState(
                plan.kind, {"weight": p}, w.dtype, kernel=plan.kernel, backing=decision.backing, source="patch()"
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
