"""Contributed Mac results: selftest files in ``benchmarks/results/mac/`` become ``docs/mac-results.md``.

    python benchmarks/mac_results.py            # validate every file, write docs/mac-results.md,
                                                # print decisions to revisit
    python benchmarks/mac_results.py --check    # exit 1 when the document is out of date or a file is rejected

Each file a Mac user sends (``mpsboost-selftest-mps-<torch>.jsonl``, written by ``mpsboost selftest``)
is checked with :func:`mpsboost.selftest.validate`; a rejected file is listed with why and left out of
the tables. The document shows one row per file: chip, macOS, memory, torch; each probe's verdict; each
workload's speed ratio (stock time / patched time, median and range over fresh processes). Probe and
workload names are read from the files, so a file from a newer mpsboost adds columns without a code
change here. Where a probe's verdict contradicts what the gate decides today for that torch version
and macOS, the decision to revisit is printed and listed in the document.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDER = ROOT / "benchmarks" / "results" / "mac"
OUT = ROOT / "docs" / "mac-results.md"

__all__ = ["collect", "main", "render", "revisit_all"]


def collect(folder: Path) -> tuple[list[dict], list[tuple[str, str]]]:
    """Valid files as ``{"file", "summary", "lines"}`` (sorted by chip, torch, file) and rejected ones as
    (file, why)."""
    from mpsboost.selftest import SelftestFormatError, read_lines, validate

    good, bad = [], []
    for f in sorted(Path(folder).glob("*.jsonl")):
        try:
            summary = validate(f)
        except SelftestFormatError as e:
            bad.append((f.name, str(e).replace(str(f), f.name)))
            continue
        if summary["machine"]["device"] != "mps":  # a valid CPU or CUDA run is no evidence from a Mac
            bad.append(
                (f.name, f"a selftest on {summary['machine']['device']}, not on MPS; this table shows Mac runs only")
            )
            continue
        good.append({"file": f.name, "summary": summary, "lines": read_lines(f)})
    good.sort(key=lambda e: (e["summary"]["machine"]["chip"], e["summary"]["machine"]["torch"], e["file"]))
    return good, bad


def _gate_today(machine: dict) -> dict[str, bool]:
    """The gate's decision for every feature on this file's torch and macOS, as mpsboost decides today."""
    from mpsboost.errors import GateError
    from mpsboost.gate import FEATURES, Env, check

    try:
        env = Env.simulate("mps", machine["torch"].split(" ")[0], macos=machine.get("macos") or None)
    except GateError:
        return {}
    return {name: check(name, env).ok for name in FEATURES}


def revisit_all(entries: Sequence[dict]) -> list[str]:
    """Every decision a contributed file's probes contradict, with the file named."""
    from mpsboost.selftest import revisit

    out = []
    for e in entries:
        today = _gate_today(e["summary"]["machine"])
        probes = [x for x in e["lines"] if x["kind"] == "probe"]
        out += [f"{e['file']}: {line}" for line in revisit(probes, today)]
        # The gate's own probes on that Mac (torch.mps.Stream, float8 on MPS, ...) against the version rule alone.
        for g in e["lines"]:
            if (
                g["kind"] == "gate"
                and g.get("decided_by") == "probed"
                and g["feature"] in today
                and today[g["feature"]] != g["ok"]
            ):
                says = "available" if today[g["feature"]] else "unavailable"
                out.append(
                    f"{e['file']}: revisit gate feature {g['feature']!r}: by version it is {says} for torch "
                    f"{e['summary']['machine']['torch']}, "
                    f"the build's probe found it {'present' if g['ok'] else 'absent'}"
                )
    return out


def _ordered(entries: Sequence[dict], kind: str) -> list[str]:
    from mpsboost.selftest import PROBES, SEED_WORKLOADS

    known = list(PROBES) if kind == "probe" else list(SEED_WORKLOADS)
    seen = {x["name"] for e in entries for x in e["lines"] if x["kind"] == kind}
    return [n for n in known if n in seen] + sorted(seen - set(known))


def _how_to() -> list[str]:
    from mpsboost.selftest import issue_tracker

    return [
        "## How to add a row",
        "",
        (
            "1. On an Apple-silicon Mac, in a checkout of the repository: "
            '`python -m pip install -e ".[diffusers,transformers]"`, then `mpsboost selftest` '
            "(it stops at its 480 s budget; `--full` for the upstream sizes, 1800 s), then "
            "`mpsboost selftest --validate FILE`. "
            "It writes `mpsboost-selftest-mps-<torch>.jsonl` and a `.md` report."
        ),
        (
            f"2. Open an issue at {issue_tracker()}, paste the `.md` report and attach the `.jsonl`. "
            "The file holds machine facts and measurements only, no personal data."
        ),
        (
            "3. A maintainer checks it (`mpsboost selftest --validate FILE`), copies it into `benchmarks/results/mac/` "
            "and runs `python benchmarks/mac_results.py`, which regenerates this page."
        ),
        "",
    ]


