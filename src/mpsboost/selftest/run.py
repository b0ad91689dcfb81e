"""Running the selftest: refuse an absent device, probe, measure, repeat in fresh processes, write the files."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .report import NOT_EVIDENCE, SCHEMA, SelftestFormatError, markdown, validate

__all__ = ["BUDGET_S", "PROCESSES", "DeviceAbsentError", "build_parser", "main", "run_selftest"]

# Fresh processes per size: MPSGraph picks a 2-3x slower GEMM kernel in about 40% of fresh processes
# (pytorch#182815), so one process is one draw; three show a spread, five estimate it.
PROCESSES = {"test": 1, "quick": 3, "full": 5}
REPEATS = {"test": 1, "quick": 3, "full": 5}
# Seconds, checked before each probe, each step of a workload and each recipe check (what does not fit is
# skipped, saying so). No Mac run has been timed yet.
BUDGET_S = {"test": 600.0, "quick": 480.0, "full": 1800.0}
CPU_BUDGET_S = 200.0
_CHILD_MARK = "MPSBOOST-SELFTEST-CHILD "


class DeviceAbsentError(SelftestFormatError):
    """The device asked for is not present: the selftest refuses before writing anything."""


def _file_stem(device: str, torch_version: str) -> str:
    return f"mpsboost-selftest-{device}-" + re.sub(r"[^A-Za-z0-9.+_-]", "_", torch_version)


def _gate_lines(device: str) -> list[dict]:
    from ..gate import FEATURES, Env, check

    env = Env.detect(device)
    out = []
    for name, feat in FEATURES.items():
        v = check(name, env)
        out.append(
            {
                "kind": "gate",
                "feature": name,
                "ok": v.ok,
                "decided_by": v.decided_by,
                "reason": v.reason,
                "probe": feat.probe is not None,
            }
        )
    return out


def _ratio(stock: list[float], patched: list[float]) -> dict:
    ratios = [s / p for s, p in zip(stock, patched) if p and p > 0]
    if not ratios:
        return {"median": None, "processes": 0}
    med = statistics.median(ratios)
    return {
        "median": med,
        "min": min(ratios),
        "max": max(ratios),
        "spread": (max(ratios) - min(ratios)) / med if med else None,
        "per_process": ratios,
        "processes": len(ratios),
    }


def _child_cmd(device: str, size: str, names: Sequence[str], repeats: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "mpsboost.selftest",
        "--child",
        "--device",
        device,
        "--size",
        size,
        "--repeats",
        str(repeats),
        "--workloads",
        ",".join(names) if names else "-",
    ]


def _run_child(cmd: list[str], timeout: float) -> dict | str:
    """One fresh process's timings, or why there are none."""
    try:
        out = subprocess.run(
            cmd, capture_output=True, text=True, timeout=max(1.0, timeout), check=False, env=dict(os.environ)
        )
    except subprocess.TimeoutExpired:
        return f"killed after {timeout:.0f} s (time budget)"
    for line in out.stdout.splitlines():
        if line.startswith(_CHILD_MARK):
            return json.loads(line[len(_CHILD_MARK) :])
    tail = (out.stderr.strip().splitlines() or ["no output"])[-1][:300]
    return f"exit status {out.returncode}: {tail}"


