"""linear_attention: transformers' Gated DeltaNet layers in few ops per decode step and per prefill chunk;
chunked prefill without ``solve_triangular`` where it is slow.

Targets: every Gated DeltaNet class of transformers 5.24 (Qwen3.5 / 3.6 MoE and dense, Qwen3-Next,
OLMo-Hybrid, LaRA-mini, Qwen4-exp), matched by class path and then checked structurally (projection
shapes, depthwise conv, gated norm, no bias, no accelerate hook): a class that drifts is skipped with
the reason. Without flash-linear-attention and causal-conv1d (CUDA/Triton only: every Mac) transformers
runs its torch reference: one layer's decode step dispatches 103 aten ops (one H200: 1.55 ms wall for
0.085 ms of kernels), host time that dominates on MPS.

Decode (one token with a cache), eager: 28 aten ops per layer instead of 103 for one sequence of
Qwen3.5/3.6 (31 for a batch; OLMo-Hybrid's six projections two more; counted on tiny models, fp32 and bf16):

- the input projections stay the model's own Parameters, each in its own storage (nothing that compares
  storages, such as transformers' tied-weight checks, save_pretrained or accelerate, sees a tie); their
  products are written side by side into one buffer, one product per Parameter (``b`` and ``a`` too);
- every weight the step reads is the module's own tensor or a view of it (projections, conv weight and
  bias, the output norm's weight, the output projection): an in-place edit, through ``.data`` too (PEFT's
  merge), is read by the next step. The gates' ``-dt_bias`` and ``exp(A_log)`` (``[Hv]`` each, float32) are
  the only copies; they are made again at every prefill (docs/known-gaps.md);
- the view of the cache's recurrent state the step reads is made once per state tensor (after the prefill),
  not once per step;
- every intermediate of the step goes into buffers the layer keeps for the current batch size and dtype
  (made after the prefill), with every view into them made once: a step dispatches arithmetic only, and
  no result's memory layout is ever assumed (the views address buffers the recipe laid out). A step that
  finds the buffers busy (another thread) and traced code allocate instead, as plain torch does;
- the conv state rolls by one ``cat`` and one copy, the depthwise conv is one multiply-sum over the new
  window's last columns and the conv's own weight (no ``conv1d`` and slice), products in float32;
- ``beta`` and the decay ``exp(g)`` come from four elementwise ops (:func:`mpsboost.ops.gated_delta.gates`);
- q/k are L2-normalised and repeated for the value heads by ``vector_norm``, ``hypot`` and one division;
- the recurrent state stays float32 in the model's own cache tensor, where stock keeps it, updated in
  place in the reference's order (decay, ``baddbmm`` for ``v - S^T k``, a rank-one update, one ``bmm``
  read for the output): stock and patched layers mix;
- on a cache that records the past (assisted decoding; transformers' deferred stop check on a Mac when the cache
  is returned) the step runs on copies and hands the new conv column and state to the cache's own calls, which
  keep what ``crop()`` rolls back to; a multi-token step there runs stock (it keeps every intermediate state);
- the gated output norm is ``vector_norm``, ``hypot``, a division and the gate's products (``sqrt(dv)``
  folded into the gate's ``addcmul``), the query's ``dk ** -0.5`` folded into its epsilon.

Decode on a Mac (fused, the default where the choice below takes it): the step after the projections is one call
of ``mpsboost::deltanet_step`` (:mod:`mpsboost.ops.deltanet_step`; its Metal kernel
:mod:`mpsboost.ops.deltanet_metal`: conv roll and silu, q/k norm, gates from the module's own ``A_log`` and
``dt_bias``, the delta rule on the cache's fp32 state in place, the gated norm; one dispatch for the 23 above): 6
aten ops per layer for one sequence, 8 for a batch, with bf16, fp8 (their decode operands) or low-bit projections
(:class:`mpsboost.recipes.low_bit.layers.AffineOperand`, written into the step's buffer by ``affine_gemv_out``).
The choice (:func:`_fused_choice`): on a real Mac the kernel is compiled, checked against the composed step and timed
against it at the layer's shapes at patch time (:func:`mpsboost.ondevice.choose`, verdict cached), and taken only if
faster; a simulated Mac takes the static choice (the cost model's: one dispatch instead of 23, no more bytes) and
times nothing; CPU and CUDA keep the composed ops. Option ``fused_step`` "auto" | "static" (the static choice, not
timed) | "off" (the composed step).

Prefill: the recipe's chunked rule (:func:`mpsboost.ops.gated_delta.chunk_gated_delta_rule`): the
projections' products side by side, and the sequential scan over 64-token chunks in five batched ops per
chunk (``bmm``/``baddbmm`` on views made once) where transformers' loop dispatches 37 (4-D ``@`` and
indexing): a 512-token prompt takes 225 aten ops per layer instead of 441 (tiny Qwen3.5-MoE), and the
difference grows with the prompt (128 chunks at 8k tokens). Its two unit lower-triangular solves per call
are ``solve_triangular`` where the gate's ``solve_triangular_fast`` says the build solves small triangular
systems at matmul speed (its verdict names the evidence), else (MPS before 2.15: about 15 ms per call)
matmuls (block doubling of the inverse, 6 levels per 64-token chunk). On the H200 proxy (Qwen3.6 shape, 40
layers, eager ``generate()``) this prefill measured faster than the stock prefill it replaced (the figures
page has the paired rounds). Option ``prefill="stock"`` keeps transformers' own.

Exactness (tested): float32 layer outputs within 1e-5 relative of stock, prefill and decode; bfloat16
relative error against a float32 reference no worse than 1.5x stock's (it is lower: the recipe keeps
q/k/v, the gates and the norm in float32 where stock rounds them to bfloat16).

Modes: eager as above. Compiled (``torch.compile`` traces the forward, as transformers' static cache
does): on MPS the same math, traced (weights read from the Parameters, decisions at trace time,
``torch.compiler.is_compiling()``); on CUDA and CPU the stock forward, since no compiled measurement
shows a gain there yet (inductor fuses stock's elementwise ops itself). CUDA with flash-linear-attention
or causal-conv1d importable: skipped, transformers runs those kernels.

Options (``options={"linear_attention": {...}}``): ``prefill`` "auto" | "matmul" | "triangular" | "stock"
("triangular": the recipe's chunked prefill with ``solve_triangular``: its projections in one buffer and a
scan of five batched ops per 64-token chunk where transformers' loop dispatches 37);
``compiled`` "auto" | "recipe" | "stock"; ``fused_step`` "auto" | "static" | "off" (above).

Compiled decoding on a Mac (opt-in, :func:`mac_compile`): transformers compiles the decode step itself
with a static cache (``generate(..., cache_implementation="static")``) on cuda, xpu, neuron and tpu only
(``_valid_auto_compile_criteria``); MPS needs ``CompileConfig._compile_all_devices``. ``mac_compile(model)``
sets that on the model's own generation config, reversibly; nothing does it by default (no Mac
measurement of the compiled mode yet).
"""

from __future__ import annotations

import importlib.util
import math
import threading
import weakref
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

import torch
import torch.nn.functional as F

