"""What every cookbook script shares: arguments, configs, stock-vs-patched measurement, the records.

A cookbook script builds its pipeline or model (``--model`` from the hub or a local folder, or
``--random-weights tiny|real`` from the configs shipped with mpsboost, :mod:`mpsboost.bench.models`), runs
the job stock, patches it with mpsboost, runs it again, and prints the patch report and the four records
of ``mpsboost.bench`` for each variant: throughput of the whole job, device-synchronised time of the
operation the recipes change, correctness against the stock output (and a CPU fp32 reference where
the script names one), and memory peaks. ``--out DIR`` also writes them as JSON Lines.

What is measured and how (warm-up, repeats, synchronisation, the memory pass, the busy-machine check) is
:mod:`mpsboost.bench.harness`, the loop ``mpsboost demo``, ``mpsboost selftest`` and the benchmarks use too.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # annotations only: --help answers before torch loads
    import torch

from mpsboost.bench.harness import best_device, machine_load

# The shipped configs and the dtype helpers are the package's (mpsboost.bench.models), the ones the
# benchmarks and the selftest read; the scripts name them as C.config, C.default_dtype, C.dtype_name.
from mpsboost.bench.models import config, default_dtype, dtype_name, read_config  # noqa: F401

# The load average when the script started: a busy machine makes every speed ratio meaningless.
LOAD_AT_START = machine_load()
# --dtype choices by name: the torch dtypes are looked up after the arguments are read (resolve).
DTYPES = ("float32", "bfloat16", "float16")


class _EmptyFp32ListFilter(logging.Filter):
    """Drop diffusers' "should be kept in float32: []" warning: ``ModelMixin.to(dtype=...)`` prints it for
    every model whose list of fp32 modules is empty, i.e. when there is nothing to keep in fp32."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "should be kept in float32: []" not in record.getMessage()


logging.getLogger("diffusers.models.modeling_utils").addFilter(_EmptyFp32ListFilter())


def parser(description: str, *, default_model: str, benchmarks: tuple[str, ...] = ()) -> argparse.ArgumentParser:
    """The options every recipe script takes. ``benchmarks``: the recipe-level benchmarks of this job
    (names of ``mpsboost bench``), run after it by ``--bench``."""
    # Each default is said once, in its help text (ArgumentDefaultsHelpFormatter would add a second).
    p = argparse.ArgumentParser(description=description)
    p.set_defaults(benchmarks=benchmarks)
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--model",
        default=None,
        help=f"hub id or local folder to load with from_pretrained (needs the weights), e.g. {default_model}",
    )
    src.add_argument(
        "--random-weights",
        choices=("tiny", "real"),
        default=None,
        help="build the architecture from mpsboost's shipped configs with random weights: 'tiny' runs in "
        "seconds "
        "on a CPU (what CI runs), 'real' is the real size (needs the memory of the real model)",
    )
    p.add_argument("--device", default=None, help="mps, cuda, cuda:1 or cpu (default: the best one present)")
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="compute dtype (default: bfloat16 on an accelerator, float32 on the CPU)",
    )
    p.add_argument("--repeats", type=int, default=3, help="timed repeats of the whole job (median reported; default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs before timing (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and inputs (default 0)")
    p.add_argument(
        "--out", type=Path, default=None, help="folder for the JSONL records (and nothing else; default: none written)"
    )
    p.add_argument(
        "--fp8",
        choices=("rowwise", "tensorwise"),
        default=None,
        help="also store the weights in fp8 (lossy, opt-in; see recipes/fp8_any.py)",
    )
    p.add_argument(
        "--plan",
        action="append",
        default=[],
        metavar="DEVICE:TORCH",
        help="also print what patch() would do on another machine, e.g. mps:2.14.1 or cuda:9.0:2.11.0",
    )
    if benchmarks:
        names = ", ".join(f"'mpsboost bench {b}'" for b in benchmarks)
        p.add_argument(
            "--bench",
            action="store_true",
            help=f"then run this job's recipe-level benchmark ({names}: stock against mpsboost and peers, four "
            "records each) on the same device, at the size of --random-weights (tiny; small with --model); "
            "its records and table go to --out (default ./bench-out)",
        )
    return p


def bench_size(args: argparse.Namespace) -> str:
    """The ``mpsboost bench --size`` that matches this run: tiny or real random weights, small with --model."""
    if args.random_weights is not None:
        return args.random_weights
    return "small" if args.model is not None else "tiny"


