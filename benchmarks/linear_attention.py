"""linear_attention: one Gated DeltaNet layer (transformers' Qwen3_5MoeGatedDeltaNet), stock vs mpsboost.

Workloads, each device-synchronised, stock and mpsboost timed in alternating rounds
(:func:`mpsboost.bench.harness.measure_variants`, min/median/max kept):

* ``linear_attention.decode``: one token with a cache filled by a 512-token prefill (the layer's conv and
  recurrent states in a transformers ``DynamicCache``), called repeatedly (the state keeps evolving);
* ``linear_attention.prefill``: 512 tokens without a previous state, into a fresh cache each call.

Each record carries the aten op count of one call (``TorchDispatchMode``: on a Mac each op costs host
time), the relative error against stock on the same inputs and both variants' relative error against a
float32 copy of the layer (same device), and the recipe's report row (its backing path).

Sizes: ``real`` = Qwen3.6-35B-A3B's DeltaNet layer (hidden 2048, 16 key heads, 32 value heads, head dim
128, conv kernel 4); ``tiny`` (hidden 64, 2/4 heads of 16) for a CPU smoke test.

    python benchmarks/linear_attention.py --device cuda --dtype bfloat16 --out results/linear_attention-cuda.jsonl
    python benchmarks/linear_attention.py --device cuda --env mps-2.15.0 --out ...   # Mac decisions, CUDA tensors
    python benchmarks/linear_attention.py --device cpu --size tiny --out /tmp/la.jsonl
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mpsboost
from mpsboost.bench import Correctness, Record, RecordEnv, Workload
from mpsboost.bench.harness import best_device, measure_variants
from mpsboost.bench.quality import relative_error
from mpsboost.bench.records import write_jsonl
from mpsboost.bench.timing import synchronize
from mpsboost.gate import Env

SIZES = {
    "real": dict(
        hidden_size=2048,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
    ),
    "tiny": dict(
        hidden_size=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
    ),
}
PROMPT = 512


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def _layer(size: str, dtype: torch.dtype, device: str):
    import transformers as t
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
        Qwen3_5MoeGatedDeltaNet,
    )

    cfg = t.Qwen3_5MoeTextConfig(num_hidden_layers=1, layer_types=["linear_attention"], **SIZES[size])
    torch.manual_seed(0)
    layer = Qwen3_5MoeGatedDeltaNet(cfg, 0).eval()
    with torch.no_grad():  # weights of a trained layer's scale (the init leaves some at ones/zeros)
        for p in layer.parameters():
            if p.dim() >= 2:
                p.normal_(0, p.shape[-1] ** -0.5)
    return cfg, layer.to(device=device, dtype=dtype)


def _cache(cfg, layer, x):
    import transformers as t

    cache = t.DynamicCache(config=cfg)
    with torch.no_grad():
        layer(x, cache=cache)
    return cache


def run(device: str, size: str, out: Path | None = None) -> list[Record]:
    """The entry point of ``mpsboost bench linear_attention --device D --size S``: native decisions, bf16 on
    an accelerator and float32 on the CPU; sizes ``small`` and ``real`` both run the real layer."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    return measure(device, "tiny" if size == "tiny" else "real", dtype, None)