from ..gate import Env, check
from ..ops import deltanet_step as dn
from ..ops import gated_delta as gd
from ..registry import Decision, Match, Recipe, class_path, option_choices, register
from ._rows import CLASS_PATH, by_class, check_row
from ._watch import Watch
from ..ops.fp8 import concat_rows
from ..ops.fp8_grouped import GemvOperand
from .fp8.layers import decode_operand as fp8_operand
from .low_bit.layers import AffineOperand, affine_state
from .low_bit.layers import decode_operand as low_bit_operand
from ..patching import (
    Changes,
    Patch,
    bind_forward,
    call_original,
    set_attr,
    set_instance_attr,
)

NAME = "linear_attention"
_STATE = "_mpsboost_linear_attention"
_TM = "transformers.models."
#: The input projections per ``DeltaNetFamily.layout``: "split" and "olmo" give the canonical row order
#: [q | k | v | z | b | a] directly; Qwen3-Next ("qkvz") interleaves per key head and is gathered into it by one
#: index_select. The widths of each are :attr:`_Layout.widths`.
_LAYOUT_PROJECTIONS = {"split": 4, "qkvz": 2, "olmo": 6}


@dataclass(frozen=True)
class DeltaNetFamily:
    """One Gated DeltaNet class: one row of :data:`FAMILIES`. The class is a dotted path; the rest are the
    names of the layer's submodules the recipe reads."""

    cls: str = field(metadata=CLASS_PATH)  # the Gated DeltaNet class (a target of the recipe)
    layout: Literal["split", "qkvz", "olmo"]  # the projections' row order (see _LAYOUT_PROJECTIONS)
    proj: tuple[str, ...]  # the input projections (bias-free nn.Linear), in that row order
    norm: str = "norm"  # the silu-gated output RMS norm
    out: str = "out_proj"  # the output projection

    def __post_init__(self) -> None:
        check_row(self)
        names = (*self.proj, self.norm, self.out)
        bad = [n for n in names if not n.isidentifier()]
        if bad:
            raise ValueError(f"DeltaNetFamily row {self.cls!r}: {bad[0]!r} is not an attribute name (proj, norm, out)")
        want = _LAYOUT_PROJECTIONS[self.layout]
        if len(self.proj) != want:
            raise ValueError(
                f"DeltaNetFamily row {self.cls!r}: field proj names {len(self.proj)} projections {self.proj}; "
                f"layout {self.layout!r} has {want}"
            )


_SPLIT = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")

#: Every Gated DeltaNet class the recipe serves (its targets, in this order). A new class is one row here, plus
#: its tiny model in ``FAMILIES`` of tests/recipes/test_linear_attention.py (tiny_models.gated_deltanet_lm).
FAMILIES: tuple[DeltaNetFamily, ...] = (
    DeltaNetFamily(_TM + "qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeGatedDeltaNet", "split", _SPLIT),
    DeltaNetFamily(_TM + "qwen3_5.modeling_qwen3_5.Qwen3_5GatedDeltaNet", "split", _SPLIT),
    DeltaNetFamily(_TM + "lara_mini.modeling_lara_mini.LaraMiniGatedDeltaNet", "split", _SPLIT),
    DeltaNetFamily(_TM + "qwen4_exp.modeling_qwen4_exp.Qwen4ExpTextGatedDeltaNet", "split", _SPLIT),
    DeltaNetFamily(
        _TM + "qwen3_next.modeling_qwen3_next.Qwen3NextGatedDeltaNet", "qkvz", ("in_proj_qkvz", "in_proj_ba")
    ),
    DeltaNetFamily(
        _TM + "olmo_hybrid.modeling_olmo_hybrid.OlmoHybridGatedDeltaNet",
        "olmo",
        ("q_proj", "k_proj", "v_proj", "g_proj", "b_proj", "a_proj"),
        norm="o_norm",
        out="o_proj",
    ),
)
_FAMILIES: dict[str, DeltaNetFamily] = by_class(FAMILIES, "cls")
_SILU = ("silu", "swish")
_QK_EPS = 1e-6  # transformers' l2norm epsilon (aligned with flash-linear-attention)


@dataclass(frozen=True)
class LinearAttentionOptions:
    """``options={"linear_attention": {...}}`` (see the module docstring)."""

    prefill: Literal["auto", "matmul", "triangular", "stock"] = "auto"
    compiled: Literal["auto", "recipe", "stock"] = "auto"
    fused_step: Literal["auto", "static", "off"] = "auto"


_CHOICES = {name: option_choices(LinearAttentionOptions, name) for name in ("prefill", "compiled", "fused_step")}


@dataclass(frozen=True)
class LinearAttentionPlan:
    """What one Gated DeltaNet layer gets: its ``family`` (its row's ``DeltaNetFamily.layout``), the prefill
    path (``"matmul"``: chunked, matmul triangular inverse; ``"stock"``) and what runs while torch.compile
    traces (``"recipe"``: the recipe's forward; ``"stock"``: the module's own)."""

    family: str
    prefill: str
    compiled: str
    fused: bool = False  # the decode step after the projections is mpsboost::deltanet_step (else composed)


@register
class LinearAttention(Recipe):
    name = NAME
    summary = (
        "Gated DeltaNet layers: a few-op decode step on per-layer buffers; a chunked prefill in few ops per "
        "chunk, its triangular solves by matmuls where solve_triangular is slow"
    )
    targets = tuple(_FAMILIES)
    lossless = True
    reversible = True
    requires = ()
    default = True
    order = 100
    Options = LinearAttentionOptions

    def decide(self, match: Match, env: Env, options: LinearAttentionOptions) -> Decision:
        for key, allowed in _CHOICES.items():
            if getattr(options, key) not in allowed:
                raise ValueError(f"{NAME} option {key!r} must be one of {allowed}, got {getattr(options, key)!r}")
        lay = _layout(match.module)
        if isinstance(lay, str):
            return Decision.skip(lay)
        if env.device_type == "cuda":
            found = _fast_path_packages()
            if found:
                return Decision.skip(
                    f"{' and '.join(found)} importable: transformers runs those CUDA kernels "
                    "(is_fast_path_available); the recipe steps aside"
                )
        solve = check("solve_triangular_fast", env)
        prefill = options.prefill if options.prefill != "auto" else ("triangular" if solve.ok else "matmul")
        compiled = (
            options.compiled if options.compiled != "auto" else ("recipe" if env.device_type == "mps" else "stock")
        )
        backing = "projections into one buffer, recurrent step in fp32"
        backing += {
            "matmul": "; prefill chunked, matmul triangular inverse",
            "triangular": "; prefill chunked, solve_triangular",
            "stock": "; prefill stock (solve_triangular)",
        }[prefill]
        why = [
            (
                "eager decode: projections, conv roll, gates and state update in few ops on per-layer buffers "
                "(stock: 103 aten ops per step); "
                f"prefill: {'forced by options' if options.prefill != 'auto' else solve.reason}"
            )
        ]
        if compiled == "recipe":
            why.append(
                "compiled: the recipe's forward, traced (weights read from the Parameters)"
                + (
                    "; solve_triangular is slow on this build under compile too"
                    if env.device_type == "mps" and prefill == "matmul"
                    else ""
                )
            )
        else:
            why.append("compiled: stock forward (inductor fuses it; no compiled measurement of the recipe's path yet)")
        fused, fused_why = _fused_choice(match.module, lay, env, options.fused_step)
        if fused:
            backing += "; decode step mpsboost::deltanet_step (Metal, 1 dispatch)"
        why.append(fused_why)
        return Decision.apply(
            backing,
            "; ".join(why),
            plan=LinearAttentionPlan(family=lay.family, prefill=prefill, compiled=compiled, fused=fused),
        )

    def apply(self, match: Match, decision: Decision, env: Env, options: LinearAttentionOptions) -> Patch:
        mod = match.module
        lay = _layout(mod)
        if isinstance(lay, str):
            raise RuntimeError(f"{class_path(type(mod))} changed between plan and apply: {lay}")
        with Changes() as ch:
            plan: LinearAttentionPlan = decision.plan
            state = _State(lay, plan.prefill, plan.compiled, plan.fused)
            ch.add(set_instance_attr(mod, NAME, _STATE, state))
            ch.add(bind_forward(mod, NAME, _forward))
            _eager_derived(mod, state)  # now, not inside the first decode step
        return ch.patch(description=f"{NAME}: restore forward")


