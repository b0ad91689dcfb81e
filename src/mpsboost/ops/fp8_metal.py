"""mpsboost's Metal kernel for fp8 weights at decode: bf16/fp16/fp32 activations times fp8 codes, on MPS.

torch 2.15's own fp8 matmul on MPS (``F.scaled_mm``, the ``scaled_mm_few_rows_*`` kernels) reads fp8 on both
sides: every input is quantised first (five dispatches), it takes tensorwise or rowwise scales only, and it has
no batch and no offsets, so routed experts must be gathered (3 bytes per routed weight). This kernel takes the
activations as they are (W8A16) and reads each weight once as its fp8 byte:

* **dense** (``groups == 0``): ``y [R, N] = x [R, K] @ (codes [N, K] * scales).T`` for a few rows (decode: 1 to 4);
  the rows of one threadgroup share each weight read;
* **grouped** (``groups == E``): rows sorted by expert with int32 cumulative ``offs [E]`` on the device, as
  ``torch._grouped_mm`` takes them: row ``r`` belongs to the first expert ``e`` with ``r < offs[e]`` (a binary
  search per threadgroup), reads only ``codes[e]``; experts with no rows are never read; rows at or past
  ``offs[E - 1]`` are written as zeros. No host synchronisation.

Scales are float32 ``[E, ceil(N / bn), ceil(K / bk)]``: rowwise ``bn = 1, bk = K``, one per tensor/expert
``bn = N, bk = K``, and the 128x128 blocks of published FP8 checkpoints ``bn = bk = 128``, applied exactly
(never requantised). Numerics are those of :func:`mpsboost.ops.fp8.dequantize` followed by a matmul: each code
times its scale in float32, rounded once to the activation dtype, then products accumulated in float32 and the
output rounded once. The rows of ``x`` may have any stride (stride 0: one row shared by every output row, how
the up projections of one token's experts read it without a copy).

Layout: one threadgroup = 2 simdgroups x 32 lanes; each simdgroup computes 4 output features for up to 4 rows;
each lane streams 16 consecutive codes (one 16-byte load) per step, 512 bytes a simdgroup; ``simd_sum`` reduces.
It needs K a multiple of 16, codes 16-byte aligned (``storage_offset % 16 == 0``) and contiguous, and block
sizes along K that are multiples of 16. The fp8 byte becomes a float by moving its 7 low bits into a half's
exponent and mantissa (exact for every finite code; the factor 2^8 between the two biases is folded into the
scale), so it needs no float8 type in Metal and works the same on uint8 storage (MPS before 2.15). The NaN codes
(0x7F, 0xFF) give NaN as in :func:`mpsboost.ops.fp8.dequantize`: each 16-byte load is tested for them with 12
integer operations and a select (under a tenth of what decoding those 16 codes takes; no extra memory traffic),
and a hit starts each row's partial sum over those 16 codes from NaN, so every output that reads a NaN code is
NaN, whatever the activation. (This relies on IEEE NaN propagation: torch compiles with MTLMathModeSafe unless
PYTORCH_MPS_FAST_MATH is set; the self-check's NaN cases refuse the kernel where it does not hold.)

The source is compiled once per process by ``torch.mps.compile_shader`` (public since torch 2.7), at patch
time: :func:`self_check` compiles it and compares it with the reference on shapes that run every branch (30
launches, under 1 MiB), and
the fp8 recipe uses the kernel on a Mac only if that passes (:func:`mpsboost.recipes.fp8.paths.metal_verdict`, after the
gate's feature ``fp8_metal_gemv``). It is reached only through the registered operators ``mpsboost::fp8_gemv``,
``mpsboost::grouped_mm``, ``mpsboost::fp8_block_gemv`` and their ``_out`` variants (their MPS kernels), so
``torch.compile`` sees an opaque call. :data:`SOURCE` is plain Metal with no torch headers, so CPU tests compile
the same text as C++ against a small emulation of the Metal built-ins and run it.
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
    "ROWS",
    "FEATURES_PER_GROUP",
    "THREADS",
    "supported",
    "rows_gemv",
    "dense",
    "dense_scale",
    "self_check",
]

ROWS = 4  # rows of x per threadgroup (they share each weight read when their expert is the same)
FEATURES_PER_SIMDGROUP = 4
SIMDGROUPS = 2
THREADS = 32 * SIMDGROUPS  # threads per threadgroup
FEATURES_PER_GROUP = FEATURES_PER_SIMDGROUP * SIMDGROUPS
CHUNK = 16  # codes a lane loads at once

_PRELUDE = f"""#include <metal_stdlib>
using namespace metal;

