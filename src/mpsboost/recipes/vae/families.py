"""The VAE family table: every VAE mpsboost patches is one row of :data:`FAMILIES`.

A row names a family's diffusers classes by dotted path (matched against each module's MRO, so
nothing here imports diffusers), the recipe that serves it, and what differs between families. The
recipes select their rows (:func:`rows_for`); the code that reads the rows is
:mod:`~mpsboost.recipes.vae.common` (and :mod:`~mpsboost.recipes.vae.tiles` for the tile loop).

Two treatments read the rows:

* the causal treatment (``wan_vae_pad``, ``qwen_image_vae``): the Wan design, where every causal
  convolution keeps diffusers' ``_padding`` and pads in front of itself. A row sets ``conv``,
  ``norm``, ``resample``, ``blocks`` and the loop fields (``first_chunk``, ``clamp_tiled``,
  ``patchify``, ``patch_fns``);
* the pad treatment (``video_vae_pad``): a VAE whose modules call ``F.pad`` on 5-D tensors. A row
  lists those modules as :class:`PadSite` entries in ``pads``, each with how its pad goes away.

A new VAE that pads like an existing row is a new row, with no new code.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PadSite", "VaeFamily", "FAMILIES", "PAD_HOWS", "family", "rows_for"]

#: How a :class:`PadSite` loses its pad (implemented in :data:`mpsboost.recipes.vae.common.PAD_TREATMENTS`).
#: "route": the module's own forward runs with its 5-D ``F.pad`` calls routed to slice copies;
#: "pad_then_conv": ``module.conv(F.pad(x, module.time_causal_padding, module.pad_mode))`` written out;
#: "fold_cosmos" / "fold_vidtok": a zero spatial pad folded into the module's convolution (constant
#: mode and symmetric padding only; a module that does not qualify is routed instead).
PAD_HOWS = ("route", "pad_then_conv", "fold_cosmos", "fold_vidtok")


@dataclass(frozen=True)
class PadSite:
    """A module class whose forward pads a 5-D tensor, and how that pad is removed (one of :data:`PAD_HOWS`)."""

    cls: str
    how: str = "route"

    def __post_init__(self) -> None:
        if self.how not in PAD_HOWS:
            raise ValueError(
                f"PadSite how={self.how!r} for {self.cls} is not accepted; pass one of {', '.join(PAD_HOWS)}"
            )


@dataclass(frozen=True)
class VaeFamily:
    """One model family's VAE: one row of :data:`FAMILIES`. Class names are dotted paths."""

    name: str  # the family's key, e.g. "wan"; unique in the table
    recipe: str  # the recipe that serves it: "wan_vae_pad", "qwen_image_vae" or "video_vae_pad"
    vae: str  # the VAE class (one report row per instance)

    # ---- the causal treatment (rows of wan_vae_pad and qwen_image_vae)
    conv: str | None = None  # the causal convolution
    norm: str | None = None  # the channel RMS norm (fused_norm)
    resample: str | None = None  # the resample block holding ZeroPad2d((0, 1, 0, 1))
    blocks: tuple[str, ...] = ()  # classes whose `nonlinearity` follows one of the norms
    avg_down: str | None = None  # AvgDown3D (Wan2.2-style encoders), or None
    first_chunk: bool = False  # the decoder takes first_chunk=
    clamp_tiled: bool = False  # tiled_decode clamps to [-1, 1]
    patchify: bool = False  # the VAE has patchify / unpatchify (Wan2.2 patch_size)
    # "causal3d": an nn.Conv3d with diffusers' `_padding = (pW, pW, pH, pH, 2*pT, 0)` that takes a
    # cache (Wan, Qwen-Image); "frame2d": an nn.Conv2d with `_padding = (pW, pW, pH, pH)` that
    # squeezes the one frame, pads a 4-D tensor and takes no cache (Qwen-Image-2.1).
    conv_kind: str = "causal3d"
    patch_fns: tuple[str, str] = ("patchify", "unpatchify")  # their names in the family's diffusers module
    # An image model (one frame per call): the report names the single-frame 2-D path and what it buys.
    images: bool = False
    # Appended to the reason on MPS builds whose rank-5 pads are wrong: what that fault does to this family.
    rank5_note: str = ""
    # mps_streams serves it (blend and copy-out of the tiled decode on a side stream).
    side_stream: bool = False

    # ---- the pad treatment (rows without conv: video_vae_pad). Besides these sites, every nn.Conv3d
    # of the VAE whose padding_mode is not "zeros" loses its pad (written out, or routed where the
    # class has its own forward).
    pads: tuple[PadSite, ...] = ()

    def __post_init__(self) -> None:
        if self.conv is not None and self.pads:
            raise ValueError(
                f"VAE family {self.name!r}: give conv (causal treatment) or pads (pad treatment), not both"
            )
        if self.conv_kind not in ("causal3d", "frame2d"):
            raise ValueError(f"VAE family {self.name!r}: conv_kind={self.conv_kind!r}; pass 'causal3d' or 'frame2d'")

    @property
    def treatment(self) -> str:
        """ "causal" (:func:`~mpsboost.recipes.vae.common.patch_tree`: a row with ``conv``) or "pad"
        (:func:`~mpsboost.recipes.vae.common.patch_pads`)."""
        return "causal" if self.conv is not None else "pad"

    @property
    def module(self) -> str:
        """The diffusers module of the VAE class (imported by the recipe when it applies, never here)."""
        return self.vae.rsplit(".", 1)[0]


