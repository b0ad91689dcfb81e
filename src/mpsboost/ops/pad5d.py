"""Padding of rank-5 tensors without a pad kernel, for diffusers' video VAEs.

On MPS before torch 2.15 every pad of a 5-D tensor went through MPSGraph: driver memory grew by
hundreds of GiB over a tiled video decode (pytorch#195368), constant time padding came back wrong once
H*W >= 65536 (issue pytorch#194922, fixed by #194944), and reflection / replication ``pad3d`` had the
same fault (fixed by #195147). diffusers' video VAEs pad before most of their 3-D convolutions:
replicate in HunyuanVideo (1.0 / 1.5 / the image refiner), Mochi (through CogVideoX's causal
convolution), EasyAnimate (Magvit) and KVAE; reflect in LTX-2's decoder, KVAE and MiniMax-H3; constant
in CogVideoX's, Cosmos', VidTok's and MiniMax-H3's.

:func:`pad5d` computes what ``F.pad`` computes for a rank-5 tensor with one buffer and slice copies:
the input is copied into the interior, then each border is filled from the interior (constant: a
fill; replicate: the edge slice broadcast; reflect: the mirrored slices; circular: the opposite
slices), axis by axis, innermost first, so that corners take the values ``F.pad`` gives them.
Every value is copied, never computed: bit-exact in every dtype.

:func:`pad_then_conv` and :func:`conv3d_padding_mode` are the forwards of the most common
padding modules (HunyuanVideo's causal convolution; ``nn.Conv3d`` with ``padding_mode="reflect"`` /
``"replicate"``) written with :func:`pad5d`. For the other modules, :class:`Pad5dMode` is a
``TorchFunctionMode`` that routes ``F.pad`` on rank-5 tensors to :func:`pad5d` while a patched
module's forward runs (entered by that forward only; nothing global is replaced). torch.compile
traces the explicit forwards; the mode may break a graph there (the routed modules then run
eagerly, with the same values).

Where a module pads with zeros in space and then runs its own convolution, the zero padding is
folded into the convolution's ``padding`` instead (:func:`cosmos_causal_conv3d`,
:func:`vidtok_causal_conv3d`): no buffer at all, as the Wan recipe does.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = [
    "pad5d",
    "Pad5dMode",
    "cosmos_causal_conv3d",
    "vidtok_causal_conv3d",
    "pad_then_conv",
    "conv3d_padding_mode",
    "symmetric_spatial",
]

_MODES = ("constant", "reflect", "replicate", "circular")


def _fill_axis(out: torch.Tensor, dim: int, lo: int, hi: int, n: int, mode: str, value: float) -> None:
    """Fill the ``lo`` leading and ``hi`` trailing entries of axis ``dim`` of ``out``; the ``n``
    entries between them hold data already."""
    if lo == 0 and hi == 0:
        return
    if mode == "constant":
        if lo:
            out.narrow(dim, 0, lo).fill_(value)
        if hi:
            out.narrow(dim, lo + n, hi).fill_(value)
    elif mode == "replicate":
        if lo:
            out.narrow(dim, 0, lo).copy_(out.narrow(dim, lo, 1).expand_as(out.narrow(dim, 0, lo)))
        if hi:
            out.narrow(dim, lo + n, hi).copy_(out.narrow(dim, lo + n - 1, 1).expand_as(out.narrow(dim, lo + n, hi)))
    elif mode == "reflect":
        # F.pad's reflect: out[lo - 1 - i] = x[1 + i], out[lo + n + i] = x[n - 2 - i].
        if lo:
            out.narrow(dim, 0, lo).copy_(out.narrow(dim, lo + 1, lo).flip(dim))
        if hi:
            out.narrow(dim, lo + n, hi).copy_(out.narrow(dim, lo + n - 1 - hi, hi).flip(dim))
    else:  # circular
        if lo:
            out.narrow(dim, 0, lo).copy_(out.narrow(dim, lo + n - lo, lo))
        if hi:
            out.narrow(dim, lo + n, hi).copy_(out.narrow(dim, lo, hi))


def pad5d(x: torch.Tensor, pad: Sequence[int], mode: str = "constant", value: float | None = None) -> torch.Tensor:
    """``F.pad(x, pad, mode, value)`` for a rank-5 ``x``, written as one buffer and slice copies.

    ``pad`` lists (before, after) pairs from the last axis backwards, as ``F.pad`` takes them (2, 4
    or 6 numbers). Negative amounts (cropping) are accepted in constant mode, as ``F.pad`` accepts
    them. Raises ``ValueError`` where ``F.pad`` would raise (reflect amounts must be smaller than
    the axis, for example), so that errors stay the same kind of error.
    """
    if mode not in _MODES:
        raise ValueError(f"pad5d: mode {mode!r} is not one of {', '.join(_MODES)}")
    if x.dim() != 5:
        raise ValueError(f"pad5d takes a rank-5 tensor, got rank {x.dim()}")
    pad = [int(p) for p in pad]
    if len(pad) % 2 or len(pad) > 6:
        raise ValueError(f"pad5d: padding length must be 2, 4 or 6, got {len(pad)}")
    pad = pad + [0] * (6 - len(pad))
    # (dim, before, after) for W, H, T
    axes = [(4, pad[0], pad[1]), (3, pad[2], pad[3]), (2, pad[4], pad[5])]
    if mode != "constant":
        if any(lo < 0 or hi < 0 for _, lo, hi in axes):
            raise ValueError(
                f"pad5d: negative padding is accepted in constant mode only, got {tuple(pad)} in {mode} mode"
            )
        if mode == "reflect":
            for d, lo, hi in axes:
                if lo >= x.shape[d] or hi >= x.shape[d]:
                    raise ValueError(
                        f"pad5d: reflect padding {(lo, hi)} must be smaller than dimension {d} of size {x.shape[d]}"
                    )
        if mode == "circular":
            for d, lo, hi in axes:
                if lo > x.shape[d] or hi > x.shape[d]:
                    raise ValueError(
                        f"pad5d: circular padding {(lo, hi)} must not exceed dimension {d} of size {x.shape[d]}"
                    )
    else:
        # Cropping first: F.pad with a negative amount drops entries.
        for d, lo, hi in axes:
            if lo < 0:
                x = x.narrow(d, -lo, x.shape[d] + lo)
            if hi < 0:
                x = x.narrow(d, 0, x.shape[d] + hi)
        axes = [(d, max(lo, 0), max(hi, 0)) for d, lo, hi in axes]
    if all(lo == 0 and hi == 0 for _, lo, hi in axes):
        # F.pad returns a new tensor for an empty pad; keep that (callers may write into it).
        return x.clone(memory_format=torch.preserve_format) if x.is_contiguous() else x.contiguous()
    shape = list(x.shape)
    for d, lo, hi in axes:
        shape[d] += lo + hi
    channels_last = x.is_contiguous(memory_format=torch.channels_last_3d) and not x.is_contiguous()
    fmt = torch.channels_last_3d if channels_last else torch.contiguous_format
    out = torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=fmt)
    (_, wl, _), (_, hl, _), (_, tl, _) = axes
    t, h, w = x.shape[2], x.shape[3], x.shape[4]
    out[:, :, tl : tl + t, hl : hl + h, wl : wl + w].copy_(x)
    fill = 0.0 if value is None else value
    # W inside the data rows and frames, then H over the full width, then T over the full frame: the
    # corners copy what the previous axes wrote, as F.pad's nested padding does.
    inner = out.narrow(2, tl, t).narrow(3, hl, h)
    _fill_axis(inner, 4, wl, axes[0][2], w, mode, fill)
    _fill_axis(out.narrow(2, tl, t), 3, hl, axes[1][2], h, mode, fill)
    _fill_axis(out, 2, tl, axes[2][2], t, mode, fill)
    return out


_PADS = (F.pad, torch._C._nn.pad)


def _pad_args(args: tuple, kwargs: dict) -> tuple[torch.Tensor, Sequence[int], str, float | None]:
    names = ("input", "pad", "mode", "value")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    return bound["input"], bound["pad"], bound.get("mode", "constant") or "constant", bound.get("value")


class Pad5dMode(TorchFunctionMode):
    """Routes ``F.pad`` on rank-5 tensors to :func:`pad5d` while active; everything else passes.

    ``calls`` counts the pads it rerouted (for reports and tests).
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _PADS:
            x, pad, mode, value = _pad_args(args, kwargs)
            # Pad lengths that F.pad refuses for rank-5 input (non-constant modes take 6) go to F.pad,
            # so that the error stays F.pad's own.
            rank5 = isinstance(x, torch.Tensor) and x.dim() == 5
            if rank5 and mode in _MODES and (mode == "constant" or len(pad) == 6):
                self.calls += 1
                return pad5d(x, pad, mode, value)
        return func(*args, **kwargs)


