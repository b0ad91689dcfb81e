"""The version gate: which torch build on which device has which kernel.

One table, :data:`FEATURES`, says for every capability the recipes rely on, per device type, since
which torch version it exists, whether only nightlies have it so far, the upstream change that
brought it (for the reason text) and an optional runtime probe. :func:`check` answers with a
:class:`Verdict`. Nothing else in mpsboost compares torch versions.

Version strings torch reports (``torch.__version__``): ``2.15.0`` (release; an RC reports the same),
``2.15.0+cpu`` / ``2.15.0+cu130`` (local tag off macOS),
``2.15.0a0+gitabc1234`` (source build), ``2.16.0.dev20261101`` (nightly; no local tag on macOS). PEP 440 sorts
``2.16.0.dev...`` below ``2.16.0``, so a plain ``>=`` would be wrong for nightlies: we compare the
release triple, and a nightly of the very version that introduces a feature counts only from the
feature's merge date, where that date is known.

Versions alone lie for nightlies (a 2.16 nightly says nothing about whether an open pull request
has landed), so where a feature is an API or a dtype the table's verdict is checked by a probe on
the real device: once per process (cached), cheaply (a few elements), at patch time and never inside
traced code. Most probes can only veto a passing rule; a feature marked ``probe_decides`` (an API the
build either has or not: ``torch.mps.Stream``, ``float8_e4m3fn`` on MPS, ``torch.mps.compile_shader``,
``torch.mps.load_metallib``) is decided by its probe either way, whatever the version says. Where no
probe is possible (a simulated environment, traced code) the version rule decides. Every
:class:`Verdict` says which decided: ``decided_by`` is ``"probed"`` or ``"by version"``.

The MPS column rests on the released macOS arm64 wheels, the builds ``pip install torch`` gives a Mac:
``tools/wheel_facts.py`` reads each one (Metal kernel names, symbols, error strings, ``torch/*.py``)
into ``data/mps_wheels.json``; every MPS rule names its fact there (``Rule.evidence``) or says it is
behavioural, and ``tests/core/test_wheel_evidence.py`` fails when ``since`` and the first wheel that
shows the fact disagree.
"""

from __future__ import annotations

import datetime as _dt
import platform
import re
import threading
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping

from packaging.version import InvalidVersion, Version

from .errors import GateError

__all__ = [
    "TorchVersion",
    "parse_torch_version",
    "Env",
    "Rule",
    "Feature",
    "FEATURES",
    "Verdict",
    "check",
    "check_all",
    "matrix",
    "DEVICE_TYPES",
    "RESEARCHED",
    "feature_info",
    "clear_probe_cache",
    "BY_VERSION",
    "PROBED",
    "BEHAVIOURAL",
    "wheel_evidence",
    "evidence_text",
]

DEVICE_TYPES = ("cpu", "cuda", "mps")

# Verdict.decided_by: the version rule of FEATURES, or a probe of this build on the real device.
BY_VERSION = "by version"
PROBED = "probed"

# The date the upstream status in FEATURES was last checked against pytorch's repository and tracker.
RESEARCHED = _dt.date(2026, 11, 30)

# Rule.evidence of a fix that no kernel, symbol or API of a wheel shows (its pull request is the evidence).
BEHAVIOURAL = "behavioural"

_NIGHTLY_DATE = re.compile(r"^(\d{4})(\d{2})(\d{2})$")


@dataclass(frozen=True)
class TorchVersion:
    """A parsed torch version string."""

    raw: str
    release: tuple[int, int, int]
    kind: str  # "release", "prerelease", "nightly", "source"
    nightly_date: _dt.date | None = None
    local: str | None = None

    @property
    def minor(self) -> tuple[int, int]:
        return self.release[:2]

    def __str__(self) -> str:
        return self.raw


def parse_torch_version(text: str) -> TorchVersion:
    """Parse a torch version string (the forms in this module's docstring); raise :class:`GateError` for
    anything else."""
    if not isinstance(text, str):
        raise TypeError(f"torch version must be a str such as '2.15.0', got {type(text).__name__}: {text!r}")
    raw = text.strip()
    try:
        v = Version(raw)
    except InvalidVersion:
        raise GateError(
            f"cannot parse torch version {text!r}; expected forms like '2.15.0', '2.15.0+cpu', "
            "'2.15.0a0+gitabc1234' (source build) or '2.16.0.dev20261101' (nightly)"
        ) from None
    if v.epoch != 0 or len(v.release) < 2 or v.release[0] < 1:
        raise GateError(f"{text!r} is not a torch version (expected MAJOR.MINOR[.PATCH], e.g. '2.15.0')")
    rel = tuple(v.release) + (0,) * (3 - len(v.release))
    release = (int(rel[0]), int(rel[1]), int(rel[2]))
    local = v.local
    date = None
    if v.dev is not None:
        m = _NIGHTLY_DATE.match(str(v.dev))
        if m:
            try:
                date = _dt.date(int(m.group(1)), int(m.group(2)), int(m.group(3)))
            except ValueError:
                raise GateError(f"nightly version {text!r} carries an impossible date {v.dev}") from None
        kind = "nightly"
    elif local is not None and local.startswith("git"):
        kind = "source"
    elif v.pre is not None:
        # 2.15.0a0 without git tag: a source build as well; rc tags report the plain release upstream.
        kind = "source" if v.pre[0] == "a" else "prerelease"
    else:
        kind = "release"
    return TorchVersion(raw=raw, release=release, kind=kind, nightly_date=date, local=local)


def _installed_torch_version() -> str:
    import torch

    return torch.__version__.split(" ")[0] if isinstance(torch.__version__, str) else str(torch.__version__)


