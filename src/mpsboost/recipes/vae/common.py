"""Applying the causal-VAE treatment to one module tree: what the Wan and Qwen-Image recipes share.

The recipes describe their diffusers classes by dotted path (:class:`VaeClasses`); this module finds
the instances by class path (no diffusers import), binds the new forwards on each instance, and
returns one :class:`~mpsboost.patching.Patch` that restores every original object.

Per instance, by option:

* every causal ``Conv3d``: :func:`~mpsboost.ops.causal_conv.causal_conv3d` (padding fold, zero
  slab, 2-D convolution for a single frame);
* every frame convolution of the Qwen-Image-2.1 VAE (an ``nn.Conv2d`` that squeezes the frame and
  pads a 4-D tensor): :func:`~mpsboost.ops.causal_conv.frame_conv2d` (padding fold);
* ``AvgDown3D`` (Wan2.2 and Qwen-Image-2.1 encoders): time padding as a zero slab;
* ``ZeroPad2d((0, 1, 0, 1))`` in the resample blocks: a buffer copy;
* ``layout="channels_last"`` (the CUDA default): every convolution weight of the tree in
  channels-last layout (same values; cuDNN's native layout), so activations stay channels-last;
* ``fused_norm``: the channel RMS norms as one ``F.rms_norm`` over the dense channel axis, and
  the SiLU that follows each of them in place;
* ``tile_loop`` (a whole VAE only): ``_encode``, ``_decode``, ``tiled_encode``, ``tiled_decode``
  replaced by :mod:`~mpsboost.recipes.vae.tiles`.
"""
from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from ...gate import Env, check
from ...registry import Decision, Match, class_path, join_path, matches_class
from ...patching import Changes, Patch, bind_forward, call_original, relayout_param, set_instance_attr
from . import tiles as vae_tiles
from ...ops.causal_conv import avg_down3d, causal_conv3d, frame_conv2d, frame_conv_foldable, pad_right_bottom, rms_norm_channels, silu_inplace

__all__ = [
    "VaeClasses",
    "VaeOptions",
    "VaePadOptions",
    "WAN",
    "QWEN",
    "QWEN21",
    "FAMILIES",
    "MODULES",
    "LAYOUTS",
    "parse_options",
    "count_modules",
    "patch_tree",
    "bind_module_forward",
    "loop_spec",
    "find_targets",
    "decide",
]

LAYOUTS = ("auto", "channels_last", "contiguous")
#: Default share of ``torch.mps.recommended_max_memory()`` above which the tile loop frees the cache.
MEMORY_THRESHOLD = 0.85


@dataclass(frozen=True)
class VaeClasses:
    """The diffusers classes of one VAE family, by dotted path (matched against each MRO).

    A model family is a row of :data:`FAMILIES`: a VAE whose modules pad like one of the rows' needs
    only a new row, no new code.
    """

    family: str  # "wan" / "qwen" / "qwen21"
    vae: str
    conv: str
    norm: str
    resample: str
    blocks: tuple[str, ...]  # classes whose `nonlinearity` follows one of the norms
    avg_down: str | None
    first_chunk: bool  # decoder takes first_chunk=
    clamp_tiled: bool  # tiled_decode clamps
    patchify: bool  # module has patchify / unpatchify (Wan2.2 patch_size)
    # "causal3d": an nn.Conv3d with diffusers' `_padding = (pW, pW, pH, pH, 2*pT, 0)` that takes a
    # cache (Wan, Qwen-Image); "frame2d": an nn.Conv2d with `_padding = (pW, pW, pH, pH)` that
    # squeezes the one frame, pads a 4-D tensor and takes no cache (Qwen-Image-2.1).
    conv_kind: str = "causal3d"
    # Names of the (un)patchify functions in the family's diffusers module.
    patch_fns: tuple[str, str] = ("patchify", "unpatchify")


