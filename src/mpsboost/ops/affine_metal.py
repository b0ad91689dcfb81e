"""mpsboost's Metal kernels for MLX's affine low-bit weights at decode, on MPS.

Two kernels, each instantiated per code width (``bits`` 2, 3, 4, 5, 6, 8) and activation dtype (float32,
float16, bfloat16); the scales' dtype (float16, bfloat16, float32: MLX writes the weight's) is a run-time argument
read once per group, so one instance serves all three:

* ``mpsb_affine_rows_{bits}_{dtype}``, the GEMV (W4A16, W8A16 and the other widths): ``y [R, N] = x [R, K] @ W.T``
  for a few rows (decode: 1 to 4), each code read once as it is stored (``bits / 8`` bytes a weight, plus the
  group's scale and bias), the rows of one threadgroup sharing each weight read:

  - dense (``groups == 0``): ``q [N, K * bits / 32]``, scales and biases ``[N, K / g]``;
  - grouped (``groups == E``): ``q [E, N, Kw]``, rows sorted by expert with int32 cumulative ``offs [E]`` on the
    device, as ``torch._grouped_mm`` takes them: row ``r`` belongs to the first ``e`` with ``r < offs[e]`` (a
    binary search per row), reads only ``q[e]``; experts with no rows are never read; rows at or past
    ``offs[E - 1]`` are written as zeros. No host synchronisation.

  Numerics are MLX's own Metal ``qmv``'s: per group ``scale * sum(x * q) + bias * sum(x)`` with float32 sums, the
  output rounded once (the weight is never rounded: see :mod:`mpsboost.ops.affine` for how that compares with the
  reference). Layout: a threadgroup is 2 simdgroups x 32 lanes; a simdgroup computes 4 output features for up to
  4 rows; a lane takes 16 consecutive codes of a row per step (``2 * bits`` bytes: one 16-byte load at 8 bits,
  two 4-byte loads at 4 bits), 512 codes a simdgroup step; ``simd_sum`` reduces. 16 codes never straddle a group
  (32 | group size), so a lane reads its scale and bias once per step. The rows of ``x`` may have any stride
  (stride 0: one row shared by every output row, how one token's experts read it without a copy); ``y`` any row
  stride (the columns of a wider buffer).
* ``mpsb_affine_embed_{bits}_{dtype}``, the quantized embedding gather: ``y [T, K]`` the rows ``ids [T]`` (int64
  or int32) of a table ``q [V, Kw]`` dequantised exactly as :func:`mpsboost.ops.affine.affine_dequantize` does
  (in the scales' dtype ``q * scale`` rounded, ``+ bias`` rounded, then to ``dtype``): bit for bit for float16 and
  bfloat16 scales (the product is exact in float32 there, so a fused multiply-add changes nothing); for float32
  scales within one float32 rounding where the compiler fuses. An id outside ``[0, V)`` gives a row of zeros.

Codes: the row's little-endian bit string, code ``j`` at bits ``[j * bits, (j + 1) * bits)``; a lane loads its
``2 * bits`` bytes as 32-bit words and cuts the 16 codes with constant shifts (3, 5 and 6 bits straddle words).
Needs K a multiple of 32 (MLX's group sizes), the codes contiguous and 16-byte aligned, scales and biases
contiguous.

The source is compiled once per process by ``torch.mps.compile_shader`` at patch time: :func:`self_check`
compiles it and compares every kernel with the reference on shapes that cover its branches, and the caller uses
the kernels on a Mac only if that passes (the low_bit_weights recipe's
:func:`mpsboost.recipes.low_bit.paths.metal_verdict`, after the gate's feature ``affine_metal_gemv``). They are
reached only through the registered operators ``mpsboost::affine_gemv``, ``mpsboost::affine_gemv_out``,
``mpsboost::affine_grouped_gemv`` and ``mpsboost::affine_embedding`` (their MPS kernels), so ``torch.compile``
sees opaque calls. :data:`SOURCE` is plain Metal with no torch headers, so CPU
tests compile the same text as C++ against a small emulation of the Metal built-ins and run it.
"""

