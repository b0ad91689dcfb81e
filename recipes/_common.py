"""What every cookbook script shares: arguments, configs, stock-vs-patched measurement, the records.

A cookbook script builds its pipeline or model (``--model`` from the hub or a local folder, or
``--random-weights tiny|real`` from the configs shipped in ``recipes/configs``), runs the job stock,
patches it with mpsboost, runs it again, and prints the patch report and the four records of
``mpsboost.bench`` for each variant: throughput of the whole job, device-synchronised time of the
operation the recipes change, correctness against the stock output (and a CPU fp32 reference where
the script names one), and memory peaks. ``--out DIR`` also writes them as JSON Lines.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

CONFIGS = Path(__file__).resolve().parent / "configs"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parser(description: str, *, default_model: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default=None,
                     help=f"hub id or local folder to load with from_pretrained (needs the weights), e.g. {default_model}")
    src.add_argument("--random-weights", choices=("tiny", "real"), default=None,
                     help="build the architecture from recipes/configs with random weights: 'tiny' runs in seconds "
                          "on a CPU (what CI runs), 'real' is the real size (needs the memory of the real model)")
    p.add_argument("--device", default=None, help="mps, cuda, cuda:1 or cpu (default: the best one present)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                   help="compute dtype (default: bfloat16 on an accelerator, float32 on the CPU)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats of the whole job (median reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs before timing")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="folder for the JSONL records (and nothing else)")
    p.add_argument("--fp8", choices=("rowwise", "tensorwise"), default=None,
                   help="also store the weights in fp8 (lossy, opt-in; see recipes/fp8_any.py)")
    p.add_argument("--plan", action="append", default=[], metavar="DEVICE:TORCH",
                   help="also print what patch() would do on another machine, e.g. mps:2.14.1 or cuda:9.0:2.11.0")
    return p


def print_plans(obj: Any, plans: list[str], fp8: str | None = None) -> None:
    """``--plan mps:2.14.1``: the dry run of mpsboost.plan for a simulated environment."""
    import mpsboost

    for spec in plans:
        device, _, version = spec.rpartition(":")
        if not device or not version:
            raise SystemExit(f"--plan {spec!r}: write DEVICE:TORCH_VERSION, e.g. mps:2.14.1 or cuda:9.0:2.11.0")
        print(mpsboost.plan(obj, device=device, torch_version=version, fp8=fp8))
        print()


class default_dtype:
    """Create parameters directly in ``dtype`` (a real-size model is never materialised in fp32)."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def __enter__(self):
        self.old = torch.get_default_dtype()
        if self.dtype.is_floating_point:
            torch.set_default_dtype(self.dtype)
        return self

    def __exit__(self, *exc):
        torch.set_default_dtype(self.old)
        return False


def resolve(args: argparse.Namespace) -> tuple[str, torch.dtype]:
    """The device and dtype of the run; defaults to ``--random-weights tiny`` when no source is given."""
    if args.model is None and args.random_weights is None:
        args.random_weights = "tiny"
    device = args.device
    if device is None:
        device = "mps" if torch.backends.mps.is_available() else "cuda" if torch.cuda.is_available() else "cpu"
    kind = torch.device(device).type
    if kind == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {device}: torch sees no CUDA device here; use --device cpu or mps")
    if kind == "mps" and not torch.backends.mps.is_available():
        raise SystemExit(f"--device {device}: torch sees no MPS device here; use --device cpu or cuda")
    dtype = DTYPES[args.dtype] if args.dtype else (torch.float32 if kind == "cpu" else torch.bfloat16)
    if args.repeats < 1 or args.warmup < 0:
        raise SystemExit("--repeats must be >= 1 and --warmup >= 0")
    return device, dtype


def config(*parts: str) -> dict:
    """A shipped config: ``config("wan22_ti2v", "tiny", "vae.json")``."""
    path = CONFIGS.joinpath(*parts)
    if not path.is_file():
        raise SystemExit(f"missing shipped config {path}; the recipes/ folder is incomplete")
    data = json.loads(path.read_text())
    return {k: v for k, v in data.items() if not k.startswith("_")}


def seeded(seed: int) -> None:
    torch.manual_seed(seed)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# ------------------------------------------------------------------------------------ measuring

@dataclass
class Measured:
    """What one variant (stock or mpsboost) produced: output, the four record sections, extras."""

    variant: str
    output: torch.Tensor
    throughput: Any
    op_time: dict
    memory: Any
    extra: dict = field(default_factory=dict)


def measure(variant: str, job: Callable[[], torch.Tensor], *, device: str, repeats: int, warmup: int,
            items_per_call: float | None, unit: str, ops: dict[str, Callable[[], Any]] | None = None,
            op_repeats: int = 5) -> Measured:
    """Run ``job`` for throughput, ``ops`` for operator time, then once more for memory peaks.

    The passes are separate (memory sampling must not slow the timed runs). ``job`` returns the output
    tensor; the output of the memory pass is the one compared for correctness.
    """
    from mpsboost.bench import measure_memory, time_fn

    with torch.no_grad():
        timing = time_fn(job, device=device, warmup=warmup, repeats=repeats)
        throughput = timing.throughput(items_per_call, unit) if items_per_call else timing.throughput(unit="s/call")
        op_time = {}
        for name, fn in (ops or {}).items():
            op_time[name] = time_fn(fn, device=device, warmup=1, repeats=op_repeats).op_time()
        with measure_memory(device) as probe:
            out = job()
    return Measured(variant, out.detach().float().cpu(), throughput, op_time, probe.peaks())


def records(workload_name: str, shape: dict, device: str, dtype: torch.dtype, stock: Measured, patched: Measured,
            *, reference: tuple[str, torch.Tensor] | None = None, data_range: float | None = None,
            psnr: bool = True, extra: dict | None = None) -> list:
    """Two records (stock, mpsboost) of one workload; correctness of each against the named reference.

    Without ``reference`` the mpsboost output is compared with the stock output (the stock record then
    has no correctness section: it is the reference).
    """
    from mpsboost.bench import Record, RecordEnv, Workload, correctness

    env = RecordEnv.capture(device, dtype)
    work = Workload(workload_name, shape)
    out = []
    for m in (stock, patched):
        if reference is not None:
            corr = correctness(m.output, reference[1], reference=reference[0], data_range=data_range, psnr_too=psnr)
        elif m is patched:
            corr = correctness(m.output, stock.output, reference="stock", data_range=data_range, psnr_too=psnr)
        else:
            corr = None
        out.append(Record(workload=work, variant=m.variant, env=env, throughput=m.throughput, op_time=m.op_time or None,
                          correctness=corr, memory=m.memory, extra={**(extra or {}), **m.extra}))
    return out


def finish(name: str, args: argparse.Namespace, report: Any, recs: list) -> int:
    """Print the patch report and the records side by side; write JSONL under ``--out``."""
    from mpsboost.bench import compare_table, write_jsonl

    print(report)
    print()
    print(compare_table(recs))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = write_jsonl(args.out / f"{name}.jsonl", recs)
        print(f"\nrecords written to {path}")
    return 0


def timed(label: str):
    """A tiny context timer for the log lines a long real-size build prints."""

    class _T:
        def __enter__(self):
            self.t0 = time.perf_counter()
            return self

        def __exit__(self, *exc):
            print(f"{label}: {time.perf_counter() - self.t0:.1f} s", file=sys.stderr)
            return False

    return _T()