@dataclass(frozen=True)
class Env:
    """The environment a decision is made for: torch build and device. Real or simulated."""

    torch_version: TorchVersion
    device_type: str = "cpu"
    device_name: str = ""
    capability: tuple[int, int] | None = None  # CUDA compute capability
    simulated: bool = False
    os: str = field(default_factory=platform.system)
    macos: tuple[int, int] | None = None  # macOS (major, minor) of a real Mac, or as simulated; None: unknown

    def __post_init__(self) -> None:
        if self.device_type not in DEVICE_TYPES:
            raise GateError(f"device type {self.device_type!r} is not one of {', '.join(DEVICE_TYPES)}")

    @classmethod
    def detect(cls, device: "str | object | None" = None) -> "Env":
        """The environment of this process; ``device`` picks the device (default: the best present)."""
        import torch

        tv = parse_torch_version(_installed_torch_version())
        if device is None:
            if torch.backends.mps.is_available():
                device = "mps"
            elif torch.cuda.is_available():
                device = "cuda"
            else:
                device = "cpu"
        dev = torch.device(device) if not isinstance(device, torch.device) else device
        name, cap = "", None
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise GateError("device 'cuda' was asked for, but torch.cuda.is_available() is False here")
            idx = dev.index if dev.index is not None else torch.cuda.current_device()
            name = torch.cuda.get_device_name(idx)
            cap = tuple(torch.cuda.get_device_capability(idx))  # type: ignore[assignment]
        elif dev.type == "mps":
            name = "Apple MPS" + (f" ({platform.machine()})" if platform.machine() else "")
        elif dev.type == "cpu":
            name = platform.processor() or platform.machine()
        else:
            raise GateError(f"device {str(dev)!r} is not supported; mpsboost knows {', '.join(DEVICE_TYPES)}")
        return cls(torch_version=tv, device_type=dev.type, device_name=name, capability=cap, macos=_macos_version())

    @classmethod
    def simulate(
        cls,
        device: str = "mps",
        torch_version: str | None = None,
        *,
        capability: tuple[int, int] | None = None,
        device_name: str | None = None,
        macos: str | tuple[int, int] | None = None,
    ) -> "Env":
        """An environment for a dry run: ``Env.simulate("mps", "2.14.1")``.

        ``device`` may carry a CUDA compute capability as ``"cuda:9.0"``; ``macos`` (e.g. ``"26.2"``)
        lets rules with a macOS condition decide (left unknown otherwise).
        """
        if not isinstance(device, str):
            raise TypeError(f"device must be a str ('mps', 'cuda', 'cuda:9.0', 'cpu'), got {type(device).__name__}")
        dtype_, _, cap_text = device.partition(":")
        if dtype_ == "cuda" and cap_text:
            try:
                major, minor = (int(x) for x in cap_text.split("."))
            except ValueError:
                raise GateError(f"cannot read compute capability from {device!r}; write e.g. 'cuda:9.0'") from None
            capability = (major, minor)
        elif cap_text:
            raise GateError(f"{device!r}: only 'cuda:MAJOR.MINOR' takes a suffix")
        if dtype_ == "cuda" and capability is None:
            capability = (9, 0)
        tv = parse_torch_version(torch_version if torch_version is not None else _installed_torch_version())
        name = device_name or {
            "mps": "Apple MPS (simulated)",
            "cuda": f"CUDA sm_{capability[0]}{capability[1]} (simulated)" if capability else "CUDA (simulated)",
            "cpu": "CPU (simulated)",
        }.get(dtype_, dtype_)
        return cls(
            torch_version=tv,
            device_type=dtype_,
            device_name=name,
            capability=capability,
            simulated=True,
            macos=_parse_macos(macos),
        )

    def with_device(self, device_type: str) -> "Env":
        return replace(self, device_type=device_type)

    def describe(self) -> str:
        cap = f", sm_{self.capability[0]}{self.capability[1]}" if self.capability else ""
        sim = " (simulated)" if self.simulated and "simulated" not in self.device_name else ""
        mac = f", macOS {self.macos[0]}.{self.macos[1]}" if self.macos else ""
        return f"torch {self.torch_version.raw} on {self.device_type} [{self.device_name}{cap}{mac}]{sim}"

    def to_dict(self) -> dict:
        return {
            "torch_version": self.torch_version.raw,
            "device_type": self.device_type,
            "device_name": self.device_name,
            "capability": list(self.capability) if self.capability else None,
            "simulated": self.simulated,
            "os": self.os,
            "macos": ".".join(map(str, self.macos)) if self.macos else None,
        }


def _parse_macos(value: "str | tuple[int, int] | None") -> tuple[int, int] | None:
    if value is None or value == "":
        return None
    if isinstance(value, tuple):
        parts = value
    else:
        try:
            parts = tuple(int(x) for x in str(value).split(".")[:2])
        except ValueError:
            raise GateError(f"cannot read a macOS version from {value!r}; write e.g. '26.2'") from None
    if not parts or len(parts) > 2:
        raise GateError(f"cannot read a macOS version from {value!r}; write e.g. '26.2'")
    return (int(parts[0]), int(parts[1]) if len(parts) > 1 else 0)


def _macos_version() -> tuple[int, int] | None:
    if platform.system() != "Darwin":
        return None
    release = platform.mac_ver()[0]
    try:
        return _parse_macos(release) if release else None
    except GateError:
        return None


@dataclass(frozen=True)
class Verdict:
    """``ok`` and a ``reason`` a person can read; ``decided_by`` says whether the version rule of the
    FEATURES table (torch version, device, capability: ``"by version"``) or a probe on the real device
    (``"probed"``) settled it."""

    ok: bool
    reason: str
    decided_by: str = BY_VERSION

    def __bool__(self) -> bool:
        return self.ok


@dataclass(frozen=True)
class Rule:
    """When one device type has a feature.

    ``since=None`` with ``never=False`` means every torch version that mpsboost supports.
    ``never=True`` means no released or nightly torch has it (``upstream`` says what is pending).
    """

    since: str | None = None
    nightly_only: bool = False
    merged: _dt.date | None = None
    upstream: str = ""
    min_capability: tuple[int, int] | None = None
    never: bool = False
    note: str = ""
    # When it pays off or is needed: macOS version, dtypes, head dims (shown by doctor, in the reason).
    conditions: str = ""
    # A macOS the rule needs (e.g. (26, 2)); a Mac known to be older fails it, an unknown one passes
    # with the condition in the reason.
    min_macos: tuple[int, int] | None = None
    # What the released macOS wheels show for it (MPS rules): the name of a fact in
    # data/mps_wheels.json (written by tools/wheel_facts.py from the wheels themselves), or BEHAVIOURAL
    # for a fix no kernel, symbol or API in a wheel can show. tests/core/test_wheel_evidence.py holds
    # every MPS rule to it: ``since`` is the first release whose wheel shows the fact, and a rule no
    # released wheel has yet names the fact that the newest wheel lacks.
    evidence: str = ""

    @property
    def first_release(self) -> str:
        """The first torch release that contains it, in words."""
        if self.never:
            return f"none (not fixed or merged as of {RESEARCHED})"
        if self.since is None:
            return "every supported release"
        rel = self._since()
        assert rel is not None
        text = f"{rel.release[0]}.{rel.release[1]}.0"
        if self.nightly_only:
            return f"none yet; {text} nightlies" + (f" from {self.merged}" if self.merged else "")
        return text

    def _since(self) -> TorchVersion | None:
        return parse_torch_version(self.since) if self.since else None