from __future__ import annotations

import functools
import math
from string import Template
from typing import Optional

import torch

__all__ = [
    "SOURCE",
    "KERNELS",
    "EMBED_KERNELS",
    "ROWS",
    "FEATURES_PER_GROUP",
    "THREADS",
    "CHUNK",
    "supported",
    "embedding_supported",
    "rows_gemv",
    "embedding",
    "self_check",
]

BITS = (2, 3, 4, 5, 6, 8)
ROWS = 4  # rows of x per threadgroup (they share each weight read when their expert is the same)
FEATURES_PER_SIMDGROUP = 4
SIMDGROUPS = 2
THREADS = 32 * SIMDGROUPS  # threads per threadgroup
FEATURES_PER_GROUP = FEATURES_PER_SIMDGROUP * SIMDGROUPS
CHUNK = 16  # codes a lane takes at once
EMBED_THREADS = 32  # threads per threadgroup of the gather (one chunk of 16 codes each)

# the scales' dtype as the kernels' run-time argument ``st``
_STYPE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

_PRELUDE = f"""#include <metal_stdlib>
using namespace metal;

#define MPSB_ROWS {ROWS}
#define MPSB_NPS {FEATURES_PER_SIMDGROUP}
#define MPSB_SGS {SIMDGROUPS}

// float -> the nearest bfloat16 (ties to even), as a float (finite inputs).
inline float mpsb_bf16(float v) {{
  uint u = as_type<uint>(v);
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  return as_type<float>(u);
}}

// The group of row r: the first e with r < offs[e] (offs: non-decreasing ends), or -1 past the last one.
inline long mpsb_group(device const int* offs, long groups, long r) {{
  long lo = 0, hi = groups;
  while (lo < hi) {{
    const long mid = (lo + hi) >> 1;
    if (r < long(offs[mid])) {{
      hi = mid;
    }} else {{
      lo = mid + 1;
    }}
  }}
  return lo < groups ? lo : -1;
}}

// Element i of a scale or bias array of dtype st (0 float32, 1 float16, 2 bfloat16), as a float.
inline float mpsb_sb(device const uchar* p, long i, long st) {{
  if (st == 0) {{
    return ((device const float*)p)[i];
  }}
  if (st == 1) {{
    return float(((device const half*)p)[i]);
  }}
  return as_type<float>(uint(((device const ushort*)p)[i]) << 16);
}}

// v rounded to dtype st (float32: as it is), as a float.
inline float mpsb_round(float v, long st) {{
  if (st == 1) {{
    return float(half(v));
  }}
  if (st == 2) {{
    return mpsb_bf16(v);
  }}
  return v;
}}

inline float mpsb_ld(float v) {{ return v; }}
inline float mpsb_ld(half v) {{ return float(v); }}
inline float mpsb_ld(ushort v) {{ return as_type<float>(uint(v) << 16); }}  // bfloat16 as its 16 bits
inline void mpsb_st(device float* p, float v) {{ *p = v; }}
inline void mpsb_st(device half* p, float v) {{ *p = half(v); }}
inline void mpsb_st(device ushort* p, float v) {{ *p = ushort(as_type<uint>(mpsb_bf16(v)) >> 16); }}

// The 2 * BITS bytes of 16 codes at p as 32-bit words, returned by value (the last word partly filled at 3 and 5
// bits): one 16-byte load at 8 bits, 4-byte loads at 2, 4 and 6 bits (p 4-byte aligned there), 2-byte loads at 3 and
// 5 bits (p 2-byte aligned).
struct mpsb_words {{
  uint w[4];
}};

template <int BITS>
inline mpsb_words mpsb_load(device const uchar* p) {{
  mpsb_words words;
  if (BITS == 8) {{
    const uint4 c = *((device const uint4*)p);
    words.w[0] = c.x;
    words.w[1] = c.y;
    words.w[2] = c.z;
    words.w[3] = c.w;
  }} else if (BITS % 2 == 0) {{
    for (int i = 0; i < BITS / 2; ++i) {{
      words.w[i] = ((device const uint*)p)[i];
    }}
  }} else {{
    device const ushort* h = (device const ushort*)p;
    for (int i = 0; i < BITS / 2; ++i) {{
      words.w[i] = uint(h[2 * i]) | (uint(h[2 * i + 1]) << 16);
    }}
    words.w[BITS / 2] = uint(h[BITS - 1]);
  }}
  return words;
}}

// Code j (0..15) of the words: bits [j * BITS, (j + 1) * BITS), across two words where it straddles them.
template <int BITS>
inline uint mpsb_code(const mpsb_words words, int j) {{
  const int o = j * BITS;
  const int w = o >> 5;
  const int sh = o & 31;
  uint v = words.w[w] >> sh;
  if (sh + BITS > 32) {{
    v |= words.w[w + 1] << (32 - sh);
  }}
  return v & ((1u << BITS) - 1u);
}}

template <int BITS, typename XT>
inline void mpsb_affine_rows(
    device const XT* x, device const uchar* w, device const uchar* sc, device const uchar* bi,
    device const int* offs, device XT* y, long R, long N, long K, long groups, long xs, long ys, long gsh, long st,
    uint2 tg, uint sg, uint lane) {{
  const long n0 = (long(tg.x) * MPSB_SGS + long(sg)) * MPSB_NPS;
  const long r0 = long(tg.y) * MPSB_ROWS;
  const long rowb = K * BITS / 8;  // bytes of one row of codes
  const long G = K >> gsh;  // groups of one row
  long ex[MPSB_ROWS];
  for (int i = 0; i < MPSB_ROWS; ++i) {{
    const long r = r0 + i;
    ex[i] = r < R ? (groups > 0 ? mpsb_group(offs, groups, r) : 0) : -1;
  }}
  float acc[MPSB_NPS][MPSB_ROWS];
  for (int j = 0; j < MPSB_NPS; ++j) {{
    for (int i = 0; i < MPSB_ROWS; ++i) {{
      acc[j][i] = 0.0f;
    }}
  }}
  for (long k = long(lane) * 16; k < K; k += 32 * 16) {{
    const long kg = k >> gsh;
    for (int j = 0; j < MPSB_NPS; ++j) {{
      const long n = n0 + j;
      if (n >= N) {{
        break;
      }}
      long prev = -1;
      float cv[16];
      float s = 0.0f, b = 0.0f;
      for (int i = 0; i < MPSB_ROWS; ++i) {{
        const long e = ex[i];
        if (e < 0) {{
          continue;
        }}
        if (e != prev) {{
          const long row = e * N + n;
          const mpsb_words words = mpsb_load<BITS>(w + row * rowb + k * BITS / 8);
          for (int c = 0; c < 16; ++c) {{
            cv[c] = float(mpsb_code<BITS>(words, c));
          }}
          s = mpsb_sb(sc, row * G + kg, st);
          b = mpsb_sb(bi, row * G + kg, st);
          prev = e;
        }}
        device const XT* xr = x + (r0 + i) * xs + k;
        float d = 0.0f, t = 0.0f;
        for (int c = 0; c < 16; ++c) {{
          const float xv = mpsb_ld(xr[c]);
          d += xv * cv[c];
          t += xv;
        }}
        acc[j][i] += s * d + b * t;
      }}
    }}
  }}
  for (int j = 0; j < MPSB_NPS; ++j) {{
    for (int i = 0; i < MPSB_ROWS; ++i) {{
      const float v = simd_sum(acc[j][i]);
      const long n = n0 + j;
      const long r = r0 + i;
      if (lane == 0 && n < N && r < R) {{
        mpsb_st(y + r * ys + n, v);
      }}
    }}
  }}
}}

template <int BITS, typename YT>
inline void mpsb_affine_embed(
    device const uchar* ids, device const uchar* w, device const uchar* sc, device const uchar* bi, device YT* y,
    long T, long V, long K, long iw, long gsh, long st, uint2 tg, uint sg, uint lane) {{
  const long chunk = long(tg.x) * {EMBED_THREADS} + long(sg) * 32 + long(lane);
  const long t = long(tg.y);
  const long k = chunk * 16;
  if (t >= T || k >= K) {{
    return;
  }}
  const long id = iw == 8 ? ((device const long*)ids)[t] : long(((device const int*)ids)[t]);
  device YT* yr = y + t * K + k;
  if (id < 0 || id >= V) {{
    for (int c = 0; c < 16; ++c) {{
      mpsb_st(yr + c, 0.0f);
    }}
    return;
  }}
  const long G = K >> gsh;
  const mpsb_words words = mpsb_load<BITS>(w + id * (K * BITS / 8) + k * BITS / 8);
  const float s = mpsb_sb(sc, id * G + (k >> gsh), st);
  const float b = mpsb_sb(bi, id * G + (k >> gsh), st);
  for (int c = 0; c < 16; ++c) {{
    const float p = mpsb_round(float(mpsb_code<BITS>(words, c)) * s, st);
    mpsb_st(yr + c, mpsb_round(p + b, st));
  }}
}}
"""

