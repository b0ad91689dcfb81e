"""The seed's workloads, stock torch against ``mpsboost.patch()`` in one process, at three sizes.

* ``test``: tiny configs of the real classes (CI on a CPU: seconds);
* ``quick``: the real architectures at sizes that reach the known triggers, within the default budget
  of a Mac run (the default);
* ``full``: the sizes of the upstream reports (Wan2.2 480x832, 21 frames in 256x256 tiles; 1024 px round
  trips; four Qwen3.6 layers with the real vocabulary where memory allows).

Each workload builds its model with random weights from a fixed seed, runs it stock (output, memory
peaks, time), patches it with the default :func:`mpsboost.patch` (``fp8="rowwise"`` for the fp8
layer), runs it again, and compares: patched against stock, and both against a CPU fp32 reference
where the workload has one at that size (the VAEs: PSNR). A long call is timed fewer times
(:data:`TIME_CAP_S` per variant and process). A workload where ``patch()`` applies nothing is "not
applicable" (stock is still measured: its error against the CPU is evidence of a build's bug).
Recipes that are merged later (Gated DeltaNet, the Qwen-Image-2.1 VAE) apply without a change here.
"""

from __future__ import annotations

import copy
import functools
import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .machine import fp32_tolerance
from ..bench.harness import release as _release

__all__ = ["SEED_WORKLOADS", "SIZES", "BudgetSpent", "SeedWorkload", "run_workload", "time_workload"]

SIZES = ("test", "quick", "full")
# "stock fails": stock torch raised on this build and the patched model ran (e.g. a missing MPS kernel
# that a recipe avoids) -- a finding, with the patched measurements and no ratio.
STATUSES = ("pass", "fail", "stock fails", "not applicable", "skipped", "error")


@dataclass(frozen=True)
class Built:
    model: Any
    run: Callable[[Any], Any]  # run(module) -> output tensor
    shape: dict
    dtype: str


@dataclass(frozen=True)
class SeedWorkload:
    name: str
    what: str
    build: Callable[[str, str], Built]  # build(size, device)
    metric: str = "psnr"  # "psnr" (images, data range 2) or "rel" (logits, outputs)
    cpu_reference: tuple[str, ...] = SIZES  # the sizes at which a CPU fp32 reference is computed
    fp8: str | None = None
    tolerance: dict = field(default_factory=lambda: {"float32": 1e-4, "bfloat16": 3e-2, "float16": 1e-2})


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def _fp_dtype(device: str) -> str:
    return "float32" if device == "cpu" else "bfloat16"


def _first_param(module):
    return next(module.parameters())


# ------------------------------------------------------------------------------------------ VAEs


def _wan22(size: str, device: str) -> Built:
    import torch

    from ..bench.models import build

    torch.manual_seed(0)
    if size == "test":
        vae = build("wan22_vae:tiny")  # the Wan2.2 structure at diffusers' test width
        latent, tile = (1, 48, 2, 2, 4), (32, 16)  # 32x64 px: three overlapping tiles
    else:
        # Wan2.2-TI2V-5B's VAE (Wan-AI/Wan2.2-TI2V-5B-Diffusers vae/config.json)
        vae = build("wan22_vae:real")
        # quick: 256x256, 5 frames in nine 128x128 tiles: hundreds of 5-D pads (the driver-memory counter of
        # pytorch#195368) below the H*W = 65536 corruption, so stock is right and no CPU reference is needed.
        # full: 480x832, 21 frames, 256x256 tiles (H*W = 65536: the pytorch#194922 trigger), against the CPU.
        latent, tile = ((1, 48, 2, 16, 16), (128, 96)) if size == "quick" else ((1, 48, 6, 30, 52), (256, 192))
    vae = vae.eval().to(device)
    vae.enable_tiling(
        tile_sample_min_height=tile[0],
        tile_sample_min_width=tile[0],
        tile_sample_stride_height=tile[1],
        tile_sample_stride_width=tile[1],
    )
    z = torch.randn(*latent, generator=torch.Generator().manual_seed(0))

    def run(module):
        p = _first_param(module)
        with torch.no_grad():
            return module.decode(z.to(p.device, p.dtype)).sample

    return Built(
        vae,
        run,
        {"latent": list(latent), "pixels": [latent[3] * 16, latent[4] * 16], "tile": tile[0], "stride": tile[1]},
        "float32",
    )


