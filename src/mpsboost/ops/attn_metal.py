"""mpsboost's Metal kernel for an attention layer's decode step after its projections, on MPS: the q/k RMS norm,
the rotary (full or partial) and the write of the token's K/V into a preallocated cache, in one dispatch.

``mpsb_attn_qk_rope_{dtype}`` (float32, float16, bfloat16): one simdgroup per (head, sequence); the grid is
``(32 * (hq + hkv), B)``. A lane holds the elements ``lane + 32 * i`` of its head (``D <= MAX_D``); the sum of
squares is a ``simd_sum``; the normed (and rounded, as :mod:`mpsboost.ops.attn_ref` rounds) head goes through
threadgroup memory so that each lane reads its rotate-half partner; the rotated head is written contiguous
(``q [B, hq, 1, D]``, ``k [B, hkv, 1, D]``: what SDPA takes with no copy) and, with a cache, the key head and the
token's value head are written at the device-side position ``pos[0]`` of ``k_cache``/``v_cache`` ``[B, hkv, S, D]``
(a position outside ``[0, S)`` writes nothing). Norm modes and the layout of the projections' product: see
:mod:`mpsboost.ops.attn_ref`. Every product is rounded to the dtype where torch's composed ops round it.

The source is plain Metal with no torch headers, compiled once per process by ``torch.mps.compile_shader``;
:func:`self_check` compares the kernel with :func:`mpsboost.ops.attn_ref.qk_rope_reference` and its cache write at
patch time, and the kernel is reached only through the registered operator ``mpsboost::attn_qk_rope_cache``
(:mod:`mpsboost.ops.attn_step`). CPU tests compile the same text as C++ against ``tests/ops/metal_emu``
(``tests/ops/test_attn_metal_emulated.py``).
"""

from __future__ import annotations

import functools
import struct
from string import Template
from typing import Optional

import torch

from . import attn_ref

__all__ = ["SOURCE", "KERNELS", "MAX_D", "supported", "qk_rope", "self_check"]

MAX_D = 512  # head dim a lane layout covers (16 elements a lane)
_PER = MAX_D // 32

_PRELUDE = f"""#include <metal_stdlib>
using namespace metal;

#define MPSB_MAXD {MAX_D}
#define MPSB_PER {_PER}

inline float mpsb_bf16(float v) {{
  uint u = as_type<uint>(v);
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  return as_type<float>(u);
}}
inline float mpsb_ld(float v) {{ return v; }}
inline float mpsb_ld(half v) {{ return float(v); }}
inline float mpsb_ld(ushort v) {{ return as_type<float>(uint(v) << 16); }}
inline void mpsb_st(device float* p, float v) {{ *p = v; }}
inline void mpsb_st(device half* p, float v) {{ *p = half(v); }}
inline void mpsb_st(device ushort* p, float v) {{ *p = ushort(as_type<uint>(mpsb_bf16(v)) >> 16); }}
inline float mpsb_rnd(device const float*, float v) {{ return v; }}
inline float mpsb_rnd(device const half*, float v) {{ return float(half(v)); }}
inline float mpsb_rnd(device const ushort*, float v) {{ return mpsb_bf16(v); }}

template <typename XT>
inline void mpsb_attn_qk_rope(
    device const XT* y, device const float* wq, device const float* wk, device const XT* cosb,
    device const XT* sinb, device XT* qo, device XT* ko, device const XT* v, device XT* kc, device XT* vc,
    device const long* pos, long HQ, long HKV, long D, long QS, long YS, long VS, long R, long CS, long mode,
    long epsb, long has_cache, long S, uint2 tg, uint sg, uint lane) {{
  threadgroup float buf[MPSB_MAXD];
  const long h = long(tg.x), b = long(tg.y);
  const bool isq = h < HQ;
  const long kh = h - HQ;
  device const XT* src = y + b * YS + (isq ? h * QS : HQ * QS + kh * D);
  device const float* w = isq ? wq : wk;
  float xv[MPSB_PER];
  float ss = 0.0f;
  for (long i = 0; i < MPSB_PER; ++i) {{
    const long e = long(lane) + 32 * i;
    xv[i] = e < D ? mpsb_ld(src[e]) : 0.0f;
    ss += xv[i] * xv[i];
  }}
  if (mode != 0) {{
    const float eps = as_type<float>(uint(epsb));
    const float inv = 1.0f / sqrt(simd_sum(ss) / float(D) + eps);
    for (long i = 0; i < MPSB_PER; ++i) {{
      const long e = long(lane) + 32 * i;
      if (e < D) {{
        const float n = xv[i] * inv;
        xv[i] = mode == 1 ? mpsb_rnd(src, n * w[e]) : mpsb_rnd(src, mpsb_rnd(src, n) * w[e]);
      }}
    }}
  }}
  for (long i = 0; i < MPSB_PER; ++i) {{
    const long e = long(lane) + 32 * i;
    if (e < D) {{
      buf[e] = xv[i];
    }}
  }}
  threadgroup_barrier(mem_flags::mem_threadgroup);
  device const XT* cr = cosb + b * CS;
  device const XT* sr = sinb + b * CS;
  const long hr = R / 2;
  device XT* dst = isq ? qo + (b * HQ + h) * D : ko + (b * HKV + kh) * D;
  const long p = has_cache != 0 ? pos[0] : -1;
  const bool write = !isq && p >= 0 && p < S;
  for (long i = 0; i < MPSB_PER; ++i) {{
    const long e = long(lane) + 32 * i;
    if (e < D) {{
      float o = xv[i];
      if (e < R) {{
        const float pr = e < hr ? -buf[e + hr] : buf[e - hr];
        o = mpsb_rnd(src, mpsb_rnd(src, xv[i] * mpsb_ld(cr[e])) + mpsb_rnd(src, pr * mpsb_ld(sr[e])));
      }}
      mpsb_st(dst + e, o);
      if (write) {{
        const long at = ((b * HKV + kh) * S + p) * D + e;
        mpsb_st(kc + at, o);
        vc[at] = v[b * VS + kh * D + e];
      }}
    }}
  }}
}}
"""

