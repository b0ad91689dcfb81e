"""The models that mpsboost's measurements build, in one place: the shipped configs and the small ones.

Two kinds of config, one table:

* the shipped JSON files under ``configs/<family>/<size>/<file>.json`` (``real``: the published config of
  Wan2.2-TI2V-5B, Qwen-Image, Qwen3-30B-A3B, Qwen3-8B, Qwen3.6-35B-A3B, each naming its source; ``tiny``:
  the same structure at toy width), read by :func:`config`. The recipe scripts (``recipes/``), the end-to-end
  benchmark and the fp8 load benchmark build from them;
* the reduced configs of the demo, the selftest and the recipe benchmarks, each written once in
  :data:`MODELS` as a row: family, the classes, and the config (a shipped file with fields changed, or
  written out here), read by :func:`model_config` and built by :func:`build`.

Nothing here imports diffusers or transformers until a model is built. Weights are random: these
models exercise every kernel at their shapes; their outputs are noise.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .errors import BenchError

__all__ = [
    "CONFIGS",
    "MODELS",
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


@dataclass(frozen=True)
class ModelSpec:
    """One model of the table: the library and classes that build it, and where its config comes from.

    ``base`` names a shipped file (family, size, file) or another row (``"wan22_vae:tiny"``) whose config
    ``override`` changes; without a base, ``override`` is the whole config.
    """

    library: str  # "diffusers" or "transformers"
    model_class: str
    config_class: str | None = None  # transformers: the config class; diffusers takes keyword arguments
    base: tuple[str, str, str] | str | None = None
    override: dict = field(default_factory=dict)
    what: str = ""


def _latents(z_dim: int) -> dict:
    # Random weights have no latent statistics: mean 0, std 1 (what the shipped files say too).
    return {"latents_mean": [0.0] * z_dim, "latents_std": [1.0] * z_dim}


# The small transformers LM the selftest's recipe checks share (every attention path applies at head_dim 32).
_SELFTEST_LM = {
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
    "qwen_image_vae:tiny": ModelSpec("diffusers", "AutoencoderKLQwenImage", base=("qwen_image", "tiny", "vae.json")),
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
            **_SELFTEST_LM,
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
        override={**_SELFTEST_LM, "head_dim": 32, "intermediate_size": 64},
    ),
    # head_dim 64 (a Metal kernel size), grouped K/V (4 heads, 2 K/V heads), eager attention.
    "llama_eager:selftest": ModelSpec(
        "transformers",
        "LlamaForCausalLM",
        "LlamaConfig",
        override={
            **_SELFTEST_LM,
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
    "wan22_transformer:docs": ModelSpec(
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
        what="the support tables (mpsboost.docs.SAMPLES)",
    ),
}


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
    import torch

    with torch.device(device) if device is not None else contextlib.nullcontext():
        if spec.config_class is None:
            return cls(**cfg)
        return cls(getattr(lib, spec.config_class)(**cfg))
