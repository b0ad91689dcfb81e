"""The composed Gated DeltaNet decode step (:func:`reference`) and the random inputs the tests and the Metal kernel's
self-check draw (:func:`random_inputs`): a leaf of ``mpsboost.ops`` that both the registered operator
(:mod:`.deltanet_step`) and the kernel (:mod:`.deltanet_metal`) read, so that neither imports the other."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F


def reference(
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
    """The composed step in float32 (the conv's products in float32 in any model dtype, gates in float32, the state
    updated in place in the reference's order): ``conv_state`` and ``state`` updated, ``out`` written."""
    b = y.shape[0]
    hv, dv = a_log.shape[0], norm_w.shape[0]
    r, kd, vd = hv // hk, hk * dk, hv * dv
    c = 2 * kd + vd
    f32 = torch.float32
    window = torch.cat((conv_state, y[:, :c].unsqueeze(-1).to(conv_state.dtype)), dim=-1)
    tail = window[..., 1:]
    conv_state.copy_(tail)
    pre = (tail.to(f32) * conv_w.to(f32)).sum(-1)
    if conv_b is not None:
        pre = pre + conv_b.to(f32)
    qkv = F.silu(pre)
    q, k = qkv[:, :kd].view(b, hk, dk), qkv[:, kd : 2 * kd].view(b, hk, dk)
    v = qkv[:, 2 * kd :].view(b, hv, dv)
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * (dk**-0.5)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q, k = q.repeat_interleave(r, dim=1), k.repeat_interleave(r, dim=1)  # [B, Hv, dk]
    off = 2 * kd + 2 * vd
    beta = torch.sigmoid(y[:, off : off + hv].to(f32)) * beta_scale
    decay = torch.exp(-a_log.to(f32).exp() * F.softplus(y[:, off + hv : off + 2 * hv].to(f32) + dt_bias.to(f32)))
    state.mul_(decay[..., None, None])
    d = (v - (state * k[..., None]).sum(-2)) * beta[..., None]
    state.add_(k[..., None] * d[..., None, :])
    o = (state * q[..., None]).sum(-2)  # [B, Hv, dv]
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + norm_eps)
    z = y[:, 2 * kd + vd : off].to(f32).view(b, hv, dv)
    out.copy_((norm_w.to(f32) * o * F.silu(z)).view(out.shape))
    return out


def random_inputs(
    g: torch.Generator,
    *,
    b: int,
    hk: int,
    r: int,
    dk: int,
    dv: int,
    width: int = 4,
    dtype: torch.dtype = torch.float32,
    bias: bool = False,
    extra_cols: int = 0,
) -> tuple[list, dict]:
    """Positional arguments and keywords of one step on the CPU, with values real layers take: unit-scale
    projections, a conv weight of ``1 / sqrt(W)`` scale, a state of earlier steps (O(1) entries), ``A_log`` over
    transformers' init range (``A`` in [0.01, 16]) and ``dt_bias`` such that half the heads decay slowly (decay above
    0.999) and half fast. ``extra_cols``: columns past the layout (a wider ``y``)."""
    hv = hk * r
    kd, vd = hk * dk, hv * dv
    c = 2 * kd + vd
    n = c + vd + 2 * hv + extra_cols

    def rn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    y = rn(b, n).to(dtype)
    conv_state = rn(b, c, width).to(dtype)
    state = rn(b, hv, dk, dv, scale=0.5)
    conv_w = rn(c, width, scale=width**-0.5).to(dtype)
    conv_b = rn(c, scale=0.1).to(dtype) if bias else None
    a_log = torch.empty(hv).uniform_(math.log(0.01), math.log(16.0), generator=g)
    slow = torch.arange(hv) % 2 == 0  # slow decay: softplus(a + dt_bias) tiny, so exp(g) within 1e-3 of 1
    dt_bias = torch.where(slow, torch.full((hv,), -12.0), rn(hv))
    norm_w = (1.0 + rn(dv, scale=0.1)).to(dtype)
    out = torch.empty(b, hv * dv, dtype=dtype)
    args = [y, conv_state, state, conv_w, conv_b, dt_bias, a_log, norm_w, out]
    return args, {"hk": hk, "dk": dk, "norm_eps": 1e-6, "beta_scale": 1.0}


# ------------------------------------------------------------------------------------------ patch-time timing

# (device) -> None (the kernel compiled and matched the composed step here) or why not; once per process.
