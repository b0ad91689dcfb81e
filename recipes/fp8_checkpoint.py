#!/usr/bin/env python3
"""Load a published fp8 checkpoint on a Mac (or anywhere) with mpsboost: one call, no bf16 copy in memory.

A published checkpoint (network or a local copy; the model is built from its own config.json on
the meta device, then every tensor is read from the files straight into its final storage):

    python recipes/fp8_checkpoint.py --model Qwen/Qwen3-8B-FP8 --device mps          # transformers' fine-grained FP8
    python recipes/fp8_checkpoint.py --model RedHatAI/Qwen3-8B-FP8-dynamic --device mps  # compressed-tensors
    python recipes/fp8_checkpoint.py --model ./wan2.1_t2v_14B_fp8_scaled.safetensors \\
        --diffusers-config Wan-AI/Wan2.1-T2V-14B-Diffusers --device mps           # a scaled_fp8 single file

Offline, with a file this script writes in each format from a real architecture with random weights:

    python recipes/fp8_checkpoint.py --random-weights tiny --write-format transformers        # what CI runs
    python recipes/fp8_checkpoint.py --random-weights tiny --write-format compressed-tensors
    python recipes/fp8_checkpoint.py --random-weights tiny --write-format scaled_fp8

What the offline mode does: writes the checkpoint (layouts below), prints what
``mpsboost.quant.fp8_plan.describe_checkpoint`` says about it for this machine, builds the model on
the meta device, ``mpsboost.load_fp8(model, path)``, and compares its forward against the stock
model holding the file's exact dequantisation (codes x scales in float32, rounded once): four
records (throughput, operator time, correctness, memory) of stock vs mpsboost.

Layouts written by :mod:`mpsboost.bench.published` (each format's documented one):
* ``transformers``: ``config.json`` ``quantization_config = {"quant_method": "fp8", "weight_block_size":
  [bn, bk]}``; ``<layer>.weight`` F8_E4M3 and ``<layer>.weight_scale_inv`` F32 per block; MoE experts as
  one Linear per expert (``mlp.experts.<e>.gate_proj.weight`` ...), as the Qwen3 FP8 releases store them.
* ``compressed-tensors``: ``quant_method = "compressed-tensors"``, ``format = "float-quantized"``, channel
  strategy: ``<layer>.weight`` F8_E4M3 and ``<layer>.weight_scale`` ``[N, 1]``.
* ``scaled_fp8``: one file, ``scaled_fp8`` marker, ``model.diffusion_model.<original Wan name>.weight``
  F8_E4M3 with ``.scale_weight`` (one float32); diffusers' single-file conversion maps the names.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: --help answers before torch loads
    import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

NAME = "fp8_checkpoint"
# mpsboost.bench.published.FORMATS, named here so that --help answers before torch loads (a test checks they agree).
FORMATS = ("transformers", "compressed-tensors", "scaled_fp8")

# ------------------------------------------------------------------------------------------ models


def _tiny_lm(dtype: torch.dtype, seed: int, meta: bool = False):
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    cfg = C.config("qwen3_moe", "tiny", "config.json")
    cfg.pop("model_type", None)
    theta = cfg.pop("rope_theta", None)
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    C.seeded(seed)
    with torch.device("meta" if meta else "cpu"):
        return AutoModelForCausalLM.from_config(Qwen3MoeConfig(**cfg), dtype=dtype).eval()


def _tiny_wan(dtype: torch.dtype, seed: int, meta: bool = False):
    import torch
    import diffusers

    cfg = C.config("wan22_ti2v", "tiny", "transformer.json")
    C.seeded(seed)
    with torch.device("meta" if meta else "cpu"):
        return diffusers.WanTransformer3DModel.from_config(cfg).to(dtype).eval()


def _inputs(model, device, dtype, seed):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from fp8_any import make_inputs

    return make_inputs(model, device, dtype, seed)


def _published_model(args, device: str):
    """--model: build the class from the checkpoint's own config on the meta device; return (model, files path)."""
    import mpsboost  # noqa: F401

    src = Path(args.model)
    if not src.exists():
        from huggingface_hub import snapshot_download

        src = Path(snapshot_download(args.model, allow_patterns=["*.json", "*.safetensors"]))
    from accelerate import init_empty_weights

    if src.is_file():  # a single-file diffusion checkpoint: the class and config come from a diffusers repo
        if not args.diffusers_config:
            raise SystemExit(
                "--model is a single file: name the diffusers model it belongs to with --diffusers-config "
                "(e.g. Wan-AI/Wan2.1-T2V-14B-Diffusers)"
            )
        import diffusers

        cfg_dir = Path(args.diffusers_config)
        sub = args.subfolder or "transformer"
        if not cfg_dir.exists():
            from huggingface_hub import hf_hub_download

            cfg_file = Path(hf_hub_download(args.diffusers_config, "config.json", subfolder=sub))
        else:
            cfg_file = cfg_dir / sub / "config.json"
        cfg = json.loads(cfg_file.read_text())
        cls = getattr(diffusers, cfg["_class_name"])
        with init_empty_weights():
            return cls.from_config(cfg), src
    cfg = json.loads((src / "config.json").read_text())
    if "_class_name" in cfg:
        import diffusers

        with init_empty_weights():
            return getattr(diffusers, cfg["_class_name"]).from_config(cfg), src
    import transformers
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(src)
    cls = getattr(
        transformers, (cfg.get("architectures") or ["AutoModelForCausalLM"])[0], transformers.AutoModelForCausalLM
    )
    with init_empty_weights():
        model = cls._from_config(config) if hasattr(cls, "_from_config") else cls.from_config(config)
    return model, src


