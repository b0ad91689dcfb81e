"""Gated delta rule (Gated DeltaNet linear attention): a one-token recurrent step in few ops, and a chunked
prefill whose unit lower-triangular solves are matmuls.

Tensor functions only (no modules, no transformers import). The math is transformers'
``torch_recurrent_gated_delta_rule`` / ``torch_chunk_gated_delta_rule`` (``models/qwen3_5_moe``), the
reference every Mac runs because flash-linear-attention is CUDA/Triton-only:

    S_t = a_t S_{t-1} + k_t beta_t (v_t - a_t S_{t-1}^T k_t)^T,   o_t = S_t^T q_t,   a_t = exp(g_t)

with ``k``, ``q`` L2-normalised, ``q`` scaled by ``d_k ** -0.5``, and the state ``S`` (per value head,
``[d_k, d_v]``) kept in float32.
"""

from __future__ import annotations

import torch

__all__ = [
    "chunk_gated_delta_rule",
    "conv_roll",
    "delta_rule_step",
    "gated_rms_norm",
    "gates",
    "l2_normalize",
    "unit_lower_inverse",
    "unit_lower_solve",
]

# Every decode function below takes optional ``out=`` tensors (and views of them): a caller that runs the
# step eagerly many times keeps those buffers and their views, so that a step dispatches its arithmetic and
# nothing else (no allocation, no view op). Without them each function allocates, as plain torch code does.


