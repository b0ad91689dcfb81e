"""softmax: the token-sampling step of generation, stock vs mpsboost.

Three workloads, device-synchronised, variants of one workload timed in alternating rounds
(:func:`mpsboost.bench.harness.measure_variants`, 5 rounds, min/median/max kept):

* ``softmax.row``: one fp32 row of 128,256 logits through ``F.softmax``, stock only (the recipe does not
  change ``torch.softmax``; a second variant would time the very same call);
* ``softmax.sampling_step``: logits -> ``softmax`` -> one multinomial draw, and the same after
  transformers' warpers (temperature 0.6, top-k 20, top-p 0.95, as Qwen3's generation config); stock
  is ``torch.multinomial``; ``mpsboost`` is the sync-free draw the recipe installs
  (:mod:`mpsboost.ops.sampling`), called directly, in the form the recipe's own decision picks on this env
  (after the softmax, or on the logits); the other form is recorded as ``mpsboost-probs`` /
  ``mpsboost-logits``. One sample is a loop of steps between device syncs, so the host syncs inside
  ``torch.multinomial`` count as they do in generation;
* ``softmax.generate`` (``size="real"``): ``generate(do_sample=True)`` of a Qwen3-0.6B-shaped model with
  random bf16 weights, 48 new tokens: the stock model against a copy patched by
  ``mpsboost.patch(model, recipes=["softmax"])``, whose report row (the path it chose) goes into the record;
  the same seed must give the same tokens.

Correctness: the draws of stock and mpsboost from the same generator state are compared token by token.

    python benchmarks/softmax.py --device cuda --size real --out OUT
"""

from __future__ import annotations

from pathlib import Path

import torch

from mpsboost.bench import Correctness, Record, RecordEnv, Workload, time_fn
from mpsboost.bench.harness import measure_variants
from mpsboost.ops.sampling import draw, draw_from_logits

VOCAB = 128256
NEW = 48  # new tokens per generate() call


def _logits(rows: int, vocab: int, device: str) -> torch.Tensor:
    # Real logits come out of a bf16 lm_head: bf16-quantised values, a few dominant tokens.
    x = torch.randn(rows, vocab, device=device) * 2.5
    x[:, :16] += 8.0
    return x.to(torch.bfloat16).to(torch.float32)


def _warpers():
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    return LogitsProcessorList([TemperatureLogitsWarper(0.6), TopKLogitsWarper(20), TopPLogitsWarper(0.95)])


def _recipe_uses_logits(device: str) -> bool:
    """Which form the softmax recipe picks on this env (asked from its own decision, on a meta model)."""
    import mpsboost
    from mpsboost.gate import Env
    from transformers import Qwen3Config, Qwen3ForCausalLM

    with torch.device("meta"):
        model = Qwen3ForCausalLM(
            Qwen3Config(
                vocab_size=64,
                hidden_size=32,
                intermediate_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=1,
                head_dim=16,
            )
        )
    (row,) = mpsboost.plan(model, env=Env.detect(device), recipes=["softmax"]).rows
    return bool(row.details.get("logits", False))


