"""mpsboost's Metal kernels for the non-matmul chains of a sparse MoE block at decode, on MPS.

Three kernels, each instantiated per activation dtype (float32, float16, bfloat16):

* ``mpsb_moe_route_{dtype}``: the router's softmax, top-k and renormalisation, and the ordering the grouped expert
  products need, for a few tokens (``N * k <= MAX_PAIRS``): from the router logits ``[N, E]`` it writes the routing
  weights ``[N, k]`` (float32 or the activation dtype), the expert ids ``[N, k]`` (int64, descending logit), each
  pair's position in expert order ``pos [N, k]`` (int32; pairs sorted by expert, stable in ``(token, slot)``
  order), the int32 cumulative ends ``offs [E]`` (``torch._grouped_mm``'s ``offs``: pairs of experts ``0..e``) and,
  when asked, the token rows in that order ``rows [N * k, H]`` (the grouped products' input). Nothing is read on
  the host. Layout: one simdgroup per threadgroup; each lane holds ``ceil(E / 32)`` logits of a token, and each of
  the k rounds takes the largest remaining logit by ``simd_max``, the lowest expert id among equal logits by a
  second ``simd_max`` over negated ids: the tie order is "larger logit first, then lower expert id", a stable
  descending sort's (what ``torch.sort(..., descending=True, stable=True)`` gives; the CPU's ``torch.topk`` has no
  defined tie order). Softmax is monotonic, so the top-k of the probabilities are those of the logits;
  renormalised weights are ``exp(l_j - l_0) / sum_i exp(l_i - l_0)`` over the k, the others
  ``exp(l_j - max) / sum_e exp(l_e - max)`` over all E, in float32 from the logits as stored (transformers'
  ``softmax(logits, dtype=float32)``). Each pair's position is a count (``simd_sum``) of the pairs before it in
  expert order, and the offsets a count per expert. The grid holds one simdgroup per 256 columns of the rows it
  copies; each routes the tokens itself (a few hundred logits: cheaper than a second dispatch), and the first one
  writes the routing.
* ``mpsb_moe_glu_{dtype}``: ``y [R, I] = silu(a) * b`` elementwise, each product rounded as torch's two ops round
  them (``silu`` in float32 rounded to the dtype, then the product rounded): the gated activation of the routed
  experts (``a``, ``b`` the two halves of each ``[R, 2I]`` row of the fused gate/up product) and of the shared
  expert (its gate and up products).
* ``mpsb_moe_combine_{dtype}``: ``y [N, H] = sum_j w[n, j] * pair[pos[n, j]] (+ sigmoid(g[n]) * shared[n])``: the
  weighted sum over a token's k routed outputs (read where ``pos`` puts them: no unsort) in float32, plus the
  shared expert's output times its sigmoid gate (the gate rounded to the dtype, then the product, as torch's ops
  round them), the sum rounded once (as ``addmm`` does).

The source is plain Metal with no torch headers, compiled once per process by ``torch.mps.compile_shader`` at
patch time: :func:`self_check` compiles it and compares every kernel with the composed reference of
:mod:`mpsboost.ops.moe_ref` on shapes that run its branches, and the moe_block recipe takes the fused path on a
Mac only if that passes and a timing on that Mac shows it faster (``moe_block.fusion_choice``). They are
reached only through the registered operators ``mpsboost::moe_route``, ``mpsboost::moe_glu`` and
``mpsboost::moe_combine`` (their MPS kernels), so ``torch.compile`` sees opaque calls. CPU tests compile the same
text as C++ against the emulation of the Metal built-ins in ``tests/ops/metal_emu`` and run it
(``tests/ops/test_moe_metal_emulated.py``).
"""

from __future__ import annotations

import functools
from string import Template
from typing import Optional

import torch

