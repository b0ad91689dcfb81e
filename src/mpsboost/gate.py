"""The version gate: which torch build on which device has which kernel.

One table, :data:`FEATURES`, says for every capability the recipes rely on, per device type, since
which torch version it exists, whether only nightlies have it so far, the upstream change that
brought it (for the reason text) and an optional runtime probe. :func:`check` answers with a
:class:`Verdict`. Nothing else in mpsboost compares torch versions.

Version strings (FACTS.md): ``2.15.0`` (release; an RC reports the same), ``2.15.0+cpu`` (local tag),
``2.15.0a0+gitabc1234`` (source build), ``2.16.0.dev20261101`` (nightly). PEP 440 sorts
``2.16.0.dev...`` below ``2.16.0``, so a plain ``>=`` would be wrong for nightlies: we compare the
release triple, and a nightly of the very version that introduces a feature counts only from the
feature's merge date, where that date is known.
"""
from __future__ import annotations

import datetime as _dt
import platform
import re
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
]

DEVICE_TYPES = ("cpu", "cuda", "mps")

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
    """Parse any torch version string of FACTS.md; raise :class:`GateError` for anything else."""
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
        return cls(torch_version=tv, device_type=dev.type, device_name=name, capability=cap)

    @classmethod
    def simulate(
        cls,
        device: str = "mps",
        torch_version: str | None = None,
        *,
        capability: tuple[int, int] | None = None,
        device_name: str | None = None,
    ) -> "Env":
        """An environment for a dry run: ``Env.simulate("mps", "2.14.1")``.

        ``device`` may carry a CUDA compute capability as ``"cuda:9.0"``.
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
        name = device_name or {"mps": "Apple MPS (simulated)", "cuda": f"CUDA sm_{capability[0]}{capability[1]} (simulated)" if capability else "CUDA (simulated)", "cpu": "CPU (simulated)"}.get(dtype_, dtype_)
        return cls(torch_version=tv, device_type=dtype_, device_name=name, capability=capability, simulated=True)

    def with_device(self, device_type: str) -> "Env":
        return replace(self, device_type=device_type)

    def describe(self) -> str:
        cap = f", sm_{self.capability[0]}{self.capability[1]}" if self.capability else ""
        sim = " (simulated)" if self.simulated and "simulated" not in self.device_name else ""
        return f"torch {self.torch_version.raw} on {self.device_type} [{self.device_name}{cap}]{sim}"

    def to_dict(self) -> dict:
        return {
            "torch_version": self.torch_version.raw,
            "device_type": self.device_type,
            "device_name": self.device_name,
            "capability": list(self.capability) if self.capability else None,
            "simulated": self.simulated,
            "os": self.os,
        }


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str

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


def _rule_verdict(feature: Feature, rule: Rule, env: Env) -> Verdict:
    where = f"{env.device_type}"
    ups = f" ({rule.upstream})" if rule.upstream else ""
    if rule.never:
        return Verdict(False, f"{feature.description}: not in any torch build on {where} yet{ups}" + (f"; {rule.note}" if rule.note else ""))
    if rule.min_capability is not None:
        cap = env.capability
        need = f"{rule.min_capability[0]}.{rule.min_capability[1]}"
        if cap is None:
            return Verdict(False, f"{feature.description} needs CUDA compute capability >= {need}; unknown here")
        if tuple(cap) < tuple(rule.min_capability):
            return Verdict(False, f"{feature.description} needs CUDA compute capability >= {need}; this device is {cap[0]}.{cap[1]}")
    since = rule._since()
    tv = env.torch_version
    if since is not None:
        have, need = tv.release, since.release
        label = f"torch {since.raw}" + (" nightlies" if rule.nightly_only else "")
        if have < need:
            return Verdict(False, f"{feature.description} needs {label}{ups}; this is torch {tv.raw}")
        if have[:2] == need[:2] and tv.kind == "nightly" and rule.merged is not None:
            if tv.nightly_date is None:
                return Verdict(False, f"{feature.description}: nightly {tv.raw} carries no date to compare with the merge of{ups} on {rule.merged}")
            if tv.nightly_date < rule.merged:
                return Verdict(False, f"{feature.description}: nightly {tv.raw} predates the merge of{ups} on {rule.merged}")
        if have[:2] == need[:2] and tv.kind == "source" and rule.nightly_only and rule.merged is not None:
            return Verdict(True, f"{feature.description}: source build {tv.raw}, assumed to include{ups} (merged {rule.merged})")
        return Verdict(True, f"{feature.description}: in {label}{ups}; this is torch {tv.raw}")
    return Verdict(True, f"{feature.description}: available on {where}" + (f"; {rule.note}" if rule.note else ""))


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
    if verdict.ok and feat.probe is not None and not env.simulated:
        probed = feat.probe(env)
        if probed is not None:
            return probed
    return verdict


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


# ----------------------------------------------------------------------------- probes

def _probe_triton(env: Env) -> Verdict | None:
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return Verdict(False, "triton is not installed")
    return None


def _probe_grouped_mm(env: Env) -> Verdict | None:
    import torch

    if not hasattr(torch.nn.functional, "grouped_mm") and not hasattr(torch, "_grouped_mm"):
        return Verdict(False, "this torch build has neither torch.nn.functional.grouped_mm nor torch._grouped_mm")
    return None


def _probe_scaled_grouped_mm(env: Env) -> Verdict | None:
    import torch

    if not hasattr(torch, "_scaled_grouped_mm") and not hasattr(torch.nn.functional, "scaled_grouped_mm"):
        return Verdict(False, "this torch build has no scaled_grouped_mm")
    return None


def _probe_streams(env: Env) -> Verdict | None:
    import torch

    if not hasattr(torch, "Stream") or not hasattr(torch, "accelerator"):
        return Verdict(False, "this torch build lacks torch.Stream / torch.accelerator")
    return None


def _d(y: int, m: int, d: int) -> _dt.date:
    return _dt.date(y, m, d)


_ALWAYS = (Rule(),)

FEATURES: dict[str, Feature] = {
    f.name: f
    for f in [
        Feature(
            "pad_constant_native",
            "constant F.pad on a native kernel (no MPSGraph driver-memory blow-up)",
            {
                "mps": (Rule(since="2.15", upstream="pytorch#195368", note="before it, each pad built an MPSGraph; Wan2.2 VAE decode reached 270 GiB driver memory"),),
                "cuda": _ALWAYS,
                "cpu": _ALWAYS,
            },
        ),
        Feature(
            "pad_rank5_correct",
            "correct constant time-padding of rank-5 tensors with H*W >= 65536",
            {
                "mps": (Rule(since="2.15", upstream="issue pytorch#194922, fixes pytorch#194944 and #195147"),),
                "cuda": _ALWAYS,
                "cpu": _ALWAYS,
            },
        ),
        Feature(
            "grouped_mm",
            "native grouped matmul with offsets read on the device",
            {
                "mps": (Rule(since="2.15", upstream="pytorch#194917, #194933"),),
                "cuda": (
                    Rule(since="2.8", min_capability=(9, 0), upstream="torch._grouped_mm (sm90)"),
                    Rule(since="2.9", min_capability=(8, 0), upstream="torch._grouped_mm (sm80+)"),
                ),
                "cpu": (Rule(since="2.10", upstream="torch.nn.functional.grouped_mm", note="needs 16-byte aligned row strides; no bias, no fp8"),),
            },
            probe=_probe_grouped_mm,
        ),
        Feature(
            "float8_storage",
            "torch.float8_e4m3fn tensors on the device",
            {
                "mps": (Rule(since="2.15", upstream="pytorch#194074", note="before it: 'Trying to convert Float8_e4m3fn to the MPS backend'"),),
                "cuda": (Rule(since="2.1"),),
                "cpu": (Rule(since="2.1"),),
            },
        ),
        Feature(
            "scaled_mm",
            "float8 scaled matmul (tensorwise and rowwise scales)",
            {
                "mps": (Rule(since="2.15", upstream="pytorch#196916", note="general kernel 0.12-0.25x of bf16 for M >= 512"),),
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
                "mps": (Rule(never=True, upstream="pytorch#197862, open when last seen"),),
                "cuda": (Rule(since="2.4", min_capability=(8, 9), upstream="mpsboost Triton kernel"),),
            },
            probe=_probe_triton,
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
                "mps": (Rule(since="2.15", upstream="pytorch#186927, #189628"),),
                "cuda": _ALWAYS,
                "cpu": _ALWAYS,
            },
        ),
        Feature(
            "linear_3d_fast",
            "F.linear on [B,1,K] as fast as on [B,K]",
            {
                "mps": (Rule(since="2.15", upstream="fix pytorch#189855 of issue #189847 (8.5x slower before)"),),
                "cuda": _ALWAYS,
                "cpu": _ALWAYS,
            },
        ),
        Feature(
            "softmax_native",
            "softmax on a native kernel (one fp32 row of 128,256: 57.4 -> 7.1 us on MPS)",
            {
                "mps": (Rule(since="2.15", upstream="pytorch#196071"),),
                "cuda": _ALWAYS,
                "cpu": _ALWAYS,
            },
        ),
        Feature(
            "sdpa_broadcast",
            "SDPA with batch/head broadcasting",
            {
                "mps": (Rule(since="2.15", upstream="pytorch#189631, #179771"),),
                "cuda": _ALWAYS,
                "cpu": _ALWAYS,
            },
        ),
        Feature(
            "device_streams",
            "device streams, record_stream and cross-stream events",
            {
                "mps": (Rule(since="2.16", nightly_only=True, upstream="pytorch#191415, #193464, #194111", merged=None),),
                "cuda": (Rule(since="2.4", note="torch.Stream / torch.accelerator"),),
            },
            probe=_probe_streams,
        ),
        Feature(
            "metal_attention",
            "attention fully on Metal kernels",
            {"mps": (Rule(since="2.16", nightly_only=True, upstream="documented on the main branch only"),)},
        ),
        Feature(
            "histc_int",
            "torch.histc on integer input",
            {
                # Not implemented for integer dtypes on CPU either ("histogram_cpu" not implemented for
                # 'Long', checked on 2.13); CUDA has it. Count with scatter_add or histc on float instead.
                "mps": (Rule(never=True, upstream="ostris/ai-toolkit#858"),),
                "cuda": _ALWAYS,
                "cpu": (Rule(never=True, note="'histogram_cpu' not implemented for integer dtypes"),),
            },
        ),
    ]
}