@dataclass(frozen=True)
class _Layout:
    family: str  # the row's layout: "split", "qkvz" or "olmo"
    hk: int
    hv: int
    dk: int
    dv: int
    width: int  # conv kernel
    hidden: int
    beta_scale: float  # 2.0 where the model allows negative eigenvalues (OLMo-Hybrid option), else 1.0
    norm_eps: float
    row: DeltaNetFamily  # its family's row: the names of its projections, norm and output projection

    @property
    def r(self) -> int:
        return self.hv // self.hk

    @property
    def conv_dim(self) -> int:
        return 2 * self.hk * self.dk + self.hv * self.dv

    @property
    def widths(self) -> tuple[int, ...]:
        kd, vd, hv = self.hk * self.dk, self.hv * self.dv, self.hv
        return {
            "split": (2 * kd + vd, vd, hv, hv),
            "qkvz": (2 * kd + 2 * vd, 2 * hv),
            "olmo": (kd, kd, vd, vd, hv, hv),
        }[self.family]

    @property
    def n(self) -> int:
        return sum(self.widths)


class _State:
    """What the recipe keeps on one patched layer (an instance attribute, never module-level): the layout,
    the decisions, the eager decode constants (rebuilt when a weight moves or changes) and the eager decode
    step's buffers (one batch size and dtype at a time)."""

    def __init__(self, layout: _Layout, prefill: str, compiled: str, fused: bool = False):
        self.layout = layout
        self.prefill = prefill  # "matmul", "triangular" or "stock"
        self.compiled = compiled  # "recipe" or "stock"
        self.fused = fused  # decode step after the projections: mpsboost::deltanet_step (else composed)
        self.watch: Watch | None = None
        self.derived: dict[str, Any] | None = None
        self.work: _Work | None = None
        self.lock = threading.Lock()  # the buffers serve one step at a time; a concurrent step allocates its own

    def remember(self, derived: dict[str, Any], watch: Watch) -> None:
        self.derived, self.watch, self.work = derived, watch, None

    def forget(self) -> None:
        """Drop the decode constants and buffers (the layer runs the stock forward until they can be rebuilt)."""
        self.derived = self.watch = self.work = None

    def __getstate__(self) -> dict[str, Any]:  # copy.deepcopy / pickle of a patched model: no lock, no buffers
        return {k: v for k, v in self.__dict__.items() if k not in ("lock", "work", "watch")}

    def __setstate__(self, st: dict[str, Any]) -> None:
        for k, v in st.items():
            setattr(self, k, v)
        self.lock, self.work, self.watch = threading.Lock(), None, None


# ---------------------------------------------------------------------------- structure


def _family(mod: torch.nn.Module) -> DeltaNetFamily | None:
    return next((_FAMILIES[class_path(c)] for c in type(mod).__mro__ if class_path(c) in _FAMILIES), None)


def _plain_linear(m: Any, n_in: int, n_out: int) -> str | None:
    if not isinstance(m, torch.nn.Linear) or type(m).forward is not torch.nn.Linear.forward:
        return f"{type(m).__name__} is not a plain nn.Linear"
    if m.bias is not None:
        return "has a bias"
    w = m.weight
    if not isinstance(w, torch.nn.Parameter) or not w.is_floating_point() or tuple(w.shape) != (n_out, n_in):
        return (
            f"weight {getattr(w, 'dtype', type(w).__name__)} {tuple(getattr(w, 'shape', ()))}, "
            f"expected floating ({n_out}, {n_in})"
        )
    return None


def _stored_linear(m: Any, n_in: int, n_out: int) -> bool:
    """A bias-free ``nn.Linear`` of the right shape whose weight another recipe stores in its own format
    (mpsboost's fp8 layers: codes and scales as buffers): the recipe calls the layer's own forward for it."""
    return (
        isinstance(m, torch.nn.Linear)
        and getattr(m, "bias", None) is None
        and (m.in_features, m.out_features) == (n_in, n_out)
        and isinstance(getattr(m, "weight", None), torch.Tensor)
        and not isinstance(m.weight, torch.nn.Parameter)
        and (tuple(m.weight.shape) == (n_out, n_in) or affine_state(m) is not None)  # low-bit codes: [N, K * bits / 32]
    )


def _decode_operand(m: Any) -> Any:
    """What the eager decode step calls for a stored projection: the fp8 layer's decode operand, the low-bit
    layer's (:class:`mpsboost.recipes.low_bit.layers.AffineOperand`), else the module itself."""
    op = fp8_operand(m)
    return low_bit_operand(m) if op is m else op


class _PlainOperand:
    """Plain projections among stored ones (the published Qwen3.6-FP8 keeps ``in_proj_b``/``in_proj_a`` in bf16
    beside fp8 ``in_proj_qkv``/``in_proj_z``), called like their decode operands: the product written into the
    caller's columns by one ``mm`` (``bmm`` for a ``[1, 1, K]`` input, as the bf16 step does) on the transposed
    weight (a view: in-place edits are read by the next step). An eager constant, rebuilt with the others when
    a weight is replaced or moved."""

    __slots__ = ("layers", "wt", "wt3")
    writes_out = True

    def __init__(self, layers: list[torch.nn.Linear]):
        self.layers = layers
        w = [m.weight.detach() for m in layers]
        self.wt = (w[0] if len(w) == 1 else torch.cat(w)).t()
        self.wt3 = self.wt.unsqueeze(0)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if x.dtype != self.wt.dtype or not (x.dim() == 2 or (x.dim() == 3 and x.shape[0] == 1)):
            y = torch.cat([m(x) for m in self.layers], dim=-1)
            return y if out is None else out.copy_(y.view(out.shape))
        if x.dim() == 3:
            return torch.bmm(x, self.wt3, out=out)
        return torch.mm(x, self.wt, out=out)


def _plain(m: Any) -> bool:
    return isinstance(getattr(m, "weight", None), torch.nn.Parameter) and getattr(m, "bias", None) is None


