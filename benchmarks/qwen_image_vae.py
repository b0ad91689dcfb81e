"""Benchmark of ``qwen_image_vae``: Qwen-Image 1.0 and 2.1 VAE encode+decode roundtrips, stock vs mpsboost.

Workloads (size "real": each VAE's config, i.e. the class defaults of diffusers 0.42.1, random weights):

* Qwen-Image 1.0 (``AutoencoderKLQwenImage``): ``qwen_image_vae_roundtrip`` of one image at 1024x1024
  and 1328x1328, untiled (as the Qwen-Image pipelines run it), and 1024x1024 tiled (36 tiles of 256 px);
  ``qwen_image_vae_roundtrip_ref``: a 128x128 roundtrip against a CPU fp32 reference;
* Qwen-Image-2.1 (``AutoencoderKLQwenImage21``: RGBA, 338M parameters, 2-D frame convolutions that
  pad 4-D, AvgDown3D blocks that pad 5-D): ``qwen_image21_vae_roundtrip`` at 1024x1024 untiled and
  tiled; ``qwen_image21_vae_roundtrip_ref`` at 128x128 against a CPU fp32 reference.

fp32 and bf16, variants stock and mpsboost (and, on CUDA, mpsboost without the channels-last
layout), one run. Records: time (median of alternating rounds), aten-level pad count (``extra.pad5d_aten``:
5-D pads in ``total``, every rank in ``all_ranks`` / ``by_rank``), correctness (mpsboost vs stock of
the same run: PSNR and relative error; the reduced roundtrip vs CPU fp32), memory peaks (allocated,
reserved, driver) of a separate pass. ``--models`` picks the VAEs (default both).

    python benchmarks/qwen_image_vae.py --device cuda --size real --out benchmarks/results
    python benchmarks/qwen_image_vae.py --device cuda --size real --out benchmarks/results --models qwen_image21
    python benchmarks/qwen_image_vae.py --device cpu --size tiny --out /tmp/qvae --models qwen_image21
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    DTYPES,
    _ref_with_label,
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
)

from mpsboost.bench.harness import MIN_REPEATS  # noqa: E402

from mpsboost.bench import Record, RecordEnv, Workload  # noqa: E402
from mpsboost.bench.models import build  # noqa: E402

#: model -> (diffusers class, workload name, seed of its inputs); the configs by size are rows
#: "<model>_vae:real", ":bench_small", ":bench_tiny" of mpsboost.bench.models
MODELS = {
    "qwen_image": ("AutoencoderKLQwenImage", "qwen_image_vae_roundtrip", 2),
    "qwen_image21": ("AutoencoderKLQwenImage21", "qwen_image21_vae_roundtrip", 3),
}


def build_qwen(size: str, device: str, model: str = "qwen_image") -> torch.nn.Module:
    torch.manual_seed(0)
    vae = build(f"{model}_vae:{'real' if size == 'real' else 'bench_' + size}", device=device)
    return vae.eval().requires_grad_(False)


def _channels(vae: torch.nn.Module) -> int:
    return int(getattr(vae.config, "in_channels", 3))  # RGBA for Qwen-Image-2.1; 1.0 has 3 (input_channels)


def roundtrip(vae: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    z = vae.encode(x).latent_dist.mode()
    return vae.decode(z).sample


def _workloads(size: str, model: str = "qwen_image") -> list[dict]:
    if size == "real":
        if model == "qwen_image21":
            return [
                {"label": "1024x1024", "hw": (1024, 1024), "tiled": False},
                {"label": "1024x1024 tiled", "hw": (1024, 1024), "tiled": True},
            ]
        return [
            {"label": "1024x1024", "hw": (1024, 1024), "tiled": False},
            {"label": "1328x1328", "hw": (1328, 1328), "tiled": False},
            {"label": "1024x1024 tiled", "hw": (1024, 1024), "tiled": True},
        ]
    if size == "small":
        return [
            {"label": "256x256", "hw": (256, 256), "tiled": False},
            {"label": "256x256 tiled", "hw": (256, 256), "tiled": True},
        ]
    return [{"label": "32x32", "hw": (32, 32), "tiled": False}, {"label": "16x24 tiled", "hw": (16, 24), "tiled": True}]


def _tiling(vae: torch.nn.Module, size: str, on: bool) -> None:
    vae.use_tiling = False
    if on:
        if size == "real":
            vae.enable_tiling()
        elif size == "small":
            vae.enable_tiling(
                tile_sample_min_height=32,
                tile_sample_min_width=32,
                tile_sample_stride_height=24,
                tile_sample_stride_width=24,
            )
        else:
            # a 2x2 grid of tiles on the 16x24 image (Qwen-Image-2.1, spatial factor 8: 2x3 tiles, each a whole
            # latent pixel)
            stride_w = 8 if getattr(vae.config, "scale_factor_spatial", None) == 8 else 12
            vae.enable_tiling(
                tile_sample_min_height=16,
                tile_sample_min_width=16,
                tile_sample_stride_height=8,
                tile_sample_stride_width=stride_w,
            )


def _variants(device: str) -> list[tuple[str, list[str] | None, dict | None]]:
    v: list[tuple[str, list[str] | None, dict | None]] = [("stock", None, None), ("mpsboost", ["qwen_image_vae"], None)]
    if device.startswith("cuda"):
        v.append(
            (
                "mpsboost:contiguous",
                ["qwen_image_vae"],
                {"qwen_image_vae": {"layout": "contiguous", "fused_norm": False}},
            )
        )
    return v


def run(device: str, size: str, out: Path, models: tuple[str, ...] = tuple(MODELS)) -> list[Record]:
    records: list[Record] = []
    for model in models:
        if model not in MODELS:
            raise ValueError(f"unknown model {model!r}; pass one or more of {', '.join(MODELS)}")
        records += _run_model(device, size, out, model)
    return records


def _run_model(device: str, size: str, out: Path, model: str) -> list[Record]:
    records: list[Record] = []
    vae = build_qwen(size, device, model)
    _, wname, seed = MODELS[model]
    repeats = MIN_REPEATS
    gen = torch.Generator(device="cpu").manual_seed(seed)
    work = _workloads(size, model)
    chans = _channels(vae)
    images = {w["label"]: torch.rand((1, chans, 1, *w["hw"]), generator=gen) * 2 - 1 for w in work}
    ref_hw = (128, 128) if size != "tiny" else (16, 16)
    ref_img = torch.rand((1, chans, 1, *ref_hw), generator=gen) * 2 - 1
    log(f"{model}: {type(vae).__name__}, {sum(p.numel() for p in vae.parameters()) / 1e6:.1f}M parameters")

    log("CPU fp32 reference (reduced roundtrip)")
    cpu_vae = cpu_fp32_copy(vae)
    with torch.no_grad():
        cpu_ref = roundtrip(cpu_vae, ref_img)
    del cpu_vae
    free(device)

    for dname, dtype in DTYPES.items():
        vae.to(dtype)
        ref_in = ref_img.to(device, dtype)
        wl = Workload(
            f"{wname}_ref", {"image": list(ref_img.shape), "dtype": dname, "tiled": False, "reference": "cpu-fp32"}
        )
        ref_records, ref_corr = reference_pass(
            vae,
            _variants(device),
            roundtrip,
            ref_in,
            cpu_ref,
            workload=wl,
            device=device,
            dtype=dtype,
            repeats=repeats,
            untile=lambda v: _tiling(v, size, False),
            label=f"reduced roundtrip {dname}",
        )
        records += ref_records
        for w in work:
            if budget_left() < 30:
                log(f"budget: skipping {w['label']} {dname}")
                continue
            x = images[w["label"]].to(device, dtype)
            wl = Workload(
                wname, {"image": w["label"], "shape": [1, chans, 1, *w["hw"]], "dtype": dname, "tiled": w["tiled"]}
            )
            variants = [v for v in _variants(device) if v[0] != "mpsboost:contiguous" or w["label"] == "1024x1024"]

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
                    fn=lambda: roundtrip(vae, x),
                    setup=lambda: _tiling(vae, size, w["tiled"]),
                    repeats=repeats,
                    extra=cref,
                )
                for rec in recs:
                    if rec.variant == "stock":
                        rec = rec.replace(
                            correctness=_ref_with_label(
                                ref_corr.get("stock"),
                                f"cpu-fp32, reduced roundtrip {ref_hw[0]}x{ref_hw[1]} ({wname}_ref)",
                            )
                        )
                    records.append(rec)
            free(device)
            del stock_out, x
            free(device)
        _tiling(vae, size, False)
    if device.startswith("cuda") and size == "real" and budget_left() > 45:
        vae.to(torch.float32)
        x = images[work[0]["label"]].to(device)
        for variant, recipes, options in _variants(device)[:2]:
            with guarded(f"profile {variant}"):
                ctx = patched(vae, recipes, options) if recipes else contextlib.nullcontext(None)
                with ctx:
                    with torch.no_grad():
                        roundtrip(vae, x)
                    ops = top_ops(lambda: roundtrip(vae, x), device)
                rec = Record(
                    workload=Workload(f"{wname}_profile", {"image": work[0]["label"], "dtype": "fp32", "tiled": False}),
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
    import argparse
    import functools

    from mpsboost.bench.cli import script_main

    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of: {', '.join(MODELS)}")
    known, rest = extra.parse_known_args()
    chosen = tuple(m for m in known.models.split(",") if m)
    bad = [m for m in chosen if m not in MODELS]
    if bad:
        raise SystemExit(f"qwen_image_vae.py: unknown --models {', '.join(bad)}; accepted: {', '.join(MODELS)}")
    raise SystemExit(script_main(__file__, functools.partial(run, models=chosen), argv=rest))
