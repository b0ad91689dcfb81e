"""conversion: what converting a bf16 weight costs at patch or load time, the fp8 codes of ``fp8="rowwise"`` and the
MLX 4/8-bit codes of ``low_bit_weights`` (and of quantize-at-load), against the plain-torch formula and MLX.

Workload: one routed-expert stack ``[E, 2 * 512, 2048]`` in bf16 (a ``gate_up_proj`` of Qwen3.6-35B-A3B's layout),
random normal * 0.02. ``--size real``: E = 256 (one layer of the real model, 1 GiB); ``small``: E = 32 (the
decode-cost tool's medium model); ``tiny``: ``[4, 64, 128]`` (a CPU smoke test). Per conversion, alternating
rounds in one process (``mpsboost.bench.harness.measure_variants``), then a separate pass per variant for memory
(``measure_memory``: the process's resident set on the CPU, the allocator on a GPU):

* ``conversion.fp8_rowwise``: ``stock`` is the formula written out in torch (``w.float().abs().amax(-1)`` / 448,
  then ``(w.float() / scale).clamp(-448, 448).to(float8_e4m3fn)``); ``mpsboost`` is
  ``mpsboost.ops.fp8.quantize(w, "rowwise")``, what ``patch(fp8="rowwise")`` calls per weight. Correctness: the
  codes and scales of ``mpsboost`` against ``stock``'s, bit for bit (``identical``).
* ``conversion.affine`` (bits 4 and 8, groups of 64): ``mpsboost`` is
  ``mpsboost.recipes.low_bit.layers.quantize`` (the codes of ``low_bit_weights`` and of quantize-at-load); ``mlx``
  is ``mx.quantize`` of the same weights on MLX's default device (a Mac's GPU, this Linux machine's CPU; not run
  when torch's device is CUDA: the two would not share a device). Correctness: codes, scales and biases against
  ``mx.quantize``'s, bit for bit. Ratios are to ``mlx``.

Commands:

    python benchmarks/conversion.py --device cpu --size small --out OUT
    python benchmarks/conversion.py --device mps --size real --out OUT      # a Mac: torch MPS and MLX's GPU
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from mpsboost.bench import Correctness, Record, RecordEnv, Workload, measure_memory
from mpsboost.bench.harness import MIN_REPEATS, measure_variants
from mpsboost.bench.timing import synchronize

EXPERTS = {"tiny": 4, "small": 32, "real": 256}
BITS = (4, 8)
GROUP = 64
FP8_MAX = 448.0


def _weight(size: str, device: str) -> torch.Tensor:
    rows, cols = (64, 128) if size == "tiny" else (1024, 2048)
    g = torch.Generator().manual_seed(0)
    return (torch.randn(EXPERTS[size], rows, cols, generator=g) * 0.02).to(torch.bfloat16).to(device)


def fp8_formula(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rowwise e4m3 codes as the formula reads, in plain torch: the baseline, and the reference for its codes."""
    amax = w.float().abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def _mlx():
    try:
        import mlx.core as mx
    except ImportError:
        return None
    return mx


def _peak(device: str, fn: Callable[[], Any]) -> tuple[Any, Any]:
    """One call of ``fn`` apart from the timed rounds: its output (what the codes are checked on) and its memory
    peaks."""
    with measure_memory(device) as probe:
        out = fn()
        synchronize(device)
    return out, probe.peaks()


def _record(wl: Workload, variant: str, env: RecordEnv, timing, reference: str, same, memory, extra: dict) -> Record:
    """One variant's record: its time per call, its codes against ``reference`` (``same``: bit for bit equal, or
    None where not compared) and its memory peak."""
    check = None if same is None else Correctness(f"{reference}, bit for bit", max_abs=0.0 if same else None)
    return Record(wl, variant, env, throughput=timing.throughput(), correctness=check, memory=memory, extra=extra)


def _measure(variants: dict, device: str, repeats: int):
    return measure_variants(variants, device=device, repeats=repeats, warmup=2)


