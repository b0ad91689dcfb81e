"""fp8_budget: the memory budget of Qwen3.6-35B-A3B-FP8 on a 64 GB Mac, computed from the model's config.

No weights are read: the text model (``Qwen3_5MoeForCausalLM``) is built on the meta device from the shipped
config (``mpsboost/bench/configs/qwen3_5_moe/real/config.json``, the published ``text_config``) and every tensor
is sorted by what the published checkpoint ``Qwen/Qwen3.6-35B-A3B-FP8`` stores it as: fp8 codes with 128x128
block scales (every linear layer and expert stack but those of ``modules_to_not_convert``), or bf16 (embeddings,
``lm_head``, norms, the router, ``shared_expert_gate``, ``in_proj_a``/``in_proj_b``, the convolution; ``A_log``
float32). Caches and activations follow from the same config (bf16 compute; the DeltaNet recurrent state float32).

    python benchmarks/fp8_budget.py            # prints the table (markdown)
    python benchmarks/fp8_budget.py --check    # exit 1 if docs/fp8-checkpoints.md holds another table

docs/fp8-checkpoints.md holds this script's output between ``<!-- fp8-budget:begin -->`` and ``-end -->``; a test
checks that they are equal.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "fp8-checkpoints.md"
BEGIN, END = "<!-- fp8-budget:begin -->", "<!-- fp8-budget:end -->"
BLOCK = 128
# Published modules_to_not_convert of Qwen3.6-35B-A3B-FP8 (per layer), besides embeddings and lm_head.
BF16_LINEARS = ("mlp.gate", "mlp.shared_expert_gate", "linear_attn.in_proj_a", "linear_attn.in_proj_b")
CONTEXTS = (8192, 32768)
PREFILL_CHUNK = 2048  # prompt tokens per forward call when a long prompt is prefilled in chunks
GiB = 1 << 30


def _config() -> dict:
    sys.path.insert(0, str(ROOT / "src"))
    from mpsboost.bench.models import read_config

    return read_config("qwen3_5_moe", "real", "config.json")


def _meta_model(cfg: dict):
    import torch
    import transformers as t

    keep = {k: v for k, v in cfg.items() if not k.startswith("_") and k not in ("architectures", "model_type")}
    with torch.device("meta"):
        return t.Qwen3_5MoeForCausalLM(t.Qwen3_5MoeTextConfig(**keep))


def budget(cfg: dict | None = None) -> dict:
    """Bytes of every line of the table (see :func:`table`)."""
    import torch

    cfg = cfg or _config()
    model = _meta_model(cfg)
    fp8_codes = scales_block = scales_row = bf16 = 0
    largest = 0
    for name, mod in model.named_modules():
        if type(mod) is torch.nn.Linear and not name.endswith(BF16_LINEARS) and name != "lm_head":
            n, k = mod.weight.shape
            fp8_codes += n * k
            scales_block += math.ceil(n / BLOCK) * math.ceil(k / BLOCK) * 4  # float32 in memory
            scales_row += n * 4
            continue
        if name.endswith("experts") and hasattr(mod, "gate_up_proj"):
            for w in (mod.gate_up_proj, mod.down_proj):
                e, n, k = w.shape
                fp8_codes += e * n * k
                scales_block += e * math.ceil(n / BLOCK) * math.ceil(k / BLOCK) * 4
                scales_row += e * n * 4
            continue
        tensors = list(mod.named_parameters(recurse=False)) + list(mod.named_buffers(recurse=False))
        for pname, p in tensors:
            size = p.numel() * (4 if pname == "A_log" else 2)  # A_log float32 as published, the rest bf16
            bf16 += size
            largest = max(largest, size)
    params_bf16 = sum(p.numel() for p in model.parameters()) * 2
    buffers = sum(t.numel() for t in model.buffers()) * 2  # rotary tables: computed, in memory, not in the file
    layers = cfg["num_hidden_layers"]
    n_full = layers // cfg["full_attention_interval"]
    n_lin = layers - n_full
    kv_per_token = n_full * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 2
    hv, dk, dv = cfg["linear_num_value_heads"], cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    conv_dim = 2 * cfg["linear_num_key_heads"] * dk + hv * dv
    recurrent = n_lin * (hv * dk * dv * 4 + conv_dim * cfg["linear_conv_kernel_dim"] * 2)
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    # Decode: a few [1, H]-sized tensors per layer and the logits row in float32; the largest transient is
    # the routed experts' gathered fp8 codes of one layer (8 experts x 3 x I x H bytes).
    k_, inter = cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]
    decode_act = vocab * 4 + k_ * 3 * inter * h + 64 * h * 4
    prefill = {}
    for ctx in CONTEXTS:
        q = min(ctx, PREFILL_CHUNK)
        # Eager attention of one full-attention layer: scores and their softmax, [heads, q, ctx] in bf16; the
        # MoE block of one layer: the routed rows' [q * k, 2I] and [q * k, I] in bf16 and [q * k, H] outputs.
        scores = 2 * cfg["num_attention_heads"] * q * ctx * 2
        moe = q * k_ * (3 * inter + h) * 2
        prefill[ctx] = max(scores, moe) + 8 * q * h * 2
    return {
        "fp8_codes": fp8_codes,
        "scales_block": scales_block,
        "scales_row": scales_row,
        "bf16_kept": bf16,
        "largest_bf16": largest,
        "params_bf16": params_bf16,
        "buffers": buffers,
        "kv_per_token": kv_per_token,
        "recurrent": recurrent,
        "decode_act": decode_act,
        "prefill": prefill,
        "layers": layers,
        "n_full": n_full,
        "n_lin": n_lin,
    }


def _g(b: float) -> str:
    return f"{b / GiB:.2f}"


def table(b: dict | None = None) -> str:
    """The markdown table of docs/fp8-checkpoints.md (GiB = 2^30 bytes)."""
    b = b or budget()
    weights_exact = b["fp8_codes"] + b["scales_block"] + b["bf16_kept"]
    weights_row = b["fp8_codes"] + b["scales_row"] + b["bf16_kept"]
    rows = [
        ("fp8 weights: codes, 1 byte each", b["fp8_codes"], b["fp8_codes"], "-"),
        ("fp8 scales, float32 in memory", b["scales_block"], b["scales_row"], "-"),
        (
            "modules the file keeps in bf16 (embeddings, lm_head, router, norms, ...)",
            b["bf16_kept"],
            b["bf16_kept"],
            "-",
        ),
        ("weights in all", weights_exact, weights_row, b["params_bf16"]),
    ]
    lines = [
        '| GiB (2^30 bytes) | fp8 file, block scales kept (exact) | `load_fp8(..., requantize="rowwise")` '
        "| the same model in bf16 |",
        "|---|---|---|---|",
    ]
    for label, a, r, bf in rows:
        lines.append(f"| {label} | {_g(a)} | {_g(r)} | {bf if isinstance(bf, str) else _g(bf)} |")
    state = b["recurrent"]
    lines.append(
        f"| DeltaNet state, {b['n_lin']} layers (recurrent float32 + conv bf16), any context | {_g(state)} "
        f"| {_g(state)} | {_g(state)} |"
    )
    for ctx in CONTEXTS:
        kv = b["kv_per_token"] * ctx
        lines.append(
            f"| KV cache at {ctx // 1024}k tokens ({b['n_full']} layers, bf16) | {_g(kv)} | {_g(kv)} | {_g(kv)} |"
        )
    lines.append(
        f"| activations, decode (one token; the largest transient: one layer's gathered expert codes) "
        f"| {_g(b['decode_act'])} | {_g(b['decode_act'])} | {_g(b['decode_act'])} |"
    )
    for ctx in CONTEXTS:
        a = b["prefill"][ctx]
        lines.append(
            f"| activations, prefill of a {ctx // 1024}k prompt in {min(ctx, PREFILL_CHUNK)}-token chunks "
            f"(one layer's scores and softmax) | {_g(a)} | {_g(a)} | {_g(a)} |"
        )
    for ctx in CONTEXTS:
        extra = b["recurrent"] + b["kv_per_token"] * ctx + b["prefill"][ctx]
        lines.append(
            f"| **total at {ctx // 1024}k context** | **{_g(weights_exact + extra)}** | **{_g(weights_row + extra)}** "
            f"| **{_g(b['params_bf16'] + extra)}** |"
        )
    # load_fp8 reads one tensor at a time into its final buffer: the model plus the largest tensor in flight
    # (unified memory: the host copy and the device copy are the same RAM). requantize adds a 16M-weight float32
    # slice; bf16 + convert holds the whole bf16 model first.
    slice_ = (1 << 24) * 4
    lines.append(
        f"| load peak (the model plus the largest tensor in flight) | {_g(weights_exact + b['largest_bf16'])} "
        f"| {_g(weights_row + b['largest_bf16'] + slice_)} | {_g(b['params_bf16'] + b['largest_bf16'])} |"
    )
    return "\n".join(lines) + "\n"


def doc_section() -> str:
    text = DOC.read_text()
    i, j = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[i:j].strip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="compare with docs/fp8-checkpoints.md")
    p.add_argument("--json", action="store_true", help="print the raw byte counts")
    a = p.parse_args(argv)
    if a.json:
        print(json.dumps(budget(), indent=2))
        return 0
    t = table()
    if a.check:
        if doc_section() != t:
            print("docs/fp8-checkpoints.md: the budget table differs from this script's output", file=sys.stderr)
            return 1
        return 0
    print(t, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