_ROWS = Template("""
kernel void mpsb_affine_rows_${bits}_${name}(
    device const ${xt}* x [[buffer(0)]],
    device const uchar* w [[buffer(1)]],
    device const uchar* sc [[buffer(2)]],
    device const uchar* bi [[buffer(3)]],
    device const int* offs [[buffer(4)]],
    device ${xt}* y [[buffer(5)]],
    constant long& R [[buffer(6)]],
    constant long& N [[buffer(7)]],
    constant long& K [[buffer(8)]],
    constant long& groups [[buffer(9)]],
    constant long& xs [[buffer(10)]],
    constant long& ys [[buffer(11)]],
    constant long& gsh [[buffer(12)]],
    constant long& st [[buffer(13)]],
    uint2 tg [[threadgroup_position_in_grid]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  mpsb_affine_rows<${bits}>(x, w, sc, bi, offs, y, R, N, K, groups, xs, ys, gsh, st, tg, sg, lane);
}
""")

_EMBED = Template("""
kernel void mpsb_affine_embed_${bits}_${name}(
    device const uchar* ids [[buffer(0)]],
    device const uchar* w [[buffer(1)]],
    device const uchar* sc [[buffer(2)]],
    device const uchar* bi [[buffer(3)]],
    device ${xt}* y [[buffer(4)]],
    constant long& T [[buffer(5)]],
    constant long& V [[buffer(6)]],
    constant long& K [[buffer(7)]],
    constant long& iw [[buffer(8)]],
    constant long& gsh [[buffer(9)]],
    constant long& st [[buffer(10)]],
    uint2 tg [[threadgroup_position_in_grid]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  mpsb_affine_embed<${bits}>(ids, w, sc, bi, y, T, V, K, iw, gsh, st, tg, sg, lane);
}
""")

