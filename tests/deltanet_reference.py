"""An independent reference for one decode step of a Gated DeltaNet layer after its projections: transformers' own
``causal_conv1d_update`` (float64), ``torch_recurrent_gated_delta_rule`` (it computes in float32 whatever it is
given) and the layer's ``Qwen3_5MoeRMSNormGated``, on the arguments of ``mpsboost::deltanet_step``; and the comparison
the DeltaNet step tests share (tests/ops/test_deltanet_step.py, tests/ops/test_deltanet_metal_emulated.py).

Tolerances, relative to the largest magnitude: the float32 state and a float32 output 1e-5; a float16/bfloat16
output one rounding to its dtype (the reference's output rounded to the dtype, then 1e-5 plus one ulp at the largest
value); the conv state exactly (it is a copy of values).
"""

from __future__ import annotations

import torch
from mpsboost.bench import max_relative_error
import torch.nn.functional as F

ULP = {torch.float32: 0.0, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


def _transformers():
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m

    return m


def independent(args, kw):
    """One step by transformers' own functions, on copies: (output float64 [B, Hv * dv], conv state, state)."""
    m = _transformers()
    y, cs, st, cw, cb, dtb, alog, nw, _ = args
    hk, dk, eps, beta_scale = kw["hk"], kw["dk"], kw["norm_eps"], kw["beta_scale"]
    hv, dv = alog.shape[0], nw.shape[0]
    kd, vd, b = hk * dk, hv * dv, y.shape[0]
    c = 2 * kd + vd
    y64 = y.double()
    cs64 = cs.double().clone()
    x = m.causal_conv1d_update(y64[:, :c, None], cs64, cw.double(), None if cb is None else cb.double(), "silu")
    qkv = x.transpose(1, 2)  # [B, 1, C]
    q = qkv[..., :kd].reshape(b, 1, hk, dk)
    k = qkv[..., kd : 2 * kd].reshape(b, 1, hk, dk)
    v = qkv[..., 2 * kd :].reshape(b, 1, hv, dv)
    off = 2 * kd + 2 * vd
    beta = y64[:, None, off : off + hv].sigmoid() * beta_scale
    g = -alog.double().exp() * F.softplus(y64[:, None, off + hv : off + 2 * hv] + dtb.double())
    o, state = m.torch_recurrent_gated_delta_rule(
        q, k, v, g=g, beta=beta, initial_state=st.clone(), output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    norm = m.Qwen3_5MoeRMSNormGated(dv, eps=eps).double()
    with torch.no_grad():
        norm.weight.copy_(nw.double())
        z = y64[:, 2 * kd + vd : off].reshape(-1, dv)
        out = norm(o.reshape(-1, dv).double(), z).reshape(b, vd)
    return out.double(), cs64.to(cs.dtype), state


def compare(args, want, what=""):
    out, cs, st = args[8], args[1], args[2]
    ref_out, ref_cs, ref_st = want
    assert not out.isnan().any(), f"{what}: an output the kernel never wrote (or a NaN)"
    assert torch.equal(cs, ref_cs), f"{what}: the conv state rolled wrongly"
    assert max_relative_error(st, ref_st) <= 1e-5, f"{what}: state differs by {max_relative_error(st, ref_st):.2e}"
    dt = out.dtype
    err = max_relative_error(out, ref_out.to(dt) if dt != torch.float32 else ref_out)
    assert err <= 1e-5 + ULP[dt], f"{what}: output differs by {err:.2e} ({dt})"
