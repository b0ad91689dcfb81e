"""Benchmark of the moe_experts recipe: transformers' eager / batched_mm / grouped_mm vs mpsboost.

    python benchmarks/moe.py --device cuda --size real --out OUT     # or: mpsboost bench moe ...

Model: a Qwen3-30B-A3B-shaped causal LM with random weights (hidden 2048, 128 experts, top-8,
moe_intermediate 768, 32 query / 4 KV heads of 128, vocab 151936), built directly on the device.

Stages, each writing records (and appending them to ``OUT/moe.partial.jsonl`` as it goes):

1. ``moe-experts-call``: one experts layer, operator time per call for 1..512 tokens (8..4096
   routed tokens): transformers' three implementations and mpsboost's three paths plus its auto
   choice; CUDA-event time in eager mode, CUDA-graph replay time (device time) for mpsboost's paths.
2. ``moe-thresholds``: the batched_mm bound derived from stage 1 (largest routed-token count up to
   which mpsboost's batched_mm is at least as fast as its grouped_mm), used by the later stages.
3. ``moe-sync-and-graph`` (CUDA): the patched forward under ``torch.cuda.set_sync_debug_mode("error")``
   and captured into a CUDA graph, replay checked against eager.
4. ``moe-prefill`` / ``moe-decode``: the whole model in eager mode, batch 1: prefill of the
   prompt, decode at each context; throughput, memory peaks, bf16 logits error vs transformers eager.
5. ``moe-greedy-fp32``: greedy tokens of patched and stock, fp32, 32 steps (fewer layers).
6. ``moe-decode-compiled``: ``generate(cache_implementation="static")`` (transformers compiles the
   decode step) on fewer layers; decode time per token and its fraction of the HBM limit (bytes of
   active weights per token over the measured copy bandwidth).

``MPSBOOST_MOE_BUDGET_S`` (seconds) makes later stages skip, with a record saying so, once the
budget is spent; ``MPSBOOST_MOE_COMPILED=0/1`` turns stage 6 off/on (default: on except for size tiny);
``MPSBOOST_MOE_STAGES`` (comma list of sweep, sync, model, greedy, compiled; default all) and
``MPSBOOST_MOE_SWEEP_MAX`` (largest token count of the sweep) shorten a run, e.g. for a CPU sweep;
``MPSBOOST_MOE_COMPILED_LAYERS`` (comma list, default "8,48" at size real) and
``MPSBOOST_MOE_COMPILED_VARIANTS`` (default "mpsboost,stock") pick the compiled runs;
``MPSBOOST_MOE_CLOCK=process`` times the CPU sweep by process CPU time (a CPU shared with other jobs).
"""

from __future__ import annotations

import copy
import gc
import json
import os
import time
from pathlib import Path
from typing import Any, Callable

import torch

import mpsboost
from mpsboost.recipes import moe_experts as moe_recipe
from mpsboost.bench.memory import measure_memory
from mpsboost.bench.quality import relative_error
from mpsboost.bench.records import Correctness, Record, RecordEnv, Throughput, Workload
from mpsboost.bench.harness import copy_bandwidth
from mpsboost.bench.timing import synchronize, time_fn

NAME = "moe"

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden=64,
        inter=32,
        experts=8,
        top_k=2,
        layers=2,
        heads=4,
        kv_heads=2,
        head_dim=16,
        vocab=512,
        prompt=32,
        contexts=(32, 64),
        sweep=(1, 2, 4, 8, 16, 32),
        greedy_layers=2,
        compiled_layers=2,
        decode_steps=4,
        compiled_new=(4, 12),
    ),
    "small": dict(
        hidden=2048,
        inter=768,
        experts=128,
        top_k=8,
        layers=4,
        heads=32,
        kv_heads=4,
        head_dim=128,
        vocab=151936,
        prompt=512,
        contexts=(512, 2048),
        sweep=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
        greedy_layers=2,
        compiled_layers=2,
        decode_steps=8,
        compiled_new=(8, 40),
    ),
    "real": dict(
        hidden=2048,
        inter=768,
        experts=128,
        top_k=8,
        layers=48,
        heads=32,
        kv_heads=4,
        head_dim=128,
        vocab=151936,
        prompt=512,
        contexts=(512, 2048),
        sweep=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
        greedy_layers=2,
        compiled_layers=8,
        decode_steps=8,
        compiled_new=(8, 40),
    ),
}
HF_IMPLS = ("eager", "batched_mm", "grouped_mm")
STOCK = (
    "stock"  # transformers as configured by default: grouped_mm (generate() switches decoding to batched_mm off CPU)
)