def _operands(mods: list[Any], widths: tuple[int, ...], fuse_last: bool) -> tuple[list[Any], list[int]]:
    """What the eager decode step calls for each projection when some are stored (fp8): each fp8 layer's decode
    operand, each plain linear's :class:`_PlainOperand`, with the last two (``b`` and ``a``) side by side in one
    operand where ``fuse_last`` and both are fp8 rowwise/tensorwise (one copy of their codes and scales,
    :func:`mpsboost.ops.fp8.concat_rows`: a few KiB, one dispatch; mpsboost's own fp8 buffers, see
    docs/known-gaps.md). Two plain ones stay two products on their own weights. Returns the operands and the
    width of each one's product."""
    ops = [_PlainOperand([m]) if _plain(m) else _decode_operand(m) for m in mods]
    widths = list(widths)
    if not fuse_last or len(mods) < 2:
        return ops, widths
    (m1, m2), (o1, o2) = mods[-2:], ops[-2:]
    # Two plain b/a layers stay two products on their own weights (a fused copy would miss in-place edits).
    if (
        isinstance(o1, GemvOperand)
        and isinstance(o2, GemvOperand)
        and o1.block is None
        and o2.block is None
        and (o1.q.dtype, o1.dtype, o1.max_rows) == (o2.q.dtype, o2.dtype, o2.max_rows)
    ):
        q, scale = concat_rows([(o1.q, o1.scale), (o2.q, o2.scale)])

        def both(x: torch.Tensor, m1: Any = m1, m2: Any = m2) -> torch.Tensor:
            return torch.cat((m1(x), m2(x)), dim=-1)

        fused = GemvOperand(both, q, scale, o1.max_rows, o1.dtype)
        return ops[:-2] + [fused], widths[:-2] + [widths[-2] + widths[-1]]
    if isinstance(o1, AffineOperand):  # two low-bit b/a layers of one format: one product (a copy of their codes)
        both = o1.beside(o2)
        if both is not None:
            return ops[:-2] + [both], widths[:-2] + [widths[-2] + widths[-1]]
    return ops, widths


def _linear_kind(m: Any, n_in: int, n_out: int) -> str:
    """ "plain", "stored" (see :func:`_stored_linear`) or why the recipe cannot use the layer."""
    why = _plain_linear(m, n_in, n_out)
    return "plain" if why is None else "stored" if _stored_linear(m, n_in, n_out) else why


def _layout(mod: torch.nn.Module) -> _Layout | str:
    """The layer's layout, or why the recipe cannot rely on it."""
    row = _family(mod)
    if row is None:
        return f"{class_path(type(mod))} is not a known Gated DeltaNet class"
    try:
        ints = [
            int(getattr(mod, a))
            for a in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "conv_kernel_size", "hidden_size")
        ]
    except (AttributeError, TypeError, ValueError) as e:
        return f"missing or non-integer layout attribute ({e})"
    hk, hv, dk, dv, width, hidden = ints
    if min(ints) < 1 or hv % hk:
        return f"value heads {hv} are not a multiple of key heads {hk}"
    if getattr(mod, "activation", None) not in _SILU:
        return f"conv activation {getattr(mod, 'activation', None)!r}; the recipe implements silu"
    norm = getattr(mod, row.norm, None)
    if (
        getattr(norm, "activation", None) not in _SILU
        or not isinstance(getattr(norm, "variance_epsilon", None), (int, float))
        or tuple(getattr(getattr(norm, "weight", None), "shape", ())) != (dv,)
    ):
        return f"gated norm {type(norm).__name__} is not silu-gated RMSNorm of width {dv}"
    layout = _Layout(
        row.layout,
        hk,
        hv,
        dk,
        dv,
        width,
        hidden,
        2.0 if getattr(mod, "allow_neg_eigval", False) else 1.0,
        float(norm.variance_epsilon),
        row,
    )
    conv = getattr(mod, "conv1d", None)
    c = layout.conv_dim
    if (
        not isinstance(conv, torch.nn.Conv1d)
        or conv.groups != c
        or tuple(conv.weight.shape) != (c, 1, width)
        or tuple(conv.padding) != (width - 1,)
        or tuple(conv.stride) != (1,)
        or tuple(conv.dilation) != (1,)
    ):
        return f"conv1d is not a depthwise causal Conv1d over {c} channels with kernel {width}"
    params = []
    for name, rows in zip(row.proj, layout.widths):
        kind = _linear_kind(getattr(mod, name, None), hidden, rows)
        if kind not in ("plain", "stored"):
            return f"{name}: {kind}"
        if kind == "plain":
            params.append(getattr(mod, name).weight)
    kind = _linear_kind(getattr(mod, row.out, None), hv * dv, hidden)
    if kind not in ("plain", "stored"):
        return f"{row.out}: {kind}"
    if len({(p.dtype, p.device) for p in params}) > 1 or len({id(p) for p in params}) != len(params):
        return "input projections differ in dtype or device, or share a weight"
    for pname in ("A_log", "dt_bias"):
        p = getattr(mod, pname, None)
        if not isinstance(p, torch.Tensor) or tuple(p.shape) != (hv,):
            return f"{pname} is not a [{hv}] tensor"
    hooked = [n for n, m in mod.named_modules() if "_hf_hook" in m.__dict__]
    if hooked or "forward" in mod.__dict__:
        return (
            "accelerate hooks move weights per call ("
            + ", ".join(n or "<layer>" for n in hooked)
            + "): a fused storage would be rebuilt every step"
            if hooked
            else "forward already wrapped on this instance; left alone"
        )
    return layout


def _proj_params(mod: torch.nn.Module, layout: _Layout) -> list[torch.nn.Parameter]:
    return [getattr(mod, n).weight for n in layout.row.proj]


# ---------------------------------------------------------------------------- derived tensors


def _qkvz_perm(lay: _Layout, device: torch.device) -> torch.Tensor:
    """Qwen3-Next's interleaved [qkvz | ba] rows gathered into the canonical [q | k | v | z | b | a]."""
    hk, r, dk, dv = lay.hk, lay.r, lay.dk, lay.dv
    w = 2 * dk + 2 * r * dv
    g = torch.arange(hk).view(hk, 1)
    q = (g * w + torch.arange(dk)).flatten()
    k = (g * w + dk + torch.arange(dk)).flatten()
    v = (g * w + 2 * dk + torch.arange(r * dv)).flatten()
    z = (g * w + 2 * dk + r * dv + torch.arange(r * dv)).flatten()
    off = hk * w
    b = (off + g * 2 * r + torch.arange(r)).flatten()
    a = (off + g * 2 * r + r + torch.arange(r)).flatten()
    return torch.cat((q, k, v, z, b, a)).to(device)


def _gate_consts(mod: torch.nn.Module, lay: _Layout, eager: bool) -> dict[str, torch.Tensor]:
    """``z_bias`` = ``[0, -dt_bias]`` and ``e_mult`` = ``[1, exp(A_log)]`` per value head, float32
    (:func:`mpsboost.ops.gated_delta.gates`): the only eager constants that are copies of a weight (a
    negation and an exponential no view expresses; computing them in the step would cost two ops of the
    28). Eager mode rebuilds them when the Watch sees a change and at every other eager call with a cache
    (a prefill), so that an edit through ``.data`` (which moves neither the version nor the data pointer)
    is followed from the next prompt on (docs/known-gaps.md)."""
    dt, a_log = mod.dt_bias, mod.A_log
    if eager:
        dt, a_log = dt.detach(), a_log.detach()
    dtf, alf = dt.to(torch.float32), a_log.to(torch.float32)
    hk, r = lay.hk, lay.r
    return {
        "z_bias": torch.stack((torch.zeros_like(dtf), -dtf), dim=-1).view(hk, r, 2),
        "e_mult": torch.stack((torch.ones_like(alf), torch.exp(alf)), dim=-1).view(hk, r, 2),
    }