@dataclass(frozen=True)
class Feature:
    name: str
    description: str
    rules: Mapping[str, tuple[Rule, ...]]
    # A runtime probe for the real (not simulated) environment; returns a Verdict to override a passing
    # rule (e.g. "triton is not importable"), or None to agree.
    probe: Callable[[Env], Verdict | None] | None = None
    # The probe decides both ways: an API or dtype the build has or lacks, whatever its version says
    # (torch.mps.Stream ships in whichever build merges pytorch#191415, not in a known version).
    probe_decides: bool = False


def _rule_verdict(feature: Feature, rule: Rule, env: Env) -> Verdict:
    where = f"{env.device_type}"
    ups = f" ({rule.upstream})" if rule.upstream else ""
    if rule.never:
        return Verdict(
            False,
            f"{feature.description}: not in any torch build on {where} yet{ups}"
            + (f"; {rule.note}" if rule.note else ""),
        )
    if rule.min_capability is not None:
        cap = env.capability
        need = f"{rule.min_capability[0]}.{rule.min_capability[1]}"
        if cap is None:
            return Verdict(False, f"{feature.description} needs CUDA compute capability >= {need}; unknown here")
        if tuple(cap) < tuple(rule.min_capability):
            return Verdict(
                False,
                f"{feature.description} needs CUDA compute capability >= {need}; this device is {cap[0]}.{cap[1]}",
            )
    if rule.min_macos is not None and env.macos is not None and tuple(env.macos) < tuple(rule.min_macos):
        need = f"{rule.min_macos[0]}.{rule.min_macos[1]}"
        return Verdict(
            False, f"{feature.description} needs macOS >= {need}{ups}; this Mac runs {env.macos[0]}.{env.macos[1]}"
        )
    since = rule._since()
    tv = env.torch_version
    extra = "".join(f"; {t}" for t in (rule.conditions, rule.note) if t)
    if rule.min_macos is not None and env.macos is None:
        extra += f"; macOS >= {rule.min_macos[0]}.{rule.min_macos[1]} assumed (unknown here)"
    if since is not None:
        have, need = tv.release, since.release
        label = f"torch {since.raw}" + (" nightlies" if rule.nightly_only else "")
        if have < need:
            return Verdict(False, f"{feature.description} needs {label}{ups}; this is torch {tv.raw}")
        if have[:2] == need[:2] and tv.kind == "nightly" and rule.merged is not None:
            if tv.nightly_date is None:
                return Verdict(
                    False,
                    f"{feature.description}: nightly {tv.raw} carries no date to compare with "
                    f"the merge of{ups} on {rule.merged}",
                )
            if tv.nightly_date < rule.merged:
                return Verdict(
                    False, f"{feature.description}: nightly {tv.raw} predates the merge of{ups} on {rule.merged}"
                )
        if have[:2] == need[:2] and tv.kind == "source" and rule.nightly_only and rule.merged is not None:
            return Verdict(
                True,
                f"{feature.description}: source build {tv.raw}, assumed to include{ups} (merged {rule.merged}){extra}",
            )
        return Verdict(True, f"{feature.description}: in {label}{ups}; this is torch {tv.raw}{extra}")
    return Verdict(True, f"{feature.description}: available on {where}{extra}")


