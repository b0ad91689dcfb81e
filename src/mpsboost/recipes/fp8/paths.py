"""The fp8 recipe's path policy: which forward each converted linear layer takes in one environment.

Asked of the gate only (its rows ``float8_storage``, ``scaled_mm``, ``fp8_gemv``, ``fp8_metal_gemv``) and, on a real
Mac, of the Metal kernel's patch-time self-check; the paths themselves are tensor functions in
:mod:`mpsboost.ops.fp8`, which decides nothing. Pure but for the once-per-process self-check: the same
environment and shape give the same :class:`LinearPath`. Where a real Mac can time two paths that both serve a
layer, :func:`mpsboost.recipes.fp8.recipe` asks :func:`mpsboost.ondevice.choose` on top of this.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from .._metal import self_checked
from ...gate import Env, check
from ...ops.fp8 import FEW_ROWS_ALIGN, FEW_ROWS_MAX, few_rows_ok, metal_ok

__all__ = [
    "ACTIVATIONS",
    "MPS_KERNELS",
    "LinearPath",
    "storage_for",
    "metal_verdict",
    "choose_linear_path",
    "mps_path_without_metal",
]


def storage_for(env: Env) -> str:
    """``"float8"`` where float8 tensors can live on the device (gate ``float8_storage``), else ``"uint8"``."""
    return "float8" if check("float8_storage", env).ok else "uint8"


@dataclass(frozen=True)
class LinearPath:
    """How a converted linear layer computes in one environment."""

    kind: str  # "fused", "mps_scaled_mm", "dequant"
    backing: str  # the report's backing path text
    reason: str
    storage: str  # "float8" or "uint8"
    gemv_max_m: int = 16
    large: str = "dequant"  # above gemv_max_m on the fused path: "dequant" or "scaled_mm" (activations in fp8)


ACTIVATIONS = ("bf16", "fp8")


MPS_KERNELS = ("auto", "metal", "scaled_mm")

# (torch version) -> None (the kernel compiled and matched the reference on this Mac) or why not; once per process.
_METAL_CHECKED: dict[str, Optional[str]] = {}


def metal_verdict(env: Env):
    """Whether mpsboost's Metal fp8 GEMV runs here: the gate's ``fp8_metal_gemv`` (torch.mps.compile_shader in this
    build), and on a real Mac its patch-time self-check (:func:`mpsboost.ops.fp8_metal.self_check`: compiled, then
    compared with the reference on shapes that cover its branches, every finite code decoded exactly), once per
    process. A simulated Mac is decided by the gate alone, and says so."""
    from ...ops import fp8_metal

    return self_checked(
        "fp8_metal_gemv", env, _METAL_CHECKED, lambda: fp8_metal.self_check("mps"), "mpsboost's Metal fp8 GEMV"
    )


def choose_linear_path(
    env: Env,
    *,
    n: int,
    k: int,
    dtype: torch.dtype,
    gemv_max_m: int = 16,
    activations: str = "bf16",
    mps_kernel: str = "auto",
) -> LinearPath:
    """The forward path for an ``[n, k]`` layer computing in ``dtype`` in ``env`` (pure: asks only the gate).

    The backing text names what actually runs here: the GEMV's activation dtype (fp32 activations go
    through tf32 tensor cores in the 16-row tile kernel), and the large-M path by alignment, dtype and ``activations``
    (``"bf16"``: dequantise then linear, exact; ``"fp8"``: quantise activations rowwise for scaled_mm).
    """
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
    if mps_kernel not in MPS_KERNELS:
        raise ValueError(f"mps_kernel must be one of {MPS_KERNELS}, got {mps_kernel!r}")
    storage = storage_for(env)
    st = check("float8_storage", env)
    if env.device_type == "cuda":
        sm = check("scaled_mm", env)
        gv = check("fp8_gemv", env)
        if sm.ok and gv.ok:
            aligned = n % 16 == 0 and k % 16 == 0
            use_sm = activations == "fp8" and aligned and dtype == torch.bfloat16
            if use_sm:
                large = "fused activation quantisation + scaled_mm rowwise"
            elif activations == "bf16":
                large = (
                    "dequantize then linear (exact: activations stay bf16)"
                    if dtype == torch.bfloat16
                    else "dequantize then linear"
                )
            else:
                large = (
                    "dequantize then linear"
                    + ("" if aligned else " (shape not 16-aligned for scaled_mm)")
                    + (
                        ""
                        if dtype == torch.bfloat16
                        else f" ({str(dtype)[6:]} output: scaled_mm rowwise gives bf16 only)"
                    )
                )
            acts = (
                ""
                if dtype == torch.bfloat16
                else (
                    ", float32 activations; tf32 in its 16-row tile kernel"
                    if dtype == torch.float32
                    else f", {str(dtype)[6:]} activations"
                )
            )
            small = f"fp8 GEMV (triton{acts}) for M<={gemv_max_m}" if gemv_max_m > 0 else "no fp8 GEMV (gemv_max_m=0)"
            return LinearPath(
                "fused",
                f"{small}; {large} above",
                f"{gv.reason}; {sm.reason}",
                storage,
                gemv_max_m,
                "scaled_mm" if use_sm else "dequant",
            )
        why = sm.reason if not sm.ok else gv.reason
        return LinearPath("dequant", "dequantize then linear", f"no fused fp8 path here: {why}", storage)
    if env.device_type == "mps":
        metal = None
        if mps_kernel != "scaled_mm":
            metal = metal_verdict(env)
            if metal.ok and metal_ok(k, dtype):
                rows = min(gemv_max_m, FEW_ROWS_MAX)
                return LinearPath(
                    "fused",
                    f"fp8 GEMV (mpsboost's Metal kernel: activations as they are, the weight read once as its fp8 "
                    f"bytes, 1 byte per weight) for M<={rows}; dequantize then linear above",
                    metal.reason
                    + ("; forced by option mps_kernel" if mps_kernel == "metal" else "")
                    + ("" if st.ok else f"; {st.reason}: the fp8 bytes are kept as uint8, which the kernel reads"),
                    storage,
                    rows,
                )
        why_not = ""
        if metal is not None:
            why_not = (
                f"; not mpsboost's Metal kernel: {metal.reason}"
                if not metal.ok
                else f"; not mpsboost's Metal kernel: K={k} is not a multiple of 16 or {str(dtype)[6:]} activations"
            )
        elif mps_kernel == "scaled_mm":
            why_not = "; option mps_kernel='scaled_mm'"
        lp = _mps_path_without_metal(env, n=n, k=k, dtype=dtype, st=st, storage=storage)
        return dataclasses.replace(lp, reason=lp.reason + why_not)
    return LinearPath(
        "dequant",
        "dequantize then linear",
        f"{env.device_type}: FP8 is a storage format; each layer is dequantised just before its matmul",
        storage,
    )


def mps_path_without_metal(env: Env, *, n: int, k: int, dtype: torch.dtype) -> LinearPath:
    """The MPS path of an ``[n, k]`` layer from torch's own kernels alone (what mpsboost's Metal GEMV is timed
    against on a Mac)."""
    st = check("float8_storage", env)
    return _mps_path_without_metal(env, n=n, k=k, dtype=dtype, st=st, storage=storage_for(env))


def _mps_path_without_metal(env: Env, *, n: int, k: int, dtype: torch.dtype, st, storage: str) -> LinearPath:
    """The MPS path from torch's own kernels alone (before mpsboost's Metal kernel, or without it)."""
    if not st.ok:
        return LinearPath(
            "dequant",
            "uint8 storage, integer decode then linear",
            f"{st.reason}; the fp8 bytes are kept as uint8 and decoded with integer ops",
            "uint8",
        )
    gv = check("fp8_gemv", env)
    sm = check("scaled_mm", env)
    if gv.ok and sm.ok and few_rows_ok(n, k, dtype):
        return LinearPath(
            "mps_scaled_mm",
            f"scaled_mm rowwise for M<={FEW_ROWS_MAX} (activations quantised per row; the weight read once as fp8, "
            "1 byte per weight); dequantize then linear above",
            f"{gv.reason}; {sm.reason}",
            storage,
            FEW_ROWS_MAX,
        )
    if gv.ok and sm.ok:
        return LinearPath(
            "dequant",
            "dequantize then linear",
            f"scaled_mm needs K and N multiples of {FEW_ROWS_ALIGN} and a float32/bfloat16/float16 output; "
            f"this layer is [{n}, {k}] in {str(dtype)[6:]}",
            storage,
        )
    return LinearPath(
        "dequant",
        "dequantize then linear",
        f"{st.reason}; FP8 is a storage format here: {gv.reason if not gv.ok else sm.reason}",
        storage,
    )