def _derive(mod: torch.nn.Module, lay: _Layout, eager: bool) -> dict[str, Any]:
    """The constants of the decode step, from the layer's current weights. Eager mode keeps them until a
    weight changes; traced code builds them inside the graph (no state read).

    The input projections stay the model's own Parameters (each its own storage: nothing that compares
    storages, such as transformers' tied-weight checks or safetensors, sees a tie). Eager decoding writes
    their products side by side into one buffer, each from its Parameter (the two tiny ``b``/``a``
    projections too: two products, no fused copy). Every weight the step reads is the module's own tensor or
    a view of it (projections, conv weight and bias, the output norm's weight, the output projection), so
    that any in-place edit, through ``.data`` too, is seen by the next step; only the gates' two per-head
    constants are copies (:func:`_gate_consts`)."""
    dev = mod.A_log.device
    f32 = torch.float32
    r = lay.r
    conv = mod.conv1d
    mods = [getattr(mod, n) for n in lay.row.proj]
    out_mod = getattr(mod, lay.row.out)
    # A projection stored by another recipe (fp8 codes and scales) runs its own forward: its codes stay where
    # that recipe put them (concatenating them would copy them, sharing one storage would read as a tie).
    stored = any(_stored_linear(m, lay.hidden, w) for m, w in zip(mods, lay.widths))
    # Each product from the Parameter itself (a view): an in-place edit of a weight, ``.data`` included, is
    # what the next step multiplies by.
    weights = [] if stored else _proj_params(mod, lay)
    if eager and not stored:
        weights = [w.detach() for w in weights]
    d: dict[str, Any] = {
        **_gate_consts(mod, lay, eager),
        "z_sign": torch.tensor([1.0, -1.0], dtype=f32, device=dev),
        "e_add": torch.tensor([math.log(lay.beta_scale), 0.0], dtype=f32, device=dev),
        # sqrt(eps) of transformers' l2norm, one row per value head: normalising repeats the key heads
        "qk_eps": torch.full((r, 1, 1), math.sqrt(_QK_EPS), dtype=f32, device=dev),
        # The query's dk ** -0.5 is folded into the output norm's epsilon (gd.gated_rms_norm).
        "norm_eps": torch.tensor(math.sqrt(lay.norm_eps * lay.dk * lay.dv), dtype=f32, device=dev),
        # The norm's own weight (gd.gated_rms_norm scales the gate's product by sqrt(dv) in the same op).
        "norm_w": getattr(mod, lay.row.norm).weight,
        "zero": torch.zeros((), dtype=f32, device=dev),
        # The fused step (mpsboost::deltanet_step) reads the module's own A_log and dt_bias at every step.
        "dt_bias": mod.dt_bias,
        "a_log": mod.A_log,
        # The conv's own weight and bias, views: the multiply-sum runs over the window's last W columns, its
        # products in float32 in any model dtype (gd.conv_roll: acc + tail * w, no cast op).
        "conv_w": conv.weight.squeeze(1),
        "conv_b": conv.bias,
        "acc": torch.zeros(1, dtype=f32, device=dev),
        "out_w": None if _stored_linear(out_mod, lay.hv * lay.dv, lay.hidden) else out_mod.weight,
        "out_mod": _decode_operand(out_mod) if eager else out_mod,
        "proj": weights,
        "proj_mods": mods if stored else None,
        "perm": _qkvz_perm(lay, dev) if lay.family == "qkvz" else None,
    }
    if eager and stored:
        ops, d["proj_widths"] = _operands(mods, lay.widths, lay.family != "qkvz")
        d["proj_mods"] = ops
    if eager:
        for k in ("norm_w", "conv_w", "conv_b", "out_w", "dt_bias", "a_log"):
            d[k] = None if d[k] is None else d[k].detach()
        d["proj_t"] = [w.t() for w in weights]  # [hidden, n]: mm operands
        d["proj_t3"] = [w.unsqueeze(0) for w in d["proj_t"]]  # [1, hidden, n]: bmm operands (one sequence)
        d["out_t"] = None if d["out_w"] is None else d["out_w"].t()
        d["out_t3"] = None if d["out_t"] is None else d["out_t"].unsqueeze(0)
    return d


def _watch(mod: torch.nn.Module, lay: _Layout) -> Watch:
    """Where and at which version every tensor the decode constants come from is (host-side metadata only,
    resolved once; eager mode alone checks it)."""
    names = (*lay.row.proj, "conv1d", lay.row.out, lay.row.norm)
    attrs = ("weight", "bias", "weight_scale", "scales", "biases")  # fp8's scale, low-bit's scales and biases
    return Watch(mod, [(n, a) for n in names for a in attrs] + [("A_log",), ("dt_bias",)])


def _eager_derived(mod: torch.nn.Module, state: _State) -> dict[str, Any] | None:
    """The eager decode constants, rebuilt when a weight moved or was written to since; None when the
    projections are no longer plain linears of one dtype and device (stock forward then)."""
    lay = state.layout
    if state.derived is not None and state.watch is not None and state.watch.fresh():
        return state.derived
    linears = [(getattr(mod, name, None), lay.hidden, rows) for name, rows in zip(lay.row.proj, lay.widths)]
    linears.append((getattr(mod, lay.row.out, None), lay.hv * lay.dv, lay.hidden))
    kinds = [_linear_kind(*x) for x in linears]
    plain = [m.weight for (m, _, _), k in zip(linears, kinds) if k == "plain"]
    if any(k not in ("plain", "stored") for k in kinds) or len({(w.dtype, w.device) for w in plain}) > 1:
        state.forget()  # e.g. weights replaced by something that is no linear any more
        return None
    with torch.no_grad():
        derived = _derive(mod, lay, eager=True)
    state.remember(derived, _watch(mod, lay))
    return state.derived


# ---------------------------------------------------------------------------- the decode step


def _specs(lay: _Layout, b: int) -> dict[str, tuple[str, tuple[int, ...], tuple[int, ...], int]]:
    """Every view the decode step reads: name -> (the tensor it views, size, stride, storage offset). All
    of them address fresh contiguous results (or the buffers that stand for them) in the canonical order."""
    hk, hv, r, dk, dv, c, n, w = lay.hk, lay.hv, lay.r, lay.dk, lay.dv, lay.conv_dim, lay.n, lay.width
    kd, vd, bh = hk * dk, hv * dv, b * hv
    one = b == 1  # one sequence: batch and heads merge (v, beta and the output norm read [B*H, ...])
    specs = {
        "x": ("y", (b, c, 1), (n, 1, 1), 0),
        "ba": ("y", (b, hk, r, 2), (n, r, 1, hv), 2 * kd + 2 * vd),
        "z": ("y", (b, hv, 1, dv), (n, dv, dv, 1), 2 * kd + vd),
        "tail": ("win", (b, c, w), (c * (w + 1), w + 1, 1), 1),
        "qk": ("qkv", (b, hk, 1, 2, dk), (c, dk, dk, kd, 1), 0),
        "v": ("qkv", (bh, 1, dv) if one else (b, hv, 1, dv), (dv, dv, 1) if one else (c, dv, dv, 1), 2 * kd),
        "k_row": ("kq", (bh, 1, dk), (2 * dk, dk, 1), dk),
        "q_row": ("kq", (bh, 1, dk), (2 * dk, dk, 1), 0),
        "k_col": ("kq", (b, hv, dk, 1), (hv * 2 * dk, 2 * dk, 1, 1), dk),
        "beta": ("e", (bh, 1, 1) if one else (b, hv, 1, 1), (2, 1, 1) if one else (2 * hv, 2, 1, 1), 0),
        "decay": ("e", (b, hv, 1, 1), (2 * hv, 2, 1, 1), 1),
        "o4": ("o", (b, hv, 1, dv), (hv * dv, dv, dv, 1), 0),
        "out_in": ("out", (1, 1, vd) if one else (b, vd), (vd, vd, 1) if one else (vd, 1), 0),
    }
    if not one:
        specs["u4"] = ("u", (b, hv, 1, dv), (hv * dv, dv, dv, 1), 0)
    return specs