# activation (and output) dtype -> (kernel suffix, Metal type); bfloat16 as its 16 bits (no bfloat before Metal 3.1)
_TYPES = {torch.float32: ("float", "float"), torch.float16: ("half", "half"), torch.bfloat16: ("bfloat16", "ushort")}

SOURCE = (
    _PRELUDE
    + "".join(_ROWS.substitute(bits=b, name=name, xt=xt) for b in BITS for name, xt in _TYPES.values())
    + "".join(_EMBED.substitute(bits=b, name=name, xt=xt) for b in BITS for name, xt in _TYPES.values())
)
KERNELS = {(b, dt): f"mpsb_affine_rows_{b}_{spec[0]}" for b in BITS for dt, spec in _TYPES.items()}
EMBED_KERNELS = {(b, dt): f"mpsb_affine_embed_{b}_{spec[0]}" for b in BITS for dt, spec in _TYPES.items()}


def _weights_ok(q: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, bits: int, group_size: int):
    if bits not in BITS:
        return f"bits={bits}: the kernels have {BITS}"
    if group_size < 32 or group_size & (group_size - 1):
        return f"group_size={group_size}: the kernels take powers of two from 32"
    if q.dtype not in (torch.uint32, torch.int32):
        return f"codes in {q.dtype}: expected uint32 words"
    if not q.is_contiguous() or (q.storage_offset() * 4) % 16:
        return "codes must be contiguous and 16-byte aligned"
    if scales.dtype not in _STYPE or biases.dtype != scales.dtype:
        return f"scales in {scales.dtype}, biases in {biases.dtype}: the kernels read float32, float16 or bfloat16"
    if not scales.is_contiguous() or not biases.is_contiguous():
        return "scales and biases must be contiguous"
    if (q.shape[-1] * 32 // bits) % 32:
        return "K must be a multiple of 32"
    return None


def supported(
    x: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor,
    bits: int,
    group_size: int,
    out: Optional[torch.Tensor] = None,
) -> Optional[str]:
    """Why the GEMV cannot take these tensors (static facts), or None: x in a dtype it has, 2-D with unit column
    stride (rows of any stride) or of more dims and contiguous (its leading dims are the rows); codes contiguous and
    16-byte aligned; K a multiple of 32; an ``out`` in x's dtype, ``[R, N]`` with unit column stride or contiguous."""
    if x.dtype not in _TYPES:
        return f"activations in {x.dtype}: the kernel has float32, float16 and bfloat16"
    if x.dim() < 2 or (x.dim() == 2 and x.shape[1] > 1 and x.stride(1) != 1) or (x.dim() > 2 and not x.is_contiguous()):
        return "x must be 2-D with contiguous rows, or contiguous"
    why = _weights_ok(q, scales, biases, bits, group_size)
    if why is not None:
        return why
    if out is not None:
        n = q.shape[-2]
        rows = out.shape[-1] == n and (out.is_contiguous() if out.dim() != 2 else (n == 1 or out.stride(1) == 1))
        if out.dtype != x.dtype or not rows:
            return "out must be in x's dtype, [R, N] with unit column stride, or contiguous"
    return None


def embedding_supported(
    ids: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor,
    bits: int,
    group_size: int,
    dtype: torch.dtype,
) -> Optional[str]:
    """Why the gather cannot take these tensors, or None: int64/int32 ids, an output dtype it has, the table as
    :func:`supported` wants the codes."""
    if ids.dtype not in (torch.int64, torch.int32):
        return f"ids in {ids.dtype}: the kernel reads int64 or int32"
    if dtype not in _TYPES:
        return f"output in {dtype}: the kernel has float32, float16 and bfloat16"
    return _weights_ok(q, scales, biases, bits, group_size)


@functools.lru_cache(maxsize=None)
def _library():
    """The compiled library (once per process; the first call is at patch time, from the self-check)."""
    return torch.mps.compile_shader(SOURCE)


def _buffer(t: torch.Tensor) -> torch.Tensor:
    """What the kernel is handed for a strided ``x`` or ``y`` (row stride 0, or the columns of a wider buffer): a
    contiguous 1-D view from its first element to its last reachable one, the same memory (the kernel addresses
    rows by the strides it is given), so that only contiguous tensors reach the shader binding."""
    if t.is_contiguous():
        return t
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.as_strided((extent,), (1,), t.storage_offset())


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)