def run_benchmarks(args: argparse.Namespace, device: str) -> int:
    """``--bench``: each recipe-level benchmark of this job through ``mpsboost bench``; the first failure's status."""
    from mpsboost.bench.cli import main as bench_main

    out = str(args.out if args.out is not None else Path("bench-out"))
    for name in args.benchmarks:
        print(f"\nrecipe-level benchmark: mpsboost bench {name} --device {device} --size {bench_size(args)}")
        rc = bench_main([name, "--device", device, "--size", bench_size(args), "--out", out, "--no-plot"])
        if rc:
            return rc
    return 0


def print_plans(obj: Any, plans: list[str], fp8: str | None = None) -> None:
    """``--plan mps:2.14.1``: the dry run of mpsboost.plan for a simulated environment."""
    import mpsboost

    for spec in plans:
        device, _, version = spec.rpartition(":")
        if not device or not version:
            raise SystemExit(f"--plan {spec!r}: write DEVICE:TORCH_VERSION, e.g. mps:2.14.1 or cuda:9.0:2.11.0")
        print(mpsboost.plan(obj, device=device, torch_version=version, fp8=fp8))
        print()


def resolve(args: argparse.Namespace) -> tuple[str, torch.dtype]:
    """The device and dtype of the run; defaults to ``--random-weights tiny`` when no source is given."""
    import torch

    if args.model is None and args.random_weights is None:
        args.random_weights = "tiny"
    device = args.device
    if device is None:
        device = best_device()
    kind = torch.device(device).type
    from mpsboost.bench.cli import present_devices

    present = ", ".join(present_devices())
    if kind == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {device}: torch sees no CUDA device here; present here: {present}")
    if kind == "mps" and not torch.backends.mps.is_available():
        raise SystemExit(f"--device {device}: torch sees no MPS device here; present here: {present}")
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.float32 if kind == "cpu" else torch.bfloat16)
    if args.repeats < 1 or args.warmup < 0:
        raise SystemExit("--repeats must be >= 1 and --warmup >= 0")
    return device, dtype


def seeded(seed: int) -> None:
    import torch

    torch.manual_seed(seed)


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


def measure(
    variant: str,
    job: Callable[[], torch.Tensor],
    *,
    device: str,
    repeats: int,
    warmup: int,
    items_per_call: float | None,
    unit: str,
    ops: dict[str, Callable[[], Any]] | None = None,
    op_repeats: int = 5,
) -> Measured:
    """Run ``job`` for throughput, ``ops`` for operator time, then once more for memory peaks.

    The passes are separate (memory sampling must not slow the timed runs); :func:`mpsboost.bench.harness.measure_job`
    runs them. ``job`` returns the output tensor; the output of the memory pass is the one compared for correctness.
    """
    from mpsboost.bench.harness import measure_job

    m = measure_job(
        job,
        device=device,
        repeats=repeats,
        warmup=warmup,
        output="last",
        memory="last",
        ops=ops,
        op_warmup=1,
        op_repeats=op_repeats,
    )
    throughput = m.timing.throughput(items_per_call, unit) if items_per_call else m.timing.throughput(unit="s/call")
    op_time = {name: t.op_time() for name, t in m.op_timings.items()}
    return Measured(variant, m.output.detach().float().cpu(), throughput, op_time, m.memory)


def records(
    workload_name: str,
    shape: dict,
    device: str,
    dtype: torch.dtype,
    stock: Measured,
    patched: Measured,
    *,
    reference: tuple[str, torch.Tensor] | None = None,
    data_range: float | None = None,
    psnr: bool = True,
    extra: dict | None = None,
) -> list:
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
        out.append(
            Record(
                workload=work,
                variant=m.variant,
                env=env,
                throughput=m.throughput,
                op_time=m.op_time or None,
                correctness=corr,
                memory=m.memory,
                extra={**(extra or {}), **m.extra},
            )
        )
    return out


def finish(name: str, args: argparse.Namespace, report: Any, recs: list) -> int:
    """Print the patch report and the records side by side; write JSONL under ``--out``."""
    from mpsboost.bench import compare_table, write_jsonl
    from mpsboost.bench.harness import ratio_lines

    print(report)
    print()
    print(compare_table(recs))
    spread = ratio_lines(recs, load_before=LOAD_AT_START)
    if spread:
        print("speed ratios with their range over the repeats:")
        print("\n".join(spread))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = write_jsonl(args.out / f"{name}.jsonl", recs)
        print(f"\nrecords written to {path}")
    if getattr(args, "bench", False):
        device = recs[0].env.device_type if recs else (args.device or best_device())
        return run_benchmarks(args, device)
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