def _view(spec: tuple[str, tuple[int, ...], tuple[int, ...], int], t: torch.Tensor) -> torch.Tensor:
    _, size, stride, offset = spec
    t = t.contiguous()  # a no-op on the fresh results it is given; never reads a strided result as contiguous
    if not torch.compiler.is_compiling():  # traced: fresh results start their storage (dynamo has no offsets)
        offset += t.storage_offset()
    return t.as_strided(size, stride, offset)


class _Work:
    """The eager decode step's buffers for one batch size and dtype, and every view into them, made once:
    a step then dispatches its arithmetic only (no allocation, no view op besides the state's own)."""

    def __init__(self, lay: _Layout, d: dict[str, Any], b: int, dtype: torch.dtype, conv_dtype: torch.dtype):
        dev = d["conv_w"].device
        f32 = torch.float32
        hv, dv, c = lay.hv, lay.dv, lay.conv_dim
        self.key = (b, dtype, conv_dtype)
        with torch.inference_mode(False):  # usable inside and outside inference mode
            e = partial(torch.empty, device=dev)
            bufs = {
                "y": e(b, lay.n, dtype=dtype),
                "win": e(b, c, lay.width + 1, dtype=conv_dtype),
                "qkv": e(b, c, dtype=f32),
                "kq": e(b, lay.hk, lay.r, 2, lay.dk, dtype=f32),
                "e": e(b, lay.hk, lay.r, 2, dtype=f32),
                "o": e(b * hv, 1, dv, dtype=f32),
                "out": e(b, hv, 1, dv, dtype=dtype),
            }
            if b > 1:
                bufs["u"] = e(b * hv, 1, dv, dtype=f32)
            raw = e(b, sum(lay.widths), dtype=dtype) if d["perm"] is not None else bufs["y"]
            self.raw = raw if d["perm"] is not None else None
            slots, start = [], 0
            for w in d["proj"]:  # each projection's product lands in its columns of y (or of the raw product)
                rows = w.shape[0]
                slots.append(raw[:, start : start + rows].unsqueeze(1) if b == 1 else raw[:, start : start + rows])
                start += rows
            self.slots = slots
            self.y2 = raw if b > 1 else raw.view(1, 1, raw.shape[-1])  # cat's target: the shape of its pieces
            # Stored projections whose decode operand writes into a buffer (mpsboost's fp8 GEMV): their columns.
            self.mod_slots = None
            if d["proj_mods"] is not None and all(getattr(m, "writes_out", False) for m in d["proj_mods"]):
                self.mod_slots, start = [], 0
                for rows in d["proj_widths"]:  # one sequence: [1, 1, n] slots for the [1, 1, K] input, as bf16's
                    slot = raw[:, start : start + rows]
                    self.mod_slots.append(slot.unsqueeze(1) if b == 1 else slot)
                    start += rows
            self.bufs = bufs
            self.views = {name: _view(spec, bufs[spec[0]]) for name, spec in _specs(lay, b).items()}
        self.state_shape = (b * hv, lay.dk, dv)
        self._rec: tuple[weakref.ref, int, torch.Size, torch.Tensor] | None = None

    def state3(self, rec: torch.Tensor) -> torch.Tensor:
        """``rec`` (the cache's recurrent state ``[B, H, dk, dv]``, updated in place step after step) as
        ``[B * H, dk, dv]``: the view made once per state tensor, not once per step (one dispatch fewer).
        Held while that tensor lives (a weak reference; the view is dropped with it): the same object with the
        same data pointer and shape is the same memory."""
        c = self._rec
        if c is not None and c[0]() is rec and c[1] == rec.data_ptr() and c[2] == rec.shape:
            return c[3]
        v = rec.view(self.state_shape)
        self._rec = (weakref.ref(rec, self._drop), rec.data_ptr(), rec.shape, v)
        return v

    def _drop(self, ref: weakref.ref) -> None:
        if self._rec is not None and self._rec[0] is ref:
            self._rec = None


def _decode(
    mod: torch.nn.Module,
    lay: _Layout,
    d: dict[str, Any],
    hs: torch.Tensor,
    conv_state: torch.Tensor,
    rec: torch.Tensor,
    work: _Work | None,
) -> torch.Tensor:
    """One token. With ``work`` (eager) every intermediate goes into its buffers and every view is ready;
    without (traced, or a concurrent step) the same ops allocate and the views are taken of their results."""
    b = hs.shape[0]
    specs = _specs(lay, b)
    if work is not None:
        bufs, views = work.bufs, work.views
        x = hs if b == 1 else hs.reshape(b, lay.hidden)
        if work.mod_slots is not None:  # stored projections by the fp8 GEMV: each writes its own columns
            for m, slot in zip(d["proj_mods"], work.mod_slots):
                m(x, out=slot)
        elif d["proj_mods"] is not None:  # stored projections: each layer's own forward, side by side
            torch.cat([m(x) for m in d["proj_mods"]], dim=-1, out=work.raw if d["perm"] is not None else work.y2)
        else:
            for wt, slot in zip(d["proj_t3"] if b == 1 else d["proj_t"], work.slots):
                (torch.bmm if b == 1 else torch.mm)(x, wt, out=slot)
        y = bufs["y"]
        if d["perm"] is not None:
            torch.index_select(work.raw, -1, d["perm"], out=y)
    else:
        bufs, views = {}, {}
        y = _project(lay, d, hs.reshape(b, lay.hidden))

    def v(name: str, t: torch.Tensor) -> torch.Tensor:
        return views[name] if work is not None else _view(specs[name], t)

    if getattr(mod.__dict__.get(_STATE), "fused", False):  # the whole step after the projections: one call
        out = bufs["out"] if work is not None else hs.new_empty(b, lay.hv, 1, lay.dv)
        dn.deltanet_step(
            y,
            conv_state,
            rec,
            d["conv_w"],
            d["conv_b"],
            d["dt_bias"],
            d["a_log"],
            d["norm_w"],
            out,
            hk=lay.hk,
            dk=lay.dk,
            norm_eps=lay.norm_eps,
            beta_scale=lay.beta_scale,
        )
    else:
        qkv = gd.conv_roll(
            conv_state,
            v("x", y),
            d["conv_w"],
            d["conv_b"],
            window=bufs.get("win"),
            tail=views.get("tail"),
            out=bufs.get("qkv"),
            acc=d["acc"],
        )
        kq = gd.l2_normalize(v("qk", qkv), d["qk_eps"], out=bufs.get("kq"))
        e = gd.gates(v("ba", y), d["z_bias"], d["z_sign"], d["e_add"], d["e_mult"], out=bufs.get("e"))
        o = gd.delta_rule_step(
            rec,
            work.state3(rec) if work is not None else rec.view(b * lay.hv, lay.dk, lay.dv),
            v("k_row", kq),
            v("k_col", kq),
            v("q_row", kq),
            v("v", qkv),
            v("beta", e),
            v("decay", e),
            u=bufs.get("u"),
            u4=views.get("u4"),
            out=bufs.get("o"),
        )
        out = gd.gated_rms_norm(
            v("o4", o),
            v("z", y),
            d["norm_w"],
            d["norm_eps"],
            weight_scale=math.sqrt(lay.dv),
            zero=d["zero"],
            out=bufs.get("out"),
        )
    if work is None:
        out = out.to(hs.dtype)
    if d["out_w"] is None:  # stored output projection: its own forward, or its decode operand
        y = d["out_mod"](v("out_in", out))
        return y if y.dim() == 3 else y.view(b, 1, lay.hidden)
    if b == 1:
        return torch.bmm(v("out_in", out), d["out_t3"] if work is not None else d["out_w"].t().unsqueeze(0))
    return torch.mm(v("out_in", out), d["out_t"] if work is not None else d["out_w"].t()).view(b, 1, lay.hidden)