def rows_gemv(
    x: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor,
    offs: Optional[torch.Tensor],
    *,
    bits: int,
    group_size: int,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Launch the GEMV on MPS tensors: ``x [R, K]``, codes ``q [N, Kw]`` (dense, ``offs=None``) or ``[E, N, Kw]``
    with int32 ``offs [E]``, scales and biases ``[..., N, K / group_size]``. ``x`` may have more dims (contiguous):
    its leading dims are the rows, and the result has them too. Returns ``[R, N]`` in ``x.dtype``, written into
    ``out`` when given (``[R, N]`` with unit column stride and any row stride, or contiguous with ``R * N``
    elements). The caller checked :func:`supported`."""
    k = x.shape[-1]
    r = math.prod(x.shape[:-1])  # the leading dims of a contiguous x are its rows: no reshape dispatched
    n = q.shape[-2]
    groups = 0 if offs is None else q.shape[0]
    y = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device) if out is None else out
    if r == 0 or n == 0:
        return y
    if k == 0:
        return y.zero_()
    xs = (x.stride(0) if x.dim() == 2 else k) if r > 1 else 0
    fn = getattr(_library(), KERNELS[(bits, x.dtype)])
    gx = -(-n // FEATURES_PER_GROUP)
    gy = -(-r // ROWS)
    fn(
        _buffer(x),
        _bytes(q),
        _bytes(scales),
        _bytes(biases),
        scales if offs is None else offs,  # unused when groups == 0
        _buffer(y),
        r,
        n,
        k,
        groups,
        xs,
        y.stride(0) if r > 1 and y.dim() == 2 else n,  # an out of more dims: contiguous rows
        group_size.bit_length() - 1,
        _STYPE[scales.dtype],
        threads=(gx * THREADS, gy),
        group_size=(THREADS, 1),
    )
    return y


def embedding(
    ids: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor,
    *,
    bits: int,
    group_size: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Launch the gather on MPS tensors: ``[*ids.shape, K]`` in ``dtype``, the rows ``ids`` of ``q [V, Kw]``
    dequantised. The caller checked :func:`embedding_supported`."""
    v, kw = q.shape
    k = kw * 32 // bits
    t = ids.numel()
    y = torch.empty((*ids.shape, k), dtype=dtype, device=q.device)
    if t == 0 or k == 0:
        return y
    flat = ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    fn = getattr(_library(), EMBED_KERNELS[(bits, dtype)])
    gx = -(-(k // CHUNK) // EMBED_THREADS)
    fn(
        _bytes(flat),
        _bytes(q),
        _bytes(scales),
        _bytes(biases),
        y,
        t,
        v,
        k,
        flat.element_size(),
        group_size.bit_length() - 1,
        _STYPE[scales.dtype],
        threads=(gx * EMBED_THREADS, t),
        group_size=(EMBED_THREADS, 1),
    )
    return y


def _reference(x, q, scales, biases, offs, bits, group_size) -> torch.Tensor:
    """The products on the CPU in float64, independent of the kernel's order and of its factoring: each row times
    its expert's weight ``code * scale + bias`` computed exactly in float64 (what the kernel approximates: it never
    rounds a weight); rows past the last offset zero."""
    from .affine_codec import unpack_codes

    w = unpack_codes(q, bits).double()  # [E, N, K]
    w = w * scales.double().repeat_interleave(group_size, -1) + biases.double().repeat_interleave(group_size, -1)
    y = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float64)
    ends = offs.tolist()
    for row in range(x.shape[0]):
        grp = next((g for g, end in enumerate(ends) if row < end), None)
        if grp is not None:
            y[row] = w[grp] @ x[row].double()
    return y


# the kernel's output against the exact product, relative to its largest magnitude: the output's rounding to
# x.dtype and float32 sums
_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def self_check(device: str = "mps") -> Optional[str]:
    """Compile the source on ``device`` and compare every kernel with the reference on shapes that cover its
    branches: every code of every width decoded exactly (one-hot rows), each scale dtype, 1-4 rows and a partial
    row group, a partial feature group, K not a multiple of the 512-code step, an expert with no rows, rows past
    the last offset, a shared row of stride 0; each activation dtype; and the embedding gather bit for bit.
    Returns None, or what failed. Patch time only (:func:`mpsboost.recipes.low_bit.paths.metal_verdict`, the
    selftest probe)."""
    from .affine_codec import affine_dequantize, affine_quantize, pack_codes

    try:
        _library()
    except Exception as exc:  # noqa: BLE001 - a compiler error of any kind is the answer
        return f"torch.mps.compile_shader failed: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
    g = torch.Generator().manual_seed(0)
    for bits in BITS:
        # every code at every position of a 32-code run: y[r, n] = code(n, r) * scale + bias, exact in float32
        n = max(32, 1 << bits)
        codes = (torch.arange(n)[:, None] + 7 * torch.arange(32)) % (1 << bits)  # every value at every position
        q = pack_codes(codes, bits)
        s = torch.full((n, 1), 0.5)
        b = torch.full((n, 1), -1.0)
        want = codes.double().t() * 0.5 - 1.0
        try:
            got = rows_gemv(
                torch.eye(32, device=device), q.to(device), s.to(device), b.to(device), None, bits=bits, group_size=32
            ).cpu()
        except Exception as exc:  # noqa: BLE001 - a launch error of any kind is the answer
            return f"launching the affine Metal kernel failed ({bits} bits): {exc}"
        if not torch.equal(got.double(), want):
            bad = int((got.double() != want).sum())
            return f"the affine Metal kernel decodes {bad} of {n * 32} {bits}-bit codes wrongly"
    cases = (
        # R, N, K, E, offs, shared row, group size
        (1, 40, 96, 0, None, False, 32),
        (3, 24, 128, 0, None, False, 64),
        (5, 40, 512 + 128, 0, None, False, 128),
        (7, 24, 64, 4, [2, 2, 5, 6], False, 32),
        (8, 40, 192, 3, [3, 3, 8], True, 64),
    )
    sdts = (torch.bfloat16, torch.float16, torch.float32)
    xdts = (torch.float32, torch.float16, torch.bfloat16)
    for bits in BITS:
        for ci, (r, n, k, e, offs, shared, gs) in enumerate(cases):
            xdt = xdts[(ci + bits) % 3]  # each width's kernel in every activation dtype
            sdt = sdts[(ci + 2 * bits) % 3]  # and every scales dtype
            w = torch.randn(max(e, 1), n, k, generator=g).to(sdt)
            q, s, b = affine_quantize(w, bits, gs)
            x = torch.randn(1 if shared else r, k, generator=g).to(xdt)
            if shared:
                x = x.expand(r, k)
            o = torch.tensor(offs if e else [r], dtype=torch.int32)
            ref = _reference(x, q, s, b, o, bits, gs)
            try:
                if e:
                    dev = (q.to(device), s.to(device), b.to(device), o.to(device))
                else:
                    dev = (q[0].to(device), s[0].to(device), b[0].to(device), None)
                got = rows_gemv(x.to(device), *dev, bits=bits, group_size=gs).cpu()
            except Exception as exc:  # noqa: BLE001 - a launch error of any kind is the answer
                return f"launching the affine Metal kernel failed ({bits} bits, {xdt}, R={r}, N={n}): {exc}"
            err = float((got.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-6))
            if not err <= _TOL[xdt]:
                return (
                    f"the affine Metal kernel differs from the reference by {err:.2e} ({bits} bits, x {xdt}, "
                    f"scales {sdt}, R={r}, N={n}, K={k}, E={e})"
                )
    for bits in BITS:
        for sdt, dt in zip((torch.bfloat16, torch.float16, torch.bfloat16), xdts[bits % 3 :] + xdts[: bits % 3]):
            w = torch.randn(12, 96, generator=g).to(sdt)
            q, s, b = affine_quantize(w, bits, 32)
            ids = torch.tensor([[3, 0, 11], [3, 7, 1]])
            want = affine_dequantize(q, s, b, bits, 32, dt)[ids]
            try:
                got = embedding(
                    ids.to(device), q.to(device), s.to(device), b.to(device), bits=bits, group_size=32, dtype=dt
                ).cpu()
            except Exception as exc:  # noqa: BLE001 - a launch error of any kind is the answer
                return f"launching the affine Metal gather failed ({bits} bits, {dt}): {exc}"
            if not torch.equal(got, want):
                return f"the affine Metal gather differs from affine_dequantize ({bits} bits, {sdt} -> {dt})"
    return None
