"""Recipe ``video_vae_pad``: diffusers' other video VAEs without a pad kernel on 5-D tensors.

Before torch 2.15 a pad of a rank-5 tensor on MPS went through MPSGraph: driver memory beyond the
allocator (pytorch#195368), wrong constant time padding once H*W >= 65536 (issue pytorch#194922), and
the same fault in reflection / replication ``pad3d`` (fixed by pytorch#195147). Wan and Qwen-Image
have their own recipes; this one covers every other video VAE of diffusers 0.42.1 that pads 5-D
tensors (pads per encode + decode of a tiny config, counted at the aten level):

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
module's forward for the other modules.

Gated: on MPS before 2.15 it applies; from 2.15 on (and on CUDA and CPU) the stock pads are native
and correct, and the recipe steps aside with that reason. ``options={"video_vae_pad": {"force":
True}}`` applies it anywhere.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch

from ...gate import FEATURES, Env, check
from ...ops import pad5d as p5
from ...registry import Decision, Match, Recipe, join_path, matches_class, register
from ...patching import Changes, Patch, bind_forward, call_original, set_instance_attr

_AE = "diffusers.models.autoencoders"

#: The VAEs (one report row each).
VAES = (
    f"{_AE}.autoencoder_kl_hunyuan_video.AutoencoderKLHunyuanVideo",
    f"{_AE}.autoencoder_kl_hunyuanvideo15.AutoencoderKLHunyuanVideo15",
    f"{_AE}.autoencoder_kl_hunyuanimage_refiner.AutoencoderKLHunyuanImageRefiner",
    f"{_AE}.autoencoder_kl_mochi.AutoencoderKLMochi",
    f"{_AE}.autoencoder_kl_cogvideox.AutoencoderKLCogVideoX",
    f"{_AE}.autoencoder_kl_cosmos.AutoencoderKLCosmos",
    f"{_AE}.autoencoder_kl_magvit.AutoencoderKLMagvit",
    f"{_AE}.autoencoder_kl_kvae_video.AutoencoderKLKVAEVideo",
    f"{_AE}.autoencoder_kl_ltx2.AutoencoderKLLTX2Video",
    f"{_AE}.autoencoder_vidtok.AutoencoderVidTok",
    f"{_AE}.autoencoder_kl_minimax_h3.AutoencoderKLMiniMaxH3",
)

#: Modules whose forward pads a 5-D tensor (found by tracing each VAE's pads to their caller).
PADDERS = (
    f"{_AE}.autoencoder_kl_hunyuan_video.HunyuanVideoCausalConv3d",
    f"{_AE}.autoencoder_kl_hunyuanvideo15.HunyuanVideo15CausalConv3d",
    f"{_AE}.autoencoder_kl_hunyuanimage_refiner.HunyuanImageRefinerCausalConv3d",
    f"{_AE}.autoencoder_kl_cogvideox.CogVideoXCausalConv3d",
    "diffusers.models.downsampling.CogVideoXDownsample3D",
    f"{_AE}.autoencoder_kl_cosmos.CosmosCausalConv3d",
    f"{_AE}.autoencoder_kl_cosmos.CosmosDownsample3d",
    f"{_AE}.autoencoder_kl_cosmos.CosmosPatchEmbed3d",
    f"{_AE}.autoencoder_kl_magvit.EasyAnimateCausalConv3d",
    f"{_AE}.autoencoder_kl_magvit.EasyAnimateDownsampler3D",
    f"{_AE}.autoencoder_kl_kvae_video.KVAECachedCausalConv3d",
    f"{_AE}.autoencoder_vidtok.VidTokCausalConv3d",
    f"{_AE}.autoencoder_vidtok.VidTokDownsample3D",
    f"{_AE}.autoencoder_kl_minimax_h3.MiniMaxH3VideoCausalConv3d",
    f"{_AE}.autoencoder_kl_minimax_h3.MiniMaxH3VideoDownsample3d",
)
_COSMOS_CONV = f"{_AE}.autoencoder_kl_cosmos.CosmosCausalConv3d"
# F.pad(x, self.time_causal_padding, mode=self.pad_mode) then self.conv(x): written out with pad5d.
_PAD_THEN_CONV = (
    f"{_AE}.autoencoder_kl_hunyuan_video.HunyuanVideoCausalConv3d",
    f"{_AE}.autoencoder_kl_hunyuanvideo15.HunyuanVideo15CausalConv3d",
    f"{_AE}.autoencoder_kl_hunyuanimage_refiner.HunyuanImageRefinerCausalConv3d",
)
_VIDTOK_CONV = f"{_AE}.autoencoder_vidtok.VidTokCausalConv3d"
NAME = "video_vae_pad"


def _kind(m: torch.nn.Module) -> str | None:
    """How this module is patched: "fold_cosmos" / "fold_vidtok" (zero pad folded into the conv),
    "pad_conv" / "conv_mode" (explicit forward with pad5d), "route" (pads via Pad5dMode), or None."""
    if matches_class(m, (_COSMOS_CONV,)) and getattr(m, "pad_mode", None) == "constant" and p5.symmetric_spatial(m.spatial_pad):
        return "fold_cosmos"
    if (
        matches_class(m, (_VIDTOK_CONV,))
        and getattr(m, "pad_mode", None) == "constant"
        and p5.symmetric_spatial(m.spatial_padding)
        and isinstance(getattr(m, "conv", None), torch.nn.Conv3d)
        and m.conv.padding == (0, 0, 0)
    ):
        return "fold_vidtok"
    if matches_class(m, _PAD_THEN_CONV) and isinstance(getattr(m, "conv", None), torch.nn.Conv3d) and len(m.time_causal_padding) == 6:
        return "pad_conv"
    if matches_class(m, PADDERS):
        return "route"
    if isinstance(m, torch.nn.Conv3d) and m.padding_mode != "zeros":
        # nn.Conv3d pads through F.pad for these modes; a subclass with its own forward is routed.
        return "conv_mode" if type(m).forward is torch.nn.Conv3d.forward else "route"
    return None


def count_targets(root: torch.nn.Module) -> dict:
    out = {"folded": 0, "written_out": 0, "routed": 0}
    for m in root.modules():
        k = _kind(m)
        if k:
            out["folded" if k.startswith("fold") else "routed" if k == "route" else "written_out"] += 1
    return out


def _gate_reasons(env: Env) -> list[str]:
    """The failing verdicts among the pad features (``pad3d_all_modes_correct`` where the gate has it)."""
    names = ["pad_constant_native", "pad_rank5_correct"]
    if "pad3d_all_modes_correct" in FEATURES:
        names.append("pad3d_all_modes_correct")
    return [v.reason for v in (check(n, env) for n in names) if not v.ok]


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
        for name, mod in root.named_modules():
            if matches_class(mod, VAES):
                yield Match(mod, join_path(prefix, name))

    def decide(self, match: Match, env: Env, options: VideoVaePadOptions) -> Decision:
        counts = count_targets(match.module)
        if sum(counts.values()) == 0:
            return Decision.skip("no module of this VAE pads a 5-D tensor", **counts)
        backing = "conv padding fold + pad as slice copies" if counts["folded"] else "pad as slice copies"
        if options.force:
            return Decision.apply(backing, "forced by options (force=True)", **counts)
        if env.device_type != "mps":
            return Decision.skip(f"pads of 5-D tensors are native and correct on {env.device_type}; stock kept", **counts)
        bad = _gate_reasons(env)
        if not bad:
            return Decision.skip(
                "stock pads of 5-D tensors are native and correct on this build (pytorch#195368, #194944, #195147); stock kept",
                **counts,
            )
        reason = (
            "avoids pytorch#195368 (MPSGraph pad: driver memory outside the allocator) and issue pytorch#194922 / "
            f"#195147 (wrong constant, reflection and replication pads of rank-5 tensors) on this build: {'; '.join(bad)}"
        )
        return Decision.apply(backing, reason, **counts)

    def apply(self, match: Match, decision: Decision, env: Env, options: VideoVaePadOptions) -> Patch:
        def routed(self_: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            with p5.Pad5dMode():
                return call_original(self_, NAME, *args, **kwargs)

        def fold_cosmos(self_: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
            return p5.cosmos_causal_conv3d(self_, x)

        def fold_vidtok(self_: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
            return p5.vidtok_causal_conv3d(self_, x)

        def pad_conv(self_: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
            return p5.pad_then_conv(self_, x)

        def conv_mode(self_: torch.nn.Conv3d, x: torch.Tensor) -> torch.Tensor:
            return p5.conv3d_padding_mode(self_, x)

        forwards = {"route": routed, "fold_cosmos": fold_cosmos, "fold_vidtok": fold_vidtok, "pad_conv": pad_conv, "conv_mode": conv_mode}
        with Changes() as ch:
            # A mark on the VAE itself: patch() sees it patched (a second call is a no-op).
            ch.add(set_instance_attr(match.module, NAME, "_mpsboost_pad5d", True))
            for m in match.module.modules():
                k = _kind(m)
                if k:
                    ch.add(bind_forward(m, NAME, forwards[k]))
        return ch.patch(description=f"{NAME}: restore forwards")