#define MPSB_ROWS {ROWS}
#define MPSB_NPS {FEATURES_PER_SIMDGROUP}
#define MPSB_SGS {SIMDGROUPS}

// An e4m3fn byte as a float, divided by 2^8: its 7 low bits are a half's exponent and mantissa shifted by 7
// (the exponent biases differ by 8: the caller multiplies the scale by 256), its sign the half's sign. Exact
// for every finite code, subnormals included.
inline float mpsb_fp8(uint b) {{
  return float(as_type<half>(ushort(((b & 0x80u) << 8) | ((b & 0x7Fu) << 7))));
}}

// 0, or a quiet NaN where one of the 16 codes in these 4 words (one 16-byte load) is an e4m3fn NaN code (0x7F or
// 0xFF: magnitude 0x7F, which mpsb_fp8 alone reads as 480/256). A byte's magnitude plus 1 reaches bit 7 only for
// 0x7F and never carries into the next byte, so one add per word tests its 4 codes: 12 integer operations and a
// select per 16 codes, once per weight read (decoding them takes about 150). A NaN weight makes the reference's
// sum NaN whatever the activation (NaN * 0 is NaN), so each row's partial sum over these 16 codes starts from
// this value instead of 0: nothing per row or per product.
inline float mpsb_nan_seed(uint a, uint b, uint c, uint d) {{
  const uint t = ((a & 0x7F7F7F7Fu) + 0x01010101u) | ((b & 0x7F7F7F7Fu) + 0x01010101u) |
                 ((c & 0x7F7F7F7Fu) + 0x01010101u) | ((d & 0x7F7F7F7Fu) + 0x01010101u);
  return (t & 0x80808080u) != 0u ? as_type<float>(0x7FC00000u) : 0.0f;
}}

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
"""

_KERNEL = Template("""
kernel void mpsb_fp8_rows_${name}(
    device const ${xt}* x [[buffer(0)]],
    device const uchar* w [[buffer(1)]],
    device const float* scale [[buffer(2)]],
    device const int* offs [[buffer(3)]],
    device ${xt}* y [[buffer(4)]],
    constant long& R [[buffer(5)]],
    constant long& N [[buffer(6)]],
    constant long& K [[buffer(7)]],
    constant long& groups [[buffer(8)]],
    constant long& xs [[buffer(9)]],
    constant long& bn [[buffer(10)]],
    constant long& bk [[buffer(11)]],
    constant long& sn [[buffer(12)]],
    constant long& sk [[buffer(13)]],
    constant long& ys [[buffer(14)]],
    uint2 tg [[threadgroup_position_in_grid]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  const long n0 = (long(tg.x) * MPSB_SGS + long(sg)) * MPSB_NPS;
  const long r0 = long(tg.y) * MPSB_ROWS;
  long ex[MPSB_ROWS];
  for (int i = 0; i < MPSB_ROWS; ++i) {
    const long r = r0 + i;
    ex[i] = r < R ? (groups > 0 ? mpsb_group(offs, groups, r) : 0) : -1;
  }
  float acc[MPSB_NPS][MPSB_ROWS];
  uint nb[MPSB_NPS];  // each feature's row of scale blocks (32-bit: no 64-bit divide in the loop)
  for (int j = 0; j < MPSB_NPS; ++j) {
    nb[j] = uint(n0 + j) / uint(bn);
    for (int i = 0; i < MPSB_ROWS; ++i) {
      acc[j][i] = 0.0f;
    }
  }
  for (long k = long(lane) * 16; k < K; k += 32 * 16) {
    const uint kb = uint(k) / uint(bk);
    for (int j = 0; j < MPSB_NPS; ++j) {
      const long n = n0 + j;
      if (n >= N) {
        break;
      }
      long prev = -1;
      float wv[16];
      float seed = 0.0f;  // NaN where these 16 codes hold a NaN code: what each row's partial sum starts from
      for (int i = 0; i < MPSB_ROWS; ++i) {
        const long e = ex[i];
        if (e < 0) {
          continue;
        }
        if (e != prev) {
          const uint4 c = *((device const uint4*)(w + (e * N + n) * K + k));
          const float s = scale[(uint(e) * uint(sn) + nb[j]) * uint(sk) + kb] * 256.0f;
          const uint words[4] = {c.x, c.y, c.z, c.w};
          for (int q = 0; q < 4; ++q) {
            for (int b = 0; b < 4; ++b) {
              wv[q * 4 + b] = ${roundw}(mpsb_fp8((words[q] >> (8 * b)) & 0xFFu) * s);
            }
          }
          seed = mpsb_nan_seed(c.x, c.y, c.z, c.w);
          prev = e;
        }
        device const ${xt}* xr = x + (r0 + i) * xs + k;
        float d = seed;
        for (int q = 0; q < 16; ++q) {
          d += wv[q] * ${loadx}(xr[q]);
        }
        acc[j][i] += d;
      }
    }
  }
  for (int j = 0; j < MPSB_NPS; ++j) {
    for (int i = 0; i < MPSB_ROWS; ++i) {
      const float v = simd_sum(acc[j][i]);
      const long n = n0 + j;
      const long r = r0 + i;
      if (lane == 0 && n < N && r < R) {
        y[r * ys + n] = ${storey}(v);
      }
    }
  }
}
""")

# activation dtype -> (kernel suffix, Metal type of x and y, load as float, round a weight, store)
_TYPES = {
    torch.float32: ("float", "float", "float", "", "float"),
    torch.float16: ("half", "half", "float", "mpsb_half", "half"),
    # bf16 as its 16 bits (no bfloat type before Metal 3.1): the float with those bits on top
    torch.bfloat16: ("bfloat16", "ushort", "mpsb_bf16_load", "mpsb_bf16", "mpsb_bf16_store"),
}

_HELPERS = """
inline float mpsb_half(float v) { return float(half(v)); }
inline float mpsb_bf16_load(ushort b) { return as_type<float>(uint(b) << 16); }
// The output (once per element, outside the loop): a NaN stays a quiet NaN whatever its payload (rounding a NaN with
// low mantissa bits all set would carry into the sign: -0.0).
inline ushort mpsb_bf16_store(float v) {
  const uint u = as_type<uint>(v);
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? ushort((u >> 16) | 0x0040u) : ushort(as_type<uint>(mpsb_bf16(v)) >> 16);
}
"""

SOURCE = (
    _PRELUDE
    + _HELPERS
    + "".join(
        _KERNEL.substitute(name=name, xt=xt, loadx=load, roundw=rnd, storey=store)
        for name, xt, load, rnd, store in _TYPES.values()
    )
)
KERNELS = {dt: f"mpsb_fp8_rows_{spec[0]}" for dt, spec in _TYPES.items()}


def supported(x: torch.Tensor, w: torch.Tensor, *, bk: int) -> Optional[str]:
    """Why the kernel cannot take these tensors (static facts), or None: x in a dtype it has, 2-D with unit column
    stride (rows of any stride) or of more dims and contiguous (its leading dims are the rows), codes contiguous and
    16-byte aligned, K and the K block multiples of 16."""
    k = w.shape[-1]
    if x.dtype not in KERNELS:
        return f"activations in {x.dtype}: the kernel has float32, float16 and bfloat16"
    if x.dim() < 2 or (x.dim() == 2 and x.shape[1] > 1 and x.stride(1) != 1) or (x.dim() > 2 and not x.is_contiguous()):
        return "x must be 2-D with contiguous rows, or contiguous"
    if w.dtype not in (torch.float8_e4m3fn, torch.uint8):
        return f"codes in {w.dtype}: expected float8_e4m3fn or uint8"
    if k % CHUNK or bk % CHUNK:
        return f"K={k} and its scale block {bk} must be multiples of {CHUNK}"
    if not w.is_contiguous() or w.storage_offset() % CHUNK:
        return "codes must be contiguous and 16-byte aligned"
    return None


@functools.lru_cache(maxsize=None)
def _library():
    """The compiled library (once per process; the first call is at patch time, from the self-check)."""
    return torch.mps.compile_shader(SOURCE)


def _buffer(t: torch.Tensor) -> torch.Tensor:
    """What the kernel is handed for a strided ``x`` or ``y`` (row stride 0, or the columns of a wider buffer): a
    contiguous 1-D view from its first element to its last reachable one, the same memory (the kernel addresses
    rows by the strides it is given), so that only contiguous tensors ever reach the shader binding."""
    if t.is_contiguous():
        return t
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.as_strided((extent,), (1,), t.storage_offset())


def launch_error(
    x: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor,
    offs: Optional[torch.Tensor],
    *,
    bn: int,
    bk: int,
    out: Optional[torch.Tensor] = None,
    static_checked: bool = False,
) -> Optional[Exception]:
    """What makes a launch on these tensors unsafe or wrong, as the exception :func:`rows_gemv` raises (TypeError for a
    dtype, ValueError otherwise), or None. The kernel trusts every size and stride it is given: a scale of another
    dtype would be read as float32 bits, a short ``out`` or ``scale`` written or read past its end. Checked: what
    :func:`supported` checks (skipped with ``static_checked``); codes ``[N, K]`` (dense) or ``[E, N, K]`` (with
    ``offs``) of x's K; block sizes of at least 1; float32 contiguous ``scale`` of exactly ``[ceil(N/bn),
    ceil(K/bk)]`` (``[E, ...]`` grouped); int32 contiguous ``offs [E]``; every tensor on x's device; ``out`` in x's
    dtype, either ``[R, N]`` with unit column stride and rows that do not overlap, or contiguous with ``R * N``
    elements. A few attribute reads: it runs at every launch."""
    if not static_checked:
        why = supported(x, w, bk=bk)
        if why is not None:
            return ValueError(f"the fp8 Metal GEMV cannot take these tensors: {why}")
    # Cheap reads only (shapes, dtypes, device indices): this runs before every launch.
    k = x.shape[-1]
    ws = w.shape
    grouped = offs is not None
    if len(ws) != 2 + grouped or ws[-1] != k:
        want = "[E, N, K] with offs" if grouped else "[N, K] without offs"
        return ValueError(f"fp8 Metal GEMV: codes {list(ws)} for x {list(x.shape)}: expected {want}, K = {k}")
    n = ws[-2]
    if bn < 1 or bk < 1:
        return ValueError(f"fp8 Metal GEMV: scale blocks ({bn}, {bk}) must be at least 1")
    if scale.dtype is not torch.float32:
        return TypeError(f"fp8 Metal GEMV: scale in {scale.dtype}; the kernel reads float32 (pass scale.float())")
    dev = x.get_device()
    blocks = (ws[0], -(-n // bn), -(-k // bk)) if grouped else (-(-n // bn), -(-k // bk))
    if scale.shape != blocks or not scale.is_contiguous() or scale.get_device() != dev:
        return ValueError(
            f"fp8 Metal GEMV: scale {list(scale.shape)} (contiguous: {scale.is_contiguous()}, on {scale.device}) for "
            f"codes {list(ws)} in ({bn}, {bk}) blocks: expected contiguous {list(blocks)} on {x.device}"
        )
    if w.get_device() != dev:
        return ValueError(f"fp8 Metal GEMV: codes on {w.device}, x on {x.device}")
    if grouped and (
        offs.dtype is not torch.int32 or offs.shape != (ws[0],) or not offs.is_contiguous() or offs.get_device() != dev
    ):
        return ValueError(
            f"fp8 Metal GEMV: offs {offs.dtype} {list(offs.shape)} on {offs.device}: expected contiguous int32 "
            f"[{ws[0]}] (one cumulative end per expert) on {x.device}"
        )
    if out is not None:
        if out.dtype is not x.dtype:
            return TypeError(f"fp8 Metal GEMV: out in {out.dtype}; the product is {x.dtype}")
        if out.get_device() != dev:
            return ValueError(f"fp8 Metal GEMV: out on {out.device}, x on {x.device}")
        r = x.numel() // k if k else math.prod(x.shape[:-1])
        if out.dim() == 2:
            ok = out.shape == (r, n) and (n == 1 or out.stride(1) == 1) and (r == 1 or out.stride(0) >= n)
        else:
            ok = out.numel() == r * n and out.is_contiguous()
        if not ok:
            return ValueError(
                f"fp8 Metal GEMV: out {list(out.shape)} with strides {list(out.stride())} for a [{r}, {n}] product: "
                f"expected [{r}, {n}] with unit column stride and rows at least {n} apart, or contiguous with "
                f"{r * n} elements"
            )
    return None


def rows_gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor,
    offs: Optional[torch.Tensor],
    *,
    bn: int,
    bk: int,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Launch the kernel on MPS tensors: ``x [R, K]``, codes ``w [N, K]`` (dense, ``offs=None``) or ``[E, N, K]``
    with int32 ``offs [E]``, float32 ``scale`` ``[ceil(N/bn), ceil(K/bk)]`` (dense) or ``[E, ...]``, contiguous.
    ``x`` may have more dims (contiguous): its leading dims are the rows, and the result has them too
    (``[..., N]``). Returns ``[R, N]`` in ``x.dtype``, written into ``out`` when given (``[R, N]`` with unit column
    stride and any row stride of at least N, e.g. the columns of a wider buffer; or contiguous of any shape with
    ``R * N`` elements). Anything else raises before the launch (:func:`launch_error`)."""
    err = launch_error(x, w, scale, offs, bn=bn, bk=bk, out=out)
    if err is not None:
        raise err
    return _launch(x, w, scale, offs, bn, bk, out)


