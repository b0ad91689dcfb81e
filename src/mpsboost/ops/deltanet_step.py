"""One decode step of a Gated DeltaNet layer after its projections, as one registered operator.

``torch.ops.mpsboost.deltanet_step(y, conv_state, state, conv_w, conv_b, dt_bias, a_log, norm_w, out, hk, dk,
norm_eps, beta_scale)``: from the projections' products ``y [B, N]`` in the canonical column order
``[q | k | v | z | b | a]`` (``N >= 2 * hk * dk + 2 * hv * dv + 2 * hv``), it rolls the depthwise causal conv's state
``conv_state [B, C, W]`` (``C = 2 * hk * dk + hv * dv``) and takes the conv's ``silu``, L2-normalises q and k per key
head and scales q by ``dk ** -0.5``, computes the gates (``beta = beta_scale * sigmoid(b)``, decay
``exp(-exp(A_log) * softplus(a + dt_bias))``), updates the float32 recurrent state ``state [B, Hv, dk, dv]`` by the
delta rule in the reference's order (``S = decay S; d = beta (v - S^T k); S += k d^T; o = S^T q``) and writes the
gated RMSNorm ``norm_w * o * rsqrt(mean(o^2) + norm_eps) * silu(z)`` into ``out`` (``B * Hv * dv`` elements,
contiguous, in ``y``'s dtype). ``conv_state``, ``state`` and ``out`` are mutated in place (declared as such:
``torch.compile`` functionalises the call); the weights are the module's own tensors (conv weight ``[C, W]``, its
bias or None, ``dt_bias``/``A_log`` ``[Hv]``, the norm's weight ``[dv]``), read at every call.

Implementations: on the CPU and CUDA (and on MPS where the kernel does not take the tensors), :func:`reference`: the
composed step in float32 (the math of the ``linear_attention`` recipe's composed decode, products in float32), one
registered call (an op counter sees one op). On MPS, :mod:`mpsboost.ops.deltanet_metal`'s kernel: one dispatch.
The caller decides which one a Mac runs (the recipe, at patch time, through :func:`mpsboost.ondevice.choose`).
"""

from __future__ import annotations

from typing import Optional

import torch

from .deltanet_ref import random_inputs, reference  # noqa: F401 - re-exported

__all__ = ["deltanet_step", "reference", "check", "random_inputs", "COMPOSED_OPS", "FUSED_OPS"]

# Dispatches of the step after the projections, composed (the linear_attention recipe's eager decode: conv roll 5,
# q/k norm 3, gates 4, delta rule 5, gated norm 6; one sequence) and fused (this operator's MPS kernel): the static
# choice's reason.
COMPOSED_OPS = 23
FUSED_OPS = 1


def _fail(msg: str) -> None:
    raise ValueError(f"mpsboost::deltanet_step: {msg}")


def check(
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
) -> None:
    """Shapes and dtypes (metadata only: fakes call it too); a clear error naming what was passed."""
    if y.dim() != 2 or not y.is_floating_point():
        _fail(f"y must be a floating [B, N] tensor, got {y.dtype} {tuple(y.shape)}")
    if a_log.dim() != 1 or dt_bias.shape != a_log.shape or norm_w.dim() != 1:
        _fail(
            f"A_log and dt_bias must be [Hv], norm_w [dv]; got {tuple(a_log.shape)}, {tuple(dt_bias.shape)}, "
            f"{tuple(norm_w.shape)}"
        )
    hv, dv = a_log.shape[0], norm_w.shape[0]
    if hk < 1 or dk < 1 or hv % hk:
        _fail(f"value heads {hv} must be a multiple of key heads {hk} (dk={dk})")
    b = y.shape[0]
    c = 2 * hk * dk + hv * dv
    if y.shape[1] < c + hv * dv + 2 * hv:
        _fail(f"y has {y.shape[1]} columns; [q | k | v | z | b | a] needs {c + hv * dv + 2 * hv}")
    if conv_w.dim() != 2 or conv_w.shape[0] != c or conv_w.shape[1] < 1:
        _fail(f"conv_w must be [C={c}, W], got {tuple(conv_w.shape)}")
    if conv_b is not None and tuple(conv_b.shape) != (c,):
        _fail(f"conv_b must be [{c}] or None, got {tuple(conv_b.shape)}")
    if tuple(conv_state.shape) != (b, c, conv_w.shape[1]):
        _fail(f"conv_state must be [{b}, {c}, {conv_w.shape[1]}], got {tuple(conv_state.shape)}")
    if tuple(state.shape) != (b, hv, dk, dv) or state.dtype != torch.float32:
        _fail(f"state must be float32 [{b}, {hv}, {dk}, {dv}], got {state.dtype} {tuple(state.shape)}")
    if out.numel() != b * hv * dv or out.dtype != y.dtype or not out.is_contiguous():
        _fail(f"out must be contiguous {y.dtype} with {b * hv * dv} elements, got {out.dtype} {tuple(out.shape)}")
    devs = {t.device for t in (y, conv_state, state, conv_w, dt_bias, a_log, norm_w, out)}
    if conv_b is not None:
        devs.add(conv_b.device)
    if len(devs) > 1:
        _fail(f"tensors on several devices: {sorted(str(d) for d in devs)}")


