"""Causal 3-D convolutions of the Wan / Qwen-Image VAEs without ``F.pad``, and their neighbours.

diffusers' ``WanCausalConv3d`` and ``QwenImageCausalConv3d`` keep their padding in ``_padding =
(pW, pW, pH, pH, 2*pT, 0)``, set the convolution's own padding to zero, prepend the cached frames and
then call ``F.pad`` on every input. On MPS before torch 2.15 that pad went through MPSGraph: a
Wan2.2 tiled decode held 270 GiB of driver memory (pytorch#195368), and constant time-padding of
rank-5 tensors with H*W >= 65536 returned wrong values (issue pytorch#194922). Everywhere else it is
one full copy of the activation per convolution.

Here the spatial zero padding becomes the convolution's own ``padding`` (bit-exact on CPU: the
kernel reads zeros at the border either way) and the causal time padding is the cached frames or a
zero slab written into one buffer. When the padded input is one real frame behind zero frames (the
first chunk of a video, every convolution of a single image), only the last time tap of the kernel
meets data: the 3-D convolution is exactly a 2-D convolution with ``weight[:, :, -1]`` (a third of
the FLOPs for 3x3x3 kernels).

The Qwen-Image-2.1 VAE already runs its causal convolutions as 2-D ones (``nn.Conv2d`` subclasses
keeping ``_padding = (pW, pW, pH, pH)``): each squeezes the one frame, ``F.pad``s the 4-D tensor and
convolves with zero own padding. :func:`frame_conv2d` folds that pad into the convolution (the
recipe checks which convolutions qualify).

The other helpers replace the remaining pad calls of these VAEs (``AvgDown3D``'s time padding, the
``ZeroPad2d((0, 1, 0, 1))`` before stride-2 downsampling) and provide the channels-last fast path
used on CUDA (a fused RMS norm over the channel axis, an in-place SiLU).

Nothing here imports diffusers: the functions read the attributes those modules have.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "causal_conv3d",
    "single_frame_conv2d",
    "frame_conv2d",
    "time_pad_front",
    "pad_right_bottom",
    "avg_down3d",
    "rms_norm_channels",
    "is_channels_last",
    "to_memory_format",
    "silu_inplace",
]


def is_channels_last(x: torch.Tensor) -> bool:
    """True when the channel axis (dim 1) is the innermost dense axis of a 4-D or 5-D tensor."""
    if x.dim() == 5:
        return x.is_contiguous(memory_format=torch.channels_last_3d)
    if x.dim() == 4:
        return x.is_contiguous(memory_format=torch.channels_last)
    return False


def to_memory_format(x: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """``x`` in channels-last layout (``channels_last``) or unchanged; never a copy when it already is."""
    if not channels_last or is_channels_last(x):
        return x
    if x.dim() == 5:
        return x.contiguous(memory_format=torch.channels_last_3d)
    if x.dim() == 4:
        return x.contiguous(memory_format=torch.channels_last)
    return x


def _empty_like_layout(shape: tuple[int, ...], like: torch.Tensor, channels_last: bool) -> torch.Tensor:
    fmt = torch.contiguous_format
    if channels_last:
        fmt = torch.channels_last_3d if len(shape) == 5 else torch.channels_last
    return torch.empty(shape, dtype=like.dtype, device=like.device, memory_format=fmt)


def time_pad_front(parts: list[torch.Tensor], front: int, *, channels_last: bool = False) -> torch.Tensor:
    """Concatenate ``parts`` along time (dim 2) behind ``front`` zero frames, in one buffer.

    ``front`` may be negative (more cached frames than the padding needs): then the first ``-front``
    frames are dropped, as ``F.pad`` with a negative amount does. Every element is written once; no
    pad kernel runs.
    """
    if front < 0:
        x = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
        return x[:, :, -front:]
    if front == 0 and len(parts) == 1:
        return parts[0]
    ref = parts[-1]
    n, c = ref.shape[0], ref.shape[1]
    h, w = ref.shape[3], ref.shape[4]
    total = front + sum(p.shape[2] for p in parts)
    out = _empty_like_layout((n, c, total, h, w), ref, channels_last or is_channels_last(ref))
    t = 0
    if front > 0:
        out[:, :, :front].zero_()
        t = front
    for p in parts:
        k = p.shape[2]
        out[:, :, t : t + k].copy_(p)
        t += k
    return out


def _dense(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when it is dense in its own layout (contiguous or channels-last), else a contiguous copy."""
    return x if x.is_contiguous() or is_channels_last(x) else x.contiguous()