def _roundtrip(vae, pixels: int, channels: int, device: str, tile: tuple[int, int] | None = None) -> Built:
    import torch

    vae = vae.eval().to(device)
    if tile is not None:
        vae.enable_tiling(
            tile_sample_min_height=tile[0],
            tile_sample_min_width=tile[0],
            tile_sample_stride_height=tile[1],
            tile_sample_stride_width=tile[1],
        )
    x = torch.rand(1, channels, 1, pixels, pixels, generator=torch.Generator().manual_seed(0)) * 2 - 1

    def run(module):
        p = _first_param(module)
        with torch.no_grad():
            return module(x.to(p.device, p.dtype), sample_posterior=False).sample

    return Built(vae, run, {"image": [1, channels, 1, pixels, pixels]}, "float32")


def _qwen_image(size: str, device: str) -> Built:
    import torch

    from ..bench.models import build

    torch.manual_seed(0)
    if size == "test":  # diffusers' tests/pipelines/qwenimage/test_qwenimage.py
        return _roundtrip(build("qwen_image_vae:tiny"), 32, 3, device)
    # Qwen/Qwen-Image vae/config.json = the class defaults; 512 px crosses H*W = 65536 in the first stage
    return _roundtrip(build("qwen_image_vae:real"), 512 if size == "quick" else 1024, 3, device)


def _qwen_image21(size: str, device: str) -> Built:
    import torch

    from ..bench.models import build

    torch.manual_seed(0)
    if size == "test":
        vae = build("qwen_image21_vae:tiny")
        return _roundtrip(vae, 32, vae.config.in_channels, device)
    vae = build("qwen_image21_vae:real")  # the class defaults are Qwen-Image-2.1's VAE
    return _roundtrip(vae, 512 if size == "quick" else 1024, vae.config.in_channels, device)


# ------------------------------------------------------------------------------------------ Qwen3.6 decode


def _memory_bytes() -> int:
    from .machine import _memory_bytes

    return _memory_bytes() or 0


def _qwen36(size: str, device: str, *, prefill_only: bool = False) -> Built:
    import torch
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    dtype = _fp_dtype(device)
    if size == "test":
        from ..bench.models import model_config

        cfg = Qwen3_5MoeTextConfig(**model_config("qwen3_5_moe:selftest"))
        prompt, steps = (70, 0) if prefill_only else (6, 3)  # prefill: two 64-token chunks, the second padded
    else:
        # Qwen3.6-35B-A3B's text model (the config defaults: hidden 2048, 256 experts top-8, Gated DeltaNet
        # 16/32 heads of 128, attention 16/2 heads of 256); a few of its 40 layers. Each MoE layer is 1.6 GB in bf16.
        four = size == "full" and _memory_bytes() >= 48 * 2**30
        types = ["linear_attention"] * 3 + ["full_attention"] if four else ["linear_attention", "full_attention"]
        cfg = Qwen3_5MoeTextConfig(
            num_hidden_layers=len(types), layer_types=types, vocab_size=248320 if size == "full" else 32768
        )
        prompt, steps = (512, 16) if size == "full" else (64, 8)
        if prefill_only:  # time to first token: the chunked Gated DeltaNet prefill, 32 or 8 chunks a layer
            prompt, steps = (2048 if size == "full" else 512), 0
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(_torch_dtype(dtype))
    try:
        with torch.device(device):  # initialise on the device: no fp32 copy of the experts in host memory
            model = Qwen3_5MoeForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(previous)
    ids = torch.randint(3, cfg.vocab_size, (1, prompt + steps), generator=torch.Generator().manual_seed(0))
    import inspect

    key = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"

    def run(module):
        dev = _first_param(module).device
        x = ids.to(dev)
        outs = []
        with torch.no_grad():
            out = module(input_ids=x[:, :prompt], use_cache=True, logits_to_keep=1)
            outs.append(out.logits[:, -1:].float())
            for i in range(steps):
                past = getattr(out, key, None)
                past = past if past is not None else out.past_key_values
                out = module(input_ids=x[:, prompt + i : prompt + i + 1], use_cache=True, **{key: past})
                outs.append(out.logits.float())
        return torch.cat(outs, dim=1)

    shape = {
        "layers": cfg.layer_types,
        "hidden": cfg.hidden_size,
        "experts": cfg.num_experts,
        "top_k": cfg.num_experts_per_tok,
        "vocab": cfg.vocab_size,
        "prompt": prompt,
        "decode_steps": steps,
    }
    return Built(model, run, shape, dtype)


