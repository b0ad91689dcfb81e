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
scale), so it needs no float8 type in Metal and works the same on uint8 storage (MPS before 2.15).

The source is compiled once per process by ``torch.mps.compile_shader`` (public since torch 2.7), at patch
time: :func:`self_check` compiles it and compares it with the reference on shapes that cover every branch, and
the fp8 recipe uses the kernel on a Mac only if that passes (:func:`mpsboost.ops.fp8.metal_verdict`, after the
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
          prev = e;
        }
        device const ${xt}* xr = x + (r0 + i) * xs + k;
        float d = 0.0f;
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
inline ushort mpsb_bf16_store(float v) { return ushort(as_type<uint>(mpsb_bf16(v)) >> 16); }
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
    stride and any row stride, e.g. the columns of a wider buffer; or contiguous of any shape with ``R * N``
    elements). The caller checked :func:`supported`."""
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
    dtype, or neither ``[R, N]`` with unit column stride nor contiguous), for the caller's reference."""
    n = w.shape[0]
    if supported(x, w, bk=bk) is not None:
        return None
    if out is not None:
        rows = out.shape[-1] == n and (out.is_contiguous() if out.dim() != 2 else (n == 1 or out.stride(1) == 1))
        if out.dtype != x.dtype or not rows:
            return None
    return rows_gemv(x, w, scale.float().contiguous(), None, bn=bn, bk=bk, out=out)


def _reference(
    x: torch.Tensor, codes: torch.Tensor, offs: torch.Tensor, scale: torch.Tensor, bn: int, bk: int
) -> torch.Tensor:
    """The kernel's numbers on the CPU, row by row (small shapes only): each row's weights ``code * scale`` in float32
    rounded to ``x.dtype``, the product summed in float64; rows past the last offset zero."""
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
            y[row] = w[grp] @ x[row].double()
    return y.to(x.dtype)


def self_check(device: str = "mps") -> Optional[str]:
    """Compile the source on ``device`` and compare the kernel with the reference on shapes that cover its
    branches (1-4 rows and a partial row group, a partial feature group, rowwise, tensorwise and block scales,
    an expert with no rows, rows past the last offset, a shared row of stride 0; each activation dtype).
    Returns None, or what failed. Patch time only (:func:`mpsboost.ops.fp8.metal_verdict`, and the selftest's probe)."""
    try:
        _library()
    except Exception as exc:  # noqa: BLE001 - a compiler error of any kind is the answer
        return f"torch.mps.compile_shader failed: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
    # Every finite code decoded exactly (one-hot rows pick one code each; subnormals included: a build that
    # flushed them, e.g. a fast-math mode, fails here even where the random cases below stay within tolerance).
    codes = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    codes[(codes & 0x7F) == 0x7F] = 0
    want = codes.view(torch.float8_e4m3fn).float()
    try:
        got = rows_gemv(
            torch.eye(16, device=device), codes.to(device), torch.ones(1, 1, device=device), None, bn=16, bk=16
        ).cpu()
    except Exception as exc:  # noqa: BLE001 - a launch error of any kind is the answer
        return f"launching the fp8 Metal kernel failed: {exc}"
    if not torch.equal(got, want.t()):
        bad = int((got != want.t()).sum())
        return f"the fp8 Metal kernel decodes {bad} of 254 finite e4m3fn codes wrongly"
    g = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 1e-2)):
        for r, n, k, e, bn, bk, offs, shared in (
            (1, 40, 48, 0, 1, 48, None, False),
            (3, 24, 64, 0, 24, 64, None, False),
            (5, 40, 512 + 48, 0, 1, 512 + 48, None, False),
            (7, 24, 64, 4, 1, 64, [2, 2, 5, 6], False),
            (8, 40, 96, 3, 16, 32, [3, 3, 8], True),
        ):
            codes = torch.randint(0, 256, (max(e, 1), n, k), generator=g, dtype=torch.uint8)
            codes[(codes & 0x7F) == 0x7F] = 0  # no NaN codes
            scale = torch.rand(max(e, 1), -(-n // bn), -(-k // bk), generator=g) + 0.5
            x = torch.randn(1 if shared else r, k, generator=g).to(dtype)
            if shared:
                x = x.expand(r, k)
            o = None if offs is None else torch.tensor(offs, dtype=torch.int32)
            w = codes if e else codes[0]
            s = scale if e else scale[0]
            ref = _reference(x, codes, o if e else torch.tensor([r], dtype=torch.int32), scale, bn, bk)
            try:
                od = None if o is None else o.to(device)
                got = rows_gemv(x.to(device), w.to(device), s.to(device), od, bn=bn, bk=bk).cpu()
            except Exception as exc:  # noqa: BLE001 - a launch error of any kind is the answer
                return f"launching the fp8 Metal kernel failed ({dtype}, R={r}, N={n}, K={k}): {exc}"
            err = float((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6))
            if not err <= tol:
                return f"the fp8 Metal kernel differs from the reference by {err:.2e} ({dtype}, R={r}, N={n}, K={k})"
    return None
