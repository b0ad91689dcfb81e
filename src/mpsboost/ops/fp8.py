"""FP8 weight storage: quantise, encode, decode and multiply, on every device.

Format: ``float8_e4m3fn`` codes with float32 scales, one per output row (``rowwise``) or one per
tensor (``tensorwise``; for 3-D expert stacks one per expert). ``scale = amax / 448`` so that the
largest magnitude of a row maps to the largest finite e4m3fn value; values are divided by the scale,
clamped to +-448 (saturation: rounding can never produce a NaN code) and rounded to nearest-even.
An all-zero row gets scale 1.0 (its codes are all zero, so any finite scale decodes to zeros).

Where float8 tensors cannot live on the device (MPS before torch 2.15, pytorch#194074), the same
bytes are stored as ``uint8`` and encoded/decoded here with integer arithmetic on sign, exponent and
mantissa: :func:`encode_e4m3` is bit-identical to ``x.clamp(-448, 448).to(torch.float8_e4m3fn)``
and :func:`decode_e4m3` to ``codes.view(torch.float8_e4m3fn).to(dtype)``, so both storages hold and
compute exactly the same numbers.

Forward paths (chosen per layer by the fp8 recipe's policy, :func:`mpsboost.recipes.fp8.paths.choose_linear_path`,
from the gate, and per call by M, the number of input rows; nothing here asks the gate):

* ``fused`` (CUDA, compute capability >= 8.9, Triton): M <= ``gemv_max_m`` through the fp8 GEMV
  (``torch.ops.mpsboost.fp8_gemv``: fp8 weight loaded, widened and accumulated in fp32 in registers,
  scale and bias in the epilogue); larger M by default dequantise-then-``F.linear`` (the stored
  weights exactly, activations untouched; two plain torch ops, which ``torch.compile`` fuses into one
  kernel), or, with ``activations="fp8"``, one fused
  activation-quantisation kernel (``torch.ops.mpsboost.fp8_quantize_rows``) plus ``torch._scaled_mm``
  with rowwise scales. Quantising activations is not the same math as the stored weights (it adds the
  activations' own rounding to the weights'), so it is an opt-in;
* ``fused`` on MPS (torch 2.7+, where the gate's ``fp8_metal_gemv`` passes and, on a real Mac, the kernel's
  patch-time self-check, :func:`mpsboost.recipes.fp8.paths.metal_verdict`): M <= 4 through the same
  ``torch.ops.mpsboost.fp8_gemv``, whose
  MPS kernel is mpsboost's own Metal GEMV (:mod:`mpsboost.ops.fp8_metal`: activations as they are, the weight read
  once as its fp8 bytes, float8 or uint8 storage alike); larger M dequantise then ``F.linear``;
* ``mps_scaled_mm`` (MPS with option ``mps_kernel="scaled_mm"``, where the gate's ``fp8_gemv`` says the few-rows
  kernels exist: torch 2.15's ``scaled_mm_few_rows_{1..4}``, tensorwise or rowwise scales, K and N multiples
  of 16): for M <= 4 the activation is quantised per row (:func:`quantize_rows_few`: five dispatches, once per
  input tensor) and ``torch.nn.functional.scaled_mm`` (``aten::_scaled_mm_v2``, the one fp8 matmul with an MPS
  kernel in the 2.15.0 wheel: see :func:`scaled_mm_v2`) reads the weight once as its fp8 bytes; otherwise
  dequantise then ``F.linear``;
* ``dequant`` (everything else): dequantise this one layer to the compute dtype, then ``F.linear``.

The Triton kernels are registered operators (``torch.library.custom_op`` with ``register_fake``), so
``torch.compile`` traces a fused forward as opaque calls of known output shape: their CUDA kernels
launch Triton (:mod:`mpsboost.ops.fp8_triton`, imported on the first CUDA call only), every other device
runs the plain-torch reference below with the same numerics, so CPU tests compile the CUDA path. All
host-side work (autotuning of launch configurations, the ``scaled_mm`` bias probe) happens at patch time
or inside the operator's eager body, never in traced code.

This module never imports diffusers or transformers, and imports Triton only on the fused path.
"""

from __future__ import annotations

import functools
import math
import threading
import weakref
from typing import Optional

import torch
import torch.nn.functional as F


__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "GRANULARITIES",
    "STORAGES",
    "encode_e4m3",
    "decode_e4m3",
    "compute_scale",
    "quantize",
    "dequantize",
    "fp8_linear",
    "quantize_rows",
    "quantize_rows_few",
    "concat_rows",
    "scaled_mm_few_rows",
    "scaled_mm_v2",
    "few_rows_ok",
    "FEW_ROWS_MAX",
    "scaled_mm_rowwise",
    "scaled_mm_bias_supported",
    "fp8_gemv",
    "fp8_gemv_out",
    "fp8_gemv_reference",
    "fused_quantize_rows",
    "stored_bytes",
    "sqnr_db",
]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
GRANULARITIES = ("rowwise", "tensorwise")
STORAGES = ("float8", "uint8")