class _Run:
    """Shared state of one run: records, the partial JSONL file, the time budget."""

    def __init__(self, device: str, out: Path, budget_s: float):
        self.device = device
        self.out = out
        self.t0 = time.perf_counter()
        self.budget_s = budget_s
        self.records: list[Record] = []
        out.mkdir(parents=True, exist_ok=True)
        self.partial = out / f"{NAME}.partial.jsonl"
        self.partial.write_text("")
        self.summary: list[str] = []

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.t0)

    def add(self, rec: Record) -> None:
        self.records.append(rec)
        with self.partial.open("a") as f:
            f.write(json.dumps(rec.to_dict()) + "\n")

    def log(self, text: str) -> None:
        print(f"[moe {time.perf_counter() - self.t0:7.1f}s] {text}", flush=True)


# ----------------------------------------------------------------------------------------- builders


def _config(s: dict, layers: int):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=s["vocab"],
        hidden_size=s["hidden"],
        intermediate_size=3 * s["hidden"],
        moe_intermediate_size=s["inter"],
        num_hidden_layers=layers,
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        head_dim=s["head_dim"],
        num_experts=s["experts"],
        num_experts_per_tok=s["top_k"],
        max_position_embeddings=4096,
        norm_topk_prob=True,
        tie_word_embeddings=False,
    )


def _build_model(s: dict, layers: int, device: str, dtype: torch.dtype):
    """Random weights initialised on the device itself (a 48-layer bf16 model is ~61 GB)."""
    from transformers import AutoModelForCausalLM

    cfg = _config(s, layers)
    cfg._experts_implementation = "grouped_mm"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norm weights
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    return model.eval()


def _experts_module(s: dict, device: str, dtype: torch.dtype):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = _config(s, 1)
    cfg._experts_implementation = "grouped_mm"
    with torch.device(device):
        m = Qwen3MoeExperts(cfg).to(dtype)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.02)
    return m.eval()


def _routing(n: int, s: dict, device: str, dtype: torch.dtype):
    logits = torch.randn(n, s["experts"], device=device)
    w, idx = torch.topk(logits.softmax(-1), s["top_k"], dim=-1)
    return idx, (w / w.sum(-1, keepdim=True)).to(dtype)


def _env(device: str, dtype: torch.dtype, compile: bool | str = False) -> RecordEnv:
    return RecordEnv.capture(device, dtype, compile=compile)


def _copy_bandwidth(device: str) -> tuple[float | None, str]:
    """The device's copy bandwidth measured in this run; None on the CPU (a memcpy figure is no ceiling)."""
    bw = copy_bandwidth(device, nbytes=2 << 30)
    if bw is None:
        return None, "not measured on this device (no bandwidth share is computed)"
    return bw, "measured in this run: device copy of 2 GiB, read + write bytes over time"


# ----------------------------------------------------------------------------------------- stage 1: sweep


def _set_variant(module: torch.nn.Module, variant: str, options: dict | None = None) -> None:
    """Put ``module`` (experts layer or whole model) into a variant; mpsboost variants patch it."""
    if mpsboost.api.is_patched(module):
        mpsboost.unpatch(module)
    if variant == STOCK or variant.startswith("transformers:"):
        impl = "grouped_mm" if variant == STOCK else variant.split(":", 1)[1]
        if hasattr(module, "set_experts_implementation"):
            module.set_experts_implementation(impl)
        else:
            module.config._experts_implementation = impl
        return
    if hasattr(module, "set_experts_implementation"):
        module.set_experts_implementation("grouped_mm")
    else:
        module.config._experts_implementation = "grouped_mm"
    opts = dict(options or {})
    if ":" in variant:
        opts["path"] = variant.split(":", 1)[1]
    mpsboost.patch(module, recipes=["moe_experts"], options={"moe_experts": opts} if opts else None)


