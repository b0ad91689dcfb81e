"""The fp8 layer: one state type, one forward per module kind, one class per original class.

Every fp8 layer is built here, whether ``mpsboost.patch(model, fp8=...)`` quantised its weights or
``mpsboost.load_fp8`` read its codes from a file: the ``fp8_weights`` recipe (:mod:`.recipe`) decides the
path and builds an :class:`Fp8State` from its plan, and binds :func:`forward_for` of that state on the
instance and swaps its class to :func:`fp8_class`. ``save_fp8`` and ``print(model)`` read the same state.

Imports neither diffusers nor transformers (it reads classes by their code, not their import path), and
no recipe, registry or checkpoint module, so that the recipe and ``mpsboost.checkpoints`` can both use it.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ...errors import Fp8StateError
from ...ops import fp8 as fp8_ops
from ...ops import fp8_moe
from ...ops.fp8_block import fp8_block_experts, fp8_block_linear
from ...ops.fp8_grouped import GemvOperand, block_gemv
from ...patching import original_forward, saved_state

__all__ = [
    "RECIPE",
    "FP8_BASE_ATTR",
    "Fp8State",
    "LoadedLayer",
    "FP8Linear",
    "fp8_class",
    "fp8_state",
    "forward_for",
    "is_hf_experts",
    "expert_weight_names",
    "plain_linear",
    "weight_names",
]

# The recipe that owns every fp8 layer (its record on the instance, its report rows).
RECIPE = "fp8_weights"
# On the fp8 layer classes: the class they were made from.
FP8_BASE_ATTR = "_mpsboost_fp8_of"
_CODES = (torch.float8_e4m3fn, torch.uint8)


# ------------------------------------------------------------------------------------------ which modules


def is_hf_experts(module: torch.nn.Module) -> bool:
    """An instance of a class decorated by transformers' ``use_experts_implementation``.

    The decorator replaces the class's ``forward`` by its dispatcher in ``integrations/moe.py``
    (``functools.wraps`` keeps the original's name, not its code). Same test as moe_experts uses.
    """
    fwd = getattr(type(module), "forward", None)
    code = getattr(fwd, "__code__", None)
    if code is None:
        return False
    if os.path.normpath(code.co_filename).split(os.sep)[-2:] != ["integrations", "moe.py"]:
        return False
    qual = getattr(code, "co_qualname", "use_experts_implementation.<locals>.wrapper.<locals>.forward")
    return "use_experts_implementation" in qual and hasattr(module, "down_proj")


def expert_weight_names(module: torch.nn.Module) -> tuple[str, str]:
    """The stacked expert weights of an experts module: (``gate_up_proj`` or ``up_proj``, ``down_proj``)."""
    up = "gate_up_proj" if getattr(module, "has_gate", True) else "up_proj"
    return up, "down_proj"


def weight_names(module: torch.nn.Module) -> tuple[str, ...]:
    """The tensors an fp8 layer stores as codes: ``weight`` of a linear layer, the stacks of an experts module."""
    return ("weight",) if isinstance(module, torch.nn.Linear) else expert_weight_names(module)


def plain_linear(module: torch.nn.Module) -> bool:
    """Exactly ``torch.nn.Linear`` (subclasses such as ``MultiheadAttention``'s ``out_proj`` read their
    weight directly and are not converted), or the fp8 layer class fp8_weights swapped onto one."""
    t = type(module)
    return t is torch.nn.Linear or t.__dict__.get(FP8_BASE_ATTR) is torch.nn.Linear


# ------------------------------------------------------------------------------------------ the state


@dataclass(eq=False, slots=True)
class Fp8State:
    """What an fp8 layer's forward reads, and what ``save_fp8`` and ``print(model)`` read: one type for
    layers quantised by ``patch(fp8=...)`` and layers loaded by ``load_fp8``. Fixed when the layer is
    built (decisions are made at patch time, never in a forward), except ``converted``: it flips when
    the ``patch()`` transaction commits (a loaded layer holds its codes already, so it starts converted)."""

    # Linear layers: the path (``"fused"``, ``"mps_scaled_mm"``, ``"dequant"`` of :func:`mpsboost.ops.fp8.
    # choose_linear_path`, or ``"block"``); ``"experts"`` for an experts module.
    kind: str
    compute_dtype: torch.dtype
    granularity: str  # "rowwise", "tensorwise", "block", or "rowwise+tensorwise" (experts whose stacks differ)
    block: Optional[tuple[int, int]] = None  # the file's scale blocks (granularity "block"): applied exactly
    gemv_max_m: int = 16
    bias_in_mm: bool = False
    large: str = "dequant"  # linear, above gemv_max_m: "dequant" (exact) or "scaled_mm" (activations in fp8)
    large_path: str = "hit"  # experts: the path for many routed pairs (mpsboost.ops.fp8_moe.PATHS)
    compiled_path: str = "stack"  # experts: the traceable path a compiled forward takes instead
    gather_max: int = 0  # experts: routed pairs at or below which experts are gathered per pair
    native_grouped: bool = False
    histc_int: bool = False
    # experts: decoding (<= 4 tokens) on the gathered fp8 codes by this kernel ("scaled_mm" on MPS 2.15+, "gemv" on
    # CUDA; mpsboost.ops.fp8_moe.few_rows_experts), or "" (not)
    few_rows: str = ""
    converted: bool = False
    backing: str = ""

    def mark_converted(self) -> None:
        self.converted = True


@dataclass(frozen=True)
class LoadedLayer:
    """What ``load_fp8`` knows of one module it fills from a file, before any data is read: the fp8_weights
    recipe decides its path from this (:meth:`~mpsboost.recipes.fp8.recipe.Fp8Weights.decide_loaded`)."""

    kind: str  # "linear" or "experts"
    granularity: str  # "rowwise", "tensorwise", "block", or "rowwise+tensorwise"
    shapes: tuple[tuple[int, ...], ...]  # every fp8 tensor of the module
    compute_dtype: torch.dtype
    nbytes: int  # codes and scales
    source: str  # "<file> (<format>)", for the report's reason
    loaded_from: str
    format: str
    block: Optional[tuple[int, int]] = None
    requantized_from: Optional[tuple[int, int]] = None  # load_fp8(requantize="rowwise") of these block scales


def fp8_state(module: torch.nn.Module) -> Optional[Fp8State]:
    """The :class:`Fp8State` of an fp8 layer (converted or still pending), or None."""
    entry = saved_state(module, RECIPE)
    state = entry.get("fp8") if entry else None
    return state if isinstance(state, Fp8State) else None


def decode_operand(module: Any) -> Any:
    """What an eager decode step calls for ``module``: a :class:`mpsboost.ops.fp8_grouped.GemvOperand` where the module
    is a converted fp8 linear whose few-rows path is the fp8 GEMV (``fused``: mpsboost's Metal kernel on MPS, its
    Triton kernel on CUDA; no block scales, no bias), a :class:`mpsboost.ops.fp8.FewRowsOperand` where it is
    ``F.scaled_mm`` (MPS 2.15+ decisions without the Metal kernel: K and N multiples of 16), else ``module``
    itself (its own forward)."""
    state = fp8_state(module) if isinstance(module, torch.nn.Linear) else None
    if state is None or not state.converted:
        return module
    if state.block is not None:  # a file's block scales: the GEMV applies them where the plan chose it
        q, scale = module.weight, getattr(module, "weight_scale", None)
        if not state.few_rows or module.bias is not None or not isinstance(scale, torch.Tensor):
            return module
        return GemvOperand(module, q, scale, state.gemv_max_m, state.compute_dtype, block=state.block)
    if state.kind not in ("mps_scaled_mm", "fused"):
        return module
    q, scale = module.weight, getattr(module, "weight_scale", None)
    if module.bias is not None or not isinstance(scale, torch.Tensor) or scale.numel() not in (1, q.shape[0]):
        return module
    if state.kind == "fused":
        if q.dtype == fp8_ops.FP8_DTYPE or (q.dtype == torch.uint8 and not q.is_cuda):
            return GemvOperand(module, q, scale, state.gemv_max_m, state.compute_dtype)
        return module
    if q.dtype != fp8_ops.FP8_DTYPE:
        return module
    if not fp8_ops.few_rows_ok(q.shape[0], q.shape[1], state.compute_dtype):
        return module
    return fp8_ops.FewRowsOperand(module, q, scale, state.gemv_max_m, state.compute_dtype)


# ------------------------------------------------------------------------------------------ the forwards


def _cast_error(module: torch.nn.Module, name: str, t: torch.Tensor) -> Exception:
    return Fp8StateError(
        f"{type(module).__name__}.{name} was converted to fp8 by mpsboost but is now {t.dtype} (the model was cast "
        "with .to(dtype)/.half() after patching?). Cast the model before mpsboost.patch(..., fp8=...), or reload it."
    )


def _linear_forward(state: Fp8State) -> Callable[..., Any]:
    def forward(self, input, *args, **kwargs):
        if not state.converted:
            return original_forward(self, RECIPE)(input, *args, **kwargs)
        w = self.weight
        if w.dtype not in _CODES:
            raise _cast_error(self, "weight", w)
        if state.block is not None:
            # Block scales of the file, applied as they are: at decode inside mpsboost's Metal kernel where the
            # gate allowed it (a static fact of the shape), otherwise this layer dequantised just before its matmul.
            if state.few_rows and self.bias is None and 0 < input.numel() <= state.gemv_max_m * input.shape[-1]:
                n, k = w.shape
                y = block_gemv(input.reshape(-1, k), w, self.weight_scale, state.block[0], state.block[1])
                return y if input.dim() == 2 else y.view(*input.shape[:-1], n)
            return fp8_block_linear(
                input, w, self.weight_scale, self.bias, block=state.block, compute_dtype=state.compute_dtype
            )
        return fp8_ops.fp8_linear(
            input,
            w,
            self.weight_scale,
            self.bias,
            kind=state.kind,
            compute_dtype=state.compute_dtype,
            gemv_max_m=state.gemv_max_m,
            bias_in_mm=state.bias_in_mm,
            large=state.large,
        )

    return forward


def _rows_of(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t`` as ``[n, -1]``, without a dispatch when it is that already."""
    return t if t.dim() == 2 and t.shape[0] == n else t.reshape(n, -1)


def _experts_forward(state: Fp8State) -> Callable[..., Any]:
    def forward(self, hidden_states, *args, **kwargs):
        if not state.converted:
            return original_forward(self, RECIPE)(hidden_states, *args, **kwargs)
        # gpt-oss names its arguments router_indices / routing_weights.
        rest = list(args)
        top_k_index = rest.pop(0) if rest else kwargs.pop("top_k_index", kwargs.pop("router_indices", None))
        top_k_weights = rest.pop(0) if rest else kwargs.pop("top_k_weights", kwargs.pop("routing_weights", None))
        up_name, down_name = expert_weight_names(self)
        up_q, down_q = getattr(self, up_name), getattr(self, down_name)
        for n_, t in ((up_name, up_q), (down_name, down_q)):
            if t.dtype not in _CODES:
                raise _cast_error(self, n_, t)
        shape = hidden_states.shape
        # Reshapes only where they change a shape: on a Mac every dispatch (views too) is host time per layer.
        x = hidden_states if hidden_states.dim() == 2 else hidden_states.reshape(-1, shape[-1])
        idx = _rows_of(top_k_index, x.shape[0])
        wts = _rows_of(top_k_weights, x.shape[0])
        has_bias = bool(getattr(self, "has_bias", False))
        up_b = getattr(self, up_name + "_bias", None) if has_bias else None
        down_b = getattr(self, "down_proj_bias", None) if has_bias else None
        act = self._apply_gate if getattr(self, "has_gate", True) else self.act_fn
        if state.block is not None:
            up_s, down_s = getattr(self, up_name + "_scale"), getattr(self, down_name + "_scale")
            if state.few_rows and x.shape[0] <= fp8_ops.FEW_ROWS_MAX and up_b is None and down_b is None:
                # Decoding: mpsboost's Metal grouped GEMV, the file's block scales applied in the kernel.
                out = fp8_moe.grouped_rows_experts(
                    x,
                    idx,
                    wts,
                    up=fp8_moe.Fp8Stack(up_q, up_s),
                    down=fp8_moe.Fp8Stack(down_q, down_s),
                    activation=act,
                    block=state.block,
                )
                return out if out.shape == shape else out.reshape(shape)
            # Block scales of the file: only the hit experts dequantised, one at a time (the whole stack when traced).
            out = fp8_block_experts(
                x,
                idx,
                wts,
                up=(up_q, getattr(self, up_name + "_scale")),
                down=(down_q, getattr(self, down_name + "_scale")),
                block=state.block,
                activation=act,
                compute_dtype=state.compute_dtype,
                up_bias=up_b,
                down_bias=down_b,
            )
            return out.reshape(shape)
        tr = bool(getattr(self, "is_transposed", False))
        up = fp8_moe.Fp8Stack(up_q, getattr(self, up_name + "_scale"), tr)
        down = fp8_moe.Fp8Stack(down_q, getattr(self, down_name + "_scale"), tr)
        post = self.post_expert_norm if getattr(self, "has_post_expert_norm", False) else None
        if (
            state.few_rows
            and x.shape[0] <= fp8_ops.FEW_ROWS_MAX
            and up_b is None
            and down_b is None
            and post is None
            and x.dtype == state.compute_dtype
            and fp8_moe.few_rows_experts_ok(up, down, x.dtype, state.few_rows)
        ):
            # Decoding: static facts (shapes, dtypes, layout), the same answer for every step of a decode.
            if state.few_rows == "grouped":
                out = fp8_moe.grouped_rows_experts(x, idx, wts, up=up, down=down, activation=act)
            else:
                out = fp8_moe.few_rows_experts(
                    x, idx, wts, up=up, down=down, activation=act, key=hidden_states, kernel=state.few_rows
                )
            return out if out.shape == shape else out.reshape(shape)
        # torch.compiler.is_compiling() is a constant while dynamo traces: a compiled forward takes the
        # traceable path decided at patch time, with no host read of the expert counts.
        compiling = torch.compiler.is_compiling()
        large = state.compiled_path if compiling else state.large_path
        path = "gather" if idx.numel() <= state.gather_max else large
        if path == "scaled_grouped_mm" and not (
            x.is_cuda
            and fp8_moe.scaled_grouped_ok(up, state.compute_dtype)
            and fp8_moe.scaled_grouped_ok(down, state.compute_dtype)
        ):
            # Static facts (device, dtype, layout): the same answer at every call of this module.
            path = "stack" if compiling else "hit"
        out = fp8_moe.fp8_routed_experts(
            x,
            idx,
            wts,
            up=up,
            down=down,
            activation=act,
            compute_dtype=state.compute_dtype,
            up_bias=up_b,
            down_bias=down_b,
            post=post,
            path=path,
            native_grouped=state.native_grouped,
            histc_int=state.histc_int,
        )
        return out.reshape(shape)

    return forward


def forward_for(state: Fp8State) -> Callable[..., Any]:
    """The forward of an fp8 layer with ``state`` (to bind on the instance): one function per module kind,
    for quantised and loaded layers alike; the state says which scales and which path."""
    return _experts_forward(state) if state.kind == "experts" else _linear_forward(state)


# ------------------------------------------------------------------------------------------ the classes


def _fp8_repr(module: torch.nn.Module) -> str:
    """What ``print(model)`` shows of a converted layer: storage, granularity, scale shapes, backing path."""
    state = fp8_state(module)
    if state is None or not state.converted:
        return "fp8=pending (converted when the patch() transaction commits)"
    names = weight_names(module)
    codes = getattr(module, names[0])
    dtype = "float8_e4m3fn"
    if codes.dtype != torch.float8_e4m3fn:
        dtype = f"float8_e4m3fn codes in {str(codes.dtype).replace('torch.', '')}"
    parts = [f"fp8={dtype}", f"granularity={state.granularity}"]
    if state.block:
        parts.append(f"block={list(state.block)}")
    for n in names:
        if n != "weight":
            parts.append(f"{n}={list(getattr(module, n).shape)}")
        scale = getattr(module, n + "_scale", None)
        if scale is not None:
            parts.append(f"{n}_scale={list(scale.shape)}")
    parts.append(f"compute_dtype={str(state.compute_dtype).replace('torch.', '')}")
    parts.append(f"backing={state.backing or state.kind}")
    return ", ".join(parts)


class FP8Linear(torch.nn.Linear):
    """A ``torch.nn.Linear`` whose weight fp8_weights stores as float8_e4m3fn codes with float32 scales.

    Never constructed: fp8_weights swaps it onto a converted instance (``patching.swap_class``), so that
    ``print(model)`` shows the layer for what it is. ``isinstance(m, torch.nn.Linear)`` still holds and
    the forward is the instance's own (bound by the recipe). The conversion cannot be undone.
    """

    _mpsboost_fp8_of = torch.nn.Linear

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {_fp8_repr(self)}"


def _experts_repr(self: torch.nn.Module) -> str:
    base = super(type(self), self).extra_repr()
    return f"{base}, {_fp8_repr(self)}" if base else _fp8_repr(self)


@functools.lru_cache(maxsize=None)
def fp8_class(cls: type) -> type:
    """The fp8 layer class of ``cls``: :class:`FP8Linear` for ``torch.nn.Linear``, else one subclass per
    experts class (``FP8Qwen3MoeExperts``, ...), made once and cached."""
    if cls is torch.nn.Linear:
        return FP8Linear
    name = f"FP8{cls.__name__}"
    doc = f"{cls.__name__} with its expert weights stored in fp8 by mpsboost's fp8_weights."
    return type(
        name,
        (cls,),
        {"extra_repr": _experts_repr, FP8_BASE_ATTR: cls, "__module__": __name__, "__qualname__": name, "__doc__": doc},
    )
