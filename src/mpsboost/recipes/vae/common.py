"""The code every VAE recipe shares: it reads rows of :data:`~mpsboost.recipes.vae.families.FAMILIES`.

The recipes select their rows; this module finds the instances by class path (no diffusers import),
decides (a frozen plan per match: :class:`CausalPlan`, :class:`PadPlan`), binds the new forwards on
each instance, and returns one :class:`~mpsboost.patching.Patch` that restores every original object.

The causal treatment (rows with ``conv``; :func:`patch_tree`), per instance, by option:

* every causal ``Conv3d``: :func:`~mpsboost.ops.causal_conv.causal_conv3d` (padding fold, zero
  slab, 2-D convolution for a single frame);
* every frame convolution of a ``conv_kind="frame2d"`` row (an ``nn.Conv2d`` that squeezes the frame
  and pads a 4-D tensor): :func:`~mpsboost.ops.causal_conv.frame_conv2d` (padding fold);
* ``AvgDown3D`` (Wan2.2 and Qwen-Image-2.1 encoders): time padding as a zero slab;
* ``ZeroPad2d((0, 1, 0, 1))`` in the resample blocks: a buffer copy;
* ``layout="channels_last"`` (the CUDA default): every convolution weight of the tree in
  channels-last layout (same values; cuDNN's native layout), so activations stay channels-last;
* ``fused_norm``: the channel RMS norms as one ``F.rms_norm`` over the dense channel axis, and
  the SiLU that follows each of them in place;
* ``tile_loop`` (a whole VAE only): ``_encode``, ``_decode``, ``tiled_encode``, ``tiled_decode``
  replaced by :mod:`~mpsboost.recipes.vae.tiles`.

The pad treatment (rows with ``pads``; :func:`patch_pads`): each module of a row's :class:`PadSite`
classes, and every ``nn.Conv3d`` with a padding mode other than zeros, gets a forward from
:data:`PAD_TREATMENTS` (:mod:`mpsboost.ops.pad5d`: slice copies or a folded convolution).
"""

from __future__ import annotations

import importlib
import types
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Iterator, Literal

import torch

from ...gate import FEATURES, Env, check
from ...ops import pad5d as p5
from ...ops.causal_conv import (
    avg_down3d,
    causal_conv3d,
    frame_conv2d,
    is_channels_last,
    pad_right_bottom,
    rms_norm_channels,
    silu_inplace,
)
from ...patching import Changes, Patch, bind_forward, call_original, relayout_param, set_instance_attr
from ...registry import Decision, Match, Recipe, class_path, join_path, matches_class
from . import tiles as vae_tiles
from .families import VaeFamily, family

__all__ = [
    "VaeTarget",
    "VaeOptions",
    "VaePadOptions",
    "CausalPlan",
    "PadPlan",
    "LAYOUTS",
    "PAD_TREATMENTS",
    "parse_options",
    "count_modules",
    "patch_tree",
    "bind_module_forward",
    "loop_spec",
    "find_targets",
    "find_vaes",
    "decide",
    "apply",
    "count_pads",
    "decide_pads",
    "patch_pads",
]

LAYOUTS = ("auto", "channels_last", "contiguous")
#: Default share of ``torch.mps.recommended_max_memory()`` above which the tile loop frees the cache.
MEMORY_THRESHOLD = vae_tiles.MEMORY_THRESHOLD


@dataclass(frozen=True)
class VaeTarget:
    """``Match.data`` of every VAE recipe: the row the module belongs to, and whether it is a whole
    VAE (its tile loop can be replaced) or a bare encoder / decoder tree."""

    family: str
    whole_vae: bool = True


@dataclass(frozen=True)
class VaePadOptions:
    """``options={"wan_vae_pad" | "qwen_image_vae": {...}}``, as the user gives them (see :func:`parse_options`).

    ``fused_norm``, ``single_frame_2d``, ``tile_loop``, ``memory_watch``: True, False or "auto"/None (the
    device's default); ``memory_watch`` also takes a :class:`~mpsboost.recipes.vae.tiles.MemoryWatcher`.
    """

    layout: Literal["auto", "channels_last", "contiguous"] = "auto"
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
    # Strided views are copied before a folded convolution (gate: conv_strided_batch_correct, pytorch#169342).
    dense_inputs: bool = False

    @property
    def channels_last(self) -> bool:
        return self.layout == "channels_last"

    def describe(self) -> dict:
        out = {
            "layout": self.layout,
            "fused_norm": self.fused_norm,
            "single_frame_2d": self.single_frame_2d,
            "tile_loop": self.tile_loop,
        }
        out["memory_watch"] = self.memory_watch.threshold if self.memory_watch is not None else None
        out["dense_inputs"] = self.dense_inputs
        return out