# ------------------------------------------------------------------------- folds into the convolution


def symmetric_spatial(p: Sequence[int]) -> tuple[int, int] | None:
    """``(pH, pW)`` when ``p`` = ``(pW, pW, pH, pH[, 0, 0])`` with no time padding; else None."""
    p = tuple(int(v) for v in p) + (0,) * (6 - len(p))
    if p[0] == p[1] and p[2] == p[3] and p[4] == p[5] == 0 and min(p) >= 0:
        return p[2], p[0]
    return None


def pad_then_conv(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """diffusers' HunyuanVideo (1.0, 1.5, image refiner) causal convolution: ``module.conv`` after
    ``F.pad(x, module.time_causal_padding, mode=module.pad_mode)``, with the pad as :func:`pad5d`."""
    return module.conv(pad5d(x, module.time_causal_padding, module.pad_mode))


def conv3d_padding_mode(conv: torch.nn.Conv3d, x: torch.Tensor) -> torch.Tensor:
    """``nn.Conv3d.forward`` for ``padding_mode`` "reflect" / "replicate" / "circular", with the pad as
    :func:`pad5d` (what ``Conv3d._conv_forward`` does with ``F.pad``)."""
    xp = pad5d(x, conv._reversed_padding_repeated_twice, conv.padding_mode)
    return F.conv3d(xp, conv.weight, conv.bias, conv.stride, 0, conv.dilation, conv.groups)


def _conv3d_folded(conv: torch.nn.Conv3d, x: torch.Tensor, ph: int, pw: int) -> torch.Tensor:
    pt = conv.padding[0] if isinstance(conv.padding, tuple) else 0
    ph0 = conv.padding[1] if isinstance(conv.padding, tuple) else 0
    pw0 = conv.padding[2] if isinstance(conv.padding, tuple) else 0
    return F.conv3d(x, conv.weight, conv.bias, conv.stride, (pt, ph0 + ph, pw0 + pw), conv.dilation, conv.groups)


def cosmos_causal_conv3d(module: torch.nn.Conv3d, x: torch.Tensor) -> torch.Tensor:
    """diffusers' ``CosmosCausalConv3d.forward`` with the zero spatial pad folded into the
    convolution (constant mode only: the caller checks ``pad_mode == "constant"``)."""
    prev = x[:, :, :1, ...].repeat(1, 1, module.temporal_pad, 1, 1)
    x = torch.cat([prev, x], dim=2)
    ph, pw = module.spatial_pad[2], module.spatial_pad[0]
    return _conv3d_folded(module, x, ph, pw)


def vidtok_causal_conv3d(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """diffusers' ``VidTokCausalConv3d.forward`` (cache logic unchanged) with the zero spatial pad
    folded into ``module.conv`` (constant mode, symmetric padding: the caller checks both)."""
    if module.is_first_chunk:
        first = x[:, :, :1, :, :].repeat((1, 1, module.time_pad, 1, 1))
    else:
        first = module.causal_cache
        first = first[:, :, -module.time_pad :] if module.time_pad != 0 else first[:, :, 0:0]
    x = torch.concatenate((first, x), dim=2)
    if module.cache_offset == 0:
        module.causal_cache = x.clone()
    else:
        module.causal_cache = x[:, :, : -module.cache_offset].clone()
    ph, pw = symmetric_spatial(module.spatial_padding)  # type: ignore[misc]
    return _conv3d_folded(module.conv, x, ph, pw)