__all__ = [
    "SOURCE",
    "ROUTE_KERNELS",
    "GLU_KERNELS",
    "COMBINE_KERNELS",
    "MAX_PAIRS",
    "MAX_EXPERTS",
    "MAX_TOP_K",
    "route_supported",
    "glu_supported",
    "combine_supported",
    "route",
    "glu",
    "combine",
    "self_check",
]

MAX_PAIRS = 64  # routed (token, expert) pairs one launch takes: every lane keeps each pair's expert
MAX_EXPERTS = 1024  # 32 logits a lane (one bit each in its taken mask)
MAX_TOP_K = 16
ROUTE_COLS = 256  # columns of the rows one simdgroup of the route kernel copies
THREADS = 256  # threads per threadgroup of the elementwise kernels (8 simdgroups)

_PRELUDE = f"""#include <metal_stdlib>
using namespace metal;

#define MPSB_MAX_PAIRS {MAX_PAIRS}
#define MPSB_MAX_K {MAX_TOP_K}
#define MPSB_COLS {ROUTE_COLS}
#define MPSB_THREADS {THREADS}

// float -> the nearest bfloat16 (ties to even), as a float (finite inputs).
inline float mpsb_bf16(float v) {{
  uint u = as_type<uint>(v);
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  return as_type<float>(u);
}}

inline float mpsb_ld(float v) {{ return v; }}
inline float mpsb_ld(half v) {{ return float(v); }}
inline float mpsb_ld(ushort v) {{ return as_type<float>(uint(v) << 16); }}  // bfloat16 as its 16 bits
inline void mpsb_st(device float* p, float v) {{ *p = v; }}
inline void mpsb_st(device half* p, float v) {{ *p = half(v); }}
inline void mpsb_st(device ushort* p, float v) {{ *p = ushort(as_type<uint>(mpsb_bf16(v)) >> 16); }}
// v rounded to the storage type of p's pointee (float32: as it is), as a float
inline float mpsb_rnd(device const float*, float v) {{ return v; }}
inline float mpsb_rnd(device const half*, float v) {{ return float(half(v)); }}
inline float mpsb_rnd(device const ushort*, float v) {{ return mpsb_bf16(v); }}

template <typename XT>
inline void mpsb_moe_route(
    device const XT* logits, device const XT* x, device uchar* wout, device long* ids, device int* pos,
    device int* offs, device XT* rows, long N, long E, long K, long H, long ls, long xs, long norm, long wt,
    long want_rows, uint2 tg, uint sg, uint lane) {{
  const long S = N * K;
  const long per = (E + 31) / 32;  // logits a lane holds
  const bool first = tg.x == 0 && sg == 0;
  uint pe[MPSB_MAX_PAIRS];  // the expert of every pair, in every lane
  for (long t = 0; t < N; ++t) {{
    device const XT* lr = logits + t * ls;
    float v[32];
    uint taken = 0u;
    float lmax = -INFINITY;
    for (long i = 0; i < per; ++i) {{
      const long e = long(lane) + 32 * i;
      v[i] = e < E ? mpsb_ld(lr[e]) : -INFINITY;
      lmax = v[i] > lmax ? v[i] : lmax;
    }}
    float top = 0.0f, den = 1.0f;  // softmax over all E (norm == 0): its max and its sum
    if (norm == 0) {{
      top = simd_max(lmax);
      float z = 0.0f;
      for (long i = 0; i < per; ++i) {{
        if (long(lane) + 32 * i < E) {{
          z += exp(v[i] - top);
        }}
      }}
      den = simd_sum(z);
    }}
    float mv[MPSB_MAX_K];
    uint me[MPSB_MAX_K];
    for (long j = 0; j < K; ++j) {{
      float bv = -INFINITY;
      long bi = -1;
      for (long i = 0; i < per; ++i) {{
        const long e = long(lane) + 32 * i;
        if (e < E && ((taken >> i) & 1u) == 0u && (bi < 0 || v[i] > bv)) {{
          bv = v[i];
          bi = e;
        }}
      }}
      const float m = simd_max(bi < 0 ? -INFINITY : bv);
      // among the lanes holding the largest remaining logit, the lowest expert id (ids < 2^24: exact as floats)
      const float c = simd_max((bi >= 0 && bv == m) ? -float(bi) : -INFINITY);
      long sel = long(-c);
      sel = sel >= 0 && sel < E ? sel : 0;  // a NaN logit compares with nothing: stay in bounds
      if (sel % 32 == long(lane)) {{
        taken |= 1u << uint(sel / 32);
      }}
      mv[j] = m;
      me[j] = uint(sel);
      pe[t * K + j] = uint(sel);
    }}
    if (first && long(lane) < K) {{
      const long j = long(lane);
      float w;
      if (norm != 0) {{
        float s = 0.0f;
        for (long i = 0; i < K; ++i) {{
          s += exp(mv[i] - mv[0]);
        }}
        w = exp(mv[j] - mv[0]) / s;
      }} else {{
        w = exp(mv[j] - top) / den;
      }}
      if (wt == 0) {{
        ((device float*)wout)[t * K + j] = w;
      }} else {{
        mpsb_st(((device XT*)wout) + t * K + j, w);
      }}
      ids[t * K + j] = long(me[j]);
    }}
  }}
  // pair p's position in expert order: the pairs of a lower expert, and those of its own expert before it
  const long c0 = long(tg.x) * MPSB_COLS;
  const long c1 = c0 + MPSB_COLS < H ? c0 + MPSB_COLS : H;
  for (long p = 0; p < S; ++p) {{
    const uint e = pe[p];
    float cnt = 0.0f;
    for (long q = long(lane); q < S; q += 32) {{
      cnt += (pe[q] < e || (pe[q] == e && q < p)) ? 1.0f : 0.0f;
    }}
    const long at = long(simd_sum(cnt));
    if (first && lane == 0) {{
      pos[p] = int(at);
    }}
    if (want_rows != 0) {{
      device const XT* src = x + (p / K) * xs;
      device XT* dst = rows + at * H;
      for (long c = c0 + long(lane); c < c1; c += 32) {{
        dst[c] = src[c];
      }}
    }}
  }}
  if (first) {{
    for (long e = long(lane); e < E; e += 32) {{
      int cnt = 0;
      for (long q = 0; q < S; ++q) {{
        cnt += pe[q] <= uint(e) ? 1 : 0;
      }}
      offs[e] = cnt;
    }}
  }}
}}

template <typename XT>
inline void mpsb_moe_glu(
    device const XT* a, device const XT* b, device XT* y, long R, long I, long as, long bs, uint2 tg, uint sg,
    uint lane) {{
  const long i = long(tg.x) * MPSB_THREADS + long(sg) * 32 + long(lane);
  const long r = long(tg.y);
  if (i < I && r < R) {{
    const float g = mpsb_ld(a[r * as + i]);
    const float s = mpsb_rnd(a, g / (1.0f + exp(-g)));
    mpsb_st(y + r * I + i, s * mpsb_ld(b[r * bs + i]));
  }}
}}

template <typename XT>
inline void mpsb_moe_combine(
    device const XT* pair, device const uchar* w, device const int* pos, device const XT* sh, device const XT* g,
    device XT* y, long N, long K, long H, long wt, long has_pos, long has_shared, long ss, uint2 tg, uint sg,
    uint lane) {{
  const long h = long(tg.x) * MPSB_THREADS + long(sg) * 32 + long(lane);
  const long t = long(tg.y);
  if (h < H && t < N) {{
    float acc = 0.0f;
    for (long j = 0; j < K; ++j) {{
      const long p = has_pos != 0 ? long(pos[t * K + j]) : t * K + j;
      const float wj = wt == 0 ? ((device const float*)w)[t * K + j] : mpsb_ld(((device const XT*)w)[t * K + j]);
      acc += wj * mpsb_ld(pair[p * H + h]);
    }}
    if (has_shared != 0) {{
      const float gv = mpsb_ld(g[t]);
      const float s = mpsb_rnd(pair, 1.0f / (1.0f + exp(-gv)));
      acc += mpsb_rnd(pair, s * mpsb_ld(sh[t * ss + h]));
    }}
    mpsb_st(y + t * H + h, acc);
  }}
}}
"""

