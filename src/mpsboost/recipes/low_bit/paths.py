"""The low_bit_weights recipe's path policy: which kernels a low-bit layer's few-rows (decode) calls take in one
environment.

Asked of the gate (its row ``affine_metal_gemv``), on a real Mac of the Metal kernels' patch-time self-check
(:func:`metal_verdict`), and of the shapes torch's own kernels take (:func:`mpsboost.ops.affine.torch_pack_for`).
The kernels themselves are tensor functions in :mod:`mpsboost.ops.affine`, which decides nothing. Pure but for the
once-per-process self-check: the same environment and layer give the same :class:`LayerPath`. Where a real Mac can
time mpsboost's Metal GEMV against torch's int4pack/int8pack for a dense linear, the recipe
(:func:`mpsboost.recipes.low_bit.recipe`) asks :func:`mpsboost.ondevice.choose` on top of this.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from .._metal import self_checked
from ...gate import Env

__all__ = [
    "LayerPath",
    "metal_verdict",
    "kernels_available",
    "module_path",
    "pack_path",
    "linear_path",
    "METAL",
    "DEQUANT",
    "PACK",
]

METAL = "affine GEMV (metal) at <= 4 rows, dequantize then matmul above"
DEQUANT = "dequantize then matmul"
PACK = {
    "int4pack": "torch's int4pack (_weight_int4pack_mm) at <= 4 rows, dequantize then matmul above",
    "int8pack": "torch's int8pack (_weight_int8pack_mm) at <= 4 rows, dequantize then matmul above",
}


@dataclass(frozen=True)
class LayerPath:
    """How a low-bit layer's few-rows calls run: ``kernel`` on ``torch.ops.mpsboost.affine_*`` (mpsboost's Metal
    kernels on a Mac), ``pack`` on torch's own kernel (``"int4pack"``, ``"int8pack"``; a dense linear only), else
    the layer dequantised per call. ``note``: what the report's reason adds (empty for the static choice)."""

    kernel: bool
    backing: str
    pack: str = ""
    note: str = ""


# (torch version) -> None (the kernels compiled and matched the reference on this Mac) or why not; once per process.
_METAL_CHECKED: dict[str, Optional[str]] = {}


def metal_verdict(env: Env):
    """Whether mpsboost's Metal low-bit kernels run here: the gate's ``affine_metal_gemv`` (torch.mps.compile_shader
    in this build), and on a real Mac their patch-time self-check (:func:`mpsboost.ops.affine_metal.self_check`:
    compiled, then every branch compared with the reference, every code decoded exactly), once per process. A
    simulated Mac is decided by the gate alone, and says so."""
    from ...ops import affine_metal

    return self_checked(
        "affine_metal_gemv",
        env,
        _METAL_CHECKED,
        lambda: affine_metal.self_check("mps"),
        "mpsboost's Metal low-bit GEMV",
    )


def kernels_available() -> bool:
    """``torch.ops.mpsboost.affine_gemv`` and its siblings are registered (``mpsboost.ops.affine``)."""
    from ...ops import affine as _affine  # noqa: F401  (registers them)

    ns = torch.ops.mpsboost
    return all(hasattr(ns, n) for n in ("affine_gemv", "affine_grouped_gemv", "affine_embedding"))


def module_path(env: Env) -> LayerPath:
    """The path of every low-bit layer kind in ``env`` (experts and embeddings; a dense linear's static choice). On
    a Mac whose gate and patch-time self-check allow mpsboost's Metal low-bit kernels (:func:`metal_verdict`),
    decode runs on them; elsewhere the layer is dequantised exactly (float32, rounded once) and multiplied: on the
    CPU and CUDA that is both faster and closer to MLX than the operators' reference, which rounds each weight in
    the scales' dtype."""
    if env.device_type == "mps" and kernels_available():
        v = metal_verdict(env)
        if v.ok:
            return LayerPath(True, METAL)
        return LayerPath(False, f"{DEQUANT} (the Metal low-bit kernels: {v.reason})")
    return LayerPath(False, DEQUANT)


def pack_path(pack: str, note: str) -> LayerPath:
    """A dense linear's few rows on torch's ``pack`` ("int4pack" or "int8pack")."""
    return LayerPath(False, PACK[pack], pack=pack, note=note)


def linear_path(
    env: Env,
    *,
    n: int,
    k: int,
    bits: int,
    group_size: int,
    dtype: torch.dtype,
    mps_kernel: str = "auto",
    unrepresentable: Optional[str] = None,
) -> tuple[LayerPath, Optional[str]]:
    """``(path, pack)`` of a dense ``[n, k]`` linear of ``bits`` computing in ``dtype``: ``pack`` is torch's kernel
    ("int4pack", "int8pack") that also serves it on MPS, where the recipe may time the two (``path`` is then the
    static choice, mpsboost's Metal GEMV), else None and ``path`` is final.

    ``mps_kernel``: "metal" keeps the static choice (the Metal GEMV where allowed), "torch" takes torch's pack
    wherever it serves the layer, "auto" leaves the choice to a timing where both serve. Where the Metal kernels are
    not allowed on a real Mac (a failed self-check), torch's pack takes the few rows where it serves them.
    ``unrepresentable``: why the layer's codes are not torch's pack's (an 8-bit layer whose groups carry their own
    scales and biases; :func:`mpsboost.ops.affine.to_int8pack`), or None."""
    from ...ops.affine import torch_pack_for

    base = module_path(env)
    if env.device_type != "mps" or mps_kernel == "metal":
        return base, None
    pack, why = torch_pack_for(bits, n, k, group_size, dtype)
    if pack is not None and unrepresentable is not None:
        pack, why = None, unrepresentable
    if pack is None:
        if mps_kernel == "torch":
            return dataclasses.replace(base, note=f"torch's int4pack/int8pack do not serve it ({why})"), None
        return base, None
    if mps_kernel == "torch":
        return pack_path(pack, "option mps_kernel='torch'"), None
    if not base.kernel:
        if env.simulated:  # a version without the kernels' gate: the static path, as before
            return base, None
        return pack_path(pack, f"not mpsboost's Metal kernels: {base.backing}"), None
    return base, pack