_KERNEL = Template("""
kernel void mpsb_attn_qk_rope_${name}(
    device const ${xt}* y [[buffer(0)]],
    device const float* wq [[buffer(1)]],
    device const float* wk [[buffer(2)]],
    device const ${xt}* cosb [[buffer(3)]],
    device const ${xt}* sinb [[buffer(4)]],
    device ${xt}* qo [[buffer(5)]],
    device ${xt}* ko [[buffer(6)]],
    device const ${xt}* v [[buffer(7)]],
    device ${xt}* kc [[buffer(8)]],
    device ${xt}* vc [[buffer(9)]],
    device const long* pos [[buffer(10)]],
    constant long& HQ [[buffer(11)]],
    constant long& HKV [[buffer(12)]],
    constant long& D [[buffer(13)]],
    constant long& QS [[buffer(14)]],
    constant long& YS [[buffer(15)]],
    constant long& VS [[buffer(16)]],
    constant long& R [[buffer(17)]],
    constant long& CS [[buffer(18)]],
    constant long& mode [[buffer(19)]],
    constant long& epsb [[buffer(20)]],
    constant long& has_cache [[buffer(21)]],
    constant long& S [[buffer(22)]],
    uint2 tg [[threadgroup_position_in_grid]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  mpsb_attn_qk_rope<${xt}>(y, wq, wk, cosb, sinb, qo, ko, v, kc, vc, pos, HQ, HKV, D, QS, YS, VS, R, CS, mode, epsb,
                           has_cache, S, tg, sg, lane);
}
""")

# activation dtype -> (kernel suffix, Metal type); bfloat16 as its 16 bits
_TYPES = {torch.float32: ("float", "float"), torch.float16: ("half", "half"), torch.bfloat16: ("bfloat16", "ushort")}
SOURCE = _PRELUDE + "".join(_KERNEL.substitute(name=n, xt=t) for n, t in _TYPES.values())
KERNELS = {dt: f"mpsb_attn_qk_rope_{spec[0]}" for dt, spec in _TYPES.items()}


def supported(
    y: torch.Tensor,
    cos: torch.Tensor,
    hq: int,
    hkv: int,
    d: int,
    q_stride: int,
    v: Optional[torch.Tensor],
    k_cache: Optional[torch.Tensor],
    v_cache: Optional[torch.Tensor],
) -> Optional[str]:
    """None when the kernel takes these operands, else why not (then the reference runs)."""
    if y.dtype not in KERNELS or cos.dtype != y.dtype:
        return f"y in {y.dtype}, cos in {cos.dtype}: the kernel takes one of float32, float16, bfloat16 for both"
    if d > MAX_D or d % 2:
        return f"head dim {d}: the kernel takes even head dims up to {MAX_D}"
    if y.dim() != 2 or y.stride(-1) != 1:
        return "y must be [B, N] with unit column stride"
    if k_cache is not None:
        b = y.shape[0]
        for c in (k_cache, v_cache):
            if c is None or not c.is_contiguous() or c.dim() != 4 or tuple(c.shape[:2]) != (b, hkv):
                return "caches must be contiguous [B, hkv, S, D]"
            if c.shape[3] != d or c.dtype != y.dtype:
                return "caches must be [B, hkv, S, D] in y's dtype"
        if v is None or v.dim() != 2 or v.stride(-1) != 1 or v.dtype != y.dtype:
            return "v must be [B, hkv * D] with unit column stride in y's dtype"
    return None


@functools.lru_cache(maxsize=None)
def _library():
    """The compiled library (once per process; the first call is at patch time, from the self-check)."""
    return torch.mps.compile_shader(SOURCE)


def _buffer(t: torch.Tensor) -> torch.Tensor:
    """A strided input as a 1-D view from its first element to its last reachable one (the same memory)."""
    if t.is_contiguous():
        return t
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.as_strided((extent,), (1,), t.storage_offset())