def check(feature: str, env: Env) -> Verdict:
    """Is ``feature`` available in ``env``? Always a :class:`Verdict` with a reason a person can read."""
    if not isinstance(env, Env):
        raise TypeError(f"check() needs an mpsboost.gate.Env, got {type(env).__name__}")
    try:
        feat = FEATURES[feature]
    except KeyError:
        import difflib

        close = difflib.get_close_matches(feature, list(FEATURES), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise GateError(f"unknown feature {feature!r}{hint} Known: {', '.join(sorted(FEATURES))}") from None
    rules = feat.rules.get(env.device_type)
    if not rules:
        return Verdict(False, f"{feat.description}: not available on {env.device_type}")
    verdicts = [_rule_verdict(feat, r, env) for r in rules]
    ok = [v for v in verdicts if v.ok]
    verdict = ok[0] if ok else verdicts[-1]
    if feat.probe is not None and not env.simulated and (verdict.ok or feat.probe_decides):
        return _with_probe(feat, env, verdict)
    if feat.probe is not None and env.simulated:
        return replace(verdict, reason=f"{verdict.reason}; by version (a simulated environment is not probed)")
    return verdict


# Probe outcomes of this process: (feature, device type, torch version) -> None (agrees) or a failing Verdict.
_PROBE_CACHE: dict[tuple[str, str, str], "Verdict | None"] = {}
_PROBE_LOCK = threading.Lock()


def clear_probe_cache() -> None:
    """Forget every probe outcome of this process (tests; after switching devices)."""
    with _PROBE_LOCK:
        _PROBE_CACHE.clear()


def _tracing() -> bool:
    """True inside torch.compile / export / FX tracing, where no probe may run."""
    import torch

    try:
        if torch.compiler.is_compiling():
            return True
    except AttributeError:  # pragma: no cover - torch < 2.3
        pass
    import torch.fx._symbolic_trace as fx_trace

    fn = getattr(fx_trace, "is_fx_symbolic_tracing", None) or getattr(fx_trace, "is_fx_tracing", None)
    return bool(fn()) if fn is not None else False


def _with_probe(feat: Feature, env: Env, table: Verdict) -> Verdict:
    key = (feat.name, env.device_type, env.torch_version.raw)
    with _PROBE_LOCK:
        known = key in _PROBE_CACHE
        outcome = _PROBE_CACHE.get(key)
    if not known:
        if _tracing():
            return replace(table, reason=f"{table.reason}; by version (device probe deferred: traced code)")
        assert feat.probe is not None
        try:
            outcome = feat.probe(env)
        except Exception as e:  # a probe that raises is a build without the feature
            outcome = Verdict(False, f"{feat.description}: the {env.device_type} probe failed: {type(e).__name__}: {e}")
        if outcome is not None:
            outcome = replace(outcome, reason=f"probed on {env.device_type}: {outcome.reason}", decided_by=PROBED)
        with _PROBE_LOCK:
            _PROBE_CACHE[key] = outcome
    if outcome is None and not table.ok:
        # probe_decides: the build has it although the version rule says no (a nightly or source build
        # that merged the change, a backport).
        return Verdict(
            True,
            f"{feat.description}: probed on {env.device_type}: present in this build "
            f"(by version alone: {table.reason})",
            PROBED,
        )
    if outcome is None:
        return replace(table, reason=f"{table.reason}; probed on {env.device_type}: confirmed", decided_by=PROBED)
    return outcome


def feature_info(name: str, device_type: str) -> dict:
    """What the table says about ``name`` on ``device_type``: upstream change, merge date, first
    release, conditions (``mpsboost doctor`` shows it)."""
    try:
        feat = FEATURES[name]
    except KeyError:
        raise GateError(f"unknown feature {name!r}; known: {', '.join(sorted(FEATURES))}") from None
    rules = feat.rules.get(device_type, ())
    return {
        "description": feat.description,
        "probe": feat.probe is not None,
        "probe_decides": feat.probe_decides,
        "rules": [
            {
                "upstream": r.upstream,
                "merged": r.merged.isoformat() if r.merged else None,
                "first_release": r.first_release,
                "conditions": "; ".join(t for t in (r.conditions, r.note) if t),
                "min_macos": ".".join(map(str, r.min_macos)) if r.min_macos else None,
                "min_capability": ".".join(map(str, r.min_capability)) if r.min_capability else None,
                "evidence": r.evidence or None,
                "evidence_text": evidence_text(r),
            }
            for r in rules
        ],
    }


def check_all(features: "tuple[str, ...] | list[str]", env: Env) -> Verdict:
    """All of ``features``; the first failing verdict, or an ok one joining the reasons."""
    reasons = []
    for f in features:
        v = check(f, env)
        if not v.ok:
            return v
        reasons.append(v.reason)
    return Verdict(True, "; ".join(reasons) if reasons else "no feature required")


def matrix(env: Env) -> dict[str, Verdict]:
    """Every feature's verdict in ``env`` (what ``mpsboost doctor`` prints)."""
    return {name: check(name, env) for name in FEATURES}


_EVIDENCE: dict | None = None


def wheel_evidence() -> dict:
    """What the released macOS arm64 torch wheels ship (``data/mps_wheels.json``, written by
    ``tools/wheel_facts.py``): ``wheels`` (version, file, sha256, min_macos) and ``facts`` (per fact:
    ``symbol``, ``shows`` per version, ``first``). Read once; never downloads anything."""
    global _EVIDENCE
    if _EVIDENCE is None:
        import json
        from importlib import resources

        _EVIDENCE = json.loads(resources.files("mpsboost").joinpath("data/mps_wheels.json").read_text())
    return _EVIDENCE


def evidence_text(rule: Rule) -> str:
    """One line on what the macOS wheels show for ``rule`` (the support table's evidence column)."""
    if not rule.evidence:
        return ""
    if rule.evidence == BEHAVIOURAL:
        return "behavioural: no kernel, symbol or API of a wheel shows it (the upstream change is the evidence)"
    facts = wheel_evidence()["facts"]
    fact = facts.get(rule.evidence)
    if fact is None:
        return f"fact {rule.evidence!r} missing from data/mps_wheels.json"
    versions = list(fact["shows"])
    if fact["first"] is not None:
        where = f"from the {fact['first']} macOS wheel"
        if fact["first"] == versions[0]:
            where = f"in every macOS wheel read ({versions[0]} to {versions[-1]})"
        return f"{fact['symbol']} {where}"
    return f"not shown by any macOS wheel up to {versions[-1]} ({fact['symbol']})"


# ----------------------------------------------------------------------------- probes
# Each probe runs on env.device_type with a few elements, returns None when the build has the feature
# and a failing Verdict (the reason a skipped recipe shows) when it has not. _with_probe caches the
# outcome per process and never calls a probe inside traced code.


def _probe_triton(env: Env) -> Verdict | None:
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return Verdict(False, "triton is not installed")
    return None


def _probe_grouped_mm(env: Env) -> Verdict | None:
    import torch

    fn = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if fn is None:
        return Verdict(False, "this torch build has neither torch.nn.functional.grouped_mm nor torch._grouped_mm")
    dev = torch.device(env.device_type)
    dtype = torch.float32 if env.device_type == "cpu" else torch.bfloat16
    # two groups of 2 and 6 rows, K = N = 8 (16-byte aligned rows in either dtype)
    a = torch.ones(8, 8, dtype=dtype, device=dev)
    b = torch.ones(2, 8, 8, dtype=dtype, device=dev)
    offs = torch.tensor([2, 8], dtype=torch.int32, device=dev)
    out = fn(a, b, offs=offs)
    if tuple(out.shape) != (8, 8) or float(out[0, 0]) != 8.0:
        return Verdict(
            False, f"grouped_mm ran on {env.device_type} but returned a wrong result (shape {tuple(out.shape)})"
        )
    return None


def _probe_scaled_grouped_mm(env: Env) -> Verdict | None:
    import torch

    if not hasattr(torch, "_scaled_grouped_mm") and not hasattr(torch.nn.functional, "scaled_grouped_mm"):
        return Verdict(False, "this torch build has no scaled_grouped_mm")
    return None


def _probe_float8(env: Env) -> Verdict | None:
    import torch

    if not hasattr(torch, "float8_e4m3fn"):
        return Verdict(False, "this torch build has no torch.float8_e4m3fn")
    x = torch.tensor([0.5, -2.0], device=env.device_type).to(torch.float8_e4m3fn)
    if x.to(torch.float32).cpu().tolist() != [0.5, -2.0]:
        return Verdict(False, f"float8_e4m3fn tensors on {env.device_type} do not round-trip exact values")
    return None


def _probe_streams(env: Env) -> Verdict | None:
    import torch

    if env.device_type == "mps":
        # torch.mps.Stream is what pytorch#191415 adds; without it there is one MPS stream only. The API
        # is the fact a user needs (the pull request is open and documented on main only), not the version.
        if not hasattr(torch.mps, "Stream"):
            return Verdict(
                False, "this torch build has no torch.mps.Stream (pytorch#191415 not in it): one MPS stream only"
            )
        if not hasattr(torch, "accelerator"):
            return Verdict(False, "this torch build has torch.mps.Stream but no torch.accelerator to switch streams")
        side = torch.mps.Stream()
        if side == torch.accelerator.current_stream(torch.device("mps")):
            return Verdict(False, "torch.mps.Stream() returned the current stream: no side streams in this build")
    elif env.device_type == "cuda":
        if not hasattr(torch, "Stream") or not hasattr(torch, "accelerator"):
            return Verdict(False, "this torch build lacks torch.Stream / torch.accelerator")
        torch.Stream(device=env.device_type)
    return None


def _probe_fp8_gemv(env: Env) -> Verdict | None:
    """CUDA: mpsboost's Triton kernel needs triton. MPS: torch's own scaled_mm few-rows kernels need
    the float8 dtype and ``torch._scaled_mm`` in this build."""
    if env.device_type == "cuda":
        return _probe_triton(env)
    import torch

    # On MPS only aten::_scaled_mm_v2 has a kernel (torch.nn.functional.scaled_mm), not torch._scaled_mm.
    if not hasattr(torch, "float8_e4m3fn") or not hasattr(torch.nn.functional, "scaled_mm"):
        return Verdict(False, "this torch build has no torch.float8_e4m3fn / torch.nn.functional.scaled_mm")
    return None


def _probe_cross_stream_events(env: Env) -> Verdict | None:
    import torch

    if env.device_type == "mps":
        if not hasattr(torch.mps, "Stream"):
            return Verdict(False, "this torch build has no torch.mps.Stream: one MPS stream only")
        side = torch.mps.Stream()
        try:
            with torch.mps.stream(side):
                ev = torch.mps.Event()
                ev.record()
                ev.wait()
        except NotImplementedError as e:  # 2.15.0: "Non-default streams are not yet supported."
            return Verdict(False, f"torch.mps.Event on a side stream raises NotImplementedError: {e}")
    elif env.device_type == "cuda" and not hasattr(torch, "Event"):
        return Verdict(False, "this torch build lacks torch.Event")
    return None


def _probe_mps_api(attr: str, upstream: str) -> Callable[[Env], Verdict | None]:
    """A probe for an API of ``torch.mps`` (reported by doctor and the selftest; no recipe uses it yet)."""

    def probe(env: Env) -> Verdict | None:
        import torch

        if not callable(getattr(torch.mps, attr, None)):
            return Verdict(False, f"this torch build has no torch.mps.{attr} ({upstream})")
        return None

    probe.__name__ = f"_probe_mps_{attr}"
    return probe


def _probe_sdpa_gqa(env: Env) -> Verdict | None:
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 9, 64, generator=g) for h in (4, 2, 2))
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))
    dev = torch.device(env.device_type)
    got = F.scaled_dot_product_attention(q.to(dev), k.to(dev), v.to(dev), enable_gqa=True).cpu()
    err = float((got - ref).abs().max())
    if err > 1e-3:
        return Verdict(False, f"SDPA with enable_gqa on {env.device_type} differs from repeated K/V by {err:.2e}")
    return None


