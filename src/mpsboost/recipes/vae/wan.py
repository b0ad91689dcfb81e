"""Recipe ``wan_vae_pad``: the Wan2.1 / Wan2.2 VAE without a single ``F.pad`` call.

On MPS before torch 2.15 every ``F.pad`` in front of the VAE's causal 3-D convolutions built an
MPSGraph: a Wan2.2-TI2V-5B tiled decode (28 tiles, 8,764 pad calls) held 270 GiB of driver memory
(pytorch#195368), and constant time padding of rank-5 tensors with H*W >= 65536 came back wrong
(issue pytorch#194922). This recipe folds the spatial padding into each convolution, writes the
causal time padding as cached frames or a zero slab, replaces ``AvgDown3D``'s time pad and the
``ZeroPad2d((0, 1, 0, 1))`` of the downsampling blocks: zero pad calls in encode and decode, tiled or
not. On later builds and other devices it is kept for speed (one copy less per convolution, a
tile loop that blends as it goes; on CUDA also channels-last activations and a fused RMS norm).
"""
from __future__ import annotations

from typing import Iterator

import torch

from ...gate import Env
from . import common as vae_patch
from ...registry import Decision, Match, Recipe, register
from ...patching import Patch

CLASSES = vae_patch.WAN


@register
class WanVaePad(Recipe):
    name = "wan_vae_pad"
    summary = "Wan VAE: spatial padding folded into each causal Conv3d, time padding as cache or zero slab; no F.pad"
    targets = (CLASSES.vae, CLASSES.conv, CLASSES.avg_down)
    lossless = True
    reversible = True
    requires = ()
    default = True
    order = 100
    Options = vae_patch.VaePadOptions

    def find(self, root: torch.nn.Module, prefix: str = "") -> Iterator[Match]:
        return vae_patch.find_targets(root, prefix, CLASSES)

    def decide(self, match: Match, env: Env, options: vae_patch.VaePadOptions) -> Decision:
        return vae_patch.decide(self.name, CLASSES, match, env, options, "conv padding fold")

    def apply(self, match: Match, decision: Decision, env: Env, options: vae_patch.VaePadOptions) -> Patch:
        opts = vae_patch.parse_options(self.name, options, env.device_type)
        spec = out_cls = None
        if match.data.get("vae"):
            import diffusers.models.autoencoders.autoencoder_kl_wan as wan
            from diffusers.models.autoencoders.vae import DecoderOutput

            spec = vae_patch.loop_spec(match.module, CLASSES, patchify=wan.patchify, unpatchify=wan.unpatchify)
            out_cls = DecoderOutput
        return vae_patch.patch_tree(match.module, CLASSES, opts, self.name, spec=spec, decoder_output=out_cls)
