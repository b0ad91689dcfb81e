"""mpsboost's Metal kernel for one decode step of a Gated DeltaNet layer after its projections, on MPS.

One dispatch per layer does what the composed step does in 22 aten ops (:mod:`mpsboost.ops.deltanet_step`): from
the projections' products ``y [B, N]`` in the canonical column order ``[q | k | v | z | b | a]`` it

1. rolls the depthwise causal conv's state (``[B, C, W]``, the cache's own tensor, updated in place) by the new
   column and computes the conv and its ``silu`` for every q, k and v channel (products and sums in float32);
2. L2-normalises q and k per key head (transformers' ``l2norm``: ``x * rsqrt(sum(x^2) + 1e-6)``) and scales q by
   ``dk ** -0.5``;
3. computes the gates: ``beta = c * sigmoid(b)`` (``c`` = 2 where a model allows negative eigenvalues) and the decay
   ``exp(-exp(A_log) * softplus(a + dt_bias))``, from the module's own ``A_log`` and ``dt_bias`` (read every step:
   nothing derived from them is kept);
4. updates the float32 recurrent state ``S`` (``[B, Hv, dk, dv]``, the cache's own tensor) in place in the
   reference's order: ``S = decay S; d = beta (v - S^T k); S += k d^T; o = S^T q``;
5. applies the gated RMSNorm ``w * o * rsqrt(mean(o^2) + eps) * silu(z)`` and writes ``[B, Hv * dv]`` in the
   activations' dtype.

Layout: one threadgroup per (sequence, key head), ``THREADS`` threads (``nt``, a multiple of 32 from 64 to 1024:
the key head's ``r * dv`` value columns rounded up). A threadgroup owns its key head's q and k channels and its
``r`` value heads' v channels, so each channel's conv state is rolled by exactly one threadgroup (no race between
threadgroups: none reads a channel another writes). The normalised q and k, the v column and the output column of
each thread sit in threadgroup memory; three ``threadgroup_barrier``\\ s separate the phases; the norms are
``simd_sum`` reductions (one simdgroup per vector). A thread owns one column ``j`` of one value head's state: it
reads the column twice (``S^T k``, then the update and ``S^T q`` in the same pass) and writes it once; the 32 lanes
of a simdgroup read 32 consecutive floats of a state row (coalesced).

Limits (:func:`supported`): ``dk <= 256``, ``r * dv <= 2048``, ``r <= 64``; the conv state in the activations'
dtype and contiguous; the state float32 and contiguous; ``y`` with unit column stride. The weights (conv weight and
bias, ``A_log``, ``dt_bias``, the norm's weight) are read in their own dtype (float32, float16 or bfloat16: a
run-time argument each), so the module's own tensors are passed, views and all.

The source is compiled once per process by ``torch.mps.compile_shader`` (public since torch 2.7) at patch time:
:func:`self_check` compiles it and compares it with the composed step, and the recipe times it against the composed
step at the layer's own shapes (:func:`mpsboost.ondevice.choose`) before taking it. It is reached only through the
registered operator ``mpsboost::deltanet_step`` (its MPS kernel), so ``torch.compile`` sees an opaque call.
:data:`SOURCE` is plain Metal with no torch headers, so CPU tests compile the same text as C++ against a small
emulation of the Metal built-ins and run it (``tests/ops/test_deltanet_metal_emulated.py``).
"""

from __future__ import annotations

import functools
import struct
from string import Template
from typing import Optional

import torch

__all__ = ["SOURCE", "KERNELS", "MAX_DK", "MAX_COLS", "MAX_R", "threads_for", "supported", "step", "self_check"]

MAX_DK = 256  # key head width (threadgroup memory for q and k)
MAX_COLS = 2048  # value columns of one key head (r * dv): threadgroup memory for v and o
MAX_R = 64  # value heads per key head

# a weight's dtype as the kernel's run-time argument
_WTYPE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