def _eager_decode(
    mod: torch.nn.Module,
    state: _State,
    d: dict[str, Any],
    hs: torch.Tensor,
    conv_state: torch.Tensor,
    rec: torch.Tensor,
) -> torch.Tensor:
    """The eager decode step on the layer's buffers (made on the first step of a batch size and dtype). One
    step at a time uses them: a step that finds them busy (another thread) allocates its own."""
    if not state.lock.acquire(blocking=False):
        return _decode(mod, state.layout, d, hs, conv_state, rec, None)
    try:
        work = state.work
        if work is None or work.key != (hs.shape[0], hs.dtype, conv_state.dtype):
            work = state.work = _Work(state.layout, d, hs.shape[0], hs.dtype, conv_state.dtype)
        return _decode(mod, state.layout, d, hs, conv_state, rec, work)
    finally:
        state.lock.release()


def _recorded_decode(
    mod: torch.nn.Module,
    lay: _Layout,
    d: dict[str, Any],
    hs: torch.Tensor,
    cache: Any,
    conv_state: torch.Tensor,
    rec: torch.Tensor,
) -> torch.Tensor:
    """One token on a cache that records the past. Its conv state keeps every column until crop(), and each
    update of its recurrent state keeps the one before: the step runs on copies (the conv state's last ``width``
    columns, the recurrent state), then hands the new column and state to the cache's own calls, which record
    them as they record stock's and count the token."""
    window = conv_state[..., -lay.width :]
    short = lay.width - window.shape[-1]  # a prompt shorter than the kernel, prefilled while recording: no padding
    if short > 0:  # the causal conv's zeros on the left, by a concatenation (no pad op: see DESIGN.md)
        window = torch.cat((window.new_zeros(*window.shape[:-1], short), window), dim=-1)
    else:  # a copy even where the slice is the whole state: the step writes into it, the cache keeps its own
        window = window.clone(memory_format=torch.contiguous_format)
    state = rec.clone()
    out = _decode(mod, lay, d, hs, window, state, None)
    cache.update_conv_state(window[..., -1:], mod.layer_idx, conv_kernel_size=lay.width)
    cache.update_recurrent_state(state, mod.layer_idx)
    return out


def _prepare_decode(mod: torch.nn.Module, state: _State, hs: torch.Tensor, cache: Any) -> None:
    """After an eager prefill with a cache: make the decode buffers for this batch size and dtype now, and the
    view of the cache's recurrent state the steps read, so that the decode steps that follow only compute
    (host-side checks only when they exist already). The gates' copies of ``dt_bias``/``A_log`` are made
    again here (a few tiny ops per prompt), so that an edit through ``.data`` is followed from this prompt on."""
    conv_state = cache.get_conv_state(mod.layer_idx, state_idx=0)
    if not isinstance(conv_state, torch.Tensor) or conv_state.dim() != 3:
        return
    fresh = state.derived is not None and state.watch is not None and state.watch.fresh()
    d = _eager_derived(mod, state)
    if d is None:
        return
    if fresh:  # kept from an earlier call: the gates' copies follow a .data edit from here on
        with torch.no_grad():
            d.update(_gate_consts(mod, state.layout, eager=True))
    if not state.lock.acquire(blocking=False):
        return
    try:
        b = hs.shape[0]
        work = state.work
        if work is None or work.key != (b, hs.dtype, conv_state.dtype):
            work = state.work = _Work(state.layout, d, b, hs.dtype, conv_state.dtype)
        rec = cache.get_recurrent_state(mod.layer_idx, state_idx=0)
        if isinstance(rec, torch.Tensor) and rec.is_contiguous() and rec.numel() == math.prod(work.state_shape):
            work.state3(rec)
    finally:
        state.lock.release()


def _project(lay: _Layout, d: dict[str, Any], x2: torch.Tensor) -> torch.Tensor:
    """[M, hidden] -> [M, N] in the canonical column order [q | k | v | z | b | a], one product per weight."""
    if d["proj_mods"] is not None:
        y = torch.cat([m(x2) for m in d["proj_mods"]], dim=-1)
    else:
        y = torch.cat([F.linear(x2, w) for w in d["proj"]], dim=-1)
    return y if d["perm"] is None else y.index_select(-1, d["perm"])


def _prefill(
    mod: torch.nn.Module,
    lay: _Layout,
    d: dict[str, Any],
    hs: torch.Tensor,
    cache: Any,
    rec: torch.Tensor | None,
    solve: str,
) -> torch.Tensor:
    """The stock prefill (and multi-token continuation) with the chunked rule of :mod:`mpsboost.ops.gated_delta`."""
    b, s, _ = hs.shape
    hk, hv, dk, dv = lay.hk, lay.hv, lay.dk, lay.dv
    kd, vd, c = hk * dk, hv * dv, lay.conv_dim
    y = _project(lay, d, hs.reshape(b * s, lay.hidden)).view(b, s, lay.n)
    qkv = y[..., :c].transpose(1, 2)
    if cache is not None:
        qkv = cache.update_conv_state(qkv, mod.layer_idx, conv_kernel_size=lay.width)
    conv = mod.conv1d
    qkv = F.silu(
        F.conv1d(qkv.to(conv.weight.dtype), conv.weight, conv.bias, padding=lay.width - 1, groups=c)[
            ..., : qkv.shape[-1]
        ]
    )
    qkv = qkv[..., -s:].transpose(1, 2).to(hs.dtype)
    q = qkv[..., :kd].reshape(b, s, hk, dk)
    k = qkv[..., kd : 2 * kd].reshape(b, s, hk, dk)
    v = qkv[..., 2 * kd :].reshape(b, s, hv, dv)
    z = y[..., c : c + vd]
    bb, a = y[..., c + vd : c + vd + hv], y[..., c + vd + hv :]
    beta = bb.sigmoid() * lay.beta_scale if lay.beta_scale != 1.0 else bb.sigmoid()
    g = -mod.A_log.float().exp() * F.softplus(a.float() + mod.dt_bias)
    o, state = gd.chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=rec, output_final_state=cache is not None, solve=solve
    )
    if cache is not None:
        cache.update_recurrent_state(state, mod.layer_idx)
    norm = getattr(mod, lay.row.norm)
    out = norm(o.reshape(-1, dv), z.reshape(-1, dv)).reshape(b, s, vd)
    return getattr(mod, lay.row.out)(out)