# Quantisation works on slices of at most this many elements, so that its float32 scratch stays
# small next to the layer (the conversion-peak promise: model size + one layer). 8 MiB of float32: under
# glibc's largest mmap threshold (32 MiB), so on Linux the heap serves the next layer's scratch from pages
# already mapped instead of mapping fresh ones.
_CHUNK_ELEMENTS = 1 << 21


# --------------------------------------------------------------------------------- integer codecs


def encode_e4m3(x: torch.Tensor) -> torch.Tensor:
    """float32 (or any float) -> uint8 e4m3fn codes with integer ops; saturating, round-to-nearest-even.

    Bit-identical to ``x.float().clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)``; NaN
    gives the NaN code 0x7F (with the sign bit of the NaN). Runs where float8 tensors cannot exist.
    """
    xf = x.float()
    neg = torch.signbit(xf)
    a = xf.abs().clamp_(max=FP8_MAX)  # NaN stays NaN through clamp
    bits = a.view(torch.int32)
    # Normal range (|x| >= 2^-6): rebias the exponent (127 -> 7) and round the 23-bit mantissa to 3
    # bits, nearest-even: add 0x7FFFF plus the lowest kept bit, then drop 20 bits (as c10 does).
    normal = (bits + ((7 - 127) << 23) + 0x7FFFF + ((bits >> 20) & 1)) >> 20
    # Subnormal range: the code is |x| / 2^-9 rounded half-to-even (torch.round), 0..8; 8 is the
    # smallest normal, whose code is indeed 8 (exponent 1, mantissa 0).
    sub = torch.round(a * 512.0).to(torch.int32)
    code = torch.where(bits < (121 << 23), sub, normal)
    code = torch.where(torch.isnan(a), torch.full_like(code, 0x7F), code)
    code = code | (neg.to(torch.int32) << 7)
    return code.to(torch.uint8)