_KERNELS = Template("""
kernel void mpsb_moe_route_${name}(
    device const ${xt}* logits [[buffer(0)]],
    device const ${xt}* x [[buffer(1)]],
    device uchar* wout [[buffer(2)]],
    device long* ids [[buffer(3)]],
    device int* pos [[buffer(4)]],
    device int* offs [[buffer(5)]],
    device ${xt}* rows [[buffer(6)]],
    constant long& N [[buffer(7)]],
    constant long& E [[buffer(8)]],
    constant long& K [[buffer(9)]],
    constant long& H [[buffer(10)]],
    constant long& ls [[buffer(11)]],
    constant long& xs [[buffer(12)]],
    constant long& norm [[buffer(13)]],
    constant long& wt [[buffer(14)]],
    constant long& want_rows [[buffer(15)]],
    uint2 tg [[threadgroup_position_in_grid]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  mpsb_moe_route<${xt}>(logits, x, wout, ids, pos, offs, rows, N, E, K, H, ls, xs, norm, wt, want_rows, tg, sg,
                        lane);
}

kernel void mpsb_moe_glu_${name}(
    device const ${xt}* a [[buffer(0)]],
    device const ${xt}* b [[buffer(1)]],
    device ${xt}* y [[buffer(2)]],
    constant long& R [[buffer(3)]],
    constant long& I [[buffer(4)]],
    constant long& as [[buffer(5)]],
    constant long& bs [[buffer(6)]],
    uint2 tg [[threadgroup_position_in_grid]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  mpsb_moe_glu<${xt}>(a, b, y, R, I, as, bs, tg, sg, lane);
}

kernel void mpsb_moe_combine_${name}(
    device const ${xt}* pair [[buffer(0)]],
    device const uchar* w [[buffer(1)]],
    device const int* pos [[buffer(2)]],
    device const ${xt}* sh [[buffer(3)]],
    device const ${xt}* g [[buffer(4)]],
    device ${xt}* y [[buffer(5)]],
    constant long& N [[buffer(6)]],
    constant long& K [[buffer(7)]],
    constant long& H [[buffer(8)]],
    constant long& wt [[buffer(9)]],
    constant long& has_pos [[buffer(10)]],
    constant long& has_shared [[buffer(11)]],
    constant long& ss [[buffer(12)]],
    uint2 tg [[threadgroup_position_in_grid]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  mpsb_moe_combine<${xt}>(pair, w, pos, sh, g, y, N, K, H, wt, has_pos, has_shared, ss, tg, sg, lane);
}
""")