def conv_roll(
    conv_state: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    window: torch.Tensor | None = None,
    tail: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    acc: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token of a depthwise causal conv with its rolling state (updated in place), then ``silu``.

    ``conv_state`` ``[B, C, W]`` (the cache's own tensor, oldest column first), ``x`` ``[B, C, 1]`` the new
    column, ``weight`` ``[C, W]`` (a view of the conv's own weight, any float dtype: nothing derived from it,
    so an in-place edit of the weight is seen at once), ``bias`` ``[C]`` or None (the conv's own). ``window``
    (``[B, C, W + 1]``, the state's dtype) and ``tail`` (its view ``[..., 1:]``) and ``out`` (float32
    ``[B, C]``) are optional buffers; ``acc`` a float32 tensor of one element holding 0 (made here where not
    given). Returns float32 ``silu(conv)`` ``[B, C]``: the window is the state and the new column side by
    side (one ``cat``), the new state its last ``W`` columns (one copy), the conv a multiply-sum over those
    columns. The products are float32 in any model dtype: ``acc + tail * weight`` (one ``addcmul``) promotes
    to float32 where the state or weight is narrower (no cast op); float32 models multiply directly.
    """
    window = torch.cat((conv_state, x), dim=-1, out=window)
    tail = tail if tail is not None else window[..., 1:]
    conv_state.copy_(tail)
    if tail.dtype == torch.float32 and weight.dtype == torch.float32:
        prod = tail * weight
    else:
        if acc is None:
            acc = torch.zeros(1, dtype=torch.float32, device=tail.device)
        prod = torch.addcmul(acc, tail, weight)
    y = torch.sum(prod, dim=-1, out=out)
    if bias is not None:
        y.add_(bias)
    return torch.nn.functional.silu(y, inplace=True)


def l2_normalize(x: torch.Tensor, eps_root: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim in float32 (transformers' ``l2norm``: ``x * rsqrt(...)``),
    broadcast against ``eps_root`` = ``sqrt(eps)`` (float32; its shape may repeat rows, e.g. each key head
    for the value heads it serves). Three ops: ``vector_norm``, ``hypot``, ``div``. With ``out`` the result is
    written there (its layout is the caller's: a strided input never decides it).
    """
    n = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)
    return torch.div(x, torch.hypot(n, eps_root), out=out)


def gates(
    ba: torch.Tensor,
    z_bias: torch.Tensor,
    z_sign: torch.Tensor,
    e_add: torch.Tensor,
    e_mult: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``beta`` and the decay ``exp(g)`` of every value head in four elementwise ops, in float32.

    ``ba`` ``[..., 2]``: the raw ``b`` and ``a`` projections side by side. With ``x = a + dt_bias``:
    ``logsigmoid([b, -x])`` is ``[log sigmoid(b), -softplus(x)]``; times ``[1, exp(A_log)]`` plus
    ``[log c, 0]`` and exponentiated, it is ``[c * sigmoid(b), exp(-exp(A_log) * softplus(x))]``: the
    reference's ``beta`` (``c`` = 2 where a model allows negative eigenvalues, else 1) and ``exp(g)``.
    ``z_bias`` = ``[0, -dt_bias]``, ``z_sign`` = ``[1, -1]``, ``e_add`` = ``[log c, 0]``,
    ``e_mult`` = ``[1, exp(A_log)]``, float32, broadcast against ``ba``. The log domain keeps the decay exact
    for any ``x`` (``sigmoid(-x) ** A`` would underflow to 0 beyond ``x`` of about 88).
    """
    log_s = torch.nn.functional.logsigmoid(torch.addcmul(z_bias, ba, z_sign))
    return torch.exp(torch.addcmul(e_add, log_s, e_mult), out=out)


def delta_rule_step(
    state: torch.Tensor,
    state3: torch.Tensor,
    k_row: torch.Tensor,
    k_col: torch.Tensor,
    q_row: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    decay: torch.Tensor,
    *,
    u: torch.Tensor | None = None,
    u4: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token of the gated delta rule, in the reference's order; ``state`` (float32 ``[B, H, dk, dv]``,
    the cache's own tensor) is updated in place and ``state3`` is its view ``[B * H, dk, dv]``:

        S = exp(g) S;   d = beta (v - S^T k);   S += k d^T;   o = S^T q

    ``k_row``/``q_row`` ``[B * H, 1, dk]``, ``k_col`` ``[B, H, dk, 1]`` (the normalised key and query, float32),
    ``decay`` ``[B, H, 1, 1]``. ``v`` and ``beta``: ``[B * H, 1, dv]`` and ``[B * H, 1, 1]`` where the batch
    and head dims of ``v`` merge (one sequence: ``d`` is one ``baddbmm``), otherwise ``[B, H, 1, dv]`` and
    ``[B, H, 1, 1]`` (``S^T k`` by ``bmm`` into ``u`` ``[B * H, 1, dv]``, ``u4`` its 4-D view, then a
    subtraction). Returns ``o`` ``[B * H, 1, dv]`` float32 (into ``out`` if given): two reads of the state by
    ``bmm``, the decay and the rank-one update in place; no per-head loop, no copy of the state.
    """
    state.mul_(decay)
    if v.dim() == 3:
        d = torch.baddbmm(v, k_row, state3, alpha=-1.0)
    else:
        u = torch.bmm(k_row, state3, out=u)
        d = torch.sub(v, u4 if u4 is not None else u.view(v.shape))
    d.mul_(beta)
    state.addcmul_(k_col, d)
    return torch.bmm(q_row, state3, out=out)


def gated_rms_norm(
    o: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    eps_root: torch.Tensor,
    *,
    weight_scale: float = 1.0,
    zero: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``w * o * rsqrt(mean(o^2) + eps) * silu(gate)`` over the last dim (size ``n``), in float32.

    Pass ``weight_scale`` = ``sqrt(n)`` and ``eps_root`` = ``sqrt(n * eps)`` (float32): ``rsqrt(|o|^2 / n + eps)``
    is ``sqrt(n) / hypot(|o|, sqrt(n * eps))``, so the norm is ``vector_norm``, ``hypot`` and ``div``, and the
    gate's product ``weight_scale * silu(gate) * w`` one ``addcmul`` on ``zero`` (a float32 0, made here where
    not given): ``weight`` is the module's own (any float dtype, widened by the product), nothing derived
    from it. With ``weight_scale`` 1 the product is a plain multiply. For ``o = s * o'`` (a scale the caller
    left out) pass ``eps / s^2`` for ``eps``. ``gate`` of another dtype is widened first (``silu`` in float32,
    as the reference computes it). ``out`` may have another float dtype (the model's): the last multiply
    rounds into it.
    """
    n = torch.linalg.vector_norm(o, dim=-1, keepdim=True)
    g = torch.nn.functional.silu(gate if gate.dtype == torch.float32 else gate.float())
    if weight_scale == 1.0:
        gw = g * weight
    else:
        if zero is None:
            zero = torch.zeros((), dtype=torch.float32, device=g.device)
        gw = torch.addcmul(zero, g, weight, value=weight_scale)
    return torch.mul(o / torch.hypot(n, eps_root), gw, out=out)


def unit_lower_inverse(a: torch.Tensor) -> torch.Tensor:
    """``(I + tril(a, -1))^-1`` by block doubling, matmuls only (``a`` ``[..., n, n]``; its diagonal and upper
    part are ignored).

    ``[[A, 0], [C, D]]^-1 = [[A^-1, 0], [-D^-1 C A^-1, D^-1]]``: starting from the 1x1 diagonal blocks (all
    ones), every level joins pairs of diagonal blocks, all pairs of all matrices in one batched product:
    ``log2 n`` levels (6 for 64-token chunks). This is the recursive triangular inversion LAPACK uses, as
    accurate as substitution; a product of powers of the nilpotent part (``prod (I + M^(2^i))``) is as
    short but measured 300x less accurate on an OLMo-Hybrid layer (beta up to 2: 7.5e-5 against 2.3e-7).
    """
    n = a.shape[-1]
    size = 1 << max(0, (n - 1).bit_length())
    lower = torch.tril(a, diagonal=-1)
    if size != n:  # pad to a power of two with an identity block: the top-left block of the inverse is the answer
        lower = torch.nn.functional.pad(lower, (0, size - n, 0, size - n))
    batch = lower.shape[:-2]
    inv = torch.eye(size, dtype=a.dtype, device=a.device).expand(*batch, size, size).clone()
    s = 1
    while s < size:
        m = size // (2 * s)
        low = torch.diagonal(lower.reshape(*batch, m, 2, s, m, 2, s), dim1=-6, dim2=-3)  # [..., 2, s, 2, s, m]
        blk = torch.diagonal(inv.view(*batch, m, 2, s, m, 2, s), dim1=-6, dim2=-3)
        c = low[..., 1, :, 0, :, :].movedim(-1, -3)
        a_inv = blk[..., 0, :, 0, :, :].movedim(-1, -3)
        d_inv = blk[..., 1, :, 1, :, :].movedim(-1, -3)
        blk[..., 1, :, 0, :, :].copy_((-(d_inv @ c) @ a_inv).movedim(-3, -1))
        s *= 2
    return inv if size == n else inv[..., :n, :n]


def unit_lower_solve(a: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """``X`` with ``(I + tril(a, -1)) X = rhs``: what ``torch.linalg.solve_triangular(a, rhs, upper=False,
    unitriangular=True)`` returns, by matmuls only (:func:`unit_lower_inverse`, then one product). On MPS
    ``solve_triangular`` costs about 15 ms per call whatever its size (kshetrajna12/reflex#1); these
    batched matmuls do not.
    """
    return unit_lower_inverse(a) @ rhs


def chunk_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    solve: str = "matmul",
    chunk_size: int = 64,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' ``torch_chunk_gated_delta_rule`` (q/k L2-normalised inside), with the two unit
    lower-triangular solves per call done by :func:`unit_lower_solve` (``solve="matmul"``) or by
    ``torch.linalg.solve_triangular`` (``solve="triangular"``). Same arguments and layout: ``query``/``key``
    ``[B, S, Hk, dk]``, ``value`` ``[B, S, Hv, dv]``, ``g``/``beta`` ``[B, S, Hv]``; returns ``[B, S, Hv, dv]``
    in the query's dtype and the float32 state ``[B, Hv, dk, dv]`` (or None). Float64 inputs are computed
    in float64 (a reference for the error bounds).
    """
    initial_dtype = query.dtype
    b, seq, hk, dk = key.shape
    hv, dv = value.shape[-2:]
    if hk != hv:
        query = query.repeat_interleave(hv // hk, dim=2)
        key = key.repeat_interleave(hv // hk, dim=2)
    acc = torch.promote_types(query.dtype, torch.float32)  # float32 (float64 stays float64: references)
    query, key, value, beta, g = [
        x.transpose(1, 2).to(acc, memory_format=torch.contiguous_format) for x in (query, key, value, beta, g)
    ]
    query = query * torch.rsqrt((query * query).sum(-1, keepdim=True) + eps)
    key = key * torch.rsqrt((key * key).sum(-1, keepdim=True) + eps)
    query = query * (dk**-0.5)

    pad = (chunk_size - seq % chunk_size) % chunk_size
    f = torch.nn.functional
    query, key, value = (f.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
    beta, g = (f.pad(x, (0, pad)) for x in (beta, g))
    n_chunks = (seq + pad) // chunk_size

    v_beta = value * beta.unsqueeze(-1)
    k_beta = key * beta.unsqueeze(-1)
    query, key, k_beta, v_beta = [
        x.reshape(b, hv, n_chunks, chunk_size, x.shape[-1]) for x in (query, key, k_beta, v_beta)
    ]
    g = g.reshape(b, hv, n_chunks, chunk_size)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=query.device).triu(1)
    cum = g.cumsum(dim=3)
    pair = (cum.unsqueeze(4) - cum.unsqueeze(3)).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ key.transpose(-1, -2)) * pair
    intra = (query @ key.transpose(-1, -2)) * pair
    decayed_k_beta = k_beta * cum.exp().unsqueeze(-1)
    if solve == "matmul":
        # Both right-hand sides in one solve: [.., C, dv + dk].
        both = unit_lower_solve(system, torch.cat((v_beta, decayed_k_beta), dim=-1))
        new_values, k_cumdecay = both[..., :dv], both[..., dv:]
    elif solve == "triangular":
        new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
        k_cumdecay = torch.linalg.solve_triangular(system, decayed_k_beta, upper=False, unitriangular=True)
    else:
        raise ValueError(f"solve must be 'matmul' or 'triangular', got {solve!r}")

    bh = b * hv
    if initial_state is None:
        state = torch.zeros(bh, dk, dv, dtype=acc, device=value.device)
    else:  # a copy: the scan updates it in place
        state = initial_state.to(acc, copy=True).reshape(bh, dk, dv)
    query = query * cum.exp().unsqueeze(-1)
    key = key * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    out = _scan(
        query.flatten(0, 1),
        key.flatten(0, 1).transpose(-1, -2),
        new_values.flatten(0, 1),
        k_cumdecay.flatten(0, 1),
        intra.flatten(0, 1),
        cum[..., -1].exp().reshape(bh, n_chunks).t().reshape(n_chunks, bh, 1, 1),
        state,
    )
    # [n, b * hv, C, dv] -> [b, S, hv, dv]
    out = out.view(n_chunks, b, hv, chunk_size, dv).permute(1, 0, 3, 2, 4).reshape(b, n_chunks * chunk_size, hv, dv)
    out = out[:, :seq].to(initial_dtype, memory_format=torch.contiguous_format)
    return out, (state.view(b, hv, dk, dv) if output_final_state else None)


def _scan(
    query: torch.Tensor,
    key_t: torch.Tensor,
    new_values: torch.Tensor,
    k_cumdecay: torch.Tensor,
    intra: torch.Tensor,
    chunk_decay: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """The sequential scan over chunks of the chunked rule, five batched matmul-or-scale ops per chunk.

    ``query`` ``[BH, n, C, dk]`` (decayed), ``key_t`` ``[BH, n, dk, C]`` (decayed to the chunk's end,
    transposed), ``new_values`` ``[BH, n, C, dv]``, ``k_cumdecay`` ``[BH, n, C, dk]``, ``intra`` ``[BH, n, C, C]``,
    ``chunk_decay`` ``[n, BH, 1, 1]``, ``state`` ``[BH, dk, dv]`` (updated in place). Returns the outputs
    chunk-major, ``[n, BH, C, dv]``. Per chunk (transformers' loop, as ``bmm``/``baddbmm`` on views made once):
    ``v_new = nv - kc @ S``, ``out = q @ S + intra @ v_new``, ``S = S * decay + k^T @ v_new``. transformers'
    loop dispatches 37 aten ops per chunk through 4-D ``@`` and indexing; a 512-token prompt is 8 chunks per
    layer, an 8k-token prompt 128.
    """
    n = query.shape[1]
    out = torch.empty(n, *new_values.shape[:1], *new_values.shape[2:], dtype=new_values.dtype, device=state.device)
    chunks = zip(
        query.unbind(1),
        key_t.unbind(1),
        new_values.unbind(1),
        k_cumdecay.unbind(1),
        intra.unbind(1),
        chunk_decay.unbind(0),
        out.unbind(0),
    )
    for q, kt, nv, kc, a, decay, o in chunks:
        v_new = torch.baddbmm(nv, kc, state, alpha=-1.0)
        torch.bmm(q, state, out=o)
        o.baddbmm_(a, v_new)
        state.mul_(decay).baddbmm_(kt, v_new)
    return out
