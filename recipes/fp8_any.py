#!/usr/bin/env python3
"""FP8 weight storage of any diffusers or transformers model with mpsboost, saved and reloaded.

With weights (network or a local copy):

    python recipes/fp8_any.py --model Qwen/Qwen3-30B-A3B --device mps --granularity rowwise \
        --save qwen3-fp8.safetensors
    python recipes/fp8_any.py --model Wan-AI/Wan2.2-TI2V-5B-Diffusers --subfolder transformer --device mps

Offline, real architecture with random weights (configs shipped with mpsboost, mpsboost.bench.models):

    python recipes/fp8_any.py --random-weights tiny --arch qwen3_moe     # seconds on a CPU (what CI runs)
    python recipes/fp8_any.py --random-weights real --arch wan_transformer --device mps

What it does: one forward of the stock model (the reference), ``mpsboost.patch(model, fp8=...)``
(float8_e4m3fn weights with fp32 per-row or per-tensor scales; lossy and irreversible, so it is opt-in),
the same forward again (throughput, operator time, correctness against stock, memory peaks, weight
bytes before and after), then ``mpsboost.save_fp8`` to a safetensors file and ``mpsboost.load_fp8``
into a freshly loaded copy of the model, whose output must equal the converted model's exactly.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: --help answers before torch loads
    import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

NAME = "fp8_any"
ARCHS = {  # --arch -> (shipped config, library)
    "qwen3_moe": (("qwen3_moe", "config.json"), "transformers"),
    "wan_transformer": (("wan22_ti2v", "transformer.json"), "diffusers"),
    "qwen_image_transformer": (("qwen_image", "transformer.json"), "diffusers"),
}


def _read_config(model: str, subfolder: str | None) -> dict:
    local = Path(model) / (subfolder or "") / "config.json"
    if local.is_file():
        return json.loads(local.read_text())
    from huggingface_hub import hf_hub_download

    return json.loads(Path(hf_hub_download(model, "config.json", subfolder=subfolder)).read_text())


def load(args, device: str, dtype: torch.dtype, seed: int):
    """The model, loaded from --model or built from a shipped config with random weights (``seed``)."""
    import torch

    if args.model is not None:
        cfg = _read_config(args.model, args.subfolder)
        if "_class_name" in cfg:  # a diffusers model folder
            import diffusers

            cls = getattr(diffusers, cfg["_class_name"])
            model = cls.from_pretrained(args.model, subfolder=args.subfolder, dtype=dtype)
        else:
            import transformers

            arch = (cfg.get("architectures") or ["AutoModel"])[0]
            cls = getattr(transformers, arch, None) or transformers.AutoModel
            model = cls.from_pretrained(args.model, subfolder=args.subfolder or "", dtype=dtype)
        return model.to(device).eval()
    (folder, file), library = ARCHS[args.arch]
    cfg = C.config(folder, args.random_weights, file)
    C.seeded(seed)
    with C.default_dtype(dtype), torch.device(device):
        if library == "diffusers":
            import diffusers

            class_name = C.read_config(folder, args.random_weights, file)["_class_name"]
            model = getattr(diffusers, class_name).from_config(cfg)
        else:
            from transformers import AutoModelForCausalLM, Qwen3MoeConfig

            cfg.pop("model_type", None)
            theta = cfg.pop("rope_theta", None)
            if theta is not None:
                cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
            if args.layers is not None:
                cfg["num_hidden_layers"] = args.layers
            model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**cfg), dtype=dtype)
    return model.to(device=device, dtype=dtype).eval()


def make_inputs(model, device: str, dtype: torch.dtype, seed: int):
    """Inputs of one forward for the model classes the cookbook knows; None for others."""
    import torch

    g = torch.Generator().manual_seed(seed)
    name = type(model).__name__
    cfg = model.config
    if name == "WanTransformer3DModel":
        hs = torch.randn(1, cfg.in_channels, 3, 16, 16, generator=g).to(device, dtype)
        enc = torch.randn(1, 32, cfg.text_dim, generator=g).to(device, dtype)
        t = torch.tensor([500], device=device)
        return lambda m: m(hidden_states=hs, timestep=t, encoder_hidden_states=enc, return_dict=False)[0]
    if name == "QwenImageTransformer2DModel":
        side = 16
        hs = torch.randn(1, side * side, cfg.in_channels, generator=g).to(device, dtype)
        enc = torch.randn(1, 32, cfg.joint_attention_dim, generator=g).to(device, dtype)
        mask = torch.ones(1, 32, dtype=torch.long, device=device)
        t = torch.tensor([0.5], device=device, dtype=dtype)
        return lambda m: m(
            hidden_states=hs,
            encoder_hidden_states=enc,
            encoder_hidden_states_mask=mask,
            timestep=t,
            img_shapes=[[(1, side, side)]],
            return_dict=False,
        )[0]
    vocab = getattr(cfg, "vocab_size", None)
    if vocab:
        ids = torch.randint(3, vocab, (1, 64), generator=g).to(device)

        def run(m):
            out = m(input_ids=ids)
            return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state

        return run
    return None


def weight_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))


def main(argv=None) -> int:
    p = C.parser(__doc__.splitlines()[0], default_model="Qwen/Qwen3-30B-A3B", benchmarks=("fp8_weights",))
    p.add_argument(
        "--subfolder", default=None, help="with --model: the model's folder in a pipeline repo, e.g. transformer"
    )
    p.add_argument(
        "--arch",
        choices=tuple(ARCHS),
        default="qwen3_moe",
        help="with --random-weights: which shipped architecture (default qwen3_moe)",
    )
    p.add_argument("--layers", type=int, default=None, help="random-weights transformers model: only this many layers")
    p.add_argument(
        "--granularity",
        choices=("rowwise", "tensorwise"),
        default="rowwise",
        help="fp8 scale granularity (default rowwise)",
    )
    p.add_argument("--save", type=Path, default=None, help="fp8 safetensors file to write (default: a temporary file)")
    args = p.parse_args(argv)
    import torch

    device, dtype = C.resolve(args)
    import mpsboost

    try:
        save_fp8, load_fp8 = mpsboost.save_fp8, mpsboost.load_fp8
        from mpsboost import checkpoints  # noqa: F401  (save_fp8/load_fp8 live there, next to the fp8_weights recipe)
    except ImportError as exc:
        raise SystemExit(
            f"fp8_any needs mpsboost.save_fp8/load_fp8 (the fp8_weights recipe); this mpsboost has none: {exc}"
        )
    if "fp8_weights" not in mpsboost.recipe_names():
        raise SystemExit("fp8_any needs the fp8_weights recipe, which this mpsboost does not register")

    with C.timed("build"):
        model = load(args, device, dtype, args.seed)
    forward = make_inputs(model, device, dtype, args.seed + 1)
    if forward is None:
        print(f"{type(model).__name__}: no known inputs; converting, saving and reloading only", file=sys.stderr)
    job = (lambda: forward(model)) if forward else None
    common = dict(device=device, repeats=args.repeats, warmup=args.warmup, items_per_call=None, unit="s/call")
    C.print_plans(model, args.plan, args.granularity)

    bytes_before = weight_bytes(model)
    stock = C.measure("stock", job, ops={"forward": job}, **common) if job else None
    report = mpsboost.patch(model, fp8=args.granularity)
    bytes_after = weight_bytes(model)
    patched = C.measure(f"mpsboost fp8 {args.granularity}", job, ops={"forward": job}, **common) if job else None

    path = args.save
    tmp = None
    if path is None:
        tmp = tempfile.TemporaryDirectory()
        path = Path(tmp.name) / "model.fp8.safetensors"
    save_fp8(model, path)
    size = path.stat().st_size
    fresh = load(args, device, dtype, args.seed)  # the same checkpoint (or seed) loaded again
    load_fp8(fresh, path)
    identical = None
    if forward is not None:
        with torch.no_grad():
            identical = bool(torch.equal(forward(fresh).float().cpu(), forward(model).float().cpu()))
    where = f"{path}" if tmp is None else "a temporary file, deleted now (--save FILE keeps it)"
    print(
        f"fp8 file: {where} ({size / 2**20:.2f} MiB); "
        f"weights {bytes_before / 2**20:.2f} -> {bytes_after / 2**20:.2f} MiB "
        f"({bytes_after / bytes_before:.2f}x); reloaded output identical to the converted model: {identical}"
    )
    if tmp is not None:
        tmp.cleanup()
    if stock is None:
        print(report)
        return 0
    extra = {
        "weight_bytes_stock": bytes_before,
        "weight_bytes_fp8": bytes_after,
        "fp8_file_bytes": size,
        "reload_identical": identical,
        "granularity": args.granularity,
    }
    shape = {"model": args.model or f"{args.arch} random ({args.random_weights})", "class": type(model).__name__}
    recs = C.records(NAME, shape, device, dtype, stock, patched, psnr=False, extra=extra)
    code = C.finish(NAME, args, report, recs)
    if identical is False:
        print("error: the reloaded model does not reproduce the converted model's output", file=sys.stderr)
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
