"""attention_decode: transformers' full-attention layers in few ops per decode step.

A Mac runs transformers eagerly, where every aten op costs host time. One decode step of Qwen3.5/3.6's
gated attention layer dispatches 70 aten ops on transformers 5.24 with sdpa (90 with eager: three
``nn.Linear`` of four ops each, two RMS norms, a partial rotary built from slices, negations and
concatenations, the cache, the attention function, the output gate); this recipe's step takes 31 (one
sequence, fp32, DynamicCache; 33 in bf16; 37 with a StaticCache, whose update is 5 ops; counted on the CPU,
where ``F.rms_norm`` is 6 ops: on MPS it is one kernel).

Targets, matched by class path and then checked structurally (projection shapes, norms, no accelerate hook,
a forward of its own set by no one else):

- ``gated``: Qwen3.5 / 3.6 (MoE and dense) and Qwen3-Next: ``q_proj`` gives the query and a sigmoid output
  gate per head, zero-centred q/k RMS norms, partial rotary;
- ``qk_norm``: Qwen3 and Qwen3-MoE: q/k RMS norms (weight applied after rounding), full rotary;
- ``plain``: Llama: no norms, full rotary.

The one-token step (a cache given, eager or sdpa attention, no attention weights wanted):

- q/k/v (and the gate) are three matmuls on the model's own Parameters, each left in its own storage. For
  one sequence the q (and gate) and k products land side by side in the layer's one-row buffer (``mm`` with
  ``out=`` a column range of it, contiguous for one row; buffer and views made once, the step holds a lock
  and a concurrent step allocates instead), so one norm and one rotary cover both; v is a fresh result (it
  goes to the cache, which may keep it). A batch, and traced code (no ``out=`` in a graph), concatenate.
  Why not one matmul over a fused weight: making the Parameters views of one storage reads, to everything
  that compares storages (transformers' tied-weight checks, ``save_pretrained``, accelerate's tied-parameter
  logic, offload), as a tie the model does not declare; a fused copy held by the recipe doubles those
  weights (Qwen3.6-35B-A3B, bf16: 10 full-attention layers x (8192 + 512 + 512) x 2048 x 2 B = 360 MiB;
  Qwen3-32B: 64 x 10240 x 5120 x 2 B = 6.25 GiB) to save two host ops a step. The weights are read once
  either way (same bytes moved); the step takes 31 ops instead of 29 (two more matmuls);
- the q and k heads are normalised by one ``F.rms_norm`` and one multiply (per-row weights prepared once,
  and again at every prefill: an edit of the norms' weights through ``.data`` is followed from the next
  prompt; every other weight the step reads is a view of the module's own, read as it is at every step);
- the rotary is one ``index_select`` (the rotate-half permutation) and a multiply-add with the sign folded
  into ``sin``; a partial rotary writes its slice in place;
- the K/V go through the model's own cache object (``cache.update``: DynamicCache concatenates,
  StaticCache copies in place), so stock and patched layers mix;
- one SDPA call on transformers' mask, K/V left grouped (``enable_gqa``) where the build's kernels take it,
  otherwise the query heads of a group packed as rows (what transformers itself does on MPS < 2.13);
- the gate is ``sigmoid`` and a multiply; ``o_proj`` one matmul.

On a Mac (fused, the default where :func:`_fused_choice` takes it) the q/k norm, the rotary (full or partial) and
their dense copy are one call of ``mpsboost::attn_qk_rope_cache`` (:mod:`mpsboost.ops.attn_step`; its Metal kernel
:mod:`mpsboost.ops.attn_metal`) on the projections' product, which returns q ``[B, hq, 1, D]`` and k
``[B, hkv, 1, D]`` contiguous (SDPA's strided-input copy has nothing left to do; the packed GQA layout is a view of
q); its weights are the norms' per-column ``1 + w`` (gated) or ``w`` (qk_norm) in float32, copies made again at
every prompt as the per-row ones are. The K/V still go through ``cache.update``; the gate is read from the
product. Per attention layer and decode step (tiny models, fp32, DynamicCache, counted on the CPU where the
operator is its composed reference behind one call): gated 15 aten ops for one sequence (composed 31), qk_norm 12
(25), plain 12 (18). The choice: on a real Mac the kernel is compiled, checked against the composed chain and
timed against it at the layer's shapes (batch 1, its dtype) at patch time (:func:`mpsboost.ondevice.choose`,
verdict cached), taken only if faster; a simulated Mac takes the static choice (fused) and times nothing; CPU and
CUDA keep the composed ops (the kernel is Metal). A step whose weights no longer suit the operator (a dtype other
than float32/float16/bfloat16; qk_norm weights in another dtype than the activations) runs the composed ops.
Option ``fused``: "auto" | "static" (the static choice, not timed) | "off".

Projections another recipe stores in its own format (fp8_weights' layers, from ``patch(fp8=...)`` or
``load_fp8``: codes and scales as buffers) run their own forward inside the step: q, k and v on the one
activation (on MPS 2.15 the fp8 layers quantise it once for the three), then one ``cat`` of q and k; the
rest of the step is the same, and an fp8 ``o_proj`` runs its own forward too (Qwen3.6 tiny, Mac 2.15.0,
fp8 rowwise: 50 ops per layer against the stock forward's 82 over the same fp8 layers; a prefill
brings the step's constants up to date, so the first decode step rebuilds nothing). Float32 within
1e-5 of the fp8 model without this recipe.

Everything else runs the module's own forward (which reads the same Parameters): prefill and multi-token
continuation, training or autograd on the weights, ``output_attentions`` (however asked for: the call's
flag, the config, or transformers' output capture), attention implementations other than eager and sdpa,
packed sequences, masks with per-head or per-query rows.

Where: on MPS by default (eager decode is host-bound there; no measurement on CUDA or the CPU yet);
``options={"attention_decode": {"devices": ("mps", "cuda", "cpu")}}`` chooses the device types.

Exactness (tested): float32 outputs within 1e-5 of stock on every family, one sequence and a left-padded
batch, dynamic and static cache; greedy tokens equal. Compiled (``torch.compile`` tracing the forward, as
transformers' static cache does): on MPS the same math, traced (weights read from the Parameters); on CUDA
and CPU the stock forward (inductor fuses it; no compiled measurement of the recipe yet). Option
``compiled``: "auto" | "recipe" | "stock" (the fused operator traces as one opaque call: it has a fake).
"""