def measure(device: str, size: str, dtype: torch.dtype, env_text: str | None, repeats: int = 5) -> list[Record]:
    cfg, stock = _layer(size, dtype, device)
    patched = copy.deepcopy(stock)
    ref = copy.deepcopy(stock).float()
    env = None
    if env_text:
        dev, _, ver = env_text.partition("-")
        env = Env.simulate(dev, ver or None)
    report = mpsboost.patch(patched, recipes=["linear_attention"], device=env if env is not None else device)
    rows = [r for r in report.rows if r.recipe == "linear_attention"]
    row = rows[0] if rows else None
    renv = RecordEnv.capture(device, dtype)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randn(1, PROMPT, cfg.hidden_size, generator=g).to(device=device, dtype=dtype)
    token = torch.randn(1, 1, cfg.hidden_size, generator=g).to(device=device, dtype=dtype)
    records, lines = [], []
    common = {
        "hidden": cfg.hidden_size,
        "key_heads": cfg.linear_num_key_heads,
        "value_heads": cfg.linear_num_value_heads,
        "head_dim": cfg.linear_key_head_dim,
        "conv_kernel": cfg.linear_conv_kernel_dim,
        "dtype": str(dtype).removeprefix("torch."),
        "env": env_text or "native",
    }
    models = {"stock": stock, "mpsboost": patched}

    for phase in ("decode", "prefill"):
        wl = Workload(
            f"linear_attention.{phase}",
            {
                **common,
                "tokens": 1 if phase == "decode" else PROMPT,
                "cached_tokens": PROMPT if phase == "decode" else 0,
            },
        )
        caches = {k: _cache(cfg, m, prompt) for k, m in models.items()} if phase == "decode" else {}

        def call(name, phase=phase, caches=caches):
            m = models[name]
            if phase == "decode":
                return m(token, cache=caches[name])
            import transformers as t

            return m(prompt, cache=t.DynamicCache(config=cfg))

        # correctness and op counts on fresh copies of the same cache state
        outs, ops = {}, {}
        with torch.no_grad():
            ref_cache = _cache(cfg, ref, prompt.float()) if phase == "decode" else None
            ref_out = ref(token.float(), cache=ref_cache) if phase == "decode" else ref(prompt.float())
            for name, m in models.items():
                c = copy.deepcopy(caches[name]) if phase == "decode" else None
                counter = _Ops()
                with counter:
                    outs[name] = m(token, cache=c) if phase == "decode" else m(prompt)
                ops[name] = counter.n
        with torch.no_grad():
            meas = measure_variants(
                {k: (lambda k=k: call(k)) for k in models},
                device=device,
                repeats=repeats,
                warmup=2,
                calls=4 if phase == "decode" else 1,
            )
        synchronize(device)
        for name in models:
            t_ = meas.timings[name]
            extra = {
                "aten_ops_per_call": ops[name],
                "rel_error_vs_fp32_layer": relative_error(outs[name], ref_out),
                **meas.extra(name),
            }
            if name == "mpsboost" and row is not None:
                extra.update(path=row.backing, patch_status=row.status, reason=row.reason)
            corr = Correctness("stock, same inputs", rel_error=relative_error(outs[name], outs["stock"]))
            records.append(Record(wl, name, renv, op_time={"layer": t_.op_time()}, correctness=corr, extra=extra))
            lines.append((phase, name, t_.median_us, ops[name], corr.rel_error, extra["rel_error_vs_fp32_layer"]))

    print(f"\n{'phase':8s} {'variant':9s} {'us/call':>10s} {'aten ops':>9s} {'rel err vs stock':>17s} {'vs fp32':>9s}")
    for ph, v, us, n, e, e32 in lines:
        print(f"{ph:8s} {v:9s} {us:10.1f} {n:9d} {e:17.2e} {e32:9.2e}")
    if row is not None:
        print(f"recipe: {row.status}: {row.backing or row.reason}")
    return records


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default=best_device())  # what `mpsboost bench` picks: mps, cuda, cpu
    p.add_argument("--size", choices=sorted(SIZES), default=None, help="default: real on a GPU, tiny on CPU")
    p.add_argument(
        "--dtype",
        choices=("bfloat16", "float16", "float32"),
        default=None,
        help="default: bfloat16 on a GPU, float32 on CPU",
    )
    p.add_argument(
        "--env", default=None, help="decide as in a simulated environment, e.g. mps-2.15.0 (tensors stay on --device)"
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None, help="JSONL file for the records")
    a = p.parse_args(argv)
    gpu = a.device != "cpu"
    size = a.size or ("real" if gpu else "tiny")
    dtype = getattr(torch, a.dtype or ("bfloat16" if gpu else "float32"))
    records = measure(a.device, size, dtype, a.env, repeats=a.repeats)
    if a.out:
        path = write_jsonl(Path(a.out), records)
        print(f"wrote {len(records)} records to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