def _sweep(run: _Run, s: dict, dtype: torch.dtype) -> dict[tuple[str, int], float]:
    dev = run.device
    m = _experts_module(s, dev, dtype)
    env = _env(dev, dtype)
    times: dict[tuple[str, int], float] = {}
    variants = ["transformers:eager", "transformers:batched_mm", STOCK] + [
        "mpsboost:grouped_mm",
        "mpsboost:batched_mm",
        "mpsboost:fallback",
        "mpsboost",
    ]
    if dev == "cpu":
        variants.insert(-1, "mpsboost:cpu_loop")
    sweep_max = int(os.environ.get("MPSBOOST_MOE_SWEEP_MAX", "1000000"))
    for n in [n for n in s["sweep"] if n <= sweep_max]:
        if run.left() < 0:
            run.log(f"sweep stopped at {n} tokens: budget spent")
            break
        x = torch.randn(n, s["hidden"], device=dev, dtype=dtype)
        idx, w = _routing(n, s, dev, dtype)
        ref = None
        for v in variants:
            _set_variant(m, v)
            with torch.no_grad():
                fn = lambda: m(x, idx, w)  # noqa: E731
                out = fn()
                if ref is None:
                    ref = out.float()
                eager_reps = 5 if v == "transformers:eager" else 15
                if dev == "cpu" and os.environ.get("MPSBOOST_MOE_CLOCK") == "process":
                    t = _process_time(fn, warmup=1, repeats=eager_reps)
                else:
                    t = time_fn(fn, device=dev, warmup=2, repeats=eager_reps)
                ops = {"experts_call": t.op_time()}
                if dev.startswith("cuda") and v.startswith("mpsboost"):
                    g = time_fn(fn, device=dev, warmup=2, repeats=15, cuda_graph="auto")
                    ops["experts_call_graph"] = g.op_time()
            times[(v, n)] = t.median_s
            run.add(
                Record(
                    workload=Workload(
                        "moe-experts-call",
                        {
                            "tokens": n,
                            "routed_tokens": n * s["top_k"],
                            "hidden": s["hidden"],
                            "moe_intermediate": s["inter"],
                            "experts": s["experts"],
                            "top_k": s["top_k"],
                        },
                    ),
                    variant=v,
                    env=env,
                    op_time=ops,
                    correctness=Correctness("transformers:eager", rel_error=relative_error(out.float(), ref)),
                )
            )
        run.log(
            "sweep n=%d: " % n
            + ", ".join(
                f"{v.split(':')[-1] if v != 'mpsboost' else 'auto'}={times[(v, n)] * 1e6:.0f}us" for v in variants
            )
        )
    _set_variant(m, "transformers:grouped_mm")
    m = None  # free it (the timed closures name it)
    return times


def _process_time(fn: Callable[[], Any], *, warmup: int, repeats: int):
    """CPU time of this process per call (``time.process_time``), for a CPU shared with other jobs:
    unlike wall-clock time it does not count the time other processes hold the cores."""
    from mpsboost.bench.timing import _summarise

    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        samples.append(time.process_time() - t0)
    return _summarise(samples, calls=1, warmup=warmup, method="process_time")


def _threshold(times: dict[tuple[str, int], float], s: dict) -> int:
    """Largest routed-token count up to which batched_mm is no slower than grouped_mm (eager)."""
    bound = 0
    for n in s["sweep"]:
        b, g = times.get(("mpsboost:batched_mm", n)), times.get(("mpsboost:grouped_mm", n))
        if b is None or g is None:
            break
        if b <= g:
            bound = n * s["top_k"]
        else:
            break
    return bound


# ----------------------------------------------------------------------------------------- stage 2b: compiled forms

