"""Let the user's Mac decide what only a Mac can tell: a kernel whose speed on Apple GPUs is unknown is compiled,
checked and timed against the stock path on the user's own Mac at patch time, and taken only if faster.

A recipe that has such a choice (a fused Metal kernel against the composed aten ops, mpsboost's fp8 GEMV against
``F.scaled_mm``, the low-bit kernels against torch's int4pack/int8pack) calls :func:`choose` once per distinct
shape while it patches, with two :class:`Contender`\\ s whose ``run`` makes one call at the model's own shape on
inputs the recipe prepared. :func:`choose`:

1. on anything but a real MPS device (a simulated Mac, the CPU, CUDA), or with ``mode="static"``, times nothing
   and returns the static choice: the path the cost model predicts faster (the recipe passes it);
2. looks the verdict up in the timing cache (one JSON file in the user's cache folder, keyed by chip, macOS,
   torch build, kernel and shape), and takes it from there when present;
3. runs the candidate's self-check (compiled, compared with the composed path); a failed check or one that
   raises takes the stock path, with the reason;
4. times stock and candidate in paired, alternating rounds (``rounds``, each timed on a synchronised device) and
   takes the candidate only when its median time ratio is below ``1 - margin``: a tie goes to stock. A timing that
   raises takes the stock path, with the reason;
5. writes the verdict into the cache (atomically: a temporary file renamed over the old one).

Nothing here runs inside traced code: :func:`choose` is patch-time only, and the forward a recipe installs reads
the chosen path from its frozen plan. Nothing here keeps a contender, a tensor or a module after it returns.

Tests drive this with an injected ``timer`` and a stubbed real-Mac :class:`~mpsboost.gate.Env`
(``tests/core/test_ondevice.py``).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Optional

from .gate import Env

__all__ = ["Contender", "Choice", "TimingCache", "choose", "cache_path", "chip_name", "default_timer", "MODES"]

MODES = ("auto", "static")
CACHE_FORMAT = "mpsboost-ondevice-timings"
CACHE_VERSION = 1
ROUNDS = 5
MARGIN = 0.02  # a candidate must be at least 2% faster (median ratio < 0.98): a tie goes to stock


@dataclass(frozen=True)
class Contender:
    """One path of a choice: ``name`` is its backing text in the report; ``run`` makes one call at the model's
    shape (inputs prepared by the caller; the result is discarded)."""

    name: str
    run: Callable[[], Any]


@dataclass(frozen=True)
class Choice:
    """What :func:`choose` decided. ``taken``: the candidate runs. ``source``: ``"static"`` (nothing timed),
    ``"timed"``, ``"cache"``, ``"self-check failed"`` or ``"timing error"``. ``ratio`` is the candidate's median
    time over stock's (None when nothing was timed), ``spread`` its lowest and highest round."""

    kernel: str
    path: str
    taken: bool
    source: str
    reason: str
    ratio: Optional[float] = None
    spread: Optional[tuple[float, float]] = None
    rounds: int = 0

    def describe(self) -> str:
        """One line for a report row: the path and, where measured, the ratio."""
        if self.ratio is None:
            return f"{self.path} ({self.reason})"
        lo, hi = self.spread if self.spread else (self.ratio, self.ratio)
        where = "timed on this Mac" if self.source == "timed" else "timed on this Mac earlier (cache)"
        return (
            f"{self.path} ({where}: candidate {self.ratio:.2f}x of stock's time, rounds {lo:.2f}-{hi:.2f}, "
            f"{self.rounds} rounds; {self.reason})"
        )


def cache_path() -> Path:
    """The timing cache file: ``$MPSBOOST_CACHE_DIR/ondevice-timings.json`` when set, else the platform's user cache
    folder (``~/Library/Caches/mpsboost`` on macOS, ``$XDG_CACHE_HOME/mpsboost`` or ``~/.cache/mpsboost``)."""
    root = os.environ.get("MPSBOOST_CACHE_DIR")
    if root:
        base = Path(root)
    elif sys.platform == "darwin":
        base = Path.home() / "Library" / "Caches" / "mpsboost"
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mpsboost"
    return base / "ondevice-timings.json"


