#!/usr/bin/env python3
"""Qwen3.6-35B-A3B in 4 bits on a 32 GB Mac: the MLX folder Mac users download, loaded into transformers by mpsboost.

The mlx-community checkpoint (about 19.5 GB of weights at 4 bits, docs/low-bit.md has the budget):

    python recipes/qwen36_4bit.py --model ./Qwen3.6-35B-A3B-4bit --device mps --new-tokens 32

``mpsboost.from_pretrained`` detects the MLX affine format, builds the text model (``Qwen3_5MoeForCausalLM``) on
the meta device, reads every tensor from the folder straight onto the device (the bf16 model never exists), undoes
every rewrite mlx-lm's converter made (experts' stacks fused back, conv1d and norms restored), and patches the
model; the report says which path each layer takes (on a Mac whose Metal self-check passes: mpsboost's low-bit GEMV
at decode). Its speed has not been measured on a Mac yet.

Offline, with a tiny folder this script writes first, of the real architecture at toy width with random weights
(mlx-lm's own converter where mlx-lm is installed, mpsboost's writer otherwise):

    python recipes/qwen36_4bit.py --random-weights tiny                       # what CI runs
    python recipes/qwen36_4bit.py --random-weights tiny --write ./qwen36-tiny-4bit --bits 8
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path


def _tiny_text_config():
    import json

    from transformers import Qwen3_5MoeTextConfig

    root = Path(__file__).resolve().parents[1] / "src/mpsboost/bench/configs/qwen3_5_moe/tiny/config.json"
    cfg = {k: v for k, v in json.loads(root.read_text()).items() if not k.startswith("_")}
    cfg.pop("model_type", None)
    cfg.pop("architectures", None)
    return Qwen3_5MoeTextConfig(**cfg)


def write_tiny(folder: Path, bits: int, group_size: int, seed: int = 0) -> str:
    """A tiny MLX folder of Qwen3.6's text model; returns who wrote it."""
    import torch
    from transformers import Qwen3_5MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3_5MoeForCausalLM(_tiny_text_config()).float().eval()
    try:
        import mlx.core as mx
        from mlx_lm import utils as mu
    except ImportError:
        import mpsboost

        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp)
            q = mpsboost.from_pretrained(
                tmp, dtype=torch.float32, device="cpu", quantize={"bits": bits, "group_size": group_size}
            )
            mpsboost.save_mlx(q, folder)
        return "mpsboost.save_mlx (mlx-lm is not installed)"
    # mlx-lm's converter on the published layout: the multimodal wrapper's keys, its config with text_config.
    sd = {
        (k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v
        for k, v in model.state_dict().items()
    }
    text = model.config.to_dict()
    text["full_attention_interval"] = text.get("full_attention_interval", 4)
    config = {"model_type": "qwen3_5_moe", "text_config": text, "tie_word_embeddings": False}
    cls, args_cls = mu._get_classes(config=config)
    mm = cls(args_cls.from_dict(config))
    mm.load_weights(list(mm.sanitize({k: mx.array(v.numpy()) for k, v in sd.items()}).items()))
    mm, config = mu.quantize_model(mm, config, group_size, bits)
    mu.save_model(folder, mm)
    mu.save_config(config, config_path=folder / "config.json")
    return "mlx-lm's quantize_model + save_model"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="an MLX folder (mlx-community/...-4bit or -8bit)")
    ap.add_argument("--random-weights", choices=["tiny"], help="write a tiny random MLX folder first and load it")
    ap.add_argument("--write", help="where --random-weights writes its folder (default: a temporary one)")
    ap.add_argument("--bits", type=int, default=4, choices=[4, 8])
    ap.add_argument("--group-size", type=int, default=64, choices=[32, 64, 128])
    ap.add_argument("--device", default=None, help="mps, cuda or cpu (default: the best one here)")
    ap.add_argument("--new-tokens", type=int, default=16)
    args = ap.parse_args(argv)
    if bool(args.model) == bool(args.random_weights):
        ap.error("give --model FOLDER or --random-weights tiny")
    import torch

    import mpsboost

    tmp = None
    folder = Path(args.model) if args.model else None
    if args.random_weights:
        folder = Path(args.write) if args.write else Path(tmp := tempfile.mkdtemp(prefix="qwen36-4bit-"))
        who = write_tiny(folder, args.bits, args.group_size)
        print(f"wrote a tiny {args.bits}-bit MLX folder at {folder} with {who}")
    dtype = torch.float32 if args.random_weights else torch.bfloat16
    model = mpsboost.from_pretrained(folder, dtype=dtype, device=args.device)
    print(mpsboost.last_report(model))
    dev = next(model.parameters()).device
    ids = torch.tensor([[1, 5, 9, 13, 17, 21]], device=dev)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)
    print("tokens:", out[0, ids.shape[1] :].tolist())
    if tmp and not args.write:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
