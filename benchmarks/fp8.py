"""fp8: FP8 weight storage (``mpsboost.patch(m, fp8="rowwise")``) against bf16 and the peers.

Sections (``size="real"`` on CUDA; ``"tiny"`` runs the same code on small shapes in seconds on CPU):

* ``decode``: one-token ``F.linear`` over 96 bf16 layer shapes of real models (:data:`MODELS`,
  :data:`DIFFUSERS`), stock bf16 vs the fp8_weights recipe (rowwise, its Triton fp8 GEMV), timed by
  CUDA-graph replay of one call per weight copy, the copies rotated so that together they exceed
  twice the 60 MB L2 (each call reads its weight from HBM, as in a real decode step). Also: the
  fraction of the fp8-byte bandwidth limit (bytes moved over time, against the device-to-device copy
  bandwidth measured in the same run), and the SQNR of each output against a float64 reference of the
  bf16 layer on fresh random-normal inputs. The peers (torchao ``Float8WeightOnlyConfig`` and
  ``Float8DynamicActivationFloat8WeightConfig(PerRow)``, optimum-quanto ``qfloat8``, diffusers layerwise
  casting) on every 6th shape of at least 2M weights, where installed.
* ``gemm``: M = 4096 rows through diffusion-transformer shapes, stock vs the recipe (fused activation
  quantisation + ``torch._scaled_mm`` rowwise), its two parts timed apart (where the time goes), and
  the peers; CUDA events.
* ``models``: whole models with random weights in bf16. A Qwen3-0.6B-shaped dense LM (real config, all
  28 layers): relative error of the logits, one-token decode ms/token, weight bytes and the conversion
  peak. A Qwen3-30B-A3B-shaped MoE LM (real widths, 8 of its 48 layers): bytes vs bf16 (target <= 0.52x),
  decode ms/token bf16 (transformers batched_mm, which generate() uses for decoding) vs fp8 through
  each expert path, and the conversion peak. A Wan2.2-5B-shaped transformer (real widths, 4 of its 30
  blocks) on a 480x832x81-frame latent: PSNR against bf16 and seconds per forward.

    python benchmarks/fp8.py --device cuda --size real --out benchmarks/results

Records go to ``OUT/fp8.jsonl`` (and, as they are made, ``OUT/fp8.partial.jsonl``).
"""

from __future__ import annotations

import gc
import math
import os
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

import mpsboost
from mpsboost.bench import Correctness, Memory, OpTime, Record, RecordEnv, Throughput, Workload, append_jsonl, time_fn
from mpsboost.bench.harness import copy_bandwidth
from mpsboost.ops import fp8 as fp8_ops

# name, hidden, q heads, kv heads, head_dim, intermediate (dense FFN or one expert), bias
MODELS = [
    ("Qwen3-0.6B", 1024, 16, 8, 128, 3072, False),
    ("Qwen3-1.7B", 2048, 16, 8, 128, 6144, False),
    ("Qwen3-4B", 2560, 32, 8, 128, 9728, False),
    ("Qwen3-8B", 4096, 32, 8, 128, 12288, False),
    ("Qwen3-14B", 5120, 40, 8, 128, 17408, False),
    ("Qwen3-32B", 5120, 64, 8, 128, 25600, False),
    ("Qwen3-30B-A3B", 2048, 32, 4, 128, 768, False),
    ("Qwen3-235B-A22B", 4096, 64, 4, 128, 1536, False),
    ("Llama-3-8B", 4096, 32, 8, 128, 14336, False),
    ("Llama-3-70B", 8192, 64, 8, 128, 28672, False),
]
# Diffusion transformers: name, dim, ffn, text dim; all their linears carry a bias.
DIFFUSERS = [
    ("Wan2.2-5B", 3072, 14336, 4096),
    ("Wan2.2-14B", 5120, 13824, 4096),
    ("Qwen-Image", 3072, 12288, 3584),
]
N_SHAPES = 96
L2_BYTES = 60 * 2**20
# MPSBOOST_FP8_SECTIONS=decode,gemm,models picks sections; MPSBOOST_FP8_PEER_COPIES caps the weight copies
# of a shape on which the peers are timed (0: no peers in the decode section).
_SECTIONS = tuple(os.environ.get("MPSBOOST_FP8_SECTIONS", "decode,gemm,models").split(","))
_PEER_MAX_COPIES = int(os.environ.get("MPSBOOST_FP8_PEER_COPIES", "64"))