@dataclass(frozen=True)
class VaePadOptions:
    """``options={"wan_vae_pad" | "qwen_image_vae": {...}}``, as the user gives them (see :func:`parse_options`).

    ``fused_norm``, ``single_frame_2d``, ``tile_loop``, ``memory_watch``: True, False or "auto"/None (the
    device's default); ``memory_watch`` also takes a :class:`~mpsboost.recipes.vae.tiles.MemoryWatcher`.
    """

    layout: str = "auto"
    fused_norm: bool | str | None = None
    single_frame_2d: bool | str | None = None
    tile_loop: bool | str | None = None
    memory_threshold: float = MEMORY_THRESHOLD
    memory_watch: bool | str | vae_tiles.MemoryWatcher | None = "auto"


@dataclass(frozen=True)
class VaeOptions:
    layout: str  # "channels_last" or "contiguous" (resolved)
    fused_norm: bool
    single_frame_2d: bool
    tile_loop: bool
    # Frees cached blocks between tiles (MPS default; see vae_tiles.MemoryWatcher). None: off.
    memory_watch: vae_tiles.MemoryWatcher | None = None

    @property
    def channels_last(self) -> bool:
        return self.layout == "channels_last"

    def describe(self) -> dict:
        out = {"layout": self.layout, "fused_norm": self.fused_norm, "single_frame_2d": self.single_frame_2d, "tile_loop": self.tile_loop}
        out["memory_watch"] = self.memory_watch.threshold if self.memory_watch is not None else None
        return out


def _bool_option(recipe: str, key: str, value: Any, default: bool) -> bool:
    if value is None or value == "auto":
        return default
    if isinstance(value, bool):
        return value
    raise ValueError(f"{recipe} option {key}={value!r} is not accepted; pass True, False or 'auto'")


def parse_options(recipe: str, options: VaePadOptions, device_type: str) -> VaeOptions:
    """The recipe's options resolved for ``device_type``; values it does not accept raise ValueError
    (api checked the keys and types against :class:`VaePadOptions`).

    Defaults: channels-last layout and the fused norm on CUDA (where cuDNN and the fused RMS-norm
    kernel are known); the contiguous layout elsewhere (the MPS and CPU paths change only what the
    pad fold needs). The single-frame 2-D convolution and the tile loop everywhere. The memory
    watch of the tile loop on MPS only (``memory_watch``: True, False, "auto", or a
    :class:`~mpsboost.recipes.vae.tiles.MemoryWatcher` with its own counters; ``memory_threshold``: the
    share of the recommended maximum, default 0.85).
    """
    layout = options.layout
    if layout not in LAYOUTS:
        raise ValueError(f"{recipe} option layout={layout!r} is not accepted; pass one of {', '.join(LAYOUTS)}")
    if layout == "auto":
        layout = "channels_last" if device_type == "cuda" else "contiguous"
    fused = _bool_option(recipe, "fused_norm", options.fused_norm, layout == "channels_last")
    sf = _bool_option(recipe, "single_frame_2d", options.single_frame_2d, True)
    tl = _bool_option(recipe, "tile_loop", options.tile_loop, True)
    threshold = options.memory_threshold
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0.0 < float(threshold) <= 1.0:
        raise ValueError(f"{recipe} option memory_threshold={threshold!r} is not accepted; pass a fraction in (0, 1], e.g. 0.85")
    watch = options.memory_watch
    watcher: vae_tiles.MemoryWatcher | None
    if isinstance(watch, vae_tiles.MemoryWatcher):
        watcher = watch
    else:
        on = _bool_option(recipe, "memory_watch", watch, device_type == "mps")
        watcher = vae_tiles.MemoryWatcher(float(threshold)) if on else None
    return VaeOptions(layout=layout, fused_norm=fused, single_frame_2d=sf, tile_loop=tl, memory_watch=watcher)


def _is_right_bottom_pad(m: torch.nn.Module) -> bool:
    return isinstance(m, torch.nn.ZeroPad2d) and tuple(m.padding) == (0, 1, 0, 1)


def _resample_pads(root: torch.nn.Module, classes: VaeClasses) -> Iterator[torch.nn.Module]:
    for m in root.modules():
        if matches_class(m, (classes.resample,)):
            for sub in m.modules():
                if _is_right_bottom_pad(sub):
                    yield sub


def _block_activations(root: torch.nn.Module, classes: VaeClasses) -> Iterator[torch.nn.Module]:
    for m in root.modules():
        if matches_class(m, classes.blocks):
            act = getattr(m, "nonlinearity", None)
            if isinstance(act, torch.nn.SiLU):
                yield act


