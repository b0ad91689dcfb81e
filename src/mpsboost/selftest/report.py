"""The selftest file: its lines, the markdown report to paste into an issue, and :func:`validate`.

A selftest JSONL file holds one JSON object per line, each with a ``kind``:

* ``selftest`` (first line): schema, machine facts, size, processes, budget, duration, date;
* ``gate``: the gate's verdict for every feature in this process, and whether a probe or the version rule decided;
* ``probe``: one bug probe (upstream numbers, gate feature, verdict, detail, measured values);
* ``workload``: one seed workload, stock against patched (seconds per process, memory peaks, quality,
  the ratio's median and spread across fresh processes);
* ``recipe``: one recipe's tiny correctness check (bench records of stock and patched).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from ..errors import MpsboostError
from .machine import REQUIRED_FACTS

__all__ = [
    "SCHEMA",
    "SelftestFormatError",
    "calibration",
    "fmt_ratio",
    "issue_tracker",
    "markdown",
    "revisit",
    "validate",
]

SCHEMA = 2
# The one line a run on a machine without MPS prints first; its report and --validate repeat it.
NOT_EVIDENCE = (
    "note: this is not an MPS device ({device}): the run checks mpsboost here, but its file is not evidence "
    "for the Mac results (only a run on an Apple-silicon Mac is); please do not send it"
)
KINDS = ("selftest", "gate", "probe", "workload", "recipe")
# Physical bounds of the cost model's constants that probe dispatch_cost measures (mpsboost.bench.decode_cost):
# (low, high, whether low itself is allowed). A dispatch under 0.1 us or over 200 us per call is a broken timer;
# eta is a share of the chip's peak bandwidth.
COST_BOUNDS = {"c_metal_us": (0.1, 200.0, True), "c_graph_us": (0.1, 200.0, True), "eta": (0.0, 1.0, False)}


class SelftestFormatError(MpsboostError, ValueError):
    """A selftest JSONL file that does not hold the expected lines; the message names file and line."""


@lru_cache(maxsize=1)
def _project() -> dict:
    from importlib.resources import files

    return json.loads(files("mpsboost").joinpath("data/project.json").read_text(encoding="utf-8"))


def issue_tracker() -> str:
    """Where users send selftest reports: the project's issue tracker, or its placeholder until it has one."""
    p = _project()
    return p.get("issues_url") or p["issues_placeholder"]


# ------------------------------------------------------------------------------------------ reading


def fmt_ratio(r: dict | None) -> str:
    if not r or r.get("median") is None:
        return "-"
    text = f"{r['median']:.2f}x"
    if r.get("processes", 1) > 1:
        text += f" ({r['min']:.2f}-{r['max']:.2f}, {r['processes']} processes)"
    return text


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.1f} GiB"


def revisit(probes: Sequence[dict], gate_ok: dict[str, bool]) -> list[str]:
    """The gate decisions a file's probes contradict, one line each."""
    from .probes import feature_ok

    out = []
    for p in probes:
        feature, measured = p.get("feature"), feature_ok(p.get("verdict", ""))
        if feature is None or measured is None or feature not in gate_ok or gate_ok[feature] == measured:
            continue
        believes = "available" if gate_ok[feature] else "unavailable"
        found = "this build free of the bug" if measured else "the bug in this build"
        out.append(
            f"revisit gate feature {feature!r}: the gate says {believes}, probe {p['name']} "
            f"({', '.join(p.get('upstream', []))}) found {found}"
        )
    return out


