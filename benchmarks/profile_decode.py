"""profile_decode: where the GPU time of a static-cache ``generate()`` goes, stock bf16 against ``fp8="rowwise"``.

A diagnostic, not a benchmark: it explains an end-to-end figure of ``benchmarks/e2e.py`` by kernel.
A Qwen3-8B-shaped model (random weights, ``--layers`` of its 36) runs ``generate(max_new_tokens=N,
cache_implementation="static")`` once to compile, then once under ``torch.profiler``; the table lists
the kernels by total CUDA time, grouped into GEMV/GEMM, attention, fp8 kernels and the rest, and
the wall time of the call next to the summed kernel time (the difference is host time the GPU waited).

    python benchmarks/profile_decode.py --device cuda --layers 36 --out OUT
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _diag import append_jsonl  # noqa: E402


def _group(name: str) -> str:
    n = name.lower()
    if "fp8_gemv" in n or "quant_rows" in n or "_splitk_reduce_kernel" in n:
        return "mpsboost fp8"
    if "gemv" in n or "gemm" in n or "sm90_xmma" in n or "cutlass" in n or "nvjet" in n:
        return "cuBLAS GEMM/GEMV"
    if "flash" in n or "attention" in n or "sdpa" in n or "fmha" in n:
        return "attention"
    if "triton" in n:
        return "inductor triton"
    return "other"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.device != "cuda" or not torch.cuda.is_available():
        print("profile_decode profiles CUDA kernels: run it with --device cuda on a CUDA machine")
        return 2
    import e2e  # the same model builder and config as the matrix

    import mpsboost

    cfg = e2e.llm_config("qwen3-8b", "real", a.layers)
    prompt = torch.randint(0, cfg.vocab_size, (1, 512), generator=torch.Generator().manual_seed(1)).cuda()
    rows = []
    for variant in ("stock", "fp8"):
        model = e2e.build_llm(cfg, "cuda", torch.bfloat16, 0)
        if variant == "fp8":
            mpsboost.patch(model, fp8="rowwise")
        kw = dict(max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens, do_sample=False,
                  cache_implementation="static", attention_mask=torch.ones_like(prompt))
        with torch.no_grad():
            model.generate(prompt, **kw)  # compile
            model.generate(prompt, **kw)
            torch.cuda.synchronize()
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                t = time.perf_counter()
                model.generate(prompt, **kw)
                torch.cuda.synchronize()
                wall = time.perf_counter() - t
        kernels: dict[str, float] = {}
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                kernels[ev.name] = kernels.get(ev.name, 0.0) + ev.device_time_total / 1e3  # ms
        total = sum(kernels.values())
        groups: dict[str, float] = {}
        for k, v in kernels.items():
            groups[_group(k)] = groups.get(_group(k), 0.0) + v
        print(f"== {variant}: {a.layers} layers, {a.new_tokens} new tokens after 512: wall {wall * 1e3:.1f} ms, "
              f"kernels {total:.1f} ms ({total / wall / 10:.0f}% of wall)")
        for g, v in sorted(groups.items(), key=lambda x: -x[1]):
            print(f"   {g:20s} {v:8.2f} ms  {v / a.new_tokens:7.3f} ms/token")
        top = sorted(kernels.items(), key=lambda x: -x[1])[:12]
        for k, v in top:
            print(f"      {v:8.2f} ms  {k[:110]}")
        rows.append({"variant": variant, "layers": a.layers, "new_tokens": a.new_tokens, "wall_ms": wall * 1e3,
                     "kernel_ms": total, "groups_ms": groups, "top_kernels_ms": dict(top),
                     "torch": torch.__version__, "device": torch.cuda.get_device_name()})
        del model
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    append_jsonl(a.out, "profile_decode.jsonl", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
