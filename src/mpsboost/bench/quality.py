"""Correctness metrics against a reference, and the CPU fp32 reference run itself.

* :func:`psnr`: 10·log10(R² / MSE) in dB, R the data range (peak to peak of the reference unless
  given; pass ``data_range=2.0`` for images in [-1, 1]); ``inf`` when identical.
* :func:`relative_error`: ‖x − ref‖₂ / ‖ref‖₂ over all elements.
* :func:`sqnr`: 10·log10(‖ref‖² / ‖x − ref‖²) in dB (signal to quantisation noise); ``inf`` when
  identical.
* :func:`max_abs`: max |x − ref|.

Sums are taken in float64 so that a bf16 output against an fp32 reference is judged on its own
error, not the metric's rounding. :func:`cpu_reference` runs a copy of a module on the CPU in
fp32 on the same inputs: the reference every recipe's correctness record is measured against.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable, Mapping

from .errors import QualityError
from .records import Correctness

__all__ = [
    "psnr",
    "relative_error",
    "max_relative_error",
    "sqnr",
    "max_abs",
    "correctness",
    "as_tensor",
    "cpu_reference",
    "to_cpu_fp32",
]

# Elements per chunk when reducing: keeps float64 temporaries small for video-sized tensors.
_CHUNK = 1 << 24


def as_tensor(output: Any):
    """The main tensor of a model output: the tensor itself, ``.sample`` (diffusers), ``.logits``
    (transformers), or the first tensor of a tuple/list/dict."""
    import torch

    if isinstance(output, torch.Tensor):
        return output
    for attr in ("sample", "logits", "last_hidden_state"):
        value = getattr(output, attr, None)
        if isinstance(value, torch.Tensor):
            return value
    if isinstance(output, Mapping):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        for item in output:
            try:
                return as_tensor(item)
            except QualityError:
                continue
    raise QualityError(
        f"cannot find a tensor in a {type(output).__name__}; pass a tensor, a diffusers output with .sample, "
        "a transformers output with .logits, or a tuple/list/dict holding tensors"
    )


def _pair(x: Any, ref: Any):

    x, ref = as_tensor(x), as_tensor(ref)
    if x.shape != ref.shape:
        raise QualityError(
            f"shapes differ: output {tuple(x.shape)} vs reference {tuple(ref.shape)}; "
            "compare outputs of the same inputs"
        )
    if x.numel() == 0:
        raise QualityError("cannot compare empty tensors (0 elements)")
    if x.is_complex() or ref.is_complex():
        raise QualityError("complex tensors are not supported; compare real and imaginary parts separately")
    if x.device != ref.device:
        x = x.to(ref.device)
    return x.detach().reshape(-1), ref.detach().reshape(-1)


def _sums(x, ref) -> tuple[float, float, float, float, float]:
    """(sum (x-ref)², sum ref², max |x-ref|, min ref, max ref), in float64, chunked."""
    import torch

    err2 = 0.0
    sig2 = 0.0
    mx = 0.0
    lo = math.inf
    hi = -math.inf
    n = x.numel()
    for start in range(0, n, _CHUNK):
        xs = x[start : start + _CHUNK].to(torch.float64)
        rs = ref[start : start + _CHUNK].to(torch.float64)
        d = xs - rs
        err2 += float(torch.dot(d, d))
        sig2 += float(torch.dot(rs, rs))
        mx = max(mx, float(d.abs().max()))
        lo = min(lo, float(rs.min()))
        hi = max(hi, float(rs.max()))
    return err2, sig2, mx, lo, hi


def _db(num: float, den: float) -> float:
    if math.isnan(num) or math.isnan(den):
        return math.nan
    if den == 0.0:
        return math.inf if num > 0 else math.nan
    if num == 0.0:
        return -math.inf
    return 10.0 * math.log10(num / den)


def psnr(x: Any, ref: Any, *, data_range: float | None = None) -> float:
    """Peak signal-to-noise ratio of ``x`` against ``ref`` in dB (``inf`` when identical).

    ``data_range``: the peak-to-peak range of valid values (2.0 for images in [-1, 1], 1.0 for
    [0, 1], 255 for 8-bit); default: max(ref) − min(ref).
    """
    x, ref = _pair(x, ref)
    err2, _, _, lo, hi = _sums(x, ref)
    r = (hi - lo) if data_range is None else data_range
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not r > 0:
        raise QualityError(
            f"data_range must be a positive number, got {r!r}"
            + (" (the reference is constant: pass data_range explicitly)" if data_range is None else "")
        )
    mse = err2 / x.numel()
    return _db(float(r) ** 2, mse)


def relative_error(x: Any, ref: Any) -> float:
    """‖x − ref‖₂ / ‖ref‖₂ over all elements (0.0 when identical, ``inf`` when ref is all zeros and x is not)."""
    x, ref = _pair(x, ref)
    err2, sig2, _, _, _ = _sums(x, ref)
    if sig2 == 0.0:
        return 0.0 if err2 == 0.0 else math.inf
    return math.sqrt(err2 / sig2)


def max_relative_error(x: Any, ref: Any) -> float:
    """max |x − ref| / max |ref|: the worst element against the reference's scale (0.0 when identical, ``inf`` when
    ref is all zeros and x is not)."""
    x, ref = _pair(x, ref)
    _, _, mx, lo, hi = _sums(x, ref)
    scale = max(abs(lo), abs(hi))
    if scale == 0.0:
        return 0.0 if mx == 0.0 else math.inf
    return mx / scale


def sqnr(x: Any, ref: Any) -> float:
    """Signal-to-quantisation-noise ratio in dB: 10·log10(‖ref‖² / ‖x − ref‖²) (``inf`` when identical)."""
    x, ref = _pair(x, ref)
    err2, sig2, _, _, _ = _sums(x, ref)
    return _db(sig2, err2)


def max_abs(x: Any, ref: Any) -> float:
    """max |x − ref| over all elements."""
    x, ref = _pair(x, ref)
    return _sums(x, ref)[2]


def correctness(
    x: Any, ref: Any, *, reference: str, data_range: float | None = None, psnr_too: bool = True
) -> Correctness:
    """Every metric of ``x`` against ``ref`` as one :class:`~mpsboost.bench.records.Correctness`.

    ``reference`` names what ``ref`` is (``"cpu-fp32"``, ``"stock"``). ``psnr_too=False`` leaves
    the PSNR out (it means little for logits or hidden states).
    """
    x, ref = _pair(x, ref)
    err2, sig2, mx, lo, hi = _sums(x, ref)
    rel = (0.0 if err2 == 0.0 else math.inf) if sig2 == 0.0 else math.sqrt(err2 / sig2)
    p = None
    r = None
    if psnr_too:
        r = (hi - lo) if data_range is None else float(data_range)
        if not r > 0:
            raise QualityError(f"data_range must be positive, got {r!r}; pass data_range explicitly or psnr_too=False")
        p = _db(r**2, err2 / x.numel())
    return Correctness(reference=reference, psnr_db=p, rel_error=rel, sqnr_db=_db(sig2, err2), max_abs=mx, data_range=r)


def to_cpu_fp32(value: Any, dtype: Any = None) -> Any:
    """``value`` with every floating tensor moved to the CPU as ``dtype`` (default float32); integer
    and bool tensors are moved but keep their dtype; containers are rebuilt; other values pass."""
    import torch

    dtype = torch.float32 if dtype is None else dtype
    if isinstance(value, torch.Tensor):
        t = value.detach().to("cpu")
        return t.to(dtype) if t.is_floating_point() else t
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(to_cpu_fp32(v, dtype) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu_fp32(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: to_cpu_fp32(v, dtype) for k, v in value.items()}
    return value


def cpu_reference(
    module: Any,
    *args: Any,
    method: str | None = None,
    dtype: Any = None,
    fn: Callable[..., Any] | None = None,
    **kwargs: Any,
) -> Any:
    """Run a copy of ``module`` on the CPU in fp32 (or ``dtype``) on the same inputs; return its output.

    ``module`` is not changed: a deep copy is moved to the CPU. Pass the stock module (or one that
    ``mpsboost.unpatch`` has restored); a patched module's copy runs the patched forwards. ``method``
    names the method to call (``"decode"`` for a VAE); ``fn(copy, *args, **kwargs)`` runs anything
    else. Floating tensors among the arguments are cast to fp32 on the CPU; others keep their
    dtype. Runs under ``torch.no_grad()``.

        ref = cpu_reference(vae, z, method="decode")   # vae on mps in bf16, z on mps
    """
    import torch

    dtype = torch.float32 if dtype is None else dtype
    if not isinstance(module, torch.nn.Module):
        raise QualityError(f"cpu_reference needs a torch.nn.Module, got {type(module).__name__}")
    if method is not None and fn is not None:
        raise QualityError("pass either method= or fn=, not both")
    if any(p.device.type == "meta" for p in module.parameters()):
        raise QualityError(
            "the module has parameters on the meta device (not loaded); load its weights before taking a reference"
        )
    ref_module = copy.deepcopy(module)
    # torch.nn.Module.to itself, not the library override: diffusers' ModelMixin.to warns about
    # casting on every call, and the cast of a throwaway reference copy is exactly what we want.
    # Module.to casts floating parameters and buffers only; integer buffers keep their dtype.
    torch.nn.Module.to(ref_module, device="cpu", dtype=dtype)
    ref_module.eval()
    cargs = to_cpu_fp32(args, dtype)
    ckw = to_cpu_fp32(kwargs, dtype)
    with torch.no_grad():
        if fn is not None:
            out = fn(ref_module, *cargs, **ckw)
        elif method is not None:
            target = getattr(ref_module, method, None)
            if not callable(target):
                raise QualityError(f"{type(module).__name__} has no method {method!r}")
            out = target(*cargs, **ckw)
        else:
            out = ref_module(*cargs, **ckw)
    return out
