"""Machine facts for a selftest file, the device check, and the scrubbing of personal data.

What a selftest file says about the machine: chip, OS and macOS version, architecture, memory size,
torch build, Python, mpsboost and library versions, and the device. Never a user name, a host name
or a path: :func:`facts` reads none of them, and :func:`scrub` removes any that reach a message
(an exception text that quotes a file path, say) before it is written.
"""

from __future__ import annotations

import getpass
import os
import platform
import re
import socket
import subprocess
import sys
from typing import Any

__all__ = ["REQUIRED_FACTS", "device_absent", "facts", "scrub", "scrub_all"]

# The facts --validate requires in every file.
REQUIRED_FACTS = (
    "os",
    "arch",
    "chip",
    "memory_bytes",
    "torch",
    "torch_build",
    "python",
    "mpsboost",
    "device",
    "device_name",
    "simulated",
    "mps_available",
)


def _run(cmd: list[str]) -> str | None:
    """One line of a system command's output, or None (missing command, error, timeout)."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    text = out.stdout.strip()
    return text.splitlines()[0].strip() if out.returncode == 0 and text else None


def _chip() -> str:
    """The processor's marketing name: ``Apple M3 Max`` on a Mac (sysctl), the CPU model on Linux."""
    if sys.platform == "darwin":
        name = _run(["sysctl", "-n", "machdep.cpu.brand_string"])
        if name:
            return name
    if sys.platform.startswith("linux"):
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                for line in f:
                    if line.lower().startswith(("model name", "hardware", "cpu model")):
                        return line.split(":", 1)[1].strip()
        except OSError:
            pass
    return platform.processor() or platform.machine() or "unknown"


def _memory_bytes() -> int | None:
    """Physical memory of the machine (sysctl hw.memsize on macOS, sysconf elsewhere)."""
    if sys.platform == "darwin":
        text = _run(["sysctl", "-n", "hw.memsize"])
        if text and text.isdigit():
            return int(text)
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return None


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def device_absent(device: str) -> str | None:
    """Why ``device`` cannot run here (one line), or None when it is present."""
    import torch

    if device == "mps":
        if not torch.backends.mps.is_built():
            return (
                "this torch build has no MPS support (torch.backends.mps.is_built() is False); "
                "run on a Mac with an arm64 torch"
            )
        if not torch.backends.mps.is_available():
            return (
                "no MPS device here (torch.backends.mps.is_available() is False; "
                f"{platform.system()} {platform.machine()}); run on an Apple-silicon Mac"
            )
    elif device == "cuda":
        if not torch.cuda.is_available():
            return "no CUDA device here (torch.cuda.is_available() is False)"
    elif device != "cpu":
        return f"unknown device {device!r}; pass mps, cuda or cpu"
    return None


def facts(device: str) -> dict[str, Any]:
    """The machine facts of this process for a run on ``device`` (no personal data)."""
    import torch

    from .. import __version__

    git = getattr(torch.version, "git_version", None)
    cuda = torch.version.cuda
    name = "cpu"
    extra: dict[str, Any] = {}
    if device == "mps":
        name = f"Apple MPS ({_chip()})"
        if hasattr(torch.mps, "recommended_max_memory"):  # what the Metal device lets one process hold
            extra["mps_recommended_max_memory"] = int(torch.mps.recommended_max_memory())
    elif device == "cuda":
        name = torch.cuda.get_device_name()
    return {
        "os": platform.system(),
        "arch": platform.machine(),
        "macos": platform.mac_ver()[0] or None,
        "chip": _chip(),
        "memory_bytes": _memory_bytes(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_build": f"{'cuda ' + cuda if cuda else 'no cuda'}, git {git[:10] if git else 'unknown'}, "
        f"{'debug' if getattr(torch.version, 'debug', False) else 'release'}",
        "mps_built": bool(torch.backends.mps.is_built()),
        "mps_available": bool(torch.backends.mps.is_available()),
        "python": platform.python_version(),
        "mpsboost": __version__,
        "libraries": {d: _version(d) for d in ("diffusers", "transformers", "kernels", "numpy")},
        "device": device,
        "device_name": name,
        "simulated": False,
        **extra,
    }


def _personal() -> list[tuple[str, str]]:
    """(text, replacement) for every piece of personal data a message could carry, longest first."""
    subs: list[tuple[str, str]] = []
    home = os.path.expanduser("~")
    if home and home not in ("~", "/"):
        subs.append((home, "~"))
    for value, label in ((os.getcwd(), "<cwd>"), (sys.prefix, "<python>")):
        if value and value != "/":
            subs.append((value, label))
    for value, label in ((_safe(getpass.getuser), "<user>"), (_safe(socket.gethostname), "<host>")):
        if value and len(value) >= 3:  # a 1-2 letter name would blank out ordinary words
            subs.append((value, label))
    return sorted(subs, key=lambda s: -len(s[0]))


def _safe(fn) -> str | None:
    try:
        return fn()
    except Exception:  # noqa: BLE001 - no user name in the environment, no network name: nothing to scrub
        return None


def scrub(text: str, extra: tuple[str, ...] = ()) -> str:
    """``text`` without the user name, host name, home folder, working folder or Python prefix (and ``extra`` paths)."""
    subs = _personal() + [(e, "<out>") for e in extra if e]
    for value, label in sorted(subs, key=lambda s: -len(s[0])):
        # Whole names only: a user called "test" must not turn "latest" into "la<user>".
        text = re.sub(r"(?<![A-Za-z0-9_])" + re.escape(value) + r"(?![A-Za-z0-9_])", label, text, flags=re.IGNORECASE)
    return text


def scrub_all(obj: Any, extra: tuple[str, ...] = ()) -> Any:
    """Every string inside ``obj`` (dicts, lists) scrubbed, except a value that is itself one of the
    words scrubbed (a user called ``test`` or ``mps`` must not turn ``"size": "test"`` into ``"<user>"``)."""
    if isinstance(obj, str):
        if any(obj.lower() == value.lower() for value, _ in _personal() if "/" not in value):
            return obj
        return scrub(obj, extra)
    if isinstance(obj, dict):
        return {k: scrub_all(v, extra) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [scrub_all(v, extra) for v in obj]
    return obj


# TF32 keeps 10 mantissa bits (unit roundoff 2^-11, about 4.9e-4). On CUDA, cuDNN runs float32 convolutions in
# TF32 by default (torch.backends.cudnn.allow_tf32), and two correct algorithms (a layout, a fold) then differ
# at that scale; a float32 tolerance below it would fail correct code.
TF32_FLOOR = 1e-3


def fp32_tolerance(device: str, dtype_name: str, tol: float) -> float:
    """``tol``, raised to :data:`TF32_FLOOR` for float32 on a CUDA build that lets cuDNN use TF32."""
    import torch

    if dtype_name == "float32" and str(device).startswith("cuda") and torch.backends.cudnn.allow_tf32:
        return max(tol, TF32_FLOOR)
    return tol
