"""The quantized layer family: one state type, one forward per module kind (linear, experts, embedding), one class
per original class, for every low-bit weight format (MLX affine first).

A layer loaded by :func:`mpsboost.from_pretrained` (or quantised at load) keeps its weights as the file's codes:

* a linear layer holds ``weight`` (uint32 words, ``[N, K * bits / 32]``), ``scales`` and ``biases`` (``[N, K / g]``,
  the file's dtype) as buffers, its ``bias`` as it was;
* an experts module (transformers' fused ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``) holds
  ``gate_up_proj``, ``gate_up_proj_scales``, ``gate_up_proj_biases``, ``down_proj``, ... the same way: the stacks stay
  quantized (no bf16 copy);
* an embedding holds ``weight``, ``scales``, ``biases`` and gathers rows of codes.

Forwards: few rows (a decode step: at most :attr:`AffineState.max_rows`) on the registered operators of
``mpsboost.ops.affine`` where the load decided so (``torch.ops.mpsboost.affine_gemv`` / ``affine_grouped_gemv`` /
``affine_embedding``: mpsboost's Metal kernels on a Mac, their reference elsewhere); otherwise the weights
dequantised per call, then the matmul (the bytes of the dequantised weight: ``N * K * itemsize`` per call, the
routed experts' only for an experts module in eager mode). Dequantisation is exact in float32 (``scales * q +
biases``), rounded once to the compute dtype.

:func:`decode_operand` gives what an eager decode step calls for a quantized linear (:class:`AffineOperand`);
:mod:`mpsboost.quant.operand` is the one place decode recipes read operands from.

Imports neither diffusers nor transformers, nor api, registry or checkpoint modules: the low_bit_weights recipe
(:mod:`.recipe`) and the quantized-weights package (:mod:`mpsboost.quant`: load, quantise at load, save) both use it.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from ...ops.affine_codec import out_fits
from ...ops.affine import take_rows, BITS, GROUP_SIZES, affine_dequantize, affine_gemv, affine_gemv_out, affine_quantize
from ...ops.affine import int4pack_linear, int8pack_linear, to_int4pack, to_int8pack
from ...patching import saved_state
from .paths import DEQUANT, METAL

__all__ = [
    "RECIPE",
    "QParams",
    "AffineState",
    "AffineLinear",
    "AffineEmbedding",
    "AffineOperand",
    "affine_class",
    "affine_state",
    "forward_for",
    "decode_operand",
    "dequantize",
    "quantize",
    "check_params",
    "build_layer",
    "stored_names",
]

# The recipe that owns every low-bit layer (its record on the instance, its report rows).
RECIPE = "low_bit_weights"
AFFINE_BASE_ATTR = "_mpsboost_affine_of"
MAX_ROWS = 4  # the decode kernels' rows (ops/affine.py: 1-4 rows)


@dataclass(frozen=True)
class QParams:
    """How one stored tensor is quantized: MLX affine, ``bits`` per weight, one scale and bias per ``group_size``."""

    bits: int
    group_size: int

    def __post_init__(self) -> None:
        check_params(self.bits, self.group_size)


@dataclass(eq=False, slots=True)
class AffineState:
    """What a low-bit layer's forward reads (fixed when the layer is built; decisions are made at load time)."""

    kind: str  # "linear", "experts" or "embedding"
    params: dict  # stored tensor name -> QParams ("weight"; or "gate_up_proj"/"up_proj" and "down_proj")
    compute_dtype: torch.dtype
    max_rows: int = MAX_ROWS
    kernel: bool = False  # few rows on torch.ops.mpsboost.affine_* (else the reference: dequantise, then matmul)
    backing: str = ""
    source: str = ""
    converted: bool = True
    extra: dict = field(default_factory=dict)
    # a dense linear's few rows on torch's own kernel instead: "int4pack" / "int8pack", reading the layer's
    # non-persistent buffers pack_weight and pack_scales (made by build_layer); "" for none
    pack: str = ""

    def mark_converted(self) -> None:
        self.converted = True


_SCRATCH = 1 << 20  # weights of one quantisation slice (its int64 and float32 scratch: about 40 MiB)


def check_params(bits: int, group_size: int, what: str = "affine quantization") -> None:
    """Raise ValueError naming ``what`` when ``bits`` or ``group_size`` is not one MLX writes."""
    if not isinstance(bits, int) or isinstance(bits, bool) or bits not in BITS:
        raise ValueError(f"{what}: bits={bits!r}; MLX's affine mode takes bits in {list(BITS)}")
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size not in GROUP_SIZES:
        raise ValueError(f"{what}: group_size={group_size!r}; MLX's affine mode takes group sizes {list(GROUP_SIZES)}")