# activation dtype -> (kernel suffix, Metal type); bfloat16 as its 16 bits (no bfloat before Metal 3.1)
_TYPES = {torch.float32: ("float", "float"), torch.float16: ("half", "half"), torch.bfloat16: ("bfloat16", "ushort")}

SOURCE = _PRELUDE + "".join(_KERNELS.substitute(name=name, xt=xt) for name, xt in _TYPES.values())
ROUTE_KERNELS = {dt: f"mpsb_moe_route_{spec[0]}" for dt, spec in _TYPES.items()}
GLU_KERNELS = {dt: f"mpsb_moe_glu_{spec[0]}" for dt, spec in _TYPES.items()}
COMBINE_KERNELS = {dt: f"mpsb_moe_combine_{spec[0]}" for dt, spec in _TYPES.items()}


def _rows_ok(t: torch.Tensor) -> bool:
    """2-D with unit column stride (rows of any stride)."""
    return t.dim() == 2 and (t.shape[1] <= 1 or t.stride(1) == 1)


def route_supported(logits: torch.Tensor, x: torch.Tensor, top_k: int, weights_dtype: torch.dtype) -> Optional[str]:
    """Why the route kernel cannot take these tensors (static facts), or None."""
    if logits.dtype not in _TYPES or x.dtype != logits.dtype:
        return f"logits in {logits.dtype}, rows in {x.dtype}: the kernel takes one of float32, float16, bfloat16"
    if weights_dtype not in (torch.float32, logits.dtype):
        return f"weights in {weights_dtype}: the kernel writes float32 or the logits' dtype"
    if not _rows_ok(logits) or not _rows_ok(x) or x.shape[0] != logits.shape[0]:
        return "logits [N, E] and rows [N, H] must be 2-D with unit column stride"
    n, e = logits.shape
    if not 1 <= top_k <= min(e, MAX_TOP_K) or e > MAX_EXPERTS or n * top_k > MAX_PAIRS:
        return (
            f"N={n}, E={e}, top_k={top_k}: the kernel takes 1 <= top_k <= min(E, {MAX_TOP_K}), E <= {MAX_EXPERTS} and "
            f"N * top_k <= {MAX_PAIRS}"
        )
    return None


