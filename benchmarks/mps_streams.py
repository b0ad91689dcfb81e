"""Benchmark of ``mps_streams``: tiled VAE decodes with blending on a side stream.

Variants on the same model and inputs: ``stock``; ``mps_streams`` alone (the stock convolutions in
the side-stream tile loop; its output must equal stock bit for bit); ``wan_vae_pad`` /
``qwen_image_vae`` alone (same loop, no side stream); both (``mps_streams`` is opt-in on CUDA; this
benchmark opts in). Workloads: the Wan2.2 VAE tiled decode at 480x832 with 21 frames (15 tiles) and the
Qwen-Image VAE tiled decode of a 1024x1024 latent (36 tiles), fp32.

On MPS the recipe needs a 2.16 nightly with user streams (pytorch#191415); on CPU it is skipped and
this benchmark records that.

    python benchmarks/mps_streams.py --device cuda --size real --out benchmarks/results
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from qwen_image_vae import build_qwen  # noqa: E402
from _common import budget_left, free, guarded, log, measure_workload  # noqa: E402
from wan_vae import build_wan22  # noqa: E402

from mpsboost.bench import Record, Workload  # noqa: E402
from mpsboost.bench.harness import MIN_REPEATS  # noqa: E402


def run(device: str, size: str, out: Path) -> list[Record]:
    records: list[Record] = []
    repeats = MIN_REPEATS
    gen = torch.Generator(device="cpu").manual_seed(3)
    cases = []
    if size == "real":
        cases = [
            ("wan", (1, 48, 6, 30, 52), "480x832x21", dict()),
            ("qwen", (1, 16, 1, 128, 128), "1024x1024 latent", dict()),
        ]
    else:
        small = size == "small"
        cases = [
            (
                "wan",
                (1, 16, 3, 8, 10) if small else (1, 16, 2, 4, 6),
                "tiny",
                dict(
                    tile_sample_min_height=64,
                    tile_sample_min_width=64,
                    tile_sample_stride_height=32,
                    tile_sample_stride_width=48,
                ),
            ),
            (
                "qwen",
                (1, 16, 1, 16, 16) if small else (1, 4, 1, 8, 10),
                "tiny",
                dict(
                    tile_sample_min_height=32,
                    tile_sample_min_width=32,
                    tile_sample_stride_height=24,
                    tile_sample_stride_width=24,
                ),
            ),
        ]
    for family, latent, label, tiles in cases:
        if budget_left() < 30:
            log(f"budget: skipping {family}")
            continue
        vae = build_wan22(size, device) if family == "wan" else build_qwen(size, device)
        vae.enable_tiling(**tiles)
        fam_recipe = "wan_vae_pad" if family == "wan" else "qwen_image_vae"
        z = torch.randn(latent, generator=gen).to(device)
        wl = Workload(f"{family}_vae_tiled_decode", {"latent": list(latent), "label": label, "tiled": True})
        on = {"mps_streams": {"on_cuda": True}}  # opt-in on CUDA: measuring it is the point here
        variants = [
            ("stock", None, None),
            ("mps_streams", ["mps_streams"], on),
            (fam_recipe, [fam_recipe], None),
            (f"{fam_recipe}+mps_streams", [fam_recipe, "mps_streams"], on),
        ]
        with guarded(f"{family}"):
            recs, stock_out = measure_workload(
                workload=wl,
                variants=variants,
                model=vae,
                device=device,
                dtype=torch.float32,
                fn=lambda: vae.decode(z).sample,
                repeats=repeats,
            )
            for rec in recs:
                if rec.variant != "stock":
                    log(f"{rec.variant}: identical to stock: {rec.extra.get('identical_to_stock')}")
                records.append(rec)
        free(device)
        vae = z = stock_out = None  # noqa: F841
        free(device)
    return records


if __name__ == "__main__":
    from mpsboost.bench.cli import script_main

    raise SystemExit(script_main(__file__, run))


def smoke(device: str) -> dict:
    """Tiny real models on ``device``: each recipe (and the channels-last options) against stock.

    Returns {case: max abs difference, or the error text}; a device run calls this first so that a
    broken path shows up in seconds, not after the long workloads.
    """
    import mpsboost

    results: dict = {}
    torch.manual_seed(0)
    cases = [
        ("wan", build_wan22("tiny", device), (1, 16, 3, 4, 6), "wan_vae_pad"),
        ("qwen", build_qwen("tiny", device), (1, 4, 1, 6, 6), "qwen_image_vae"),
    ]
    for family, vae, latent, recipe in cases:
        vae.enable_tiling(
            tile_sample_min_height=64,
            tile_sample_min_width=64,
            tile_sample_stride_height=32,
            tile_sample_stride_width=48,
        )
        z = torch.randn(latent, device=device)
        with torch.no_grad():
            ref = vae.decode(z).sample
            for name, recipes, options in (
                ("streams", ["mps_streams"], {"mps_streams": {"on_cuda": True}}),
                ("pad", [recipe], None),
                ("pad+streams", [recipe, "mps_streams"], {"mps_streams": {"on_cuda": True}}),
                ("pad:contiguous", [recipe], {recipe: {"layout": "contiguous", "fused_norm": False}}),
            ):
                key = f"{family}:{name}"
                try:
                    with mpsboost.patched(vae, recipes=recipes, options=options):
                        out = vae.decode(z).sample
                    results[key] = float((out - ref).abs().max())
                except Exception as exc:  # noqa: BLE001 - reported to the caller
                    results[key] = f"{type(exc).__name__}: {exc}"
    return results
