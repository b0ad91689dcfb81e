"""The memory budget of Qwen3.6-35B-A3B in MLX affine low bits on a Mac, computed from the model's real config
(``src/mpsboost/bench/configs/qwen3_5_moe/real/config.json``), not typed:

* weights: every tensor of ``Qwen3_5MoeForCausalLM`` built on the meta device, stored as ``mpsboost.from_pretrained``
  stores an mlx-community folder: plain ``nn.Linear`` / ``nn.Embedding`` and the experts' stacks in ``bits`` with
  bf16 scales and biases per group of 64 (``K * bits / 8 + 4 * K / 64`` bytes a row), everything else in bf16 (the
  routers, which mlx-lm stores at 8 bits and transformers' ``TopKRouter`` reads as a plain weight, are dequantised);
* state: the Gated DeltaNet layers' recurrent state (float32) and convolution state (bf16) for one sequence;
* KV cache: the full-attention layers' keys and values (bf16) at 8k and 32k tokens, one sequence;
* load peak: the quantized weights plus the largest tensor of the file (the one-call load reads one at a time);
* the Mac's GPU working set: assumed 2/3 of the RAM up to 36 GB and 3/4 above (the usual default of
  ``recommendedMaxWorkingSetSize``; ``torch.mps.recommended_max_memory()`` gives the real one), not measured;
* measured (the second table, from the committed records ``benchmarks/results/lowbit_load-*.jsonl`` of
  ``benchmarks/lowbit_load.py`` at the real config, 40 layers): the file written, the device's allocator peak over
  ``mpsboost.from_pretrained``, and the logits against the file's exact dequantisation; the latest record of each
  bit width. The "load peak" column of the first table takes the measured peak where a record has one.

    python benchmarks/low_bit_budget.py            # print the table
    python benchmarks/low_bit_budget.py --write    # rewrite its block in docs/low-bit.md
    python benchmarks/low_bit_budget.py --check    # exit 1 where docs/low-bit.md differs
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "src/mpsboost/bench/configs/qwen3_5_moe/real/config.json"
DOC = ROOT / "docs/low-bit.md"
START, END = "<!-- low-bit-budget:start -->", "<!-- low-bit-budget:end -->"
RESULTS = ROOT / "benchmarks/results"
GB = 10**9
GROUP = 64
MACS = {4: (32, 36, 48), 8: (48, 64)}


def _model():
    import torch
    import transformers as t

    cfg = {k: v for k, v in json.loads(CONFIG.read_text()).items() if not k.startswith("_")}
    cfg.pop("model_type", None)
    cfg.pop("architectures", None)
    with torch.device("meta"):
        return t.Qwen3_5MoeForCausalLM(t.Qwen3_5MoeTextConfig(**cfg)), cfg


def sizes(bits: int) -> dict:
    import torch

    model, cfg = _model()
    quant = kept = 0
    largest = 0
    for name, mod in model.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            n = p.numel()
            k = p.shape[-1]
            low = (
                (type(mod) in (torch.nn.Linear, torch.nn.Embedding) and pname == "weight")
                or pname in ("gate_up_proj", "down_proj")
            ) and k % GROUP == 0
            if low:
                rows = n // k
                nbytes = rows * (k * bits // 8 + 2 * 2 * (k // GROUP))
                quant += nbytes
            else:
                nbytes = 2 * n
                kept += nbytes
            largest = max(largest, nbytes)
    layers = cfg["num_hidden_layers"]
    full = layers // cfg["full_attention_interval"]
    linear = layers - full
    hv, dk, dv = cfg["linear_num_value_heads"], cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    conv_dim = 2 * cfg["linear_num_key_heads"] * dk + hv * dv
    state = linear * (hv * dk * dv * 4 + conv_dim * cfg["linear_conv_kernel_dim"] * 2)
    kv_token = full * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 2
    return {"quant": quant, "kept": kept, "largest": largest, "state": state, "kv_token": kv_token}


def measured() -> dict[int, dict]:
    """bits -> the latest real-size load record (40 layers, with a device peak): its values and where it lies."""
    from mpsboost.bench import read_jsonl

    found: dict[int, dict] = {}
    for path in sorted(RESULTS.glob("lowbit_load-*.jsonl")):
        for r in read_jsonl(path):
            shape = r.workload.shape
            peak = r.memory.tensor_allocated if r.memory else None
            if r.workload.name != "lowbit_load" or shape.get("layers") != 40 or peak is None:
                continue
            bits = int(shape["bits"])
            if bits not in found or r.created > found[bits]["created"]:
                found[bits] = {
                    "created": r.created,
                    "file": shape["file_bytes"],
                    "peak": peak,
                    "rel_error": r.correctness.rel_error if r.correctness else None,
                    "layers_max": max(r.extra.get("layer_errors") or [float("nan")]),
                    "record": path.name,
                    "env": f"{r.env.device_name}; torch {r.env.torch_version}",
                }
    return found


def measured_table() -> str:
    lines = [
        "| bits | file (GB) | device peak over the load (GB) | peak / file | logits vs exact dequantisation (rel.) | "
        "worst layer fed the reference's input (rel.) | record |",
        "|---|---|---|---|---|---|---|",
    ]
    for bits, m in sorted(measured().items()):
        worst = "not recorded" if math.isnan(m["layers_max"]) else f"{m['layers_max']:.1e}"
        lines.append(
            f"| {bits} | {_gb(m['file'])} | {_gb(m['peak'])} | {m['peak'] / m['file']:.3f}x | {m['rel_error']:.2f} | "
            f"{worst} | `{m['record']}`; {m['env']} |"
        )
    return "\n".join(lines)


def _gb(x: float) -> str:
    return f"{x / GB:.1f}"


def table() -> str:
    lines = [
        "| Mac | bits | weights, low bits (GB) | kept in bf16 (GB) | DeltaNet state (GB) | KV 8k / 32k (GB) | "
        "total at 8k / 32k (GB) | GPU working set, assumed (GB) | fits at 8k / 32k | load peak (GB) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    seen = measured()
    for bits, macs in MACS.items():
        s = sizes(bits)
        w = s["quant"] + s["kept"]
        for ram in macs:
            usable = ram * GB * (2 / 3 if ram <= 36 else 3 / 4)
            tot = [w + s["state"] + s["kv_token"] * n for n in (8192, 32768)]
            fits = " / ".join("yes" if t <= usable else "no" for t in tot)
            lines.append(
                f"| {ram} GB | {bits} | {_gb(s['quant'])} | {s['kept'] / GB:.2f} | {s['state'] / GB:.2f} | "
                f"{_gb(s['kv_token'] * 8192)} / {_gb(s['kv_token'] * 32768)} | {_gb(tot[0])} / {_gb(tot[1])} | "
                f"{_gb(usable)} | {fits} | {_load_peak(seen.get(bits), w + s['largest'])} |"
            )
    return "\n".join(lines)


def _load_peak(m: dict | None, bound: float) -> str:
    if m is None:
        return f"{_gb(bound)} (bound)"
    return f"{_gb(m['peak'])} (measured; bound {_gb(bound)})"


def _doc_with(text: str) -> str:
    doc = DOC.read_text()
    a, b = doc.index(START) + len(START), doc.index(END)
    return doc[:a] + "\n" + text + "\n" + doc[b:]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="rewrite the table's block in docs/low-bit.md")
    ap.add_argument("--check", action="store_true", help="exit 1 where docs/low-bit.md holds another table")
    args = ap.parse_args(argv)
    text = (
        table()
        + "\n\nMeasured at the real config (40 layers, random weights), on a GPU, not a Mac:\n\n"
        + measured_table()
    )
    if args.write:
        DOC.write_text(_doc_with(text))
    elif args.check:
        if _doc_with(text) != DOC.read_text():
            print("docs/low-bit.md: the budget table differs from benchmarks/low_bit_budget.py's", file=sys.stderr)
            return 1
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
