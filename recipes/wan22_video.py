#!/usr/bin/env python3
"""Wan2.2 video generation (TI2V-5B; T2V-A14B with --model) with mpsboost: stock vs patched.

With weights (network or a local copy):

    python recipes/wan22_video.py --model Wan-AI/Wan2.2-TI2V-5B-Diffusers --device mps --dtype bfloat16 \\
        --prompt "a cat surfing a wave at sunset" --height 704 --width 1280 --frames 121

Offline, real architecture with random weights (the wan22_ti2v configs shipped with mpsboost):

    python recipes/wan22_video.py --random-weights tiny            # seconds on a CPU (what CI runs)
    python recipes/wan22_video.py --random-weights real --device mps --frames 21 --steps 2

The job is the whole pipeline call (denoising steps and the VAE decode). The VAE decode of one latent
video is also timed alone: it is what the VAE recipes (wan_vae_pad, mps_streams) change. Random
weights have no text encoder: the prompt embeddings are random tensors of the transformer's text width.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: --help answers before torch loads
    import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

NAME = "wan22_video"


def build(args, device: str, dtype: torch.dtype):
    """The pipeline and its run settings (tiny/real run.json, overridden by the command line)."""
    import torch
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel

    size = args.random_weights or "real"
    run = C.config("wan22_ti2v", size, "run.json")
    for key in ("height", "width", "frames", "steps"):
        if getattr(args, key) is not None:
            run[key] = getattr(args, key)
    if args.model is not None:
        # The VAE in fp32 (the diffusers recommendation for Wan), the rest in the compute dtype.
        vae = AutoencoderKLWan.from_pretrained(args.model, subfolder="vae", dtype=torch.float32)
        pipe = WanPipeline.from_pretrained(args.model, vae=vae, dtype=dtype)
        pipe.to(device)
    else:
        C.seeded(args.seed)
        with C.default_dtype(dtype), torch.device(device):
            transformer = WanTransformer3DModel.from_config(C.config("wan22_ti2v", size, "transformer.json"))
            vae = AutoencoderKLWan.from_config(C.config("wan22_ti2v", size, "vae.json"))
        sched = UniPCMultistepScheduler(
            prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=run["flow_shift"]
        )
        pipe = WanPipeline(
            tokenizer=None,
            text_encoder=None,
            vae=vae,
            scheduler=sched,
            transformer=transformer,
            transformer_2=None,
            boundary_ratio=None,
            expand_timesteps=True,
        )
        pipe.to(device=device, dtype=dtype)
    if run.get("vae_tiling") or args.tiling:
        pipe.vae.enable_tiling()
    pipe.set_progress_bar_config(disable=True)
    return pipe, run


def prompt_kwargs(args, pipe, run: dict, device: str, dtype: torch.dtype) -> dict:
    import torch

    if pipe.text_encoder is not None and pipe.tokenizer is not None:
        return {
            "prompt": args.prompt,
            "negative_prompt": args.negative_prompt,
            "max_sequence_length": run["text_tokens"],
        }
    g = torch.Generator().manual_seed(args.seed + 1)
    dim = pipe.transformer.config.text_dim
    emb = torch.randn(1, run["text_tokens"], dim, generator=g).to(device, dtype)
    neg = torch.randn(1, run["text_tokens"], dim, generator=g).to(device, dtype)
    return {"prompt_embeds": emb, "negative_prompt_embeds": neg}


def main(argv=None) -> int:
    p = C.parser(__doc__.splitlines()[0], default_model="Wan-AI/Wan2.2-TI2V-5B-Diffusers", benchmarks=("wan_vae_pad",))
    p.add_argument("--prompt", default="A cat surfing a wave at sunset, cinematic")
    p.add_argument("--negative-prompt", default="blurry, low quality")
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--frames", type=int, default=None, help="number of video frames (4k+1)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps")
    p.add_argument("--tiling", action="store_true", help="tiled VAE decode (pipe.vae.enable_tiling())")
    args = p.parse_args(argv)
    import torch

    device, dtype = C.resolve(args)
    import mpsboost

    with C.timed("build"):
        pipe, run = build(args, device, dtype)
    kw = prompt_kwargs(args, pipe, run, device, dtype)
    call = dict(
        height=run["height"],
        width=run["width"],
        num_frames=run["frames"],
        num_inference_steps=run["steps"],
        guidance_scale=run["guidance_scale"],
        output_type="pt",
    )

    def job() -> torch.Tensor:
        out = pipe(**kw, **call, generator=torch.Generator(device="cpu").manual_seed(args.seed))
        return torch.as_tensor(out.frames)

    # One latent video of the job's shape for the VAE decode op.
    vae = pipe.vae
    spatial = vae.config.scale_factor_spatial
    lat_frames = (run["frames"] - 1) // vae.config.scale_factor_temporal + 1
    z = torch.randn(
        1,
        vae.config.z_dim,
        lat_frames,
        run["height"] // spatial,
        run["width"] // spatial,
        generator=torch.Generator().manual_seed(args.seed + 2),
    ).to(device, vae.dtype)
    ops = {"vae.decode": lambda: vae.decode(z).sample}
    common = dict(
        device=device, repeats=args.repeats, warmup=args.warmup, items_per_call=run["frames"], unit="frames/s", ops=ops
    )

    C.print_plans(pipe, args.plan, args.fp8)
    stock = C.measure("stock", job, **common)
    report = mpsboost.patch(pipe, fp8=args.fp8)
    patched = C.measure("mpsboost", job, **common)
    shape = {
        "height": run["height"],
        "width": run["width"],
        "frames": run["frames"],
        "steps": run["steps"],
        "weights": args.model or f"random ({args.random_weights})",
        "vae_tiling": bool(vae.use_tiling),
    }
    recs = C.records(
        NAME,
        shape,
        device,
        dtype,
        stock,
        patched,
        data_range=1.0,
        extra={"applied": len(report.applied), "skipped": len(report.skipped)},
    )
    return C.finish(NAME, args, report, recs)


if __name__ == "__main__":
    sys.exit(main())