@dataclass(frozen=True)
class ModuleCounts:
    """How many of each causal-treatment target a tree holds (for the report and for tests)."""

    causal_convs: int
    avg_down: int
    zero_pads: int
    norms: int


@dataclass(frozen=True)
class CausalPlan:
    """What ``decide`` settled for one match of the causal treatment; ``apply`` reads only this."""

    family: str
    options: VaeOptions
    counts: ModuleCounts
    whole_vae: bool

    def report_details(self) -> dict:
        """The report row's details (unchanged keys: the counts, the resolved options, whole_vae)."""
        return {**asdict(self.counts), **self.options.describe(), "whole_vae": self.whole_vae}


@dataclass(frozen=True)
class PadPlan:
    """What ``decide`` settled for one VAE of the pad treatment: its row and how many modules lose a pad."""

    family: str
    folded: int
    written_out: int
    routed: int

    def report_details(self) -> dict:
        return {"folded": self.folded, "written_out": self.written_out, "routed": self.routed}

    @property
    def total(self) -> int:
        return self.folded + self.written_out + self.routed


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
        raise ValueError(
            f"{recipe} option memory_threshold={threshold!r} is not accepted; pass a fraction in (0, 1], e.g. 0.85"
        )
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


def _resample_pads(root: torch.nn.Module, row: VaeFamily) -> Iterator[torch.nn.Module]:
    for m in root.modules():
        if matches_class(m, (row.resample,)):
            for sub in m.modules():
                if _is_right_bottom_pad(sub):
                    yield sub


def _block_activations(root: torch.nn.Module, row: VaeFamily) -> Iterator[torch.nn.Module]:
    for m in root.modules():
        if matches_class(m, row.blocks):
            act = getattr(m, "nonlinearity", None)
            if isinstance(act, torch.nn.SiLU):
                yield act


def count_modules(root: torch.nn.Module, row: VaeFamily) -> ModuleCounts:
    """How many of each target of ``row`` the tree holds (for the report and for tests)."""
    return ModuleCounts(
        causal_convs=sum(1 for m in root.modules() if matches_class(m, (row.conv,))),
        avg_down=sum(1 for m in root.modules() if row.avg_down and matches_class(m, (row.avg_down,))),
        zero_pads=sum(1 for _ in _resample_pads(root, row)),
        norms=sum(1 for m in root.modules() if matches_class(m, (row.norm,))),
    )


def frame_conv_foldable(conv: torch.nn.Module) -> bool:
    """True when :func:`~mpsboost.ops.causal_conv.frame_conv2d` computes what ``conv``'s own forward
    does: a 2-D convolution with zero padding mode, no own padding, and a symmetric
    ``_padding = (pW, pW, pH, pH)``. Other frame convolutions are left as they are."""
    p = getattr(conv, "_padding", None)
    return (
        isinstance(conv, torch.nn.Conv2d)
        and conv.padding_mode == "zeros"
        and tuple(conv.padding) == (0, 0)
        and isinstance(p, (tuple, list))
        and len(p) == 4
        and p[0] == p[1]
        and p[2] == p[3]
    )


def fused_norm_fits(norm: torch.nn.Module, x: torch.Tensor) -> bool:
    """True when :func:`~mpsboost.ops.causal_conv.rms_norm_channels` computes ``norm(x)``: a channel-first
    norm, ``x`` channels-last (the channel axis must be the dense inner one for the fused kernel), and
    the weight in ``x``'s dtype (mixed dtypes promote in the stock forward; its result type is kept by
    taking that path)."""
    return bool(getattr(norm, "channel_first", False)) and is_channels_last(x) and norm.gamma.dtype == x.dtype


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
    row: VaeFamily,
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
        enc = sum(1 for m in root.encoder.modules() if matches_class(m, (row.conv,)))
    if dec is None:
        dec = sum(1 for m in root.decoder.modules() if matches_class(m, (row.conv,)))
    return vae_tiles.VaeLoopSpec(
        family=row.name,
        first_chunk=row.first_chunk,
        clamp_tiled=row.clamp_tiled,
        enc_convs=int(enc),
        dec_convs=int(dec),
        patchify=patchify if row.patchify else None,
        unpatchify=unpatchify if row.patchify else None,
    )


