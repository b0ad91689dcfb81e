"""Per-recipe checks: every registered recipe on a tiny real-architecture workload, stock vs patched.

For each recipe with a workload below: build the model (a real diffusers/transformers class from a
tiny config, random weights from a fixed seed), ask :func:`mpsboost.plan` whether the recipe applies
here (if not, record why), run it stock and patched (only that recipe), and check patched against
stock and both against a CPU fp32 reference: a recipe passes when patched stays within a tolerance
of stock and is no further from the CPU reference than stock is. These are correctness checks of
each recipe on this device (tiny models: launch-bound, not a benchmark); the seed workloads in
:mod:`.workloads` carry the speed and memory evidence.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .machine import fp32_tolerance

__all__ = [
    "LOSSY",
    "STATUSES",
    "TOLERANCE",
    "WORKLOADS",
    "RecipeResult",
    "RecipeWorkload",
    "check_recipe",
    "format_table",
]

KIND = "selftest"
STATUSES = ("pass", "fail", "not applicable", "no workload", "error")
DTYPES = ("float32", "bfloat16", "float16")
# Patched vs stock (relative L2 error) for a lossless recipe, per dtype; a lossy one (fp8) gets LOSSY.
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 1e-2}
LOSSY = 0.25


# ------------------------------------------------------------------------------------------ workloads

# The models: rows of mpsboost.bench.models.MODELS (one table for the demo, the selftest and the benchmarks).


def _model(name: str) -> Callable[[], Any]:
    def make():
        from ..bench.models import build

        return build(name)

    make.__name__ = make.__qualname__ = f"build_{name.replace(':', '_')}"
    return make


# The Wan2.2 TI2V-5B VAE structure (residual, patch size 2, z 48, 16x spatial) at diffusers' test width.
_wan22_vae = _model("wan22_vae:tiny")
_qwen_image_vae = _model("qwen_image_vae:tiny")  # diffusers' tests/pipelines/qwenimage/test_qwenimage.py
_qwen3_moe = _model("qwen3_moe:selftest")
_qwen3 = _model("qwen3:selftest")
_llama_eager = _model("llama_eager:selftest")
_hunyuan_video_vae = _model("hunyuan_video_vae:tiny")


def _video_roundtrip(vae, device, dtype, *, tiled: bool = False, pixels: int = 32, frames: int = 5):
    """Encode and decode one fixed random clip of ``frames`` x ``pixels`` x ``pixels``."""
    import torch

    g = torch.Generator().manual_seed(0)
    x = (torch.rand(1, 3, frames, pixels, pixels, generator=g) * 2 - 1).to(device, dtype)

    def run(module):
        p = next(module.parameters())
        with torch.no_grad():
            return module(x.to(p.device, p.dtype), sample_posterior=False).sample

    return run


def _dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _vae_decode(vae, device, dtype, *, tiled: bool = False, pixels: int = 32):
    """Decode a fixed random latent of 5 frames at ``pixels`` px (tiled: 32 px tiles, 16 px stride)."""
    import torch

    g = torch.Generator().manual_seed(0)
    spatial = 8 * (vae.config.patch_size or 1) if hasattr(vae.config, "patch_size") else 8
    z = torch.randn(1, vae.config.z_dim, 2, pixels // spatial, pixels // spatial, generator=g).to(device, dtype)
    if tiled:
        vae.enable_tiling(
            tile_sample_min_height=32,
            tile_sample_min_width=32,
            tile_sample_stride_height=16,
            tile_sample_stride_width=16,
        )

    def run(module):
        with torch.no_grad():
            return module.decode(z.to(next(module.parameters()).device, next(module.parameters()).dtype)).sample

    return run


def _vae_roundtrip(vae, device, dtype, *, tiled: bool = False, pixels: int = 32):
    """Encode and decode one fixed random image (a single frame) of ``pixels`` x ``pixels``."""
    import torch

    g = torch.Generator().manual_seed(0)
    x = (torch.rand(1, 3, 1, pixels, pixels, generator=g) * 2 - 1).to(device, dtype)

    def run(module):
        p = next(module.parameters())
        with torch.no_grad():
            return module(x.to(p.device, p.dtype), sample_posterior=False).sample

    return run


def _lm_logits(model, device, dtype, *, tiled: bool = False, **_: Any):
    """Teacher-forced logits: a prefill of 6 tokens, then 3 one-token decode steps with the KV cache."""
    import inspect

    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=g)
    key = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"

    def run(module):
        dev = next(module.parameters()).device
        x = ids.to(dev)
        outs = []
        with torch.no_grad():
            out = module(input_ids=x[:, :6], use_cache=True)
            outs.append(out.logits.float())
            for i in range(3):
                past = getattr(out, key, None) if getattr(out, key, None) is not None else out.past_key_values
                out = module(input_ids=x[:, 6 + i : 7 + i], use_cache=True, **{key: past})
                outs.append(out.logits.float())
        return torch.cat(outs, dim=1)

    return run


def _lm_sample(model, device, dtype, *, tiled: bool = False, **_: Any):
    """``generate(do_sample=True)`` of 8 tokens from a fixed seed: the generated ids."""
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (2, 5), generator=g)

    def run(module):
        dev = next(module.parameters()).device
        torch.manual_seed(0)
        with torch.no_grad():
            out = module.generate(
                ids.to(dev),
                attention_mask=torch.ones_like(ids, device=dev),
                max_new_tokens=8,
                do_sample=True,
                top_k=0,
                top_p=1.0,
                pad_token_id=0,
            )
        return out[:, ids.shape[1] :].float()

    return run


@dataclass(frozen=True)
class RecipeWorkload:
    """A tiny real-architecture workload for one recipe."""

    name: str
    build: Callable[[], Any]
    runner: Callable[..., Callable[[Any], Any]]  # runner(model, device, dtype, tiled=) -> run(module) -> output
    metric: str = "rel"  # "psnr" (images/video) or "rel" (logits); "ids" for sampled tokens
    tiled: bool = False
    shape: dict = field(default_factory=dict)
    kw: dict = field(default_factory=dict)  # extra arguments of the runner


WORKLOADS: dict[str, RecipeWorkload] = {
    "wan_vae_pad": RecipeWorkload(
        "wan22_vae_decode",
        _wan22_vae,
        _vae_decode,
        "psnr",
        shape={"latent": [1, 48, 2, 2, 2], "pixels": 32},
        kw={"pixels": 32},
    ),
    "mps_streams": RecipeWorkload(
        "wan22_vae_tiled_decode",
        _wan22_vae,
        _vae_decode,
        "psnr",
        tiled=True,
        shape={"latent": [1, 48, 2, 4, 4], "pixels": 64, "tile": 32, "stride": 16},
        kw={"pixels": 64},
    ),
    "qwen_image_vae": RecipeWorkload(
        "qwen_image_vae_roundtrip",
        _qwen_image_vae,
        _vae_roundtrip,
        "psnr",
        shape={"image": [1, 3, 1, 32, 32]},
        kw={"pixels": 32},
    ),
    "moe_experts": RecipeWorkload(
        "qwen3_moe_prefill_decode", _qwen3_moe, _lm_logits, shape={"batch": 2, "prompt": 6, "decode_steps": 3}
    ),
    "fp8_weights": RecipeWorkload(
        "qwen3_moe_prefill_decode", _qwen3_moe, _lm_logits, shape={"batch": 2, "prompt": 6, "decode_steps": 3}
    ),
    "decode_linear": RecipeWorkload(
        "qwen3_prefill_decode", _qwen3, _lm_logits, shape={"batch": 2, "prompt": 6, "decode_steps": 3}
    ),
    "metal_attention": RecipeWorkload(
        "llama_eager_prefill_decode", _llama_eager, _lm_logits, shape={"batch": 2, "prompt": 6, "decode_steps": 3}
    ),
    "softmax": RecipeWorkload(
        "qwen3_generate_sampled", _qwen3, _lm_sample, "ids", shape={"batch": 2, "prompt": 5, "new_tokens": 8}
    ),
    "video_vae_pad": RecipeWorkload(
        "hunyuan_video_vae_roundtrip",
        _hunyuan_video_vae,
        _video_roundtrip,
        "psnr",
        shape={"video": [1, 3, 5, 32, 32]},
        kw={"pixels": 32, "frames": 5},
    ),
    "attention_split": RecipeWorkload(
        "qwen3_prefill_decode", _qwen3, _lm_logits, shape={"batch": 2, "prompt": 6, "decode_steps": 3}
    ),
}


# ------------------------------------------------------------------------------------------ running


@dataclass
class RecipeResult:
    recipe: str
    status: str
    reason: str = ""
    workload: str | None = None
    backing: str = ""
    speed_ratio: float | None = None  # stock time / patched time (> 1: patched is faster)
    vs_stock: Any = None  # Correctness of patched against stock
    records: list = field(default_factory=list)  # bench Records written for it


def _measure(run: Callable[[Any], Any], module: Any, device: str, repeats: int):
    """Output and memory peaks of a first call (which also warms up), then the timed repeats."""
    from ..bench.harness import measure_job

    m = measure_job(lambda: run(module), device=device, repeats=repeats, warmup=0, output="first", memory="first")
    return m.output, m.timing, m.memory


def _compare(x, ref, metric: str, reference: str):
    from ..bench import correctness

    if metric == "psnr":
        return correctness(x, ref, reference=reference, data_range=2.0)
    return correctness(x, ref, reference=reference, psnr_too=False)


def check_recipe(
    name: str, recipe: Any, device: str, dtype_name: str, repeats: int, env: Any, record_env: Any
) -> RecipeResult:
    import torch

    import mpsboost

    from ..bench import Record
    from ..bench import Workload as BenchWorkload

    wl = WORKLOADS.get(name)
    if wl is None:
        return RecipeResult(name, "no workload", "the selftest has no workload for this recipe yet")
    dtype = _dtype(dtype_name)
    fp8 = "rowwise" if not recipe.lossless and name == "fp8_weights" else None
    torch.manual_seed(0)
    model = wl.build().eval()
    model.to(device)
    if dtype != torch.float32:
        model.to(dtype)
    bench_wl = BenchWorkload(
        f"{KIND}:{name}", dict(wl.shape, model=type(model).__name__, workload=wl.name, dtype=dtype_name)
    )
    plan = mpsboost.plan(model, env=env, recipes=[name], fp8=fp8)
    would = [r for r in plan.rows if r.status == "would apply"]
    if not would:
        why = "; ".join(sorted({r.reason for r in plan.rows})) or "no target in the workload"
        rec = Record(
            bench_wl, "mpsboost", record_env, extra={KIND: {"recipe": name, "status": "not applicable", "reason": why}}
        )
        return RecipeResult(name, "not applicable", why, wl.name, records=[rec])
    backing = ", ".join(sorted({r.backing for r in would if r.backing}))
    run = wl.runner(model, device, dtype, tiled=wl.tiled, **wl.kw)
    stock_out, stock_t, stock_m = _measure(run, model, device, repeats)
    if device == "cpu" and dtype == torch.float32:
        ref = stock_out.detach().float()  # the stock run is the CPU fp32 reference itself
    elif wl.metric == "ids":
        ref = None  # sampled tokens off the CPU: another generator stream, nothing to compare with
    else:
        # The CPU fp32 reference: a copy of the stock model, on the CPU in fp32, same inputs.
        ref_model = copy.deepcopy(model).to("cpu", torch.float32)
        ref = run(ref_model).detach().to("cpu", torch.float32)
        del ref_model
    with warnings.catch_warnings():
        # Parts of a target a recipe leaves alone (e.g. fp8 keeps lm_head) are in its report rows.
        warnings.simplefilter("ignore", UserWarning)
        report = mpsboost.patch(model, recipes=[name], fp8=fp8)
    try:
        patched_out, patched_t, patched_m = _measure(run, model, device, repeats)
    finally:
        if recipe.reversible:
            mpsboost.unpatch(model)
    stock_out, patched_out = (t.detach().to("cpu", torch.float32) for t in (stock_out, patched_out))
    vs_stock = _compare(patched_out, stock_out, wl.metric, "stock")
    tol = LOSSY if not recipe.lossless else fp32_tolerance(device, dtype_name, TOLERANCE[dtype_name])
    if wl.metric == "ids":
        # Sampled tokens: the same seed must draw the same tokens; the CPU reference draws from another
        # generator stream unless the device is the CPU.
        same = bool(torch.equal(patched_out, stock_out))
        stock_ref = _compare(stock_out, ref, "rel", "cpu-fp32") if device == "cpu" else None
        patched_ref = _compare(patched_out, ref, "rel", "cpu-fp32") if device == "cpu" else None
        ok = same and (device != "cpu" or torch.equal(patched_out, ref))
        why = (
            "same tokens as stock for the same seed"
            if same
            else "patched drew other tokens than stock for the same seed"
        )
    else:
        stock_ref = _compare(stock_out, ref, wl.metric, "cpu-fp32")
        patched_ref = _compare(patched_out, ref, wl.metric, "cpu-fp32")
        rel_s, rel_p = stock_ref.rel_error, patched_ref.rel_error
        close = vs_stock.rel_error is not None and vs_stock.rel_error <= tol
        no_worse = rel_p is not None and rel_s is not None and rel_p <= 1.5 * rel_s + tol
        ok = bool(close and no_worse)
        why = (
            f"patched vs stock rel {vs_stock.rel_error:.2e} (tolerance {tol:g}); "
            f"vs CPU fp32: stock {rel_s:.2e}, patched {rel_p:.2e}"
        )
    ratio = stock_t.median_s / patched_t.median_s if patched_t.median_s > 0 else None
    applied = [r for r in report.rows if r.status == "applied"]
    info = {
        "recipe": name,
        "status": "pass" if ok else "fail",
        "reason": why,
        "speed_ratio": ratio,
        "tolerance": tol,
        "backing": backing,
        "rows_applied": len(applied),
        "lossless": bool(recipe.lossless),
        "metric": wl.metric,
    }
    recs = [
        Record(
            bench_wl,
            "stock",
            record_env,
            throughput=stock_t.throughput(),
            correctness=stock_ref,
            memory=stock_m,
            extra={KIND: dict(info)},
        ),
        Record(
            bench_wl,
            "mpsboost",
            record_env,
            throughput=patched_t.throughput(),
            correctness=patched_ref,
            memory=patched_m,
            extra={KIND: dict(info, vs_stock=vs_stock.to_dict())},
        ),
    ]
    return RecipeResult(name, info["status"], why, wl.name, backing, ratio, vs_stock, recs)


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= k:
            return f"{n / k:.1f} {unit}"
    return f"{n} B"


def _mem(res: RecipeResult, field_name: str) -> str:
    by = {r.variant: r for r in res.records}
    s, p = by.get("stock"), by.get("mpsboost")
    if s is None or p is None or s.memory is None or p.memory is None:
        return "-"
    return f"{_fmt_bytes(getattr(s.memory, field_name))} -> {_fmt_bytes(getattr(p.memory, field_name))}"


def format_table(results: Sequence[RecipeResult]) -> str:
    """One row per recipe: status, speed ratio, errors, the three memory peaks (stock -> patched)."""
    head = [
        "recipe",
        "status",
        "speed",
        "vs stock",
        "vs cpu-fp32 (stock/patched)",
        "tensor peak",
        "reserved peak",
        "driver peak",
    ]
    rows = []
    for res in results:
        by = {r.variant: r for r in res.records}
        s, p = by.get("stock"), by.get("mpsboost")
        ref = "-"
        if s is not None and p is not None and s.correctness is not None and p.correctness is not None:
            ref = f"{s.correctness.rel_error:.1e} / {p.correctness.rel_error:.1e}"
        rows.append(
            [
                res.recipe,
                res.status,
                f"{res.speed_ratio:.2f}x" if res.speed_ratio else "-",
                f"{res.vs_stock.rel_error:.1e}"
                if res.vs_stock is not None and res.vs_stock.rel_error is not None
                else "-",
                ref,
                _mem(res, "tensor_allocated"),
                _mem(res, "allocator_reserved"),
                _mem(res, "driver_level"),
            ]
        )
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    notes = [f"  {res.recipe}: {res.reason}" for res in results if res.reason]
    return "\n".join(lines + ([""] + notes if notes else []))