def decode_e4m3(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 e4m3fn codes -> ``dtype`` with integer ops on sign, exponent and mantissa.

    Bit-identical to ``codes.view(torch.float8_e4m3fn).to(dtype)`` for every code (NaN codes decode
    to NaN). 16-bit outputs are built in 16-bit integers (the bytes of one layer, not four times them).
    """
    if codes.dtype != torch.uint8:
        raise TypeError(f"decode_e4m3 takes uint8 codes, got {codes.dtype}")
    if dtype == torch.float32:
        itype, exp_shift, bias, mant_shift = torch.int32, 23, 127, 20
    elif dtype == torch.bfloat16:
        itype, exp_shift, bias, mant_shift = torch.int16, 7, 127, 4
    elif dtype == torch.float16:
        itype, exp_shift, bias, mant_shift = torch.int16, 10, 15, 7
    else:
        raise TypeError(f"decode_e4m3 decodes to float32, bfloat16 or float16, not {dtype}")
    c = codes.to(itype)
    mag = c & 0x7F
    # Normal codes: exponent e (bias 7) becomes e - 7 + bias; the 3 mantissa bits move to the top of
    # the target mantissa. Adding (bias - 7) << exp_shift to the shifted magnitude does both at once.
    val = ((mag << mant_shift) + ((bias - 7) << exp_shift)).view(dtype)
    # Exponent 0: subnormal, value = mantissa * 2^-9, exact in every target dtype.
    val = torch.where(mag < 8, mag.to(dtype) * (2.0**-9), val)
    val = torch.where(mag == 0x7F, torch.full_like(val, float("nan")), val)
    return torch.where((c & 0x80) != 0, -val, val)


# --------------------------------------------------------------------------------- quantisation


def _check_args(granularity: str, storage: str) -> None:
    if granularity not in GRANULARITIES:
        raise ValueError(f"fp8 granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if storage not in STORAGES:
        raise ValueError(f"fp8 storage must be one of {STORAGES}, got {storage!r}")


def _slices(n: int, per: int):
    step = max(1, per)
    for start in range(0, n, step):
        yield slice(start, min(n, start + step))


def compute_scale(w: torch.Tensor, granularity: str, *, k_dim: int = -1) -> torch.Tensor:
    """float32 scales of ``w`` (2-D ``[N, K]`` or 3-D ``[E, N, K]``; ``k_dim`` is the reduced input dim).

    rowwise: one per output row (``k_dim`` reduced, kept as size 1); tensorwise: one per 2-D matrix
    (shape ``()`` for 2-D, ``[E, 1, 1]`` for 3-D). amax is taken in the weight's own dtype (exact).
    """
    if w.dim() not in (2, 3):
        raise ValueError(f"fp8 weights are 2-D [N, K] or 3-D [E, N, K]; got shape {tuple(w.shape)}")
    k_dim = k_dim % w.dim()
    if k_dim == 0:
        raise ValueError("k_dim 0 would mix rows of different outputs; the reduced dim is 1 or 2")

    # max |w| as max(amax, -amin): two reductions that allocate only their result (abs() would copy the
    # weight; vector_norm(inf) reads it at a third of their speed on the CPU). Exact, NaN propagated.
    def absmax(*dims: int) -> torch.Tensor:
        return torch.maximum(w.amax(dim=dims, keepdim=True), w.amin(dim=dims, keepdim=True).neg())

    if granularity == "rowwise":
        amax = absmax(k_dim)
    elif granularity == "tensorwise":
        amax = absmax(1, 2) if w.dim() == 3 else absmax(0, 1).reshape(())
    else:
        raise ValueError(f"fp8 granularity must be one of {GRANULARITIES}, got {granularity!r}")
    amax = amax.float()
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))


def quantize(
    w: torch.Tensor,
    granularity: str = "rowwise",
    storage: str = "float8",
    *,
    k_dim: int = -1,
    out_device: "torch.device | str | None" = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``w`` to (codes, float32 scale); codes are float8_e4m3fn or (``storage="uint8"``) their bytes.

    Works slice by slice in one float32 scratch of at most ``_CHUNK_ELEMENTS``, so the only new memory of
    substance is the 1-byte codes. ``out_device`` puts the codes elsewhere (e.g. CPU for saving).
    """
    _check_args(granularity, storage)
    if not w.is_floating_point() or w.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"quantize takes a float32/bfloat16/float16 weight, got {w.dtype}")
    scale = compute_scale(w, granularity, k_dim=k_dim)
    dev = torch.device(out_device) if out_device is not None else w.device
    qdtype = FP8_DTYPE if storage == "float8" else torch.uint8
    q = torch.empty(w.shape, dtype=qdtype, device=dev)
    # Slice along dim 0 (rows of a matrix, experts of a stack); scales broadcast per slice. One float32
    # scratch serves every slice: w / scale is computed into it (type promotion: in float32, as
    # w.float() / scale, without the float32 copy), clamped in place and cast into the codes, so a
    # layer costs one scratch allocation instead of three per slice (fresh pages each on Linux, where
    # allocations this large are mapped and unmapped every time).
    per = max(1, _CHUNK_ELEMENTS // max(1, w[0].numel()))
    scratch = torch.empty((min(per, w.shape[0]), *w.shape[1:]), dtype=torch.float32, device=w.device)
    for s in _slices(w.shape[0], per):
        # A 0-dim scale would not take part in type promotion (the quotient computed in w's dtype).
        sc = scale.reshape(1) if scale.dim() == 0 else scale[s]
        y = torch.div(w[s], sc, out=scratch[: s.stop - s.start]).clamp_(-FP8_MAX, FP8_MAX)
        q[s].copy_(y if storage == "float8" else encode_e4m3(y))
    return q, scale


def widen(q: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """fp8 codes (``float8_e4m3fn``, or their bytes as ``uint8``) -> ``dtype`` (float32, bfloat16 or
    float16), exactly: every e4m3 value (3 mantissa bits, 2^-9 .. 448) is a value of each of them."""
    if q.dtype == torch.uint8:
        return decode_e4m3(q, dtype)
    if q.dtype == FP8_DTYPE:
        return q.to(dtype)
    raise TypeError(f"fp8 weights are float8_e4m3fn or uint8 codes, got {q.dtype}")


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Codes and scale -> a ``dtype`` tensor of the same shape (one layer at a time, never a model):
    ``code * scale`` in float32, rounded once. (A bf16 or fp16 copy of the scale would move every weight
    of the row, or of the whole tensor, by the same up to 2^-9: a systematic error that compounds over
    layers, 2.7e-3 relative on a 2-block Qwen-Image transformer, 1.6e-2 on 16 blocks at real width.)

    The codes are widened straight to ``dtype`` (exact) and multiplied in place by the float32 scale:
    type promotion computes each product in float32 and rounds it once into ``dtype``, so the result
    is bit for bit that of ``codes.float() * scale`` without a float32 copy of the layer on CUDA and
    MPS (CPU's TensorIterator still makes one) and with 7 bytes of traffic per weight instead of 19.
    Two dispatches of a few microseconds each: a one-pass Triton kernel (3 bytes per weight) cut the
    GPU time of an eager forward but made the call slower, its launcher adding host time per layer to a
    host-bound forward (the profile records in benchmarks/results); under torch.compile these two ops fuse into
    one kernel anyway."""
    s = scale.float()
    if s.dim() == 0:
        # A 0-dim tensor does not take part in type promotion: the product would be computed in
        # ``dtype`` with a rounded copy of the scale. One dimension makes it count.
        s = s.reshape(1)
    return widen(q, dtype).mul_(s)


def stored_bytes(*tensors: Optional[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def sqnr_db(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Signal-to-quantisation-noise ratio of ``x`` against ``ref`` in dB (float64)."""
    r = ref.double()
    noise = (x.double() - r).pow(2).sum().item()
    signal = r.pow(2).sum().item()
    if noise == 0:
        return math.inf
    return 10.0 * math.log10(signal / noise) if signal > 0 else -math.inf


# --------------------------------------------------------------------------------- activations


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rowwise fp8 quantisation of a 2-D activation in plain torch ops: (codes [M, K], scales [M, 1]).

    The fused CUDA path runs one Triton kernel instead (:func:`fused_quantize_rows`); this is its reference.
    """
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


# Smallest activation scale: a row of zeros quantises to zero codes instead of 0/0.
_TINY_SCALE = 2.0**-120
FEW_ROWS_MAX = 4  # rows at or below which MPS runs scaled_mm_few_rows_{1..4} (pytorch#197862, torch 2.15)
FEW_ROWS_ALIGN = 16  # K and N of the MPS scaled_mm kernels must be multiples of this
_FEW_ROWS_OUT = (torch.bfloat16, torch.float16, torch.float32)  # its output types besides float8


class _LastQuantised(threading.local):
    """The last few activations :func:`quantize_rows_few` quantised, per thread, each held weakly with its
    version counter: q, k and v (or a shared expert's gate and up, and the routed experts after its down
    projection) read the same input tensor, which is then quantised once. Eager only; traced code never reads
    it (torch.compile merges the repeats itself). Holds no module and no input alive."""

    def __init__(self) -> None:
        self.entries: list = []  # (weakref to the input, its version, (codes, scales)), newest last


_LAST = _LastQuantised()
_LAST_KEPT = 3


def quantize_rows_few(x: torch.Tensor, key: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rowwise fp8 quantisation of the rows of an activation (any number of leading dims) in 5 dispatches:
    (codes [M, K], scales [M, 1]).

    One ``linalg_vector_norm(ord=inf)`` gives every row's amax in float32 (no ``abs`` copy), ``div_`` and
    ``clamp_min_`` make it a scale (a zero row gets a tiny scale, so its codes are zeros, not NaN), then one
    division and one cast. ``|x / scale| <= 448`` up to one rounding, which the cast keeps finite
    (e4m3fn rounds values below 464 to 448). In eager mode the last inputs quantised are remembered (weakly,
    with their version counters): the next linear layer reading the very same tensor reuses the codes without a
    single dispatch (the lookup comes before the reshape to 2-D). ``key`` is the tensor to remember when ``x`` is
    a fresh view of it."""
    key = x if key is None else key
    # Inference tensors keep no version counter (torch.inference_mode): nothing is remembered for them.
    eager = not torch.compiler.is_compiling() and type(key) is torch.Tensor and not key.is_inference()
    if eager:
        for ref, version, out in _LAST.entries:
            if ref() is key and version == key._version:
                return out
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    amax = torch.linalg.vector_norm(x2, float("inf"), dim=-1, keepdim=True, dtype=torch.float32)
    xs = amax.div_(FP8_MAX).clamp_min_(_TINY_SCALE)
    xq = (x2 / xs).to(FP8_DTYPE)
    if eager:
        _LAST.entries = [e for e in _LAST.entries[-(_LAST_KEPT - 1) :] if e[0]() is not None]
        _LAST.entries.append((weakref.ref(key), key._version, (xq, xs)))
    return xq, xs


def concat_rows(parts: "list[tuple[torch.Tensor, torch.Tensor]]") -> tuple[torch.Tensor, torch.Tensor]:
    """Linear layers of one input fused along their outputs: codes ``[N_i, K]`` and their rowwise (``[N_i, 1]``)
    or tensorwise (``[]``) scales -> codes ``[sum N_i, K]`` and rowwise scales ``[sum N_i, 1]``, exactly (a tensor
    scale is the scale of each of its rows). For a recipe that fuses projections (e.g. a Gated DeltaNet's
    ``in_proj_*``): then one :func:`fp8_linear` quantises the input once and reads every code once. Block scales
    are not accepted here (their rows join only at whole blocks)."""
    if not parts:
        raise ValueError("concat_rows needs at least one (codes, scale) pair")
    codes, scales = [], []
    for q, s in parts:
        if q.dim() != 2 or q.dtype not in (FP8_DTYPE, torch.uint8):
            raise TypeError(f"concat_rows takes 2-D float8_e4m3fn or uint8 codes, got {q.dtype} {tuple(q.shape)}")
        n = q.shape[0]
        if s.numel() == 1:
            s = s.float().reshape(1, 1).expand(n, 1)
        elif tuple(s.shape) in ((n, 1), (n,)):
            s = s.float().reshape(n, 1)
        else:
            raise ValueError(f"concat_rows takes rowwise [N, 1] or tensorwise scales; got {tuple(s.shape)} for N={n}")
        codes.append(q)
        scales.append(s)
    if len({(q.dtype, q.shape[1]) for q in codes}) != 1:
        raise ValueError("concat_rows: every part must have the same code dtype and input size K")
    return torch.cat(codes), torch.cat(scales).contiguous()


def few_rows_ok(n: int, k: int, dtype: torch.dtype) -> bool:
    """Static facts for the MPS few-rows ``scaled_mm``: K and N multiples of 16 and an output type it writes."""
    return n % FEW_ROWS_ALIGN == 0 and k % FEW_ROWS_ALIGN == 0 and dtype in _FEW_ROWS_OUT


def scaled_mm_v2(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    bias: Optional[torch.Tensor],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``(a * scale_a) @ (b * scale_b) + bias`` with rowwise scales (``[M, 1]`` and ``[1, N]``) through
    ``torch.nn.functional.scaled_mm``, i.e. ``aten::_scaled_mm_v2``: the only fp8 matmul MPS has.

    The released torch 2.15.0 macOS wheel registers ``aten::_scaled_mm`` (``torch._scaled_mm``) for CPU only; on MPS
    only ``aten::_scaled_mm_v2`` has a kernel (``wrapper_MPS__scaled_mm_v2`` in ``torch/lib/libtorch_cpu.dylib``, no
    ``wrapper_MPS___scaled_mm``; its errors read "MPS _scaled_mm_v2 only supports TensorWise or RowWise scaling with
    one Float scale per operand" and "supports Float, Half, BFloat16 and Float8_e4m3fn outputs"; the wheel's facts
    are in ``mpsboost/data/mps_wheels.json``). So every MPS call goes through here, never ``torch._scaled_mm``. CPU
    runs the same operator (how the tests exercise it); CUDA keeps ``torch._scaled_mm`` and the Triton kernels."""
    rw = F.ScalingType.RowWise
    return F.scaled_mm(a, b, scale_a, rw, scale_b, rw, bias=bias, output_dtype=out_dtype)


def _scale_row(scale: torch.Tensor, n: int) -> torch.Tensor:
    """A weight's scale (rowwise ``[N, 1]`` or tensorwise ``[]``) as scaled_mm's rowwise ``scale_b [1, N]``."""
    if scale.numel() == n and scale.dim() > 0:
        return scale.view(1, n)
    return scale.reshape(1, 1).expand(1, n).contiguous()


def scaled_mm_few_rows(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    bias: Optional[torch.Tensor],
    *,
    bias_in_mm: bool = True,
    key: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``x [..., K] @ (q [N, K] * scale).T + bias`` by :func:`scaled_mm_v2` with rowwise scales, in ``x.dtype``,
    shaped ``[..., N]``: the activation quantised per row (:func:`quantize_rows_few`, or its remembered codes), the
    weight read once as its fp8 bytes. On MPS (torch 2.15+) M <= 4 runs the few-rows kernels
    ``scaled_mm_few_rows_{1..4}``. Dispatches: 5 for a new input (3 when its codes are remembered), plus the
    quantisation's 5 (6 with a reshape) for a new one."""
    n = q.shape[0]
    xq, xs = quantize_rows_few(x, key)
    ws = _scale_row(scale, n)
    in_mm = bias is not None and bias_in_mm and bias.dtype == x.dtype and x.dtype != torch.float32
    y = scaled_mm_v2(xq, q.t(), xs, ws, bias if in_mm else None, x.dtype)
    if bias is not None and not in_mm:
        y = y + bias
    return y if x.dim() == 2 else y.view(*x.shape[:-1], n)


class FewRowsOperand:
    """One fp8 linear's few-rows product, prepared once for an eager decode step that calls it every token.

    What the layer's own forward does at few rows on MPS 2.15 (:func:`scaled_mm_few_rows`): the input
    quantised per row (:func:`quantize_rows_few`, remembered between the layers that read one input), then
    one :func:`scaled_mm_v2`. The transposed codes ``[K, N]`` and the rowwise scale ``[1, N]`` are views
    (a tensor scale: one ``[1, N]`` copy) made here instead of at every call: two dispatches fewer per
    product (``t`` and the scale's ``view``), the same kernels, the same result bit for bit. Other calls
    (more rows, another dtype) go to the layer. A recipe keeps it with its other eager constants, rebuilt
    when the layer's codes or scales change (it watches them); traced code never sees it."""

    __slots__ = ("layer", "wt", "scale_row", "max_rows", "dtype")

    def __init__(self, layer: torch.nn.Module, q: torch.Tensor, scale: torch.Tensor, max_rows: int, dtype: torch.dtype):
        self.layer = layer
        self.wt = q.detach().t()
        self.scale_row = _scale_row(scale.detach(), q.shape[0])
        self.max_rows = max_rows
        self.dtype = dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.dtype or x.dim() < 2 or not 0 < _rows(x) <= self.max_rows:
            return self.layer(x)
        xq, xs = quantize_rows_few(x)  # [M, K] (a reshape of more dims inside, remembered under x)
        y = scaled_mm_v2(xq, self.wt, xs, self.scale_row, None, x.dtype)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[-1])


def fp8_gemv_reference(
    x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor]
) -> torch.Tensor:
    """The fp8 GEMV's numerics in plain torch: the weight dequantised as :func:`dequantize` does (codes x
    scale in fp32, rounded once to ``x.dtype``), then ``F.linear`` (fp32 sums, bias, one rounding). So the
    GEMV and the dequantise-then-linear path of large batches compute the same function of the file."""
    n = w.shape[0]
    return F.linear(
        x, dequantize(w, scale.reshape(n, 1) if scale.numel() == n and n > 1 else scale.reshape(()), x.dtype), bias
    )


@torch.library.custom_op("mpsboost::fp8_gemv", mutates_args=())
def _fp8_gemv_op(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return fp8_gemv_reference(x, w, scale, bias)


@functools.lru_cache(maxsize=None)
def _have_triton() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


@_fp8_gemv_op.register_kernel("cuda")
def _fp8_gemv_cuda(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    # The recipe chooses this path only where the gate found triton; a direct caller without it still
    # gets the right numbers (the operator's eager body, never traced).
    if not _have_triton():
        return fp8_gemv_reference(x, w, scale, bias)
    from . import fp8_triton

    if x.dim() != 2:  # the Triton kernel takes rows; the operator, any leading dims
        return fp8_triton.fp8_gemv(x.reshape(-1, x.shape[-1]), w, scale, bias).view(*x.shape[:-1], w.shape[0])
    return fp8_triton.fp8_gemv(x, w, scale, bias)


@_fp8_gemv_op.register_kernel("mps")
def _fp8_gemv_mps(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    # mpsboost's Metal kernel (mpsboost.ops.fp8_metal): the activation as it is, each weight read once as its fp8
    # byte. The recipe chooses this path only where its metal_verdict allowed it (compiled and checked on this Mac).
    from . import fp8_metal

    y = fp8_metal.dense(x, w, *fp8_metal.dense_scale(scale, *w.shape))
    if y is None:
        return fp8_gemv_reference(x, w, scale, bias)
    return y if bias is None else y.add_(bias)


def check_out_size(x: torch.Tensor, n: int, out: torch.Tensor, op: str) -> None:
    """Raise ValueError unless ``out`` has the element count of the product of ``x [..., K]`` with ``n`` outputs: what
    the ``_out`` operators take on every device (the product is then viewed as ``out``'s shape; on MPS the Metal
    kernel writes there, and a shorter ``out`` would be written past its end)."""
    k = x.shape[-1]
    r = x.numel() // k if k else math.prod(x.shape[:-1])
    if out.numel() != r * n:
        raise ValueError(
            f"{op}: out {list(out.shape)} has {out.numel()} elements; x {list(x.shape)} times {n} outputs is a "
            f"[{r}, {n}] product ({r * n} elements)"
        )


@torch.library.custom_op("mpsboost::fp8_gemv_out", mutates_args=("out",))
def _fp8_gemv_out_op(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    check_out_size(x, w.shape[0], out, "mpsboost::fp8_gemv_out")
    out.copy_(fp8_gemv_reference(x, w, scale, None).view(out.shape))


@_fp8_gemv_out_op.register_kernel("cuda")
def _fp8_gemv_out_cuda(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    check_out_size(x, w.shape[0], out, "mpsboost::fp8_gemv_out")
    out.copy_(_fp8_gemv_cuda(x, w, scale, None).view(out.shape))


@_fp8_gemv_out_op.register_kernel("mps")
def _fp8_gemv_out_mps(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    from . import fp8_metal

    check_out_size(x, w.shape[0], out, "mpsboost::fp8_gemv_out")
    if fp8_metal.dense(x, w, *fp8_metal.dense_scale(scale, *w.shape), out=out) is None:
        out.copy_(fp8_gemv_reference(x, w, scale, None).view(out.shape))


@_fp8_gemv_out_op.register_fake
def _fp8_gemv_out_fake(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    return None


@_fp8_gemv_op.register_fake
def _fp8_gemv_fake(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], w.shape[0]))


@torch.library.custom_op("mpsboost::fp8_quantize_rows", mutates_args=())
def _quantize_rows_op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_rows(x)


@_quantize_rows_op.register_kernel("cuda")
def _quantize_rows_cuda(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # scaled_grouped_mm experts use this too, and their gate does not ask for triton.
    if not _have_triton():
        return quantize_rows(x)
    from . import fp8_triton

    return fp8_triton.quantize_rows(x)


@_quantize_rows_op.register_fake
def _quantize_rows_fake(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    return x.new_empty((m, k), dtype=FP8_DTYPE), x.new_empty((m, 1), dtype=torch.float32)


def _eager_on(x: torch.Tensor, device_type: str) -> bool:
    """Whether a call may go straight to an operator's kernel for ``device_type`` ("cuda", "mps"): eager, a plain
    tensor on that device, nothing to differentiate. The dispatcher of a ``custom_op`` costs about 20 us of host
    time per call, which an eager forward pays once per layer (224 layers in a 16-block Qwen-Image transformer; on
    a Mac every fp8 projection of a decode step); tracing (torch.compile, export), tensor subclasses (fake,
    functional, distributed tensors of any tracer) and autograd (the operators have no backward: they raise) still
    go through the registered operator."""
    # is_compiling() first: under dynamo it is a constant True and nothing after it is traced.
    return (
        not torch.compiler.is_compiling()
        and type(x) is torch.Tensor
        and x.device.type == device_type
        and not (x.requires_grad and torch.is_grad_enabled())
    )


def _eager_cuda(x: torch.Tensor) -> bool:
    return _eager_on(x, "cuda")


def _eager_mps(x: torch.Tensor) -> bool:
    return _eager_on(x, "mps")


def fp8_gemv(
    x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """``x [M, K] @ (w [N, K] fp8 * scale).T + bias`` in ``x.dtype``: ``torch.ops.mpsboost.fp8_gemv``."""
    if _eager_cuda(x):
        return _fp8_gemv_cuda(x, w, scale, bias)
    if _eager_mps(x):
        return _fp8_gemv_mps(x, w, scale, bias)
    return torch.ops.mpsboost.fp8_gemv(x, w, scale, bias)


def fp8_gemv_out(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """:func:`fp8_gemv` without a bias, written into ``out`` (``[M, N]``, e.g. the columns of a wider buffer):
    ``torch.ops.mpsboost.fp8_gemv_out``. On MPS the Metal kernel writes there; elsewhere a copy."""
    if _eager_mps(x):
        _fp8_gemv_out_mps(x, w, scale, out)
    else:
        torch.ops.mpsboost.fp8_gemv_out(x, w, scale, out)
    return out


def fused_quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_rows` as ``torch.ops.mpsboost.fp8_quantize_rows`` (one Triton kernel on CUDA)."""
    if _eager_cuda(x):
        return _quantize_rows_cuda(x)
    return torch.ops.mpsboost.fp8_quantize_rows(x)


# --------------------------------------------------------------------------------- forward paths


def metal_ok(k: int, dtype: torch.dtype) -> bool:
    """Static facts for mpsboost's Metal fp8 GEMV (:mod:`mpsboost.ops.fp8_metal`): K a multiple of 16 and an
    activation dtype it has."""
    return k % 16 == 0 and dtype in (torch.float32, torch.bfloat16, torch.float16)


def gemv_contenders(n: int, k: int, dtype: torch.dtype, *, rows: int = 1, device: str = "mps") -> tuple:
    """``(stock_run, metal_run)`` at one ``[n, k]`` layer's decode shape (``rows`` activations in ``dtype``), for
    :func:`mpsboost.ondevice.choose`: ``stock_run`` makes one product by torch's own few-rows fp8 kernels
    (``mps_scaled_mm``: the activation quantised per row, then ``F.scaled_mm``), ``metal_run`` one by mpsboost's
    Metal fp8 GEMV (``fused``), both on the same random codes and rowwise scales on ``device``, made at the first
    call (nothing is allocated where nothing is timed). The Metal kernel's correctness is its own self-check's
    (:func:`mpsboost.recipes.fp8.paths.metal_verdict`), taken before this is asked."""
    made: list[tuple] = []

    def inputs() -> tuple:
        if not made:
            g = torch.Generator().manual_seed(0)
            w = torch.randn(n, k, generator=g) * 0.05
            q, scale = quantize(w, "rowwise")
            x = torch.randn(rows, k, generator=g).to(dtype)
            made.append((x.to(device), q.to(device), scale.to(device)))
        return made[0]

    def stock() -> torch.Tensor:
        x, q, scale = inputs()
        return fp8_linear(x, q, scale, None, kind="mps_scaled_mm", compute_dtype=dtype, gemv_max_m=FEW_ROWS_MAX)

    def metal() -> torch.Tensor:
        x, q, scale = inputs()
        return fp8_linear(x, q, scale, None, kind="fused", compute_dtype=dtype, gemv_max_m=FEW_ROWS_MAX)

    return stock, metal


@functools.lru_cache(maxsize=None)
def scaled_mm_bias_supported(device: str, api: str = "v1") -> bool:
    """Patch-time probe: does this torch build take a bias together with rowwise scales in its fp8 matmul on
    ``device`` (a device string such as ``"cuda:0"``)? ``api`` is the function the layer's forward calls:
    ``"v1"`` ``torch._scaled_mm`` (CUDA), ``"v2"`` :func:`scaled_mm_v2` (``F.scaled_mm``, the MPS path). Some builds
    refuse the bias; it is then added after the product. One tiny call per device, api and process, never inside a
    forward."""
    if api not in ("v1", "v2"):
        raise ValueError(f"scaled_mm_bias_supported(api={api!r}): accepted are 'v1' and 'v2'")
    dev = torch.device(device)
    a = torch.zeros(16, 16, device=dev).to(FP8_DTYPE)
    b = torch.zeros(16, 16, device=dev).to(FP8_DTYPE)
    ones_a = torch.ones(16, 1, device=dev)
    ones_b = torch.ones(1, 16, device=dev)
    bias = torch.zeros(16, device=dev, dtype=torch.bfloat16)
    try:
        if api == "v2":
            scaled_mm_v2(a, b.t(), ones_a, ones_b, bias, torch.bfloat16)
        else:
            torch._scaled_mm(a, b.t(), scale_a=ones_a, scale_b=ones_b, bias=bias, out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


def scaled_mm_rowwise(
    xq: torch.Tensor,
    q: torch.Tensor,
    xs: torch.Tensor,
    scale: torch.Tensor,
    bias: Optional[torch.Tensor],
    *,
    bias_in_mm: bool = True,
) -> torch.Tensor:
    """``torch._scaled_mm`` of row-quantised activations ``[M, K]`` and a weight ``[N, K]`` (any scales), bf16 out.

    ``bias_in_mm`` is :func:`scaled_mm_bias_supported` of the device, decided at patch time.
    """
    n = q.shape[0]
    ws = (
        scale.reshape(1, n) if scale.numel() == n and scale.dim() > 0 else scale.reshape(1, 1).expand(1, n).contiguous()
    )
    if bias is not None and bias_in_mm:
        return torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=ws, bias=bias, out_dtype=torch.bfloat16)
    y = torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16)
    return y if bias is None else y + bias


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


def fp8_linear(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    bias: Optional[torch.Tensor],
    *,
    kind: str,
    compute_dtype: torch.dtype,
    gemv_max_m: int = 16,
    bias_in_mm: bool = True,
    large: str = "dequant",
) -> torch.Tensor:
    """``F.linear(x, dequantize(q, scale), bias)`` by the path ``kind`` (see
    :func:`mpsboost.recipes.fp8.paths.choose_linear_path`).

    Traceable by ``torch.compile(fullgraph=True)``: every branch is on static facts (dtype, shapes,
    arguments fixed at patch time); the kernels are registered operators. ``kind="fused"`` on tensors
    that are not on CUDA runs the operators' reference kernels (how CPU tests exercise the CUDA path).
    """
    if kind == "fused" and (q.dtype == FP8_DTYPE or (q.dtype == torch.uint8 and not q.is_cuda)):
        n, k = q.shape
        m = _rows(x)
        x2 = x.reshape(m, k)
        if m <= gemv_max_m:
            y = fp8_gemv(x2, q, scale, bias)
        elif large == "scaled_mm" and x.dtype == torch.bfloat16 and n % 16 == 0 and k % 16 == 0:
            xq, xs = fused_quantize_rows(x2)
            y = scaled_mm_rowwise(xq, q, xs, scale, bias, bias_in_mm=bias_in_mm)
        else:
            return F.linear(x, dequantize(q, scale, compute_dtype), bias)
        return y.reshape(*x.shape[:-1], n)
    if kind == "mps_scaled_mm" and q.dtype == FP8_DTYPE and 0 < _rows(x) <= gemv_max_m:
        n, k = q.shape
        if few_rows_ok(n, k, x.dtype):
            return scaled_mm_few_rows(x, q, scale, bias, bias_in_mm=bias_in_mm)
    return F.linear(x, dequantize(q, scale, compute_dtype), bias)
