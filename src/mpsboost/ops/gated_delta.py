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
    "conv_step",
    "gated_rms_norm",
    "gates",
    "qk_normalize",
    "recurrent_step",
    "unit_lower_inverse",
    "unit_lower_solve",
]


def conv_step(
    conv_state: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """One token of a depthwise causal conv with its rolling state, updated in place.

    ``conv_state`` ``[B, C, W]`` (the cache's own tensor, oldest column first), ``x`` ``[B, C, 1]`` the new
    column, ``weight`` ``[C, W]``. Returns the pre-activation output ``[B, C]``. The roll is a copy of the
    shifted window (no ``conv1d`` and no slice of its padded output); the conv a multiply-sum.
    """
    window = torch.cat((conv_state[..., 1:], x), dim=-1)
    conv_state.copy_(window)
    out = (window * weight).sum(-1)
    return out if bias is None else out + bias


def qk_normalize(qk: torch.Tensor, eps_rep: torch.Tensor) -> torch.Tensor:
    """L2-normalise query and key rows in float32 and repeat them for grouped value heads, in one product.

    ``qk`` ``[B, Hk, 1, 2, d]`` (row 0 query, row 1 key; any float dtype), ``eps_rep`` float32 ``[r, 1, 1]``
    filled with the norm's epsilon (its leading dim repeats each key head for ``r`` value heads). Returns
    float32 ``[B, Hk, r, 2, d]``: ``x * rsqrt(sum(x^2) + eps)`` as transformers' ``l2norm`` computes it. The
    query's ``d ** -0.5`` scale is left out: the output norm absorbs it (see :func:`gated_rms_norm`).
    """
    n = torch.linalg.vector_norm(qk, dim=-1, keepdim=True, dtype=torch.float32)
    return qk * torch.rsqrt(torch.addcmul(eps_rep, n, n))


def gates(
    ba: torch.Tensor, z_bias: torch.Tensor, z_sign: torch.Tensor, e_add: torch.Tensor, e_mult: torch.Tensor
) -> torch.Tensor:
    """``beta`` and the decay ``exp(g)`` of every value head in four elementwise ops, in float32.

    ``ba`` ``[..., 2]``: the raw ``b`` and ``a`` projections side by side. With ``x = a + dt_bias``:
    ``logsigmoid([b, -x])`` is ``[log sigmoid(b), -softplus(x)]``; times ``[1, exp(A_log)]`` plus
    ``[log c, 0]`` and exponentiated, it is ``[c * sigmoid(b), exp(-exp(A_log) * softplus(x))]``: the
    reference's ``beta`` (``c`` = 2 where a model allows negative eigenvalues, else 1) and ``exp(g)``.
    ``z_bias`` = ``[0, -dt_bias]``, ``z_sign`` = ``[1, -1]``, ``e_add`` = ``[log c, 0]``,
    ``e_mult`` = ``[1, exp(A_log)]``, float32, broadcast against ``ba``.
    """
    log_s = torch.nn.functional.logsigmoid(torch.addcmul(z_bias, ba, z_sign))
    return torch.exp(torch.addcmul(e_add, log_s, e_mult))


def recurrent_step(
    state: torch.Tensor, kq: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, decay: torch.Tensor
) -> torch.Tensor:
    """One token of the gated delta rule; ``state`` (float32 ``[B, H, dk, dv]``, contiguous: the cache's
    own tensor) is updated in place.

    ``kq`` float32 ``[B, H, 2, dk]``, contiguous with storage offset 0 (a fresh result; row 0 the query, row 1
    the key, both normalised). ``v``,
    ``beta`` and ``decay`` are ``[B, H, 1, dv]``, ``[B, H, 1, 1]``, or, for one sequence (B = 1), ``[H, 1, dv]``
    and ``[H, 1, 1]`` (the batch merged with the heads: two views fewer). Returns ``o = S_t^T q`` as
    ``[B * H, 1, dv]`` float32. Two reads of the state by ``bmm``, the decay and the rank-one delta update
    in place: no per-head Python loop, no copy of the state.
    """
    b, h, dk, dv = state.shape
    s3 = state.view(b * h, dk, dv)
    k_row = kq.as_strided((b * h, 1, dk), (2 * dk, dk, 1), dk)
    u = torch.bmm(k_row, s3)  # S^T k of the old state: [B*H, 1, dv]
    if v.dim() == 4:
        u = u.view(b, h, 1, dv)
        k_col = kq.as_strided((b, h, dk, 1), (h * 2 * dk, 2 * dk, 1, 1), dk)
    else:
        k_col = kq.as_strided((h, dk, 1), (2 * dk, 1, 1), dk)
    delta = torch.addcmul(v, u, decay, value=-1.0) * beta  # beta (v - a S^T k)
    state.mul_(decay)
    state.addcmul_(k_col, delta)
    q_row = kq.as_strided((b * h, 1, dk), (2 * dk, dk, 1), 0)
    return torch.bmm(q_row, s3)


def gated_rms_norm(
    o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: torch.Tensor, dim: int
) -> torch.Tensor:
    """``weight * o * rsqrt(mean(o^2) + eps) * silu(gate)`` over the last dim (size ``dim``), float32.

    ``eps`` is a float32 tensor broadcastable to ``o[..., :1]``. The mean of squares comes from one
    ``vector_norm`` (``mean = n^2 / dim``) folded with the epsilon into one ``addcmul``. For ``o = s * o'``
    (a scale the caller left out) pass ``eps / s^2``: ``s o' rsqrt(s^2 m' + eps) = o' rsqrt(m' + eps / s^2)``.
    """
    n = torch.linalg.vector_norm(o, dim=-1, keepdim=True)
    r = torch.rsqrt(torch.addcmul(eps, n, n, value=1.0 / dim))
    return (o * r) * (weight * torch.nn.functional.silu(gate.to(torch.float32)))


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

    if initial_state is None:
        state = torch.zeros(b, hv, dk, dv, dtype=acc, device=value.device)
    else:
        state = initial_state.to(acc)
    out = torch.zeros_like(new_values)
    query = query * cum.exp().unsqueeze(-1)
    key = key * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    for i in range(n_chunks):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        out[:, :, i] = query[:, :, i] @ state + intra[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + key[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(b, hv, -1, dv)[:, :, :seq]
    out = out.transpose(1, 2).to(initial_dtype, memory_format=torch.contiguous_format)
    return out, (state if output_final_state else None)