def _pairs_ok(pair: torch.Tensor, weights: torch.Tensor, pos: Optional[torch.Tensor]) -> Optional[str]:
    if pair.dtype not in _TYPES or not pair.is_contiguous() or pair.dim() != 2:
        return f"routed outputs {pair.dtype} {tuple(pair.shape)}: expected a contiguous [N * k, H] float tensor"
    if weights.dtype not in (torch.float32, pair.dtype) or not weights.is_contiguous() or weights.dim() != 2:
        return f"weights {weights.dtype} {tuple(weights.shape)}: expected contiguous [N, k], float32 or the outputs'"
    if pos is not None and (pos.dtype != torch.int32 or not pos.is_contiguous()):
        return f"positions {pos.dtype}: expected contiguous int32 [N, k]"
    return None


def glu_supported(a: torch.Tensor, b: torch.Tensor) -> Optional[str]:
    if a.dtype not in _TYPES or b.dtype != a.dtype:
        return f"inputs in {a.dtype} and {b.dtype}: the kernel takes one of float32, float16, bfloat16"
    if not _rows_ok(a) or not _rows_ok(b) or a.shape != b.shape:
        return "gate and up must be [R, I] with unit column stride"
    return None


def combine_supported(
    pair: torch.Tensor,
    weights: torch.Tensor,
    pos: Optional[torch.Tensor],
    shared: Optional[torch.Tensor],
    gate: Optional[torch.Tensor],
) -> Optional[str]:
    why = _pairs_ok(pair, weights, pos)
    if why is not None:
        return why
    if shared is not None:
        if gate is None or shared.dtype != pair.dtype or gate.dtype != pair.dtype or not _rows_ok(shared):
            return "the shared expert's output and gate must be in the outputs' dtype, [N, H] with unit column stride"
        if not gate.is_contiguous() or gate.numel() != weights.shape[0]:
            return "the shared expert's gate must be contiguous [N, 1]"
    return None


@functools.lru_cache(maxsize=None)
def _library():
    """The compiled library (once per process; the first call is at patch time, from the self-check)."""
    return torch.mps.compile_shader(SOURCE)


def _buffer(t: torch.Tensor) -> torch.Tensor:
    """A strided input as a contiguous 1-D view from its first element to its last reachable one (the same memory;
    the kernel addresses rows by the strides it is given)."""
    if t.is_contiguous():
        return t
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.as_strided((extent,), (1,), t.storage_offset())


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)


