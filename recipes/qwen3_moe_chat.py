#!/usr/bin/env python3
"""A transformers MoE model (Qwen3-MoE) generating text with mpsboost: stock vs patched.

With weights (network or a local copy):

    python recipes/qwen3_moe_chat.py --model Qwen/Qwen3-30B-A3B --device mps --dtype bfloat16 \\
        --prompt "Explain grouped matrix multiplication in two sentences." --new-tokens 64

Offline, real architecture with random weights (the qwen3_moe configs shipped with mpsboost):

    python recipes/qwen3_moe_chat.py --random-weights tiny            # seconds on a CPU (what CI runs)
    python recipes/qwen3_moe_chat.py --random-weights real --layers 8 --device mps   # Qwen3-30B-A3B shape,
                                                                                      # 8 of 48 layers

The job is ``generate()`` (greedy, or ``--sample``): prefill of the prompt, then one token at a time.
Operator times: the prefill forward and one decode step with a KV cache of the prompt (the cache is
cropped back after each step, so every call sees the same context). Correctness: the logits of the
patched model against the stock model on the stock model's generated sequence (teacher forcing), and
how many generated tokens agree. Random weights have no tokenizer: the prompt is random token ids.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: --help answers before torch loads
    import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

NAME = "qwen3_moe_chat"


def build(args, device: str, dtype: torch.dtype):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3MoeConfig

    size = args.random_weights or "real"
    run = C.config("qwen3_moe", size, "run.json")
    for key in ("prompt_tokens", "new_tokens"):
        if getattr(args, key) is not None:
            run[key] = getattr(args, key)
    if args.model is not None:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, device_map=device)
        return model.eval(), tokenizer, run
    cfg = C.config("qwen3_moe", size, "config.json")
    cfg.pop("model_type", None)
    theta = cfg.pop("rope_theta", None)
    if theta is not None:
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    if args.layers is not None:
        cfg["num_hidden_layers"] = args.layers
    config = Qwen3MoeConfig(**cfg)
    C.seeded(args.seed)
    with C.default_dtype(dtype), torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.to(device).eval(), None, run


def prompt_ids(args, tokenizer, run: dict, vocab: int, device: str) -> torch.Tensor:
    import torch

    if tokenizer is not None:
        messages = [{"role": "user", "content": args.prompt}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, return_tensors="pt").input_ids.to(device)
    g = torch.Generator().manual_seed(args.seed + 1)
    return torch.randint(3, vocab, (run["batch"], run["prompt_tokens"]), generator=g).to(device)


def main(argv=None) -> int:
    p = C.parser(__doc__.splitlines()[0], default_model="Qwen/Qwen3-30B-A3B", benchmarks=("moe_experts",))
    p.add_argument(
        "--prompt",
        default="Explain in two sentences why grouped matrix multiplication helps mixture-of-experts models.",
    )
    p.add_argument("--prompt-tokens", type=int, default=None, help="random-weights prompt length")
    p.add_argument("--new-tokens", type=int, default=None)
    p.add_argument("--layers", type=int, default=None, help="random weights: build only this many decoder layers")
    p.add_argument(
        "--sample", action="store_true", help="sample (temperature 0.7, top-p 0.8) instead of greedy decoding"
    )
    args = p.parse_args(argv)
    import torch

    device, dtype = C.resolve(args)
    import mpsboost

    with C.timed("build"):
        model, tokenizer, run = build(args, device, dtype)
    ids = prompt_ids(args, tokenizer, run, model.config.vocab_size, device)
    new = run["new_tokens"]
    gen_kw = dict(
        max_new_tokens=new, min_new_tokens=new, do_sample=args.sample, pad_token_id=model.config.pad_token_id or 0
    )
    if args.sample:
        gen_kw.update(temperature=0.7, top_p=0.8)
    mask = torch.ones_like(ids)

    def job() -> torch.Tensor:
        torch.manual_seed(args.seed)
        return model.generate(ids, attention_mask=mask, **gen_kw)

    def ops() -> dict:
        from transformers import DynamicCache

        # transformers >= 5.2x calls the cache argument `cache` (past_key_values is deprecated there).
        key = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=ids, use_cache=True, **{key: cache})
        last = ids[:, -1:]

        def decode_step():
            out = model(input_ids=last, use_cache=True, **{key: cache})
            cache.crop(-1)  # drop the token just added: every timed call sees the same context
            return out.logits

        return {"prefill": lambda: model(input_ids=ids, use_cache=False).logits, "decode step": decode_step}

    common = dict(
        device=device, repeats=args.repeats, warmup=args.warmup, items_per_call=new * ids.shape[0], unit="tokens/s"
    )

    C.print_plans(model, args.plan, args.fp8)
    stock = C.measure("stock", job, ops=ops(), **common)
    seq = stock.output.to(device=device, dtype=torch.long)
    with torch.no_grad():
        stock.output = model(input_ids=seq).logits.float().cpu()
    stock_tokens = seq
    report = mpsboost.patch(model, fp8=args.fp8)
    patched = C.measure("mpsboost", job, ops=ops(), **common)
    patched_tokens = patched.output.to(device=device, dtype=torch.long)
    with torch.no_grad():
        patched.output = model(input_ids=seq).logits.float().cpu()
    agree = (patched_tokens[:, ids.shape[1] :] == stock_tokens[:, ids.shape[1] :]).float().mean().item()
    patched.extra["generated_tokens_equal_to_stock"] = agree
    if tokenizer is not None:
        print("stock:    " + tokenizer.decode(stock_tokens[0, ids.shape[1] :], skip_special_tokens=True))
        print("mpsboost: " + tokenizer.decode(patched_tokens[0, ids.shape[1] :], skip_special_tokens=True))
    shape = {
        "batch": ids.shape[0],
        "prompt_tokens": ids.shape[1],
        "new_tokens": new,
        "layers": model.config.num_hidden_layers,
        "experts": model.config.num_experts,
        "top_k": model.config.num_experts_per_tok,
        "sample": args.sample,
        "weights": args.model or f"random ({args.random_weights})",
    }
    recs = C.records(NAME, shape, device, dtype, stock, patched, psnr=False)
    print(f"generated tokens equal to stock: {agree:.0%}")
    return C.finish(NAME, args, report, recs)


if __name__ == "__main__":
    sys.exit(main())