COMPILED_FORMS = {
    # name -> moe_experts options that select it while torch.compile traces
    "batched_mm fused gather-GEMV": {"compiled_batched_form": "fused", "compiled_batched_max_tokens": 1 << 20},
    "batched_mm bmm": {"compiled_batched_form": "bmm", "compiled_batched_max_tokens": 1 << 20},
    "grouped_mm": {"compiled_batched_max_tokens": 0},
}


def _compiled_forms(run: _Run, s: dict, dtype: torch.dtype, tokens: tuple[int, ...]) -> dict:
    """One experts call under torch.compile(fullgraph=True), device time by CUDA-graph replay, per
    compiled formulation; returns the options of the fastest one for decoding (the first token count)."""
    dev = run.device
    m = _experts_module(s, dev, dtype)
    env = _env(dev, dtype, compile="default, fullgraph")
    best: dict[int, tuple[float, str]] = {}
    for n in tokens:
        x = torch.randn(n, s["hidden"], device=dev, dtype=dtype)
        idx, w = _routing(n, s, dev, dtype)
        for name, opts in [*COMPILED_FORMS.items(), ("transformers batched_mm", None)]:
            if run.left() < 60:
                break
            torch._dynamo.reset()
            if opts is None:
                _set_variant(m, "transformers:batched_mm")
            else:
                _set_variant(m, "mpsboost", opts)
            f = torch.compile(m, fullgraph=True, dynamic=False)
            t0 = time.perf_counter()
            with torch.no_grad():
                f(x, idx, w)
                compile_s = time.perf_counter() - t0
                t = time_fn(lambda: f(x, idx, w), device=dev, warmup=2, repeats=20, cuda_graph=dev.startswith("cuda"))
            run.add(
                Record(
                    workload=Workload(
                        "moe-experts-call-compiled",
                        {
                            "tokens": n,
                            "routed_tokens": n * s["top_k"],
                            "hidden": s["hidden"],
                            "moe_intermediate": s["inter"],
                            "experts": s["experts"],
                            "top_k": s["top_k"],
                        },
                    ),
                    variant=("transformers:batched_mm" if opts is None else f"mpsboost:{name}"),
                    env=env,
                    op_time={"experts_call": t.op_time()},
                    extra={"compile_s": compile_s, "options": opts},
                )
            )
            run.log(f"compiled experts n={n} {name}: {t.median_s * 1e6:.1f} us (compile {compile_s:.1f}s)")
            if opts is not None and (n not in best or t.median_s < best[n][0]):
                best[n] = (t.median_s, name)
    _set_variant(m, "transformers:grouped_mm")
    del m
    torch._dynamo.reset()
    if not best:
        return {}
    first = tokens[0]
    name = best[first][1]
    run.summary.append(f"fastest compiled experts form at {first} token(s): {name} ({best[first][0] * 1e6:.1f} us)")
    return dict(COMPILED_FORMS[name], **({"compiled_batched_max_tokens": 64} if "batched" in name else {}))


# ----------------------------------------------------------------------------------------- stage 3: sync and graphs