def count_modules(root: torch.nn.Module, classes: VaeClasses) -> dict:
    """How many of each target the tree holds (for the report and for tests)."""
    return {
        "causal_convs": sum(1 for m in root.modules() if matches_class(m, (classes.conv,))),
        "avg_down": sum(1 for m in root.modules() if classes.avg_down and matches_class(m, (classes.avg_down,))),
        "zero_pads": sum(1 for _ in _resample_pads(root, classes)),
        "norms": sum(1 for m in root.modules() if matches_class(m, (classes.norm,))),
    }


_WAN = "diffusers.models.autoencoders.autoencoder_kl_wan"
_QWEN = "diffusers.models.autoencoders.autoencoder_kl_qwenimage"
_QWEN21 = "diffusers.models.autoencoders.autoencoder_kl_qwenimage21"

#: diffusers 0.42.1's Wan2.1 / Wan2.2 VAE classes.
WAN = VaeClasses(
    family="wan",
    vae=f"{_WAN}.AutoencoderKLWan",
    conv=f"{_WAN}.WanCausalConv3d",
    norm=f"{_WAN}.WanRMS_norm",
    resample=f"{_WAN}.WanResample",
    blocks=(f"{_WAN}.WanResidualBlock", f"{_WAN}.WanEncoder3d", f"{_WAN}.WanDecoder3d"),
    avg_down=f"{_WAN}.AvgDown3D",
    first_chunk=True,
    clamp_tiled=True,
    patchify=True,
)

#: diffusers 0.42.1's Qwen-Image VAE classes (the Wan2.1 design without AvgDown3D or patches).
QWEN = VaeClasses(
    family="qwen",
    vae=f"{_QWEN}.AutoencoderKLQwenImage",
    conv=f"{_QWEN}.QwenImageCausalConv3d",
    norm=f"{_QWEN}.QwenImageRMS_norm",
    resample=f"{_QWEN}.QwenImageResample",
    blocks=(f"{_QWEN}.QwenImageResidualBlock", f"{_QWEN}.QwenImageEncoder3d", f"{_QWEN}.QwenImageDecoder3d"),
    avg_down=None,
    first_chunk=False,
    clamp_tiled=False,  # diffusers' tiled_decode of this VAE does not clamp; kept as is
    patchify=False,
)

#: diffusers 0.42.1's Qwen-Image-2.1 VAE classes: the Wan2.2 residual design (AvgDown3D, DupUp3D,
#: first_chunk, clamped tiles) for images only, its causal convolutions already 2-D (``nn.Conv2d``
#: subclasses that squeeze the frame, ``F.pad`` it and refuse a cache).
QWEN21 = VaeClasses(
    family="qwen21",
    vae=f"{_QWEN21}.AutoencoderKLQwenImage21",
    conv=f"{_QWEN21}.QwenImage21CausalConv3d",
    norm=f"{_QWEN21}.QwenImage21RMS_norm",
    resample=f"{_QWEN21}.QwenImage21Resample",
    blocks=(f"{_QWEN21}.QwenImage21ResidualBlock", f"{_QWEN21}.QwenImage21Encoder3d", f"{_QWEN21}.QwenImage21Decoder3d"),
    avg_down=f"{_QWEN21}.QwenImage21AvgDown3D",
    first_chunk=True,
    clamp_tiled=True,
    patchify=True,
    conv_kind="frame2d",
    patch_fns=("_patchify", "_unpatchify"),
)

#: Every family, by name.
FAMILIES = {c.family: c for c in (WAN, QWEN, QWEN21)}

#: diffusers module of each family (imported by the recipes, never here).
MODULES = {"wan": _WAN, "qwen": _QWEN, "qwen21": _QWEN21}


# ----------------------------------------------------------------------------------------- binding

def bind_module_forward(module: torch.nn.Module, recipe: str, new_forward: Callable[..., Any]) -> Patch:
    """Bind ``new_forward`` on this instance (inside an accelerate hook where there is one: the
    registry puts it in ``_old_forward`` so that offloading keeps moving the weights in)."""
    return bind_forward(module, recipe, new_forward)


