"""Tiny MLX checkpoints written by mlx-lm itself (its model classes, ``sanitize``, ``quantize_model`` and
``save_model``: what ``mlx_lm.convert`` does, without the tokenizer), and mlx-lm's forward of a folder.

mlx and mlx-lm are optional test dependencies (the ``test`` extra installs them where wheels exist: Linux x86-64,
macOS arm64); where ``import mlx`` fails, the tests that need them skip saying so.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

try:  # mlx is an optional test dependency: skip (with the reason) only where it cannot be imported
    import mlx.core as mx
    import mlx.nn  # noqa: F401
    from mlx.utils import tree_map_with_path
    from mlx_lm import utils as mlx_utils

    MLX_ERROR = ""
except ImportError as _exc:  # pragma: no cover - where mlx has no wheel
    MLX_ERROR = f"mlx / mlx-lm cannot be imported here ({_exc}); install the test extra (mlx[cpu] on Linux x86-64)"

needs_mlx = pytest.mark.skipif(bool(MLX_ERROR), reason=MLX_ERROR or "mlx present")

COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)
_GDN = dict(
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
    layer_types=["linear_attention", "full_attention"],
    full_attention_interval=2,  # mlx-lm reads the interval, transformers the layer types
)
_MOE = dict(moe_intermediate_size=64, shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2)

# family -> (config class, model class, config fields): widths multiples of 128 where a group of 128 must fit.
FAMILIES: dict[str, tuple[str, str, dict]] = {
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(head_dim=32, **_GDN, **_MOE)),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(head_dim=32, intermediate_size=128, **_GDN)),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(head_dim=32, intermediate_size=128, **_GDN, **_MOE)),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(head_dim=32, intermediate_size=128, moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2),
    ),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, intermediate_size=128)),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(head_dim=32, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2),
    ),
    "olmoe": (
        "OlmoeConfig",
        "OlmoeForCausalLM",
        dict(intermediate_size=64, num_experts=4, num_experts_per_tok=2, eos_token_id=2, pad_token_id=1),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            intermediate_size=128,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
            num_experts=4,
            num_experts_per_tok=2,
        ),
    ),
}
MULTIMODAL = {"qwen3_5_moe": "qwen3_5_moe", "qwen3_5": "qwen3_5"}


def hf_model(family: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """The tiny transformers model of ``family`` (float32, random weights; norms random too, so that a norm stored
    +1 and not undone shows)."""
    import transformers as t

    cfg_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    model = getattr(t, model_cls)(getattr(t, cfg_cls)(**{**COMMON, **extra, **overrides})).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.normal_(0.0, 0.2)  # zero-centred norms (Qwen3.5/3.6, Qwen3-Next) and plain ones alike
            elif "experts" in name or name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.15)  # experts and routers that matter: a routing or weighting fault shows
    return model


def checkpoint_weights(family: str, model: torch.nn.Module, tmp: Path) -> tuple[dict, dict]:
    """(the weights under the keys a published checkpoint has, its config.json) of ``model``."""
    if family in MULTIMODAL:
        # Qwen3.5/3.6 publish the multimodal model: model.language_model.*, lm_head.weight (experts fused).
        sd = {}
        for k, v in model.state_dict().items():
            if k == "lm_head.weight" and model.config.tie_word_embeddings:
                continue
            sd[k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k] = v
        text = model.config.to_dict()
        cfg = {
            "model_type": MULTIMODAL[family],
            "text_config": text,
            "tie_word_embeddings": text["tie_word_embeddings"],
        }
        return sd, cfg
    model.save_pretrained(tmp / "hf")  # transformers writes the per-expert layout the published checkpoints have
    from safetensors.torch import load_file

    sd = load_file(str(tmp / "hf" / "model.safetensors"))
    cfg = json.loads((tmp / "hf" / "config.json").read_text())
    # Published configs of these families (and mlx-lm's ModelArgs) carry these fields at the top level.
    rope = getattr(model.config, "rope_parameters", None) or {}
    cfg.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
    cfg.setdefault("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
    for k in ("num_experts", "num_local_experts"):
        if hasattr(model.config, k):
            cfg.setdefault(k, getattr(model.config, k))
    return sd, cfg


def write_mlx(
    family: str,
    folder: Path,
    *,
    bits: int = 4,
    group_size: int = 64,
    dtype: str = "float32",
    seed: int = 0,
    predicate: Any = None,
    **overrides: Any,
) -> torch.nn.Module:
    """mlx-lm's conversion of the tiny ``family`` model into ``folder`` (its default quant predicate: MoE routers at
    8 bits); returns the transformers model it came from."""
    model = hf_model(family, seed, **overrides)
    with tempfile.TemporaryDirectory() as tmp:
        sd, config = checkpoint_weights(family, model, Path(tmp))
    model_class, args_class = mlx_utils._get_classes(config=config)
    mm = model_class(args_class.from_dict(config))
    weights = {k: mx.array(v.float().numpy()) for k, v in sd.items()}
    weights = mm.sanitize(weights)
    mm.load_weights(list(weights.items()))
    target = getattr(mx, dtype)
    cast = getattr(mm, "cast_predicate", lambda _: True)
    mm.update(
        tree_map_with_path(
            lambda k, v: v.astype(target) if cast(k) and mx.issubdtype(v.dtype, mx.floating) else v, mm.parameters()
        )
    )
    mm, config = mlx_utils.quantize_model(mm, config, group_size, bits, quant_predicate=predicate)
    mlx_utils.save_model(folder, mm)
    mlx_utils.save_config(config, config_path=folder / "config.json")
    return model


def mlx_model(folder: Path):
    """mlx-lm's model of ``folder``, its floating tensors cast to float32 (``gather_qmm`` needs float32 on the CPU)."""
    mm, _ = mlx_utils.load_model(Path(folder))
    mm.update(
        tree_map_with_path(
            lambda k, v: v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v, mm.parameters()
        )
    )
    return mm


def mlx_logits(mm, ids: torch.Tensor) -> torch.Tensor:
    out = mm(mx.array(ids.numpy()))
    return torch.from_numpy(__import__("numpy").array(out.astype(mx.float32)))


def mlx_greedy(mm, ids: torch.Tensor, steps: int, last: list | None = None) -> list[int]:
    """Greedy tokens with mlx-lm's cache; ``last`` gets the logits of the last one-token (decode) step."""
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(mm)
    toks: list[int] = []
    x = mx.array(ids.numpy())
    for _ in range(steps):
        logits = mm(x, cache=cache)
        nxt = int(mx.argmax(logits[0, -1]).item())
        toks.append(nxt)
        x = mx.array([[nxt]])
    if last is not None:
        last.append(torch.from_numpy(np.array(logits[0, -1].astype(mx.float32))))
    return toks


def torch_greedy(model, ids: torch.Tensor, steps: int, last: list | None = None) -> list[int]:
    toks: list[int] = []
    with torch.no_grad():
        out = model(ids, use_cache=True)
        for i in range(steps):
            nxt = int(out.logits[0, -1].argmax())
            toks.append(nxt)
            if i == steps - 1:
                break
            out = model(torch.tensor([[nxt]]), cache=out.past_key_values, use_cache=True)
    if last is not None:
        last.append(out.logits[0, -1].float())
    return toks