from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F

from ..gate import Env, check
from ..ops import attn_step
from ..ops.attention import rotary, sdpa
from ..ops.attn_ref import MODES
from ..patching import (
    Changes,
    Patch,
    bind_forward,
    call_original,
    is_patched_by,
    set_instance_attr,
)
from ..registry import Decision, Match, Recipe, class_path, option_choices, register
from . import _hf
from ._rows import CLASS_PATH, by_class, check_row
from ._watch import Watch
from ._operand import decode_operand

NAME = "attention_decode"
_STATE = "_mpsboost_attention_decode"
_TM = "transformers.models."
# The q/k norm classes of each kind (zero-centred: x * rsqrt(...) * (1 + w) in float32, then rounded;
# round-then-scale: w * round(x * rsqrt(...))).
_GATED_NORMS = (
    _TM + "qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeRMSNorm",
    _TM + "qwen3_5.modeling_qwen3_5.Qwen3_5RMSNorm",
    _TM + "qwen3_next.modeling_qwen3_next.Qwen3NextRMSNorm",
)
_QK_NORMS = (_TM + "qwen3.modeling_qwen3.Qwen3RMSNorm", _TM + "qwen3_moe.modeling_qwen3_moe.Qwen3MoeRMSNorm")


@dataclass(frozen=True)
class AttentionFamily:
    """One full-attention class: one row of :data:`FAMILIES`. Class names are dotted paths. Every kind has
    ``q_proj``, ``k_proj``, ``v_proj`` (:data:`_PROJ`) and ``o_proj``."""

    cls: str = field(metadata=CLASS_PATH)  # the attention class (a target of the recipe)
    # "gated": q_proj gives the query and a sigmoid output gate per head, zero-centred q/k norms, partial rotary;
    # "qk_norm": q/k RMS norms (weight applied after rounding), full rotary; "plain": no norms, full rotary.
    kind: Literal["gated", "qk_norm", "plain"]
    norms: tuple[str, ...] = field(default=(), metadata=CLASS_PATH)  # the classes its q_norm/k_norm may be

    def __post_init__(self) -> None:
        check_row(self)
        if (self.kind == "plain") != (not self.norms):
            raise ValueError(
                f"AttentionFamily row {self.cls!r}: field norms={self.norms!r} with kind={self.kind!r}; "
                "a 'plain' row names no norm classes, a 'gated' or 'qk_norm' row names its q/k norm classes"
            )


#: Every attention class the recipe serves (its targets, in this order). A new class is one row here, plus its
#: tiny model in ``FAMILIES`` of tests/recipes/attention/test_attention_decode.py.
FAMILIES: tuple[AttentionFamily, ...] = (
    AttentionFamily(_TM + "qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeAttention", "gated", _GATED_NORMS),
    AttentionFamily(_TM + "qwen3_5.modeling_qwen3_5.Qwen3_5Attention", "gated", _GATED_NORMS),
    AttentionFamily(_TM + "qwen3_next.modeling_qwen3_next.Qwen3NextAttention", "gated", _GATED_NORMS),
    AttentionFamily(_TM + "qwen3.modeling_qwen3.Qwen3Attention", "qk_norm", _QK_NORMS),
    AttentionFamily(_TM + "qwen3_moe.modeling_qwen3_moe.Qwen3MoeAttention", "qk_norm", _QK_NORMS),
    AttentionFamily(_TM + "llama.modeling_llama.LlamaAttention", "plain"),
)
_FAMILIES: dict[str, AttentionFamily] = by_class(FAMILIES, "cls")
_IMPLS = ("eager", "sdpa")
# The recipe whose forward (transformers' forward with its attention lookup routed) may sit under this one.
_ROUTER = "metal_attention"
_GQA = ("enable_gqa", "packed")
# the activation dtypes mpsboost::attn_qk_rope_cache's Metal kernel takes (elsewhere the composed step runs)
_FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Arguments of an attention call this step does not implement (packed sequences, biases, sinks, caps).
_UNCOVERED = ("cu_seq_lens_q", "cu_seq_lens_k", "position_bias", "softcap", "s_aux", "sinks", "cache_params")


_DEVICES = ("mps", "cuda", "cpu")


@dataclass(frozen=True)
class AttentionDecodeOptions:
    """``options={"attention_decode": {...}}``: ``devices``, the device types it applies on (default MPS: no
    measurement elsewhere yet); ``compiled`` ("auto": the recipe's step traced on MPS, the module's own
    forward elsewhere; "recipe"; "stock"); ``fused`` ("auto": on a Mac the q/k norm and rotary are one call of
    ``mpsboost::attn_qk_rope_cache`` where :func:`_fused_choice` takes it; "static": the cost model's choice, not
    timed; "off": the composed ops)."""

    devices: tuple[str, ...] = ("mps",)
    compiled: Literal["auto", "recipe", "stock"] = "auto"
    fused: Literal["auto", "static", "off"] = "auto"


_COMPILED = option_choices(AttentionDecodeOptions, "compiled")
_FUSED = option_choices(AttentionDecodeOptions, "fused")


@dataclass(frozen=True)
class AttentionDecodePlan:
    """What one attention layer gets: its ``family`` (its row's ``AttentionFamily.kind``), how SDPA takes grouped
    K/V (``"enable_gqa"`` or ``"packed"``: a group's query heads as rows) and what runs while torch.compile
    traces (``"recipe"`` or ``"stock"``)."""

    family: str
    gqa: str
    compiled: str
    dense: bool = False  # q/k/v made contiguous before SDPA (gate feature sdpa_strided_correct)
    fused: bool = False  # q/k norm and rotary by mpsboost::attn_qk_rope_cache (else composed)


