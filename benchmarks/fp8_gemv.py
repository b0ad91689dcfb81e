"""fp8_gemv: operator time of the batch-1 fp8 GEMV (``mpsboost::fp8_gemv``) against bf16 ``F.linear``.

An operator benchmark, not an end-to-end one: it tells which kernel and launch configuration streams
weight bytes fastest, and how close each gets to the device's copy bandwidth; whether that reaches a
``generate()`` is measured by ``benchmarks/e2e.py``.

For each (N, K) of the Qwen3-8B decoder and its lm_head, ``L`` distinct weights (together well over the
L2 cache, as the layers of one decode step are) are run one after the other, captured into one CUDA
graph (``mpsboost.bench.timing.time_fn``); the time per layer is the time per cycle over ``L``. Variants,
all in one process:

* ``bf16``: ``F.linear`` on the bf16 weights (cuBLAS), the baseline a user has without fp8;
* ``fp8 mma <cfg>`` / ``fp8 row <cfg>``: each launch configuration the tuner considers, for the
  tensor-core kernel and the single-row CUDA-core kernel of ``mpsboost.ops.fp8_triton``;
* ``fp8 tuned``: what ``mpsboost::fp8_gemv`` runs after its patch-time tuning (the shipped path).

Each variant is checked against ``x @ (codes * scale).T`` computed in float32 (relative error).

    python benchmarks/fp8_gemv.py --device cuda --out benchmarks/results
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _diag import append_jsonl  # noqa: E402

SHAPES = {  # (N, K): what one Qwen3-8B decode step runs at batch 1
    "q_proj/o_proj": (4096, 4096),
    "k_proj/v_proj": (1024, 4096),
    "gate/up_proj": (12288, 4096),
    "down_proj": (4096, 12288),
    "lm_head": (151936, 4096),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=None, help="folder for fp8_gemv.jsonl")
    p.add_argument("--min-bytes", type=int, default=400 * 2**20, help="fp8 bytes per cycle of distinct weights")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--only", default=None, help="comma-separated shape names")
    a = p.parse_args(argv)
    if a.device != "cuda" or not torch.cuda.is_available():
        print("fp8_gemv measures the CUDA kernels: run it with --device cuda on a CUDA machine")
        return 2
    import triton

    import mpsboost
    from mpsboost.bench.harness import copy_bandwidth
    from mpsboost.bench.timing import time_fn
    from mpsboost.ops import fp8_triton as ft

    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    props = torch.cuda.get_device_properties(dev)
    env = {
        "device": props.name,
        "capability": list(torch.cuda.get_device_capability(dev)),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "mpsboost": mpsboost.__version__,
        "date": _dt.date.today().isoformat(),
        "command": " ".join(["python", "benchmarks/fp8_gemv.py"] + (argv or sys.argv[1:])),
        "copy_bandwidth_GBps": bw / 1e9 if bw else None,
    }
    print(json.dumps(env))
    records = []
    shapes = {k: v for k, v in SHAPES.items() if a.only is None or k in a.only.split(",")}
    torch.manual_seed(0)
    for name, (n, k) in shapes.items():
        layers = max(2, -(-a.min_bytes // (n * k)))
        ws16 = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(layers)]
        scales = [w.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 448.0 for w in ws16]
        codes = [(w.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn) for w, s in zip(ws16, scales)]
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        outs = [torch.empty(1, n, device=dev, dtype=torch.bfloat16) for _ in range(layers)]
        refs = [(x.float() @ (c.float() * s).T) for c, s in zip(codes, scales)]
        replays = max(3, int(2e-3 / max(layers * n * k / 3e12, 1e-6)))

        def rel(i: int) -> float:
            return float((outs[i].float() - refs[i]).norm() / refs[i].norm())

        variants: list[tuple[str, object]] = [("bf16", None)]
        cands = ft._candidates(1, n, k, ft._sms(dev))
        variants += [
            (f"fp8 {c.kind} bn{c.block_n} bk{c.block_k} sk{c.split_k} w{c.num_warps} s{c.num_stages}", c) for c in cands
        ]
        ft.clear_tuning_cache()
        t0 = time.perf_counter()
        ft.fp8_gemv(x, codes[0], scales[0].reshape(-1))  # the shipped tuning (cold L2), as at patch time
        tune_s = time.perf_counter() - t0
        tuned = next(iter(ft._TUNED.values()))
        variants.append((f"fp8 tuned ({tuned.kind} bn{tuned.block_n} bk{tuned.block_k} sk{tuned.split_k})", tuned))
        base = None
        for label, cfg in variants:
            if cfg is None:

                def fn():
                    for i in range(layers):
                        torch.mm(x, ws16[i].t(), out=outs[i])

                wbytes = 2 * n * k
            else:

                def fn(cfg=cfg):
                    for i in range(layers):
                        ft._launch(x, codes[i], scales[i].reshape(-1), None, outs[i], cfg)

                wbytes = n * k + 4 * n
            try:
                ts = list(
                    time_fn(fn, device=dev, warmup=2, repeats=a.repeats, cuda_graph=True, calls=replays).samples_s
                )
            except Exception as exc:  # noqa: BLE001 - a configuration that fails to compile is recorded
                records.append(
                    {"shape": name, "n": n, "k": k, "variant": label, "error": f"{type(exc).__name__}: {exc}"[:300]}
                )
                print(f"{name:14s} {label:44s} failed: {exc}"[:200])
                continue
            per_layer = [t / layers for t in ts]
            med = statistics.median(per_layer)
            err = (
                rel(0)
                if cfg is not None
                else float(
                    (outs[0].float() - x.float() @ ws16[0].float().T).norm() / (x.float() @ ws16[0].float().T).norm()
                )
            )
            if cfg is None:
                base = med
            rec = {
                "shape": name,
                "n": n,
                "k": k,
                "layers_in_cycle": layers,
                "variant": label,
                "us_per_layer_median": med * 1e6,
                "us_per_layer_min": min(per_layer) * 1e6,
                "us_per_layer_max": max(per_layer) * 1e6,
                "repeats": a.repeats,
                "replays": replays,
                "weight_bytes": wbytes,
                "GBps": wbytes / med / 1e9,
                "share_of_copy_bandwidth": (wbytes / med) / bw if bw else None,
                "speedup_vs_bf16": base / med if base else None,
                "rel_err_vs_fp32_dequant": err,
            }
            if label.startswith("fp8 tuned"):
                rec["tune_s"] = tune_s
            records.append(rec)
            print(
                f"{name:14s} {label:44s} {med * 1e6:8.1f} us  [{min(per_layer) * 1e6:.1f}-{max(per_layer) * 1e6:.1f}]  "
                f"{rec['GBps']:7.0f} GB/s  {rec['share_of_copy_bandwidth'] or 0:5.2f} of copy  "
                f"x{rec['speedup_vs_bf16'] or 0:4.2f} vs bf16  rel {err:.1e}",
                flush=True,
            )
        ws16 = codes = scales = outs = refs = None  # free before the next shape
        torch.cuda.empty_cache()
    append_jsonl(a.out, "fp8_gemv.jsonl", [{**r, "env": env} for r in records])
    return 0


if __name__ == "__main__":
    sys.exit(main())
