"""decode_cost: aten ops and bytes moved by one decode step of the Qwen3.6 shape, per block, under a Mac's decisions.

The device-independent proxies of a Mac's eager decode (``mpsboost.bench.decode_cost``: the counting rules of the
project's decode-ops tool): ops at the tiny size in float32 (host time), bytes at the medium size in bfloat16 (the
real model's widths, 4 layers, 32 experts top-8: device time once host time is low). Variants, each under the
decisions of a Mac on each torch build (``Env.simulate``), every lossless recipe on:

* ``patched``: ``mpsboost.patch(model)``, weights in the compute dtype (float32 at the tiny size, as the tool
  counts; ``patched, bfloat16`` at the tiny size too, the baseline of the published layout, which computes in
  bfloat16);
* ``fp8 rowwise``: ``patch(model, fp8="rowwise")`` (mpsboost's Metal GEMV where the gate allows it);
* ``fp8 rowwise, torch's kernels``: the same with option ``mps_kernel="scaled_mm"`` (torch's ``F.scaled_mm``
  few-rows kernels on 2.15, dequantisation before);
* ``fp8 as published``: the model written in the layout of Qwen/Qwen3.6-35B-A3B-FP8 (block scales: 128x128 at the
  medium size, 16x32 at the tiny one, whose experts are 64 rows wide) and read back by ``mpsboost.load_fp8``.

    python benchmarks/decode_cost.py --out benchmarks/results        # writes decode_cost-cpu-<date>.json

Counts hold on every device; ``python benchmarks/tables.py`` renders the record into docs/fp8-checkpoints.md.

``--predict`` writes a Mac cost model's **prediction** (never a measurement) of Qwen3.6-35B-A3B's decode step on
named chips (``mpsboost.bench.decode_cost.predict``): bytes / (eta * bandwidth) + Metal dispatches * c_metal +
MPSGraph dispatches * c_graph, every constant with its source. Counts at the medium size in bfloat16 (the real
widths; ops per block equal the tiny size's), under Mac 2.15.0 decisions and the 2.15.0 wheel's dispatch kinds,
scaled to the real model: each block's counts per block times its real number (30 Gated DeltaNet, 10 attention,
40 MoE), the rest as counted, plus the bytes the medium widths leave out (the 248,320-row lm_head, the 256-expert
router). Rows: stock, patched bf16, fp8 as published (``load_fp8``), and 4-bit: the medium model quantised by
``low_bit_weights`` (MLX affine, 4 bits, groups of 64, its lm_head too; the router kept in bf16, the shared expert's
gate at 8 bits) and patched, its step counted like the others; the bytes the medium widths leave out are added at
MLX 4-bit's rates (4.5 bits a weight for the lm_head with its scales and biases, 8.5 for the router, as mlx-lm
writes it).

    python benchmarks/decode_cost.py --predict --out benchmarks/results   # decode_cost-predict-<date>.json

``--calibrate FILE...`` (with ``--predict``) adds, per Mac selftest file, the same steps predicted with the constants
that Mac measured (probe ``dispatch_cost``: c_metal, c_graph, eta), on the chip it names; a file that is not a
validated Mac run, or whose constants are outside their physical bounds, is refused before anything is counted.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
import tempfile
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "recipes"))

ENVS = ("2.15.0", "2.14.1")
VARIANTS = ("patched", "fp8 rowwise", "fp8 rowwise, torch's kernels", "patched, bfloat16", "fp8 as published")
SIZES = {"ops": ("tiny", torch.float32), "bytes": ("medium", torch.bfloat16)}
BF16 = ("patched, bfloat16", "fp8 as published")  # computing in bfloat16 at every size


def _model(variant: str, size: str, dtype: torch.dtype, env, workdir: Path):
    import mpsboost
    from mpsboost.bench.decode_cost import build

    if variant in BF16:
        dtype = torch.bfloat16
    if variant != "fp8 as published":
        m = build(size, dtype)
        kw = {"fp8": "rowwise"} if variant.startswith("fp8") else {}
        opts = {"fp8_weights": {"mps_kernel": "scaled_mm"}} if variant.endswith("torch's kernels") else None
        mpsboost.patch(m, device=env, options=opts, **kw)
        return m
    import qwen36_fp8

    folder = Path(tempfile.mkdtemp(dir=workdir))
    qwen36_fp8.write_folder(build(size, torch.bfloat16), folder, block=(128, 128) if size == "medium" else (16, 32))
    m = qwen36_fp8.meta_model_from(folder)
    mpsboost.load_fp8(m, folder, device=env)
    return m


def measure(workdir: Path) -> list[dict]:
    from mpsboost.bench.decode_cost import decode_cost
    from mpsboost.gate import Env

    rows = []
    for ver in ENVS:
        env = Env.simulate("mps", ver)
        for what, (size, dtype) in SIZES.items():
            for variant in VARIANTS:
                if what == "bytes" and variant == "patched, bfloat16":
                    continue  # the medium size computes in bfloat16 already: the same as "patched"
                m = _model(variant, size, dtype, env, workdir)
                counts = decode_cost(m)[what]
                rows.append(
                    {
                        "decisions": f"mac-{ver}",
                        "variant": variant,
                        "measure": what,
                        "size": size,
                        "dtype": "bfloat16" if variant in BF16 else str(dtype).replace("torch.", ""),
                        "blocks": counts,
                        "total": sum(counts.values()),
                    }
                )
                print(f"mac-{ver} {what:5s} {variant:30s} {sum(counts.values()):>12}", flush=True)
                del m
    return rows


REAL = {"hidden": 2048, "vocab": 248_320, "experts": 256, "top_k": 8}  # Qwen3.6-35B-A3B (shared/FACTS.md)
FOUR_BIT = "4-bit (MLX affine g64, low_bit_weights)"
PREDICT_VARIANTS = ("stock", "patched, bfloat16", "fp8 as published", FOUR_BIT)
BITS = 4.5  # MLX affine 4-bit, group 64, bf16 scales and biases (shared/FACTS.md, MLX's format)
ROUTER_BITS = 8.5  # mlx-lm gives mlp.gate and mlp.shared_expert_gate 8 bits
SEED = {"before": 38.7, "after": 51.7}  # tok/s, the seed's M3 Ultra, bf16, torch.compile (issue 37)
PEERS = (
    ("MLX 4-bit", "M3 Ultra", 92.0, "Rapid-MLX#159"),
    ("MLX 8-bit", "M3 Ultra", 73.0, "Rapid-MLX#472 (about)"),
    ("MLX 4-bit", "M2 Max", 79.8, "Rapid-MLX#1065"),
    ("MLX 4-bit", "M3 Max", 97.5, "incoai/splash#37 (96-99)"),
    ("llama.cpp Q8_0 (Qwen3.5-35B-A3B)", "not stated", 53.5, "ollama#14861"),
    ("the seed's PyTorch bf16, torch.compile, before the grouped decode", "M3 Ultra", 38.7, "issue 37"),
    ("the seed's PyTorch bf16, torch.compile, after the grouped decode", "M3 Ultra", 51.7, "issue 37"),
)


def weight_bytes(model) -> dict[str, float]:
    """Bytes of weights one decode step reads per block, at the real model's counts: every 2-D+ parameter of a
    block, the routed experts' stacks times top_k / experts (the experts one token picks), the router at the real
    number of experts; ``rest``: the real lm_head (one embedding row is left out). ``router``: the routers' share
    of ``mlp`` (kept at 8 bits by the 4-bit layout)."""
    from mpsboost.bench.decode_cost import BLOCKS, REAL_BLOCKS, blocks_of

    per = dict.fromkeys(BLOCKS, 0.0)
    router = 0.0
    for name, p in model.named_parameters():
        parts = name.split(".")
        if p.dim() < 2 or len(parts) < 5 or parts[3] not in BLOCKS:
            continue
        b = p.numel() * p.element_size()
        if parts[4] == "experts":
            b *= REAL["top_k"] / p.shape[0]
        elif parts[3] == "mlp" and parts[4] in ("gate", "shared_expert_gate"):
            b *= REAL["experts"] / p.shape[0] if parts[4] == "gate" else 1
            router += b
        per[parts[3]] += b
    n = blocks_of(model)
    out = {k: per[k] / n[k] * REAL_BLOCKS[k] for k in BLOCKS if n[k]}
    out["router"] = router / n["mlp"] * REAL_BLOCKS["mlp"]
    out["rest"] = REAL["vocab"] * REAL["hidden"] * 2
    return out


def _predict_model(variant: str, env, workdir: Path):
    from mpsboost.bench.decode_cost import build

    if variant == "stock":
        return build("medium", torch.bfloat16)
    if variant == FOUR_BIT:
        import mpsboost

        m = build("medium", torch.bfloat16)
        opts = {"low_bit_weights": {"bits": 4, "group_size": 64}}
        mpsboost.patch(m, device=env, recipes=["low_bit_weights"], options=opts)
        mpsboost.patch(m, device=env)
        return m
    return _model(variant, "medium", torch.bfloat16, env, workdir)


def calibrated_rows(steps: dict, cal: dict) -> list[dict]:
    """The prediction of each step with the constants a Mac's selftest measured
    (``mpsboost.selftest.report.calibration``): on the chip it names (its bandwidth from :data:`CHIPS`), with its
    measured eta where it has one."""
    from mpsboost.bench.decode_cost import CHIPS, CONSTANTS, predict

    chip = cal["chip"]
    if chip not in CHIPS:
        raise SystemExit(f"{cal['file']}: chip {chip!r} is not one the model names ({', '.join(CHIPS)})")
    bw, eta_key, _ = CHIPS[chip]
    eta = cal["eta"] if cal["eta"] is not None else CONSTANTS[eta_key][0]
    rows = []
    for variant, step in steps.items():
        lo = predict(step, bw, eta, cal["c_metal_us"], cal["c_graph_us"], mixed="metal")
        hi = predict(step, bw, eta, cal["c_metal_us"], cal["c_graph_us"], mixed="mpsgraph")
        rows.append(
            {
                "variant": variant,
                "chip": chip,
                "file": cal["file"],
                "constants": {k: cal[k] for k in ("c_metal_us", "c_graph_us", "eta")},
                "ms_mixed_as_metal": round(lo, 2),
                "ms_mixed_as_mpsgraph": round(hi, 2),
                "tok_s": [round(1e3 / hi, 1), round(1e3 / lo, 1)],
            }
        )
    return rows


def predict_rows(workdir: Path) -> dict:
    from mpsboost.bench.decode_cost import CHIPS, CONSTANTS, blocks_of, decode_cost, predict, scale
    from mpsboost.gate import Env

    env = Env.simulate("mps", "2.15.0")
    steps, extra = {}, {}
    for variant in PREDICT_VARIANTS:
        m = _predict_model(variant, env, workdir)
        head_rows = m.get_output_embeddings().out_features
        router_rows = m.model.layers[0].mlp.gate.weight.shape[0]
        # what the medium widths leave out: the real vocabulary's lm_head rows, the real router's experts (bf16; at
        # MLX 4-bit's rates for the 4-bit row)
        head_b, router_b = (BITS / 8, ROUTER_BITS / 8) if variant == FOUR_BIT else (2, 2)
        extra[variant] = (REAL["vocab"] - head_rows) * REAL["hidden"] * head_b + 40 * REAL["hidden"] * (
            REAL["experts"] - router_rows
        ) * router_b
        cost = decode_cost(m, release="2.15.0")
        steps[variant] = scale(cost, blocks_of(m), extra_bytes=extra[variant])
        steps[variant]["counted"] = {k: cost[k] for k in ("ops", "bytes", "dispatches", "pointwise")}
        if variant == "patched, bfloat16":
            weights = weight_bytes(m)
        print(f"{variant:20s} {steps[variant]['bytes'] / 1e9:7.2f} GB {steps[variant]['ops']:7.0f} ops", flush=True)
        del m
    c = {k: v for k, (v, _) in CONSTANTS.items()}
    rows = []
    for variant, step in steps.items():
        for chip, (bw, eta_key, _) in CHIPS.items():
            lo = predict(step, bw, c[eta_key], c["c_metal_us"], c["c_graph_us"], mixed="metal")
            hi = predict(step, bw, c[eta_key], c["c_metal_us"], c["c_graph_us"], mixed="mpsgraph")
            fu = predict(step, bw, c[eta_key], c["c_metal_us"], c["c_graph_us"], mixed="metal", fused=True)
            rows.append(
                {
                    "variant": variant,
                    "chip": chip,
                    "ms_mixed_as_metal": round(lo, 2),
                    "ms_mixed_as_mpsgraph": round(hi, 2),
                    "ms_pointwise_fused": round(fu, 2),
                    "tok_s": [round(1e3 / hi, 1), round(1e3 / lo, 1)],
                    "tok_s_pointwise_fused": round(1e3 / fu, 1),
                    "bytes_ms": round(step["bytes"] / (c[eta_key] * bw * 1e9) * 1e3, 2),
                }
            )
    return {"steps": steps, "weight_bytes": weights, "rows": rows}


def main_predict(out: Path, calibrate: list[Path] = ()) -> int:
    import transformers

    import mpsboost
    from mpsboost.bench.decode_cost import CHIPS, CONSTANTS
    from mpsboost.selftest.report import calibration

    cals = [calibration(f) for f in calibrate]  # refused before anything is counted
    with tempfile.TemporaryDirectory() as work:
        got = predict_rows(Path(work))
    if cals:
        got["calibrated"] = [row for cal in cals for row in calibrated_rows(got["steps"], cal)]
    record = {
        "name": "decode_cost-predict",
        "label": "predicted, not measured",
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": "python benchmarks/decode_cost.py --predict --out benchmarks/results",
        "env": {
            "device": "cpu (counts); the times are a model's prediction for the chips named",
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "mpsboost": mpsboost.__version__,
            "python": platform.python_version(),
            "decisions": "mac-2.15.0",
            "dispatch kinds": "src/mpsboost/data/mps_dispatch_kinds.json, torch 2.15.0 macOS wheel",
            "counting": "as a Mac dispatches (decode_cost as_on_mps: F.rms_norm as one _fused_rms_norm)",
        },
        "model": (
            "ms = bytes / (eta * bandwidth) + metal * c_metal + mpsgraph * c_graph; 'mixed' ops (both paths ship) "
            "priced as Metal (ms_mixed_as_metal) and as MPSGraph (ms_mixed_as_mpsgraph); ms_pointwise_fused: "
            "pointwise ops' dispatches removed (a bound on torch.compile's fusion). Bytes: read and written, at a "
            "40-token context. Scaling: counts per block (medium size, bf16) times the real blocks (30 Gated "
            "DeltaNet, 10 attention, 40 MoE), the rest as counted, plus the real lm_head and router bytes."
        ),
        "constants": {k: {"value": v, "source": s} for k, (v, s) in CONSTANTS.items()},
        "chips": {k: {"bandwidth_gbs": bw, "eta": e, "source": s} for k, (bw, e, s) in CHIPS.items()},
        "seed": SEED,
        "peers": [{"what": w, "chip": c, "tok_s": t, "source": s} for w, c, t, s in PEERS],
        **got,
    }
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"decode_cost-predict-{dt.date.today().isoformat()}.json"
    for suffix in "bcdefghijklmnopqrstuvwxyz":  # a record of the same day is kept: the next letter
        if not path.exists():
            break
        path = out / f"decode_cost-predict-{dt.date.today().isoformat()}{suffix}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"record written to {path}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="folder for decode_cost-cpu-<date>.json")
    p.add_argument("--predict", action="store_true", help="write decode_cost-predict-<date>.json: a prediction")
    p.add_argument(
        "--calibrate",
        type=Path,
        nargs="+",
        default=[],
        metavar="SELFTEST.jsonl",
        help="with --predict: also predict with the constants these Macs' selftest files measured",
    )
    a = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    if a.calibrate and not a.predict:
        p.error("--calibrate goes with --predict")
    if a.predict:
        return main_predict(a.out, a.calibrate)
    import transformers

    import mpsboost

    with tempfile.TemporaryDirectory() as work:
        rows = measure(Path(work))
    record = {
        "name": "decode_cost",
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": "python benchmarks/decode_cost.py --out benchmarks/results",
        "env": {
            "device": "cpu (counts: device independent)",
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "mpsboost": mpsboost.__version__,
            "python": platform.python_version(),
        },
        "rules": "mpsboost.bench.decode_cost (the counting rules of shared/tools/decode_ops.py)",
        "rows": rows,
    }
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / f"decode_cost-cpu-{dt.date.today().isoformat()}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"record written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