@register
class AttentionDecode(Recipe):
    name = NAME
    summary = (
        "full-attention decode step in few ops: q/k/v(/gate) products side by side in one result, "
        "one norm for q and k, "
        "rotary by one permutation, cache update, one SDPA, gate and o_proj"
    )
    targets = tuple(_FAMILIES)
    lossless = True
    reversible = True
    requires = ()
    default = True
    order = 105  # after metal_attention (its routed forward stays what prefill runs), before attention_split
    Options = AttentionDecodeOptions

    def decide(self, match: Match, env: Env, options: AttentionDecodeOptions) -> Decision:
        if options.compiled not in _COMPILED:
            raise ValueError(f"{NAME} option 'compiled' must be one of {_COMPILED}, got {options.compiled!r}")
        if options.fused not in _FUSED:
            raise ValueError(f"{NAME} option 'fused' must be one of {_FUSED}, got {options.fused!r}")
        bad = [d for d in options.devices if d not in _DEVICES]
        if bad:
            raise ValueError(f"{NAME} option devices={options.devices!r}: unknown {bad}; accepted: {_DEVICES}")
        lay = _layout(match.module)
        if isinstance(lay, str):
            return Decision.skip(lay)
        impl = _hf.implementation(match.module)
        if impl not in _IMPLS:
            return Decision.skip(f"attention implementation {impl!r}: the step implements eager and sdpa only")
        if env.device_type not in options.devices:
            return Decision.skip(
                f"applies on {', '.join(options.devices)} (options devices); no measurement of the step on "
                f"{env.device_type} yet: stock kept"
            )
        if lay.hq == lay.hkv:
            gqa, why_gqa = "enable_gqa", "no grouped K/V"
        elif env.device_type == "mps":
            v = check("sdpa_metal_gqa", env)
            gqa = "enable_gqa" if v.ok else "packed"
            why_gqa = v.reason if v.ok else f"query heads packed per K/V head: {v.reason}"
        elif env.device_type == "cuda":
            gqa, why_gqa = "packed", "query heads packed per K/V head (CUDA SDPA with a mask and GQA is the math path)"
        else:
            gqa, why_gqa = "enable_gqa", "SDPA with enable_gqa"
        compiled = (
            options.compiled if options.compiled != "auto" else ("recipe" if env.device_type == "mps" else "stock")
        )
        dense = env.device_type == "mps" and not (strided := check("sdpa_strided_correct", env)).ok
        if dense:
            why_gqa += f"; q/k/v made contiguous before SDPA (sdpa_strided_correct: {strided.reason})"
        fused, why_fused = _fused_choice(match.module, lay, env, options.fused)
        backing = (
            f"projections side by side, q/k norm and rotary by mpsboost::attn_qk_rope_cache (1 dispatch), SDPA ({gqa})"
            if fused
            else f"projections side by side, one norm, rotary by permutation, SDPA ({gqa})"
        )
        why = (
            f"eager decode in few ops ({lay.family} attention; stock: 70 aten ops per step for Qwen3.5/3.6); "
            f"{why_gqa}; {why_fused}; prefill and other calls: the module's own forward; compiled: "
            + ("the recipe's step, traced" if compiled == "recipe" else "the module's own forward (inductor fuses it)")
        )
        return Decision.apply(
            backing,
            why,
            plan=AttentionDecodePlan(family=lay.family, gqa=gqa, compiled=compiled, dense=dense, fused=fused),
        )

    def apply(self, match: Match, decision: Decision, env: Env, options: AttentionDecodeOptions) -> Patch:
        mod = match.module
        lay = _layout(mod)
        if isinstance(lay, str):
            raise RuntimeError(f"{class_path(type(mod))} changed between plan and apply: {lay}")
        plan: AttentionDecodePlan = decision.plan
        with Changes() as ch:
            st = _State(
                lay,
                plan.gqa,
                plan.compiled,
                _hf.attention_collector(),
                _cache_arg(mod) or "cache",
                plan.dense,
                plan.fused,
            )
            ch.add(set_instance_attr(mod, NAME, _STATE, st))
            ch.add(bind_forward(mod, NAME, _forward))
            _eager_derived(mod, st)
        return ch.patch(description=f"{NAME}: restore forward")


@dataclass(frozen=True)
class _Layout:
    family: str  # the row's kind: "gated", "qk_norm" or "plain"
    hq: int
    hkv: int
    d: int
    hidden: int
    eps: float  # q/k norm epsilon (unused for "plain")
    bias: bool

    @property
    def q_rows(self) -> int:  # rows of the head-major view holding q (and the gate) and k
        return (2 * self.hq if self.family == "gated" else self.hq) + self.hkv

    @property
    def q_stride(self) -> int:  # columns between two query heads
        return 2 * self.d if self.family == "gated" else self.d

    @property
    def widths(self) -> tuple[int, int, int]:
        return (self.hq * self.d * (2 if self.family == "gated" else 1), self.hkv * self.d, self.hkv * self.d)

    @property
    def n(self) -> int:
        return sum(self.widths)


_PROJ = ("q_proj", "k_proj", "v_proj")


def _family(mod: torch.nn.Module) -> AttentionFamily | None:
    return next((_FAMILIES[class_path(c)] for c in type(mod).__mro__ if class_path(c) in _FAMILIES), None)


def _stored(m: Any) -> bool:
    """A ``nn.Linear`` whose weight another recipe stores in its own format (mpsboost's fp8 layers: codes and
    scales as buffers, the layer's own forward bound on the instance): the step calls that forward for it."""
    return isinstance(m, torch.nn.Linear) and not isinstance(getattr(m, "weight", None), torch.nn.Parameter)