_PRELUDE = f"""#include <metal_stdlib>
using namespace metal;

#define MPSB_DN_MAXDK {MAX_DK}
#define MPSB_DN_MAXCOLS {MAX_COLS}
#define MPSB_DN_MAXR {MAX_R}

// float -> the nearest bfloat16 (ties to even), as a float (finite inputs).
inline float mpsb_dn_bf16(float v) {{
  uint u = as_type<uint>(v);
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  return as_type<float>(u);
}}

// Element i of a weight of dtype t (0 float32, 1 float16, 2 bfloat16), as a float.
inline float mpsb_dn_w(device const uchar* p, long i, long t) {{
  if (t == 0) {{
    return ((device const float*)p)[i];
  }}
  if (t == 1) {{
    return float(((device const half*)p)[i]);
  }}
  return as_type<float>(uint(((device const ushort*)p)[i]) << 16);
}}

inline float mpsb_dn_ld(float v) {{ return v; }}
inline float mpsb_dn_ld(half v) {{ return float(v); }}
inline float mpsb_dn_ld(ushort v) {{ return as_type<float>(uint(v) << 16); }}  // bfloat16 as its 16 bits
inline void mpsb_dn_st(device float* p, float v) {{ *p = v; }}
inline void mpsb_dn_st(device half* p, float v) {{ *p = half(v); }}
inline void mpsb_dn_st(device ushort* p, float v) {{ *p = ushort(as_type<uint>(mpsb_dn_bf16(v)) >> 16); }}

inline float mpsb_dn_sigmoid(float x) {{ return 1.0f / (1.0f + exp(-x)); }}

// softplus(x) = max(x, 0) + log1p(exp(-|x|)), log1p by Goldberg's correction (Metal has no log1p): exact to a few
// ulp for every x, so the decay of a slow-decay gate (softplus near 0) keeps its relative precision.
inline float mpsb_dn_softplus(float x) {{
  const float e = exp(-fabs(x));
  const float u = 1.0f + e;
  const float l = u == 1.0f ? e : log(u) * (e / (u - 1.0f));
  return (x > 0.0f ? x : 0.0f) + l;
}}
"""