_AE = "diffusers.models.autoencoders"
_WAN = f"{_AE}.autoencoder_kl_wan"
_QWEN = f"{_AE}.autoencoder_kl_qwenimage"
_QWEN21 = f"{_AE}.autoencoder_kl_qwenimage21"
_HV = f"{_AE}.autoencoder_kl_hunyuan_video"
_HV15 = f"{_AE}.autoencoder_kl_hunyuanvideo15"
_HIR = f"{_AE}.autoencoder_kl_hunyuanimage_refiner"
_COG = f"{_AE}.autoencoder_kl_cogvideox"
_COSMOS = f"{_AE}.autoencoder_kl_cosmos"
_MAGVIT = f"{_AE}.autoencoder_kl_magvit"
_KVAE = f"{_AE}.autoencoder_kl_kvae_video"
_VIDTOK = f"{_AE}.autoencoder_vidtok"
_MINIMAX = f"{_AE}.autoencoder_kl_minimax_h3"

#: Every VAE family of diffusers 0.42.1 that mpsboost patches. The pad treatment's sites were found by
#: tracing each VAE's 5-D pads to the module that calls them; its rows' order is video_vae_pad's targets.
FAMILIES: tuple[VaeFamily, ...] = (
    # Wan2.1 / Wan2.2 (AutoencoderKLWan: Wan2.2 adds AvgDown3D and patch_size 2).
    VaeFamily(
        "wan",
        "wan_vae_pad",
        f"{_WAN}.AutoencoderKLWan",
        conv=f"{_WAN}.WanCausalConv3d",
        norm=f"{_WAN}.WanRMS_norm",
        resample=f"{_WAN}.WanResample",
        blocks=(f"{_WAN}.WanResidualBlock", f"{_WAN}.WanEncoder3d", f"{_WAN}.WanDecoder3d"),
        avg_down=f"{_WAN}.AvgDown3D",
        first_chunk=True,
        clamp_tiled=True,
        patchify=True,
        side_stream=True,
    ),
    # Qwen-Image 1.0: the Wan2.1 design without AvgDown3D or patches; its tiled_decode does not clamp.
    VaeFamily(
        "qwen",
        "qwen_image_vae",
        f"{_QWEN}.AutoencoderKLQwenImage",
        conv=f"{_QWEN}.QwenImageCausalConv3d",
        norm=f"{_QWEN}.QwenImageRMS_norm",
        resample=f"{_QWEN}.QwenImageResample",
        blocks=(f"{_QWEN}.QwenImageResidualBlock", f"{_QWEN}.QwenImageEncoder3d", f"{_QWEN}.QwenImageDecoder3d"),
        images=True,
        side_stream=True,
    ),
    # Qwen-Image-2.1: the Wan2.2 residual design (AvgDown3D, DupUp3D, first_chunk, clamped tiles) for
    # images only, its causal convolutions already 2-D (nn.Conv2d subclasses that squeeze the frame,
    # F.pad it and refuse a cache).
    VaeFamily(
        "qwen21",
        "qwen_image_vae",
        f"{_QWEN21}.AutoencoderKLQwenImage21",
        conv=f"{_QWEN21}.QwenImage21CausalConv3d",
        norm=f"{_QWEN21}.QwenImage21RMS_norm",
        resample=f"{_QWEN21}.QwenImage21Resample",
        blocks=(
            f"{_QWEN21}.QwenImage21ResidualBlock",
            f"{_QWEN21}.QwenImage21Encoder3d",
            f"{_QWEN21}.QwenImage21Decoder3d",
        ),
        avg_down=f"{_QWEN21}.QwenImage21AvgDown3D",
        first_chunk=True,
        clamp_tiled=True,
        patchify=True,
        conv_kind="frame2d",
        patch_fns=("_patchify", "_unpatchify"),
        images=True,
        rank5_note=(
            "in this VAE the 5-D pads are the encoder's AvgDown3D time pads, whose corruption makes "
            "the latents wrong (QwenLM/Qwen-Image-2.1#6, ComfyUI#16433)"
        ),
    ),
    # ---- the pad treatment: F.pad(x, self.time_causal_padding, mode=self.pad_mode) then self.conv(x)
    VaeFamily(
        "hunyuan_video",
        "video_vae_pad",
        f"{_HV}.AutoencoderKLHunyuanVideo",
        pads=(PadSite(f"{_HV}.HunyuanVideoCausalConv3d", "pad_then_conv"),),
    ),
    VaeFamily(
        "hunyuan_video15",
        "video_vae_pad",
        f"{_HV15}.AutoencoderKLHunyuanVideo15",
        pads=(PadSite(f"{_HV15}.HunyuanVideo15CausalConv3d", "pad_then_conv"),),
    ),
    VaeFamily(
        "hunyuan_image_refiner",
        "video_vae_pad",
        f"{_HIR}.AutoencoderKLHunyuanImageRefiner",
        pads=(PadSite(f"{_HIR}.HunyuanImageRefinerCausalConv3d", "pad_then_conv"),),
    ),
    # Mochi pads in CogVideoX's causal convolution.
    VaeFamily(
        "mochi",
        "video_vae_pad",
        f"{_AE}.autoencoder_kl_mochi.AutoencoderKLMochi",
        pads=(PadSite(f"{_COG}.CogVideoXCausalConv3d"),),
    ),
    VaeFamily(
        "cogvideox",
        "video_vae_pad",
        f"{_COG}.AutoencoderKLCogVideoX",
        pads=(PadSite(f"{_COG}.CogVideoXCausalConv3d"), PadSite("diffusers.models.downsampling.CogVideoXDownsample3D")),
    ),
    VaeFamily(
        "cosmos",
        "video_vae_pad",
        f"{_COSMOS}.AutoencoderKLCosmos",
        pads=(
            PadSite(f"{_COSMOS}.CosmosCausalConv3d", "fold_cosmos"),
            PadSite(f"{_COSMOS}.CosmosDownsample3d"),
            PadSite(f"{_COSMOS}.CosmosPatchEmbed3d"),
        ),
    ),
    VaeFamily(
        "easyanimate",
        "video_vae_pad",
        f"{_MAGVIT}.AutoencoderKLMagvit",
        pads=(PadSite(f"{_MAGVIT}.EasyAnimateCausalConv3d"), PadSite(f"{_MAGVIT}.EasyAnimateDownsampler3D")),
    ),
    # KVAE's KVAESafeConv3d (an nn.Conv3d with its own forward and a replicate padding_mode) is routed
    # by the pad treatment's rule for every row: an nn.Conv3d whose padding_mode is not "zeros".
    VaeFamily(
        "kvae_video",
        "video_vae_pad",
        f"{_KVAE}.AutoencoderKLKVAEVideo",
        pads=(PadSite(f"{_KVAE}.KVAECachedCausalConv3d"),),
    ),
    # LTX-2 pads only through nn.Conv3d(padding_mode="reflect") in its decoder, which that rule writes out.
    VaeFamily("ltx2_video", "video_vae_pad", f"{_AE}.autoencoder_kl_ltx2.AutoencoderKLLTX2Video"),
    VaeFamily(
        "vidtok",
        "video_vae_pad",
        f"{_VIDTOK}.AutoencoderVidTok",
        pads=(PadSite(f"{_VIDTOK}.VidTokCausalConv3d", "fold_vidtok"), PadSite(f"{_VIDTOK}.VidTokDownsample3D")),
    ),
    VaeFamily(
        "minimax_h3",
        "video_vae_pad",
        f"{_MINIMAX}.AutoencoderKLMiniMaxH3",
        pads=(PadSite(f"{_MINIMAX}.MiniMaxH3VideoCausalConv3d"), PadSite(f"{_MINIMAX}.MiniMaxH3VideoDownsample3d")),
    ),
)

_BY_NAME = {f.name: f for f in FAMILIES}
if len(_BY_NAME) != len(FAMILIES):
    raise RuntimeError("VAE family names must be unique")


def family(name: str) -> VaeFamily:
    """The row named ``name``."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"no VAE family {name!r}; the table has {', '.join(_BY_NAME)}") from None


def rows_for(recipe: str) -> tuple[VaeFamily, ...]:
    """The rows a recipe serves, in table order."""
    return tuple(f for f in FAMILIES if f.recipe == recipe)
