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

The package: ``env.py`` holds versions and :class:`Env`; ``rules.py`` the rule engine (:class:`Rule`,
:class:`Feature`, :class:`Verdict`, :func:`check`, the probe cache, the wheel evidence); ``probes.py`` the
device probes; ``features.py`` the :data:`FEATURES` table alone, the file a new gate row touches
(``docs/contributing.md``, "a gate feature is a row").
"""

from __future__ import annotations

from .env import DEVICE_TYPES, Env, TorchVersion, parse_torch_version
from .features import FEATURES
from .probes import _probe_streams  # noqa: F401  (tests call the probe itself)
from .rules import (
    _PROBE_CACHE,  # noqa: F401  (tests seed the probe cache)
    BEHAVIOURAL,
    BY_VERSION,
    PROBED,
    RESEARCHED,
    Feature,
    Rule,
    Verdict,
    check,
    check_all,
    clear_probe_cache,
    evidence_text,
    feature_info,
    matrix,
    wheel_evidence,
)

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