_KERNEL = Template("""
kernel void mpsb_deltanet_step_${name}(
    device const ${xt}* y [[buffer(0)]],
    device ${xt}* cs [[buffer(1)]],
    device float* S [[buffer(2)]],
    device const uchar* cw [[buffer(3)]],
    device const uchar* cb [[buffer(4)]],
    device const uchar* dtb [[buffer(5)]],
    device const uchar* alog [[buffer(6)]],
    device const uchar* nw [[buffer(7)]],
    device ${xt}* out [[buffer(8)]],
    constant long& hk [[buffer(9)]],
    constant long& dk [[buffer(10)]],
    constant long& hv [[buffer(11)]],
    constant long& dv [[buffer(12)]],
    constant long& W [[buffer(13)]],
    constant long& ys [[buffer(14)]],
    constant long& hasb [[buffer(15)]],
    constant long& cwt [[buffer(16)]],
    constant long& cbt [[buffer(17)]],
    constant long& dtt [[buffer(18)]],
    constant long& alt [[buffer(19)]],
    constant long& nwt [[buffer(20)]],
    constant long& epsb [[buffer(21)]],
    constant long& betab [[buffer(22)]],
    constant long& nt [[buffer(23)]],
    uint2 tg [[threadgroup_position_in_grid]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float tq[MPSB_DN_MAXDK];
  threadgroup float tk[MPSB_DN_MAXDK];
  threadgroup float tv[MPSB_DN_MAXCOLS];
  threadgroup float tn[MPSB_DN_MAXR + 2];
  const long tid = long(sg) * 32 + long(lane);
  const long nsg = nt / 32;
  const long g = long(tg.x);
  const long b = long(tg.y);
  const long r = hv / hk;
  const long kd = hk * dk;
  const long vd = hv * dv;
  const long C = 2 * kd + vd;
  const long cols = r * dv;
  const float eps = as_type<float>(uint(epsb));
  const float bscale = as_type<float>(uint(betab));
  device const ${xt}* yr = y + b * ys;

  // 1. the conv of this key head's q and k channels and of its value heads' v channels, each channel's state rolled
  //    by the new column (this threadgroup owns these channels: no other one reads or writes them)
  for (long i = tid; i < 2 * dk + cols; i += nt) {
    const long ch = i < dk ? g * dk + i : (i < 2 * dk ? kd + g * dk + (i - dk) : 2 * kd + g * cols + (i - 2 * dk));
    device ${xt}* st = cs + (b * C + ch) * W;
    float acc = 0.0f;
    for (long j = 0; j + 1 < W; ++j) {
      const ${xt} s = st[j + 1];
      acc += mpsb_dn_ld(s) * mpsb_dn_w(cw, ch * W + j, cwt);
      st[j] = s;
    }
    const ${xt} xv = yr[ch];
    acc += mpsb_dn_ld(xv) * mpsb_dn_w(cw, ch * W + W - 1, cwt);
    st[W - 1] = xv;
    if (hasb != 0) {
      acc += mpsb_dn_w(cb, ch, cbt);
    }
    const float s = acc * mpsb_dn_sigmoid(acc);
    if (i < dk) {
      tq[i] = s;
    } else if (i < 2 * dk) {
      tk[i - dk] = s;
    } else {
      tv[i - 2 * dk] = s;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // 2. |q|^2 and |k|^2: one simdgroup each
  if (sg < 2) {
    float p = 0.0f;
    for (long i = long(lane); i < dk; i += 32) {
      const float v = sg == 0 ? tq[i] : tk[i];
      p += v * v;
    }
    const float t = simd_sum(p);
    if (lane == 0) {
      tn[sg] = t;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const float qs = 1.0f / (sqrt(tn[0] + 1e-6f) * sqrt(float(dk)));
  const float ks = 1.0f / sqrt(tn[1] + 1e-6f);

  // 3. the delta rule: one column j of one value head's state per thread, read twice, written once
  for (long c = tid; c < cols; c += nt) {
    const long hl = c / dv;
    const long j = c - hl * dv;
    const long h = g * r + hl;
    const float beta = bscale * mpsb_dn_sigmoid(mpsb_dn_ld(yr[2 * kd + 2 * vd + h]));
    const float a = mpsb_dn_ld(yr[2 * kd + 2 * vd + hv + h]) + mpsb_dn_w(dtb, h, dtt);
    const float decay = exp(-exp(mpsb_dn_w(alog, h, alt)) * mpsb_dn_softplus(a));
    device float* col = S + (b * hv + h) * dk * dv + j;
    float u = 0.0f;
    for (long i = 0; i < dk; ++i) {
      u += (col[i * dv] * decay) * tk[i];
    }
    const float d = (tv[c] - u * ks) * beta;
    float o = 0.0f;
    for (long i = 0; i < dk; ++i) {
      const float s = col[i * dv] * decay + (tk[i] * ks) * d;
      col[i * dv] = s;
      o += s * (tq[i] * qs);
    }
    tv[c] = o;  // this thread's own column: its v is read above
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // 4. |o|^2 of each value head: simdgroup s takes heads s, s + nsg, ...
  for (long hl = long(sg); hl < r; hl += nsg) {
    float p = 0.0f;
    for (long j = long(lane); j < dv; j += 32) {
      const float v = tv[hl * dv + j];
      p += v * v;
    }
    const float t = simd_sum(p);
    if (lane == 0) {
      tn[2 + hl] = t;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // 5. the gated RMSNorm, written in the activations' dtype
  for (long c = tid; c < cols; c += nt) {
    const long hl = c / dv;
    const long j = c - hl * dv;
    const long h = g * r + hl;
    const float inv = 1.0f / sqrt(tn[2 + hl] / float(dv) + eps);
    const float z = mpsb_dn_ld(yr[2 * kd + vd + h * dv + j]);
    mpsb_dn_st(out + b * vd + h * dv + j, mpsb_dn_w(nw, j, nwt) * (tv[c] * inv) * (z * mpsb_dn_sigmoid(z)));
  }
}
""")

