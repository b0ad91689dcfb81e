"""Torch versions and the environment a decision is made for: :func:`parse_torch_version` reads every form
torch reports (see :mod:`mpsboost.gate`), :class:`Env` is a real (``Env.detect``) or simulated
(``Env.simulate``) torch build and device."""

from __future__ import annotations

import datetime as _dt
import functools
import platform
import re
from dataclasses import dataclass, field

from packaging.version import InvalidVersion, Version

from ..errors import GateError

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
    """Parse a torch version string (the forms in the docstring of :mod:`mpsboost.gate`); raise :class:`GateError` for
    anything else."""
    if not isinstance(text, str):
        raise TypeError(f"torch version must be a str such as '2.15.0', got {type(text).__name__}: {text!r}")
    return _parse(text)


@functools.lru_cache(maxsize=256)  # every gate rule asks; the value is frozen
def _parse(text: str) -> TorchVersion:
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