def patch_tree(
    root: torch.nn.Module,
    row: VaeFamily,
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
        sf, cl, dense = opts.single_frame_2d, opts.channels_last, opts.dense_inputs

        def conv_forward(self: torch.nn.Module, x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
            return causal_conv3d(self, x, cache_x, single_frame_2d=sf, channels_last=cl, dense=dense)

        def frame_forward(self: torch.nn.Module, x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
            if cache_x is not None or x.dim() != 5 or x.shape[2] != 1:
                # The stock forward's own error (it takes one frame and no cache); shapes are static
                # under torch.compile, so this is a guard, not a host sync.
                return call_original(self, recipe, x, cache_x)
            return frame_conv2d(self, x, channels_last=cl, dense=dense)

        frame2d = row.conv_kind == "frame2d"

        def avg_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
            return avg_down3d(self, x)

        def pad_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
            if x.dim() != 4:
                return call_original(self, recipe, x)
            return pad_right_bottom(x)

        def norm_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
            if fused_norm_fits(self, x):
                return rms_norm_channels(self, x)
            # call_original, not a bound method built here: torch.compile traces straight through it.
            return call_original(self, recipe, x)

        def silu_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
            return silu_inplace(x)

        for m in root.modules():
            if matches_class(m, (row.conv,)):
                if frame2d and not frame_conv_foldable(m):
                    continue  # a padding mode other than zeros: left as it is
                ch.add(bind_module_forward(m, recipe, frame_forward if frame2d else conv_forward))
            elif row.avg_down and matches_class(m, (row.avg_down,)):
                ch.add(bind_module_forward(m, recipe, avg_forward))
            elif opts.fused_norm and matches_class(m, (row.norm,)):
                ch.add(bind_module_forward(m, recipe, norm_forward))
        for pad in _resample_pads(root, row):
            ch.add(bind_module_forward(pad, recipe, pad_forward))
        if opts.fused_norm:
            # Each of these SiLUs receives the fresh output of a norm: in place is safe there.
            for act in _block_activations(root, row):
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

            loops = (
                ("_decode", _decode),
                ("_encode", _encode),
                ("tiled_decode", tiled_decode),
                ("tiled_encode", tiled_encode),
            )
            for name, fn in loops:
                ch.add(set_instance_attr(root, recipe, name, types.MethodType(fn, root)))
    return ch.patch(description=f"{recipe}: restore {class_path(type(root))}")


# ----------------------------------------------------------------------------------------- causal treatment


def find_targets(root: torch.nn.Module, prefix: str, rows: tuple[VaeFamily, ...]) -> Iterator[Match]:
    """Per row: each whole VAE under ``root`` (one match, one report row); or, when ``root`` holds the
    row's causal convolutions but no VAE (a bare encoder or decoder), ``root`` itself as a module-tree match."""
    for row in rows:
        found = False
        for name, mod in root.named_modules():
            if matches_class(mod, (row.vae,)):
                found = True
                yield Match(mod, join_path(prefix, name), VaeTarget(row.name, whole_vae=True))
        if not found and any(matches_class(m, (row.conv,)) for m in root.modules()):
            yield Match(root, prefix or "<root>", VaeTarget(row.name, whole_vae=False))


def _single_frame_reason(env: Env) -> str:
    """What the single-frame 2-D path buys on this MPS build: speed before conv3d reached Metal, else memory."""
    conv3d = check("conv3d_metal", env)
    if not conv3d.ok:
        # issue pytorch#192213: conv3d at 7% of matmul throughput on 2.12 (MPSGraph).
        return (
            "single frames as 2-D convolutions: a third of the FLOPs, and conv3d is slow on this build "
            f"({conv3d.reason})"
        )
    return (
        "single frames as 2-D convolutions: conv3d runs on Metal kernels here (pytorch#188802, #192229), so this "
        "buys memory (no 5-D activations or cached frames) and a graph with no F.pad, not speed"
    )


def _backing(row: VaeFamily, opts: VaeOptions) -> str:
    if row.conv_kind == "frame2d":
        # Its convolutions are 2-D already: the fold is the whole change (single_frame_2d has nothing to do).
        backing = "conv2d padding fold"
    elif row.images and opts.single_frame_2d:
        backing = "conv padding fold, 2-D conv for single frame"
    else:
        backing = "conv padding fold"
    extras = []
    if opts.channels_last:
        extras.append("channels-last")
    if opts.fused_norm:
        extras.append("fused RMS norm")
    return backing + (" + " + ", ".join(extras) if extras else "")


def decide(recipe: str, match: Match, env: Env, options: VaePadOptions) -> Decision:
    """The causal treatment's decision: always applicable (lossless), with the reason for this
    environment and a :class:`CausalPlan` (the options resolved once, for ``apply``)."""
    row = family(match.data.family)
    opts = parse_options(recipe, options, env.device_type)
    strided = check("conv_strided_batch_correct", env)
    if not strided.ok:
        opts = replace(opts, dense_inputs=True)
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
        mps = env.device_type == "mps"
        why = "F.pad is native and correct on this build (pytorch#195368, #194922); " if mps else ""
        reason = f"for speed: {why}folding saves one copy of the activation per causal convolution"
        if opts.channels_last:
            reason += "; activations stay channels-last (cuDNN's native layout)"
    if opts.memory_watch is not None and opts.tile_loop:
        reason += (
            f"; the tile loop {opts.memory_watch.describe()} (torch.mps.driver_allocated_memory against "
            "recommended_max_memory, then empty_cache), before a unified-memory Mac swaps"
        )
    if env.device_type == "mps":
        if row.conv_kind == "causal3d" and row.images and opts.single_frame_2d:
            reason = f"{reason}; {_single_frame_reason(env)}"
        if row.rank5_note and not rank5.ok:
            reason = f"{reason}; {row.rank5_note}"
    if opts.dense_inputs:
        reason += (
            "; a strided input (a frame slice) is copied before its convolution, as diffusers' F.pad did: "
            "convolutions of such views are wrong past the first batch element on MPS (issue pytorch#169342, open)"
        )
    plan = CausalPlan(row.name, opts, count_modules(match.module, row), match.data.whole_vae)
    return Decision.apply(_backing(row, opts), reason, plan=plan)


def apply(recipe: str, match: Match, decision: Decision) -> Patch:
    """The causal treatment on ``match.module`` as ``decision.plan`` says; a whole VAE gets the tile loop
    with diffusers' (un)patchify and ``DecoderOutput`` (imported here, when it applies)."""
    plan: CausalPlan = decision.plan
    row = family(plan.family)
    spec = out_cls = None
    if plan.whole_vae:
        from diffusers.models.autoencoders.vae import DecoderOutput

        mod = importlib.import_module(row.module)
        pf, upf = (getattr(mod, n, None) for n in row.patch_fns)
        spec = loop_spec(match.module, row, patchify=pf, unpatchify=upf)
        out_cls = DecoderOutput
    return patch_tree(match.module, row, plan.options, recipe, spec=spec, decoder_output=out_cls)


def find_vaes(root: torch.nn.Module, prefix: str, rows: tuple[VaeFamily, ...]) -> Iterator[Match]:
    """Each module under ``root`` whose class is the VAE of one of ``rows`` (the first such row)."""
    for name, mod in root.named_modules():
        for row in rows:
            if matches_class(mod, (row.vae,)):
                yield Match(mod, join_path(prefix, name), VaeTarget(row.name, whole_vae=True))
                break


# ----------------------------------------------------------------------------------------- pad treatment


def _cosmos_foldable(m: torch.nn.Module) -> bool:
    return getattr(m, "pad_mode", None) == "constant" and p5.symmetric_spatial(m.spatial_pad) is not None


def _vidtok_foldable(m: torch.nn.Module) -> bool:
    conv = getattr(m, "conv", None)
    return (
        getattr(m, "pad_mode", None) == "constant"
        and p5.symmetric_spatial(m.spatial_padding) is not None
        and isinstance(conv, torch.nn.Conv3d)
        and conv.padding == (0, 0, 0)
    )


def _pad_then_conv_fits(m: torch.nn.Module) -> bool:
    return isinstance(getattr(m, "conv", None), torch.nn.Conv3d) and len(m.time_causal_padding) == 6


@dataclass(frozen=True)
class PadTreatment:
    """How one kind of pad site loses its pad: when it fits a module, the forward bound on it, and the
    report count it adds to ("folded", "written_out" or "routed")."""

    fits: Callable[[torch.nn.Module], bool]
    forward: Callable[..., Any] | None  # None: the module's own forward, run under Pad5dMode
    counts_as: str


#: Every ``PadSite.how`` (and "conv_mode", the rule for ``nn.Conv3d`` with a padding mode), by name.
PAD_TREATMENTS: dict[str, PadTreatment] = {
    "fold_cosmos": PadTreatment(_cosmos_foldable, p5.cosmos_causal_conv3d, "folded"),
    "fold_vidtok": PadTreatment(_vidtok_foldable, p5.vidtok_causal_conv3d, "folded"),
    "pad_then_conv": PadTreatment(_pad_then_conv_fits, p5.pad_then_conv, "written_out"),
    "conv_mode": PadTreatment(
        lambda m: type(m).forward is torch.nn.Conv3d.forward, p5.conv3d_padding_mode, "written_out"
    ),
    "route": PadTreatment(lambda m: True, None, "routed"),
}
# A site whose own treatment does not fit a module (another pad mode, asymmetric padding) is routed:
# its pads still become slice copies, through the module's own forward.
_PRECEDENCE = ("fold_cosmos", "fold_vidtok", "pad_then_conv")


def pad_site(m: torch.nn.Module, row: VaeFamily) -> str | None:
    """The key of :data:`PAD_TREATMENTS` for module ``m`` of a VAE of ``row``, or None (left as it is)."""
    sites = [s for s in row.pads if matches_class(m, (s.cls,))]
    if sites:
        for how in _PRECEDENCE:
            if any(s.how == how for s in sites) and PAD_TREATMENTS[how].fits(m):
                return how
        return "route"
    if isinstance(m, torch.nn.Conv3d) and m.padding_mode != "zeros":
        # nn.Conv3d pads through F.pad for these modes; a subclass with its own forward is routed.
        return "conv_mode" if PAD_TREATMENTS["conv_mode"].fits(m) else "route"
    return None


def count_pads(root: torch.nn.Module, row: VaeFamily) -> PadPlan:
    """How many modules of ``root`` lose their pad, by kind (folded, written out, routed)."""
    out = {"folded": 0, "written_out": 0, "routed": 0}
    for m in root.modules():
        how = pad_site(m, row)
        if how:
            out[PAD_TREATMENTS[how].counts_as] += 1
    return PadPlan(row.name, **out)


def _gate_reasons(env: Env) -> list[str]:
    """The failing verdicts among the pad features (``pad3d_all_modes_correct`` where the gate has it)."""
    names = ["pad_constant_native", "pad_rank5_correct"]
    if "pad3d_all_modes_correct" in FEATURES:
        names.append("pad3d_all_modes_correct")
    return [v.reason for v in (check(n, env) for n in names) if not v.ok]


def decide_pads(match: Match, env: Env, force: bool) -> Decision:
    """The pad treatment's decision: on MPS builds with a faulty 5-D pad (or ``force``), with a :class:`PadPlan`."""
    plan = count_pads(match.module, family(match.data.family))
    if plan.total == 0:
        return Decision.skip("no module of this VAE pads a 5-D tensor", plan=plan)
    backing = "conv padding fold + pad as slice copies" if plan.folded else "pad as slice copies"
    if force:
        return Decision.apply(backing, "forced by options (force=True)", plan=plan)
    if env.device_type != "mps":
        return Decision.skip(f"pads of 5-D tensors are native and correct on {env.device_type}; stock kept", plan=plan)
    bad = _gate_reasons(env)
    if not bad:
        return Decision.skip(
            "stock pads of 5-D tensors are native and correct on this build (pytorch#195368, #194944, #195147); "
            "stock kept",
            plan=plan,
        )
    reason = (
        "avoids pytorch#195368 (MPSGraph pad: driver memory outside the allocator) and issue pytorch#194922 / "
        f"#195147 (wrong constant, reflection and replication pads of rank-5 tensors) on this build: {'; '.join(bad)}"
    )
    return Decision.apply(backing, reason, plan=plan)


def patch_pads(recipe: str, match: Match, decision: Decision) -> Patch:
    """The pad treatment on the VAE of ``match``: every module with a pad site gets its forward."""
    row = family(decision.plan.family)

    def routed(self_: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        with p5.Pad5dMode():
            return call_original(self_, recipe, *args, **kwargs)

    with Changes() as ch:
        # A mark on the VAE itself: patch() sees it patched (a second call is a no-op).
        ch.add(set_instance_attr(match.module, recipe, "_mpsboost_pad5d", True))
        for m in match.module.modules():
            how = pad_site(m, row)
            if how:
                fwd = PAD_TREATMENTS[how].forward
                ch.add(bind_forward(m, recipe, routed if fwd is None else fwd))
    return ch.patch(description=f"{recipe}: restore forwards")


class CausalVaeRecipe(Recipe):
    """The recipes of Wan-design VAEs (``wan_vae_pad``, ``qwen_image_vae``): a subclass is its declaration
    (``name``, ``summary``, ``targets``, ``ROWS``); finding, deciding and applying are this module's,
    steered by the rows. Not registered itself."""

    ROWS: tuple[VaeFamily, ...] = ()
    Options = VaePadOptions

    def find(self, root: torch.nn.Module, prefix: str = "") -> Iterator[Match]:
        return find_targets(root, prefix, self.ROWS)

    def decide(self, match: Match, env: Env, options: VaePadOptions) -> Decision:
        return decide(self.name, match, env, options)

    def apply(self, match: Match, decision: Decision, env: Env, options: VaePadOptions) -> Patch:
        return apply(self.name, match, decision)
