"""Benchmark of ``wan_vae_pad``: the Wan2.2 VAE decode, stock vs mpsboost, fp32 and bf16.

Workloads (size "real": the Wan2.2-TI2V-5B VAE config, row ``wan22_vae:real`` of ``mpsboost.bench.models``, random
weights):

* ``wan22_vae_decode`` 480x832, 81 frames (latent 21x30x52), tiled (15 tiles of 256 px, stride 192)
  and untiled;
* ``wan22_vae_decode`` 704x1280 tiled (28 tiles), 21 frames (latent 6x44x80): fewer frames than a
  full clip so that the run fits the device time it is given (the tile count is the real one);
* ``wan22_vae_decode_ref``: a reduced decode (latent 2x4x4) against a CPU fp32 reference.

Every record keeps the four kinds apart: time (the variants of one workload timed in alternating
rounds, each patched by ``mpsboost.patched`` around its own samples; median, min and max kept), the
count of aten-level pads of 5-D tensors in one decode (:func:`mpsboost.bench.harness.count_pad5d`),
correctness (mpsboost vs stock of the same run; stock vs the CPU fp32 reference of the
reduced decode), and the memory peaks of a separate pass. Sizes "tiny" and "small" run the same
code on small configs (tiny finishes in seconds on a CPU).

    python benchmarks/wan_vae.py --device cuda --size real --out benchmarks/results
    mpsboost bench wan_vae --device cuda --size real

The helpers it shares with ``qwen_image_vae.py`` and ``mps_streams.py`` are in ``_common.py``.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common.py, when imported by path

from _common import (  # noqa: E402
    DTYPES,
    budget_left,
    cpu_fp32_copy,
    free,
    guarded,
    log,
    measure_workload,
    patched,
    reference_pass,
    stream_record,
    top_ops,
    _ref_with_label,
)

from mpsboost.bench import Record, RecordEnv, Workload  # noqa: E402
from mpsboost.bench.harness import MIN_REPEATS  # noqa: E402
from mpsboost.bench.models import build  # noqa: E402

# ------------------------------------------------------------------------------------------ Wan2.2


def build_wan22(size: str, device: str) -> torch.nn.Module:
    """The Wan2.2 VAE at ``size``: rows wan22_vae:real, :bench_small, :bench_tiny of mpsboost.bench.models."""
    name = {"real": "wan22_vae:real", "small": "wan22_vae:bench_small", "tiny": "wan22_vae:bench_tiny"}[size]
    torch.manual_seed(0)
    # Random init directly on the device: 705M parameters initialise in well under a second there.
    vae = build(name, device=device)
    return vae.eval().requires_grad_(False)


def wan_workloads(size: str) -> list[dict]:
    """(name, latent shape, tiled, note) of each decode workload at ``size``."""
    if size == "real":
        return [
            {"label": "480x832x81 tiled", "latent": (1, 48, 21, 30, 52), "tiled": True, "frames": 81},
            {"label": "480x832x81 untiled", "latent": (1, 48, 21, 30, 52), "tiled": False, "frames": 81},
            {
                "label": "704x1280x21 tiled",
                "latent": (1, 48, 6, 44, 80),
                "tiled": True,
                "frames": 21,
                "note": "21 of 81 frames to fit the device time; 28 tiles as at full length",
            },
        ]
    if size == "small":
        return [
            {"label": "128x160x9 tiled", "latent": (1, 16, 3, 8, 10), "tiled": True, "frames": 9},
            {"label": "128x160x9 untiled", "latent": (1, 16, 3, 8, 10), "tiled": False, "frames": 9},
        ]
    return [
        {"label": "64x96x5 tiled", "latent": (1, 16, 2, 4, 6), "tiled": True, "frames": 5},
        {"label": "64x96x5 untiled", "latent": (1, 16, 2, 4, 6), "tiled": False, "frames": 5},
    ]


def tiling(vae: torch.nn.Module, size: str, on: bool) -> None:
    vae.use_tiling = False
    if on:
        if size == "real":
            vae.enable_tiling()  # diffusers' defaults: 256 px tiles, stride 192
        else:
            vae.enable_tiling(
                tile_sample_min_height=64,
                tile_sample_min_width=64,
                tile_sample_stride_height=32,
                tile_sample_stride_width=48,
            )


def _variants(device: str) -> list[tuple[str, list[str] | None, dict | None]]:
    v: list[tuple[str, list[str] | None, dict | None]] = [("stock", None, None), ("mpsboost", ["wan_vae_pad"], None)]
    if device.startswith("cuda"):
        # What the channels-last layout and the fused norm add on top of the fold and the tile loop.
        v.append(
            ("mpsboost:contiguous", ["wan_vae_pad"], {"wan_vae_pad": {"layout": "contiguous", "fused_norm": False}})
        )
    return v


def run(device: str, size: str, out: Path) -> list[Record]:
    records: list[Record] = []
    vae = build_wan22(size, device)
    repeats = MIN_REPEATS
    gen = torch.Generator(device="cpu").manual_seed(1)
    work = wan_workloads(size)
    latents = {w["label"]: torch.randn(w["latent"], generator=gen) for w in work}
    ref_shape = (1, vae.config.z_dim, 2, 4, 4) if size != "tiny" else (1, vae.config.z_dim, 2, 2, 2)
    ref_latent = torch.randn(ref_shape, generator=gen)
    ref_label = "x".join(str(d) for d in ref_shape[2:])

    # CPU fp32 reference of a reduced decode (stock model), taken before anything is patched.
    log("CPU fp32 reference (reduced decode)")
    cpu_vae = cpu_fp32_copy(vae)
    with torch.no_grad():
        cpu_ref = cpu_vae.decode(ref_latent).sample
    del cpu_vae
    free(device)

    for dname, dtype in DTYPES.items():
        vae.to(dtype)
        ref_in = ref_latent.to(device, dtype)
        wl = Workload(
            "wan22_vae_decode_ref", {"latent": list(ref_shape), "dtype": dname, "tiled": False, "reference": "cpu-fp32"}
        )
        ref_records, ref_corr = reference_pass(
            vae,
            _variants(device),
            lambda v, x: v.decode(x).sample,
            ref_in,
            cpu_ref,
            workload=wl,
            device=device,
            dtype=dtype,
            repeats=repeats,
            untile=lambda v: tiling(v, size, False),
            label=f"reduced decode {dname}",
        )
        records += ref_records
        for w in work:
            if budget_left() < 60:
                log(f"budget: skipping {w['label']} {dname}")
                continue
            z = latents[w["label"]].to(device, dtype)
            shape = {
                "video": w["label"],
                "latent": list(w["latent"]),
                "dtype": dname,
                "tiled": w["tiled"],
                "frames": w["frames"],
            }
            if "note" in w:
                shape["note"] = w["note"]
            wl = Workload("wan22_vae_decode", shape)
            variants = [
                v for v in _variants(device) if v[0] != "mpsboost:contiguous" or (w["tiled"] and w["frames"] == 81)
            ]

            def cref(name, report, ref_corr=ref_corr):
                c = ref_corr.get(name)
                return {} if name == "stock" else {"cpu_ref_reduced": c.to_dict() if c else None}

            stock_out = None
            with guarded(f"{w['label']} {dname}"):
                recs, stock_out = measure_workload(
                    workload=wl,
                    variants=variants,
                    model=vae,
                    device=device,
                    dtype=dtype,
                    fn=lambda: vae.decode(z).sample,
                    setup=lambda: tiling(vae, size, w["tiled"]),
                    repeats=repeats,
                    extra=cref,
                )
                for rec in recs:
                    if rec.variant == "stock":
                        # The stock record's correctness: the reduced decode against CPU fp32.
                        rec = rec.replace(
                            correctness=_ref_with_label(
                                ref_corr.get("stock"),
                                f"cpu-fp32, reduced decode of latent {ref_label} (wan22_vae_decode_ref)",
                            )
                        )
                    records.append(rec)
            free(device)
            del stock_out, z
            free(device)
        tiling(vae, size, False)
    if device.startswith("cuda") and size == "real" and budget_left() > 40:
        # Where the time goes: one profile of a 2-frame tiled decode per variant.
        vae.to(torch.float32)
        z = latents[work[0]["label"]][:, :, :2].to(device)
        tiling(vae, size, True)
        for variant, recipes, options in _variants(device)[:2]:
            with guarded(f"profile {variant}"):
                ctx = patched(vae, recipes, options) if recipes else contextlib.nullcontext(None)
                with ctx:
                    with torch.no_grad():
                        vae.decode(z)
                    ops = top_ops(lambda: vae.decode(z), device)
                rec = Record(
                    workload=Workload(
                        "wan22_vae_decode_profile", {"latent": list(z.shape), "dtype": "fp32", "tiled": True}
                    ),
                    variant=variant,
                    env=RecordEnv.capture(device, torch.float32),
                    extra={"top_device_ops": ops},
                )
                stream_record(rec)
                records.append(rec)
                log(
                    f"profile {variant}: "
                    + "; ".join(f"{o['op']} {o['self_us'] / 1e3:.1f} ms x{o['calls']}" for o in ops[:8])
                )
    vae = None  # noqa: F841 - release the model before the next benchmark
    free(device)
    return records


if __name__ == "__main__":
    from mpsboost.bench.cli import script_main

    raise SystemExit(script_main(__file__, run))