@torch.library.custom_op("mpsboost::deltanet_step", mutates_args=("conv_state", "state", "out"))
def _deltanet_step_op(
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
    norm_eps: float,
    beta_scale: float,
) -> None:
    check(y, conv_state, state, conv_w, conv_b, dt_bias, a_log, norm_w, out, hk, dk)
    reference(
        y,
        conv_state,
        state,
        conv_w,
        conv_b,
        dt_bias,
        a_log,
        norm_w,
        out,
        hk=hk,
        dk=dk,
        norm_eps=norm_eps,
        beta_scale=beta_scale,
    )


@_deltanet_step_op.register_kernel("mps")
def _deltanet_step_mps(
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
    norm_eps: float,
    beta_scale: float,
) -> None:
    # mpsboost's Metal kernel (mpsboost.ops.deltanet_metal); the caller chose this path where the kernel compiled,
    # matched the composed step and was faster on this Mac.
    from . import deltanet_metal as dm

    args = (y, conv_state, state, conv_w, conv_b, dt_bias, a_log, norm_w, out)
    fn = dm.step if dm.supported(*args, hk, dk) is None else reference
    fn(*args, hk=hk, dk=dk, norm_eps=norm_eps, beta_scale=beta_scale)


@_deltanet_step_op.register_fake
def _deltanet_step_fake(
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
    norm_eps: float,
    beta_scale: float,
) -> None:
    check(y, conv_state, state, conv_w, conv_b, dt_bias, a_log, norm_w, out, hk, dk)
    return None


def deltanet_step(
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
    beta_scale: float = 1.0,
) -> torch.Tensor:
    """``torch.ops.mpsboost.deltanet_step`` (see the module docs); returns ``out``. An eager call on plain MPS
    tensors with nothing to differentiate goes straight to the kernel (the custom_op dispatcher costs about 20 us of
    host time a call, as :func:`mpsboost.ops.affine._eager_mps` notes); traced code, tensor subclasses and autograd
    go through the registered operator."""
    if (
        not torch.compiler.is_compiling()
        and type(y) is torch.Tensor
        and y.device.type == "mps"
        and not torch.is_grad_enabled()
    ):
        check(y, conv_state, state, conv_w, conv_b, dt_bias, a_log, norm_w, out, hk, dk)
        _deltanet_step_mps(
            y, conv_state, state, conv_w, conv_b, dt_bias, a_log, norm_w, out, hk, dk, norm_eps, beta_scale
        )
    else:
        torch.ops.mpsboost.deltanet_step(
            y,
            conv_state,
            state,
            conv_w,
            conv_b,
            dt_bias,
            a_log,
            norm_w,
            out,
            hk,
            dk,
            float(norm_eps),
            float(beta_scale),
        )
    return out


_SELF_CHECKED: dict[str, Optional[str]] = {}


def contenders(
    *,
    b: int,
    hk: int,
    r: int,
    dk: int,
    dv: int,
    width: int,
    dtype: torch.dtype,
    bias: bool,
    beta_scale: float,
    norm_eps: float,
    device: str = "mps",
) -> tuple:
    """``(stock_run, fused_run, check)`` at one layer's shapes, for :func:`mpsboost.ondevice.choose`: ``stock_run``
    makes one composed step (:func:`reference`: the step's aten ops, one dispatch each), ``fused_run`` one launch of
    the Metal kernel, each on its own copy of the same random inputs on ``device`` (made at the first call: nothing
    is allocated where nothing is timed); ``check`` returns None where the kernel passed its self-check
    (:func:`mpsboost.ops.deltanet_metal.self_check`, once per process) and computes what the composed step computes
    at these shapes (one step from the same inputs: output and both states), else why not."""
    from . import deltanet_metal as dm

    made: dict[str, tuple] = {}

    def inputs(which: str) -> tuple:
        if which not in made:
            g = torch.Generator().manual_seed(0)
            args, kw = random_inputs(g, b=b, hk=hk, r=r, dk=dk, dv=dv, width=width, dtype=dtype, bias=bias)
            kw.update(norm_eps=norm_eps, beta_scale=beta_scale)
            made[which] = ([a.to(device, copy=True) if isinstance(a, torch.Tensor) else a for a in args], kw)
        return made[which]

    def stock_run() -> None:
        args, kw = inputs("stock")
        reference(*args, **kw)

    def fused_run() -> None:
        args, kw = inputs("fused")
        dm.step(*args, **kw)

    def check_run() -> Optional[str]:
        if device not in _SELF_CHECKED:
            _SELF_CHECKED[device] = dm.self_check(device)
        if _SELF_CHECKED[device] is not None:
            return _SELF_CHECKED[device]
        (sa, kw), (fa, _) = inputs("check-stock"), inputs("check-fused")
        why = dm.supported(*fa, hk, dk)
        if why is not None:
            return why
        reference(*sa, **kw)
        dm.step(*fa, **kw)
        for name, i, tol in (("output", 8, dm.TOL[dtype]), ("conv state", 1, 0.0), ("state", 2, 1e-5)):
            want, got = sa[i].double().cpu(), fa[i].double().cpu()
            err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
            if not err <= tol:
                return f"the fused step's {name} differs from the composed step's by {err:.2e} at these shapes"
        return None

    return stock_run, fused_run, check_run