def single_frame_conv2d(
    conv: torch.nn.Conv3d,
    frame: torch.Tensor,
    tap: int,
    padding: tuple[int, int],
    *,
    channels_last: bool = False,
    dense: bool = False,
) -> torch.Tensor:
    """One output frame of ``conv`` whose time window holds data only at kernel tap ``tap``.

    ``frame`` is ``[N, C, 1, H, W]``; the result is ``[N, O, 1, H', W']`` (channels-last when
    ``channels_last`` or when ``frame`` already is). ``dense``: a strided frame is copied first.
    """
    x2 = to_memory_format(frame[:, :, 0], channels_last)
    if dense:
        x2 = _dense(x2)
    w2 = conv.weight[:, :, tap]
    # The time slice of a 5-D weight is strided; give cuDNN/MPS a dense 2-D weight of x's layout.
    w2 = w2.contiguous(memory_format=torch.channels_last if is_channels_last(x2) else torch.contiguous_format)
    y = F.conv2d(x2, w2, conv.bias, conv.stride[1:], padding, conv.dilation[1:], conv.groups)
    return y.unsqueeze(2)


def causal_conv3d(
    conv: torch.nn.Conv3d,
    x: torch.Tensor,
    cache_x: torch.Tensor | None = None,
    *,
    single_frame_2d: bool = True,
    channels_last: bool = False,
    dense: bool = False,
) -> torch.Tensor:
    """What ``WanCausalConv3d.forward(x, cache_x)`` computes, without ``F.pad``.

    ``conv`` must carry diffusers' ``_padding = (pW, pW, pH, pH, 2*pT, 0)`` and zero own padding.
    ``single_frame_2d``: use the 2-D convolution when one real frame meets the kernel's last tap.
    ``channels_last``: build the padded buffer channels-last (cuDNN's native layout).
    ``dense``: never hand the convolution a strided view (a frame slice of the VAE's frame loop, the frames kept
    past a longer cache); copy it first. diffusers' own ``F.pad`` copied every input; without it such views
    reach the convolution, which MPS gets wrong past the first batch element (issue pytorch#169342).
    """
    pw, _, ph, _, pt, _ = conv._padding
    parts = [x]
    front = pt
    # Same rule as diffusers: the cache only replaces time padding, and only when there is some.
    if cache_x is not None and pt > 0:
        cache_x = cache_x.to(x.device)
        parts = [cache_x, x]
        front = pt - cache_x.shape[2]
    kt = conv.kernel_size[0]
    dt = conv.dilation[0]
    if single_frame_2d and len(parts) == 1 and x.shape[2] == 1 and front == dt * (kt - 1):
        # Padded input [0, .., 0, x]: every output frame but one would read only zeros in time,
        # and the one output frame sees x at the last tap alone.
        return single_frame_conv2d(conv, x, kt - 1, (ph, pw), channels_last=channels_last, dense=dense)
    if channels_last and len(parts) == 1 and front == 0:
        inp = to_memory_format(x, True)
    else:
        inp = time_pad_front(parts, front, channels_last=channels_last)
    if dense:
        inp = _dense(inp)
    return F.conv3d(inp, conv.weight, conv.bias, conv.stride, (0, ph, pw), conv.dilation, conv.groups)