def main(argv=None) -> int:
    p = C.parser(__doc__.splitlines()[0], default_model="Qwen/Qwen3-8B-FP8", benchmarks=("fp8_load",))
    p.add_argument(
        "--write-format",
        choices=FORMATS,
        default="transformers",
        help="offline: the published format of the file this script writes and loads",
    )
    p.add_argument(
        "--diffusers-config",
        default=None,
        help="--model is a single file: the diffusers repo (or folder) of its config",
    )
    p.add_argument(
        "--subfolder", default=None, help="with --diffusers-config: the component folder (default transformer)"
    )
    args = p.parse_args(argv)
    import torch

    device, dtype = C.resolve(args)
    import mpsboost
    from mpsboost.quant.fp8_plan import describe_checkpoint

    if args.model is not None:
        with C.timed("build on meta"):
            model, path = _published_model(args, device)
        print(describe_checkpoint(path, device))
        t0 = time.perf_counter()
        report = mpsboost.load_fp8(model, path, device=device)
        print(f"loaded in {time.perf_counter() - t0:.1f} s")
        print(report)
        forward = _inputs(model, device, dtype, args.seed)
        if forward is not None:
            with torch.no_grad():
                out = forward(model)
            print(f"one forward: output {tuple(out.shape)} {out.dtype}, finite: {bool(torch.isfinite(out).all())}")
        return 0

    fmt = args.write_format
    builder = _tiny_wan if fmt == "scaled_fp8" else _tiny_lm
    if args.random_weights == "real":
        raise SystemExit(
            "--random-weights real: use benchmarks/fp8_load.py, which writes real-size files tensor by tensor"
        )
    with tempfile.TemporaryDirectory() as tmp:
        src = builder(dtype, args.seed)
        block = (16, 48)  # tiny layers: several blocks per layer, short last blocks
        config = src.config.to_dict() if fmt != "scaled_fp8" else None
        # The writers of the published layouts are the package's: benchmarks/fp8_load.py writes the same files.
        from mpsboost.bench.published import write_published

        path, ref_state = write_published(src, fmt, Path(tmp) / fmt, block=block, config=config)
        print(describe_checkpoint(path, device))
        print()
        stock = builder(dtype, args.seed + 1)
        missing, unexpected = stock.load_state_dict(ref_state, strict=False)
        if unexpected or any("freq" not in k for k in missing):
            raise SystemExit(f"reference state does not fit: missing {missing[:3]}, unexpected {unexpected[:3]}")
        stock = stock.to(device)
        model = builder(dtype, args.seed, meta=True)
        C.print_plans(stock, args.plan)
        size = sum(f.stat().st_size for f in (path.glob("*.safetensors") if path.is_dir() else [path]))
        t0 = time.perf_counter()
        report = mpsboost.load_fp8(model, path, device=device)
        load_s = time.perf_counter() - t0
        fwd_stock = _inputs(stock, device, dtype, args.seed + 2)
        fwd_fp8 = _inputs(model, device, dtype, args.seed + 2)
        common = dict(device=device, repeats=args.repeats, warmup=args.warmup, items_per_call=None, unit="s/call")
        m_stock = C.measure("stock", lambda: fwd_stock(stock), ops={"forward": lambda: fwd_stock(stock)}, **common)
        m_fp8 = C.measure(
            f"mpsboost fp8 checkpoint ({fmt})",
            lambda: fwd_fp8(model),
            ops={"forward": lambda: fwd_fp8(model)},
            **common,
        )
        shape = {
            "model": f"{type(model).__name__} random (tiny)",
            "weights": "random",
            "format": fmt,
            "block": list(block),
        }
        extra = {"file_bytes": size, "load_s": load_s, "format": fmt}
        recs = C.records(NAME, shape, device, dtype, m_stock, m_fp8, psnr=False, extra=extra)
        print(
            f"checkpoint {path.name} ({size / 2**20:.2f} MiB, {fmt}) loaded onto a meta-built model in {load_s:.2f} s; "
            "the stock model holds the file's exact dequantisation"
        )
        return C.finish(NAME, args, report, recs)


if __name__ == "__main__":
    sys.exit(main())