def _launch(
    x: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor,
    offs: Optional[torch.Tensor],
    bn: int,
    bk: int,
    out: Optional[torch.Tensor],
) -> torch.Tensor:
    k = x.shape[-1]
    r = math.prod(x.shape[:-1])  # the leading dims of a contiguous x are its rows: no reshape dispatched
    n = w.shape[-2]
    groups = 0 if offs is None else w.shape[0]
    y = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device) if out is None else out
    if r == 0 or n == 0:
        return y
    if k == 0:
        return y.zero_()
    codes = w.view(torch.uint8) if w.dtype != torch.uint8 else w
    sn, sk = scale.shape[-2], scale.shape[-1]
    xs = (x.stride(0) if x.dim() == 2 else k) if r > 1 else 0
    fn = getattr(_library(), KERNELS[x.dtype])
    gx = -(-n // FEATURES_PER_GROUP)
    gy = -(-r // ROWS)
    fn(
        _buffer(x),
        codes,
        scale,
        scale if offs is None else offs,  # unused when groups == 0
        _buffer(y),
        r,
        n,
        k,
        groups,
        xs,
        bn,
        bk,
        sn,
        sk,
        y.stride(0) if r > 1 and y.dim() == 2 else n,  # an out of more dims: contiguous rows
        threads=(gx * THREADS, gy),
        group_size=(THREADS, 1),
    )
    return y


def dense_scale(scale: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, int, int]:
    """A dense layer's rowwise (``[N]``/``[N, 1]``) or tensorwise scale as the kernel reads it: ``(scale [SN, 1]
    float32, bn, bk)``, a row of blocks ``(1, K)`` or one block ``(N, K)``."""
    rowwise = scale.numel() == n and n > 1
    return scale.float().reshape(n if rowwise else 1, 1), (1 if rowwise else n), k


def dense(
    x: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor,
    bn: int,
    bk: int,
    out: Optional[torch.Tensor] = None,
) -> Optional[torch.Tensor]:
    """A dense layer ``w [N, K]`` on the kernel (float32 block scales ``[ceil(N/bn), ceil(K/bk)]``): the product, or
    ``out`` written; None where the kernel cannot take these tensors (:func:`supported`; an ``out`` in another
    dtype or on another device, or neither ``[R, N]`` with unit column stride and rows at least N apart nor
    contiguous ``[..., N]``), for the caller's reference. An ``out`` of those layouts but the wrong size, or a scale
    of the wrong shape, raises (:func:`launch_error`): the kernel would write or read past their ends."""
    n = w.shape[0]
    if supported(x, w, bk=bk) is not None:
        return None
    if out is not None:
        if out.dim() == 2:
            rows = out.shape[-1] == n and (n == 1 or out.stride(1) == 1) and (out.shape[0] == 1 or out.stride(0) >= n)
        else:
            rows = out.shape[-1] == n and out.is_contiguous()
        if out.dtype != x.dtype or out.device != x.device or not rows:
            return None
    s = scale.float().contiguous()
    err = launch_error(x, w, s, None, bn=bn, bk=bk, out=out, static_checked=True)
    if err is not None:
        raise err
    return _launch(x, w, s, None, bn, bk, out)


def _reference(
    x: torch.Tensor, codes: torch.Tensor, offs: torch.Tensor, scale: torch.Tensor, bn: int, bk: int
) -> torch.Tensor:
    """The kernel's numbers on the CPU, row by row (small shapes only): each row's weights ``code * scale`` in float32
    rounded to ``x.dtype`` (torch's own decode of the codes: NaN codes are NaN), the product summed in float64; rows
    past the last offset zero."""
    r, k = x.shape
    _, n, _ = codes.shape
    vals = codes.view(torch.float8_e4m3fn).float()
    s = scale.repeat_interleave(bn, 1)[:, :n].repeat_interleave(bk, 2)[:, :, :k]
    w = (vals * s).to(x.dtype).double()
    y = torch.zeros(r, n, dtype=torch.float64)
    ends = offs.tolist()
    for row in range(r):
        grp = next((g for g, end in enumerate(ends) if row < end), None)
        if grp is not None:
            y[row] = (w[grp] * x[row].double()).sum(-1)  # products first: NaN * 0 is NaN (a BLAS may skip zeros)
    return y.to(x.dtype)


def _mismatch(got: torch.Tensor, ref: torch.Tensor, tol: Optional[float]) -> Optional[str]:
    """How ``got`` differs from ``ref``: NaN in other places, or finite values off by more than ``tol`` (relative to
    the largest; None: bit for bit), or None."""
    gn, rn = got.isnan(), ref.isnan()
    if not torch.equal(gn, rn):
        extra, missing = int((gn & ~rn).sum()), int((rn & ~gn).sum())
        return f"NaN at {extra} outputs where the reference has a number, a number at {missing} where it has NaN"
    g, r = got[~rn].float(), ref[~rn].float()
    if tol is None:
        bad = int((g != r).sum())
        return None if bad == 0 else f"{bad} of {r.numel()} finite outputs not bit for bit"
    err = float((g - r).abs().max() / r.abs().max().clamp_min(1e-6)) if r.numel() else 0.0
    return None if err <= tol else f"relative error {err:.2e} > {tol:.0e}"


# The dtypes, each its own kernel, and the tolerance of the random cases (float32 sums in another order; fp16 and
# bf16 outputs rounded once).
_DTYPES = ((torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 1e-2))
# Scales that make exact ties when code * scale is rounded to the dtype (round to nearest even is then visible):
# fp32 1 + 2^-23, fp16 1 + 2^-11, bf16 1 + 2^-8.
_TIE = {torch.float32: 1 + 2.0**-23, torch.float16: 1 + 2.0**-11, torch.bfloat16: 1 + 2.0**-8}
# The one-hot value of x beside the tie scale: 8 significant bits (exact in bf16), so weight times x, exact in
# float32, has up to 11 (bf16) or 22 (fp16) bits and the output's own rounding to nearest even is seen too.
_ONE_HOT = 1 + 2.0**-2 + 2.0**-7
# The random cases, in each dtype: (R, N, K, experts (0: dense), (bn, bk) with None for K, offs, x, out), the
# grouped one with offs [2, 2, 5, 6] (_CASES[6]) also holding the NaN codes of _NAN_AT.
# x "2d" [R, K]; "3d" [1, R, K] contiguous (its product [1, R, N]); "shared" one row expanded to R (stride 0).
# out "strided": the columns 8 .. 8 + N of a [R, N + 24] buffer whose other columns must be kept.
_CASES = (
    (1, 45, 48, 0, (1, None), None, "2d", None),  # one row; N % 8 = 5: the second simdgroup's last 3 features past N
    (2, 42, 64, 0, (42, None), None, "2d", "strided"),  # tensorwise; N % 8 = 2: the last group's second simdgroup idle
    (3, 36, 64, 0, (1, None), None, "2d", "strided"),  # N % 8 = 4
    (4, 24, 560, 0, (1, None), None, "2d", None),  # a full row group; K > 512: a second, partial step of the lanes
    (5, 38, 560, 0, (1, None), None, "3d", None),  # a partial row group; N % 8 = 6
    (2, 150, 272, 0, (128, 128), None, "2d", None),  # published checkpoints' 128x128 blocks, partial at both edges
    (7, 36, 560, 4, (1, None), [2, 2, 5, 6], "2d", None),  # expert 1 empty, row 6 past the last offset; NaN codes
    (9, 40, 96, 3, (16, 32), [3, 3, 8], "shared", None),  # one row of stride 0 for every row; 16x32 blocks
)
# NaN codes of the grouped case (expert, feature, k): one read by rows 2-4, one by row 5 in the last chunk of K, and
# one in the expert with no rows (never read: it must not reach any output).
_NAN_AT = ((2, 5, 300, 0x7F), (3, 35, 559, 0xFF), (1, 0, 0, 0x7F))


def _decode_codes() -> torch.Tensor:
    """Codes [18, 16] for the exact decode: rows 0 and 1 finite codes with one NaN code each (0x7F at k = 0, 0xFF at
    k = 15), rows 2-17 every finite code once (code 16 n + k at [n + 2, k], the two NaN codes replaced by 0; the
    last two rows are a partial feature group, whose outputs are finite numbers)."""
    allc = torch.arange(256, dtype=torch.uint8)
    allc[(allc & 0x7F) == 0x7F] = 0
    nan_rows = torch.arange(32, dtype=torch.uint8).reshape(2, 16) + 16
    nan_rows[0, 0], nan_rows[1, 15] = 0x7F, 0xFF
    return torch.cat([nan_rows, allc.reshape(16, 16)])


def self_check(device: str = "mps") -> Optional[str]:
    """Compile the source on ``device`` and compare the kernel with the reference (:func:`_reference`, torch's own
    decode of the codes) on shapes that run each of its branches, in each activation dtype (one kernel each):

    * every code decoded exactly, bit for bit: x one-hot, at scale 1 (the decode alone; subnormal codes included: a
      build that flushed them fails here), then at a scale that makes rounding ties with x = 1.2578125 (each weight's
      rounding to the dtype, then the output's, both to nearest even), and the NaN codes 0x7F and 0xFF making their
      outputs NaN;
    * 1, 2, 3, 4 rows and partial row groups (5, 7, 9 rows); partial feature groups (N % 8 = 2, 4, 5, 6: a simdgroup
      with features past N, a simdgroup with none); K past one step of the lanes (560);
    * rowwise, tensorwise, 16x32 and 128x128 block scales, blocks partial at the edges;
    * grouped rows: an expert with no rows (and a NaN code in it, never read), rows past the last offset (zeros),
      NaN codes reaching only their expert's rows;
    * x of stride 0 (one row shared by every output row), x of 3 dims and its 3-dim product, and ``out=`` the
      columns of a wider buffer (its other columns kept, its own prefilled with NaN).

    Cost, bounded by construction rather than timed: 6 + 3 x 8 = 30 launches, each followed by one read back to the
    host, and under 1 MiB copied to the device in all (``tests/ops/test_fp8_metal_emulated.py`` counts both), plus the
    one ``torch.mps.compile_shader`` of the source; the reference is float64 products of at most [150, 272].
    Returns None, or what failed. Patch time only (:func:`mpsboost.recipes.fp8.paths.metal_verdict`, and the
    selftest's probe)."""
    try:
        _library()
    except Exception as exc:  # noqa: BLE001 - a compiler error of any kind is the answer
        return f"torch.mps.compile_shader failed: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
    codes = _decode_codes()
    for dtype, _ in _DTYPES:
        for s, c in ((1.0, 1.0), (_TIE[dtype], _ONE_HOT)):
            x = torch.eye(16, dtype=dtype) * c
            scale = torch.full((1, 1, 1), s)
            try:
                got = rows_gemv(x.to(device), codes.to(device), scale[0].to(device), None, bn=18, bk=16).cpu()
            except Exception as exc:  # noqa: BLE001 - a launch error of any kind is the answer
                return f"launching the fp8 Metal kernel failed ({dtype}): {exc}"
            why = _mismatch(got, _reference(x, codes[None], torch.tensor([16], dtype=torch.int32), scale, 18, 16), None)
            if why is not None:
                return f"the fp8 Metal kernel decodes e4m3fn codes wrongly ({dtype}, scale {s!r}): {why}"
    g = torch.Generator().manual_seed(0)
    for dtype, tol in _DTYPES:
        for r, n, k, e, (bn, bk), offs, xkind, okind in _CASES:
            bk = bk or k
            codes = torch.randint(0, 256, (max(e, 1), n, k), generator=g, dtype=torch.uint8)
            codes[(codes & 0x7F) == 0x7F] = 0
            if offs == _CASES[6][5]:
                for ce, cn, ck, c in _NAN_AT:
                    codes[ce, cn, ck] = c
            scale = torch.rand(max(e, 1), -(-n // bn), -(-k // bk), generator=g) + 0.5
            x = torch.randn(1 if xkind == "shared" else r, k, generator=g).to(dtype)
            if xkind == "shared":
                x = x.expand(r, k)
            o = torch.tensor(offs if e else [r], dtype=torch.int32)
            ref = _reference(x, codes, o, scale, bn, bk)
            where = f"({dtype}, R={r}, N={n}, K={k}, experts={e}, blocks=({bn}, {bk}), x {xkind}, out {okind})"
            try:
                xd = x.to(device) if xkind != "3d" else x.reshape(1, r, k).to(device)
                wide = out = None
                if okind == "strided":
                    wide = torch.full((r, n + 24), 7.0, dtype=dtype, device=device)
                    out = wide[:, 8 : 8 + n].fill_(float("nan"))
                w, s, od = (codes, scale, o.to(device)) if e else (codes[0], scale[0], None)
                got = rows_gemv(xd, w.to(device), s.to(device), od, bn=bn, bk=bk, out=out).cpu()
                if wide is not None:
                    kept = bool((wide[:, :8] == 7).all()) and bool((wide[:, 8 + n :] == 7).all())
                    if not kept:
                        return f"the fp8 Metal kernel wrote outside out= {where}"
            except Exception as exc:  # noqa: BLE001 - a launch error of any kind is the answer
                return f"launching the fp8 Metal kernel failed {where}: {exc}"
            if tuple(got.shape) != ((1, r, n) if xkind == "3d" else (r, n)):
                return f"the fp8 Metal kernel's product has shape {list(got.shape)} {where}"
            why = _mismatch(got.reshape(r, n), ref, tol)
            if why is not None:
                return f"the fp8 Metal kernel differs from the reference {where}: {why}"
    return None