def chip_name() -> str:
    """The processor's name on a Mac (``Apple M3 Ultra``, from sysctl), else the platform's machine string."""
    if sys.platform == "darwin":
        try:
            out = subprocess.run(
                ["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True, timeout=5, check=False
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            out = ""
        if out:
            return out
    return platform.machine() or "unknown"


class TimingCache:
    """The verdicts timed on this machine, one JSON file. A file that is not this format (another program's, a
    newer version's, truncated) is never trusted: it is read as empty and replaced on the next write."""

    def __init__(self, path: Optional[Path] = None):
        self.path = Path(path) if path is not None else cache_path()
        self.problem: Optional[str] = None  # why the file on disk was not read, when it wasn't

    def _read(self) -> dict:
        try:
            raw = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            self.problem = f"timing cache {self.path} unreadable ({type(exc).__name__}); timing anew"
            return {}
        if not isinstance(raw, dict) or raw.get("format") != CACHE_FORMAT or raw.get("version") != CACHE_VERSION:
            self.problem = f"timing cache {self.path} is not a {CACHE_FORMAT} v{CACHE_VERSION} file; timing anew"
            return {}
        entries = raw.get("entries")
        return entries if isinstance(entries, dict) else {}

    def get(self, key: str) -> Optional[dict]:
        entry = self._read().get(key)
        if not isinstance(entry, dict) or not isinstance(entry.get("taken"), bool):
            return None
        ratio = entry.get("ratio")
        if not isinstance(ratio, (int, float)) or not ratio > 0:
            return None
        return entry

    def put(self, key: str, entry: dict) -> None:
        entries = self._read()
        entries[key] = entry
        body = json.dumps({"format": CACHE_FORMAT, "version": CACHE_VERSION, "entries": entries}, indent=1)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".timings-", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w") as fh:
                fh.write(body)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def default_timer(fn: Callable[[], Any], *, min_s: float = 2e-3, warmup: int = 2) -> float:
    """Seconds per call of ``fn`` on the MPS device: warm-up calls, then as many calls as fill ``min_s``, between
    two ``torch.mps.synchronize()``."""
    import time

    import torch

    for _ in range(warmup):
        fn()
    torch.mps.synchronize()
    n, elapsed = 1, 0.0
    while True:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.mps.synchronize()
        elapsed = time.perf_counter() - t0
        if elapsed >= min_s or n >= 1 << 14:
            return elapsed / n
        n *= 4


def _key(kernel: str, shape: Any, env: Env, chip: str) -> str:
    macos = ".".join(str(x) for x in env.macos) if env.macos else "unknown"
    return f"{kernel}|{shape}|{chip}|macOS {macos}|torch {env.torch_version.raw}"


def choose(
    kernel: str,
    shape: Any,
    *,
    env: Env,
    stock: Contender,
    candidate: Contender,
    static: bool,
    check: Optional[Callable[[], Optional[str]]] = None,
    mode: Literal["auto", "static"] = "auto",
    timer: Optional[Callable[[Callable[[], Any]], float]] = None,
    cache: Optional[TimingCache] = None,
    chip: Optional[str] = None,
    rounds: int = ROUNDS,
    margin: float = MARGIN,
) -> Choice:
    """Stock or candidate for ``kernel`` at ``shape`` (see the module docs). ``static``: the cost model's choice,
    taken wherever nothing is timed. ``check`` returns None when the candidate computes what stock computes, or why
    not. ``shape`` is any value whose ``str`` names the call's shapes and dtypes."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")

    def pick(taken: bool, source: str, reason: str, **kw) -> Choice:
        return Choice(kernel, candidate.name if taken else stock.name, taken, source, reason, **kw)

    if mode == "static" or env.simulated or env.device_type != "mps":
        why = (
            "option keeps the static choice"
            if mode == "static"
            else "simulated environment"
            if env.simulated
            else f"{env.device_type}, not a Mac"
        )
        return pick(static, "static", f"not timed: {why}; the cost model's choice")
    chip = chip if chip is not None else chip_name()
    cache = cache if cache is not None else TimingCache()
    key = _key(kernel, shape, env, chip)
    hit = cache.get(key)
    if hit is not None:
        spread = hit.get("spread")
        return pick(
            hit["taken"],
            "cache",
            "faster on this Mac" if hit["taken"] else "not faster on this Mac",
            ratio=float(hit["ratio"]),
            spread=tuple(spread) if isinstance(spread, list) and len(spread) == 2 else None,
            rounds=int(hit.get("rounds", 0)),
        )
    if check is not None:
        try:
            why = check()
        except Exception as exc:  # a check that raises is a failed check: the stock path runs
            why = f"{type(exc).__name__}: {exc}"
        if why is not None:
            return pick(False, "self-check failed", f"candidate failed its self-check on this Mac: {why}")
    timer = timer if timer is not None else default_timer
    ratios: list[float] = []
    try:
        for r in range(rounds):
            # paired and alternating: stock first in even rounds, the candidate first in odd ones
            if r % 2 == 0:
                ts, tc = timer(stock.run), timer(candidate.run)
            else:
                tc, ts = timer(candidate.run), timer(stock.run)
            if not (ts > 0 and tc > 0):
                raise ValueError(f"timer returned {ts!r} / {tc!r} seconds")
            ratios.append(tc / ts)
    except Exception as exc:  # a timing that fails leaves the stock path in place, with the reason
        return pick(False, "timing error", f"timing failed on this Mac ({type(exc).__name__}: {exc}); stock kept")
    med = statistics.median(ratios)
    taken = med < 1.0 - margin
    spread = (min(ratios), max(ratios))
    reason = "faster on this Mac" if taken else f"not faster on this Mac (a tie within {margin:.0%} goes to stock)"
    try:
        cache.put(
            key, {"taken": taken, "ratio": med, "spread": list(spread), "rounds": rounds, "candidate": candidate.name}
        )
    except OSError as exc:  # an unwritable cache folder costs a re-timing next process, nothing else
        reason += f"; not cached ({type(exc).__name__}: {exc})"
    return pick(taken, "timed", reason, ratio=med, spread=spread, rounds=rounds)
