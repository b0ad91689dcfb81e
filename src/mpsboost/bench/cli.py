"""``mpsboost bench NAME``: run ``benchmarks/NAME.py`` and write its records, table and chart.

    mpsboost bench wan_vae --device cuda --size real --out results/
    mpsboost bench --list
    mpsboost bench --table results/wan_vae.jsonl          # table and chart of records already written

A benchmark is an importable script ``benchmarks/NAME.py`` with ``run(device, size, out) ->
list[Record]``. It is found in ``--benchmarks-dir``, then ``$MPSBOOST_BENCHMARKS``, then
``./benchmarks``, then the ``benchmarks/`` folder of the checkout mpsboost is installed from.
The command writes ``OUT/NAME.jsonl``, ``OUT/NAME.txt`` (the comparison table, also printed) and
``OUT/NAME.png`` (the chart; needs matplotlib).

Scripts use :func:`script_main` for their own ``__main__`` so that ``python benchmarks/NAME.py
--device cuda --size real --out DIR`` behaves the same.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from .errors import BenchError, BenchmarkNotFoundError
from .harness import best_device
from .records import Record, read_jsonl, write_jsonl

__all__ = [
    "main",
    "script_main",
    "find_benchmark",
    "catalogue",
    "present_devices",
    "BENCHMARKS",
    "recipes_without_benchmark",
    "benchmark_dirs",
    "list_benchmarks",
    "best_device",
    "run_benchmark",
    "SIZES",
]

SIZES = ("tiny", "small", "real")
# What `mpsboost bench NAME` accepts: every recipe name, and the end-to-end matrix, mapped to the
# stem of its script in benchmarks/ (the script names are shorter than some recipe names).
BENCHMARKS = {
    "wan_vae_pad": "wan_vae",
    "qwen_image_vae": "qwen_image_vae",
    "moe_experts": "moe",
    "fp8_weights": "fp8",
    "decode_linear": "decode_linear",
    "softmax": "softmax",
    "mps_streams": "mps_streams",
    "linear_attention": "linear_attention",
    "e2e": "e2e",
}
NOT_SHIPPED = (
    "the benchmarks are not part of the installed package (a wheel has none): they are the benchmarks/ "
    "folder of mpsboost's source repository. Run `mpsboost bench NAME` inside a checkout of it, or point "
    "--benchmarks-dir or ${env} at that folder"
)
DEVICES = ("cuda", "mps", "cpu")
ENV_VAR = "MPSBOOST_BENCHMARKS"


def check_device(device: str) -> str:
    """``device`` if torch can use it here; a clear error otherwise."""
    import torch

    kind = device.split(":", 1)[0]
    if kind not in DEVICES:
        raise BenchError(f"device {device!r} is not supported; accepted: {', '.join(DEVICES)} (cuda:N for a given GPU)")
    present = present_devices()
    if kind == "cuda" and not torch.cuda.is_available():
        raise BenchError(
            f"--device {device} but torch {torch.__version__} sees no CUDA device; present here: {', '.join(present)}"
        )
    if kind == "mps" and not torch.backends.mps.is_available():
        raise BenchError(
            f"--device mps but torch {torch.__version__} sees no MPS device; present here: {', '.join(present)}"
        )
    return device


def present_devices() -> list[str]:
    """The device types torch can use here, best first, each once (``["cpu"]`` on a CPU-only machine)."""
    import torch

    out = [d for d, ok in (("mps", torch.backends.mps.is_available()), ("cuda", torch.cuda.is_available())) if ok]
    return out + ["cpu"]


def benchmark_dirs(explicit: str | os.PathLike | None = None) -> list[Path]:
    """The folders searched for benchmark scripts, in order (existing ones only, no duplicates)."""
    import mpsboost

    candidates: list[Path] = []
    if explicit is not None:
        candidates.append(Path(explicit))
    if os.environ.get(ENV_VAR):
        candidates.append(Path(os.environ[ENV_VAR]))
    candidates.append(Path.cwd() / "benchmarks")
    # An editable install or a source checkout: src/mpsboost/__init__.py -> <repo>/benchmarks
    candidates.append(Path(mpsboost.__file__).resolve().parents[2] / "benchmarks")
    out: list[Path] = []
    seen: set[Path] = set()
    for c in candidates:
        try:
            r = c.resolve()
        except OSError:
            continue
        if r.is_dir() and r not in seen:
            seen.add(r)
            out.append(r)
    return out


def list_benchmarks(explicit: str | os.PathLike | None = None) -> dict[str, Path]:
    """name -> script path of every benchmark found (first folder wins)."""
    found: dict[str, Path] = {}
    for d in benchmark_dirs(explicit):
        for p in sorted(d.glob("*.py")):
            if p.stem.startswith("_") or p.stem in found:
                continue
            found[p.stem] = p
    return found


def find_benchmark(name: str, explicit: str | os.PathLike | None = None) -> Path:
    """The script of benchmark ``name`` (a recipe name such as ``moe_experts``, ``e2e``, or a script
    stem such as ``moe``); :class:`BenchmarkNotFoundError` lists what exists and where."""
    if explicit is not None and not Path(explicit).is_dir():
        raise BenchmarkNotFoundError(f"--benchmarks-dir {explicit} is not a folder")
    if not name or "/" in name or "\\" in name or name.startswith((".", "_")):
        raise BenchmarkNotFoundError(
            f"{name!r} is not a benchmark name; give a recipe name such as moe_experts (see --list)"
        )
    name = name[:-3] if name.endswith(".py") else name
    stem = BENCHMARKS.get(name, name)
    found = list_benchmarks(explicit)
    if stem in found:
        return found[stem]
    missing = recipes_without_benchmark()
    if name in missing:
        # A recipe with no script: say so, rather than send the user looking for a file that never existed.
        raise BenchmarkNotFoundError(
            f"recipe {name} has no benchmark of its own ({missing[name]}). Benchmarks: "
            + ", ".join(n for n, _, p in catalogue(explicit) if p is not None)
        )
    dirs = benchmark_dirs(explicit)
    if not dirs:
        raise BenchmarkNotFoundError(f"no benchmark {name!r} here: " + NOT_SHIPPED.format(env="$" + ENV_VAR))
    known = ", ".join(n for n, _, _ in catalogue(explicit))
    script = f"{stem}.py" + (f" (the benchmark of {name})" if stem != name else "")
    raise BenchmarkNotFoundError(
        f"no benchmark named {name!r}: {script} is not in {', '.join(str(d) for d in dirs)}. Names: {known}. "
        f"Point --benchmarks-dir or ${ENV_VAR} at the folder holding {stem}.py."
    )


# Recipes with no benchmark script, and why (`mpsboost bench NAME` says so; `--list` names them apart).
_NO_BENCHMARK_WHY = {
    "metal_attention": "it routes attention to the Metal SDPA kernels, which only an MPS device runs; "
    "its numerics are covered by the tests and by `mpsboost selftest`",
    "attention_split": "it changes no speed, only correctness above 2^31 attention scores on MPS; "
    "covered by the tests and by `mpsboost selftest`",
    "video_vae_pad": "`mpsboost selftest` runs it (a HunyuanVideo VAE round trip); no separate script yet",
}


def recipes_without_benchmark() -> dict[str, str]:
    """{recipe name: why it has no script} for every registered recipe that ``BENCHMARKS`` does not map."""
    from ..registry import recipe_names

    return {n: _NO_BENCHMARK_WHY.get(n, "no benchmark script yet") for n in recipe_names() if n not in BENCHMARKS}


def catalogue(explicit: str | os.PathLike | None = None) -> list[tuple[str, str, Path | None]]:
    """(name to give, script stem, script path or None when absent here) for every known benchmark,
    then any other script found in the benchmark folders."""
    found = list_benchmarks(explicit)
    rows = [(name, stem, found.get(stem)) for name, stem in BENCHMARKS.items()]
    mapped = set(BENCHMARKS.values())
    rows += [(stem, stem, path) for stem, path in found.items() if stem not in mapped]
    return rows


def load_benchmark(path: Path) -> Any:
    """Import a benchmark script by path (its folder goes on sys.path so `import _common` works)."""
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    mod_name = f"mpsboost_benchmark_{path.stem}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise BenchmarkNotFoundError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    spec.loader.exec_module(module)
    if not callable(getattr(module, "run", None)):
        raise BenchError(f"{path} has no run(device, size, out) function; every benchmark script must define one")
    return module


def run_benchmark(
    name: str,
    run: Callable[[str, str, Path], Any],
    *,
    device: str,
    size: str,
    out: Path,
    plot: bool = True,
    echo: Callable[[str], None] = print,
) -> list[Record]:
    """Call ``run(device, size, out)``, then write ``out/NAME.jsonl``, ``.txt`` table and ``.png`` chart."""
    from .table import compare_table

    if size not in SIZES:
        raise BenchError(f"size {size!r} is not one of {', '.join(SIZES)}")
    check_device(device)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    from . import harness
    from .progressbar import activity

    load_before = harness.machine_load()  # the busy-machine check compares it, and the load after, with the cores
    with activity(f"{name} ({device}, {size})"):
        records = run(device, size, out)
    if records is None or isinstance(records, (str, bytes)) or not hasattr(records, "__iter__"):
        raise BenchError(f"benchmark {name}: run() returned {type(records).__name__}; it must return a list of Record")
    records = list(records)
    bad = [type(r).__name__ for r in records if not isinstance(r, Record)]
    if bad:
        raise BenchError(
            f"benchmark {name}: run() returned non-Record items ({', '.join(sorted(set(bad)))}); "
            "return mpsboost.bench.Record objects"
        )
    jsonl = write_jsonl(out / f"{name}.jsonl", records)
    table = compare_table(records)
    (out / f"{name}.txt").write_text(table, encoding="utf-8")
    echo(table)
    for line in harness.ratio_lines(records, load_before=load_before):  # each ratio's range; too busy: a warning
        echo(line)
    echo(f"records: {jsonl}")
    echo(f"table:   {out / f'{name}.txt'}")
    if plot and records:
        png = _plot_or_explain(records, out / f"{name}.png", echo)
        if png is not None:
            echo(f"chart:   {png}")
    return records


def _plot_or_explain(records: list[Record], path: Path, echo: Callable[[str], None]) -> Path | None:
    from .plot import plot

    try:
        return plot(records, path)
    except BenchError as exc:  # matplotlib missing: the records and table are what matters
        echo(f"chart:   skipped ({exc})")
        return None


def _parser(prog: str, *, with_name: bool) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Run a recipe benchmark: stock vs mpsboost vs peers, four separate records per variant "
        "(throughput, op time, correctness, memory), written as JSONL with a comparison table and a chart.",
    )
    if with_name:
        p.add_argument(
            "name",
            nargs="?",
            help="a recipe name (wan_vae_pad, moe_experts, fp8_weights, ...), e2e "
            "(the end-to-end matrix), or a script stem of benchmarks/ (see --list)",
        )
        p.add_argument("--list", action="store_true", help="list the benchmark names, and the script each runs")
        p.add_argument(
            "--benchmarks-dir",
            help=f"folder holding the benchmark scripts (default: ${ENV_VAR}, ./benchmarks, the source checkout)",
        )
        p.add_argument(
            "--table",
            metavar="JSONL",
            nargs="+",
            help="print the table (and chart into --out) of records already written, run nothing",
        )
    p.add_argument("--device", help=f"one of {', '.join(DEVICES)} (default: the best present: mps, cuda, cpu)")
    p.add_argument(
        "--size",
        default="small",
        choices=SIZES,
        help="workload size: tiny (seconds on a CPU), small, real (default: small)",
    )
    p.add_argument("--out", default=None, help="output folder (default: ./bench-out)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG chart")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``mpsboost bench``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser("mpsboost bench", with_name=True)
    args = parser.parse_args(argv)
    try:
        if args.list:
            dirs = benchmark_dirs(args.benchmarks_dir)
            rows = catalogue(args.benchmarks_dir)
            width = max(len(n) for n, _, _ in rows)
            for name, stem, path in rows:
                where = str(path) if path is not None else f"benchmarks/{stem}.py (not found here)"
                print(f"{name.ljust(width)}  {where}")
            missing = recipes_without_benchmark()
            if missing:
                print("\nrecipes without a benchmark: " + ", ".join(missing))
            if not dirs:
                print("\n" + NOT_SHIPPED.format(env="$" + ENV_VAR) + ".")
                return 1
            return 0
        out = Path(args.out or "bench-out")
        if args.table:
            from .table import compare_table

            records = [r for path in args.table for r in read_jsonl(path)]
            table = compare_table(records)
            print(table)
            if not args.no_plot and records and args.out:
                png = _plot_or_explain(records, out / (Path(args.table[0]).stem + ".png"), print)
                if png is not None:
                    print(f"chart:   {png}")
            return 0
        if not args.name:
            parser.print_usage(sys.stderr)
            print("mpsboost bench: give a benchmark NAME, --list or --table FILE.jsonl", file=sys.stderr)
            return 2
        path = find_benchmark(args.name, args.benchmarks_dir)
        module = load_benchmark(path)
        device = args.device or best_device()
        run_benchmark(path.stem, module.run, device=device, size=args.size, out=out, plot=not args.no_plot)
        return 0
    except BenchError as exc:
        print(f"mpsboost bench: {exc}", file=sys.stderr)
        return 2


def script_main(name_or_file: str, run: Callable[[str, str, Path], Any], argv: Sequence[str] | None = None) -> int:
    """The ``__main__`` of a benchmark script: ``python benchmarks/NAME.py --device --size --out``.

    if __name__ == "__main__":
        raise SystemExit(script_main(__file__, run))
    """
    name = Path(name_or_file).stem
    parser = _parser(f"python benchmarks/{name}.py", with_name=False)
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        run_benchmark(
            name,
            run,
            device=args.device or best_device(),
            size=args.size,
            out=Path(args.out or "bench-out"),
            plot=not args.no_plot,
        )
    except BenchError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 2
    return 0