def frame_conv2d(
    conv: torch.nn.Conv2d, x: torch.Tensor, *, channels_last: bool = False, dense: bool = False
) -> torch.Tensor:
    """What diffusers' ``QwenImage21CausalConv3d.forward(x)`` computes, without ``F.pad``.

    ``x`` is ``[N, C, 1, H, W]``; the frame axis is dropped, the spatial zero padding is the
    convolution's own ``padding`` (no padded copy of the activation; bit-exact on the CPU), and the
    frame axis is put back. ``channels_last``: run the convolution on channels-last activations.
    ``dense``: a strided ``x`` is copied first (see :func:`causal_conv3d`).
    """
    pw, _, ph, _ = conv._padding
    x2 = to_memory_format(x.squeeze(2), channels_last)
    if dense:
        x2 = _dense(x2)
    y = F.conv2d(x2, conv.weight, conv.bias, conv.stride, (ph, pw), conv.dilation, conv.groups)
    return y.unsqueeze(2)


def pad_right_bottom(x: torch.Tensor) -> torch.Tensor:
    """``F.pad(x, (0, 1, 0, 1))`` for a 4-D tensor, written as a buffer copy (no pad kernel).

    It stands in for the ``ZeroPad2d((0, 1, 0, 1))`` before the stride-2 downsampling convolutions;
    the copy keeps ``x``'s layout.
    """
    n, c, h, w = x.shape
    out = _empty_like_layout((n, c, h + 1, w + 1), x, is_channels_last(x))
    out[:, :, h, :].zero_()
    out[:, :, :h, w].zero_()
    out[:, :, :h, :w].copy_(x)
    return out


def avg_down3d(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What diffusers' ``AvgDown3D.forward`` computes, with the causal time padding as a zero slab."""
    ft, fs = module.factor_t, module.factor_s
    pad_t = (ft - x.shape[2] % ft) % ft
    if pad_t:
        x = time_pad_front([x], pad_t)
    b, c, t, h, w = x.shape
    # Splitting axes is a view whatever the strides; the permute's contiguous() is the one copy,
    # as in diffusers.
    x = x.view(b, c, t // ft, ft, h // fs, fs, w // fs, fs)
    x = x.permute(0, 1, 3, 5, 7, 2, 4, 6).contiguous()
    x = x.view(b, c * module.factor, t // ft, h // fs, w // fs)
    x = x.view(b, module.out_channels, module.group_size, t // ft, h // fs, w // fs)
    return x.mean(dim=2)


def rms_norm_channels(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """diffusers' ``WanRMS_norm`` / ``QwenImageRMS_norm`` (channel-first) as one fused ``F.rms_norm``.

    ``F.normalize(x, dim=1) * sqrt(C) * gamma + bias`` equals ``x * rsqrt(mean(x**2)) * gamma +
    bias``; the only difference is the zero-vector guard (``max(norm, 1e-12)`` there, an
    epsilon of ``1e-24 / C`` under the mean here: both give 0 for a zero vector). Rounding differs
    by an ulp or so per element (fp32: ~1e-7 relative; bf16: one rounding instead of three).

    ``norm`` must be channel-first, ``x`` channels-last (the channel axis the dense inner one, for the
    fused kernel) and in the weight's dtype; the caller checks that and takes the stock forward otherwise.
    """
    gamma = norm.gamma
    c = x.shape[1]
    # rms_norm's rsqrt(mean(x**2)) already carries the sqrt(C) that diffusers multiplies in as
    # `scale` (= dim ** 0.5, i.e. sqrt(C)); only a different scale would need a factor.
    w = gamma.reshape(c)
    ratio = norm.scale / c**0.5
    if ratio != 1.0:
        w = w * ratio
    y = F.rms_norm(x.movedim(1, -1), (c,), w, eps=1e-24 / c).movedim(-1, 1)
    bias = norm.bias
    if isinstance(bias, torch.Tensor):
        y = y + bias
    return y


def silu_inplace(x: torch.Tensor) -> torch.Tensor:
    """SiLU, in place when autograd does not need the input (inference), else out of place."""
    return F.silu(x, inplace=not torch.is_grad_enabled())
