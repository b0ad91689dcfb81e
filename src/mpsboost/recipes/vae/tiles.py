"""The frame and tile loops of the Wan / Qwen-Image VAEs, rewritten to compute the same values.

diffusers' loops (``_encode``, ``_decode``, ``tiled_encode``, ``tiled_decode`` of
``AutoencoderKLWan`` and ``AutoencoderKLQwenImage``) are reproduced step for step, with four
changes that leave every value as it was:

* the causal cache is a local list per call (as in diffusers, one per tile) instead of VAE state;
* a single latent frame (an image) runs without the cache: with one frame the cached and uncached
  paths compute the same thing, and the uncached one copies no activation into the cache;
* decoded frames are gathered in a list and concatenated once, not re-concatenated per frame;
* tiles are blended as soon as they are decoded, with vectorised blend weights that round exactly
  like diffusers' per-row loop, and cropped at once; only the crops and the edge strips the next
  tiles blend with are kept, not every tile of the image, and no full-size buffer is held while
  tiles are being computed.

``watcher`` (a :class:`MemoryWatcher`) checks the driver-level allocation after every tile and
frees the allocator's cached blocks when it passes a share of the device's recommended maximum: on a
unified-memory Mac the cache of a long tiled decode otherwise grows until the system swaps.

``side`` (an :class:`~mpsboost.ops.streams.SideStream`) moves the blending and the copy into the
assembly to a side stream: tile i+1 computes while tile i is blended and cropped.

Nothing here imports diffusers: the VAE's attributes and a :class:`VaeLoopSpec` describe it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ...ops.streams import SideStream

__all__ = [
    "MEMORY_THRESHOLD",
    "VaeLoopSpec",
    "MemoryWatcher",
    "blend_",
    "decode_latents",
    "encode_frames",
    "decode",
    "encode",
    "tiled_decode",
    "tiled_encode",
]


#: Default share of ``torch.mps.recommended_max_memory()`` at which :class:`MemoryWatcher` frees the cache.
MEMORY_THRESHOLD = 0.85


@dataclass(frozen=True)
class VaeLoopSpec:
    """What differs between the Wan and the Qwen-Image loops (read from diffusers 0.42.1)."""

    family: str  # the family's row name ("wan", "qwen", ...), for messages
    first_chunk: bool  # the decoder takes first_chunk= (Wan)
    clamp_tiled: bool  # tiled_decode clamps to [-1, 1] (Wan does; Qwen-Image's does not)
    enc_convs: int  # causal convolutions in the encoder / decoder (length of the cache lists)
    dec_convs: int
    patchify: Callable[[torch.Tensor, int], torch.Tensor] | None = None  # Wan2.2 (patch_size 2)
    unpatchify: Callable[[torch.Tensor, int], torch.Tensor] | None = None


class MemoryWatcher:
    """Frees cached device memory between tiles before a unified-memory Mac starts swapping.

    After each tile, ``driver_allocated()`` (default ``torch.mps.driver_allocated_memory``: the
    allocator's caches plus MPS / MPSGraph allocations) is compared with ``threshold`` times
    ``recommended_max()`` (default ``torch.mps.recommended_max_memory``); at or above it,
    ``empty_cache()`` (default ``torch.mps.empty_cache``) returns the cached blocks to the system.
    The functions are injectable (tests, other back-ends). With the defaults it acts on MPS tensors
    only; elsewhere :meth:`step` does nothing.

    ``checks`` counts the tiles it looked after; ``frees`` lists ``(tile, bytes before, bytes after)``
    for each time it freed.
    """

    def __init__(
        self,
        threshold: float = MEMORY_THRESHOLD,
        *,
        driver_allocated: Callable[[], int] | None = None,
        recommended_max: Callable[[], int] | None = None,
        empty_cache: Callable[[], None] | None = None,
    ) -> None:
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0.0 < float(threshold) <= 1.0:
            raise ValueError(f"memory threshold must be a fraction in (0, 1], got {threshold!r}")
        self.threshold = float(threshold)
        self._injected = any(f is not None for f in (driver_allocated, recommended_max, empty_cache))
        self._allocated = driver_allocated
        self._max = recommended_max
        self._empty = empty_cache
        self.checks = 0
        self.frees: list[tuple[int, int, int]] = []

    def _fns(self) -> tuple[Callable[[], int], Callable[[], int], Callable[[], None]]:
        mps = torch.mps
        return (
            self._allocated or mps.driver_allocated_memory,
            self._max or mps.recommended_max_memory,
            self._empty or mps.empty_cache,
        )

    def applies_to(self, device: torch.device) -> bool:
        return self._injected or device.type == "mps"

    def step(self, device: torch.device) -> bool:
        """Check once (after a tile); True when it freed the cache."""
        if not self.applies_to(device):
            return False
        allocated, recommended, empty = self._fns()
        self.checks += 1
        before = int(allocated())
        limit = int(recommended())
        if limit <= 0 or before < self.threshold * limit:
            return False
        empty()
        after = int(allocated())
        self.frees.append((self.checks, before, after))
        import logging

        logging.getLogger("mpsboost").info(
            "tiled VAE loop: driver memory %.2f GiB >= %.0f%% of the recommended %.2f GiB; "
            "freed cached blocks (now %.2f GiB)",
            before / 2**30,
            100 * self.threshold,
            limit / 2**30,
            after / 2**30,
        )
        return True

    def describe(self) -> str:
        return f"frees cached blocks between tiles at {100 * self.threshold:.0f}% of the recommended maximum"


def _patch_size(vae: Any, spec: VaeLoopSpec) -> int | None:
    return getattr(vae.config, "patch_size", None) if spec.patchify is not None else None


# ----------------------------------------------------------------------------------------- blend


def _opmath(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


_WEIGHTS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _blend_weights(
    e: int, dtype: torch.dtype, device: torch.device, trailing: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The blend weights ``1 - y/e`` and ``y/e`` (y < e) as Python computes them, cast to ``dtype``,
    on ``device``, shaped to broadcast over ``trailing`` axes. Cached: a host-to-device copy of
    pageable memory synchronises the stream, which must not happen once per tile."""
    key = (e, dtype, device.type, device.index, trailing)
    hit = _WEIGHTS.get(key)
    if hit is None:
        shape = [e] + [1] * trailing
        w_a = torch.tensor([1 - y / e for y in range(e)], dtype=torch.float64).to(dtype).reshape(shape)
        w_b = torch.tensor([y / e for y in range(e)], dtype=torch.float64).to(dtype).reshape(shape)
        hit = (w_a.to(device), w_b.to(device))
        if len(_WEIGHTS) > 256:  # tile sizes are few; keep the cache from growing without bound
            _WEIGHTS.clear()
        _WEIGHTS[key] = hit
    return hit


def blend_(a: torch.Tensor, b: torch.Tensor, extent: int, dim: int) -> None:
    """diffusers' ``blend_v`` (``dim=-2``) / ``blend_h`` (``dim=-1``), in place on ``b``, vectorised.

    ``a`` may be only the trailing strip of the neighbour tile (at least ``extent`` long, or all of
    it). diffusers multiplies each row by a Python float, which the kernel applies in the opmath
    type (fp32 for fp32/bf16/fp16) before rounding to the tensor's dtype; the weights here are the
    same floats as an fp32 tensor, and each product is rounded to ``b``'s dtype before the sum, so
    the result is bit-identical.
    """
    e = min(a.shape[dim], b.shape[dim], extent)
    if e <= 0:
        return
    w_a, w_b = _blend_weights(e, _opmath(b.dtype), b.device, -dim - 1)
    a_part = a.narrow(dim, a.shape[dim] - e, e)
    b_part = b.narrow(dim, 0, e)
    mixed = (a_part * w_a).to(b.dtype) + (b_part * w_b).to(b.dtype)
    b_part.copy_(mixed)


# ----------------------------------------------------------------------------------------- frames


def decode_latents(vae: Any, x: torch.Tensor, spec: VaeLoopSpec, *, post_quant_per_frame: bool) -> torch.Tensor:
    """Decode every latent frame of ``x`` with a fresh causal cache; frames concatenated on dim 2.

    ``post_quant_per_frame``: apply ``post_quant_conv`` to each frame slice (as ``tiled_decode``
    does) or to all frames at once before the loop (as ``_decode`` does).
    """
    frames = x.shape[2]
    if not post_quant_per_frame:
        x = vae.post_quant_conv(x)
    if frames == 1:
        # One frame: the cache would only be filled, never read. Same values, no cache copies.
        if post_quant_per_frame:
            x = vae.post_quant_conv(x)
        kw = {"first_chunk": True} if spec.first_chunk else {}
        return vae.decoder(x, **kw)
    cache: list = [None] * spec.dec_convs
    out = []
    for k in range(frames):
        xk = x[:, :, k : k + 1]
        if post_quant_per_frame:
            xk = vae.post_quant_conv(xk)
        kw = {"first_chunk": k == 0} if spec.first_chunk else {}
        out.append(vae.decoder(xk, feat_cache=cache, feat_idx=[0], **kw))
    return out[0] if len(out) == 1 else torch.cat(out, dim=2)


def encode_frames(vae: Any, x: torch.Tensor, spec: VaeLoopSpec, *, quant_per_chunk: bool) -> torch.Tensor:
    """Encode ``x`` in diffusers' chunks (1 frame, then 4 at a time) with a fresh causal cache.

    ``quant_per_chunk``: apply ``quant_conv`` per chunk (``tiled_encode``) or once at the end
    (``_encode``).
    """
    frames = x.shape[2]
    chunks = 1 + (frames - 1) // 4
    if chunks == 1:
        out = vae.encoder(x[:, :, :1])
        return vae.quant_conv(out)
    cache: list = [None] * spec.enc_convs
    parts = []
    for i in range(chunks):
        chunk = x[:, :, :1] if i == 0 else x[:, :, 1 + 4 * (i - 1) : 1 + 4 * i]
        y = vae.encoder(chunk, feat_cache=cache, feat_idx=[0])
        parts.append(vae.quant_conv(y) if quant_per_chunk else y)
    out = torch.cat(parts, dim=2)
    return out if quant_per_chunk else vae.quant_conv(out)


# ----------------------------------------------------------------------------------------- untiled


def decode(vae: Any, z: torch.Tensor, spec: VaeLoopSpec) -> torch.Tensor:
    """``vae._decode(z)``'s sample (tiled when diffusers would tile)."""
    _, _, _, height, width = z.shape
    scr = vae.spatial_compression_ratio
    if vae.use_tiling and (width > vae.tile_sample_min_width // scr or height > vae.tile_sample_min_height // scr):
        # Through the instance, so that a side-stream tile loop set there is used.
        return vae.tiled_decode(z, return_dict=False)[0]
    out = decode_latents(vae, z, spec, post_quant_per_frame=False)
    p = _patch_size(vae, spec)
    if p is not None:
        out = spec.unpatchify(out, patch_size=p)
    # A fresh tensor either way (decoder output, concatenation, or unpatchify's copy): clamp in place.
    out = out.clamp_(-1.0, 1.0) if not torch.is_grad_enabled() else torch.clamp(out, -1.0, 1.0)
    # diffusers returns the contiguous layout; a channels-last decoder output is converted once here.
    return out.contiguous()


def encode(vae: Any, x: torch.Tensor, spec: VaeLoopSpec) -> torch.Tensor:
    """``vae._encode(x)`` (tiled when diffusers would tile)."""
    _, _, _, height, width = x.shape
    p = _patch_size(vae, spec)
    tiled = vae.use_tiling and (width > vae.tile_sample_min_width or height > vae.tile_sample_min_height)
    if p is not None:
        # Wan decides on the pixel size, then tiles the patchified input.
        x = spec.patchify(x, patch_size=p)
    if tiled:
        return vae.tiled_encode(x)
    return encode_frames(vae, x, spec, quant_per_chunk=False).contiguous()


# ----------------------------------------------------------------------------------------- tiles


def _place(
    tile: torch.Tensor,
    crops: list[torch.Tensor],
    above: torch.Tensor | None,
    left: torch.Tensor | None,
    rows_left: int,
    cols_left: int,
    crop_h: int,
    crop_w: int,
    blend_h: int,
    blend_w: int,
    keep_bottom: bool,
    keep_right: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Blend ``tile`` with its finished neighbours, append its crop to ``crops``, return its strips.

    ``rows_left`` / ``cols_left``: output rows / columns not yet covered, so that the crop never
    reaches past the output (diffusers crops the concatenation at the end instead; same values).
    """
    if above is not None:
        blend_(above, tile, blend_h, dim=-2)
    if left is not None:
        blend_(left, tile, blend_w, dim=-1)
    hh = max(0, min(crop_h, tile.shape[-2], rows_left))
    ww = max(0, min(crop_w, tile.shape[-1], cols_left))
    if hh > 0 and ww > 0:
        # A copy, not a view: the tile's memory is released as soon as its strips are taken.
        crops.append(tile[..., :hh, :ww].contiguous())
    bottom = tile[..., -blend_h:, :].clone() if keep_bottom and blend_h > 0 else None
    right = tile[..., :, -blend_w:].clone() if keep_right and blend_w > 0 else None
    return bottom, right


def _tile_grid(
    vae: Any,
    src: torch.Tensor,
    *,
    tile_h: int,
    tile_w: int,
    step_h: int,
    step_w: int,
    crop_h: int,
    crop_w: int,
    blend_h: int,
    blend_w: int,
    out_h: int,
    out_w: int,
    run_tile: Callable[[torch.Tensor], torch.Tensor],
    side: SideStream | None,
    watcher: MemoryWatcher | None = None,
) -> torch.Tensor:
    """Run ``run_tile`` over the tile grid of ``src``; blend, crop and assemble as diffusers does.

    The output is assembled row by row (each finished row concatenated once, the rows at the end),
    so that no full-size buffer is held while tiles are still being computed.
    """
    height, width = src.shape[-2], src.shape[-1]
    rows = list(range(0, height, step_h))
    cols = list(range(0, width, step_w))
    done_rows: list[torch.Tensor] = []
    y_done = 0
    above: list[torch.Tensor | None] = [None] * len(cols)
    for ri, i in enumerate(rows):
        left: torch.Tensor | None = None
        below: list[torch.Tensor | None] = [None] * len(cols)
        crops: list[torch.Tensor] = []
        for cj, j in enumerate(cols):
            tile = run_tile(src[..., i : i + tile_h, j : j + tile_w])
            # Offsets are the sizes of the crops before this one, as in diffusers' concatenation.
            x_done = sum(c.shape[-1] for c in crops)
            args = (
                tile,
                crops,
                above[cj],
                left,
                out_h - y_done,
                out_w - x_done,
                crop_h,
                crop_w,
                blend_h,
                blend_w,
                ri + 1 < len(rows),
                cj + 1 < len(cols),
            )
            if side is None:
                below[cj], left = _place(*args)
            else:
                side.fork()
                with side:
                    below[cj], left = _place(*args)
                side.keep(tile)
            del tile, args
            if watcher is not None:
                watcher.step(src.device)
        if crops:
            if side is None:
                done_rows.append(torch.cat(crops, dim=-1))
            else:
                with side:
                    done_rows.append(torch.cat(crops, dim=-1))
            y_done += done_rows[-1].shape[-2]
        del crops
        above = below
    if side is not None:
        side.join()
    return done_rows[0] if len(done_rows) == 1 else torch.cat(done_rows, dim=-2)


def tiled_decode(
    vae: Any,
    z: torch.Tensor,
    spec: VaeLoopSpec,
    *,
    side: SideStream | None = None,
    watcher: MemoryWatcher | None = None,
) -> torch.Tensor:
    """``vae.tiled_decode(z)``'s sample."""
    _, _, _, height, width = z.shape
    scr = vae.spatial_compression_ratio
    sample_h, sample_w = height * scr, width * scr
    tile_h = vae.tile_sample_min_height // scr
    tile_w = vae.tile_sample_min_width // scr
    step_h = vae.tile_sample_stride_height // scr
    step_w = vae.tile_sample_stride_width // scr
    crop_h, crop_w = vae.tile_sample_stride_height, vae.tile_sample_stride_width
    p = _patch_size(vae, spec)
    if p is not None:
        sample_h, sample_w = sample_h // p, sample_w // p
        crop_h, crop_w = crop_h // p, crop_w // p
        blend_h = vae.tile_sample_min_height // p - crop_h
        blend_w = vae.tile_sample_min_width // p - crop_w
    else:
        blend_h = vae.tile_sample_min_height - crop_h
        blend_w = vae.tile_sample_min_width - crop_w

    def run_tile(t: torch.Tensor) -> torch.Tensor:
        return decode_latents(vae, t, spec, post_quant_per_frame=True)

    dec = _tile_grid(
        vae,
        z,
        tile_h=tile_h,
        tile_w=tile_w,
        step_h=step_h,
        step_w=step_w,
        crop_h=crop_h,
        crop_w=crop_w,
        blend_h=blend_h,
        blend_w=blend_w,
        out_h=sample_h,
        out_w=sample_w,
        run_tile=run_tile,
        side=side,
        watcher=watcher,
    )
    if spec.clamp_tiled:
        # Clamping commutes with unpatchify's permutation; doing it first, in place, saves a buffer.
        dec = dec.clamp_(-1.0, 1.0) if not torch.is_grad_enabled() else torch.clamp(dec, -1.0, 1.0)
    if p is not None:
        dec = spec.unpatchify(dec, patch_size=p)
    return dec


def tiled_encode(
    vae: Any,
    x: torch.Tensor,
    spec: VaeLoopSpec,
    *,
    side: SideStream | None = None,
    watcher: MemoryWatcher | None = None,
) -> torch.Tensor:
    """``vae.tiled_encode(x)`` (``x`` already patchified where the VAE patchifies)."""
    _, _, _, height, width = x.shape
    ratio = vae.spatial_compression_ratio
    p = _patch_size(vae, spec)
    if p is not None:
        ratio = ratio // p
    latent_h, latent_w = height // ratio, width // ratio
    t_min_h = vae.tile_sample_min_height // ratio
    t_min_w = vae.tile_sample_min_width // ratio
    t_step_h = vae.tile_sample_stride_height // ratio
    t_step_w = vae.tile_sample_stride_width // ratio

    def run_tile(t: torch.Tensor) -> torch.Tensor:
        return encode_frames(vae, t, spec, quant_per_chunk=True)

    return _tile_grid(
        vae,
        x,
        tile_h=vae.tile_sample_min_height,
        tile_w=vae.tile_sample_min_width,
        step_h=vae.tile_sample_stride_height,
        step_w=vae.tile_sample_stride_width,
        crop_h=t_step_h,
        crop_w=t_step_w,
        blend_h=t_min_h - t_step_h,
        blend_w=t_min_w - t_step_w,
        out_h=latent_h,
        out_w=latent_w,
        run_tile=run_tile,
        side=side,
        watcher=watcher,
    )