def run(device: str, size: str, out: Path) -> list[Record]:
    from mpsboost.ops import fp8 as fp8_ops
    from mpsboost.recipes.low_bit.layers import quantize as affine_quantize

    env = RecordEnv.capture(device, torch.bfloat16)
    repeats = {"tiny": MIN_REPEATS, "small": 11, "real": 7}[size]
    w = _weight(size, device)
    shape = {"experts": w.shape[0], "rows": w.shape[1], "cols": w.shape[2], "dtype": "bfloat16"}
    records: list[Record] = []
    lines = []

    # fp8 rowwise: the formula in torch against mpsboost's conversion
    wl = Workload("conversion.fp8_rowwise", shape)
    variants = {"stock": lambda: fp8_formula(w), "mpsboost": lambda: fp8_ops.quantize(w, "rowwise")}
    m = _measure(variants, device, repeats)
    outs, mems = {}, {}
    for variant, fn in variants.items():
        outs[variant], mems[variant] = _peak(device, fn)
    (q_ref, s_ref), (q, s) = outs["stock"], outs["mpsboost"]
    same = torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
    del outs, q_ref, s_ref, q, s
    for variant in variants:
        t = m.timings[variant]
        ok = same if variant == "mpsboost" else True  # the formula's codes are the reference
        extra = {"identical": ok, **m.extra(variant)}
        records.append(_record(wl, variant, env, t, "stock formula", ok, mems[variant], extra))
        lines.append(("fp8 rowwise", variant, t.median_s))

    # MLX 4/8-bit affine: mpsboost's codes against mx.quantize
    mx = _mlx() if not device.startswith("cuda") else None
    for bits in BITS:
        wl = Workload("conversion.affine", {**shape, "bits": bits, "group_size": GROUP})
        variants = {"mpsboost": lambda bits=bits: affine_quantize(w, bits, GROUP)}
        extra_all: dict = {}
        same = None
        if mx is not None:
            a = mx.array(w.float().cpu().numpy()).astype(mx.bfloat16)
            mx.eval(a)

            def mlx_quantize(bits=bits, a=a):
                out = mx.quantize(a, group_size=GROUP, bits=bits)
                mx.eval(*out)
                return out

            variants["mlx"] = mlx_quantize
            extra_all["mlx_device"] = str(mx.default_device())
        else:
            extra_all["mlx"] = "not run: " + ("torch's device is CUDA" if device.startswith("cuda") else "no mlx")
        m = _measure(variants, device, repeats)
        # The memory pass's outputs are the ones compared. MLX's memory is in the process's resident set on the CPU;
        # a GPU's counters are torch's, so there MLX's call is made without a probe.
        (q, s, b), mem = _peak(device, variants["mpsboost"])
        mems = {"mpsboost": mem}
        if mx is not None:
            (mq, ms, mb), mems["mlx"] = _peak(device, mlx_quantize) if device == "cpu" else (mlx_quantize(), None)
            q, s, b = q.cpu(), s.cpu(), b.cpu()
            same = bool(
                np.array_equal(np.array(mq).view(np.uint32), q.view(torch.int32).numpy().view(np.uint32))
                and torch.equal(torch.from_numpy(np.array(ms.astype(mx.float32))), s.float())
                and torch.equal(torch.from_numpy(np.array(mb.astype(mx.float32))), b.float())
            )
        for variant in variants:
            t = m.timings[variant]
            base = "mlx" if "mlx" in variants else variant
            extra = {**extra_all, "identical": same, **m.extra(variant, baseline=base)}
            records.append(_record(wl, variant, env, t, "mx.quantize", same, mems[variant], extra))
            lines.append((f"affine {bits}-bit g{GROUP}", variant, t.median_s))

    print(f"\n{'conversion':20s} {'variant':10s} {'s/call':>10s}")
    for what, v, sec in lines:
        print(f"{what:20s} {v:10s} {sec:10.3f}")
    return records


if __name__ == "__main__":
    from mpsboost.bench.cli import script_main

    raise SystemExit(script_main(__file__, run))
