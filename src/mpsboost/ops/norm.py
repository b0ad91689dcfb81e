"""RMS norms as one ``F.rms_norm`` call: the three forms transformers' RMSNorm classes compute.

Every form normalises in float32. They differ in where the weight enters and where the result is
rounded to the input's dtype:

* ``"round_then_scale"`` (Llama and 140-odd classes copied from it): ``w * round(x * rsqrt(mean(x^2) + eps))``;
* ``"scale_in_fp32"`` (gpt-oss, OLMo, Helium, ...): ``round(x * rsqrt(...) * w)``;
* ``"zero_centered"`` (Gemma, Qwen3.5/3.6, Qwen3-Next): ``round(x * rsqrt(...) * (1 + w))``.

On MPS ``F.rms_norm`` with a weight is one Metal kernel (pytorch#145301) where the module's forward
dispatches eight to ten ops; on the CPU it is the same composite as the module's code, op for op, so the
result is bit-identical there. ``round_then_scale`` passes a weight of ones so that the fused path is
taken and the weight is applied after rounding, as the module does; in float32, where that rounding is the
identity, the module's weight goes into the one call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["FORMS", "norm_weight", "rms_norm"]

FORMS = ("round_then_scale", "scale_in_fp32", "zero_centered")


def norm_weight(weight: torch.Tensor, form: str) -> torch.Tensor:
    """The float32 weight ``F.rms_norm`` takes for ``form``: ``1 + w``, ``w``, or ones (the module's weight is
    then applied after rounding). A caller may compute it once and pass it to :func:`rms_norm` while the
    module's weight stays as it was (two to three fewer ops per call)."""
    if form == "zero_centered":
        return 1.0 + weight.float()
    if form == "scale_in_fp32":
        return weight.float()
    if form == "round_then_scale":
        return torch.ones(weight.shape[-1:], dtype=torch.float32, device=weight.device)
    raise ValueError(f"unknown RMS norm form {form!r}; known: {', '.join(FORMS)}")


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, form: str, w32: torch.Tensor | None = None
) -> torch.Tensor:
    """The RMS norm of ``x`` over its last dimension in ``form`` (see the module docstring); ``w32``: the
    :func:`norm_weight` of ``weight``, when the caller has it."""
    if form == "round_then_scale" and x.dtype == torch.float32 and weight.dtype == torch.float32:
        # In float32 the rounding is the identity: the module's weight goes into the one call (the same two
        # products, in the module's order), one op fewer than weight-after.
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    if w32 is None:
        w32 = norm_weight(weight, form)
    y = F.rms_norm(x.float(), (x.shape[-1],), w32, eps).to(x.dtype)
    return weight * y if form == "round_then_scale" else y