# activation (conv state and output) dtype -> (kernel suffix, Metal type); bfloat16 as its 16 bits
_TYPES = {torch.float32: ("float", "float"), torch.float16: ("half", "half"), torch.bfloat16: ("bfloat16", "ushort")}

SOURCE = _PRELUDE + "".join(_KERNEL.substitute(name=name, xt=xt) for name, xt in _TYPES.values())
KERNELS = {dt: f"mpsb_deltanet_step_{spec[0]}" for dt, spec in _TYPES.items()}


def threads_for(cols: int) -> int:
    """Threads per threadgroup for ``cols`` (``r * dv``) value columns: rounded up to 32, from 64 to 1024."""
    return min(1024, max(64, -(-cols // 32) * 32))


def _float_bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def supported(
    y: torch.Tensor,
    conv_state: torch.Tensor,
    state: torch.Tensor,
    conv_w: torch.Tensor,
    conv_b: Optional[torch.Tensor],
    dt_bias: torch.Tensor,
    a_log: torch.Tensor,
    norm_w: torch.Tensor,
    out: torch.Tensor,
    hk: int,
    dk: int,
) -> Optional[str]:
    """Why the kernel cannot take these tensors (static facts), or None. The shapes themselves are checked by the
    operator (:func:`mpsboost.ops.deltanet_step.check`)."""
    if y.dtype not in _TYPES:
        return f"activations in {y.dtype}: the kernel has float32, float16 and bfloat16"
    if conv_state.dtype != y.dtype or not conv_state.is_contiguous():
        return "the conv state must be contiguous, in the activations' dtype"
    if state.dtype != torch.float32 or not state.is_contiguous():
        return "the recurrent state must be contiguous float32"
    if y.dim() != 2 or (y.shape[1] > 1 and y.stride(1) != 1):
        return "y must be 2-D with unit column stride"
    if out.dtype != y.dtype or not out.is_contiguous():
        return "out must be contiguous, in the activations' dtype"
    ws = [conv_w, dt_bias, a_log, norm_w] + ([conv_b] if conv_b is not None else [])
    if any(w.dtype not in _WTYPE or not w.is_contiguous() for w in ws):
        return "the weights must be contiguous float32, float16 or bfloat16"
    hv, dv = a_log.shape[0], norm_w.shape[0]
    r = hv // hk
    if dk > MAX_DK or r * dv > MAX_COLS or r > MAX_R:
        return f"dk={dk}, r={r}, dv={dv}: the kernel takes dk <= {MAX_DK}, r * dv <= {MAX_COLS}, r <= {MAX_R}"
    return None


@functools.lru_cache(maxsize=None)
def _library():
    """The compiled library (once per process; the first call is at patch time, from the self-check)."""
    return torch.mps.compile_shader(SOURCE)


def _buffer(t: torch.Tensor) -> torch.Tensor:
    """A contiguous 1-D view from ``t``'s first element to its last reachable one (``y`` may be the columns of a
    wider buffer): the same memory, addressed by the row stride the kernel is given."""
    if t.is_contiguous():
        return t
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.as_strided((extent,), (1,), t.storage_offset())


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def step(
    y: torch.Tensor,
    conv_state: torch.Tensor,
    state: torch.Tensor,
    conv_w: torch.Tensor,
    conv_b: Optional[torch.Tensor],
    dt_bias: torch.Tensor,
    a_log: torch.Tensor,
    norm_w: torch.Tensor,
    out: torch.Tensor,
    *,
    hk: int,
    dk: int,
    norm_eps: float,
    beta_scale: float,
) -> torch.Tensor:
    """Launch the kernel (one dispatch): ``conv_state`` and ``state`` updated in place, ``out`` written. The caller
    checked the shapes and :func:`supported`."""
    b = y.shape[0]
    hv, dv = a_log.shape[0], norm_w.shape[0]
    width = conv_w.shape[-1]
    nt = threads_for((hv // hk) * dv)
    if b == 0:
        return out
    fn = getattr(_library(), KERNELS[y.dtype])
    fn(
        _buffer(y),
        conv_state,
        state,
        _bytes(conv_w),
        _bytes(conv_b if conv_b is not None else conv_w),  # unused when hasb == 0
        _bytes(dt_bias),
        _bytes(a_log),
        _bytes(norm_w),
        out,
        hk,
        dk,
        hv,
        dv,
        width,
        y.stride(0) if b > 1 else y.shape[1],
        int(conv_b is not None),
        _WTYPE[conv_w.dtype],
        _WTYPE[conv_b.dtype] if conv_b is not None else 0,
        _WTYPE[dt_bias.dtype],
        _WTYPE[a_log.dtype],
        _WTYPE[norm_w.dtype],
        _float_bits(norm_eps),
        _float_bits(beta_scale),
        nt,
        threads=(hk * nt, b),
        group_size=(nt, 1),
    )
    return out


# the kernel against the composed step, relative to the output's largest magnitude (float32 state either way): the
# output's rounding to the activations' dtype, and float32 sums in another order
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}

# (B, hk, r, dk, dv, W, activations, conv bias, beta scale): every head ratio the models take (1, 2, 4; 3 for
# Qwen3.5 dense), batch 1 to 3, each activation dtype, a conv bias, OLMo-Hybrid's beta scale 2, and a key head of
# more value columns than a threadgroup has threads (r * dv = 1152: the threads loop)
_CASES = (
    (1, 2, 2, 32, 32, 4, torch.bfloat16, False, 1.0),
    (3, 1, 4, 64, 32, 4, torch.float32, True, 1.0),
    (2, 2, 1, 32, 64, 3, torch.float16, False, 2.0),
    (1, 1, 9, 32, 128, 4, torch.float32, False, 1.0),
    (2, 2, 3, 32, 32, 4, torch.bfloat16, True, 1.0),
)


def self_check(device: str = "mps") -> Optional[str]:
    """Compile the source on ``device`` and compare the kernel with the composed step
    (:func:`mpsboost.ops.deltanet_step.reference`, run on the CPU in float32) on :data:`_CASES`, two steps each (a
    continued state), slow-decay gates among the fast ones: the output, the conv state and the recurrent state.
    Five launches of a few KiB each. Returns None, or what failed. Patch time only."""
    from .deltanet_ref import random_inputs, reference

    try:
        _library()
    except Exception as exc:  # noqa: BLE001 - a compiler error of any kind is the answer
        return f"torch.mps.compile_shader failed: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
    g = torch.Generator().manual_seed(0)
    for b, hk, r, dk, dv, width, dt, bias, beta_scale in _CASES:
        args, kw = random_inputs(g, b=b, hk=hk, r=r, dk=dk, dv=dv, width=width, dtype=dt, bias=bias)
        kw["beta_scale"] = beta_scale
        dev = [a.to(device, copy=True) if isinstance(a, torch.Tensor) else a for a in args]
        for _ in range(2):
            reference(*args, **kw)
            try:
                step(*dev, **kw)
                got = [t.cpu() for t in (dev[8], dev[1], dev[2])]
            except Exception as exc:  # noqa: BLE001 - a launch error of any kind is the answer
                return f"launching the DeltaNet step kernel failed (B={b}, r={r}, {dt}): {exc}"
            for name, want, have in zip(("output", "conv state", "state"), (args[8], args[1], args[2]), got):
                ref = want.double()
                err = float((have.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-6))
                if not err <= TOL[dt if name == "output" else torch.float32]:
                    return f"the DeltaNet step kernel's {name} differs by {err:.2e} (B={b}, r={r}, dk={dk}, {dt})"
            dev[1].copy_(args[1])  # next step from the reference's states: each step checked on its own
            dev[2].copy_(args[2])
    return None