def _convert_weights(root: torch.nn.Module, channels_last: bool) -> list[Patch]:
    """Conv weights of ``root`` in channels-last layout; each undo puts the contiguous layout back.

    The Parameter objects stay the same (only ``.data`` is re-laid); values are unchanged.
    """
    patches: list[Patch] = []
    if channels_last:
        for m in root.modules():
            if isinstance(m, (torch.nn.Conv3d, torch.nn.Conv2d)) and isinstance(m.weight, torch.nn.Parameter):
                w = m.weight
                fmt = torch.channels_last_3d if w.dim() == 5 else torch.channels_last
                if w.device.type != "meta" and not w.is_contiguous(memory_format=fmt):
                    patches.append(relayout_param(w, fmt))
    return patches


def loop_spec(
    root: torch.nn.Module,
    classes: VaeClasses,
    *,
    patchify: Callable[..., torch.Tensor] | None = None,
    unpatchify: Callable[..., torch.Tensor] | None = None,
) -> vae_tiles.VaeLoopSpec:
    """The loop description of a VAE instance. The recipe passes diffusers' ``patchify`` /
    ``unpatchify`` functions (ops never import diffusers)."""
    counts = getattr(root, "_cached_conv_counts", None) or {}
    enc = counts.get("encoder")
    dec = counts.get("decoder")
    if enc is None:
        enc = sum(1 for m in root.encoder.modules() if matches_class(m, (classes.conv,)))
    if dec is None:
        dec = sum(1 for m in root.decoder.modules() if matches_class(m, (classes.conv,)))
    return vae_tiles.VaeLoopSpec(
        family=classes.family,
        first_chunk=classes.first_chunk,
        clamp_tiled=classes.clamp_tiled,
        enc_convs=int(enc),
        dec_convs=int(dec),
        patchify=patchify if classes.patchify else None,
        unpatchify=unpatchify if classes.patchify else None,
    )