def _d(y: int, m: int, d: int) -> _dt.date:
    return _dt.date(y, m, d)


_ALWAYS = (Rule(),)

# Upstream status researched on RESEARCHED (pytorch's repository and issue tracker). Release windows:
# 2.14 cut the week of 2026-08-10; 2.15 cut 2026-10-05, released 2026-10-28; 2.16 cut 2026-11-30.
FEATURES: dict[str, Feature] = {
    f.name: f
    for f in [
        Feature(
            "pad_constant_native",
            "constant F.pad on a native kernel (no MPSGraph driver-memory blow-up)",
            {
                "mps": (
                    Rule(
                        since="2.15",
                        upstream="kernel constant_pad_nd_dense_float in the 2.15.0 macOS wheel; pytorch#195368, "
                        "fp8 pad #197801",
                        note="before it, each pad built an MPSGraph; Wan2.2 VAE decode reached 270 GiB driver memory",
                        evidence="constant_pad_kernel",
                    ),
                ),
                "cuda": _ALWAYS,
                "cpu": _ALWAYS,
            },
        ),
        Feature(
            "pad_rank5_correct",
            "correct constant time-padding of rank-5 tensors with H*W >= 65536",
            {
                "mps": (
                    Rule(
                        since="2.15",
                        upstream="issue pytorch#194922, fixes pytorch#194944 and #195147; behavioural: no symbol",
                        conditions="wrong results from H*W = 65536 (2^16) exactly; smaller frames are fine",
                        evidence=BEHAVIOURAL,
                    ),
                ),
                "cuda": _ALWAYS,
                "cpu": _ALWAYS,
            },
        ),
        Feature(
            "grouped_mm",
            "native grouped matmul with offsets read on the device",
            {
                "mps": (
                    Rule(
                        since="2.15",
                        upstream="kernel grouped_mm_rows_bfloat_bm16_u32 in the 2.15.0 macOS wheel; "
                        "pytorch#194917, #194933",
                        evidence="grouped_mm_kernels",
                    ),
                ),
                "cuda": (
                    Rule(since="2.8", min_capability=(9, 0), upstream="torch._grouped_mm (sm90)"),
                    Rule(since="2.9", min_capability=(8, 0), upstream="torch._grouped_mm (sm80+)"),
                ),
                "cpu": (
                    Rule(
                        since="2.10",
                        upstream="torch.nn.functional.grouped_mm",
                        note="needs 16-byte aligned row strides; no bias, no fp8",
                    ),
                ),
            },
            probe=_probe_grouped_mm,
        ),
        Feature(
            "float8_storage",
            "torch.float8_e4m3fn tensors on the device",
            {
                "mps": (
                    Rule(
                        since="2.15",
                        upstream="kernel copy_identity_dense_castout_float8_e4m3fn in the 2.15.0 macOS wheel; "
                        "pytorch#194074",
                        note="before it: 'Trying to convert Float8_e4m3fn to the MPS backend'",
                        evidence="float8_kernels",
                    ),
                ),
                "cuda": (Rule(since="2.1"),),
                "cpu": (Rule(since="2.1"),),
            },
            probe=_probe_float8,
            probe_decides=True,
        ),
        Feature(
            "scaled_mm",
            "float8 scaled matmul (tensorwise and rowwise scales)",
            {
                "mps": (
                    Rule(
                        since="2.15",
                        upstream="kernel scaled_mm_float8_e4m3fn in the 2.15.0 macOS wheel; pytorch#196916",
                        conditions=(
                            "through torch.nn.functional.scaled_mm (aten::_scaled_mm_v2; torch._scaled_mm has no MPS "
                            "kernel in the 2.15.0 wheel); tensorwise or rowwise scales only (the wheel's error text: "
                            "'MPS _scaled_mm_v2 only supports TensorWise or RowWise scaling'); a storage format for "
                            "large M: the general kernel runs at 0.12-0.25x of bf16 for M >= 512"
                        ),
                        evidence="scaled_mm_kernels",
                    ),
                ),
                "cuda": (Rule(since="2.4", min_capability=(8, 9), upstream="torch._scaled_mm"),),
                # CPU has a reference kernel (256 ms for 2048x2048 at M=1): correct, never fast.
            },
        ),
        Feature(
            "scaled_grouped_mm",
            "float8 grouped scaled matmul",
            {"cuda": (Rule(since="2.9", min_capability=(9, 0), upstream="torch._scaled_grouped_mm"),)},
            probe=_probe_scaled_grouped_mm,
        ),
        Feature(
            "fp8_gemv",
            "float8 matrix-vector fast path for M = 1..4",
            {
                # Two different kernels behind one capability: on MPS torch's own (F.scaled_mm runs them for
                # one to four rows), on CUDA mpsboost's Triton kernel.
                "mps": (
                    Rule(
                        since="2.15",
                        upstream="kernel scaled_mm_few_rows_1_float8_e4m3fn in the 2.15.0 macOS wheel; pytorch#197862",
                        note="on MPS: torch's scaled_mm few-rows kernels (M = 1..4), tensorwise or rowwise scales only",
                        evidence="scaled_mm_few_rows",
                    ),
                ),
                "cuda": (
                    Rule(
                        since="2.4",
                        min_capability=(8, 9),
                        upstream="mpsboost Triton kernel",
                        note="on CUDA: mpsboost's Triton kernel",
                    ),
                ),
            },
            probe=_probe_fp8_gemv,
        ),
        Feature(
            "fp8_metal_gemv",
            "mpsboost's Metal fp8 GEMV (bf16/fp16/fp32 activations, 1 byte per weight; dense, or grouped by offsets)",
            {
                "mps": (
                    Rule(
                        since="2.7",
                        upstream="def compile_shader in torch/mps/__init__.py of every macOS wheel read (public "
                        "since 2.7); the kernel is mpsboost's (mpsboost.ops.fp8_metal)",
                        note="on a Mac the fp8 recipe also compiles it and checks it against the reference at patch "
                        "time (mpsboost.ops.fp8.metal_verdict)",
                        evidence="mps_compile_shader",
                    ),
                )
            },
            probe=_probe_mps_api("compile_shader", "public since torch 2.7"),
            probe_decides=True,
        ),
        Feature(
            "affine_metal_gemv",
            "mpsboost's Metal low-bit GEMV for MLX affine weights (2-8 bits; dense, or grouped by offsets) and the "
            "quantized embedding gather",
            {
                "mps": (
                    Rule(
                        since="2.7",
                        upstream="def compile_shader in torch/mps/__init__.py of every macOS wheel read (public "
                        "since 2.7); the kernels are mpsboost's (mpsboost.ops.affine_metal)",
                        note="on a Mac they are also compiled and checked against the reference at patch time "
                        "(mpsboost.ops.affine.metal_verdict)",
                        evidence="mps_compile_shader",
                    ),
                )
            },
            probe=_probe_mps_api("compile_shader", "public since torch 2.7"),
            probe_decides=True,
        ),
        Feature(
            "triton",
            "Triton kernels",
            {"cuda": (Rule(since="2.4", min_capability=(8, 0)),)},
            probe=_probe_triton,
        ),
        Feature(
            "gemv_bias_epilogue",
            "matrix-vector kernels for mm/addmm with a fused bias (x @ W.t() decode layout)",
            {
                "mps": (
                    Rule(
                        since="2.14",
                        upstream="kernels gemv_t_bfloat_16_1_ab / gemv_nt_*_ab in the 2.14.0 macOS wheel; "
                        "pytorch#186927, #189628",
                        evidence="gemv_bias_kernels",
                    ),
                ),
                "cuda": _ALWAYS,
                "cpu": _ALWAYS,
            },
        ),
        Feature(
            "linear_3d_fast",
            "F.linear on [B,1,K] as fast as on [B,K]",
            {
                "mps": (
                    Rule(
                        since="2.15",
                        upstream="fix pytorch#189855 of issue #189847, 8.5x slower before; behavioural: no symbol",
                        evidence=BEHAVIOURAL,
                    ),
                ),
                "cuda": _ALWAYS,
                "cpu": _ALWAYS,
            },
        ),
        Feature(
            "softmax_native",
            "softmax on a native kernel (one fp32 row of 128,256: 57.4 -> 7.1 us on MPS, "
            "as measured in pytorch#196071)",
            {
                "mps": (
                    Rule(
                        since="2.15",
                        upstream="kernel softmax_float_u32 in the 2.15.0 macOS wheel; pytorch#196071",
                        evidence="softmax_kernel",
                    ),
                ),
                "cuda": _ALWAYS,
                "cpu": _ALWAYS,
            },
        ),
        Feature(
            "sdpa_broadcast",
            "SDPA with batch/head broadcasting",
            {
                "mps": (
                    Rule(
                        since="2.15", upstream="pytorch#189631, #179771; behavioural: no symbol", evidence=BEHAVIOURAL
                    ),
                ),
                "cuda": _ALWAYS,
                "cpu": _ALWAYS,
            },
        ),
        Feature(
            "device_streams",
            "device streams (torch.mps.Stream / torch.Stream) and record_stream",
            {
                # The 2.15.0 macOS wheel ships torch/mps/streams.py (Stream, stream, set_stream) and an MPS
                # record_stream. Events across streams are a separate feature (cross_stream_events): 2.15.0
                # raises on them. On a real Mac the probe decides (torch.mps.Stream must exist).
                "mps": (
                    Rule(
                        since="2.15",
                        upstream="torch/mps/streams.py and record_stream_mps in the 2.15.0 macOS wheel; "
                        "pytorch#191415, #193464",
                        note="events across streams are not in 2.15 (feature cross_stream_events)",
                        evidence="mps_streams",
                    ),
                ),
                "cuda": (Rule(since="2.4", note="torch.Stream / torch.accelerator"),),
            },
            probe=_probe_streams,
            probe_decides=True,
        ),
        Feature(
            "cross_stream_events",
            "events across device streams (record on one stream, wait on another)",
            {
                # torch/mps/event.py of the 2.15.0 macOS wheel: Event.record()/wait() raise
                # NotImplementedError("Non-default streams are not yet supported.") off the default stream.
                # pytorch#194111 (multi-stream events) open as of RESEARCHED; a 2.16 nightly passes the table,
                # on a real Mac the probe (an event recorded and awaited on a side stream) decides.
                "mps": (
                    Rule(
                        since="2.16",
                        nightly_only=True,
                        merged=None,
                        upstream="pytorch#194111, open; 'Non-default streams are not yet supported.' raised by "
                        "torch.mps.Event in the 2.15.0 macOS wheel",
                        note=f"not merged as of {RESEARCHED}: on a real Mac a probe of torch.mps.Event on a side "
                        "stream decides",
                        evidence="mps_cross_stream_events",
                    ),
                ),
                "cuda": (Rule(since="2.4", note="torch.Event / wait_stream"),),
            },
            probe=_probe_cross_stream_events,
            probe_decides=True,
        ),
        Feature(
            "mps_compile_shader",
            "torch.mps.compile_shader: Metal kernels compiled from source at run time (reported for future recipes)",
            {
                "mps": (
                    Rule(
                        since="2.7",
                        upstream="def compile_shader in torch/mps/__init__.py of every macOS wheel read; "
                        "public since 2.7",
                        evidence="mps_compile_shader",
                    ),
                )
            },
            probe=_probe_mps_api("compile_shader", "public since torch 2.7"),
            probe_decides=True,
        ),
        Feature(
            "mps_load_metallib",
            "torch.mps.load_metallib: precompiled Metal libraries (reported for future recipes)",
            {
                "mps": (
                    Rule(
                        since="2.13",
                        upstream="def load_metallib in torch/mps/__init__.py of the 2.13.0 macOS wheel; pytorch#177276",
                        evidence="mps_load_metallib",
                    ),
                )
            },
            probe=_probe_mps_api("load_metallib", "pytorch#177276, torch 2.13"),
            probe_decides=True,
        ),
        Feature(
            "sdpa_metal_prefill",
            "SDPA prefill (query length > 8) on Metal kernels, flash-style (no full score matrix)",
            {
                "mps": (
                    Rule(
                        since="2.13",
                        upstream="kernels prefill_attention_* in the 2.13.0 macOS wheel; pytorch#181575 (Apr 2026)",
                        conditions="head dims 32/64/72/80/96/128/256; other shapes use the MPSGraph path",
                        evidence="sdpa_prefill_kernels",
                    ),
                ),
            },
        ),
        Feature(
            "sdpa_metal_gqa",
            "SDPA with grouped K/V (enable_gqa) without materialising repeated K/V",
            {
                "mps": (
                    Rule(
                        since="2.13",
                        merged=_d(2026, 5, 11),
                        upstream="pytorch#183280; behavioural: no symbol",
                        conditions="Metal kernel paths only; the MPSGraph fallback still repeats K/V",
                        evidence=BEHAVIOURAL,
                    ),
                ),
                "cuda": (Rule(since="2.5", upstream="enable_gqa"),),
                "cpu": (Rule(since="2.5", upstream="enable_gqa"),),
            },
            probe=_probe_sdpa_gqa,
        ),
        Feature(
            "sdpa_mpp_attention",
            "SDPA prefill on Metal Performance Primitives (matmul2d) kernels",
            {
                "mps": (
                    Rule(
                        since="2.14",
                        min_macos=(26, 2),
                        upstream="kernels prefill_attention_mpp_* in the 2.14.0 macOS wheel, none in 2.13.0; "
                        "pytorch#182256 (May 2026)",
                        evidence="sdpa_mpp_kernels",
                        conditions=(
                            "fp16/bf16, head dims 64/96/128/256, query length > 8; others keep the simdgroup kernel"
                        ),
                    ),
                ),
            },
        ),
        Feature(
            "sdpa_metal_macos26_fixed",
            "Metal SDPA kernels fixed for macOS 26",
            {
                "mps": (
                    Rule(
                        since="2.14",
                        merged=_d(2026, 8, 2),
                        upstream="pytorch#191794; behavioural: no symbol",
                        evidence=BEHAVIOURAL,
                    ),
                )
            },
        ),
        Feature(
            "metal_attention",
            "attention fully on Metal kernels (every SDPA path, no MPSGraph fallback)",
            {
                "mps": (
                    Rule(
                        since="2.16",
                        nightly_only=True,
                        upstream="documented on the main branch only; no single pull request; the MPSGraph SDPA "
                        "sdpa_general_mps is still in the 2.15.0 macOS wheel",
                        evidence="sdpa_without_mpsgraph",
                    ),
                )
            },
        ),
        Feature(
            "sdpa_large_scores_correct",
            "correct SDPA when the score matrix B*H*Lq*Lk has 2^31 or more elements",
            {
                # MPSGraph's matmul/softmax index the score matrix with 32 bits: issue pytorch#179352 measured
                # wrong results (cosine 0.44) above 2^32 elements in the SDPA graph path (fix PR #179592 closed,
                # not confirmed merged); ComfyUI#14837 (Wan / video workflows) sees corruption from about 2^31
                # (its fix, ComfyUI#14838, chunks below 2^30); bmm past 2^32 elements, pytorch#197636, is open.
                "mps": (
                    Rule(
                        never=True,
                        upstream="issue pytorch#179352 (fix #179592 not confirmed merged), ComfyUI#14837; "
                        "behavioural: no symbol",
                        note=f"not fixed as of {RESEARCHED}: split attention so that B*H*Lq*Lk < 2^31",
                        evidence=BEHAVIOURAL,
                    ),
                ),
                "cuda": _ALWAYS,
                "cpu": _ALWAYS,
            },
        ),
        Feature(
            "sdpa_strided_correct",
            "correct SDPA on non-contiguous q/k/v (transposed heads, permuted or chunked views)",
            {
                # The Metal SDPA kernels read q with assumed strides: wrong values for a transposed query at
                # query length <= 8 and head dims 64/96/128 on 2.8.0 (issue pytorch#163597, fix #163598 for 2.9);
                # the same class again after 2.11 (pytorch#181133: permuted q/k/v, head_dim >= 64, [84, 3, 3, 64]
                # gives max abs error 3.6; pytorch#170837, fix #170874: batched strided inputs). ComfyUI#10681
                # (black images, M5, torch 2.11) names #163597. No wheel shows a fix, so every release is treated
                # as affected until the selftest probe sdpa_strided says otherwise on a Mac.
                "mps": (
                    Rule(
                        never=True,
                        upstream="issue pytorch#163597 (fix #163598), again pytorch#181133, #170837 (fix #170874), "
                        "ComfyUI#10681; behavioural: no symbol",
                        note="not confirmed fixed in any release: mpsboost hands SDPA contiguous inputs on MPS",
                        evidence=BEHAVIOURAL,
                    ),
                ),
                "cuda": _ALWAYS,
                "cpu": _ALWAYS,
            },
        ),
        Feature(
            "conv_strided_batch_correct",
            "correct convolution of a strided view (a chunk() of channels, a frame slice) at batch > 1",
            {
                # Issue pytorch#169342 (open, "needs reproduction"): a conv on a chunk() view is right for the
                # first batch element only (M5 Pro, macOS 26.2; torch 2.9.0, 2.9.1, 2.10 nightly); named by
                # ComfyUI#10681. Stock diffusers VAEs never hit it (F.pad copies each causal conv's input); the
                # padding fold of the VAE recipes would hand such views to the conv, so it copies them on MPS.
                "mps": (
                    Rule(
                        never=True,
                        upstream="issue pytorch#169342 (open), ComfyUI#10681; behavioural: no symbol",
                        note="open upstream: the VAE recipes give MPS convolutions dense inputs",
                        evidence=BEHAVIOURAL,
                    ),
                ),
                "cuda": _ALWAYS,
                "cpu": _ALWAYS,
            },
        ),
        Feature(
            "conv3d_metal",
            "conv3d on Metal kernels (near matmul throughput)",
            {
                "mps": (
                    Rule(
                        since="2.14",
                        upstream="kernels conv3d_simd_* / conv3d_mpp_* in the 2.14.0 macOS wheel; "
                        "pytorch#188802, #192229",
                        evidence="conv3d_kernels",
                        conditions=(
                            "issue #192213: 7% of matmul throughput on 2.12, 97% on a 2.14 nightly (fp16, with bias)"
                        ),
                    ),
                ),
                "cuda": _ALWAYS,
                "cpu": _ALWAYS,
            },
        ),
        Feature(
            "pad3d_all_modes_correct",
            "correct reflection and replication pad3d on rank-5 tensors with H*W >= 65536",
            {
                "mps": (
                    Rule(
                        since="2.15",
                        upstream="kernels reflection_pad3d_forward_* / replication_pad3d_forward_* in the "
                        "2.15.0 macOS wheel, pad3d off MPSGraph; pytorch#195147 (issue #194922)",
                        evidence="pad3d_kernels",
                    ),
                ),
                "cuda": _ALWAYS,
                "cpu": _ALWAYS,
            },
        ),
        Feature(
            "histc_no_host_sync",
            "torch.histc counts on the device without a host sync (MoE routing offsets)",
            {
                "mps": (
                    Rule(
                        since="2.15",
                        upstream="kernel histc_atomic_global_float in the 2.15.0 macOS wheel; pytorch#196016",
                        note="before it MPS histc cost about 0.17 ms per bin (43.9 ms for 256 bins, pytorch#198304)",
                        evidence="histc_atomic_float",
                    ),
                ),
                "cuda": _ALWAYS,
                "cpu": _ALWAYS,
            },
        ),
        Feature(
            "rms_norm_fused",
            "F.rms_norm as one fused kernel (input and weight floating point, no grad)",
            {
                # aten's rms_norm on MPS calls the Metal kernel directly when a weight is given (pytorch#145301,
                # merged 2025-01-23, in 2.7); elsewhere on the CPU it is the composite (pow, mean, rsqrt, muls).
                # pytorch#187779 (fp16/bf16 weight multiply kept in fp32) does not matter to fp32 calls.
                "mps": (
                    Rule(
                        since="2.7",
                        upstream="pytorch#145301; kernel rms_norm_float in every macOS wheel read",
                        evidence="rms_norm_kernel",
                    ),
                ),
            },
        ),
        Feature(
            "solve_triangular_fast",
            "torch.linalg.solve_triangular at matmul speed (Gated DeltaNet chunked prefill: two calls per layer)",
            {
                # Up to 2.14 MPS solved through MPSMatrixSolveTriangular at about 15 ms per call whatever its
                # size (kshetrajna12/reflex#1: a matmul inverse was 4x faster on a Qwen3.5 prefill). The 2.15.0
                # macOS wheel ships small triangular-solve Metal kernels written for this solve (pytorch#196900)
                # and no MPSMatrixSolveTriangular any more (pytorch#196241).
                "mps": (
                    Rule(
                        since="2.15",
                        upstream="kernel triangular_solve_small_16 in the 2.15.0 macOS wheel, pytorch#196900, written "
                        "for the Gated DeltaNet solve; before it MPSMatrixSolveTriangular, about 15 ms per call, "
                        "kshetrajna12/reflex#1",
                        evidence="triangular_solve_small",
                    ),
                ),
                "cuda": _ALWAYS,
                "cpu": _ALWAYS,
            },
        ),
        Feature(
            "histc_int",
            "torch.histc on integer input",
            {
                # MPS: integer histc kernels (histc_atomic_*_int/long) ship in the 2.15.0 macOS wheel; not
                # implemented for integer dtypes on CPU ("histogram_cpu" not implemented for 'Long', checked
                # on 2.13); CUDA has it. Elsewhere count with scatter_add or histc on float instead.
                "mps": (
                    Rule(
                        since="2.15",
                        upstream="kernel histc_atomic_global_int in the 2.15.0 macOS wheel; before it "
                        "ostris/ai-toolkit#858, transformers#45685",
                        evidence="histc_atomic_int",
                    ),
                ),
                "cuda": _ALWAYS,
                "cpu": (Rule(never=True, note="'histogram_cpu' not implemented for integer dtypes"),),
            },
        ),
    ]
}
