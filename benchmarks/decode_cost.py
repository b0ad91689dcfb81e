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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="folder for decode_cost-cpu-<date>.json")
    a = p.parse_args(argv)
    warnings.filterwarnings("ignore")
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