def layer_shapes() -> list[tuple[str, int, int, bool]]:
    """The 96 distinct (N, K) one-token layer shapes: label, N (out), K (in), bias."""
    cand: list[tuple[str, int, int, bool]] = []
    for name, h, qh, kvh, hd, ffn, bias in MODELS:
        q, kv = qh * hd, kvh * hd
        moe = "A3B" in name or "A22B" in name
        cand += [
            (f"{name}.q_proj", q, h, bias),
            (f"{name}.k_proj", kv, h, bias),
            (f"{name}.o_proj", h, q, bias),
            (f"{name}.qkv_fused", q + 2 * kv, h, bias),
            (f"{name}.{'expert.' if moe else ''}gate_proj", ffn, h, False),
            (f"{name}.{'expert.' if moe else ''}gate_up_fused", 2 * ffn, h, False),
            (f"{name}.{'expert.' if moe else ''}down_proj", h, ffn, False),
        ]
        if moe:
            cand.append((f"{name}.router", 128, h, False))
        if name.startswith("Llama"):
            cand.append((f"{name}.lm_head", 128256, h, False))
    for name, d, ffn, text in DIFFUSERS:
        cand += [
            (f"{name}.attn.to_q", d, d, True),
            (f"{name}.attn.qkv_fused", 3 * d, d, True),
            (f"{name}.ffn.up", ffn, d, True),
            (f"{name}.ffn.down", d, ffn, True),
            (f"{name}.text_embed", d, text, True),
            (f"{name}.time_proj", 6 * d, d, True),
            (f"{name}.time_embed", d, 256, True),
            (f"{name}.norm_out", 2 * d, d, True),
        ]
    seen, out = set(), []
    for lab, n, k, b in cand:
        if (n, k) not in seen:
            seen.add((n, k))
            out.append((lab, n, k, b))
    # Fill to 96: the Qwen3 output heads (vocab 151936; mpsboost keeps lm_head in bf16 by default, but
    # include_lm_head=True converts it), then Qwen2.5 and Llama-3.2 projections, all from real configs.
    extra = [
        ("Qwen3-0.6B.lm_head", 151936, 1024, False),
        ("Qwen3-1.7B.lm_head", 151936, 2048, False),
        ("Qwen3-4B.lm_head", 151936, 2560, False),
        ("Qwen3-8B.lm_head", 151936, 4096, False),
        ("Qwen3-14B.lm_head", 151936, 5120, False),
        ("Qwen2.5-7B.q_proj", 3584, 3584, True),
        ("Qwen2.5-7B.kv", 512, 3584, True),
        ("Qwen2.5-7B.up", 18944, 3584, False),
        ("Qwen2.5-7B.down", 3584, 18944, False),
        ("Qwen2.5-1.5B.q_proj", 1536, 1536, True),
        ("Qwen2.5-1.5B.up", 8960, 1536, False),
        ("Qwen2.5-1.5B.down", 1536, 8960, False),
        ("Qwen2.5-1.5B.kv", 256, 1536, True),
        ("Llama-3.2-1B.up", 8192, 2048, False),
        ("Llama-3.2-1B.down", 2048, 8192, False),
        ("Llama-3.2-3B.q", 3072, 3072, False),
        ("Llama-3.2-3B.kv", 1024, 3072, False),
        ("Llama-3.2-3B.up", 8192, 3072, False),
        ("Llama-3.2-3B.down", 3072, 8192, False),
    ]
    for lab, n, k, b in extra:
        if len(out) >= N_SHAPES:
            break
        if (n, k) not in seen:
            seen.add((n, k))
            out.append((lab, n, k, b))
    return out[:N_SHAPES]


TINY_SHAPES = [("tiny.a", 96, 64, False), ("tiny.b", 128, 96, True), ("tiny.c", 50, 33, True)]
GEMM_SHAPES = [  # label, N, K (diffusion-transformer linears, bias)
    ("Wan2.2-14B.attn.to_q", 5120, 5120),
    ("Wan2.2-14B.attn.qkv_fused", 15360, 5120),
    ("Wan2.2-14B.ffn.up", 13824, 5120),
    ("Wan2.2-14B.ffn.down", 5120, 13824),
    ("Wan2.2-5B.attn.to_q", 3072, 3072),
    ("Wan2.2-5B.ffn.up", 14336, 3072),
    ("Wan2.2-5B.ffn.down", 3072, 14336),
    ("Qwen-Image.ffn.up", 12288, 3072),
    ("Qwen-Image.ffn.down", 3072, 12288),
    ("Qwen-Image.img_mod", 18432, 3072),
]


# ------------------------------------------------------------------------------------------ helpers


