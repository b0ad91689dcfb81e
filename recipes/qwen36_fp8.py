#!/usr/bin/env python3
"""Qwen3.6-35B-A3B-FP8 on a 64 GB Mac: load the published fp8 folder with mpsboost and generate.

The published checkpoint (about 35 GB; in bf16 the model is about 70 GB, more than a 64 GB Mac holds):

    python recipes/qwen36_fp8.py --model Qwen/Qwen3.6-35B-A3B-FP8 --device mps --prompt "The capital of France is"
    python recipes/qwen36_fp8.py --model ./Qwen3.6-35B-A3B-FP8 --device cuda --requantize rowwise  # see below

The text model (``Qwen3_5MoeForCausalLM``) is built on the meta device from the folder's config and
``mpsboost.load_fp8`` reads every tensor straight into its final storage: the fp8 layers never exist in bf16
(docs/fp8-checkpoints.md has the memory budget). Without options the block scales are applied exactly, and on a
Mac decoding reads the fp8 bytes through mpsboost's Metal fp8 GEMV, which takes the block scales as they are.
``--requantize rowwise`` turns the file's 128x128 block scales into per-row scales while reading (lossy, within
half an e4m3 step per weight). On a Mac where the Metal GEMV runs it changes no path and only costs accuracy; it
matters only where that kernel is off (its self-check failed on this Mac: then torch 2.15's few-rows
``scaled_mm`` at decode instead of dequantise-then-linear) and on CUDA (the Triton fp8 GEMV at decode). The patch
report says which path each layer got.

Offline, with a folder this script writes first in the published layout (the multimodal wrapper's
``model.language_model.*`` keys, BF16 ``weight_scale_inv`` per 128x128 block, experts one Linear per expert, the
published ``modules_to_not_convert`` in bf16), from the real architecture at toy width with random weights:

    python recipes/qwen36_fp8.py --random-weights tiny                     # what CI runs
    python recipes/qwen36_fp8.py --random-weights tiny --write ./qwen36-tiny-fp8   # keep the folder

Offline, the generation is timed against the stock model holding the file's exact dequantisation (codes x
scales in float32, rounded once): four records (throughput, operator time, correctness, memory).
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

NAME = "qwen36_fp8"
BLOCK = (128, 128)  # the published block size
TINY_BLOCK = (16, 32)  # at toy width (experts 32 rows wide) blocks must be smaller to tile each expert's rows


def _text_config():
    from transformers import Qwen3_5MoeTextConfig

    cfg = C.config("qwen3_5_moe", "tiny", "config.json")
    cfg = {k: v for k, v in cfg.items() if k not in ("model_type", "architectures")}
    return Qwen3_5MoeTextConfig(**cfg)


def _text_model(cfg, dtype: torch.dtype, seed: int, meta: bool = False):
    import torch
    from transformers import Qwen3_5MoeForCausalLM

    C.seeded(seed)
    with torch.device("meta" if meta else "cpu"):
        return Qwen3_5MoeForCausalLM(cfg).to(dtype).eval()


def write_folder(src: torch.nn.Module, folder: Path, block: tuple[int, int] = BLOCK) -> dict:
    """``src`` written in the layout of Qwen/Qwen3.6-35B-A3B-FP8; returns the reference state (the file's exact
    dequantisation) under ``src``'s keys."""
    import torch
    from mpsboost.bench.published import qwen36_fp8_layout, write_published

    lay = qwen36_fp8_layout(src.config)
    rename = lay.rename

    _, ref = write_published(
        src,
        "transformers",
        folder,
        block=block,
        config=lay.config,
        rename=rename,
        keep=lay.keep,
        scale_dtype=torch.bfloat16,
        modules_to_not_convert=lay.modules_to_not_convert,
    )
    back = {rename(k): k for k in src.state_dict()}
    return {back.get(k, k): v for k, v in ref.items()}


def meta_model_from(folder: Path):
    """The text model of a Qwen3.6 folder (its config.json: the wrapper's, with ``text_config``), on the meta device."""
    import torch
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    raw = json.loads((folder / "config.json").read_text())
    text = dict(raw.get("text_config", raw))
    text.pop("model_type", None)
    text.pop("architectures", None)
    with torch.device("meta"):
        return Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**text)).eval()