# ------------------------------------------------------------------------------------------ fp8 layer


def _fp8_linear(m_rows: Callable[[str], int]) -> Callable[[str, str], Built]:
    def build(size: str, device: str) -> Built:
        import torch

        dtype = _fp_dtype(device)
        k = n = 64 if size == "test" else 4096
        m = m_rows(size)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False)).to(device, _torch_dtype(dtype)).eval()
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(0))

        def run(module):
            p = _first_param(module) if any(True for _ in module.parameters()) else None
            dev = p.device if p is not None else torch.device(device)
            with torch.no_grad():
                return module(x.to(dev, _torch_dtype(dtype)))

        return Built(model, run, {"m": m, "k": k, "n": n}, dtype)

    return build


SEED_WORKLOADS: dict[str, SeedWorkload] = {
    w.name: w
    for w in [
        SeedWorkload(
            "wan22_vae_tiled_decode",
            "Wan2.2 TI2V-5B VAE, tiled decode (pytorch#195368, #194922)",
            _wan22,
            cpu_reference=("test", "full"),
        ),
        SeedWorkload(
            "qwen_image_vae_roundtrip", "Qwen-Image VAE encode + decode, PSNR vs CPU (ComfyUI#16433)", _qwen_image
        ),
        SeedWorkload(
            "qwen_image21_vae_roundtrip",
            "Qwen-Image-2.1 VAE encode + decode, PSNR vs CPU (Qwen-Image-2.1#6)",
            _qwen_image21,
        ),
        SeedWorkload(
            "qwen36_decode",
            "Qwen3.6-35B-A3B layers (Gated DeltaNet + MoE): prefill, then one-token decode steps",
            _qwen36,
            metric="rel",
            cpu_reference=(),
            tolerance={"float32": 1e-4, "bfloat16": 5e-2, "float16": 5e-2},
        ),
        SeedWorkload(
            "qwen36_prefill",
            "Qwen3.6-35B-A3B layers (Gated DeltaNet + MoE): one long prompt, no decode (time to first token)",
            functools.partial(_qwen36, prefill_only=True),
            metric="rel",
            cpu_reference=(),
            tolerance={"float32": 1e-4, "bfloat16": 5e-2, "float16": 5e-2},
        ),
        SeedWorkload(
            "qwen36_fp8_decode",
            "Qwen3.6-35B-A3B layers in fp8 rowwise (on a Mac: mpsboost's Metal fp8 kernel) against stock bf16: "
            "prefill, then one-token decode steps (run with qwen36_decode, patched bf16 against the same stock)",
            _qwen36,
            metric="rel",
            cpu_reference=(),
            fp8="rowwise",
            tolerance=dict.fromkeys(("float32", "bfloat16", "float16"), 0.1),
        ),
        SeedWorkload(
            "fp8_linear_m1",
            "one 4096x4096 layer in fp8 rowwise storage, one token (decode)",
            _fp8_linear(lambda size: 1),
            metric="rel",
            cpu_reference=(),
            fp8="rowwise",
            tolerance=dict.fromkeys(("float32", "bfloat16", "float16"), 0.1),
        ),
        SeedWorkload(
            "fp8_linear_m1024",
            "one 4096x4096 layer in fp8 rowwise storage, 1024 tokens (prefill; pytorch#196916)",
            _fp8_linear(lambda size: 16 if size == "test" else 1024),
            metric="rel",
            cpu_reference=(),
            fp8="rowwise",
            tolerance=dict.fromkeys(("float32", "bfloat16", "float16"), 0.1),
        ),
    ]
}


