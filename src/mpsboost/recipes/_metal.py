"""The verdict on one of mpsboost's Metal kernels in an environment, shared by the recipes that run them: the
gate's feature for it (``torch.mps.compile_shader`` in this build) and, on a real Mac, the kernel's patch-time
self-check (compiled, then compared with its reference), once per torch build and process."""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from ..gate import Env, Verdict, check

__all__ = ["self_checked"]


def self_checked(
    feature: str, env: Env, cache: dict[str, Optional[str]], self_check: Callable[[], Optional[str]], kernel: str
) -> Verdict:
    """The gate's verdict on ``feature`` in ``env``; on a real Mac also ``self_check()`` (None: it passed, else what
    failed), run once per torch build into ``cache``. A simulated Mac is decided by the gate alone, and says so.
    ``kernel`` names the kernel in the reason."""
    v = check(feature, env)
    if not v.ok or env.simulated or env.device_type != "mps":
        return v
    key = env.torch_version.raw
    if key not in cache:
        cache[key] = self_check()
    why = cache[key]
    if why is not None:
        return dataclasses.replace(v, ok=False, reason=f"{kernel} failed its self-check on this Mac: {why}")
    return dataclasses.replace(v, reason=f"{v.reason}; compiled and checked against the reference on this Mac")