def _generate(model, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    import torch

    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0
        )
    return out[:, ids.shape[1] :]


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    import torch

    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def main(argv=None) -> int:
    p = C.parser(__doc__.splitlines()[0], default_model="Qwen/Qwen3.6-35B-A3B-FP8", benchmarks=("fp8_load",))
    p.add_argument("--prompt", default="The capital of France is", help="--model: the prompt (needs the tokenizer)")
    p.add_argument("--new-tokens", type=int, default=16, help="tokens to generate (default 16)")
    p.add_argument(
        "--requantize",
        choices=("rowwise",),
        default=None,
        help="requantise the file's block scales per row while loading (lossy; on a Mac the same Metal fp8 GEMV "
        "either way: it matters only where that kernel is off, and on CUDA)",
    )
    p.add_argument("--write", type=Path, default=None, help="offline: keep the written folder here")
    args = p.parse_args(argv)
    import torch

    device, dtype = C.resolve(args)
    import mpsboost
    from mpsboost.quant.fp8_plan import describe_checkpoint

    if args.model is not None:
        folder = Path(args.model)
        if not folder.exists():
            from huggingface_hub import snapshot_download

            folder = Path(snapshot_download(args.model, allow_patterns=["*.json", "*.safetensors", "*.txt"]))
        print(describe_checkpoint(folder, device))
        model = meta_model_from(folder)
        t0 = time.perf_counter()
        report = mpsboost.load_fp8(model, folder, device=device, requantize=args.requantize)
        print(f"loaded in {time.perf_counter() - t0:.1f} s")
        print(report)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(folder)
        ids = tok(args.prompt, return_tensors="pt").input_ids.to(device)
        t0 = time.perf_counter()
        new = _generate(model, ids, args.new_tokens)
        dt = time.perf_counter() - t0
        print(args.prompt + tok.decode(new[0], skip_special_tokens=True))
        print(f"{new.shape[1]} tokens in {dt:.2f} s ({new.shape[1] / dt:.2f} tokens/s, prefill included)")
        return 0

    if args.random_weights == "real":
        raise SystemExit(
            "--random-weights real: use benchmarks/fp8_load.py --only qwen3.6, which writes the 36 GB folder "
            "tensor by tensor"
        )
    cfg = _text_config()
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.write or Path(tmp) / "Qwen3.6-35B-A3B-FP8-tiny"
        ref_state = write_folder(_text_model(cfg, dtype, args.seed), folder, TINY_BLOCK)
        print(describe_checkpoint(folder, device))
        print()
        stock = _text_model(cfg, dtype, args.seed + 1)
        missing, unexpected = stock.load_state_dict(ref_state, strict=False)
        if unexpected or any("freq" not in k for k in missing):
            raise SystemExit(f"reference state does not fit: missing {missing[:3]}, unexpected {unexpected[:3]}")
        stock = stock.to(device)
        C.print_plans(stock, args.plan)
        model = meta_model_from(folder)
        t0 = time.perf_counter()
        report = mpsboost.load_fp8(model, folder, device=device, requantize=args.requantize)
        load_s = time.perf_counter() - t0
        g = torch.Generator().manual_seed(args.seed + 2)
        ids = torch.randint(3, cfg.vocab_size, (1, 12), generator=g).to(device)
        new_stock, new_fp8 = _generate(stock, ids, args.new_tokens), _generate(model, ids, args.new_tokens)
        print(f"prompt ids {ids[0].tolist()}")
        print(f"stock (exact dequantisation): {new_stock[0].tolist()}")
        print(f"mpsboost fp8:                 {new_fp8[0].tolist()}")
        common = dict(device=device, repeats=args.repeats, warmup=args.warmup, items_per_call=None, unit="s/call")
        # Timed: the generation; compared: the logits of the prompt (the tokens follow from them).
        m_stock = C.measure(
            "stock", lambda: _logits(stock, ids), ops={"generate": lambda: _generate(stock, ids, 4)}, **common
        )
        m_fp8 = C.measure(
            "mpsboost fp8 (load_fp8)",
            lambda: _logits(model, ids),
            ops={"generate": lambda: _generate(model, ids, 4)},
            **common,
        )
        shape = {
            "model": "Qwen3_5MoeForCausalLM random (tiny)",
            "weights": "random",
            "layout": "Qwen/Qwen3.6-35B-A3B-FP8 (model.language_model.* keys, BF16 weight_scale_inv)",
            "block": list(TINY_BLOCK),
            "requantize": args.requantize,
            "new_tokens": args.new_tokens,
        }
        size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        extra = {"file_bytes": size, "load_s": load_s, "same_tokens": bool(torch.equal(new_stock, new_fp8))}
        recs = C.records(NAME, shape, device, dtype, m_stock, m_fp8, psnr=False, extra=extra)
        print(
            f"folder {folder.name} ({size / 2**20:.2f} MiB) loaded onto a meta-built model in {load_s:.2f} s"
            + (f"; kept at {folder}" if args.write else "")
        )
        return C.finish(NAME, args, report, recs)


if __name__ == "__main__":
    sys.exit(main())