def _sync_and_graph(run: _Run, s: dict, dtype: torch.dtype, options: dict) -> None:
    dev = run.device
    m = _experts_module(s, dev, dtype)
    env = _env(dev, dtype)
    results: dict[str, Any] = {}
    for n in (1, 64, 512):
        x = torch.randn(n, s["hidden"], device=dev, dtype=dtype)
        idx, w = _routing(n, s, dev, dtype)
        for v in (
            "mpsboost",
            "mpsboost:grouped_mm",
            "mpsboost:batched_mm",
            "mpsboost:fallback",
            STOCK,
            "transformers:batched_mm",
            "transformers:eager",
        ):
            _set_variant(m, v, options if v == "mpsboost" else None)
            with torch.no_grad():
                m(x, idx, w)
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
                try:
                    m(x, idx, w)
                    results[f"{v} n={n} sync"] = "no host sync"
                except RuntimeError as exc:
                    results[f"{v} n={n} sync"] = f"host sync: {str(exc).splitlines()[0][:120]}"
                finally:
                    torch.cuda.set_sync_debug_mode(0)
                    torch.cuda.synchronize()
            if v.startswith("mpsboost"):
                # Capture into a CUDA graph, replay on new inputs copied into the static buffers.
                sx, sidx, sw = x.clone(), idx.clone(), w.clone()
                with torch.no_grad():
                    side = torch.cuda.Stream()
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        m(sx, sidx, sw)
                    torch.cuda.current_stream().wait_stream(side)
                    g = torch.cuda.CUDAGraph()
                    try:
                        with torch.cuda.graph(g):
                            sout = m(sx, sidx, sw)
                        x2 = torch.randn_like(x)
                        idx2, w2 = _routing(n, s, dev, dtype)
                        sx.copy_(x2), sidx.copy_(idx2), sw.copy_(w2)
                        g.replay()
                        torch.cuda.synchronize()
                        ref = m(x2, idx2, w2)
                        results[f"{v} n={n} graph"] = (
                            f"captured; replay rel error vs eager {relative_error(sout.float(), ref.float()):.2e}"
                        )
                    except Exception as exc:  # noqa: BLE001 - the failure is the measurement
                        torch.cuda.synchronize()
                        results[f"{v} n={n} graph"] = f"capture failed: {type(exc).__name__}: {str(exc)[:120]}"
                    del g
    _set_variant(m, "transformers:grouped_mm")
    ok = all(
        ("no host sync" in val) for key, val in results.items() if key.startswith("mpsboost") and key.endswith("sync")
    )
    graphs = all(val.startswith("captured") for key, val in results.items() if key.endswith("graph"))
    run.add(
        Record(
            workload=Workload(
                "moe-sync-and-graph", {"hidden": s["hidden"], "experts": s["experts"], "top_k": s["top_k"]}
            ),
            variant="mpsboost",
            env=env,
            extra={"checks": results, "mpsboost_sync_free": ok, "mpsboost_graph_capture": graphs},
        )
    )
    run.summary.append(
        f"sync-debug 'error' on every mpsboost path: {'pass' if ok else 'FAIL'}; "
        f"CUDA-graph capture: {'pass' if graphs else 'FAIL'}"
    )
    for key, val in results.items():
        if not key.startswith("mpsboost") and key.endswith("sync"):
            run.summary.append(f"  {key}: {val}")
    m = None


# ----------------------------------------------------------------------------------------- stage 4: whole model


def _prefill(model, ids):
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
    return out.logits[:, -1].float(), out.past_key_values


def _decode_step(model, cache, tok):
    with torch.no_grad():
        return model(input_ids=tok, past_key_values=cache, use_cache=True).logits