def run(device: str, size: str, out: Path) -> list[Record]:
    env = RecordEnv.capture(device, torch.float32)
    vocab = VOCAB if size != "tiny" else 4096
    steps = {"tiny": 20, "small": 100, "real": 200}[size]
    repeats = 5
    records: list[Record] = []
    lines = []
    torch.manual_seed(0)
    x = _logits(1, vocab, device)
    input_ids = torch.zeros(1, 8, dtype=torch.long, device=device)

    # 1. the micro-benchmark: one fp32 row through softmax
    # (stock only: the recipe does not change torch.softmax, so an "mpsboost" row would time the same call)
    wl = Workload("softmax.row", {"rows": 1, "vocab": vocab, "dtype": "float32"})
    t = time_fn(lambda: torch.softmax(x, dim=-1), device=device, warmup=5, repeats=repeats * 4, calls=50)
    records.append(Record(wl, "stock", env, op_time={"softmax": t.op_time()}, extra={"path": "native softmax"}))
    lines.append(("softmax row", "stock", t.median_us))

    # 2. the sampling step, with and without warpers; "mpsboost" is the form the recipe picks on this env
    warp = _warpers()
    logits_here = _recipe_uses_logits(device)
    forms = {
        "probs": lambda s: draw(torch.softmax(s, dim=-1))[0],
        "logits": lambda s: draw_from_logits(s)[0],
    }

    def stock_step(s):
        return torch.multinomial(torch.softmax(s, dim=-1), num_samples=1)

    for name in ("plain", "warped"):
        prep = (lambda: warp(input_ids, x)) if name == "warped" else (lambda: x)
        wl = Workload(
            "softmax.sampling_step",
            {
                "rows": 1,
                "vocab": vocab,
                "warpers": "temperature 0.6, top-k 20, top-p 0.95" if name == "warped" else "none",
            },
        )
        variants = {"stock": stock_step}
        for form, fn in forms.items():
            variants["mpsboost" if (form == "logits") == logits_here else f"mpsboost-{form}"] = fn
        checks = {}
        for variant, fn in variants.items():
            # same generator state -> same tokens as torch.multinomial?
            same, n_check = 0, 200
            for i in range(n_check):
                torch.manual_seed(1000 + i)
                a = stock_step(prep())
                torch.manual_seed(1000 + i)
                b = fn(prep())
                same += int(torch.equal(a, b))
            checks[variant] = (same, n_check)
        m = measure_variants(
            {v: (lambda fn=fn: fn(prep())) for v, fn in variants.items()},
            device=device,
            repeats=repeats,
            warmup=3,
            calls=steps,
        )
        for variant, fn in variants.items():
            same, n_check = checks[variant]
            t = m.timings[variant]
            path = (
                "torch.multinomial"
                if variant == "stock"
                else f"sync-free exponential race on {'logits' if fn is forms['logits'] else 'probs'}"
            )
            extra = {"identical_draws": f"{same}/{n_check}", "path": path, **m.extra(variant)}
            if variant != "stock":
                # The draw the recipe installs, called directly (the recipe's own decision picks the form
                # for "mpsboost"); the whole generate() below goes through patch().
                extra["measured_through"] = "the installed draw, called directly"
            records.append(
                Record(
                    wl,
                    variant,
                    env,
                    throughput=t.throughput(items_per_call=1, unit="steps/s"),
                    correctness=Correctness("stock, same generator state", rel_error=1.0 - same / n_check),
                    extra=extra,
                )
            )
            lines.append((f"step {name}", variant, t.median_us))

    if size == "real" and device.startswith("cuda"):
        records += _generate(device, lines)

    print(f"\n{'workload':14s} {'variant':16s} {'us':>10s}")
    for w, v, us in lines:
        print(f"{w:14s} {v:16s} {us:10.2f}")
    return records


def _generate(device: str, lines: list, repeats: int = 5) -> list[Record]:
    """Whole eager ``generate()``: the stock model and a copy patched by ``mpsboost.patch()``, alternating."""
    import copy

    import mpsboost
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    with torch.device(device):
        stock = Qwen3ForCausalLM(cfg).to(torch.bfloat16).eval()
    patched = copy.deepcopy(stock)
    report = mpsboost.patch(patched, recipes=["softmax"])
    row = report.rows_for("softmax")[0]
    gen = GenerationConfig(
        do_sample=True, temperature=0.6, top_k=20, top_p=0.95, max_new_tokens=NEW, min_new_tokens=NEW, pad_token_id=0
    )
    prompt = torch.randint(0, cfg.vocab_size, (1, 32), device=device)
    env = RecordEnv.capture(device, torch.bfloat16)
    wl = Workload(
        "softmax.generate",
        {
            "model": "Qwen3-0.6B-shaped (random weights)",
            "prompt": 32,
            "new_tokens": NEW,
            "sampling": "temperature 0.6, top-k 20, top-p 0.95",
            "mode": "eager",
        },
    )
    tokens = {}

    def gen_fn(model, name):
        def fn():
            torch.manual_seed(77)
            tokens[name] = model.generate(prompt, generation_config=gen)

        return fn

    with torch.no_grad():
        m = measure_variants(
            {"stock": gen_fn(stock, "stock"), "mpsboost": gen_fn(patched, "mpsboost")},
            device=device,
            repeats=repeats,
            warmup=1,
        )
    same = bool(torch.equal(tokens["stock"], tokens["mpsboost"]))
    records = []
    for variant, t in m.timings.items():
        extra = {"same_tokens_as_stock": same, **m.extra(variant)}
        if variant == "mpsboost":
            extra.update(
                measured_through="patch()",
                path=row.backing,
                patch_status=row.status,
                reason=row.reason,
                report=str(report),
            )
        records.append(
            Record(
                wl,
                variant,
                env,
                throughput=t.throughput(items_per_call=NEW, unit="tokens/s"),
                correctness=Correctness("stock, same seed", rel_error=0.0 if same else 1.0),
                extra=extra,
            )
        )
        lines.append(("generate/token", variant, t.median_s / NEW * 1e6))
    return records


if __name__ == "__main__":
    from mpsboost.bench.cli import script_main

    raise SystemExit(script_main(__file__, run))