def _forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    cache: Any = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    state: _State = self.__dict__[_STATE]
    lay = state.layout
    compiling = torch.compiler.is_compiling()  # a trace-time constant
    stock = (
        (compiling and state.compiled == "stock")
        or "cache_params" in kwargs
        or kwargs.get("cu_seq_lens_q") is not None
        or kwargs.get("seq_idx") is not None
        # autograd must reach the Parameters: the stock forward uses them directly
        or (not compiling and torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters()))
    )
    s = hidden_states.shape[1]
    # A cache recording the past (assisted decoding; on a Mac, transformers' deferred stop check when the cache is
    # returned) keeps what crop() rolls back to: a one-token step runs on copies (_recorded_decode); a multi-token
    # step runs stock, which keeps its intermediate states.
    recording = cache is not None and hasattr(cache, "is_recording_past") and cache.is_recording_past(self.layer_idx)
    stock = stock or (recording and s != 1)
    conv_state = rec = None
    if not stock and cache is not None:
        conv_state = cache.get_conv_state(self.layer_idx, state_idx=0)
        rec = cache.get_recurrent_state(self.layer_idx, state_idx=0)
    decode = (
        s == 1
        and conv_state is not None
        and rec is not None
        and rec.dtype == torch.float32
        and rec.is_contiguous()
        and (recording or conv_state.is_contiguous())
    )
    prefill_stock = not stock and not decode and state.prefill == "stock"
    d = None
    if not stock and not prefill_stock:
        d = _derive(self, lay, eager=False) if compiling else _eager_derived(self, state)
    if d is None:
        out = call_original(self, NAME, hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    else:
        if attention_mask is not None:  # transformers' apply_mask_to_padding_states
            hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
        if decode and recording:
            return _recorded_decode(self, lay, d, hidden_states, cache, conv_state, rec)
        if decode:
            # the step updates the conv state in place, where no cache call sees it: transformers >= 5.25 counts the
            # linear layers' tokens (its get_seq_length reads layer 0, a linear one) through this call
            if hasattr(cache, "increase_count"):
                cache.increase_count(self.layer_idx, 0)
            if compiling or (torch.is_grad_enabled() and hidden_states.requires_grad):
                return _decode(self, lay, d, hidden_states, conv_state, rec, None)
            return _eager_decode(self, state, d, hidden_states, conv_state, rec)
        out = _prefill(self, lay, d, hidden_states, cache, rec, state.prefill)
    if cache is not None and not compiling and (prefill_stock or d is not None):
        _prepare_decode(self, state, hidden_states, cache)  # the decode buffers of this batch, before its first step
    return out


# ---------------------------------------------------------------------------- the recipe


def _fast_path_packages() -> list[str]:
    """The CUDA kernel packages transformers would call instead of its torch reference."""
    return [p for p in ("fla", "causal_conv1d") if importlib.util.find_spec(p) is not None]


_STATIC_WHY = (
    f"cost model: {dn.FUSED_OPS} dispatch instead of {dn.COMPOSED_OPS} after the projections, at no more bytes (the "
    "state read twice and written once; composed: read four times, written twice)"
)


def _fused_choice(mod: torch.nn.Module, lay: _Layout, env: Env, mode: str) -> tuple[bool, str]:
    """Whether the decode step runs ``mpsboost::deltanet_step`` after the projections (one Metal dispatch) or the
    composed ops, and why. Off a Mac: composed (the kernel is Metal; the operator would run the same ops behind one
    call). On a Mac the static choice is the cost model's (fused: fewer dispatches, no more bytes); on a real Mac
    :func:`mpsboost.ondevice.choose` compiles the kernel, checks it against the composed step and times both at the
    layer's shapes (batch 1), taking it only if faster (verdict cached); ``fused_step="static"`` keeps the static
    choice, ``"off"`` the composed step."""
    if mode == "off":
        return False, "decode step composed (option fused_step='off')"
    if env.device_type != "mps":
        return False, (
            f"decode step composed: the fused step's kernel is Metal (on {env.device_type} "
            "mpsboost::deltanet_step would run the same ops behind one call)"
        )
    gate = check("deltanet_metal_step", env)
    if not gate.ok:
        return False, f"decode step composed: {gate.reason}"
    from .. import ondevice

    dtype = mod.conv1d.weight.dtype
    shape = f"B1 hk{lay.hk} hv{lay.hv} dk{lay.dk} dv{lay.dv} W{lay.width} {str(dtype).removeprefix('torch.')}"
    stock, fused, chk = dn.contenders(
        b=1,
        hk=lay.hk,
        r=lay.r,
        dk=lay.dk,
        dv=lay.dv,
        width=lay.width,
        dtype=dtype,
        bias=mod.conv1d.bias is not None,
        beta_scale=lay.beta_scale,
        norm_eps=lay.norm_eps,
    )
    choice = ondevice.choose(
        "deltanet_step",
        shape,
        env=env,
        stock=ondevice.Contender(f"composed step ({dn.COMPOSED_OPS} dispatches)", stock),
        candidate=ondevice.Contender("mpsboost::deltanet_step (1 Metal dispatch)", fused),
        static=True,
        check=chk,
        mode="static" if mode == "static" else "auto",
    )
    return choice.taken, f"decode step: {choice.describe()}; {_STATIC_WHY}"


# ---------------------------------------------------------------------------- compiled decoding on a Mac


def mac_compile(model: Any, *, backend: str = "inductor", mode: str | None = None, fullgraph: bool = False) -> Patch:
    """Let ``generate(..., cache_implementation="static")`` compile the decode step on MPS (opt-in).

    transformers compiles it by itself on cuda/xpu/neuron/tpu only; on other devices it needs
    ``CompileConfig._compile_all_devices`` (``generation/utils.py``, ``_valid_auto_compile_criteria``).
    This sets ``model.generation_config.compile_config`` to a copy of the model's own (or a new
    ``CompileConfig(backend, mode, fullgraph)``; ``mode`` default "default": transformers' "reduce-overhead"
    means CUDA graphs) with that flag on. Returns a :class:`~mpsboost.patching.Patch`: call it to put the
    previous config back. Works on any device (the tests use CPU); the patched Gated DeltaNet layers trace
    with ``fullgraph=True``.
    """
    cfg = getattr(model, "generation_config", None)
    if cfg is None or not hasattr(cfg, "compile_config"):
        raise TypeError(
            f"mac_compile needs a transformers generative model (with a generation_config), got {type(model).__name__}"
        )
    if not isinstance(backend, str) or not isinstance(fullgraph, bool) or not (mode is None or isinstance(mode, str)):
        raise TypeError(
            "mac_compile takes backend: str, mode: str | None, fullgraph: bool; "
            f"got {backend!r}, {mode!r}, {fullgraph!r}"
        )
    import copy as _copy

    from transformers import CompileConfig

    previous = cfg.compile_config
    new = (
        _copy.copy(previous)
        if previous is not None
        else CompileConfig(backend=backend, mode=mode or "default", fullgraph=fullgraph)
    )
    # not an __init__ argument in transformers 5.24 (a class-level default): set on the new copy, never on previous
    flag = set_attr(new, "_compile_all_devices", True)
    return Patch.chain(
        [flag, set_attr(cfg, "compile_config", new)],
        description="mac_compile: restore generation_config.compile_config",
    )