# ------------------------------------------------------------------------------------------ running


def _quality(x, ref, metric: str) -> dict:
    from ..bench import psnr, relative_error

    d = {"rel_error": _finite(relative_error(x, ref))}
    if metric == "psnr":
        d["psnr_db"] = _finite(psnr(x, ref, data_range=2.0))
    return d


def _finite(v: float | None) -> float | None:
    """JSON has no inf/nan: an identical pair's PSNR is recorded as 999 dB, a NaN as None."""
    if v is None or math.isnan(v):
        return None
    return 999.0 if math.isinf(v) else float(v)


def _patch(model, wl: SeedWorkload):
    import mpsboost

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # parts a recipe leaves alone are in the report rows
        return mpsboost.patch(model, fp8=wl.fp8)


# Seconds of timed calls per variant and process at most: a 40 s decode is timed once, not five times.
TIME_CAP_S = 60.0


def _time(run, model, device: str, repeats: int) -> float:
    """Median seconds per call after one warm-up call; fewer repeats when one call is long."""
    from ..bench.harness import measure_job

    m = measure_job(
        lambda: run(model), device=device, repeats=repeats, warmup=1, output=None, memory=None, time_cap_s=TIME_CAP_S
    )
    return m.timing.median_s


def _memory_dict(mem) -> dict:
    return {
        k: getattr(mem, k) for k in ("tensor_allocated", "allocator_reserved", "driver_level", "driver_level_source")
    }


class BudgetSpent(Exception):
    """The selftest's time budget ran out inside a workload, before ``step``."""

    def __init__(self, step: str):
        super().__init__(f"time budget spent before {step}")
        self.step = step