class _Budget:
    """Wall-clock budget: sections check it and stop early rather than run past the device lease."""

    def __init__(self, seconds: float):
        self.t0 = time.monotonic()
        self.seconds = seconds

    def left(self, until: float = 1.0) -> float:
        """Seconds left before the fraction ``until`` of the budget is spent."""
        return self.seconds * until - (time.monotonic() - self.t0)


def _peer(kind: str, lin: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """A peer's fp8 version of one bf16 ``nn.Linear`` (on its device), or None when not installed."""
    try:
        if kind == "torchao:float8_weight_only":
            from torchao.quantization import Float8WeightOnlyConfig, quantize_

            quantize_(lin, Float8WeightOnlyConfig())
            return lin
        if kind == "torchao:float8_dynamic_rowwise":
            from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

            quantize_(lin, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
            return lin
        if kind == "quanto:qfloat8":
            from optimum.quanto import freeze, qfloat8, quantize

            box = torch.nn.Sequential(lin)
            quantize(box, weights=qfloat8)
            freeze(box)
            return box
        if kind == "diffusers:layerwise_fp8":
            from diffusers.hooks.layerwise_casting import apply_layerwise_casting_hook

            apply_layerwise_casting_hook(lin, torch.float8_e4m3fn, torch.bfloat16, non_blocking=False)
            return lin
    except ImportError:
        return None
    raise ValueError(kind)


PEERS = ("torchao:float8_weight_only", "torchao:float8_dynamic_rowwise", "quanto:qfloat8", "diffusers:layerwise_fp8")


def _peer_versions() -> dict:
    from importlib import metadata

    out = {}
    for name in ("torchao", "optimum-quanto", "diffusers", "transformers"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _copy_bandwidth(device: str) -> float | None:
    """Device-to-device copy bandwidth in bytes/s (read + write), the ceiling the fractions refer to."""
    return copy_bandwidth(device) if device.startswith("cuda") else None


def _fp8_linears(
    weights: list[torch.Tensor], biases: list[torch.Tensor | None], granularity: str = "rowwise"
) -> torch.nn.ModuleList:
    mods = torch.nn.ModuleList()
    for w, b in zip(weights, biases):
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            lin.weight.copy_(w)
            if b is not None:
                lin.bias.copy_(b)
        mods.append(lin)
    mpsboost.patch(mods, recipes=["fp8_weights"], fp8=granularity)
    return mods


def _sqnr_vs(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> float:
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    return fp8_ops.sqnr_db(y, ref)


# ------------------------------------------------------------------------------------------ decode


def _decode(device: str, size: str, env: RecordEnv, emit, budget: _Budget, bw: float | None) -> list[tuple]:
    shapes = layer_shapes() if size == "real" else TINY_SHAPES
    cuda = device.startswith("cuda")
    rows = []
    for i, (label, n, k, bias) in enumerate(shapes):
        if budget.left(float(os.environ.get("MPSBOOST_FP8_DECODE_FRACTION", "0.45"))) < 0:
            print(f"decode: budget reached after {i} shapes")
            break
        g = torch.Generator(device=device).manual_seed(i)
        copies = max(2, math.ceil(2 * L2_BYTES / (n * k))) if cuda else 1
        ws = [torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=g) * 0.02 for _ in range(copies)]
        bs = [
            torch.randn(n, device=device, dtype=torch.bfloat16, generator=g) * 0.02 if bias else None
            for _ in range(copies)
        ]
        x = torch.randn(1, k, device=device, dtype=torch.bfloat16, generator=g)
        wl = Workload("decode_linear", {"layer": label, "N": n, "K": k, "bias": bias, "M": 1, "copies": copies})
        graph = "auto" if cuda else False

        def stock():
            for w, b in zip(ws, bs):
                F.linear(x, w, b)

        t_stock = time_fn(stock, device=device, warmup=2, repeats=10 if cuda else 3, cuda_graph=graph)
        us_stock = t_stock.median_s / copies * 1e6
        emit(
            Record(
                wl,
                "stock",
                env,
                op_time={"linear": _per(t_stock, copies)},
                correctness=Correctness(
                    "float64 F.linear of the bf16 layer", sqnr_db=_sqnr_vs(F.linear(x, ws[0], bs[0]), x, ws[0], bs[0])
                ),
                extra={"bytes": 2 * n * k + 2 * (k + n) + (2 * n if bias else 0)},
            )
        )
        mods = _fp8_linears(ws, bs)
        del ws[1:], bs[1:]

        def fp8():
            for m in mods:
                m(x)

        t_fp8 = time_fn(fp8, device=device, warmup=2, repeats=10 if cuda else 3, cuda_graph=graph)
        us_fp8 = t_fp8.median_s / copies * 1e6
        xs = torch.randn(1, k, device=device, dtype=torch.bfloat16, generator=g)  # fresh input for quality
        sq = _sqnr_vs(mods[0](xs), xs, ws[0], bs[0])
        fp8_bytes = n * k + 4 * n + 2 * (k + n) + (2 * n if bias else 0)
        frac = (fp8_bytes / (us_fp8 * 1e-6)) / bw if bw else None
        extra = {
            "bytes": fp8_bytes,
            "fraction_of_copy_bandwidth": frac,
            "speedup_vs_stock": us_stock / us_fp8,
            "path": mpsboost.last_report(mods).rows[0].backing if mpsboost.last_report(mods).rows else None,
        }
        if cuda:
            from mpsboost.ops import fp8_triton

            extra["gemv_config"] = list(
                fp8_triton._TUNED.get((n, k, 1, torch.bfloat16, bias, torch.device(device).index or 0), ()) or []
            )
        emit(
            Record(
                wl,
                "mpsboost",
                env,
                op_time={"linear": _per(t_fp8, copies)},
                correctness=Correctness("float64 F.linear of the bf16 layer", sqnr_db=sq),
                extra=extra,
            )
        )
        peer_us = {}
        # Peers on every 6th shape whose rotation needs at most 64 copies (their setup is per copy).
        if i % 6 == 0 and copies <= _PEER_MAX_COPIES and size == "real":
            for kind in PEERS:
                try:
                    pm = []
                    for j in range(copies):
                        lin = torch.nn.Linear(k, n, bias=bias, device=device, dtype=torch.bfloat16)
                        with torch.no_grad():
                            lin.weight.copy_(ws[0])
                            if bias:
                                lin.bias.copy_(bs[0])
                        p = _peer(kind, lin)
                        if p is None:
                            break
                        pm.append(p)
                    if not pm:
                        continue

                    def peer(pm=pm):
                        for m in pm:
                            m(x)

                    with torch.no_grad():
                        t = time_fn(peer, device=device, warmup=2, repeats=10, cuda_graph=graph)
                        y = pm[0](xs)
                    peer_us[kind] = t.median_s / copies * 1e6
                    emit(
                        Record(
                            wl,
                            kind,
                            env,
                            op_time={"linear": _per(t, copies)},
                            correctness=Correctness(
                                "float64 F.linear of the bf16 layer", sqnr_db=_sqnr_vs(y, xs, ws[0], bs[0])
                            ),
                            extra={"note": t.note} if t.note else {},
                        )
                    )
                    del pm
                except Exception as exc:  # a peer that fails here is reported, not fatal
                    print(f"peer {kind} failed on {label}: {type(exc).__name__}: {str(exc)[:200]}")
        rows.append((label, n, k, us_stock, us_fp8, frac, sq, peer_us))
        mods = ws = bs = None  # free them (closures above still name them)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return rows


def _per(t, copies: int) -> OpTime:
    op = t.op_time()
    return OpTime(
        median_us=op.median_us / copies,
        min_us=op.min_us / copies,
        max_us=op.max_us / copies,
        iqr_us=op.iqr_us / copies,
        repeats=op.repeats,
        warmup=op.warmup,
        method=op.method,
        calls=copies,
    )


# ------------------------------------------------------------------------------------------ large GEMMs


def _gemm(device: str, size: str, env: RecordEnv, emit, budget: _Budget) -> list[tuple]:
    cuda = device.startswith("cuda")
    shapes = GEMM_SHAPES if size == "real" else [("tiny.gemm", 64, 48)]
    m_rows = 4096 if size == "real" else 32
    rows = []
    for i, (label, n, k) in enumerate(shapes):
        if budget.left(0.65) < 0:
            print(f"gemm: budget reached after {i} shapes")
            break
        g = torch.Generator(device=device).manual_seed(100 + i)
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=g) * 0.02
        b = torch.randn(n, device=device, dtype=torch.bfloat16, generator=g) * 0.02
        x = torch.randn(m_rows, k, device=device, dtype=torch.bfloat16, generator=g)
        wl = Workload("gemm", {"layer": label, "N": n, "K": k, "M": m_rows, "bias": True})
        flops = 2 * m_rows * n * k
        t_stock = time_fn(lambda: F.linear(x, w, b), device=device, warmup=3, repeats=20 if cuda else 3)
        ref = F.linear(x.double(), w.double(), b.double())
        emit(
            Record(
                wl,
                "stock",
                env,
                op_time={"linear": t_stock.op_time()},
                throughput=Throughput(flops / t_stock.median_s / 1e12, "TFLOP/s", seconds_per_call=t_stock.median_s),
                correctness=Correctness(
                    "float64 F.linear of the bf16 layer", sqnr_db=fp8_ops.sqnr_db(F.linear(x, w, b), ref)
                ),
            )
        )
        res = {"stock": t_stock.median_s * 1e6}
        for gran in ("rowwise", "tensorwise"):
            mods = _fp8_linears([w], [b], gran)
            mod = mods[0]
            with torch.no_grad():
                t = time_fn(lambda: mod(x), device=device, warmup=3, repeats=20 if cuda else 3)
                y = mod(x)
            ops = {"linear": t.op_time()}
            if cuda:
                from mpsboost.ops import fp8_triton

                q, s = mod.weight, mod.weight_scale
                t_q = time_fn(lambda: fp8_triton.quantize_rows(x), device=device, warmup=3, repeats=20)
                xq, xs = fp8_triton.quantize_rows(x)
                t_mm = time_fn(lambda: fp8_ops.scaled_mm_rowwise(xq, q, xs, s, b), device=device, warmup=3, repeats=20)
                ops["activation_quant"] = t_q.op_time()
                ops["scaled_mm"] = t_mm.op_time()
                res[f"{gran}.quant"] = t_q.median_s * 1e6
                res[f"{gran}.mm"] = t_mm.median_s * 1e6
            variant = "mpsboost" if gran == "rowwise" else "mpsboost:tensorwise"
            emit(
                Record(
                    wl,
                    variant,
                    env,
                    op_time=ops,
                    throughput=Throughput(flops / t.median_s / 1e12, "TFLOP/s", seconds_per_call=t.median_s),
                    correctness=Correctness("float64 F.linear of the bf16 layer", sqnr_db=fp8_ops.sqnr_db(y, ref)),
                    extra={"speedup_vs_stock": t_stock.median_s / t.median_s},
                )
            )
            res[variant] = t.median_s * 1e6
            mods = mod = None
        if size == "real":
            for kind in PEERS:
                try:
                    lin = torch.nn.Linear(k, n, device=device, dtype=torch.bfloat16)
                    with torch.no_grad():
                        lin.weight.copy_(w)
                        lin.bias.copy_(b)
                    p = _peer(kind, lin)
                    if p is None:
                        continue
                    with torch.no_grad():
                        t = time_fn(lambda: p(x), device=device, warmup=3, repeats=10)
                        y = p(x)
                    res[kind] = t.median_s * 1e6
                    emit(
                        Record(
                            wl,
                            kind,
                            env,
                            op_time={"linear": t.op_time()},
                            throughput=Throughput(flops / t.median_s / 1e12, "TFLOP/s", seconds_per_call=t.median_s),
                            correctness=Correctness(
                                "float64 F.linear of the bf16 layer", sqnr_db=fp8_ops.sqnr_db(y, ref)
                            ),
                        )
                    )
                    del p, lin
                except Exception as exc:
                    print(f"peer {kind} failed on {label}: {type(exc).__name__}: {str(exc)[:200]}")
        rows.append((label, n, k, res))
        w = b = x = ref = None
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------------------ models


def _bytes(model: torch.nn.Module) -> dict:
    total = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    lin = exp = 0
    for mod in model.modules():
        if type(mod) is torch.nn.Linear:
            lin += mod.weight.numel() * mod.weight.element_size() + (
                mod.weight_scale.numel() * 4 if "weight_scale" in mod._buffers else 0
            )
        for n in ("gate_up_proj", "down_proj"):
            t = mod._parameters.get(n) if n in mod._parameters else mod._buffers.get(n)
            if t is not None and t.dim() == 3:
                exp += t.numel() * t.element_size()
                sc = mod._buffers.get(n + "_scale")
                exp += sc.numel() * 4 if sc is not None else 0
    return {"total": total, "linear_weights": lin, "expert_weights": exp}


def _convert_measured(model, device: str, **kw) -> tuple[Any, dict]:
    """Patch with fp8 and read the allocator peak during the conversion (CUDA)."""
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    report = mpsboost.patch(model, fp8="rowwise", **kw)
    if cuda:
        torch.cuda.synchronize()
    info = {"seconds": time.perf_counter() - t0}
    if cuda:
        info.update(
            start_allocated=start,
            peak_allocated=torch.cuda.max_memory_allocated(),
            end_allocated=torch.cuda.memory_allocated(),
        )
        info["peak_over_start"] = info["peak_allocated"] - start
    return report, info


def _largest_layer_bytes(model) -> int:
    best = 0
    for mod in model.modules():
        for t in list(mod._parameters.values()):
            if t is not None and t.dim() >= 2:
                best = max(best, t.numel() * t.element_size())
    return best


def _decode_ms(model, device: str, prompt: int, steps: int, vocab: int) -> tuple[float, list[float], torch.Tensor]:
    """Prefill ``prompt`` tokens, then ``steps`` one-token steps; returns (median ms/token, all, prefill logits)."""
    from transformers import DynamicCache

    g = torch.Generator(device=device).manual_seed(7)
    ids = torch.randint(0, vocab, (1, prompt), device=device, generator=g)
    times = []
    with torch.no_grad():
        cache = DynamicCache()
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        logits = out.logits.float()
        tok = out.logits[:, -1:].argmax(-1)
        for _ in range(steps):
            if device.startswith("cuda"):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                out = model(input_ids=tok, past_key_values=cache, use_cache=True)
                e.record()
                e.synchronize()
                times.append(s.elapsed_time(e))
            else:
                t0 = time.perf_counter()
                out = model(input_ids=tok, past_key_values=cache, use_cache=True)
                times.append((time.perf_counter() - t0) * 1e3)
            tok = out.logits[:, -1:].argmax(-1)
    ts = sorted(times[2:] or times)
    return ts[len(ts) // 2], times, logits


def _lm(kind: str, size: str, device: str):
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    real = size == "real"
    if kind == "dense":
        cfg = Qwen3Config(
            vocab_size=151936 if real else 512,
            hidden_size=1024 if real else 64,
            intermediate_size=3072 if real else 128,
            num_hidden_layers=28 if real else 2,
            num_attention_heads=16 if real else 4,
            num_key_value_heads=8 if real else 2,
            head_dim=128 if real else 16,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
        )
        cls = Qwen3ForCausalLM
    else:
        cfg = Qwen3MoeConfig(
            vocab_size=151936 if real else 512,
            hidden_size=2048 if real else 64,
            intermediate_size=6144 if real else 128,
            moe_intermediate_size=768 if real else 32,
            num_experts=128 if real else 8,
            num_experts_per_tok=8 if real else 2,
            num_hidden_layers=8 if real else 2,
            num_attention_heads=32 if real else 4,
            num_key_value_heads=4 if real else 2,
            head_dim=128 if real else 16,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
            norm_topk_prob=True,
        )
        cls = Qwen3MoeForCausalLM
    torch.manual_seed(0)
    with torch.device(device):
        model = cls._from_config(cfg, dtype=torch.bfloat16).eval()  # built in bf16: no fp32 copy first
    if kind == "moe":
        model.set_experts_implementation("batched_mm")  # what generate() uses for decoding
    return model, cfg


def _models(device: str, size: str, env: RecordEnv, emit, budget: _Budget) -> list[str]:
    lines = []
    real = size == "real"
    cuda = device.startswith("cuda")
    prompt, steps = (128, 24) if real else (8, 4)
    # --- dense LM (its input embedding is tied to lm_head: both stay bf16)
    for kind in ("dense", "moe"):
        if budget.left() < 40:
            break
        model, cfg = _lm(kind, size, device)
        b0 = _bytes(model)
        ms0, all0, logits0 = _decode_ms(model, device, prompt, steps, cfg.vocab_size)
        wl = Workload(
            f"lm_decode_{kind}",
            {
                "model": "Qwen3-0.6B-shaped (28 layers)"
                if kind == "dense" and real
                else ("Qwen3-30B-A3B-shaped (8 of 48 layers)" if real else f"tiny {kind}"),
                "prompt": prompt,
                "steps": steps,
                "batch": 1,
            },
        )
        emit(
            Record(
                wl,
                "stock",
                env,
                throughput=Throughput(ms0, "ms/token"),
                extra={
                    "bytes": b0,
                    "ms_per_step": all0,
                    "experts_implementation": "batched_mm" if kind == "moe" else None,
                },
            )
        )
        big = _largest_layer_bytes(model)
        report, conv = _convert_measured(model, device, recipes=["fp8_weights"])
        b1 = _bytes(model)
        paths = sorted(
            {f"{r.target.split('.')[-1]}: {r.backing}" for r in report.rows_for("fp8_weights") if r.status == "applied"}
        )
        variants = [("mpsboost", None)]
        if kind == "moe":
            variants = [
                ("mpsboost", None),
                ("mpsboost:moe_scaled_grouped_mm", "scaled_grouped_mm"),
                ("mpsboost:moe_hit", "hit"),
            ]
        for variant, force in variants:
            if force is not None:
                _force_moe_path(model, force)
            try:
                ms1, all1, logits1 = _decode_ms(model, device, prompt, steps, cfg.vocab_size)
            except Exception:  # one failing expert path must not hide the others
                traceback.print_exc()
                lines.append(f"{kind:5s} {variant:32s} FAILED (traceback above)")
                continue
            rel = fp8_ops.sqnr_db(logits1, logits0)
            relerr = ((logits1 - logits0).norm() / logits0.norm()).item()
            emit(
                Record(
                    wl,
                    variant,
                    env,
                    throughput=Throughput(ms1, "ms/token"),
                    correctness=Correctness("bf16 model logits (prefill)", rel_error=relerr, sqnr_db=rel),
                    memory=Memory(tensor_allocated=conv.get("peak_allocated")) if cuda else None,
                    extra={
                        "bytes": b1,
                        "bytes_ratio_total": b1["total"] / b0["total"],
                        "bytes_ratio_linear": (b1["linear_weights"] / b0["linear_weights"])
                        if b0["linear_weights"]
                        else None,
                        "bytes_ratio_experts": (b1["expert_weights"] / b0["expert_weights"])
                        if b0["expert_weights"]
                        else None,
                        "conversion": conv,
                        "largest_layer_bytes": big,
                        "ms_per_step": all1,
                        "paths": paths,
                        "moe_path_forced": force,
                        "speedup_vs_stock": ms0 / ms1,
                    },
                )
            )
            lines.append(
                f"{kind:5s} {variant:32s} {ms0:8.2f} -> {ms1:8.2f} ms/token  bytes x{b1['total'] / b0['total']:.3f}  "
                f"logits rel err {relerr:.3e}  conv peak over start {conv.get('peak_over_start', 0) / 2**20:.0f} MiB "
                f"(largest layer {big / 2**20:.0f} MiB)"
            )
        del model
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    if budget.left() > 25:
        try:
            lines += _wan(device, size, env, emit)
        except ImportError as exc:
            lines.append(f"wan transformer skipped: {exc}")
    return lines


def _force_moe_path(model, path: str) -> None:
    from mpsboost.patching import ATTR

    for mod in model.modules():
        st = mod.__dict__.get(ATTR, {}).get("fp8_weights", {}).get("fp8")
        if st is not None and st.kind == "experts":
            st.large_path = path
            st.gather_max = 0


def _wan(device: str, size: str, env: RecordEnv, emit) -> list[str]:
    from diffusers import WanTransformer3DModel

    real = size == "real"
    kw = dict(
        patch_size=(1, 2, 2),
        num_attention_heads=24 if real else 2,
        attention_head_dim=128 if real else 12,
        in_channels=48,
        out_channels=48,
        text_dim=4096 if real else 32,
        freq_dim=256,
        ffn_dim=14336 if real else 32,
        num_layers=4 if real else 1,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
        rope_max_seq_len=1024,
    )
    frames, h, w = (21, 30, 52) if real else (2, 4, 4)
    torch.manual_seed(0)
    with torch.device(device):
        ref_model = WanTransformer3DModel(**kw).to(torch.bfloat16).eval()
    g = torch.Generator(device=device).manual_seed(3)
    hs = torch.randn(1, 48, frames, h, w, device=device, dtype=torch.bfloat16, generator=g)
    enc = torch.randn(1, 512 if real else 7, kw["text_dim"], device=device, dtype=torch.bfloat16, generator=g)
    t = torch.tensor([500], device=device)

    def fwd(m):
        with torch.no_grad():
            return m(hidden_states=hs, timestep=t, encoder_hidden_states=enc, return_dict=False)[0]

    t0 = time_fn(lambda: fwd(ref_model), device=device, warmup=1, repeats=5 if real else 2)
    ref = fwd(ref_model).float()
    b0 = _bytes(ref_model)
    wl = Workload(
        "wan_transformer_forward",
        {
            "model": "Wan2.2-5B-shaped (4 of 30 blocks)" if real else "tiny",
            "latent": [48, frames, h, w],
            "tokens": frames * h * w // 4,
            "text_tokens": enc.shape[1],
        },
    )
    emit(
        Record(
            wl,
            "stock",
            env,
            throughput=Throughput(t0.median_s, "s/call", seconds_per_call=t0.median_s),
            extra={"bytes": b0},
        )
    )
    report, conv = _convert_measured(ref_model, device)
    t1 = time_fn(lambda: fwd(ref_model), device=device, warmup=1, repeats=5 if real else 2)
    out = fwd(ref_model).float()
    b1 = _bytes(ref_model)
    rng = (ref.max() - ref.min()).item()
    ps = mpsboost.bench.psnr(out, ref, data_range=rng)
    emit(
        Record(
            wl,
            "mpsboost",
            env,
            throughput=Throughput(t1.median_s, "s/call", seconds_per_call=t1.median_s),
            correctness=Correctness(
                "bf16 transformer output", psnr_db=ps, sqnr_db=fp8_ops.sqnr_db(out, ref), data_range=rng
            ),
            extra={
                "bytes": b1,
                "bytes_ratio_linear": b1["linear_weights"] / b0["linear_weights"],
                "conversion": conv,
                "speedup_vs_stock": t0.median_s / t1.median_s,
            },
        )
    )
    return [
        f"wan   4-block forward {t0.median_s * 1e3:8.2f} -> {t1.median_s * 1e3:8.2f} ms   PSNR {ps:.1f} dB  "
        f"linear bytes x{b1['linear_weights'] / b0['linear_weights']:.3f}"
    ]


# ------------------------------------------------------------------------------------------ run


def run(device: str, size: str, out: Path) -> list[Record]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    partial = out / "fp8.partial.jsonl"
    if partial.exists():
        partial.unlink()
    budget = _Budget(float(os.environ.get("MPSBOOST_BENCH_SECONDS", "1e9")))
    env = RecordEnv.capture(device, torch.bfloat16)
    records: list[Record] = []
    peers = _peer_versions()

    def emit(rec: Record) -> None:
        rec = rec.replace(extra={**rec.extra, "peer_versions": peers})
        records.append(rec)
        append_jsonl(partial, [rec])

    bw = _copy_bandwidth(device)
    print(f"device copy bandwidth: {bw / 1e12:.2f} TB/s" if bw else "device copy bandwidth: n/a")
    summary: list[str] = []
    sections = {
        "decode": lambda: _decode(device, size, env, emit, budget, bw),
        "gemm": lambda: _gemm(device, size, env, emit, budget),
        "models": lambda: _models(device, size, env, emit, budget),
    }
    for name in _SECTIONS:  # in the order given
        fn = sections[name]
        t0 = time.monotonic()
        try:
            res = fn()
        except Exception:  # one broken section must not lose the others' records
            traceback.print_exc()
            summary.append(f"{name}: FAILED (traceback above)")
            continue
        summary.append(f"{name}: {time.monotonic() - t0:.1f} s")
        if name == "decode" and res:
            sp = [r[3] / r[4] for r in res]
            geo = math.exp(sum(math.log(s) for s in sp) / len(sp))
            big = sorted(res, key=lambda r: -r[1] * r[2])[:5]
            summary.append(
                f"decode: {len(res)} shapes, geomean speedup fp8/bf16 {geo:.3f}x "
                f"(min {min(sp):.2f}, max {max(sp):.2f}); "
                f"min SQNR {min(r[6] for r in res):.1f} dB"
            )
            for r in big:
                frac = f"{r[5] * 100:.0f}% of copy BW" if r[5] else ""
                summary.append(
                    f"  {r[0]:34s} {r[1]:6d}x{r[2]:<6d} bf16 {r[3]:8.2f} us  "
                    f"fp8 {r[4]:8.2f} us  {r[3] / r[4]:.2f}x  {frac}"
                )
            peer_lines = {}
            for r in res:
                for kname, us in r[7].items():
                    peer_lines.setdefault(kname, []).append(r[3] / us)
            for kname, v in peer_lines.items():
                summary.append(
                    f"  peer {kname:32s} geomean {math.exp(sum(map(math.log, v)) / len(v)):.3f}x over {len(v)} shapes"
                )
        if name == "gemm" and res:
            for label, n, k, r in res:
                parts = "  ".join(f"{kk}={vv:.0f}" for kk, vv in r.items())
                summary.append(f"  gemm {label:28s} {r['stock'] / r.get('mpsboost', float('nan')):.2f}x  {parts}")
        if name == "models" and res:
            summary += [f"  {line}" for line in res]
    print("\n".join(["", "fp8 summary"] + summary))
    return records


if __name__ == "__main__":
    from mpsboost.bench.cli import script_main

    raise SystemExit(script_main(__file__, run))