def patch_tree(
    root: torch.nn.Module,
    classes: VaeClasses,
    opts: VaeOptions,
    recipe: str,
    *,
    spec: vae_tiles.VaeLoopSpec | None = None,
    decoder_output: Callable[..., Any] | None = None,
) -> Patch:
    """Apply the treatment to every target under ``root``; one undo for all of it.

    ``spec`` and ``decoder_output`` (diffusers' ``DecoderOutput``) are given for a whole VAE: with
    ``opts.tile_loop`` its frame and tile loops are replaced too. On an exception part-way, what
    was applied so far is undone before re-raising.
    """
    with Changes() as ch:
        sf, cl = opts.single_frame_2d, opts.channels_last

        def conv_forward(self: torch.nn.Module, x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
            return causal_conv3d(self, x, cache_x, single_frame_2d=sf, channels_last=cl)

        def frame_forward(self: torch.nn.Module, x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
            if cache_x is not None or x.dim() != 5 or x.shape[2] != 1:
                # The stock forward's own error (it takes one frame and no cache); shapes are static
                # under torch.compile, so this is a guard, not a host sync.
                return call_original(self, recipe, x, cache_x)
            return frame_conv2d(self, x, channels_last=cl)

        frame2d = classes.conv_kind == "frame2d"

        def avg_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
            return avg_down3d(self, x)

        def pad_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
            if x.dim() != 4:
                return call_original(self, recipe, x)
            return pad_right_bottom(x)

        def norm_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
            y = rms_norm_channels(self, x)
            # call_original, not a bound method built here: torch.compile traces straight through it.
            return y if y is not None else call_original(self, recipe, x)

        def silu_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
            return silu_inplace(x)

        for m in root.modules():
            if matches_class(m, (classes.conv,)):
                if frame2d and not frame_conv_foldable(m):
                    continue  # a padding mode other than zeros: left as it is
                ch.add(bind_module_forward(m, recipe, frame_forward if frame2d else conv_forward))
            elif classes.avg_down and matches_class(m, (classes.avg_down,)):
                ch.add(bind_module_forward(m, recipe, avg_forward))
            elif opts.fused_norm and matches_class(m, (classes.norm,)):
                ch.add(bind_module_forward(m, recipe, norm_forward))
        for pad in _resample_pads(root, classes):
            ch.add(bind_module_forward(pad, recipe, pad_forward))
        if opts.fused_norm:
            # Each of these SiLUs receives the fresh output of a norm: in place is safe there.
            for act in _block_activations(root, classes):
                ch.add(bind_module_forward(act, recipe, silu_forward))
        for p in _convert_weights(root, cl):
            ch.add(p)

        if spec is not None and decoder_output is not None and opts.tile_loop:

            def _decode(self: Any, z: torch.Tensor, return_dict: bool = True) -> Any:
                dec = vae_tiles.decode(self, z, spec)
                return decoder_output(sample=dec) if return_dict else (dec,)

            def _encode(self: Any, x: torch.Tensor) -> torch.Tensor:
                return vae_tiles.encode(self, x, spec)

            watcher = opts.memory_watch

            def tiled_decode(self: Any, z: torch.Tensor, return_dict: bool = True) -> Any:
                dec = vae_tiles.tiled_decode(self, z, spec, watcher=watcher)
                return decoder_output(sample=dec) if return_dict else (dec,)

            def tiled_encode(self: Any, x: torch.Tensor) -> torch.Tensor:
                return vae_tiles.tiled_encode(self, x, spec, watcher=watcher)

            for name, fn in (("_decode", _decode), ("_encode", _encode), ("tiled_decode", tiled_decode), ("tiled_encode", tiled_encode)):
                ch.add(set_instance_attr(root, recipe, name, types.MethodType(fn, root)))
    return ch.patch(description=f"{recipe}: restore {class_path(type(root))}")


# ----------------------------------------------------------------------------------------- recipe glue

def find_targets(root: torch.nn.Module, prefix: str, classes: VaeClasses) -> Iterator[Match]:
    """Each whole VAE under ``root`` (one match, one report row); or, when ``root`` holds causal
    convolutions but no VAE (a bare encoder or decoder), ``root`` itself as a module-tree match."""
    found = False
    for name, mod in root.named_modules():
        if matches_class(mod, (classes.vae,)):
            found = True
            yield Match(mod, join_path(prefix, name), {"vae": True, "family": classes.family})
    if not found and any(matches_class(m, (classes.conv,)) for m in root.modules()):
        yield Match(root, prefix or "<root>", {"vae": False, "family": classes.family})


def decide(recipe: str, classes: VaeClasses, match: Match, env: Env, options: VaePadOptions, backing: str) -> Decision:
    """The shared decision: always applicable (lossless), with the reason for this environment."""
    opts = parse_options(recipe, options, env.device_type)
    extras = []
    if opts.channels_last:
        extras.append("channels-last")
    if opts.fused_norm:
        extras.append("fused RMS norm")
    full_backing = backing + (" + " + ", ".join(extras) if extras else "")
    pad = check("pad_constant_native", env)
    rank5 = check("pad_rank5_correct", env)
    if not pad.ok or not rank5.ok:
        bad = "; ".join(v.reason for v in (pad, rank5) if not v.ok)
        reason = (
            "avoids pytorch#195368 (MPSGraph pad: 270 GiB driver memory in a Wan2.2 tiled decode) and "
            f"pytorch#194922 (wrong time padding of rank-5 tensors with H*W >= 65536) on this build: {bad}"
        )
    else:
        # The two upstream issues are MPS ones: cite them only where they could have applied.
        why = "F.pad is native and correct on this build (pytorch#195368, #194922); " if env.device_type == "mps" else ""
        reason = f"for speed: {why}folding saves one copy of the activation per causal convolution"
        if opts.channels_last:
            reason += "; activations stay channels-last (cuDNN's native layout)"
    if opts.memory_watch is not None and opts.tile_loop:
        reason += (
            f"; the tile loop {opts.memory_watch.describe()} (torch.mps.driver_allocated_memory against "
            "recommended_max_memory, then empty_cache), before a unified-memory Mac swaps"
        )
    counts = count_modules(match.module, classes)
    return Decision.apply(full_backing, reason, **counts, **opts.describe(), whole_vae=bool(match.data.get("vae")))