def _linear(m: Any, n_in: int, n_out: int, bias: bool) -> str | None:
    if _stored(m):
        w = m.weight
        # fp8 codes keep the dense shape; low-bit codes pack several into a word: the layer's own sizes say it
        dense = (getattr(m, "out_features", None), getattr(m, "in_features", None))
        if not isinstance(w, torch.Tensor) or dense != (n_out, n_in):
            return f"stored weight of ({dense[0]}, {dense[1]}), expected ({n_out}, {n_in})"
        if (getattr(m, "bias", None) is not None) != bias:
            return "bias differs from the other projections"
        return None
    if not isinstance(m, torch.nn.Linear) or type(m).forward is not torch.nn.Linear.forward:
        return f"{type(m).__name__} is not a plain nn.Linear"
    w = getattr(m, "weight", None)
    if not isinstance(w, torch.nn.Parameter) or not w.is_floating_point() or tuple(w.shape) != (n_out, n_in):
        return f"weight {tuple(getattr(w, 'shape', ()))}, expected floating ({n_out}, {n_in})"
    if (getattr(m, "bias", None) is not None) != bias:
        return "bias differs from the other projections"
    return None


def _norm_eps(norm: Any) -> float | None:
    for name in ("eps", "variance_epsilon"):
        v = getattr(norm, "__dict__", {}).get(name)
        if isinstance(v, float):
            return v
    return None


