"""The models that mpsboost's measurements build, in one place: the shipped configs and the small ones.

Two kinds of config, one table:

* the shipped JSON files under ``configs/<family>/<size>/<file>.json`` (``real``: the published config of
  Wan2.2-TI2V-5B, Qwen-Image, Qwen3-30B-A3B, Qwen3-8B, Qwen3.6-35B-A3B, each naming its source; ``tiny``:
  the same structure at toy width), read by :func:`config`. The recipe scripts (``recipes/``), the end-to-end
  benchmark and the fp8 load benchmark build from them;
* the reduced configs of the demo, the selftest, the support tables, the recipe benchmarks and the tests, each
  written once in :data:`MODELS` as a row: family, the classes, and the config (a shipped file with fields changed,
  another row with fields changed, or written out here), read by :func:`model_config` and built by :func:`build`.
  A pipeline row names its components' rows.

:data:`ZOO` names the rows the tests build (``tests/tiny_models.py`` runs them by their :attr:`ModelSpec.kind`): a
tiny model for the tests is a row here and an entry there.

Nothing here imports diffusers or transformers until a model is built. Weights are random: these
models exercise every kernel at their shapes; their outputs are noise.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from .errors import BenchError

__all__ = [
    "CONFIGS",
    "KINDS",
    "MODELS",
    "TINY_LM",
    "VIDEO_VAES",
    "ZOO",
    "ModelSpec",
    "build",
    "config",
    "default_dtype",
    "dtype_name",
    "model_config",
    "read_config",
]

#: The shipped configs (package data: they travel with the wheel).
CONFIGS = Path(__file__).resolve().parent / "configs"


def read_config(family: str, size: str, file: str) -> dict:
    """A shipped config file as written, ``_source``/``_class_name`` notes included."""
    path = CONFIGS / family / size / file
    if not path.is_file():
        known = sorted(p.relative_to(CONFIGS).as_posix() for p in CONFIGS.glob("*/*/*.json"))
        raise BenchError(f"no shipped config {family}/{size}/{file} in {CONFIGS}; shipped: {', '.join(known)}")
    return json.loads(path.read_text(encoding="utf-8"))


def config(family: str, size: str, file: str) -> dict:
    """A shipped config without its notes (keys starting with ``_``): ``config("wan22_ti2v", "tiny", "vae.json")``."""
    return {k: v for k, v in read_config(family, size, file).items() if not k.startswith("_")}


class default_dtype:
    """Create parameters directly in ``dtype`` (a real-size model is never materialised in fp32)."""

    def __init__(self, dtype: Any):
        self.dtype = dtype

    def __enter__(self):
        import torch

        self.old = torch.get_default_dtype()
        if self.dtype.is_floating_point:
            torch.set_default_dtype(self.dtype)
        return self

    def __exit__(self, *exc):
        import torch

        torch.set_default_dtype(self.old)
        return False


def dtype_name(dtype: Any) -> str:
    """``"bfloat16"`` for ``torch.bfloat16``."""
    return str(dtype).replace("torch.", "")


# ------------------------------------------------------------------------------------------ the table


#: What a row's model takes as input, read from its class name (:attr:`ModelSpec.kind`).
KINDS = {
    "pipeline": "Pipeline",  # a diffusers pipeline: prompt embeddings in, images or frames out
    "vae": "Autoencoder",  # pixels (or a latent) in, pixels out
    "lm": "ForCausalLM",  # token ids in, logits out, with a KV cache
    "encoder": "EncoderModel",  # token ids in, hidden states out
    "dit": "Transformer",  # a diffusion transformer: latents, a timestep and text embeddings in
}


@dataclass(frozen=True)
class ModelSpec:
    """One model of the table: the library and classes that build it, and where its config comes from.

    ``base`` names a shipped file (family, size, file) or another row (``"wan22_vae:tiny"``) whose config
    ``override`` changes; without a base, ``override`` is the whole config. A pipeline row (``model_class``
    ending in ``Pipeline``) names its ``components`` (built in order, after one another from the caller's seed) and
    its ``scheduler`` (class name, keyword arguments); ``override`` is then the pipeline's own keyword arguments.
    ``shape``: input dimensions the tests run the model at whatever else they vary (``{"frames": 1}``: images only).
    """

    library: str  # "diffusers" or "transformers"
    model_class: str
    config_class: str | None = None  # transformers: the config class; diffusers takes keyword arguments
    base: tuple[str, str, str] | str | None = None
    override: dict = field(default_factory=dict)
    what: str = ""
    # name -> a row, (a row, config fields changed), or None (the component left out)
    components: Mapping[str, Any] = field(default_factory=dict)
    scheduler: tuple[str, dict] | None = None
    shape: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.library not in ("diffusers", "transformers"):
            raise ValueError(f"{self.model_class}: library must be 'diffusers' or 'transformers', got {self.library!r}")
        self.kind  # noqa: B018 - raises for a class of no known kind
        if (self.kind == "pipeline") != bool(self.components):
            raise ValueError(f"{self.model_class}: a pipeline row, and only one, names its components")
        if self.library == "transformers" and self.config_class is None:
            raise ValueError(f"{self.model_class}: a transformers row names its config class")

    @property
    def kind(self) -> str:
        """``"pipeline"``, ``"vae"``, ``"lm"``, ``"encoder"`` or ``"dit"``: what the model takes (:data:`KINDS`)."""
        for kind, marker in KINDS.items():
            if marker in self.model_class:
                return kind
        raise ValueError(f"{self.model_class}: no kind of {sorted(KINDS)} matches the class name ({KINDS})")


def _latents(z_dim: int) -> dict:
    # Random weights have no latent statistics: mean 0, std 1 (what the shipped files say too).
    return {"latents_mean": [0.0] * z_dim, "latents_std": [1.0] * z_dim}


# The small transformers LM the selftest's recipe checks and the tests' LMs share (with head_dim 32, the smallest
# head size of a Metal attention kernel, every attention path applies; two query heads share one K/V head).
TINY_LM = {
    "vocab_size": 128,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

# The Gated DeltaNet layout of the tests' hybrids, and their experts.
_GDN = {
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "layer_types": ["linear_attention", "full_attention"],
}
_GDN_MOE = {
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 16,
    "num_experts": 4,
    "num_experts_per_tok": 2,
}
# Wan's flow-matching UniPC scheduler.
_FLOW_UNIPC = {"prediction_type": "flow_prediction", "use_flow_sigmas": True, "flow_shift": 3.0}

MODELS: dict[str, ModelSpec] = {
    # Wan2.2 VAE (diffusers AutoencoderKLWan): residual blocks, patch 2, z 48, 12 channels, 16x / 4x compression.
    "wan22_vae:real": ModelSpec(
        "diffusers",
        "AutoencoderKLWan",
        base=("wan22_ti2v", "real", "vae.json"),
        what="Wan2.2-TI2V-5B's VAE (705M parameters)",
    ),
    "wan22_vae:tiny": ModelSpec(
        "diffusers",
        "AutoencoderKLWan",
        base=("wan22_ti2v", "tiny", "vae.json"),
        what="the Wan2.2 VAE structure at diffusers' test width (cookbook tiny, selftest)",
    ),
    # Widths divided by 20 and 16: a decode takes well under a second on a CPU core (the encoder is not run;
    # base_dim only sizes its weights).
    "wan22_vae:demo": ModelSpec(
        "diffusers",
        "AutoencoderKLWan",
        base="wan22_vae:real",
        override={"base_dim": 8, "decoder_base_dim": 16},
        what="mpsboost demo",
    ),
    "wan22_vae:bench_tiny": ModelSpec(
        "diffusers",
        "AutoencoderKLWan",
        base="wan22_vae:tiny",
        override={"decoder_base_dim": 4, "z_dim": 16, **_latents(16)},
        what="benchmarks/wan_vae.py --size tiny",
    ),
    "wan22_vae:bench_small": ModelSpec(
        "diffusers",
        "AutoencoderKLWan",
        base="wan22_vae:bench_tiny",
        override={"base_dim": 16, "decoder_base_dim": 24, "num_res_blocks": 2},
        what="benchmarks/wan_vae.py --size small",
    ),
    # Qwen-Image VAE: the class defaults are Qwen-Image's; tiny is diffusers' tests/pipelines/qwenimage config.
    "qwen_image_vae:real": ModelSpec("diffusers", "AutoencoderKLQwenImage", base=("qwen_image", "real", "vae.json")),
    # Single images in the tests: the Qwen-Image case (its 3-D path costs 10x on a CPU).
    "qwen_image_vae:tiny": ModelSpec(
        "diffusers", "AutoencoderKLQwenImage", base=("qwen_image", "tiny", "vae.json"), shape={"frames": 1}
    ),
    # mpsboost demo: the Qwen-Image VAE structure (z 16, dim_mult [1, 2, 4, 4], 2 residual blocks, 8x spatial) at a
    # sixth of its width (base_dim 16 for 96): a 16x16 latent decodes to a 128x128 image.
    "qwen_image_vae:demo": ModelSpec(
        "diffusers",
        "AutoencoderKLQwenImage",
        base="qwen_image_vae:real",
        override={"base_dim": 16, **_latents(16)},
        what="mpsboost demo",
    ),
    "qwen_image_vae:bench_tiny": ModelSpec(
        "diffusers",
        "AutoencoderKLQwenImage",
        override={
            "base_dim": 4,
            "z_dim": 4,
            "dim_mult": [1, 2, 4],
            "num_res_blocks": 1,
            "temperal_downsample": [False, True],
            **_latents(4),
        },
        what="benchmarks/qwen_image_vae.py --size tiny",
    ),
    "qwen_image_vae:bench_small": ModelSpec(
        "diffusers",
        "AutoencoderKLQwenImage",
        override={
            "base_dim": 16,
            "z_dim": 16,
            "dim_mult": [1, 2, 4, 4],
            "num_res_blocks": 2,
            "temperal_downsample": [False, True, True],
        },
        what="benchmarks/qwen_image_vae.py --size small",
    ),
    # Qwen-Image-2.1: the class defaults (base_dim 96, decoder_base_dim 144, z_dim 64, dim_mult [1, 2, 4, 8, 8],
    # 4 channels in and out, spatial factor 16) are its VAE.
    "qwen_image21_vae:real": ModelSpec("diffusers", "AutoencoderKLQwenImage21", what="the class defaults"),
    "qwen_image21_vae:tiny": ModelSpec(
        "diffusers",
        "AutoencoderKLQwenImage21",
        override={
            "base_dim": 8,
            "decoder_base_dim": 8,
            "z_dim": 4,
            "dim_mult": [1, 1, 1, 1, 1],
            "num_res_blocks": 1,
            "temperal_downsample": [False, True, True, True],
            **_latents(4),
        },
        what="selftest",
    ),
    "qwen_image21_vae:bench_tiny": ModelSpec(
        "diffusers",
        "AutoencoderKLQwenImage21",
        override={
            "base_dim": 4,
            "decoder_base_dim": 6,
            "z_dim": 4,
            "dim_mult": [1, 2, 2, 2],
            "num_res_blocks": 1,
            "temperal_downsample": [False, True, True],
            "scale_factor_spatial": 8,
            **_latents(4),
        },
        what="benchmarks/qwen_image_vae.py --size tiny",
    ),
    "qwen_image21_vae:bench_small": ModelSpec(
        "diffusers",
        "AutoencoderKLQwenImage21",
        override={
            "base_dim": 16,
            "decoder_base_dim": 24,
            "z_dim": 16,
            "dim_mult": [1, 2, 4, 4, 4],
            "num_res_blocks": 2,
            "temperal_downsample": [False, True, True, True],
            **_latents(16),
        },
        what="benchmarks/qwen_image_vae.py --size small",
    ),
    # HunyuanVideo's VAE structure (causal convs with replicate time padding) at a test width.
    "hunyuan_video_vae:tiny": ModelSpec(
        "diffusers",
        "AutoencoderKLHunyuanVideo",
        override={
            "block_out_channels": (8, 8, 8, 8),
            "norm_num_groups": 4,
            "layers_per_block": 1,
            "latent_channels": 4,
        },
    ),
    # diffusers' other video VAEs at test widths (VIDEO_VAES names their inputs).
    "hunyuan_video15_vae:tiny": ModelSpec(
        "diffusers",
        "AutoencoderKLHunyuanVideo15",
        override={"block_out_channels": (8, 8, 8, 8, 8), "layers_per_block": 1, "latent_channels": 4},
    ),
    "hunyuan_image_refiner_vae:tiny": ModelSpec(
        "diffusers",
        "AutoencoderKLHunyuanImageRefiner",
        override={"block_out_channels": (8, 8, 8, 8, 8), "layers_per_block": 1, "latent_channels": 4},
    ),
    "mochi_vae:tiny": ModelSpec(
        "diffusers",
        "AutoencoderKLMochi",
        override={
            "encoder_block_out_channels": (32, 32, 32, 32),
            "decoder_block_out_channels": (32, 32, 32, 32),
            "layers_per_block": (1, 1, 1, 1, 1),
        },
    ),
    "cogvideox_vae:tiny": ModelSpec(
        "diffusers",
        "AutoencoderKLCogVideoX",
        override={
            "block_out_channels": (8, 8, 8, 8),
            "norm_num_groups": 4,
            "layers_per_block": 1,
            "latent_channels": 4,
        },
    ),
    "cosmos_vae:tiny": ModelSpec(
        "diffusers",
        "AutoencoderKLCosmos",
        override={
            "encoder_block_out_channels": (8, 8, 8, 8),
            "decode_block_out_channels": (8, 8, 8, 8),
            "latent_channels": 4,
            "num_layers": 1,
            "resolution": 32,
            "attention_resolutions": (8,),
            "latents_mean": None,
            "latents_std": None,
        },
    ),
    "magvit_vae:tiny": ModelSpec(
        "diffusers",
        "AutoencoderKLMagvit",
        override={
            "block_out_channels": [8, 8, 8, 8],
            "norm_num_groups": 4,
            "layers_per_block": 1,
            "latent_channels": 4,
        },
    ),
    "kvae_video_vae:tiny": ModelSpec(
        "diffusers",
        "AutoencoderKLKVAEVideo",
        override={"ch": 32, "ch_mult": (1, 1, 1), "num_res_blocks": 1, "z_channels": 4},
    ),
    "ltx2_vae:tiny": ModelSpec(
        "diffusers",
        "AutoencoderKLLTX2Video",
        override={
            "block_out_channels": (8, 16, 32, 64),
            "decoder_block_out_channels": (8, 16, 32),
            "latent_channels": 8,
            "layers_per_block": (1, 1, 1, 1, 1),
            "decoder_layers_per_block": (1, 1, 1, 1),
        },
    ),
    "vidtok_vae:tiny": ModelSpec(
        "diffusers",
        "AutoencoderVidTok",
        override={"ch": 8, "ch_mult": [1, 1, 1, 1], "num_res_blocks": 1},
    ),
    "minimax_h3_vae:tiny": ModelSpec(
        "diffusers",
        "AutoencoderKLMiniMaxH3",
        override={
            "block_out_channels": (8, 8, 8, 8, 8, 8),
            "norm_num_groups": 4,
            "layers_per_block": 1,
            "decoder_num_layers": 1,
            "decoder_num_attention_heads": 2,
            "decoder_attention_head_dim": 8,
            "clip_length": 5,
            "token_drop": 1,
        },
    ),
    # Qwen3-30B-A3B's layout (every layer sparse, top-k routing over many small experts, GQA with head_dim set
    # apart from hidden/heads) at toy widths.
    "qwen3_moe:demo": ModelSpec(
        "transformers",
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        override={
            "vocab_size": 2048,
            "hidden_size": 256,
            "intermediate_size": 512,
            "moe_intermediate_size": 128,
            "num_experts": 16,
            "num_experts_per_tok": 4,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "max_position_embeddings": 1024,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": True,
            "tie_word_embeddings": False,
        },
        what="mpsboost demo",
    ),
    "qwen3_moe:selftest": ModelSpec(
        "transformers",
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        override={
            **TINY_LM,
            "head_dim": 32,
            "intermediate_size": 64,
            "moe_intermediate_size": 16,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "decoder_sparse_step": 1,
            "norm_topk_prob": True,
        },
    ),
    "qwen3:selftest": ModelSpec(
        "transformers",
        "Qwen3ForCausalLM",
        "Qwen3Config",
        override={**TINY_LM, "head_dim": 32, "intermediate_size": 64},
    ),
    # head_dim 64 (a Metal kernel size), grouped K/V (4 heads, 2 K/V heads), eager attention.
    "llama_eager:selftest": ModelSpec(
        "transformers",
        "LlamaForCausalLM",
        "LlamaConfig",
        override={
            **TINY_LM,
            "hidden_size": 256,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 64,
            "attn_implementation": "eager",
        },
    ),
    # mpsboost demo: Qwen3.6-35B-A3B's text model layout (3 Gated DeltaNet layers to 1 gated full-attention layer,
    # twice as many value heads as key heads, GQA, partial rotary, routed experts top-k plus a shared expert) at toy
    # widths.
    "qwen3_5_moe:demo": ModelSpec(
        "transformers",
        "Qwen3_5MoeForCausalLM",
        "Qwen3_5MoeTextConfig",
        override={
            "vocab_size": 2048,
            "hidden_size": 256,
            "num_hidden_layers": 4,
            "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 64,
            "linear_value_head_dim": 64,
            "linear_conv_kernel_dim": 4,
            "num_experts": 16,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": 128,
            "shared_expert_intermediate_size": 128,
            "max_position_embeddings": 1024,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
            "tie_word_embeddings": False,
        },
        what="mpsboost demo",
    ),
    # Qwen3.6's text model (Gated DeltaNet + full attention, MoE with a shared expert) at a test width.
    "qwen3_5_moe:selftest": ModelSpec(
        "transformers",
        "Qwen3_5MoeForCausalLM",
        "Qwen3_5MoeTextConfig",
        override={
            "vocab_size": 128,
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "layer_types": ["linear_attention", "full_attention"],
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 16,
            "max_position_embeddings": 64,
        },
    ),
    # The support tables' workloads (mpsboost.docs.SAMPLES), built on the meta device in bfloat16 and never run.
    # Qwen3.6-35B-A3B's text model at toy width: Gated DeltaNet and full attention layers, 256 -> 8 routed experts
    # with top-8 -> 2, one shared expert with its gate.
    "qwen3_5_moe:docs": ModelSpec(
        "transformers",
        "Qwen3_5MoeForCausalLM",
        "Qwen3_5MoeTextConfig",
        override={
            "vocab_size": 128,
            "hidden_size": 64,
            "num_hidden_layers": 4,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 16,
            "num_experts": 8,
            "num_experts_per_tok": 2,
        },
        what="the support tables (mpsboost.docs.SAMPLES)",
    ),
    "qwen_image21_vae:docs": ModelSpec(
        "diffusers",
        "AutoencoderKLQwenImage21",
        override={
            "base_dim": 8,
            "decoder_base_dim": 8,
            "z_dim": 4,
            "dim_mult": [1, 1, 1],
            "num_res_blocks": 1,
            "temperal_downsample": [False, True],
            **_latents(4),
        },
        what="the support tables (mpsboost.docs.SAMPLES)",
    ),
    "wan22_transformer:tiny": ModelSpec(
        "diffusers",
        "WanTransformer3DModel",
        override={
            "patch_size": [1, 2, 2],
            "num_attention_heads": 2,
            "attention_head_dim": 12,
            "in_channels": 48,
            "out_channels": 48,
            "text_dim": 32,
            "freq_dim": 256,
            "ffn_dim": 32,
            "num_layers": 2,
            "cross_attn_norm": True,
            "qk_norm": "rms_norm_across_heads",
            "rope_max_seq_len": 32,
        },
        what="the support tables (mpsboost.docs.SAMPLES) and the tests",
    ),
    # ------------------------------------------------------------------------ the tests' zoo (besides the rows above)
    # diffusers' own test config of the Wan2.1 VAE (tests/pipelines/wan/test_wan_22.py, A14B part).
    "wan21_vae:tiny": ModelSpec(
        "diffusers",
        "AutoencoderKLWan",
        override={
            "base_dim": 3,
            "z_dim": 16,
            "dim_mult": [1, 1, 1, 1],
            "num_res_blocks": 1,
            "temperal_downsample": [False, True, True],
        },
        what="the tests",
    ),
    # The Qwen-Image-2.1 structure (residual blocks, AvgDown3D with time and space factors, DupUp3D, RGBA in and out,
    # 2-D causal convolutions) with three downsamplings (spatial factor 8: tiled runs have 4x4 tiles, as Qwen-Image's).
    # Images only: its convolutions refuse a cache (more frames raise in diffusers).
    "qwen_image21_vae:test": ModelSpec(
        "diffusers",
        "AutoencoderKLQwenImage21",
        base="qwen_image21_vae:bench_tiny",
        override={"base_dim": 8, "decoder_base_dim": 12},
        shape={"frames": 1},
        what="the tests",
    ),
    "qwen_image_transformer:tiny": ModelSpec(
        "diffusers",
        "QwenImageTransformer2DModel",
        override={
            "patch_size": 2,
            "in_channels": 16,
            "out_channels": 4,
            "num_layers": 2,
            "attention_head_dim": 16,
            "num_attention_heads": 3,
            "joint_attention_dim": 16,
            "guidance_embeds": False,
            "axes_dims_rope": [8, 4, 4],
        },
        what="the tests",
    ),
    "umt5_encoder:tiny": ModelSpec(
        "transformers",
        "UMT5EncoderModel",
        "UMT5Config",
        override={
            "vocab_size": 64,
            "d_model": 32,
            "d_kv": 8,
            "d_ff": 32,
            "num_layers": 2,
            "num_heads": 4,
            "relative_attention_num_buckets": 8,
            "pad_token_id": 0,
        },
        what="the tests (Wan's text encoder)",
    ),
    "mixtral:test": ModelSpec(
        "transformers",
        "MixtralForCausalLM",
        "MixtralConfig",
        override={**TINY_LM, "head_dim": 32, "intermediate_size": 16, "num_local_experts": 8, "num_experts_per_tok": 2},
        what="the tests",
    ),
    "gpt_oss:test": ModelSpec(
        "transformers",
        "GptOssForCausalLM",
        "GptOssConfig",
        override={
            **TINY_LM,
            "head_dim": 32,
            "intermediate_size": 16,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": 16,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
        what="the tests",
    ),
    # Multi-head latent attention (q/kv LoRA ranks), grouped routing, one dense layer first, a shared expert.
    "deepseek_v3:test": ModelSpec(
        "transformers",
        "DeepseekV3ForCausalLM",
        "DeepseekV3Config",
        override={
            **TINY_LM,
            "num_key_value_heads": 2,
            "intermediate_size": 64,
            "moe_intermediate_size": 16,
            "n_routed_experts": 8,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "n_group": 2,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "q_lora_rank": 16,
            "kv_lora_rank": 16,
            "qk_rope_head_dim": 16,
            "qk_nope_head_dim": 16,
            "v_head_dim": 32,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
        what="the tests",
    ),
    "llama:test": ModelSpec(
        "transformers",
        "LlamaForCausalLM",
        "LlamaConfig",
        override={**TINY_LM, "intermediate_size": 64},
        what="the tests",
    ),
    # A Llama on transformers' eager attention: what metal_attention routes to the Metal SDPA kernels on MPS 2.13-2.15
    # (models already on sdpa reach those kernels without mpsboost).
    "llama_eager:test": ModelSpec(
        "transformers",
        "LlamaForCausalLM",
        "LlamaConfig",
        base="llama:test",
        override={"attn_implementation": "eager"},
        what="the tests",
    ),
    # Gated DeltaNet hybrids: one DeltaNet layer, then one full-attention layer; two key heads shared by four value
    # heads (grouped values, as in Qwen3.6: 16 key / 32 value heads).
    "qwen3_5_moe:test": ModelSpec(
        "transformers",
        "Qwen3_5MoeForCausalLM",
        "Qwen3_5MoeTextConfig",
        override={**TINY_LM, **_GDN, "head_dim": 32, **_GDN_MOE},
        what="the tests (Qwen3.6-35B-A3B's classes)",
    ),
    "qwen3_5:test": ModelSpec(
        "transformers",
        "Qwen3_5ForCausalLM",
        "Qwen3_5TextConfig",
        override={**TINY_LM, **_GDN, "head_dim": 32, "intermediate_size": 64},
        what="the tests (dense)",
    ),
    "qwen3_next:test": ModelSpec(
        "transformers",
        "Qwen3NextForCausalLM",
        "Qwen3NextConfig",
        override={**TINY_LM, **_GDN, "head_dim": 32, "intermediate_size": 64, **_GDN_MOE},
        what="the tests (fused qkvz/ba projections)",
    ),
    "olmo_hybrid:test": ModelSpec(
        "transformers",
        "OlmoHybridForCausalLM",
        "OlmoHybridConfig",
        override={**TINY_LM, **_GDN, "intermediate_size": 64, "linear_allow_neg_eigval": True},
        what="the tests (separate projections, beta in [0, 2])",
    ),
    # Pipelines from precomputed prompt embeddings (no tokenizer).
    # Wan2.2 TI2V-5B's shape: one transformer, the z-48 VAE, expand_timesteps.
    "wan22_ti2v_pipeline:test": ModelSpec(
        "diffusers",
        "WanPipeline",
        components={
            "vae": "wan22_vae:tiny",
            "transformer": "wan22_transformer:tiny",
            "text_encoder": "umt5_encoder:tiny",
            "tokenizer": None,
            "transformer_2": None,
        },
        scheduler=("UniPCMultistepScheduler", _FLOW_UNIPC),
        override={"boundary_ratio": None, "expand_timesteps": True},
        what="the tests",
    ),
    # Wan2.2 T2V-A14B's shape: two transformers (high and low noise), the z-16 VAE.
    "wan22_a14b_pipeline:test": ModelSpec(
        "diffusers",
        "WanPipeline",
        components={
            "vae": "wan21_vae:tiny",
            "transformer": ("wan22_transformer:tiny", {"in_channels": 16, "out_channels": 16}),
            "transformer_2": ("wan22_transformer:tiny", {"in_channels": 16, "out_channels": 16}),
            "text_encoder": None,
            "tokenizer": None,
        },
        scheduler=("UniPCMultistepScheduler", _FLOW_UNIPC),
        override={"boundary_ratio": 0.875},
        what="the tests",
    ),
    "qwen_image_pipeline:test": ModelSpec(
        "diffusers",
        "QwenImagePipeline",
        components={
            "vae": "qwen_image_vae:tiny",
            "transformer": "qwen_image_transformer:tiny",
            "text_encoder": None,
            "tokenizer": None,
        },
        scheduler=("FlowMatchEulerDiscreteScheduler", {}),
        shape={"frames": 1},
        what="the tests",
    ),
}


#: The tests' zoo: the name a test builds (``tests/tiny_models.build(name)``) -> its row. The cross-model tests
#: (compatibility, reliability, properties) run every recipe on each of these that holds its targets.
ZOO: dict[str, str] = {
    "wan21_vae": "wan21_vae:tiny",
    "wan22_vae": "wan22_vae:tiny",
    "qwen_image_vae": "qwen_image_vae:tiny",
    "qwen_image21_vae": "qwen_image21_vae:test",
    "hunyuan_video_vae": "hunyuan_video_vae:tiny",
    "wan_transformer": "wan22_transformer:tiny",
    "qwen_image_transformer": "qwen_image_transformer:tiny",
    "qwen3_moe": "qwen3_moe:selftest",
    "mixtral": "mixtral:test",
    "gpt_oss": "gpt_oss:test",
    "deepseek_v3": "deepseek_v3:test",
    "qwen3": "qwen3:selftest",
    "llama": "llama:test",
    "llama_eager": "llama_eager:test",
    "qwen3_5_moe": "qwen3_5_moe:test",
    "umt5_encoder": "umt5_encoder:tiny",
    "wan22_ti2v_pipeline": "wan22_ti2v_pipeline:test",
    "wan22_a14b_pipeline": "wan22_a14b_pipeline:test",
    "qwen_image_pipeline": "qwen_image_pipeline:test",
}
#: diffusers' other video VAEs (the pad check of every VAE, ``tests/recipes/vae/test_video_vae_pad.py``): the name a
#: test uses -> its row and the input shape (batch, channels, frames, height, width) that runs every padding module.
VIDEO_VAES: dict[str, tuple[str, tuple[int, ...]]] = {
    "hunyuan_video": ("hunyuan_video_vae:tiny", (1, 3, 9, 32, 32)),
    "hunyuan_video15": ("hunyuan_video15_vae:tiny", (1, 3, 9, 32, 32)),
    "hunyuan_image_refiner": ("hunyuan_image_refiner_vae:tiny", (1, 3, 5, 32, 32)),
    "mochi": ("mochi_vae:tiny", (1, 3, 7, 16, 16)),
    "cogvideox": ("cogvideox_vae:tiny", (1, 3, 9, 32, 32)),
    "cosmos": ("cosmos_vae:tiny", (1, 3, 9, 32, 32)),
    "magvit": ("magvit_vae:tiny", (1, 3, 9, 32, 32)),
    "kvae_video": ("kvae_video_vae:tiny", (1, 3, 9, 32, 32)),
    "ltx2": ("ltx2_vae:tiny", (1, 3, 9, 64, 64)),
    "vidtok": ("vidtok_vae:tiny", (1, 3, 9, 32, 32)),
    "minimax_h3": ("minimax_h3_vae:tiny", (1, 3, 17, 32, 32)),
}


def _check_table() -> None:
    for name, spec in MODELS.items():
        family, sep, size = name.partition(":")
        if not (sep and family and size):
            raise ValueError(f"row {name!r}: a row is named family:size")
        if isinstance(spec.base, str) and spec.base not in MODELS:
            raise ValueError(f"row {name!r}: base {spec.base!r} is no row")
        for comp in spec.components.values():
            row = comp[0] if isinstance(comp, tuple) else comp
            if row is not None and row not in MODELS:
                raise ValueError(f"row {name!r}: component {row!r} is no row")
    for table, rows in (("ZOO", set(ZOO.values())), ("VIDEO_VAES", {row for row, _ in VIDEO_VAES.values()})):
        missing = sorted(rows - set(MODELS))
        if missing:
            raise ValueError(f"{table} names rows that MODELS lacks: {', '.join(missing)}")


_check_table()


def model_config(name: str) -> dict:
    """The config (keyword arguments of the model or config class) of row ``name`` of :data:`MODELS`, a fresh copy."""
    spec = MODELS.get(name)
    if spec is None:
        raise BenchError(f"no model {name!r} in mpsboost.bench.models.MODELS; known: {', '.join(MODELS)}")
    if spec.base is None:
        base: dict = {}
    elif isinstance(spec.base, str):
        base = model_config(spec.base)
    else:
        base = config(*spec.base)
    return json.loads(json.dumps({**base, **spec.override}))  # deep copy: callers may change lists in place


def build(name: str, *, device: Any = None, **override: Any) -> Any:
    """A model of row ``name`` with random weights (the caller seeds torch), ``override`` on top of its config.

    ``device``: create the parameters there directly (a real-size model never passes through host memory).
    """
    import contextlib
    import importlib

    spec = MODELS.get(name)
    if spec is None:
        model_config(name)  # raises the error naming the known rows
    cfg = {**model_config(name), **override}
    lib = importlib.import_module(spec.library)
    cls: Callable[..., Any] = getattr(lib, spec.model_class)
    if spec.components:
        parts: dict[str, Any] = {}
        for part, comp in spec.components.items():
            row, changed = comp if isinstance(comp, tuple) else (comp, {})
            parts[part] = None if row is None else build(row, device=device, **changed)
        if spec.scheduler is not None:
            sched_class, sched_kwargs = spec.scheduler
            parts["scheduler"] = getattr(lib, sched_class)(**sched_kwargs)
        return cls(**parts, **cfg)
    import torch

    with torch.device(device) if device is not None else contextlib.nullcontext():
        if spec.config_class is None:
            return cls(**cfg)
        return cls(getattr(lib, spec.config_class)(**cfg))