def render(entries: Sequence[dict], rejected: Sequence[tuple[str, str]] = ()) -> str:
    """The markdown document for ``docs/mac-results.md``."""
    from mpsboost.selftest import decisions
    from mpsboost.selftest.report import fmt_ratio

    out = [
        "# Contributed Mac results",
        "",
        (
            "Generated by `benchmarks/mac_results.py` from the selftest files in `benchmarks/results/mac/`; "
            "do not edit by hand."
        ),
        (
            "Every other figure in this project was measured on an NVIDIA H200 or simulated: "
            "these rows are the evidence from Macs."
        ),
        "",
    ]
    if not entries:
        out += [
            "**No results yet.** No Mac has sent a selftest file so far: the tables below fill in from the first one.",
            "",
        ]
        out += _how_to()
    else:
        out += [
            "## Machines",
            "",
            "| # | chip | memory | macOS | torch | mpsboost | size | processes | date | file |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for i, e in enumerate(entries, 1):
            m, head = e["summary"]["machine"], e["lines"][0]
            mem = f"{m['memory_bytes'] / 2**30:.0f} GB" if m.get("memory_bytes") else "-"
            out.append(
                f"| {i} | {m['chip']} | {mem} | {m.get('macos') or '-'} | {m['torch']} | {m['mpsboost']} "
                f"| {head.get('size', '-')} "
                f"| {head.get('processes', '-')} | {head.get('date', '-')} | `{e['file']}` |"
            )
        probes = _ordered(entries, "probe")
        out += [
            "",
            "## Bug probes (stock torch against the CPU, at the trigger size)",
            "",
            "| # | " + " | ".join(probes) + " |",
            "|---|" + "---|" * len(probes),
        ]
        for i, e in enumerate(entries, 1):
            verdicts = {x["name"]: x["verdict"] for x in e["lines"] if x["kind"] == "probe"}
            out.append(f"| {i} | " + " | ".join(verdicts.get(p, "-") for p in probes) + " |")
        workloads = _ordered(entries, "workload")
        out += [
            "",
            "## Workloads (stock time / patched time; median, range over fresh processes)",
            "",
            "| # | " + " | ".join(workloads) + " |",
            "|---|" + "---|" * len(workloads),
        ]
        for i, e in enumerate(entries, 1):
            cells = []
            by = {x["name"]: x for x in e["lines"] if x["kind"] == "workload"}
            for w in workloads:
                x = by.get(w)
                if x is None:
                    cells.append("-")
                elif x["status"] in ("pass", "fail"):
                    cells.append(fmt_ratio(x.get("ratio")) + ("" if x["status"] == "pass" else " **fail**"))
                else:
                    cells.append(x["status"])
            out.append(f"| {i} | " + " | ".join(cells) + " |")
        todo = revisit_all(entries)
        out += ["", "## Decisions to revisit", ""] + (
            [f"- {t}" for t in todo] if todo else ["- none: every probe agrees with the gate"]
        )
        out += [""] + _how_to()
    if rejected:
        out += ["## Files left out", ""] + [f"- `{f}`: {why}" for f, why in rejected] + [""]
    out += [
        "## The decisions a selftest would overturn",
        "",
        (
            'For each MPS decision of the gate: the selftest probe whose verdict confirms ("fixed") or refutes '
            '("has the bug") it, and whether the gate probes the build itself.'
        ),
        "",
        "| gate feature | selftest probe | gate probes the build | upstream |",
        "|---|---|---|---|",
    ]
    for d in decisions():
        out.append(
            f"| {d['feature']} | {', '.join(d['selftest_probes']) or 'none yet'} "
            f"| {'yes' if d['gate_probe'] else 'no'} "
            f"| {d['upstream'] or '-'} |"
        )
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Render contributed Mac selftest files into docs/mac-results.md.")
    p.add_argument(
        "--folder", type=Path, default=FOLDER, help="folder of selftest .jsonl files (default benchmarks/results/mac)"
    )
    p.add_argument("--out", type=Path, default=OUT, help="the document to write (default docs/mac-results.md)")
    p.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if the document is stale or a file is rejected"
    )
    args = p.parse_args(argv)
    entries, rejected = collect(args.folder)
    text = render(entries, rejected)
    for f, why in rejected:
        print(f"rejected {f}: {why}", file=sys.stderr)
    for line in revisit_all(entries):
        print(line)
    if args.check:
        current = args.out.read_text(encoding="utf-8") if args.out.is_file() else ""
        stale = current != text
        if stale:
            print(f"{args.out} is out of date; run python benchmarks/mac_results.py", file=sys.stderr)
        return 1 if stale or rejected else 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {args.out} ({len(entries)} file(s), {len(rejected)} rejected)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
