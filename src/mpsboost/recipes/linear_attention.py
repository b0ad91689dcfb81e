"""linear_attention: transformers' Gated DeltaNet layers in few ops per decode step; chunked prefill
without ``solve_triangular`` where it is slow.

Targets: every Gated DeltaNet class of transformers 5.24 (Qwen3.5 / 3.6 MoE and dense, Qwen3-Next,
OLMo-Hybrid, LaRA-mini, Qwen4-exp), matched by class path and then checked structurally (projection
shapes, depthwise conv, gated norm, no bias, no accelerate hook): a class that drifts is skipped with
the reason. Without flash-linear-attention and causal-conv1d (CUDA/Triton only: every Mac) transformers
runs its torch reference: one layer's decode step dispatches 103 aten ops (one H200: 1.55 ms wall for
0.085 ms of kernels), host time that dominates on MPS.

Decode (one token with a cache), eager: 43 aten ops per layer instead of 103 (one sequence; 45 for a batch):

- the input projections are one matmul: at patch time their Parameters become views of one fused
  storage (same Parameter objects, same values, same state_dict; memory does not double), and undo gives
  each its own storage back. If something later moves them (``model.to(...)``), the next eager call
  fuses them again; while autograd needs them the stock forward runs;
- the conv state rolls by one copy and the depthwise conv is a multiply-sum (no ``cat``+``conv1d``+slice);
- ``beta`` and the decay ``exp(g)`` come from four elementwise ops (:func:`mpsboost.ops.gated_delta.gates`);
- q/k are L2-normalised, scaled and repeated for the value heads by one product;
- the recurrent state stays float32 in the model's own cache tensor, where stock keeps it, updated in
  place (two ``bmm`` reads, the decay and a rank-one update): stock and patched layers mix.

Prefill: on MPS the chunked rule with the unit lower-triangular solves done by matmuls (block
doubling of the inverse, 6 levels per 64-token chunk; ``solve_triangular`` costs about 15 ms per
call there, gate feature ``solve_triangular_fast``); elsewhere the stock forward.

Exactness (tested): float32 layer outputs within 1e-5 relative of stock, prefill and decode; bfloat16
relative error against a float32 reference no worse than 1.5x stock's (it is lower: the recipe keeps
q/k/v, the gates and the norm in float32 where stock rounds them to bfloat16).

Modes: eager as above. Compiled (``torch.compile`` traces the forward, as transformers' static cache
does): on MPS the same math, traced (weights read from the Parameters, decisions at trace time,
``torch.compiler.is_compiling()``); on CUDA and CPU the stock forward, since no compiled measurement
shows a gain there yet (inductor fuses stock's elementwise ops itself). CUDA with flash-linear-attention
or causal-conv1d importable: skipped, transformers runs those kernels.

Options (``options={"linear_attention": {...}}``): ``prefill`` "auto" | "matmul" | "stock";
``compiled`` "auto" | "recipe" | "stock".

Compiled decoding on a Mac (opt-in, :func:`mac_compile`): transformers compiles the decode step itself
with a static cache (``generate(..., cache_implementation="static")``) on cuda, xpu, neuron and tpu only
(``_valid_auto_compile_criteria``); MPS needs ``CompileConfig._compile_all_devices``. ``mac_compile(model)``
sets that on the model's own generation config, reversibly; nothing does it by default (no Mac
measurement of the compiled mode yet).
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..gate import Env, check
from ..ops import gated_delta as gd
from ..registry import Decision, Match, Recipe, class_path, register
from ..patching import (
    Changes,
    Patch,
    bind_forward,
    call_original,
    fuse_params,
    fuse_storage,
    set_attr,
    set_instance_attr,
)

NAME = "linear_attention"
_STATE = "_mpsboost_linear_attention"
_TM = "transformers.models."
# class path -> family: which projections, norm and output layer it has.
_FAMILIES = {
    _TM + "qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeGatedDeltaNet": "split",
    _TM + "qwen3_5.modeling_qwen3_5.Qwen3_5GatedDeltaNet": "split",
    _TM + "lara_mini.modeling_lara_mini.LaraMiniGatedDeltaNet": "split",
    _TM + "qwen4_exp.modeling_qwen4_exp.Qwen4ExpTextGatedDeltaNet": "split",
    _TM + "qwen3_next.modeling_qwen3_next.Qwen3NextGatedDeltaNet": "qkvz",
    _TM + "olmo_hybrid.modeling_olmo_hybrid.OlmoHybridGatedDeltaNet": "olmo",
}
# Projections in fused row order. "split" and "olmo" give the canonical layout [q | k | v | z | b | a]
# directly; Qwen3-Next interleaves per key head and is gathered into it by one index_select.
_PROJ = {
    "split": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
    "qkvz": ("in_proj_qkvz", "in_proj_ba"),
    "olmo": ("q_proj", "k_proj", "v_proj", "g_proj", "b_proj", "a_proj"),
}
_NORM = {"split": "norm", "qkvz": "norm", "olmo": "o_norm"}
_OUT = {"split": "out_proj", "qkvz": "out_proj", "olmo": "o_proj"}
_SILU = ("silu", "swish")
_CHOICES = {"prefill": ("auto", "matmul", "stock"), "compiled": ("auto", "recipe", "stock")}
_QK_EPS = 1e-6  # transformers' l2norm epsilon (aligned with flash-linear-attention)


@dataclass(frozen=True)
class LinearAttentionOptions:
    """``options={"linear_attention": {...}}`` (see the module docstring)."""

    prefill: str = "auto"
    compiled: str = "auto"


@dataclass(frozen=True)
class _Layout:
    family: str
    hk: int
    hv: int
    dk: int
    dv: int
    width: int  # conv kernel
    hidden: int
    beta_scale: float  # 2.0 where the model allows negative eigenvalues (OLMo-Hybrid option), else 1.0
    norm_eps: float

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
    """What the recipe keeps on one patched layer (an instance attribute, never module-level)."""

    def __init__(self, layout: _Layout, prefill: str, compiled: str, fused: torch.Tensor):
        self.layout = layout
        self.prefill = prefill  # "matmul" or "stock"
        self.compiled = compiled  # "recipe" or "stock"
        self.fused = fused  # [N, hidden]: the storage the projection Parameters are views of
        self.key: tuple | None = None
        self.derived: dict[str, Any] | None = None

    def set_fused(self, fused: torch.Tensor | None) -> None:
        self.fused = fused

    def remember(self, derived: dict[str, Any], key: tuple) -> None:
        self.derived, self.key = derived, key

    def forget(self) -> None:
        """Drop the fused storage and the decode constants (the layer runs the stock forward until fused again)."""
        self.fused = self.derived = self.key = None


# ---------------------------------------------------------------------------- structure


def _family(mod: torch.nn.Module) -> str | None:
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


def _layout(mod: torch.nn.Module) -> _Layout | str:
    """The layer's layout, or why the recipe cannot rely on it."""
    fam = _family(mod)
    if fam is None:
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
    norm = getattr(mod, _NORM[fam], None)
    if (
        getattr(norm, "activation", None) not in _SILU
        or not isinstance(getattr(norm, "variance_epsilon", None), (int, float))
        or tuple(getattr(getattr(norm, "weight", None), "shape", ())) != (dv,)
    ):
        return f"gated norm {type(norm).__name__} is not silu-gated RMSNorm of width {dv}"
    layout = _Layout(
        fam,
        hk,
        hv,
        dk,
        dv,
        width,
        hidden,
        2.0 if getattr(mod, "allow_neg_eigval", False) else 1.0,
        float(norm.variance_epsilon),
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
    for name, rows in zip(_PROJ[fam], layout.widths):
        why = _plain_linear(getattr(mod, name, None), hidden, rows)
        if why:
            return f"{name}: {why}"
        params.append(getattr(mod, name).weight)
    why = _plain_linear(getattr(mod, _OUT[fam], None), hv * dv, hidden)
    if why:
        return f"{_OUT[fam]}: {why}"
    if len({(p.dtype, p.device) for p in params}) != 1 or len({id(p) for p in params}) != len(params):
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
    return [getattr(mod, n).weight for n in _PROJ[layout.family]]


# ---------------------------------------------------------------------------- fused storage


def _fused_views(params: list[torch.nn.Parameter], fused: torch.Tensor | None) -> bool:
    if fused is None:
        return False
    start, step = fused.data_ptr(), fused.shape[1] * fused.element_size()
    for p in params:
        if p.dtype != fused.dtype or p.device != fused.device or p.data_ptr() != start or not p.is_contiguous():
            return False
        start += p.shape[0] * step
    return True


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


def _derive(mod: torch.nn.Module, lay: _Layout, state: _State | None) -> dict[str, Any]:
    """The constants of the decode step, from the layer's current Parameters. Eager mode keeps them until a
    Parameter changes; traced code builds them inside the graph (no state read)."""
    hk, r = lay.hk, lay.r
    a_log, dt = mod.A_log, mod.dt_bias
    dev = a_log.device
    f32 = torch.float32
    dtf = dt.detach().to(f32) if state is not None else dt.to(f32)
    alf = a_log.detach().to(f32) if state is not None else a_log.to(f32)
    conv = mod.conv1d
    d: dict[str, Any] = {
        "z_bias": torch.stack((torch.zeros_like(dtf), -dtf), dim=-1).view(hk, r, 2),
        "z_sign": torch.tensor([1.0, -1.0], dtype=f32, device=dev),
        "e_add": torch.tensor([math.log(lay.beta_scale), 0.0], dtype=f32, device=dev),
        "e_mult": torch.stack((torch.ones_like(alf), torch.exp(alf)), dim=-1).view(hk, r, 2),
        "eps_rep": torch.full((r, 1, 1), _QK_EPS, dtype=f32, device=dev),
        # The query's dk ** -0.5 is folded into the output norm's epsilon (gd.gated_rms_norm).
        "eps_norm": torch.tensor(lay.norm_eps * lay.dk, dtype=f32, device=dev),
        # float32: the multiply-sum then accumulates unrounded products in any model dtype (no cast op).
        "conv_w": conv.weight.view(lay.conv_dim, lay.width).to(f32),
        "conv_b": None if conv.bias is None else conv.bias.to(f32),
        "norm_w": getattr(mod, _NORM[lay.family]).weight,
        "out_wt": getattr(mod, _OUT[lay.family]).weight.t(),
        "perm": _qkvz_perm(lay, dev) if lay.family == "qkvz" else None,
        "wt": None,
    }
    if state is not None:
        d["conv_w"], d["out_wt"], d["norm_w"] = d["conv_w"].detach(), d["out_wt"].detach(), d["norm_w"].detach()
        d["wt"] = state.fused.t()
    return d


def _key(mod: torch.nn.Module, lay: _Layout) -> tuple:
    """Where and at which version every tensor the decode constants come from is: host-side metadata only
    (no aten op, no device sync); eager mode alone calls it."""
    names = (*_PROJ[lay.family], "conv1d", _OUT[lay.family], _NORM[lay.family])
    ts = [getattr(getattr(mod, n, None), "weight", None) for n in names]
    ts += [mod.A_log, mod.dt_bias, getattr(mod.conv1d, "bias", None)]
    return tuple((t.data_ptr(), t._version, t.dtype) if isinstance(t, torch.Tensor) else None for t in ts)


def _eager_derived(mod: torch.nn.Module, state: _State) -> dict[str, Any] | None:
    """The eager decode constants, rebuilt (and the projections fused again) when a Parameter moved or was
    written to since; None when the projections can no longer be fused (stock forward then)."""
    lay = state.layout
    key = _key(mod, lay)
    if key == state.key and state.derived is not None:
        return state.derived
    linears = [(getattr(mod, name, None), lay.hidden, rows) for name, rows in zip(_PROJ[lay.family], lay.widths)]
    linears.append((getattr(mod, _OUT[lay.family], None), lay.hv * lay.dv, lay.hidden))
    if any(_plain_linear(*x) for x in linears) or len({(m.weight.dtype, m.weight.device) for m, _, _ in linears}) != 1:
        state.forget()  # e.g. weights converted by another recipe: free the old storage
        return None
    params = _proj_params(mod, lay)
    if not _fused_views(params, state.fused):
        state.set_fused(fuse_storage(params))
        key = _key(mod, lay)
    with torch.no_grad():
        derived = _derive(mod, lay, state)
    state.remember(derived, key)
    return state.derived


# ---------------------------------------------------------------------------- the forward


def _project(mod: torch.nn.Module, lay: _Layout, d: dict[str, Any], x2: torch.Tensor) -> torch.Tensor:
    """[M, hidden] -> [M, N] in the canonical column order [q | k | v | z | b | a]."""
    if d["wt"] is not None:
        y = torch.mm(x2, d["wt"])
    else:  # traced: read the Parameters (inductor sees the same matmuls as stock)
        y = torch.cat([F.linear(x2, p) for p in _proj_params(mod, lay)], dim=-1)
    return y if d["perm"] is None else y.index_select(-1, d["perm"])


def _decode(
    mod: torch.nn.Module, lay: _Layout, d: dict[str, Any], hs: torch.Tensor, conv_state: torch.Tensor, rec: torch.Tensor
) -> torch.Tensor:
    b = hs.shape[0]
    hk, hv, r, dk, dv, c, n = lay.hk, lay.hv, lay.r, lay.dk, lay.dv, lay.conv_dim, lay.n
    kd, vd = hk * dk, hv * dv
    y = _project(mod, lay, d, hs.reshape(b, lay.hidden))
    o0 = 0  # y and qkv are fresh results (storage offset 0): as_strided views address them directly
    qkv = F.silu(gd.conv_step(conv_state, y.as_strided((b, c, 1), (n, 1, 1), o0), d["conv_w"], d["conv_b"]))
    q0 = 0
    kq = gd.qk_normalize(qkv.as_strided((b, hk, 1, 2, dk), (c, dk, dk, kd, 1), q0), d["eps_rep"])
    e = gd.gates(
        y.as_strided((b, hk, r, 2), (n, r, 1, hv), o0 + 2 * kd + 2 * vd),
        d["z_bias"],
        d["z_sign"],
        d["e_add"],
        d["e_mult"],
    )
    # One sequence (the usual decode): batch and heads merge into one dim, which saves two views.
    lead = (hv,) if b == 1 else (b, hv)
    ls = (dv,) if b == 1 else (c, dv)
    es = (2,) if b == 1 else (2 * hv, 2)
    v = qkv.as_strided((*lead, 1, dv), (*ls, dv, 1), q0 + 2 * kd)
    o = gd.recurrent_step(
        rec, kq, v, e.as_strided((*lead, 1, 1), (*es, 1, 1), 0), e.as_strided((*lead, 1, 1), (*es, 1, 1), 1)
    )
    z = y.as_strided((*lead, 1, dv), ((dv,) if b == 1 else (n, dv)) + (dv, 1), o0 + 2 * kd + vd)
    out = gd.gated_rms_norm(o if b == 1 else o.view(b, hv, 1, dv), z, d["norm_w"], d["eps_norm"], dv)
    return torch.mm(out.view(b, vd).to(hs.dtype), d["out_wt"]).view(b, 1, lay.hidden)


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
    y = _project(mod, lay, d, hs.reshape(b * s, lay.hidden)).view(b, s, lay.n)
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
    norm = getattr(mod, _NORM[lay.family])
    out = norm(o.reshape(-1, dv), z.reshape(-1, dv)).reshape(b, s, vd)
    return getattr(mod, _OUT[lay.family])(out)


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
    conv_state = rec = None
    if not stock and cache is not None:
        conv_state = cache.get_conv_state(self.layer_idx, state_idx=0)
        rec = cache.get_recurrent_state(self.layer_idx, state_idx=0)
    decode = (
        s == 1
        and conv_state is not None
        and rec is not None
        and not cache.is_recording_past(self.layer_idx)
        and rec.dtype == torch.float32
        and rec.is_contiguous()
        and conv_state.is_contiguous()
    )
    if not stock and not decode and state.prefill == "stock":
        stock = True
    d = None
    if not stock:
        d = _derive(self, lay, None) if compiling else _eager_derived(self, state)
    if d is None:
        return call_original(self, NAME, hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    if attention_mask is not None:  # transformers' apply_mask_to_padding_states
        hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
    if decode:
        return _decode(self, lay, d, hidden_states, conv_state, rec)
    return _prefill(self, lay, d, hidden_states, cache, rec, state.prefill)


# ---------------------------------------------------------------------------- the recipe


def _fast_path_packages() -> list[str]:
    """The CUDA kernel packages transformers would call instead of its torch reference."""
    return [p for p in ("fla", "causal_conv1d") if importlib.util.find_spec(p) is not None]


@dataclass(frozen=True)
class LinearAttentionPlan:
    """What one Gated DeltaNet layer gets: its model ``family`` (a key of the families table), the prefill
    path (``"matmul"``: chunked, matmul triangular inverse; ``"stock"``) and what runs while torch.compile
    traces (``"recipe"``: the recipe's forward; ``"stock"``: the module's own)."""

    family: str
    prefill: str
    compiled: str


@register
class LinearAttention(Recipe):
    name = NAME
    summary = (
        "Gated DeltaNet layers: fused projections and a few-op recurrent step at decode; "
        "matmul triangular solves in prefill where solve_triangular is slow"
    )
    targets = tuple(_FAMILIES)
    lossless = True
    reversible = True
    requires = ()
    default = True
    order = 100
    Options = LinearAttentionOptions

    def decide(self, match: Match, env: Env, options: LinearAttentionOptions) -> Decision:
        for field, allowed in _CHOICES.items():
            if getattr(options, field) not in allowed:
                raise ValueError(f"{NAME} option {field!r} must be one of {allowed}, got {getattr(options, field)!r}")
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
        prefill = options.prefill if options.prefill != "auto" else ("stock" if solve.ok else "matmul")
        compiled = (
            options.compiled if options.compiled != "auto" else ("recipe" if env.device_type == "mps" else "stock")
        )
        backing = "fused projections, recurrent step in fp32"
        backing += (
            "; prefill chunked, matmul triangular inverse"
            if prefill == "matmul"
            else "; prefill stock (solve_triangular)"
        )
        why = [
            (
                "eager decode: fused projections, conv roll, gates and state update in few ops "
                "(stock: 103 aten ops per step); "
                f"prefill: {'forced by options' if options.prefill != 'auto' else solve.reason}"
            )
        ]
        if compiled == "recipe":
            why.append(
                "compiled: the recipe's forward, traced (weights read from the Parameters)"
                + ("; on MPS solve_triangular stays slow under compile too" if env.device_type == "mps" else "")
            )
        else:
            why.append("compiled: stock forward (inductor fuses it; no compiled measurement of the recipe's path yet)")
        return Decision.apply(
            backing, "; ".join(why), plan=LinearAttentionPlan(family=lay.family, prefill=prefill, compiled=compiled)
        )

    def apply(self, match: Match, decision: Decision, env: Env, options: LinearAttentionOptions) -> Patch:
        mod = match.module
        lay = _layout(mod)
        if isinstance(lay, str):
            raise RuntimeError(f"{class_path(type(mod))} changed between plan and apply: {lay}")
        with Changes() as ch:
            plan: LinearAttentionPlan = decision.plan
            state = _State(lay, plan.prefill, plan.compiled, None)  # type: ignore[arg-type]
            fused, undo_fuse = fuse_params(
                _proj_params(mod, lay),
                current=lambda: state.fused,
                description=f"{NAME}: projection weights back to their own storage",
            )
            ch.add(undo_fuse)
            state.set_fused(fused)
            ch.add(set_instance_attr(mod, NAME, _STATE, state))
            ch.add(bind_forward(mod, NAME, _forward))
            _eager_derived(mod, state)  # now, not inside the first decode step
        return ch.patch(description=f"{NAME}: restore forward and projection storage")


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
