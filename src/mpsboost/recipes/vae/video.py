"""Recipe ``video_vae_pad``: diffusers' other video VAEs without a pad kernel on 5-D tensors.

Before torch 2.15 a pad of a rank-5 tensor on MPS went through MPSGraph: driver memory beyond the
allocator (pytorch#195368), wrong constant time padding once H*W >= 65536 (issue pytorch#194922), and
the same fault in reflection / replication ``pad3d`` (fixed by pytorch#195147). Wan and Qwen-Image
have their own recipes; this one covers every other video VAE of diffusers 0.42.1 that pads 5-D
tensors, one row each in :data:`~mpsboost.recipes.vae.families.FAMILIES` (pads per encode + decode of
a tiny config, counted at the aten level):

=========================  ===================================================
HunyuanVideo               42 replication_pad3d (causal conv)
HunyuanVideo 1.5           50 replication_pad3d (causal conv)
HunyuanImage refiner       50 replication_pad3d (causal conv)
Mochi                      23 replication_pad3d (CogVideoX causal conv)
CogVideoX                  3 constant_pad_nd (downsampling)
Cosmos                     109 constant_pad_nd, 2 reflection_pad3d (wavelet patcher)
EasyAnimate (Magvit)       38 replication_pad3d, 9 constant_pad_nd
KVAE video                 34 replication_pad3d, 4 reflection_pad3d
LTX-2 video                13 reflection_pad3d (reflect-mode Conv3d of the decoder)
VidTok                     24 constant_pad_nd, 2 replication_pad3d
MiniMax-H3                 72 constant_pad_nd, 72 reflection_pad3d
=========================  ===================================================

(Allegro, LTX-Video and the SVD temporal decoder pad no 5-D tensor; they are not targets.)

Zero spatial pads in front of a module's own convolution (Cosmos' and VidTok's causal convolutions)
are folded into the convolution's ``padding``; every other 5-D pad runs as
:func:`mpsboost.ops.pad5d.pad5d` (one buffer, slice copies: bit-exact): written into the forward
for HunyuanVideo's causal convolutions and for ``nn.Conv3d`` with a reflect / replicate
``padding_mode`` (LTX-2), routed there by a ``TorchFunctionMode`` entered inside each patched
module's forward for the other modules. Which module gets which is its row's ``pads``
(:class:`~mpsboost.recipes.vae.families.PadSite`), carried out by
:data:`~mpsboost.recipes.vae.common.PAD_TREATMENTS`.

Gated: on MPS before 2.15 it applies; from 2.15 on (and on CUDA and CPU) the stock pads are native
and correct, and the recipe steps aside with that reason. ``options={"video_vae_pad": {"force":
True}}`` applies it anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from ...gate import Env
from ...patching import Patch
from ...registry import Decision, Match, Recipe, register
from . import common
from .families import rows_for

NAME = "video_vae_pad"
#: Its rows of the family table (the pad treatment), in the order of the table above.
ROWS = rows_for(NAME)
#: The VAEs (one report row each).
VAES = tuple(row.vae for row in ROWS)


@dataclass(frozen=True)
class VideoVaePadOptions:
    """``options={"video_vae_pad": {...}}``: ``force`` applies it on any env."""

    force: bool = False


@register
class VideoVaePad(Recipe):
    name = NAME
    summary = "diffusers video VAEs (HunyuanVideo, Mochi, CogVideoX, Cosmos, LTX-2, ...): no pad kernel on 5-D tensors"
    targets = VAES
    lossless = True
    reversible = True
    requires = ()
    default = True
    order = 100
    Options = VideoVaePadOptions

    def find(self, root: torch.nn.Module, prefix: str = "") -> Iterator[Match]:
        return common.find_vaes(root, prefix, ROWS)

    def decide(self, match: Match, env: Env, options: VideoVaePadOptions) -> Decision:
        return common.decide_pads(match, env, options.force)

    def apply(self, match: Match, decision: Decision, env: Env, options: VideoVaePadOptions) -> Patch:
        return common.patch_pads(self.name, match, decision)