def _model_stage(run: _Run, s: dict, dtype: torch.dtype, options: dict) -> None:
    dev = run.device
    layers = s["layers"]
    t = time.perf_counter()
    model = _build_model(s, layers, dev, dtype)
    synchronize(dev)
    run.log(
        f"built {layers}-layer model in {time.perf_counter() - t:.1f}s "
        f"({sum(p.numel() for p in model.parameters()) * torch.finfo(dtype).bits / 8 / 1e9:.1f} GB)"
    )
    env = _env(dev, dtype)
    prompt = torch.randint(0, s["vocab"], (1, s["prompt"]), device=dev)
    contexts = {}
    _set_variant(model, "transformers:grouped_mm")
    for c in s["contexts"]:
        ids = torch.randint(0, s["vocab"], (1, c), device=dev)
        _, cache = _prefill(model, ids)
        contexts[c] = cache
    tok = torch.randint(0, s["vocab"], (1, 1), device=dev)
    ref_logits = None
    shape = {
        "layers": layers,
        "batch": 1,
        "hidden": s["hidden"],
        "experts": s["experts"],
        "top_k": s["top_k"],
        "moe_intermediate": s["inter"],
        "vocab": s["vocab"],
    }
    for v in ("transformers:eager", "transformers:batched_mm", STOCK, "mpsboost"):
        if run.left() < 60:
            run.log(f"skipping {v}: budget")
            continue
        _set_variant(model, v, options if v == "mpsboost" else None)
        slow = v == "transformers:eager"
        # Memory pass (also the warm-up), then timing. Empty the allocator's cache first, so that the
        # reserved and driver-level peaks are this variant's and not what an earlier one left cached.
        gc.collect()
        if dev.startswith("cuda"):
            torch.cuda.empty_cache()
        with measure_memory(dev) as probe:
            logits, _ = _prefill(model, prompt)
        mem = probe.peaks()
        if ref_logits is None:
            ref_logits = logits
        tp = time_fn(lambda: _prefill(model, prompt), device=dev, warmup=0, repeats=2 if slow else 3)
        run.add(
            Record(
                workload=Workload("moe-prefill", {**shape, "prompt": s["prompt"]}),
                variant=v,
                env=env,
                throughput=tp.throughput(items_per_call=s["prompt"], unit="tokens/s"),
                memory=mem,
                correctness=Correctness("transformers:eager", rel_error=relative_error(logits, ref_logits)),
                extra={"ms_per_prefill": tp.median_s * 1e3},
            )
        )
        line = f"{v:26s} prefill {s['prompt']}: {tp.median_s * 1e3:8.1f} ms"
        for c, base in contexts.items():
            cache = copy.deepcopy(base)
            with measure_memory(dev) as probe:
                _decode_step(model, cache, tok)
            mem = probe.peaks()
            td = time_fn(
                lambda: _decode_step(model, cache, tok), device=dev, warmup=1, repeats=3 if slow else s["decode_steps"]
            )
            run.add(
                Record(
                    workload=Workload("moe-decode", {**shape, "context": c}),
                    variant=v,
                    env=env,
                    throughput=td.throughput(items_per_call=1, unit="tokens/s"),
                    memory=mem,
                    extra={"ms_per_token": td.median_s * 1e3},
                )
            )
            line += f" | decode@{c}: {td.median_s * 1e3:7.2f} ms/token"
            cache = None
        run.log(line)
        run.summary.append(line)
    _set_variant(model, "transformers:grouped_mm")
    model = contexts = None
    gc.collect()
    if dev.startswith("cuda"):
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------- stage 5: greedy fp32


def _greedy_stage(run: _Run, s: dict, options: dict) -> None:
    dev = run.device
    layers = s["greedy_layers"]
    model = _build_model(s, layers, dev, torch.float32)
    # Larger weights than init so that logits separate and greedy choices mean something.
    prompt = torch.randint(0, s["vocab"], (1, 16), device=dev)
    kw = dict(
        max_new_tokens=32, min_new_tokens=32, do_sample=False, attention_mask=torch.ones_like(prompt), pad_token_id=0
    )
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.no_grad():
            _set_variant(model, "transformers:grouped_mm")
            stock = model.generate(prompt, **kw)
            _set_variant(model, "mpsboost", options)
            patched = model.generate(prompt, **kw)
            _set_variant(model, "transformers:grouped_mm")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    same = int((stock == patched).sum()) - prompt.shape[1]
    run.add(
        Record(
            workload=Workload(
                "moe-greedy-fp32",
                {
                    "layers": layers,
                    "new_tokens": 32,
                    "hidden": s["hidden"],
                    "experts": s["experts"],
                    "top_k": s["top_k"],
                },
            ),
            variant="mpsboost",
            env=_env(dev, torch.float32),
            correctness=Correctness(STOCK, rel_error=0.0 if torch.equal(stock, patched) else float("nan")),
            extra={"identical": bool(torch.equal(stock, patched)), "matching_new_tokens": same},
        )
    )
    run.summary.append(
        f"greedy fp32 {layers} layers, 32 new tokens: identical={torch.equal(stock, patched)} ({same}/32 match)"
    )
    del model


# ----------------------------------------------------------------------------------------- stage 6: compiled


def _active_bytes_per_token(model, s: dict) -> int:
    """Bytes of weights one decoded token reads: everything, except experts at top_k/E and one embedding row."""
    total = 0.0
    for name, p in model.named_parameters():
        b = p.numel() * p.element_size()
        if ".experts." in name:
            b *= s["top_k"] / s["experts"]
        elif "embed_tokens" in name:
            b = p.shape[-1] * p.element_size()
        total += b
    return int(total)