def _eps_bits(eps: float) -> int:
    return struct.unpack("<I", struct.pack("<f", eps))[0]


def qk_rope(
    y: torch.Tensor,
    wq: Optional[torch.Tensor],
    wk: Optional[torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    hq: int,
    hkv: int,
    d: int,
    q_stride: int,
    eps: float,
    mode: int,
    v: Optional[torch.Tensor] = None,
    k_cache: Optional[torch.Tensor] = None,
    v_cache: Optional[torch.Tensor] = None,
    pos: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the kernel (the caller checked :func:`supported`): ``(q [B, hq, 1, D], k [B, hkv, 1, D])``, and the
    cache write when ``k_cache`` is given."""
    b = y.shape[0]
    q = torch.empty((b, hq, 1, d), dtype=y.dtype, device=y.device)
    k = torch.empty((b, hkv, 1, d), dtype=y.dtype, device=y.device)
    if b == 0:
        return q, k
    r = cos.shape[-1]
    c2, s2 = cos.reshape(cos.shape[0], r), sin.reshape(sin.shape[0], r)
    if c2.stride(-1) != 1 or s2.stride(-1) != 1 or c2.stride(0) != s2.stride(0):
        c2, s2 = c2.contiguous(), s2.contiguous()
    cs = c2.stride(0) if c2.shape[0] > 1 else 0
    has = k_cache is not None
    wqf = wq if wq is not None else _buffer(y)  # unused without a norm
    wkf = wk if wk is not None else _buffer(y)
    fn = getattr(_library(), KERNELS[y.dtype])
    fn(
        _buffer(y),
        wqf,
        wkf,
        _buffer(c2),
        _buffer(s2),
        q,
        k,
        _buffer(v) if has else y,
        k_cache if has else _buffer(y),  # unused (never written) without a cache
        v_cache if has else _buffer(y),
        pos if has else y,
        hq,
        hkv,
        d,
        q_stride,
        y.stride(0) if b > 1 else y.shape[1],
        (v.stride(0) if b > 1 else v.shape[1]) if has else 0,
        r,
        cs,
        mode,
        _eps_bits(eps),
        int(has),
        k_cache.shape[2] if has else 0,
        threads=(32 * (hq + hkv), b),
        group_size=(32, 1),
    )
    return q, k


_TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-6))


def self_check(device: str = "mps") -> Optional[str]:
    """Compile the source on ``device`` and compare the kernel with :mod:`mpsboost.ops.attn_ref` in each dtype:
    every norm mode, full and partial rotary, one sequence and three (cos broadcast and per sequence), grouped
    heads, the gate-interleaved layout, the cache write at a device-side position. None when it passes, else why
    not."""
    try:
        _library()
    except Exception as exc:  # a compile failure is a failed check: the composed path runs
        return f"torch.mps.compile_shader failed: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
    g = torch.Generator().manual_seed(0)
    for dt in KERNELS:
        for b, hq, hkv, d, r, mode, gated, cb in (
            (1, 4, 2, 64, 16, 1, True, 1),
            (3, 8, 2, 128, 128, 2, False, 3),
            (2, 2, 2, 64, 64, 0, False, 1),
        ):
            qs = 2 * d if gated else d
            n = hq * qs + hkv * d
            y = torch.randn(b, n, generator=g).to(dt).to(device)
            w = None if mode == 0 else (torch.rand(2, d, generator=g) + 0.5).to(device)
            wq, wk = (None, None) if w is None else (w[0].contiguous(), w[1].contiguous())
            ang = torch.rand(cb, 1, r, generator=g) * 6
            cos, sin = ang.cos().to(dt).to(device), ang.sin().to(dt).to(device)
            v = torch.randn(b, hkv * d, generator=g).to(dt).to(device)
            kc = torch.zeros(b, hkv, 5, d, dtype=dt, device=device)
            vc = torch.zeros_like(kc)
            pos = torch.tensor([3], device=device)
            try:
                q, k = qk_rope(y, wq, wk, cos, sin, hq, hkv, d, qs, 1e-6, mode, v, kc, vc, pos)
            except Exception as exc:
                return f"{dt} launch failed: {type(exc).__name__}: {exc}"
            rq, rk = attn_ref.qk_rope_reference(y, wq, wk, cos, sin, hq, hkv, d, qs, 1e-6, mode)
            rkc, rvc = torch.zeros_like(kc), torch.zeros_like(vc)
            attn_ref.cache_write_reference(rk, v.view(b, hkv, 1, d), rkc, rvc, pos)
            for name, got, ref in (("q", q, rq), ("k", k, rk), ("k_cache", kc, rkc), ("v_cache", vc, rvc)):
                e = _rel(got, ref)
                if not e <= _TOL[dt]:
                    return f"{name} off by {e:.2e} relative in {dt} (b={b}, heads {hq}/{hkv}, d={d}, rotary {r})"
    return None
