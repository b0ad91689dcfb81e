"""Tiny instances of every MoE experts class the moe_experts recipe covers (random weights)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import inspect
import torch


@dataclass
class Case:
    name: str
    module: torch.nn.Module
    hidden: int
    num_experts: int
    top_k: int
    call: Callable  # (module, x[N, H], idx[N, k], w[N, k]) -> out[N, H]


def _init(module: torch.nn.Module, std: float = 0.2) -> torch.nn.Module:
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, std)
    return module.eval()


def _experts_call(m, x, idx, w):
    """The module's call; unpatched, transformers' eager implementation (the reference).

    The config keeps transformers' default (``grouped_mm``) so that the recipe applies: an explicit
    choice in the config would make it step aside. The reference sets ``eager`` for one call only.
    """
    cfg = getattr(m, "config", None)
    if cfg is None or "forward" in m.__dict__:
        return m(x, idx, w)
    prev = cfg._experts_implementation_internal
    cfg._experts_implementation_internal = "eager"
    try:
        return m(x, idx, w)
    finally:
        cfg._experts_implementation_internal = prev


def build(
    name: str,
    *,
    hidden: int = 32,
    inter: int = 16,
    experts: int = 8,
    top_k: int = 2,
    dtype: torch.dtype = torch.float32,
) -> Case:
    import transformers as T

    if name == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts as C

        cfg = T.Qwen3MoeConfig(
            hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts, num_experts_per_tok=top_k
        )
    elif name == "qwen3_5_moe":
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeExperts as C

        cfg = T.Qwen3_5MoeTextConfig(
            hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts, num_experts_per_tok=top_k
        )
    elif name == "qwen3_next":
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextExperts as C

        cfg = T.Qwen3NextConfig(
            hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts, num_experts_per_tok=top_k
        )
    elif name == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts as C

        cfg = T.MixtralConfig(
            hidden_size=hidden, intermediate_size=inter, num_local_experts=experts, num_experts_per_tok=top_k
        )
    elif name == "deepseek_v3":
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts as C

        cfg = T.DeepseekV3Config(
            hidden_size=hidden, moe_intermediate_size=inter, n_routed_experts=experts, num_experts_per_tok=top_k
        )
    elif name == "gpt_oss":
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts as C

        cfg = T.GptOssConfig(
            hidden_size=hidden, intermediate_size=inter, num_local_experts=experts, num_experts_per_tok=top_k
        )
    elif name == "step3p7":
        from transformers.models.step3p7.modeling_step3p7 import Step3p7Experts as C

        cfg = T.Step3p7TextConfig(
            hidden_size=hidden, moe_intermediate_size=inter, num_local_experts=experts, num_experts_per_tok=top_k
        )
        if "layer_idx" in inspect.signature(C.__init__).parameters:  # transformers >= 5.25: the limit per layer
            cfg.swiglu_limits = [7.0] * cfg.num_hidden_layers
            m = _init(C(cfg, 0)).to(dtype)
        else:
            m = _init(C(cfg, swiglu_limit=7.0)).to(dtype)
        assert m.limit == 7.0
        return Case(name, m, hidden, experts, top_k, _experts_call)
    elif name == "dbrx":
        from transformers.models.dbrx.configuration_dbrx import DbrxFFNConfig
        from transformers.models.dbrx.modeling_dbrx import DbrxExperts as C

        cfg = DbrxFFNConfig(hidden_size=hidden, ffn_hidden_size=inter, moe_num_experts=experts, moe_top_k=top_k)
        m = _init(C(cfg)).to(dtype)
        return Case(name, m, hidden, experts, top_k, lambda m, x, idx, w: m(x, idx, w).reshape(x.shape))
    else:
        raise KeyError(name)
    return Case(name, _init(C(cfg)).to(dtype), hidden, experts, top_k, _experts_call)


HF_NAMES = ("qwen3_moe", "qwen3_5_moe", "qwen3_next", "mixtral", "deepseek_v3", "gpt_oss")
LEGACY_NAMES = ("step3p7", "dbrx")
ALL_NAMES = HF_NAMES + LEGACY_NAMES


def routing(n: int, experts: int, top_k: int, *, scenario: str = "random", dtype=torch.float32):
    """[n, k] expert ids (distinct per token) and weights for one routing scenario."""
    if scenario == "random":
        idx = torch.rand(n, experts).argsort(dim=-1)[:, :top_k]
    elif scenario == "zero_tokens":  # only the first top_k experts are ever hit; the rest get none
        idx = torch.stack([torch.randperm(top_k) for _ in range(n)])
    elif scenario == "one_expert_all":  # expert 3 in every token's top-k
        rest = (
            torch.stack([torch.randperm(experts - 1)[: top_k - 1] for _ in range(n)])
            if top_k > 1
            else torch.empty(n, 0, dtype=torch.long)
        )
        rest = rest + (rest >= 3).long()
        idx = torch.cat([torch.full((n, 1), 3, dtype=torch.long), rest], dim=1)
    else:
        raise KeyError(scenario)
    w = torch.rand(n, top_k).softmax(dim=-1).to(dtype)
    return idx, w


def tiny_causal_lm(kind: str = "qwen3_moe", *, dtype: torch.dtype = torch.float32, experts: int = 8, top_k: int = 2):
    """A 2-layer causal LM with random weights: ``qwen3_moe`` or ``jetmoe``."""
    import transformers as T

    if kind == "qwen3_moe":
        cfg = T.Qwen3MoeConfig(
            vocab_size=96,
            hidden_size=32,
            intermediate_size=48,
            moe_intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            num_experts=experts,
            num_experts_per_tok=top_k,
            max_position_embeddings=128,
        )
    elif kind == "jetmoe":
        cfg = T.JetMoeConfig(
            vocab_size=96,
            hidden_size=32,
            num_hidden_layers=2,
            num_key_value_heads=2,
            kv_channels=8,
            intermediate_size=16,
            num_local_experts=experts,
            num_experts_per_tok=top_k,
            max_position_embeddings=128,
        )
    else:
        raise KeyError(kind)
    model = T.AutoModelForCausalLM.from_config(cfg)
    return _init(model, 0.3).to(dtype)