def markdown(lines: Sequence[dict], jsonl_name: str) -> str:
    """The report to paste into an issue."""
    head = lines[0]
    m = head["machine"]
    probes = [x for x in lines if x["kind"] == "probe"]
    workloads = [x for x in lines if x["kind"] == "workload"]
    recipes = [x for x in lines if x["kind"] == "recipe"]
    gates = [x for x in lines if x["kind"] == "gate"]
    mac = f"macOS {m['macos']}" if m.get("macos") else m["os"]
    send = (
        f"Send it: open an issue at {issue_tracker()}, paste this report and attach `{jsonl_name}`."
        if m["device"] == "mps"
        else f"**{NOT_EVIDENCE.format(device=m['device'])}**"
    )
    out = [
        f"## mpsboost selftest: {m['chip']}, {mac}, torch {m['torch']} on {m['device']}",
        "",
        send,
        "",
        (
            "**What the file contains**: the machine facts below (chip, OS version, memory size, torch build, Python, "
            "library versions), the gate's decisions, each bug probe's verdict and measurements, each workload's time, "
            "memory peaks and error (stock against mpsboost, across fresh processes), each recipe's check. "
            "**No personal data**: no user name, host name, path, IP address or serial number is recorded "
            "(error messages are scrubbed of them)."
        ),
        "",
        f"- mpsboost {m['mpsboost']}, torch {m['torch']} ({m['torch_build']}), python {m['python']}, "
        + ", ".join(f"{k} {v}" for k, v in m.get("libraries", {}).items() if v),
        f"- machine: {m['chip']}, {m['arch']}, {_gib(m.get('memory_bytes'))}, {mac}; device {m['device_name']}",
        (
            f"- run: `{head.get('command', 'mpsboost selftest')}` (size {head['size']}, {head['processes']} processes, "
            f"{head['duration_s']:.0f} s of a {head['budget_s']:.0f} s budget)"
        ),
        "",
        "### Bug probes (stock torch against the CPU)",
        "",
        "| probe | upstream | verdict | detail |",
        "|---|---|---|---|",
    ]
    out += [f"| {p['name']} | {', '.join(p['upstream'])} | **{p['verdict']}** | {p['detail']} |" for p in probes]
    out += [
        "",
        "### Workloads (stock against `mpsboost.patch`)",
        "",
        (
            "| workload | status | speed (stock / patched) | vs CPU (stock / patched) | tensor peak (stock / patched) "
            "| driver peak (stock / patched) | recipes |"
        ),
        "|---|---|---|---|---|---|---|",
    ]
    for w in workloads:
        q = "-"
        s_cpu, p_cpu = (w.get("stock") or {}).get("vs_cpu"), (w.get("patched") or {}).get("vs_cpu")
        if s_cpu:
            key = "psnr_db" if "psnr_db" in s_cpu else "rel_error"
            unit = " dB" if key == "psnr_db" else ""

            def cell(v, unit=unit):
                text = _num(v)
                return text if text in ("exact", "NaN") else text + unit

            q = cell(s_cpu.get(key)) + (f" / {cell(p_cpu.get(key))}" if p_cpu else "")
        mem = {}
        sm, pm = (w.get("stock") or {}).get("memory"), (w.get("patched") or {}).get("memory")
        for key in ("tensor_allocated", "driver_level"):
            mem[key] = "-" if not sm else _gib(sm.get(key)) + (f" / {_gib(pm.get(key))}" if pm else "")
        out.append(
            f"| {w['name']} | {w['status']} | {fmt_ratio(w.get('ratio'))} | {q} "
            f"| {mem['tensor_allocated']} | {mem['driver_level']} "
            f"| {', '.join(w.get('recipes', [])) or '-'} |"
        )
    notes = [f"- {w['name']}: {w['reason']}" for w in workloads if w.get("reason")]
    out += [""] + notes if notes else []
    if recipes:
        counts: dict[str, int] = {}
        for r in recipes:
            counts[r["status"]] = counts.get(r["status"], 0) + 1
        out += ["", "### Recipe checks (tiny models)", "", ", ".join(f"{n} {s}" for s, n in counts.items()), ""]
        out += [
            f"- {r['recipe']}: {r['status']}"
            + (f" ({r['reason']})" if r["status"] in ("fail", "error", "no workload") and r.get("reason") else "")
            for r in recipes
        ]
    decided = [g for g in gates if g.get("decided_by") == "probed"]
    if decided:
        out += ["", "### Gate decisions a probe of this build made", ""]
        out += [f"- {g['feature']}: {'yes' if g['ok'] else 'no'} [{g['decided_by']}] {g['reason']}" for g in decided]
    todo = revisit(probes, {g["feature"]: g["ok"] for g in gates})
    out += ["", "### Decisions to revisit", ""] + (
        [f"- {t}" for t in todo] if todo else ["- none: every probe agrees with the gate"]
    )
    return "\n".join(out) + "\n"