def _layout(mod: torch.nn.Module) -> _Layout | str:
    """The layer's layout, or why the recipe cannot rely on it."""
    row = _family(mod)
    if row is None:
        return f"{class_path(type(mod))} is not a known attention class"
    fam = row.kind
    cfg = getattr(mod, "config", None)
    try:
        d = int(mod.head_dim)
        hq = int(cfg.num_attention_heads)
        hkv = int(cfg.num_key_value_heads)
        hidden = int(cfg.hidden_size)
    except (AttributeError, TypeError, ValueError) as e:
        return f"missing or non-integer layout attribute ({e})"
    if min(d, hq, hkv, hidden) < 1 or hq % hkv or d % 2:
        return f"heads {hq}/{hkv} or head_dim {d} not supported"
    if getattr(mod, "num_key_value_groups", hq // hkv) != hq // hkv or not isinstance(mod.scaling, float):
        return "num_key_value_groups or scaling differ from the config"
    bias = getattr(mod.q_proj, "bias", None) is not None
    eps = 0.0
    if fam != "plain":
        norms = [getattr(mod, n, None) for n in ("q_norm", "k_norm")]
        eps_ = [_norm_eps(n) for n in norms]
        if any(class_path(type(n)) not in row.norms for n in norms):
            return f"q/k norms are {[type(n).__name__ for n in norms]}, expected {row.norms}"
        if any(tuple(getattr(getattr(n, "weight", None), "shape", ())) != (d,) for n in norms):
            return f"q/k norm weights are not of width {d}"
        if eps_[0] is None or eps_[0] != eps_[1]:
            return "q/k norms have no float eps, or different ones"
        eps = eps_[0]
    lay = _Layout(fam, hq, hkv, d, hidden, eps, bias)
    for name, rows in zip(_PROJ, lay.widths):
        why = _linear(getattr(mod, name, None), hidden, rows, bias)
        if why:
            return f"{name}: {why}"
    why = _linear(getattr(mod, "o_proj", None), hq * d, hidden, getattr(mod.o_proj, "bias", None) is not None)
    if why:
        return f"o_proj: {why}"
    params = _proj_params(mod, lay)
    plain = [p for p in params if isinstance(p, torch.nn.Parameter)]
    if len({(p.dtype, p.device) for p in plain}) > 1 or len({id(p) for p in params}) != len(params):
        return "projections differ in dtype or device, or share a weight"
    hooked = [n for n, m in mod.named_modules() if "_hf_hook" in m.__dict__]
    if hooked:
        return f"accelerate hooks move weights per call ({', '.join(n or '<layer>' for n in hooked)})"
    if "forward" in mod.__dict__ and not is_patched_by(mod, _ROUTER):
        return "forward already replaced on this instance; left alone"
    if _cache_arg(mod) is None:
        return "the class forward takes neither `cache` nor `past_key_values`; stock kept"
    return lay


def _cache_arg(mod: torch.nn.Module) -> str | None:
    """The name the class forward takes the cache by: ``cache`` (transformers >= 5.2x, which also passes the
    call's keywords on to ``cache.update``) or ``past_key_values`` (earlier 5.x)."""
    params = inspect.signature(inspect.unwrap(type(mod).forward)).parameters
    return next((n for n in ("cache", "past_key_values") if n in params), None)


def _proj_params(mod: torch.nn.Module, lay: _Layout) -> list[torch.nn.Parameter]:
    ps = [getattr(mod, n).weight for n in _PROJ]
    return ps + ([getattr(mod, n).bias for n in _PROJ] if lay.bias else [])


class _State:
    """What the recipe keeps on one patched layer (an instance attribute, never module-level)."""

    def __init__(
        self,
        layout: _Layout,
        gqa: str,
        compiled: str,
        collector: Any,
        cache_arg: str,
        dense: bool,
        fused: bool = False,
    ):
        self.layout = layout
        self.dense = dense
        self.fused = fused  # the q/k norm and rotary are one call of mpsboost::attn_qk_rope_cache
        self.cache_arg = cache_arg
        self.gqa = gqa
        self.compiled = compiled
        self.collector = collector
        self.watch: Watch | None = None
        self.derived: dict[str, Any] | None = None

        self.work: tuple | None = None  # ((dtype, device), [1, q+k] buffer, its q and k column views)
        self.lock = threading.Lock()  # the buffer serves one step at a time; a concurrent step allocates

    def forget(self) -> None:
        self.derived = self.watch = self.work = None

    def buffer(self, like: torch.Tensor, lay: _Layout) -> tuple:
        """The one-row q/k buffer and its column views, for ``like``'s dtype and device (made once; taken with
        the lock held)."""
        key = (like.dtype, like.device)
        if self.work is None or self.work[0] != key:
            wq, wk = lay.widths[0], lay.widths[1]
            buf = torch.empty((1, wq + wk), dtype=like.dtype, device=like.device)
            self.work = (key, buf, buf[:, :wq], buf[:, wq:])
        return self.work

    def __deepcopy__(self, memo: dict) -> _State:
        """A copy of a patched model: the same decisions, its own lock, constants and buffer (rebuilt from the
        copy's weights on its first step); transformers' output collector (a process-wide object holding a
        ContextVar) shared, not copied."""
        new = _State(self.layout, self.gqa, self.compiled, self.collector, self.cache_arg, self.dense, self.fused)
        memo[id(self)] = new
        return new


def _norm_weight(mod: torch.nn.Module, lay: _Layout, detach: bool) -> torch.Tensor | None:
    """Per-row weights of the head-major [q (and gate) | k] view: one multiply after the norm."""
    if lay.family == "plain":
        return None
    wq, wk = mod.q_norm.weight, mod.k_norm.weight
    if detach:
        wq, wk = wq.detach(), wk.detach()
    if lay.family == "gated":  # (1 + w) in float32, as the modules compute it; the gate rows are left alone
        wq, wk = 1.0 + wq.float(), 1.0 + wk.float()
        q = torch.stack((wq, torch.ones_like(wq)), 0).repeat(lay.hq, 1)
    else:
        q = wq.expand(lay.hq, lay.d)
    return torch.cat((q, wk.expand(lay.hkv, lay.d)), 0)


def _qk_weights(mod: torch.nn.Module, lay: _Layout, detach: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The fused operator's per-column q/k norm weights, contiguous float32 ``[D]`` each: ``1 + w`` for the gated
    family (as its norms compute it), the weight itself for qk_norm (the operator rounds it to the activation dtype,
    exact where the norm's weight is in that dtype: :func:`_fusable`), None for plain. Copies, made again at every
    prompt as ``norm_w`` is (:func:`_refresh_norm_weight`)."""
    if lay.family == "plain":
        return None
    ws = (mod.q_norm.weight, mod.k_norm.weight)
    if detach:
        ws = tuple(w.detach() for w in ws)
    if lay.family == "gated":
        return tuple((1.0 + w.float()).contiguous() for w in ws)
    return tuple(w.to(torch.float32, copy=True).contiguous() for w in ws)


def _fusable(mod: torch.nn.Module, lay: _Layout, dtype: torch.dtype | None) -> str | None:
    """None where ``mpsboost::attn_qk_rope_cache`` computes what this layer's composed step computes at ``dtype``
    (the step's compute dtype), else why not (metadata only: also read while tracing)."""
    if dtype not in _FUSED_DTYPES:
        return f"compute dtype {dtype}: the fused operator takes {', '.join(str(t) for t in _FUSED_DTYPES)}"
    if lay.family == "qk_norm":
        wd = {mod.q_norm.weight.dtype, mod.k_norm.weight.dtype}
        if wd != {dtype}:
            # stock multiplies by the weight in its own dtype (a float32 weight makes a float32 product)
            return f"q/k norm weights in {sorted(str(t) for t in wd)}, activations in {dtype}"
    return None


def _derive(mod: torch.nn.Module, lay: _Layout, state: _State | None, fused: bool) -> dict[str, Any]:
    """The constants of the decode step. Eager mode keeps them until a Parameter changes; traced code builds
    them inside the graph (no state read). ``fused``: the plan's choice; the step takes the fused operator where
    :func:`_fusable` holds for the weights as they are now (``d["fused"]``), else the composed ops."""
    detach = state is not None
    dtype = _compute_dtype(mod, lay)
    fused = fused and _fusable(mod, lay, dtype) is None
    o = mod.o_proj
    projs = [getattr(mod, n) for n in _PROJ]
    # A projection stored by another recipe (fp8 codes and scales) runs its own forward: on MPS 2.15 the fp8
    # layers quantise the one activation they share once (mpsboost.ops.fp8), and their codes stay theirs.
    stored = any(_stored(m) for m in projs)
    o_stored = _stored(o)
    d: dict[str, Any] = {
        "fused": fused,
        "qk_w": _qk_weights(mod, lay, detach) if fused else None,  # the fused operator's wq, wk
        "norm_w": None if fused else _norm_weight(mod, lay, detach),
        "o_wt": None if o_stored else (o.weight.detach().t() if detach else o.weight.t()),
        "o_b": None if o_stored or o.bias is None else (o.bias.detach() if detach else o.bias),
        "o_mod": (decode_operand(o) if detach else o) if o_stored else None,
        "mods": tuple(decode_operand(m) if detach else m for m in projs) if stored else None,
        "dtype": dtype,
        "ones": None,
        "wt": None,
        "b": None,
        "rope": {},  # rotary dim -> (perm, sign)
    }
    if lay.family != "plain" and not fused:
        d["ones"] = torch.ones(lay.d, dtype=torch.float32, device=o.weight.device)
    if state is not None and not stored:
        ps = [p.detach() for p in _proj_params(mod, lay)]
        # each projection's weight transposed (a view: nothing copied) and its column range in the product
        d["wt"] = tuple(p.t() for p in ps[:3])
        d["b"] = tuple(ps[3:]) if lay.bias else None
        # the rotary constants of the configured rotary width, now rather than inside the first step
    if state is not None and d["dtype"] is not None and not fused:
        # the rotary constants of the configured rotary width, now rather than inside the first step
        rd = _configured_rotary_dim(mod, lay)
        if rd is not None:
            _rope_consts(d, rd, torch.empty(0, dtype=d["dtype"], device=o.weight.device))
    return d


def _compute_dtype(mod: torch.nn.Module, lay: _Layout) -> torch.dtype | None:
    """The dtype the step computes in: the plain projections' weights', else (every projection stored by
    another recipe) the q/k norms' or the output projection's, None when none says."""
    for m in (*(getattr(mod, n) for n in _PROJ), mod.o_proj):
        if not _stored(m):
            return m.weight.dtype
    if lay.family != "plain":
        return mod.q_norm.weight.dtype
    return None


def _configured_rotary_dim(mod: torch.nn.Module, lay: _Layout) -> int | None:
    cfg = getattr(mod, "config", None)
    rope = getattr(cfg, "rope_parameters", None)
    factor = rope.get("partial_rotary_factor") if isinstance(rope, dict) else None
    factor = factor if factor is not None else getattr(cfg, "partial_rotary_factor", 1.0)
    if not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        return None
    rd = int(lay.d * factor)
    return rd if rd % 2 == 0 and rd > 0 else None


def _watch(mod: torch.nn.Module, lay: _Layout) -> Watch:
    """Where and at which version every tensor the constants come from is (host-side metadata only)."""
    paths = [(n, a) for n in (*_PROJ, "o_proj") for a in ("weight", "bias", "weight_scale")]
    if lay.family != "plain":
        paths += [("q_norm", "weight"), ("k_norm", "weight")]
    return Watch(mod, paths)


def _eager_derived(mod: torch.nn.Module, state: _State) -> dict[str, Any] | None:
    """The eager constants, rebuilt when a Parameter moved or was written to since; None when the layout no
    longer holds (then the stock forward runs)."""
    lay = state.layout
    if state.derived is not None and state.watch is not None and state.watch.fresh():
        return state.derived
    linears = [(getattr(mod, n, None), lay.hidden, rows, lay.bias) for n, rows in zip(_PROJ, lay.widths)]
    o = getattr(mod, "o_proj", None)
    linears.append((o, lay.hq * lay.d, lay.hidden, getattr(o, "bias", None) is not None))
    plain = [m for m, *_ in linears if not _stored(m)]
    if (
        any(_linear(*x) for x in linears)
        or len({(m.weight.dtype, m.weight.device) for m, *_ in linears if m in plain}) > 1
        or len({m.weight.device for m, *_ in linears}) != 1
    ):
        state.forget()
        return None
    with torch.no_grad():
        state.derived = _derive(mod, lay, state, state.fused)
        if state.derived["wt"] is not None:
            state.buffer(mod.q_proj.weight, lay)  # now rather than inside the first step
        elif state.derived["mods"] is not None and isinstance(
            getattr(state.derived["mods"][0], "dtype", None), torch.dtype
        ):
            # stored projections' decode operands (fp8): the buffer in the dtype they compute in
            like = torch.empty(0, dtype=state.derived["mods"][0].dtype, device=mod.q_proj.weight.device)
            state.buffer(like, lay)
    state.watch = _watch(mod, lay)
    return state.derived


def _refresh_norm_weight(mod: torch.nn.Module, state: _State) -> None:
    """The per-row q/k norm weights made again from the norms' weights as they are now (a few tiny ops per
    prompt). The one eager constant that is a copy: ``(1 + w)`` in float32 or a weight repeated per head, one
    row of which no view of the two weights expresses (the fused operator's: ``1 + w`` or the weight in
    float32). The projections' weights, biases and the output projection's are views and need nothing."""
    d = state.derived
    if d is None:
        return
    with torch.no_grad():
        if d["norm_w"] is not None:
            d["norm_w"] = _norm_weight(mod, state.layout, True)
        if d["qk_w"] is not None:
            d["qk_w"] = _qk_weights(mod, state.layout, True)


def _rope_consts(d: dict[str, Any], rd: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rotate_half as a permutation of the ``rd`` rotary columns, and its sign ([-1]*h + [1]*h)."""
    found = d["rope"].get((rd, like.dtype, like.device))
    if found is None:
        h = rd // 2
        perm = torch.cat((torch.arange(h, rd), torch.arange(0, h))).to(like.device)
        sign = torch.cat((torch.full((h,), -1.0), torch.ones(h))).to(like.device, like.dtype)
        found = (perm, sign)
        if not torch.compiler.is_compiling():
            d["rope"][(rd, like.dtype, like.device)] = found
    return found


def _project(
    mod: torch.nn.Module, d: dict[str, Any], x2: torch.Tensor, work: tuple | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``([B, Nq + Nk], [B, Nv])``: the q (and gate) and k products side by side (the norm and the rotary run
    over both at once), and the v product, from the Parameters as they are (each in its own storage). Eager,
    one row (``work``: the layer's one-row buffer and its column views, the lock held): q and k write their
    columns of it (a column range of one row is contiguous). v is always a fresh result: it goes to the
    cache, which may keep it. A batch, a concurrent step and traced code (no ``out=`` in a graph): q and k
    concatenated."""
    if d["mods"] is not None:  # stored projections (fp8): each layer's own forward on the one activation
        if work is not None:  # decode operands that write into a buffer (mpsboost's fp8 GEMV): q and k columns
            _, buf, q, k = work
            d["mods"][0](x2, out=q)
            d["mods"][1](x2, out=k)
            return buf, d["mods"][2](x2)
        q, k, v = (m(x2) for m in d["mods"])
        return torch.cat((q, k), dim=-1), v
    wts, bs = d["wt"], d["b"]
    if wts is None:  # traced: read the Parameters (inductor sees the stock matmuls)
        lin = [F.linear(x2, getattr(mod, p).weight, getattr(mod, p).bias) for p in _PROJ]
        return torch.cat(lin[:2], dim=-1), lin[2]

    def mm(i: int, out: torch.Tensor | None = None) -> torch.Tensor:
        if bs is None:
            return torch.mm(x2, wts[i], out=out)
        return torch.addmm(bs[i], x2, wts[i], out=out)

    if work is None:
        return torch.cat((mm(0), mm(1)), dim=-1), mm(2)
    _, buf, q, k = work
    mm(0, q)
    mm(1, k)
    return buf, mm(2)


def _decode(
    mod: torch.nn.Module,
    st: _State,
    d: dict[str, Any],
    hs: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    mask: torch.Tensor | None,
    cache: Any,
    kwargs: dict,
    own: bool,
) -> torch.Tensor:
    """One token. ``own``: this step holds the layer's lock and may write its one-row q/k buffer."""
    lay = st.layout
    b, hq, hkv, dh = hs.shape[0], lay.hq, lay.hkv, lay.d
    writes = d["wt"] is not None or (d["mods"] is not None and all(getattr(m, "writes_out", False) for m in d["mods"]))
    work = st.buffer(hs, lay) if own and b == 1 and writes else None
    # [B, Nqk] (the buffer, or a fresh result: as_strided views address it) and [B, Nv]
    y, yv = _project(mod, d, hs.reshape(b, lay.hidden), work)
    nqk = lay.widths[0] + lay.widths[1]
    if d["fused"]:
        # norm, rotary and the dense copy in one call: q [B, hq, 1, D] and k [B, hkv, 1, D], both contiguous
        wq, wk = d["qk_w"] if d["qk_w"] is not None else (None, None)
        q, k = attn_step.qk_rope_cache(
            y, wq, wk, cos, sin, hq=hq, hkv=hkv, d=dh, q_stride=lay.q_stride, eps=lay.eps, mode=MODES[lay.family]
        )
        if st.gqa == "packed":  # a group's query heads as rows: the same memory
            q = q.view(b, hkv, hq // hkv, dh)
    else:
        q, k = _qk_composed(st, d, y, cos, sin, b)
    v = yv.view(b, hkv, 1, dh)
    if st.cache_arg == "cache":  # as the class forward calls it
        k, v = cache.update(k, v, mod.layer_idx, kwargs=kwargs)
    else:
        k, v = cache.update(k, v, mod.layer_idx)
    # [B, H, 1, D] or [B, Hkv, r, D]: both [B, H * D] in memory
    out = sdpa(q, k, v, mask, scale=mod.scaling, dense=st.dense)
    if lay.family == "gated":
        # the gate heads in SDPA's output shape ([B, H, 1, D] or [B, Hkv, r, D]: head g * r + j), so no reshape
        r = out.shape[2]
        gate = y.as_strided(tuple(out.shape), (nqk, r * 2 * dh, 2 * dh, 1), dh)
        out = out * torch.sigmoid(gate)
    o = out.reshape(b, hq * dh)  # a view where SDPA's output is dense in [B, H, D] order
    if d["o_mod"] is not None:  # stored output projection (fp8): its own forward
        o = d["o_mod"](o)
    else:
        o = torch.mm(o, d["o_wt"]) if d["o_b"] is None else torch.addmm(d["o_b"], o, d["o_wt"])
    return o.view(b, 1, lay.hidden)


def _qk_composed(
    st: _State, d: dict[str, Any], y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, b: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The composed q/k: one norm over the q and k heads, the rotary by permutation, views of the result."""
    lay = st.layout
    hq, hkv, dh = lay.hq, lay.hkv, lay.d
    nqk = lay.widths[0] + lay.widths[1]
    rows = lay.q_rows
    qk = y.as_strided((b, rows, dh), (nqk, dh, 1), 0)
    fresh = d["norm_w"] is not None
    if fresh:
        dtype = qk.dtype
        normed = F.rms_norm(qk.float(), (dh,), d["ones"], lay.eps)
        if lay.family == "gated":
            qk = (normed * d["norm_w"]).to(dtype)
        else:
            qk = normed.to(dtype) * d["norm_w"]
    perm, sign = _rope_consts(d, cos.shape[-1], cos)
    # [B, rows, D] (contiguous); a partial rotary writes in place only into the norm's fresh result
    qk = rotary(qk, cos, sin, perm, sign, inplace=fresh)
    if not qk.is_contiguous():  # host-side check; the views below address a dense [B, rows, D]
        qk = qk.contiguous()
    rs = rows * dh
    if st.gqa == "packed":
        r = hq // hkv
        q = qk.as_strided((b, hkv, r, dh), (rs, r * lay.q_stride, lay.q_stride, 1), 0)
    else:
        q = qk.as_strided((b, hq, 1, dh), (rs, lay.q_stride, dh, 1), 0)
    k = qk.as_strided((b, hkv, 1, dh), (rs, dh, dh, 1), (rows - hkv) * dh)
    return q, k


def _decodable(
    mod: torch.nn.Module, st: _State, hs: Any, pe: Any, mask: Any, cache: Any, kwargs: dict, compiling: bool
) -> bool:
    """Whether this call is a one-token step the recipe computes as stock does (host-side checks only)."""
    lay = st.layout
    if (
        mod.training
        or cache is None
        or not isinstance(hs, torch.Tensor)
        or hs.dim() != 3
        or hs.shape[1] != 1
        or hs.shape[2] != lay.hidden
        or not isinstance(pe, (tuple, list))
        or len(pe) != 2
        or _hf.implementation(mod) not in _IMPLS
        or any(kwargs.get(k) is not None for k in _UNCOVERED)
        or _hf.weights_wanted(mod, kwargs, st.collector)
    ):
        return False
    cos, sin = pe
    if not (isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor)) or cos.shape != sin.shape:
        return False
    rd = cos.shape[-1]
    if cos.dim() != 3 or cos.shape[1] != 1 or cos.shape[0] not in (1, hs.shape[0]) or rd % 2 or rd > lay.d:
        return False
    if cos.dtype != hs.dtype:
        return False
    if mask is not None and (
        not isinstance(mask, torch.Tensor)
        or mask.dim() != 4
        or mask.shape[1] != 1
        or mask.shape[2] != 1
        or mask.shape[0] not in (1, hs.shape[0])
    ):
        return False
    if not compiling and (
        torch.is_autocast_enabled(hs.device.type)
        or (torch.is_grad_enabled() and any(p.requires_grad for p in mod.parameters()))
    ):
        return False
    return True


def _forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: Any = None,
    attention_mask: torch.Tensor | None = None,
    cache: Any = None,
    **kwargs: Any,
) -> Any:
    st: _State = self.__dict__[_STATE]
    compiling = torch.compiler.is_compiling()  # a trace-time constant
    if "past_key_values" in kwargs and cache is None:  # the name before 5.2x (deprecated since)
        cache = kwargs.pop("past_key_values")
    d = None
    if not (compiling and st.compiled == "stock") and _decodable(
        self, st, hidden_states, position_embeddings, attention_mask, cache, kwargs, compiling
    ):
        d = _derive(self, st.layout, None, st.fused) if compiling else _eager_derived(self, st)
        if d is not None and hidden_states.dtype != d["dtype"]:
            d = None  # e.g. autocast's or a caller's other dtype: stock casts as it does
    if d is None:
        if not compiling and isinstance(hidden_states, torch.Tensor) and hidden_states.dim() == 3:
            if hidden_states.shape[1] > 1:
                # A prefill: the decode constants are brought up to date here (rebuilt when a weight moved
                # or another recipe converted it since, e.g. fp8 at patch() commit), so that the first decode
                # step runs as every later one does; the q/k norms' per-row copy is made again in any case
                # (an edit through .data leaves no trace the Watch could see).
                if st.derived is not None and st.watch is not None and st.watch.fresh():
                    _refresh_norm_weight(self, st)
                else:
                    _eager_derived(self, st)
        return call_original(
            self,
            NAME,
            hidden_states,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            **{st.cache_arg: cache},
            **kwargs,
        )
    cos, sin = position_embeddings
    if compiling or not st.lock.acquire(blocking=False):  # traced, or another thread's step holds the buffer
        return _decode(self, st, d, hidden_states, cos, sin, attention_mask, cache, kwargs, own=False), None
    try:
        return _decode(self, st, d, hidden_states, cos, sin, attention_mask, cache, kwargs, own=True), None
    finally:
        st.lock.release()


# aten ops the composed q/k chain takes after the projections, for one sequence (counted on the CPU, fp32: the
# norm's six, its weight, the cast, the rotary's five, the views), against one call of the fused operator
_COMPOSED_QK_OPS = 14
_STATIC_WHY = (
    f"cost model: 1 dispatch instead of about {_COMPOSED_QK_OPS} for the q/k norm, rotary and their dense copy, "
    "no more bytes (the q/k product read once, q and k written once, contiguous for SDPA)"
)
# how far the fused operator may stand from the composed chain in the patch-time check (relative, max-abs)
_CHECK_TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _pair_check(pair: Any, dtype: torch.dtype) -> Any:
    """The patch-time check of :func:`mpsboost.ondevice.choose`: the kernel's own self-check (once per process),
    then one call of each path of ``pair()`` (:func:`mpsboost.ops.attn_step.timing_pair`) on the same inputs, q and
    k compared. None when they agree, else why not."""

    def check_run() -> str | None:
        from ..ops import attn_metal

        why = attn_metal.self_check("mps")
        if why is not None:
            return why
        composed, fused = pair()
        for name, want, got in zip(("q", "k"), composed(), fused()):
            want, got = want.double().cpu(), got.double().cpu()
            err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
            if not err <= _CHECK_TOL[dtype]:
                return f"the fused operator's {name} differs from the composed chain's by {err:.2e} at these shapes"
        return None

    return check_run


def _fused_choice(mod: torch.nn.Module, lay: _Layout, env: Env, mode: str) -> tuple[bool, str]:
    """Whether the decode step's q/k norm and rotary are one call of ``mpsboost::attn_qk_rope_cache`` or the
    composed ops, and why. Off a Mac: composed (the kernel is Metal; the operator would run the same ops behind one
    call). On a Mac: the gate row ``attn_metal_qk_rope``, then :func:`mpsboost.ondevice.choose` at the layer's
    shapes (batch 1, its dtype): on a real Mac the kernel is compiled, checked against the composed chain and timed
    against it (verdict cached), taken only if faster; a simulated Mac, or ``fused="static"``, takes the static
    choice (fused) and times nothing. ``fused="off"``: composed."""
    if mode == "off":
        return False, "q/k norm and rotary composed (option fused='off')"
    if env.device_type != "mps":
        return False, (
            f"q/k norm and rotary composed: the fused operator's kernel is Metal (on {env.device_type} "
            "mpsboost::attn_qk_rope_cache would run the same ops behind one call)"
        )
    gate = check("attn_metal_qk_rope", env)
    if not gate.ok:
        return False, f"q/k norm and rotary composed: {gate.reason}"
    dtype = _compute_dtype(mod, lay)
    why = _fusable(mod, lay, dtype)
    if why is not None:
        return False, f"q/k norm and rotary composed: {why}"
    from .. import ondevice

    rd = _configured_rotary_dim(mod, lay) or lay.d
    shape = (
        f"B1 hq{lay.hq} hkv{lay.hkv} D{lay.d} qs{lay.q_stride} R{rd} mode{MODES[lay.family]} "
        f"{str(dtype).removeprefix('torch.')}"
    )
    made: list = []

    def pair() -> tuple:  # the inputs are made at the first call: nothing is allocated where nothing is timed
        if not made:
            made.append(
                attn_step.timing_pair(
                    batch=1,
                    hq=lay.hq,
                    hkv=lay.hkv,
                    d=lay.d,
                    q_stride=lay.q_stride,
                    rotary=rd,
                    mode=MODES[lay.family],
                    dtype=dtype,
                )
            )
        return made[0]

    def stock_run() -> Any:
        return pair()[0]()

    def fused_run() -> Any:
        return pair()[1]()

    choice = ondevice.choose(
        "attn_qk_rope_cache",
        shape,
        env=env,
        stock=ondevice.Contender(f"composed q/k norm and rotary (about {_COMPOSED_QK_OPS} dispatches)", stock_run),
        candidate=ondevice.Contender("mpsboost::attn_qk_rope_cache (1 Metal dispatch)", fused_run),
        static=True,
        check=_pair_check(pair, dtype),
        mode="static" if mode == "static" else "auto",
    )
    return choice.taken, f"q/k norm and rotary: {choice.describe()}; {_STATIC_WHY}"