def child_main(device: str, size: str, names: Sequence[str], repeats: int) -> int:
    """A fresh process: the GEMM sample and each workload's stock and patched seconds, as one JSON line."""
    from .probes import gemm_sample
    from .workloads import SEED_WORKLOADS, time_workload

    res: dict[str, Any] = {"gemm_s": gemm_sample(device, size == "test"), "workloads": {}}
    for name in names:
        try:
            res["workloads"][name] = time_workload(SEED_WORKLOADS[name], device, size, repeats)
        except Exception as e:  # noqa: BLE001 - one workload's failure in a repeat is reported in the parent, not fatal
            res["workloads"][name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    print(_CHILD_MARK + json.dumps(res), flush=True)
    return 0


def run_selftest(
    device: str | None = None,
    *,
    size: str = "quick",
    processes: int | None = None,
    repeats: int | None = None,
    budget_s: float | None = None,
    out_dir: str | Path = ".",
    probes: Sequence[str] | None = None,
    workloads: Sequence[str] | None = None,
    recipes: Sequence[str] | None = None,
    dtype: str = "float32",
    command: str = "mpsboost selftest",
    echo: Callable[[str], None] = print,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[list[dict], Path, Path]:
    """Run the selftest; returns its lines and the paths of the JSONL and markdown files.

    ``probes`` / ``workloads`` / ``recipes``: only these (an empty list: none of that section; None: all).
    Raises :class:`DeviceAbsentError` (nothing written) when ``device`` is not present. The budget is
    checked on ``clock`` before each probe, each step of a workload, each fresh process and each recipe
    check; what does not fit is recorded as skipped.
    """
    from ..bench.harness import frozen_heap
    from .probes import PROBES, gemm_sample, gemm_verdict, run_probes
    from .workloads import SEED_WORKLOADS

    device = _checked_request(device, size, dtype, probes, workloads, recipes)
    with frozen_heap():  # each probe's and workload's release collects what the run made, not the libraries
        processes, repeats, budget_s = _settings(device, size, processes, repeats, budget_s)
        small = size == "test" or device == "cpu"
        # On the CPU the run is no evidence and the quick and full sizes would take many minutes: the
        # workloads run at their test size there, as the probes do (``small``).
        wl_size = "test" if device == "cpu" else size
        t0 = clock()
        deadline = t0 + budget_s
        echo(f"mpsboost selftest on {device} (size {size}, {processes} process(es), budget {budget_s:.0f} s)")
        if device != "mps":
            echo(NOT_EVIDENCE.format(device=device))
        if wl_size != size:
            echo(
                f"  on the cpu the probes and workloads run at their test size (tiny models), not {size}, "
                "in one process"
            )
        lines: list[dict] = _gate_lines(device)
        chosen_probes = tuple(PROBES) if probes is None else tuple(probes)
        probe_lines = (
            run_probes(device, small, deadline=deadline, only=chosen_probes, echo=echo, clock=clock)
            if chosen_probes
            else []
        )
        names = list(SEED_WORKLOADS) if workloads is None else list(workloads)
        wl_lines = [
            _one_workload(name, device, wl_size, repeats, deadline, t0, budget_s, echo, clock) for name in names
        ]
        # Repeats in fresh processes: the timings only (no reference, no memory), each in a new interpreter.
        gemm = [gemm_sample(device, small)] if "gemm_fresh_process" in chosen_probes else []
        child_notes = _repeat_in_fresh_processes(
            device, wl_size, wl_lines, gemm, processes, repeats, deadline, echo, clock
        )
        for w in wl_lines:
            if w["status"] in ("pass", "fail"):
                w["ratio"] = _ratio(w["stock"]["seconds"], w["patched"]["seconds"])
            elif "stock" in w:
                w["ratio"] = None
        if gemm:
            for p in probe_lines:
                if p["name"] == "gemm_fresh_process":
                    p.update(gemm_verdict(gemm, device))
        lines += probe_lines + wl_lines
        if recipes is None or recipes:
            lines += _recipe_lines(device, dtype, recipes, repeats, deadline, echo, clock, covered=_covered(wl_lines))
        head = {
            "kind": "selftest",
            "schema": SCHEMA,
            "machine": None,  # filled below, once the run is over
            "size": size,
            "workload_size": wl_size,
            "processes": processes,
            "repeats": repeats,
            "budget_s": budget_s,
            "duration_s": round(clock() - t0, 1),
            "evidence": device == "mps",
            "date": _dt.date.today().isoformat(),
            "command": command,
            "process_notes": child_notes,
        }
        return _write([head] + lines, device, out_dir, echo)


def _checked_request(
    device: str | None,
    size: str,
    dtype: str,
    probes: Sequence[str] | None,
    workloads: Sequence[str] | None,
    recipes: Sequence[str] | None,
) -> str:
    """The device to run on (the best present where None), after every argument is checked: nothing runs or is
    written on a bad one."""
    from ..registry import all_recipes
    from .machine import device_absent
    from .probes import PROBES
    from .recipe_checks import DTYPES
    from .workloads import SEED_WORKLOADS, SIZES

    if size not in SIZES:
        raise ValueError(f"size {size!r} is not accepted; pass one of {', '.join(SIZES)}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not accepted; pass one of {', '.join(DTYPES)}")
    if device is None:
        from ..bench.harness import best_device

        device = best_device()
    why = device_absent(device)
    if why:
        raise DeviceAbsentError(f"--device {device}: {why}; nothing was run or written")
    for label, chosen, known in (("probe", probes, PROBES), ("workload", workloads, SEED_WORKLOADS)):
        unknown = sorted(set(chosen or ()) - set(known))
        if unknown:
            raise ValueError(f"unknown {label}(s) {unknown}; known: {', '.join(known)}")
    known_recipes = {r.name: r for r in all_recipes()}
    unknown = sorted(set(recipes or ()) - set(known_recipes))
    if unknown:
        raise ValueError(f"unknown recipe(s) {unknown}; known: {', '.join(sorted(known_recipes))}")
    return device


def _settings(
    device: str, size: str, processes: int | None, repeats: int | None, budget_s: float | None
) -> tuple[int, int, float]:
    """``(processes, repeats, budget_s)``: those given, else the size's (on the CPU: one process, one repeat, a
    budget that ends the run within four minutes on two busy cores)."""
    # Fresh processes show MPS's per-process GEMM kernel choice (pytorch#182815); on the CPU one is enough.
    processes = (1 if device == "cpu" else PROCESSES[size]) if processes is None else processes
    # On the CPU the run is no evidence (tiny models, one process): one timed repeat, and a budget that
    # ends it within four minutes on two busy cores.
    repeats = (1 if device == "cpu" else REPEATS[size]) if repeats is None else repeats
    budget_s = (
        (min(BUDGET_S[size], CPU_BUDGET_S) if device == "cpu" else BUDGET_S[size]) if budget_s is None else budget_s
    )
    if processes < 1 or repeats < 1 or budget_s <= 0:
        raise ValueError(
            f"processes ({processes}) and repeats ({repeats}) must be at least 1 and the budget ({budget_s}) positive"
        )
    return processes, repeats, budget_s


def _one_workload(
    name: str,
    device: str,
    wl_size: str,
    repeats: int,
    deadline: float,
    t0: float,
    budget_s: float,
    echo: Callable[[str], None],
    clock: Callable[[], float],
) -> dict:
    """One seed workload's line: run, skipped (the budget) or an error (a finding, not the end of the run)."""
    from .workloads import SEED_WORKLOADS, BudgetSpent, run_workload

    skipped = {"kind": "workload", "name": name, "what": SEED_WORKLOADS[name].what, "size": wl_size}
    if clock() > deadline:
        rec = dict(skipped, status="skipped", reason="time budget spent")
    else:
        echo(f"  workload {name}: started ({clock() - t0:.0f} s of {budget_s:.0f} s)")
        try:
            rec = run_workload(
                SEED_WORKLOADS[name], device, wl_size, repeats, deadline=deadline, clock=clock, progress=echo
            )
        except BudgetSpent as e:
            rec = dict(skipped, status="skipped", reason=str(e))
        except Exception as e:  # noqa: BLE001 - one workload's failure is a finding, not the end of the run
            first = (str(e).strip().splitlines() or [""])[0][:300]
            rec = dict(skipped, status="error", reason=f"{type(e).__name__}: {first}")
    echo(f"  workload {name}: {rec['status']} ({rec.get('seconds', 0):.1f} s)")
    return rec


def _repeat_in_fresh_processes(
    device: str,
    wl_size: str,
    wl_lines: list[dict],
    gemm: list,
    processes: int,
    repeats: int,
    deadline: float,
    echo: Callable[[str], None],
    clock: Callable[[], float],
) -> list[str]:
    """Processes 2..``processes``: each a new interpreter timing the workloads that ran (and the GEMM sample),
    their seconds appended to ``wl_lines`` and ``gemm``; returns the notes of those that did not run."""
    ran = [w["name"] for w in wl_lines if w["status"] in ("pass", "fail")]
    child_notes = []
    for i in range(1, processes):
        left = deadline - clock()
        if left <= 5:
            child_notes.append(f"process {i + 1}: not started (time budget spent)")
            continue
        got = _run_child(_child_cmd(device, wl_size, ran, repeats), left)
        if isinstance(got, str):
            child_notes.append(f"process {i + 1}: {got}")
            continue
        if gemm:
            gemm.append(got["gemm_s"])
        for w in wl_lines:
            t = got["workloads"].get(w["name"])
            if t and "error" not in t and t.get("patched_s") and t.get("stock_s") and w["status"] in ("pass", "fail"):
                w["stock"]["seconds"].append(t["stock_s"])
                w["patched"]["seconds"].append(t["patched_s"])
            elif t and "error" in t:
                w.setdefault("repeat_errors", []).append(t["error"])
        echo(f"  process {i + 1}: timed {len(got['workloads'])} workload(s)")
    return child_notes


def _write(lines: list[dict], device: str, out_dir: str | Path, echo: Callable[[str], None]) -> tuple:
    """The machine's facts into the head line, every local path scrubbed, then the JSONL and the markdown."""
    import torch

    from .machine import facts, scrub_all

    lines[0]["machine"] = facts(device)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lines = scrub_all(lines, (str(out.resolve()),))
    stem = _file_stem(device, torch.__version__)
    jsonl, md = out / f"{stem}.jsonl", out / f"{stem}.md"
    jsonl.write_text("".join(json.dumps(x, default=str) + "\n" for x in lines), encoding="utf-8")
    md.write_text(markdown(lines, jsonl.name), encoding="utf-8")
    send = "paste the .md into an issue and attach the .jsonl" if device == "mps" else "not evidence: do not send them"
    echo(f"\nwrote {jsonl.name} and {md.name} in {out}; {send}")
    return lines, jsonl, md


def _covered(wl_lines: Sequence[dict]) -> dict[str, list[str]]:
    """recipe -> the workloads of this run whose patched model it applied to, each with its status."""
    out: dict[str, list[str]] = {}
    for w in wl_lines:
        for r in w.get("recipes") or ():
            out.setdefault(r, []).append(f"{w['name']} ({w['status']})")
    return out


def _recipe_lines(
    device: str,
    dtype: str,
    names: Sequence[str] | None,
    repeats: int,
    deadline: float,
    echo: Callable[[str], None],
    clock: Callable[[], float] = time.perf_counter,
    covered: dict[str, list[str]] | None = None,
) -> list[dict]:
    """One line per recipe check; a recipe without a tiny check of its own names the workloads of this run
    that exercised it (``covered``, from :func:`_covered`)."""
    from ..bench import Record, RecordEnv
    from ..bench import Workload as BenchWorkload
    from ..gate import Env
    from ..registry import all_recipes
    from .recipe_checks import KIND, RecipeResult, check_recipe

    env = Env.detect(device)
    known = {r.name: r for r in all_recipes()}
    chosen = [known[n] for n in names] if names else list(known.values())
    record_env = RecordEnv.capture(device, {"float32": "float32"}.get(dtype, dtype))
    out = []
    for recipe in chosen:
        t0 = clock()
        if clock() > deadline:
            res = RecipeResult(recipe.name, "error", "not run: time budget spent")
        else:
            try:
                res = check_recipe(recipe.name, recipe, device, dtype, repeats, env, record_env)
            except Exception as e:  # noqa: BLE001 - one recipe's failure is a finding, not the end of the run
                why = f"{type(e).__name__}: {e}"
                rec = Record(
                    BenchWorkload(f"{KIND}:{recipe.name}", {"dtype": dtype}),
                    "mpsboost",
                    record_env,
                    extra={KIND: {"recipe": recipe.name, "status": "error", "reason": why}},
                )
                res = RecipeResult(recipe.name, "error", why, records=[rec])
        if res.status == "no workload" and (covered or {}).get(recipe.name):
            res.reason = (
                f"no tiny check of its own; exercised by the workloads above: {', '.join(covered[recipe.name])}"
            )
        echo(
            f"  recipe {recipe.name}: {res.status}{' (' + res.reason + ')' if res.status == 'no workload' else ''} "
            f"({clock() - t0:.1f} s)"
        )
        out.append(
            {
                "kind": "recipe",
                "recipe": res.recipe,
                "status": res.status,
                "reason": res.reason,
                "workload": res.workload,
                "backing": res.backing,
                "speed_ratio": res.speed_ratio,
                "records": [r.to_dict() for r in res.records],
            }
        )
    return out


# ------------------------------------------------------------------------------------------ command line


def _names(text: str | None) -> list[str] | None:
    if text is None:
        return None
    return [] if text in ("", "-", "none") else [t for t in text.split(",") if t]


def build_parser(prog: str = "mpsboost selftest") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Evidence from this machine: the known MPS bugs probed at their trigger sizes, "
        "the seed's workloads "
        "stock against patched across fresh processes, each recipe's check; writes a JSONL and a markdown report to "
        "paste into an issue. No personal data is recorded.",
    )
    p.add_argument(
        "--device",
        choices=("mps", "cuda", "cpu"),
        help="default: mps, then cuda, then cpu; an absent device is refused (exit 2)",
    )
    size = p.add_mutually_exclusive_group()
    size.add_argument(
        "--quick",
        dest="size",
        action="store_const",
        const="quick",
        help="sizes that reach the triggers, within a 480 s budget (default)",
    )
    size.add_argument(
        "--full",
        dest="size",
        action="store_const",
        const="full",
        help="the sizes of the upstream reports, up to 30 minutes",
    )
    size.add_argument("--size", dest="size", choices=("test", "quick", "full"), help="test: tiny models (CI, seconds)")
    p.add_argument(
        "--processes", type=int, help="fresh processes that time the workloads (default: quick 3, full 5, test 1)"
    )
    p.add_argument("--repeats", type=int, help="timed repeats per variant in each process")
    p.add_argument(
        "--budget",
        type=float,
        help="seconds; what does not fit is recorded as skipped (default: quick 480, full 1800; 200 on the cpu)",
    )
    p.add_argument("--probes", help="comma-separated probe names (default all; '-' for none)")
    p.add_argument("--workloads", help="comma-separated workload names (default all; '-' for none)")
    p.add_argument(
        "--recipes", nargs="*", help="only these recipes' checks (default every recipe; give none for no checks)"
    )
    p.add_argument(
        "--dtype", choices=("float32", "bfloat16", "float16"), default="float32", help="dtype of the recipe checks"
    )
    p.add_argument("--out", default=".", help="folder for the JSONL and markdown files (default: here)")
    p.add_argument("--validate", metavar="JSONL", help="only check a selftest file and print its summary")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(size="quick")
    return p


def _command(argv: Sequence[str]) -> str:
    """The command line for the report, without the output folder (a path is personal data)."""
    words, skip = ["mpsboost", "selftest"], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--out":
            skip = True
            continue
        if not a.startswith("--out="):
            words.append(a)
    return " ".join(words)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.validate:
        summary = validate(args.validate, require_mps=True)
        print(json.dumps(summary, indent=2, default=str))
        return 0
    if args.child:
        return child_main(args.device, args.size, _names(args.workloads) or [], args.repeats or 1)
    for flag in ("processes", "repeats"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise SelftestFormatError(f"--{flag} must be at least 1, got {value}")
    lines, _, _ = run_selftest(
        args.device,
        size=args.size,
        processes=args.processes,
        repeats=args.repeats,
        budget_s=args.budget,
        out_dir=args.out,
        probes=_names(args.probes),
        workloads=_names(args.workloads),
        recipes=args.recipes,
        dtype=args.dtype,
        command=_command(argv),
    )
    bad = [x for x in lines if x.get("status") in ("fail", "error") or x.get("verdict") == "error"]
    return 1 if bad else 0
