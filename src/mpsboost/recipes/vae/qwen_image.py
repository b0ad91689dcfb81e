"""Recipe ``qwen_image_vae``: the Qwen-Image 1.0 and 2.1 VAEs without ``F.pad``, and 2-D for single images.

Same treatment as ``wan_vae_pad`` (the Qwen-Image VAE is the Wan2.1 design): spatial padding folded
into each causal convolution, time padding as cached frames or a zero slab, the downsampling
``ZeroPad2d`` as a buffer copy. On MPS before torch 2.15 this avoids pytorch#195368 (MPSGraph pad
memory) and pytorch#194922 (wrong time padding of rank-5 tensors once H*W >= 65536: roundtrips far
from the CPU result, ComfyUI#16433). For an image (one frame) every 3x3x3 causal convolution sees
``[0, 0, x]`` in time, which is exactly a 2-D convolution with the last time slice of the weight:
about a third of the FLOPs, and no cache copies since nothing follows the frame.

The Qwen-Image-2.1 VAE (``AutoencoderKLQwenImage21``) is a row of the same family table
(:data:`~mpsboost.recipes.vae.common.QWEN21`): its causal convolutions are 2-D already (``nn.Conv2d``
subclasses that squeeze the frame and ``F.pad`` the 4-D tensor), its encoder's ``AvgDown3D`` blocks
pad 5-D in time. A 256x256 roundtrip issues 74 4-D and 5 5-D ``constant_pad_nd`` at the aten level;
patched, none. The 5-D time pads are the ones pytorch#194922 corrupts on MPS before 2.15
(QwenLM/Qwen-Image-2.1#6: encoder latents far from the CPU ones once H*W >= 65536).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Iterator

import torch

from ...gate import Env, check
from . import common as vae_patch
from ...registry import Decision, Match, Recipe, register
from ...patching import Patch

CLASSES = vae_patch.QWEN
#: The families this recipe serves (Qwen-Image 1.0, Qwen-Image-2.1), one row each.
FAMILIES = (vae_patch.QWEN, vae_patch.QWEN21)


def _family(match: Match) -> vae_patch.VaeClasses:
    return vae_patch.FAMILIES[match.data.get("family", CLASSES.family)]


def _single_frame_reason(env: Env) -> str:
    """What the single-frame 2-D path buys on this MPS build: speed before conv3d reached Metal, else memory."""
    conv3d = check("conv3d_metal", env)
    if not conv3d.ok:
        # issue pytorch#192213: conv3d at 7% of matmul throughput on 2.12 (MPSGraph).
        return f"single frames as 2-D convolutions: a third of the FLOPs, and conv3d is slow on this build ({conv3d.reason})"
    return (
        "single frames as 2-D convolutions: conv3d runs on Metal kernels here (pytorch#188802, #192229), so this buys "
        "memory (no 5-D activations or cached frames) and a graph with no F.pad, not speed"
    )


@register
class QwenImageVae(Recipe):
    name = "qwen_image_vae"
    summary = "Qwen-Image 1.0 / 2.1 VAEs: no F.pad (padding fold, zero slab); single frames as 2-D convolutions"
    targets = tuple(t for fam in FAMILIES for t in (fam.vae, fam.conv))
    lossless = True
    reversible = True
    requires = ()
    default = True
    order = 100
    Options = vae_patch.VaePadOptions

    def find(self, root: torch.nn.Module, prefix: str = "") -> Iterator[Match]:
        for fam in FAMILIES:
            yield from vae_patch.find_targets(root, prefix, fam)

    def decide(self, match: Match, env: Env, options: vae_patch.VaePadOptions) -> Decision:
        fam = _family(match)
        opts = vae_patch.parse_options(self.name, options, env.device_type)
        if fam.conv_kind == "frame2d":
            # Its convolutions are 2-D already: the fold is the whole change (single_frame_2d has nothing to do).
            decision = vae_patch.decide(self.name, fam, match, env, options, "conv2d padding fold")
            if env.device_type == "mps" and not check("pad_rank5_correct", env).ok:
                decision = replace(decision, reason=(
                    f"{decision.reason}; in this VAE the 5-D pads are the encoder's AvgDown3D time pads, whose "
                    "corruption makes the latents wrong (QwenLM/Qwen-Image-2.1#6, ComfyUI#16433)"))
            return decision
        backing = "conv padding fold" + (", 2-D conv for single frame" if opts.single_frame_2d else "")
        decision = vae_patch.decide(self.name, fam, match, env, options, backing)
        if decision.applicable and opts.single_frame_2d and env.device_type == "mps":
            decision = replace(decision, reason=f"{decision.reason}; {_single_frame_reason(env)}")
        return decision

    def apply(self, match: Match, decision: Decision, env: Env, options: vae_patch.VaePadOptions) -> Patch:
        fam = _family(match)
        opts = vae_patch.parse_options(self.name, options, env.device_type)
        spec = out_cls = None
        if match.data.get("vae"):
            import importlib

            from diffusers.models.autoencoders.vae import DecoderOutput

            mod = importlib.import_module(vae_patch.MODULES[fam.family])
            pf, upf = (getattr(mod, n, None) for n in fam.patch_fns)
            spec = vae_patch.loop_spec(match.module, fam, patchify=pf, unpatchify=upf)
            out_cls = DecoderOutput
        return vae_patch.patch_tree(match.module, fam, opts, self.name, spec=spec, decoder_output=out_cls)