def run_workload(
    wl: SeedWorkload,
    device: str,
    size: str,
    repeats: int,
    *,
    deadline: float | None = None,
    clock: Callable[[], float] = time.perf_counter,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """The full measurement of one workload in this process: outputs, memory, time, quality.

    Before each step (build, stock run and timing, CPU reference, patch, patched run and timing) the
    budget is checked against ``deadline`` (on ``clock``): once it is spent, :class:`BudgetSpent`
    names the step not started. ``progress`` gets one line per step as it starts.
    """
    import torch

    from ..bench import measure_memory

    t0 = clock()

    def step(what: str) -> None:
        if deadline is not None and clock() > deadline:
            raise BudgetSpent(what)
        if progress is not None:
            progress(f"    {wl.name}: {what} ({clock() - t0:.0f} s)")

    rec: dict[str, Any] = {"kind": "workload", "name": wl.name, "what": wl.what, "size": size}
    step("build")
    built = wl.build(size, device)
    model, run = built.model, built.run
    rec.update(shape=built.shape, dtype=built.dtype)
    step("stock run")
    try:
        with measure_memory(device) as probe:
            stock_out = run(model).detach()
    except (RuntimeError, NotImplementedError, TypeError) as e:
        return _stock_fails(rec, wl, model, run, device, repeats, e, t0, clock)
    step("stock timing")
    stock = {"seconds": [_time(run, model, device, repeats)], "memory": _memory_dict(probe.peaks())}
    ref = None
    if size in wl.cpu_reference:
        if device == "cpu" and built.dtype == "float32":
            ref = stock_out.float()
        else:
            step("CPU reference")
            ref_model = copy.deepcopy(model).to("cpu", torch.float32)
            ref = run(ref_model).detach().float()
            del ref_model
        stock["vs_cpu"] = _quality(stock_out.float().cpu(), ref, wl.metric)
    step("patch")
    report = _patch(model, wl)
    applied = sorted({r.recipe for r in report.rows if r.status == "applied"})
    rec["recipes"] = applied
    rec["stock"] = stock
    if not applied:
        why = (
            "; ".join(sorted({f"{r.recipe}: {r.reason}" for r in report.rows if r.status == "skipped"}))
            or "no recipe applies"
        )
        rec.update(status="not applicable", reason=f"patch() applied nothing here ({why})")
    else:
        _release(device)
        step("patched run")
        with measure_memory(device) as probe:
            patched_out = run(model).detach()
        step("patched timing")
        patched = {"seconds": [_time(run, model, device, repeats)], "memory": _memory_dict(probe.peaks())}
        if ref is not None:
            patched["vs_cpu"] = _quality(patched_out.float().cpu(), ref, wl.metric)
        vs_stock = _quality(patched_out.float().cpu(), stock_out.float().cpu(), wl.metric)
        tol = fp32_tolerance(device, built.dtype, wl.tolerance[built.dtype])
        close = vs_stock["rel_error"] is not None and vs_stock["rel_error"] <= tol
        why = (
            f"patched vs stock rel. error {vs_stock['rel_error']:.2e} (tolerance {tol:g})"
            if vs_stock["rel_error"] is not None
            else "patched output has NaN"
        )
        if ref is not None:
            s, p = stock["vs_cpu"]["rel_error"], patched["vs_cpu"]["rel_error"]
            no_worse = p is not None and (s is None or p <= 1.5 * s + tol)
            # A build with a stock bug (the rank-5 pad) is far from the CPU; patched must be at least as close.
            stock_broken = s is None or s > 100 * tol
            ok = no_worse and (close or stock_broken)
            why += f"; vs CPU fp32: stock {_fmt(s)}, patched {_fmt(p)}"
            if stock_broken and not close:
                why += " (stock is the one far from the CPU)"
        else:
            ok = close
        rec.update(
            status="pass" if ok else "fail",
            reason=why,
            patched=patched,
            vs_stock=vs_stock,
            tolerance=tol,
            ratio_here=stock["seconds"][0] / patched["seconds"][0] if patched["seconds"][0] > 0 else None,
        )
    rec["seconds"] = round(clock() - t0, 2)
    del model, built
    _release(device)
    return rec


def _stock_fails(
    rec: dict,
    wl: SeedWorkload,
    model,
    run,
    device: str,
    repeats: int,
    error: Exception,
    t0: float,
    clock: Callable[[], float] = time.perf_counter,
) -> dict:
    """Stock raised: patch and run anyway; the record says what stock raised and whether patched ran."""
    first = (str(error).strip().splitlines() or [""])[0][:300]
    rec["stock"] = {"error": f"{type(error).__name__}: {first}"}
    report = _patch(model, wl)
    rec["recipes"] = sorted({r.recipe for r in report.rows if r.status == "applied"})
    if not rec["recipes"]:
        rec.update(status="error", reason=f"stock raised {rec['stock']['error']}; patch() applied nothing here")
    else:
        from ..bench import measure_memory

        with measure_memory(device) as probe:
            out = run(model).detach()
        finite = bool(out.float().isfinite().all())
        rec["patched"] = {
            "seconds": [_time(run, model, device, repeats)],
            "memory": _memory_dict(probe.peaks()),
            "finite": finite,
        }
        rec.update(
            status="stock fails" if finite else "error",
            reason=f"stock raised {rec['stock']['error']}; patched ran"
            + ("" if finite else " but its output is not finite"),
        )
    rec["seconds"] = round(clock() - t0, 2)
    _release(device)
    return rec


def _fmt(v: float | None) -> str:
    return "NaN" if v is None else f"{v:.2e}"


def time_workload(wl: SeedWorkload, device: str, size: str, repeats: int) -> dict:
    """Stock and patched seconds only (a repeat in a fresh process): no reference, no memory."""
    built = wl.build(size, device)
    model, run = built.model, built.run
    try:
        stock = _time(run, model, device, repeats)
    except (RuntimeError, NotImplementedError, TypeError):
        stock = None  # recorded once by the first process; a repeat has no ratio to add
    report = _patch(model, wl)
    patched = _time(run, model, device, repeats) if any(r.status == "applied" for r in report.rows) else None
    del model, built
    _release(device)
    return {"name": wl.name, "stock_s": stock, "patched_s": patched}