def route(
    logits: torch.Tensor, x: torch.Tensor, *, top_k: int, norm: bool, weights_dtype: torch.dtype, want_rows: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the route kernel (the caller checked :func:`route_supported`): ``(weights [N, k], ids [N, k] int64,
    pos [N, k] int32, offs [E] int32, rows [N * k, H] or [0, H])``."""
    n, e = logits.shape
    h = x.shape[1]
    dev = logits.device
    weights = torch.empty((n, top_k), dtype=weights_dtype, device=dev)
    ids = torch.empty((n, top_k), dtype=torch.int64, device=dev)
    pos = torch.empty((n, top_k), dtype=torch.int32, device=dev)
    offs = torch.empty((e,), dtype=torch.int32, device=dev)
    rows = torch.empty((n * top_k if want_rows else 0, h), dtype=x.dtype, device=dev)
    if n == 0:
        return weights, ids, pos, offs.zero_(), rows
    fn = getattr(_library(), ROUTE_KERNELS[logits.dtype])
    groups = max(1, -(-h // ROUTE_COLS)) if want_rows else 1
    fn(
        _buffer(logits),
        _buffer(x),
        _bytes(weights),
        ids,
        pos,
        offs,
        rows if want_rows else x.new_empty((1,)),
        n,
        e,
        top_k,
        h,
        logits.stride(0) if n > 1 else e,
        x.stride(0) if n > 1 else h,
        int(bool(norm)),
        0 if weights_dtype == torch.float32 else 1,
        int(bool(want_rows)),
        threads=(groups * 32, 1),
        group_size=(32, 1),
    )
    return weights, ids, pos, offs, rows


def glu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Launch the gated activation (the caller checked :func:`glu_supported`): ``silu(a) * b`` as ``[R, I]``."""
    r, i = a.shape
    y = torch.empty((r, i), dtype=a.dtype, device=a.device)
    if r == 0 or i == 0:
        return y
    fn = getattr(_library(), GLU_KERNELS[a.dtype])
    gx = -(-i // THREADS)
    fn(
        _buffer(a),
        _buffer(b),
        y,
        r,
        i,
        a.stride(0) if r > 1 else i,
        b.stride(0) if r > 1 else i,
        threads=(gx * THREADS, r),
        group_size=(THREADS, 1),
    )
    return y


def combine(
    pair: torch.Tensor,
    weights: torch.Tensor,
    pos: Optional[torch.Tensor],
    shared: Optional[torch.Tensor],
    gate: Optional[torch.Tensor],
    shape: list[int],
) -> torch.Tensor:
    """Launch the weighted combine (the caller checked :func:`combine_supported`): ``shape`` (``[N, H]`` elements)."""
    n, k = weights.shape
    h = pair.shape[1]
    y = torch.empty(shape, dtype=pair.dtype, device=pair.device)
    if n == 0 or h == 0:
        return y
    fn = getattr(_library(), COMBINE_KERNELS[pair.dtype])
    gx = -(-h // THREADS)
    has_shared = shared is not None
    fn(
        pair,
        _bytes(weights),
        pos if pos is not None else weights,  # unused without positions
        _buffer(shared) if has_shared else pair,  # unused without a shared expert
        gate if has_shared else pair,
        y,
        n,
        k,
        h,
        0 if weights.dtype == torch.float32 else 1,
        int(pos is not None),
        int(has_shared),
        (shared.stride(0) if n > 1 else h) if has_shared else h,
        threads=(gx * THREADS, n),
        group_size=(THREADS, 1),
    )
    return y


# the kernels against the composed reference, relative to the largest magnitude: float32 sums in another order and
# Metal's exp (a few ulp), then the output's rounding to the dtype
_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-6))


def self_check(device: str = "mps") -> Optional[str]:
    """Compile the source on ``device`` and compare every kernel with the composed reference of
    :mod:`mpsboost.ops.moe_ref` in each dtype: the route kernel for 1 and 3 tokens, top-k 1, 2 and 8, E 8, 60 and
    256, renormalised and not, weights in float32 and the dtype, with the rows and without (ids and offsets exactly,
    positions as a permutation that sorts the ids, weights and rows within the tolerance); tied logits (the tie
    order: larger first, then lower id); the gated activation on the halves of a fused row and on two tensors; the
    combine with positions and without, with a shared expert and without. 3 x 9 launches, each read back once.
    Returns None, or what failed. Patch time only."""
    from . import moe_ref as ref

    try:
        _library()
    except Exception as exc:  # noqa: BLE001 - a compiler error of any kind is the answer
        return f"torch.mps.compile_shader failed: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
    g = torch.Generator().manual_seed(0)
    cases = ((1, 8, 2, True, True), (3, 60, 1, False, True), (1, 256, 8, True, False), (3, 256, 8, False, True))
    for dt in _TYPES:
        tol = _TOL[dt]
        for n, e, k, norm, rows in cases:
            logits = torch.randn(n, e, generator=g).to(dt)
            x = torch.randn(n, 40, generator=g).to(dt)
            wdt = dt if norm else torch.float32
            want = ref.route_reference(logits, x, k, norm, wdt, rows)
            try:
                got = [
                    t.cpu()
                    for t in route(
                        logits.to(device), x.to(device), top_k=k, norm=norm, weights_dtype=wdt, want_rows=rows
                    )
                ]
            except Exception as exc:  # noqa: BLE001 - a launch error of any kind is the answer
                return f"launching the MoE route kernel failed ({dt}, N={n}, E={e}, k={k}): {exc}"
            why = ref.route_mismatch(got, want, logits, tol)
            if why is not None:
                return f"the MoE route kernel {why} ({dt}, N={n}, E={e}, k={k}, norm={norm})"
        tied = torch.zeros(2, 64, dtype=dt)
        tied[0, [5, 9, 40]] = 1.0
        try:
            got = route(
                tied.to(device), tied.to(device), top_k=4, norm=True, weights_dtype=torch.float32, want_rows=False
            )[1].cpu()
        except Exception as exc:  # noqa: BLE001
            return f"launching the MoE route kernel failed ({dt}, tied logits): {exc}"
        if got.tolist() != [[5, 9, 40, 0], [0, 1, 2, 3]]:
            return f"the MoE route kernel breaks ties out of order ({dt}): {got.tolist()}"
        h = torch.randn(5, 2 * 24, generator=g).to(dt)
        a, b = torch.randn(2, 24, generator=g).to(dt), torch.randn(2, 24, generator=g).to(dt)
        for args in ((h[:, :24], h[:, 24:]), (a, b)):
            try:
                got = glu(*(t.to(device) for t in args)).cpu()
            except Exception as exc:  # noqa: BLE001
                return f"launching the MoE gated activation failed ({dt}): {exc}"
            if _rel(got, ref.glu_reference(*args)) > tol:
                return f"the MoE gated activation differs from silu(a) * b ({dt})"
        for with_pos, with_shared, wdt in ((True, True, dt), (False, False, torch.float32), (True, False, dt)):
            n, k, hd = 3, 4, 40
            pair = torch.randn(n * k, hd, generator=g).to(dt)
            w = torch.rand(n, k, generator=g).to(wdt)
            pos = torch.randperm(n * k, generator=g).to(torch.int32).view(n, k) if with_pos else None
            sh = torch.randn(n, hd, generator=g).to(dt) if with_shared else None
            gt = torch.randn(n, 1, generator=g).to(dt) if with_shared else None
            want = ref.combine_reference(pair, w, pos, sh, gt, [n, hd])
            dev = [None if t is None else t.to(device) for t in (pair, w, pos, sh, gt)]
            try:
                got = combine(*dev, [n, hd]).cpu()
            except Exception as exc:  # noqa: BLE001
                return f"launching the MoE combine failed ({dt}): {exc}"
            if _rel(got, want) > tol:
                return f"the MoE combine differs from the weighted sum (+ gated shared expert) ({dt})"
    return None