def _compiled_stage(
    run: _Run,
    s: dict,
    dtype: torch.dtype,
    options: dict,
    bw: float,
    bw_source: str,
    layers: int,
    variants: tuple[str, ...],
    need_s: float,
) -> None:
    dev = run.device
    if run.left() < need_s:
        run.log(f"compiled stage, {layers} layers: skipped, budget")
        run.summary.append(f"compiled {layers} layers: not run (time budget)")
        return
    model = _build_model(s, layers, dev, dtype)
    limit_s = _active_bytes_per_token(model, s) / bw if bw else None
    env = _env(dev, dtype, compile="reduce-overhead, static cache (transformers generate)")
    prompt = torch.randint(0, s["vocab"], (1, s["prompt"]), device=dev)
    n1, n2 = s["compiled_new"]
    from transformers import CompileConfig, StoppingCriteria, StoppingCriteriaList

    class _StopAt(StoppingCriteria):
        """Stop at a given length while max_length (and so the static cache's size) stays fixed:
        a different max_new_tokens would resize the cache and recompile."""

        def __init__(self, length: int):
            self.length = length

        def __call__(self, input_ids, scores, **kwargs):
            return torch.full(
                (input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool, device=input_ids.device
            )

    max_length = s["prompt"] + n2
    for v in variants:
        if run.left() < need_s / 2:
            run.log(f"compiled {v}: skipped, budget")
            run.summary.append(f"compiled {v}: not run (time budget)")
            continue
        torch._dynamo.reset()
        _set_variant(model, v, options if v == "mpsboost" else None)
        # transformers' default compile settings (mode reduce-overhead); fullgraph for mpsboost proves
        # the patched decode step has no graph break. Off CUDA, generate() compiles only when told to.
        cc = CompileConfig(fullgraph=v == "mpsboost")
        if not dev.startswith("cuda"):
            cc._compile_all_devices = True
        kw = dict(
            do_sample=False,
            cache_implementation="static",
            compile_config=cc,
            max_length=max_length,
            attention_mask=torch.ones_like(prompt),
            pad_token_id=0,
            eos_token_id=None,
        )
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(
                prompt, stopping_criteria=StoppingCriteriaList([_StopAt(s["prompt"] + n1)]), **kw
            )  # compiles
            synchronize(dev)
            compile_s = time.perf_counter() - t

            def gen(n):
                synchronize(dev)
                t0 = time.perf_counter()
                out = model.generate(prompt, stopping_criteria=StoppingCriteriaList([_StopAt(s["prompt"] + n)]), **kw)
                synchronize(dev)
                if out.shape[1] != s["prompt"] + n:
                    raise RuntimeError(f"generate made {out.shape[1] - s['prompt']} tokens, expected {n}")
                return time.perf_counter() - t0

            a = min(gen(n1) for _ in range(2))
            b = min(gen(n2) for _ in range(2))
        per_tok = (b - a) / (n2 - n1)
        frac = limit_s / per_tok if per_tok > 0 and limit_s is not None else None
        run.add(
            Record(
                workload=Workload(
                    "moe-decode-compiled",
                    {
                        "layers": layers,
                        "batch": 1,
                        "context": s["prompt"],
                        "hidden": s["hidden"],
                        "experts": s["experts"],
                        "top_k": s["top_k"],
                        "moe_intermediate": s["inter"],
                    },
                ),
                variant=v,
                env=env,
                throughput=Throughput(1.0 / per_tok, "tokens/s", seconds_per_call=per_tok, items_per_call=1),
                extra={
                    "ms_per_token": per_tok * 1e3,
                    "hbm_limit_ms_per_token": None if limit_s is None else limit_s * 1e3,
                    "fraction_of_hbm_limit": frac,
                    "copy_bandwidth_bytes_per_s": bw,
                    "copy_bandwidth_source": bw_source,
                    "first_generate_s": compile_s,
                    "method": f"(t(generate {n2}) - t(generate {n1})) / {n2 - n1}, best of 2 each",
                    "fullgraph": cc.fullgraph,
                },
            )
        )
        share = "no HBM limit measured" if frac is None else f"{frac * 100:5.1f}% of HBM limit {limit_s * 1e3:.3f} ms"
        line = (
            f"compiled {v:24s} {layers} layers: decode {per_tok * 1e3:7.3f} ms/token = {share} "
            f"(first generate {compile_s:.0f}s)"
        )
        run.log(line)
        run.summary.append(line)
    _set_variant(model, "transformers:grouped_mm")
    model = None


# ----------------------------------------------------------------------------------------- entry


def run(device: str, size: str, out: Path) -> list[Record]:
    if size not in SHAPES:
        raise ValueError(f"size {size!r}: accepted sizes are {', '.join(SHAPES)}")
    s = SHAPES[size]
    dtype = torch.bfloat16 if device.startswith(("cuda", "mps")) or size != "tiny" else torch.float32
    budget = float(os.environ.get("MPSBOOST_MOE_BUDGET_S", "1e9"))
    compiled = os.environ.get("MPSBOOST_MOE_COMPILED", "0" if size == "tiny" else "1") == "1"
    stages = set(os.environ.get("MPSBOOST_MOE_STAGES", "sweep,forms,sync,model,greedy,compiled").split(","))
    r = _Run(device, Path(out), budget)
    torch.manual_seed(0)
    bw, bw_source = _copy_bandwidth(device)
    r.log(
        f"{device} torch {torch.__version__}; copy bandwidth "
        + (f"{bw / 1e12:.2f} TB/s ({bw_source})" if bw else bw_source)
    )
    times = _sweep(r, s, dtype) if "sweep" in stages else {}
    bound = _threshold(times, s) if times else moe_recipe.thresholds_for(device.split(":")[0], True).batched_max_tokens
    options = {"batched_max_tokens": bound}
    r.add(
        Record(
            workload=Workload("moe-thresholds", {"hidden": s["hidden"], "experts": s["experts"], "top_k": s["top_k"]}),
            variant="mpsboost",
            env=_env(device, dtype),
            extra={
                "batched_max_tokens": bound,
                "rule": (
                    "largest routed-token count of the sweep up to which mpsboost batched_mm <= grouped_mm "
                    "(CUDA events, eager)"
                ),
            },
        )
    )
    r.summary.append(f"measured batched_max_tokens = {bound} routed tokens")
    r.log(f"threshold: batched_mm at <= {bound} routed tokens")
    if "forms" in stages and compiled:
        options.update(_compiled_forms(r, s, dtype, (1, 8)))
        r.add(
            Record(
                workload=Workload(
                    "moe-compiled-choice", {"hidden": s["hidden"], "experts": s["experts"], "top_k": s["top_k"]}
                ),
                variant="mpsboost",
                env=_env(device, dtype),
                extra={"options": dict(options)},
            )
        )
    if device.startswith("cuda") and "sync" in stages:
        _sync_and_graph(r, s, dtype, options)
    if "model" in stages:
        _model_stage(r, s, dtype, options)
    if r.left() > 30 and "greedy" in stages:
        _greedy_stage(r, s, options)
    if compiled and "compiled" in stages:
        variants = tuple(os.environ.get("MPSBOOST_MOE_COMPILED_VARIANTS", f"mpsboost,{STOCK}").split(","))
        layer_counts = os.environ.get("MPSBOOST_MOE_COMPILED_LAYERS", f"{s['compiled_layers']},{s['layers']}").split(
            ","
        )
        for i, layers in enumerate(dict.fromkeys(int(n) for n in layer_counts)):
            _compiled_stage(r, s, dtype, options, bw, bw_source, layers, variants, 60 if i == 0 else 150)
    print("\n".join(["", "moe summary:"] + r.summary), flush=True)
    return r.records


if __name__ == "__main__":
    from mpsboost.bench.cli import script_main

    raise SystemExit(script_main(__file__, run))