def quantize(w: torch.Tensor, bits: int = 4, group_size: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``mx.quantize(w, group_size, bits)`` (:func:`mpsboost.ops.affine.affine_quantize`, bit for bit): ``(codes
    uint32 [..., K*bits/32], scales, biases [..., K/g])`` in ``w.dtype``, computed a slice of rows at a time so that
    quantising a large stack keeps a bounded scratch (about 40 MiB), not a float32 copy of the tensor."""
    check_params(bits, group_size)
    k = w.shape[-1]
    if k % group_size:
        raise ValueError(f"the last dimension {k} is not a multiple of group_size={group_size}")
    if (k * bits) % 32:
        raise ValueError(f"a row of {k} weights at {bits} bits is not a whole number of 32-bit words")
    lead = w.shape[:-1]
    rows = w.reshape(-1, k)
    n = rows.shape[0]
    out_q = torch.empty(n, k * bits // 32, dtype=torch.uint32, device=w.device)
    out_s = torch.empty(n, k // group_size, dtype=w.dtype, device=w.device)
    out_b = torch.empty_like(out_s)
    step = max(1, _SCRATCH // max(1, k))
    for r0 in range(0, n, step):
        q, s, b = affine_quantize(rows[r0 : r0 + step], bits, group_size)
        out_q[r0 : r0 + step], out_s[r0 : r0 + step], out_b[r0 : r0 + step] = q, s, b
    return out_q.reshape(*lead, -1), out_s.reshape(*lead, -1), out_b.reshape(*lead, -1)


def dequantize(q: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, p: QParams, dtype: torch.dtype):
    """The weights ``[..., N, K]`` in ``dtype``: ``scales * q + biases`` in float32, rounded once."""
    return affine_dequantize(q, scales.float(), biases.float(), p.bits, p.group_size, dtype)


def affine_state(module: torch.nn.Module) -> Optional[AffineState]:
    """The :class:`AffineState` of a low-bit layer, or None."""
    entry = saved_state(module, RECIPE)
    state = entry.get("affine") if entry else None
    return state if isinstance(state, AffineState) else None


def stored_names(kind: str, up: str = "gate_up_proj") -> tuple[str, ...]:
    """The code tensors of a layer of ``kind`` (each with ``<name>_scales``/``<name>_biases``, or ``scales``/
    ``biases`` for ``weight``)."""
    return ("weight",) if kind in ("linear", "embedding") else (up, "down_proj")


def aux_names(name: str) -> tuple[str, str]:
    return ("scales", "biases") if name == "weight" else (f"{name}_scales", f"{name}_biases")


# ------------------------------------------------------------------------------------------ the forwards


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0


def _linear_forward(state: AffineState) -> Callable[..., Any]:
    p = state.params["weight"]

    def forward(self, input, *args, **kwargs):
        q, s, b = self.weight, self.scales, self.biases
        if state.kernel and 0 < _rows(input) <= state.max_rows and input.dtype == state.compute_dtype:
            y = torch.ops.mpsboost.affine_gemv(input, q, s, b, p.bits, p.group_size)
            return y if self.bias is None else y + self.bias
        if state.pack and 0 < _rows(input) <= state.max_rows and input.dtype == state.compute_dtype:
            # torch's own kernel on its packed copy (plain aten calls, branching on the state only: traceable)
            if state.pack == "int4pack":
                y = int4pack_linear(input, self.pack_weight, self.pack_scales, p.group_size)
            else:
                y = int8pack_linear(input, self.pack_weight, self.pack_scales)
            return y if self.bias is None else y + self.bias
        # Prefill (or no kernel): the layer dequantised for this call, N * K * itemsize bytes, then the matmul.
        return F.linear(input, dequantize(q, s, b, p, input.dtype), self.bias)

    return forward


def _embedding_forward(state: AffineState) -> Callable[..., Any]:
    p = state.params["weight"]

    def forward(self, input, *args, **kwargs):
        q, s, b = self.weight, self.scales, self.biases
        if state.kernel:
            return torch.ops.mpsboost.affine_embedding(input, q, s, b, p.bits, p.group_size, state.compute_dtype)
        flat = input.reshape(-1)
        rows = dequantize(take_rows(q, flat), s[flat], b[flat], p, state.compute_dtype)
        return rows.view(*input.shape, rows.shape[-1])

    return forward


def _pairs(self, x, idx, wts, up_name, pu, pd, dtype):
    """Every (token, expert) pair's expert dequantised from the stacks, one batched matmul per projection: the
    decode path without a kernel, and the traceable path of a compiled forward (no host read)."""
    t, k = idx.shape
    flat = idx.reshape(-1)
    up_q = getattr(self, up_name)
    up_s, up_b = getattr(self, up_name + "_scales"), getattr(self, up_name + "_biases")
    w_up = dequantize(take_rows(up_q, flat), up_s[flat], up_b[flat], pu, dtype)  # [P, 2I, H]
    xs = x.repeat_interleave(k, dim=0) if k > 1 else x
    h = torch.bmm(w_up, xs.unsqueeze(-1)).squeeze(-1)
    a = self._apply_gate(h) if getattr(self, "has_gate", True) else self.act_fn(h)
    w_dn = dequantize(
        take_rows(self.down_proj, flat), self.down_proj_scales[flat], self.down_proj_biases[flat], pd, dtype
    )
    o = torch.bmm(w_dn, a.unsqueeze(-1)).squeeze(-1)  # [P, H]
    return (o.view(t, k, -1) * wts.unsqueeze(-1).to(o.dtype)).sum(1)


def _grouped(self, x, idx, wts, up_name, pu, pd):
    """Pairs sorted by expert, offsets computed on the device (no host read), both projections on
    ``torch.ops.mpsboost.affine_grouped_gemv``: the routed experts read in place."""
    t, k = idx.shape
    e = self.down_proj.shape[0]
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=e)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    xs = x.index_select(0, order // k)
    up_q = getattr(self, up_name)
    up_s, up_b = getattr(self, up_name + "_scales"), getattr(self, up_name + "_biases")
    h = torch.ops.mpsboost.affine_grouped_gemv(xs, up_q, up_s, up_b, offs, pu.bits, pu.group_size)
    a = self._apply_gate(h) if getattr(self, "has_gate", True) else self.act_fn(h)
    o = torch.ops.mpsboost.affine_grouped_gemv(
        a, self.down_proj, self.down_proj_scales, self.down_proj_biases, offs, pd.bits, pd.group_size
    )
    out = torch.empty_like(o).index_copy_(0, order, o)
    return (out.view(t, k, -1) * wts.unsqueeze(-1).to(out.dtype)).sum(1)


def _hit(self, x, idx, wts, up_name, pu, pd, dtype):
    """Eager prefill: pairs sorted by expert, each hit expert dequantised once (its bytes only), one matmul per
    projection and expert; the expert counts are read on the host (one read per call)."""
    t, k = idx.shape
    e = self.down_proj.shape[0]
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=e).tolist()
    tok = order // k
    out = torch.zeros(t, x.shape[-1], dtype=dtype, device=x.device)
    wsorted = wts.reshape(-1)[order]
    up_q = getattr(self, up_name)
    up_s, up_b = getattr(self, up_name + "_scales"), getattr(self, up_name + "_biases")
    start = 0
    for ex, n in enumerate(counts):
        if not n:
            continue
        rows = tok[start : start + n]
        h = F.linear(x[rows], dequantize(up_q[ex], up_s[ex], up_b[ex], pu, dtype))
        a = self._apply_gate(h) if getattr(self, "has_gate", True) else self.act_fn(h)
        dn = dequantize(self.down_proj[ex], self.down_proj_scales[ex], self.down_proj_biases[ex], pd, dtype)
        o = F.linear(a, dn) * wsorted[start : start + n].unsqueeze(-1).to(dtype)
        out.index_add_(0, rows, o)
        start += n
    return out


def _experts_forward(state: AffineState) -> Callable[..., Any]:
    up_name = next(n for n in state.params if n != "down_proj")
    pu, pd = state.params[up_name], state.params["down_proj"]

    def forward(self, hidden_states, *args, **kwargs):
        rest = list(args)
        top_k_index = rest.pop(0) if rest else kwargs.pop("top_k_index", kwargs.pop("router_indices", None))
        top_k_weights = rest.pop(0) if rest else kwargs.pop("top_k_weights", kwargs.pop("routing_weights", None))
        shape = hidden_states.shape
        x = hidden_states if hidden_states.dim() == 2 else hidden_states.reshape(-1, shape[-1])
        idx = top_k_index.reshape(x.shape[0], -1)
        wts = top_k_weights.reshape(x.shape[0], -1)
        dtype = x.dtype
        if state.kernel and x.shape[0] <= state.max_rows and dtype == state.compute_dtype:
            out = _grouped(self, x, idx, wts, up_name, pu, pd)
        elif x.shape[0] <= state.max_rows or torch.compiler.is_compiling():
            # torch.compiler.is_compiling() is a constant while dynamo traces: no host read in a compiled forward.
            out = _pairs(self, x, idx, wts, up_name, pu, pd, dtype)
        else:
            out = _hit(self, x, idx, wts, up_name, pu, pd, dtype)
        return out.to(hidden_states.dtype).reshape(shape)

    return forward


def forward_for(state: AffineState) -> Callable[..., Any]:
    """The forward of a low-bit layer with ``state`` (bound on the instance)."""
    return {"linear": _linear_forward, "experts": _experts_forward, "embedding": _embedding_forward}[state.kind](state)


# ------------------------------------------------------------------------------------------ decode operands


class AffineOperand:
    """One quantized linear's few-rows product on ``torch.ops.mpsboost.affine_gemv``, for an eager decode step that
    calls it every token (the protocol of :mod:`mpsboost.quant.operand`): a 2-D input in, a 2-D product out (one
    dispatch); with ``out=`` written into the caller's buffer (``affine_gemv_out``: one dispatch for a contiguous
    input); other calls (more rows, another dtype, a strided
    input of more dims) go to ``layer``. :meth:`beside` stacks two operands' rows into one product (a fused
    projection's columns), where their bits and group sizes agree. No bias."""

    __slots__ = ("layer", "q", "scales", "biases", "params", "max_rows", "dtype")
    writes_out = True

    def __init__(self, layer, q, scales, biases, params: QParams, max_rows: int, dtype: torch.dtype):
        self.layer = layer
        self.q, self.scales, self.biases = q.detach(), scales.detach(), biases.detach()
        self.params = params
        self.max_rows = max_rows
        self.dtype = dtype

    @property
    def out_features(self) -> int:
        return self.q.shape[0]

    def __call__(self, x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        rows = _rows(x)
        if (
            x.dtype != self.dtype
            or x.dim() < 2
            or not 0 < rows <= self.max_rows
            or (x.dim() > 2 and not x.is_contiguous())
        ):
            y = self.layer(x)
            return y if out is None else out.copy_(y.view(out.shape))
        bits, group = self.params.bits, self.params.group_size
        if out is not None and x.is_contiguous() and out_fits(out, x, self.q.shape[0]):  # one dispatch, in place
            return affine_gemv_out(x, self.q, self.scales, self.biases, bits, group, out)
        y = affine_gemv(x, self.q, self.scales, self.biases, bits, group)
        return y if out is None else out.copy_(y.view(out.shape))

    def beside(self, other: Any) -> Optional["AffineOperand"]:
        """One operand for ``self``'s and ``other``'s rows side by side (a copy of both codes: small projections
        only), or None where they differ in kind, bits, group size, K, dtype or scale dtype."""
        if not isinstance(other, AffineOperand) or other.params != self.params or other.dtype != self.dtype:
            return None
        if other.q.shape[1:] != self.q.shape[1:] or other.scales.dtype != self.scales.dtype:
            return None
        a, b = self.layer, other.layer

        def both(x):
            return torch.cat([a(x), b(x)], dim=-1)

        return AffineOperand(
            both,
            torch.cat([self.q, other.q]),
            torch.cat([self.scales, other.scales]),
            torch.cat([self.biases, other.biases]),
            self.params,
            self.max_rows,
            self.dtype,
        )


def decode_operand(module: Any) -> Any:
    """An :class:`AffineOperand` for a quantized linear (no bias) whose few-rows path is the kernel, else ``module``."""
    state = affine_state(module) if isinstance(module, torch.nn.Linear) else None
    if state is None or state.kind != "linear" or not state.kernel or module.bias is not None:
        return module
    return AffineOperand(
        module, module.weight, module.scales, module.biases, state.params["weight"], state.max_rows, state.compute_dtype
    )


# ------------------------------------------------------------------------------------------ building a layer

_HINT = "the weights were stored in low bits; load the model again (from_pretrained, or mpsboost.from_pretrained)"


def _torch_pack(state: AffineState, tensors: dict) -> tuple[AffineState, dict]:
    """``(state, {pack_weight, pack_scales})``: torch's packed copy of a dense linear's codes for ``state.pack``
    on the codes' device, or, where the repack would not be exact (a 4-bit zero ``bias + 8 * scale`` or a scale
    not representable in the compute dtype; an 8-bit layer not in int8pack's format), ``state`` on its static
    path instead (the Metal kernels where the recipe allowed them, else dequantise then matmul), with a warning
    naming why. Codes that ``mx.quantize`` writes repack exactly at 4 bits."""
    import warnings

    from ...errors import UserInputError

    if not state.pack or state.kind != "linear":
        return state, {}
    p = state.params["weight"]
    q, s, b = tensors["weight"], tensors["scales"], tensors["biases"]
    why = None
    if state.pack == "int4pack":
        packed, sz, inexact = to_int4pack(q, s, b, p.group_size, dtype=state.compute_dtype, device_type=q.device.type)
        if inexact:
            why = f"{inexact} group scale(s)/zero(s) of the 4-bit repack are not representable in {state.compute_dtype}"
        pack = {"pack_weight": packed, "pack_scales": sz}
    else:
        try:
            w8, sc = to_int8pack(q, s, b, p.group_size, dtype=state.compute_dtype)
            pack = {"pack_weight": w8, "pack_scales": sc}
        except UserInputError as exc:
            why = str(exc)
    if why is None:
        return state, pack
    kernel = bool(state.extra.get("static_kernel", False))
    static = METAL if kernel else DEQUANT
    warnings.warn(f"low_bit_weights: torch's {state.pack} not taken ({why}); {static} instead", stacklevel=3)
    return dataclasses.replace(state, pack="", kernel=kernel, backing=f"{static} ({state.pack}: {why})"), {}


def build_layer(mod: torch.nn.Module, state: AffineState, tensors: dict, description: str):
    """Put the codes, scales and biases ``tensors`` into ``mod``, swap its class to its low-bit class and bind the
    forward of ``state``: one Patch (irreversible once committed). A dense linear whose decode is torch's
    int4pack/int8pack (``state.pack``) also gets their packed copy, as non-persistent buffers (not saved)."""
    from ...patching import Changes, bind_forward, replace_tensors, swap_class

    base = type(mod)
    state, pack = _torch_pack(state, tensors)
    with Changes() as ch:
        ch.add(
            replace_tensors(
                mod, {**tensors, **pack}, explanation=_HINT, description=description, non_persistent=tuple(pack)
            )
        )
        ch.add(swap_class(mod, RECIPE, affine_class(base)))
        ch.add(bind_forward(mod, RECIPE, forward_for(state), affine=state))
    return ch.patch(reversible=False, description=description)


# ------------------------------------------------------------------------------------------ the classes


def _repr(module: torch.nn.Module) -> str:
    state = affine_state(module)
    if state is None:
        return "low_bit=pending"
    parts = []
    for name, p in state.params.items():
        s = getattr(module, aux_names(name)[0])
        parts.append(f"{name}=affine {p.bits}-bit g{p.group_size} (scales {str(s.dtype).replace('torch.', '')})")
    parts.append(f"compute_dtype={str(state.compute_dtype).replace('torch.', '')}")
    parts.append(f"backing={state.backing}")
    return ", ".join(parts)


class AffineLinear(torch.nn.Linear):
    """A ``torch.nn.Linear`` whose weight is stored as MLX affine low-bit codes with group scales and biases.

    Never constructed: swapped onto a loaded instance (``patching.swap_class``), so that ``print(model)`` shows
    the layer for what it is; ``isinstance(m, torch.nn.Linear)`` still holds; the forward is the instance's own.
    """

    _mpsboost_affine_of = torch.nn.Linear

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {_repr(self)}"


class AffineEmbedding(torch.nn.Embedding):
    """A ``torch.nn.Embedding`` whose table is stored as MLX affine low-bit codes (rows gathered, then dequantised)."""

    _mpsboost_affine_of = torch.nn.Embedding

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {_repr(self)}"


def _experts_repr(self: torch.nn.Module) -> str:
    return _repr(self)


@functools.lru_cache(maxsize=None)
def affine_class(cls: type) -> type:
    """The low-bit class of ``cls``: :class:`AffineLinear`, :class:`AffineEmbedding`, or one subclass per experts
    class (``Affine<Name>``), made once and cached."""
    if cls is torch.nn.Linear:
        return AffineLinear
    if cls is torch.nn.Embedding:
        return AffineEmbedding
    name = f"Affine{cls.__name__}"
    doc = f"{cls.__name__} with its expert stacks stored as MLX affine low-bit codes by mpsboost."
    return type(
        name,
        (cls,),
        {
            "extra_repr": _experts_repr,
            AFFINE_BASE_ATTR: cls,
            "__module__": __name__,
            "__qualname__": name,
            "__doc__": doc,
        },
    )
