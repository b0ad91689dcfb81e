"""The rule engine: :class:`Rule` (when one device type has a feature), :class:`Feature` (a row of the
table in ``features.py``), :class:`Verdict`, :func:`check` and its probe cache, and what the macOS wheels
show for a rule (``data/mps_wheels.json``)."""

from __future__ import annotations

import datetime as _dt
import threading
from dataclasses import dataclass, replace
from typing import Callable, Mapping

from ..errors import GateError
from .env import Env, TorchVersion, parse_torch_version

# Verdict.decided_by: the version rule of FEATURES, or a probe of this build on the real device.
BY_VERSION = "by version"
PROBED = "probed"

# The date the upstream status in FEATURES was last checked against pytorch's repository and tracker.
RESEARCHED = _dt.date(2026, 11, 30)

# Rule.evidence of a fix that no kernel, symbol or API of a wheel shows (its pull request is the evidence).
BEHAVIOURAL = "behavioural"


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


# The table the engine reads. gate/features.py fills it (it imports this module, so this one cannot import
# it): one Feature per row, keyed by name.
FEATURES: dict[str, Feature] = {}


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