def _num(v: Any) -> str:
    if v is None:
        return "NaN"
    if v >= 999:  # an identical pair's PSNR (recorded as 999 dB: JSON has no infinity)
        return "exact"
    return f"{v:.1f}" if abs(v) >= 1 else f"{v:.1e}"


# ------------------------------------------------------------------------------------------ validation


def _positive(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 and math.isfinite(v)


def _check_machine(where: str, head: dict) -> dict:
    m = head.get("machine")
    if not isinstance(m, dict):
        raise SelftestFormatError(f"{where}: the first line has no machine facts")
    missing = [k for k in REQUIRED_FACTS if m.get(k) is None or m.get(k) == ""]
    if missing:
        raise SelftestFormatError(f"{where}: machine facts missing: {', '.join(missing)}")
    if m["simulated"] is not False or head.get("simulated"):
        raise SelftestFormatError(
            f"{where}: the file comes from a simulated environment; only a run on real hardware is evidence"
        )
    if m["device"] == "mps":
        wrong = []
        if m["os"] != "Darwin":
            wrong.append(f"os {m['os']!r}")
        if m["arch"] != "arm64":
            wrong.append(f"arch {m['arch']!r}")
        if m["mps_available"] is not True:
            wrong.append("MPS not available")
        if not m.get("macos"):
            wrong.append("no macOS version")
        if wrong:
            raise SelftestFormatError(
                f"{where}: claims device 'mps' but the machine facts say {', '.join(wrong)}; "
                "MPS evidence comes from an Apple-silicon Mac (Darwin, arm64) with MPS available"
            )
    return m


def _check_line(where: str, rec: dict, seen: dict) -> None:
    from .probes import VERDICTS
    from .recipe_checks import STATUSES as RECIPE_STATUSES
    from .workloads import STATUSES

    kind = rec["kind"]
    if rec.get("simulated"):
        raise SelftestFormatError(f"{where}: a line flagged simulated; only a run on real hardware is evidence")
    name = rec.get("feature") if kind == "gate" else rec.get("recipe") if kind == "recipe" else rec.get("name")
    if not isinstance(name, str) or not name:
        raise SelftestFormatError(f"{where}: a {kind} line without a name")
    if name in seen.setdefault(kind, {}):
        raise SelftestFormatError(f"{where}: a second {kind} line for {name!r}")
    if kind == "gate":
        if not isinstance(rec.get("ok"), bool) or rec.get("decided_by") not in ("probed", "by version"):
            raise SelftestFormatError(
                f"{where}: gate line {name!r} needs ok (bool) and decided_by ('probed' or 'by version')"
            )
        seen[kind][name] = rec["ok"]
    elif kind == "probe":
        ups = rec.get("upstream")
        if not isinstance(ups, list) or not ups or not all(isinstance(u, str) and "#" in u for u in ups):
            raise SelftestFormatError(f"{where}: probe {name!r} names no upstream issue or pull request")
        if rec.get("verdict") not in VERDICTS:
            raise SelftestFormatError(
                f"{where}: probe {name!r} verdict {rec.get('verdict')!r} is not one of {', '.join(VERDICTS)}"
            )
        # a Mac's physical bounds hold a probe's measurement; one that did not measure ("not applicable": off a
        # Mac, the host's numbers, a fast CPU dispatching under 0.1 us; "error", "skipped") is never evidence
        measured_here = rec["verdict"] in ("has the bug", "fixed")
        _check_costs(where, name, rec.get("measured") or {}, bounds=measured_here)
        seen[kind][name] = rec["verdict"]
    elif kind == "workload":
        status = rec.get("status")
        if status not in STATUSES:
            raise SelftestFormatError(
                f"{where}: workload {name!r} status {status!r} is not one of {', '.join(STATUSES)}"
            )
        if status in ("pass", "fail"):
            for side in ("stock", "patched"):
                secs = (rec.get(side) or {}).get("seconds")
                if not isinstance(secs, list) or not secs or not all(_positive(s) for s in secs):
                    raise SelftestFormatError(
                        f"{where}: workload {name!r} ran but its {side} seconds are missing or not positive"
                    )
            if not _positive((rec.get("ratio") or {}).get("median")):
                raise SelftestFormatError(f"{where}: workload {name!r} ran but has no positive speed ratio")
            if not isinstance(rec.get("vs_stock"), dict):
                raise SelftestFormatError(f"{where}: workload {name!r} ran but has no comparison with stock")
        if status == "stock fails":
            secs = (rec.get("patched") or {}).get("seconds")
            if (
                not isinstance((rec.get("stock") or {}).get("error"), str)
                or not isinstance(secs, list)
                or not all(_positive(x) for x in secs)
            ):
                raise SelftestFormatError(
                    f"{where}: workload {name!r} 'stock fails' needs stock's error and patched seconds"
                )
        seen[kind][name] = status
    elif kind == "recipe":
        _check_recipe(where, rec, name, RECIPE_STATUSES)
        seen[kind][name] = rec["status"]


def _check_costs(where: str, name: str, measured: dict, *, bounds: bool = True) -> None:
    """The cost-model constants a probe line carries (:data:`COST_BOUNDS`), accepted only within their bounds
    (``bounds=False``: only as finite numbers)."""
    for key, (lo, hi, closed) in COST_BOUNDS.items():
        v = measured.get(key)
        if v is None:
            continue
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        if not (ok and (not bounds or ((lo <= v if closed else lo < v) and v <= hi))):
            span = f"{'[' if closed else '('}{lo}, {hi}]"
            raise SelftestFormatError(f"{where}: probe {name!r} {key} = {v!r} is outside its physical bounds {span}")
    gbs = measured.get("achieved_gbs")
    if gbs is not None and not _positive(gbs):
        raise SelftestFormatError(f"{where}: probe {name!r} achieved_gbs = {gbs!r} is not a positive bandwidth")


def _check_recipe(where: str, rec: dict, name: str, statuses: tuple) -> None:
    from ..bench import Record
    from ..bench.errors import RecordError

    status = rec.get("status")
    if status not in statuses:
        raise SelftestFormatError(f"{where}: recipe {name!r} status {status!r} is not one of {', '.join(statuses)}")
    if status not in ("pass", "fail"):
        return
    try:
        records = [Record.from_dict(r) for r in rec.get("records") or []]
    except (RecordError, TypeError, AttributeError) as e:
        raise SelftestFormatError(f"{where}: recipe {name!r} carries a broken bench record: {e}") from None
    variants = sorted(r.variant for r in records)
    if variants != ["mpsboost", "stock"]:
        raise SelftestFormatError(
            f"{where}: recipe {name!r} ran but has {variants} records; expected stock and mpsboost"
        )
    for r in records:
        if r.throughput is None or r.memory is None:
            raise SelftestFormatError(
                f"{where}: recipe {name!r} ran but its {r.variant} record lacks throughput or memory"
            )
        if r.correctness is not None and r.correctness.reference != "cpu-fp32":
            raise SelftestFormatError(
                f"{where}: recipe {name!r}: correctness reference {r.correctness.reference!r}, expected 'cpu-fp32'"
            )
    if not _positive(rec.get("speed_ratio")):
        raise SelftestFormatError(
            f"{where}: recipe {name!r} speed_ratio {rec.get('speed_ratio')!r} is not a positive number"
        )


def read_lines(path: str | Path) -> list[dict]:
    """The JSON objects of a selftest file, each with a known ``kind`` (no other check)."""
    p = Path(path)
    if not p.is_file():
        raise SelftestFormatError(
            f"{p}: no such file (expected a mpsboost-selftest-*.jsonl written by `mpsboost selftest`)"
        )
    text = p.read_text(encoding="utf-8", errors="replace")
    out = []
    for no, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise SelftestFormatError(f"{p}:{no}: not JSON ({e.msg})") from None
        if isinstance(rec, dict) and "kind" not in rec and "workload" in rec and "variant" in rec:
            raise SelftestFormatError(
                f"{p}:{no}: a bench record, not a selftest line (a file of an older mpsboost selftest, "
                "or a benchmark's results); run `mpsboost selftest` with this version"
            )
        if not isinstance(rec, dict) or rec.get("kind") not in KINDS:
            got = rec.get("kind") if isinstance(rec, dict) else type(rec).__name__
            raise SelftestFormatError(
                f"{p}:{no}: not a selftest line (kind {got!r}; expected one of {', '.join(KINDS)})"
            )
        rec["_line"] = no
        out.append(rec)
    if not out:
        raise SelftestFormatError(f"{p}: empty file; a selftest writes a header line, then its findings")
    return out


def _contradictions(m: dict) -> list[str]:
    """What the machine facts say against each other (a hand-edited or mixed-up file)."""
    out = []
    apple = [f"{k} {m[k]!r}" for k in ("chip", "device_name") if "apple" in str(m.get(k, "")).lower()]
    if apple and m["os"] != "Darwin":
        out.append(f"{' and '.join(apple)} on os {m['os']!r} (Apple silicon runs macOS)")
    if m["device"] == "mps":
        if str(m.get("torch_build", "")).startswith(("cuda ", "rocm ")):
            out.append(f"torch build {m['torch_build']!r} is a CUDA/ROCm build, which has no MPS")
        if m.get("mps_built") is not True:
            out.append("mps_built is not true")
        if m.get("device_name") != f"Apple MPS ({m['chip']})":
            out.append(f"device_name {m.get('device_name')!r} does not name the chip {m['chip']!r}")
    elif str(m.get("device_name", "")).startswith("Apple MPS"):
        out.append(f"device {m['device']!r} with device_name {m['device_name']!r}")
    return out


def _check_record_envs(where: str, rec: dict, m: dict) -> None:
    """Every bench record a line carries was measured in the environment the header describes."""
    for r in rec.get("records") or ():
        env = r.get("env") if isinstance(r, dict) else None
        if not isinstance(env, dict):
            continue
        theirs = {
            "device": env.get("device_type"),
            "torch": env.get("torch_version"),
            "torch_build": env.get("torch_build"),
            "os": str(env.get("os", "")).split(" ")[0] or None,
            "mpsboost": env.get("mpsboost_version"),
        }
        wrong = [f"{k} {v!r} (header: {m.get(k)!r})" for k, v in theirs.items() if v is not None and v != m.get(k)]
        if wrong:
            raise SelftestFormatError(
                f"{where}: a record of this line was measured elsewhere than the header says: {', '.join(wrong)}"
            )


def validate(path: str | Path, *, require_mps: bool = False) -> dict:
    """Check a selftest file; returns ``{"machine", "probes", "workloads", "recipes", "gate"}``
    (name -> verdict/status).

    Rejects (:class:`SelftestFormatError`, naming file and line): a line that is not JSON or of no
    known kind; a first line without the machine facts; a simulated run; a file that claims MPS but
    whose machine facts are not an Apple-silicon Mac with MPS available; machine facts that contradict
    each other (an Apple chip on Linux, a CUDA torch build on MPS, a device name that is not the
    chip's); a record measured in another environment than the header's; a probe without its upstream
    number; a workload or recipe that ran without its measurements; and a file with no successful
    case (every probe, workload and recipe errored, skipped or not applicable). ``require_mps``
    (``mpsboost selftest --validate``): a run on another device is rejected too, as no evidence.
    """
    p = Path(path)
    lines = read_lines(p)
    head = lines[0]
    where = f"{p}:{head['_line']}"
    if head["kind"] != "selftest":
        raise SelftestFormatError(
            f"{where}: the first line must be the selftest header (kind 'selftest'), not {head['kind']!r}"
        )
    if head.get("schema") != SCHEMA:
        raise SelftestFormatError(
            f"{where}: schema {head.get('schema')!r}; this mpsboost reads schema {SCHEMA} "
            "(run `mpsboost selftest` again with this version)"
        )
    machine = _check_machine(where, head)
    wrong = _contradictions(machine)
    if wrong:
        raise SelftestFormatError(f"{where}: the machine facts contradict each other: {'; '.join(wrong)}")
    if require_mps and machine["device"] != "mps":
        raise SelftestFormatError(
            f"{where}: a selftest on {machine['device']}, not on MPS: not evidence for the Mac results "
            "(only a run on an Apple-silicon Mac is)"
        )
    seen: dict[str, dict] = {}
    for rec in lines[1:]:
        w = f"{p}:{rec['_line']}"
        if rec["kind"] == "selftest":
            raise SelftestFormatError(f"{w}: a second header; one selftest run per file")
        _check_record_envs(w, rec, machine)
        _check_line(w, rec, seen)
    from .probes import EVIDENCE

    probes, workloads, recipes = seen.get("probe", {}), seen.get("workload", {}), seen.get("recipe", {})
    ok = (
        sum(v in EVIDENCE for v in probes.values())
        + sum(v in ("pass", "fail", "stock fails") for v in workloads.values())
        + sum(v in ("pass", "fail") for v in recipes.values())
    )
    if not ok:
        raise SelftestFormatError(
            f"{p}: no successful case: every probe, workload and recipe errored, was skipped or did not apply "
            f"(probes {sorted(set(probes.values()))}, workloads {sorted(set(workloads.values()))}, "
            f"recipes {sorted(set(recipes.values()))})"
        )
    return {
        "machine": machine,
        "probes": probes,
        "workloads": workloads,
        "recipes": recipes,
        "gate": seen.get("gate", {}),
    }


def calibration(path) -> dict:
    """The cost model's constants as a Mac's selftest file measured them (probe ``dispatch_cost``):
    ``{"file", "chip", "c_metal_us", "c_graph_us", "eta"}`` (``eta`` None where the chip is not one of
    :data:`mpsboost.bench.decode_cost.CHIPS`). The file is validated first as evidence from a Mac
    (:func:`validate` with ``require_mps``: an Apple-silicon Mac's facts, every constant within its physical
    bounds); a file without the probe's measurement is refused, naming it."""
    validate(path, require_mps=True)
    for rec in read_lines(path):
        if rec["kind"] == "probe" and rec.get("name") == "dispatch_cost":
            m = rec.get("measured") or {}
            if m.get("c_metal_us") is None or m.get("c_graph_us") is None:
                break
            return {
                "file": str(path),
                "chip": m.get("chip_model"),
                "c_metal_us": float(m["c_metal_us"]),
                "c_graph_us": float(m["c_graph_us"]),
                "eta": None if m.get("eta") is None else float(m["eta"]),
            }
    raise SelftestFormatError(
        f"{path}: no measured dispatch_cost probe (c_metal_us, c_graph_us): run `mpsboost selftest` on the Mac "
        "(its probe dispatch_cost measures the cost model's constants)"
    )
