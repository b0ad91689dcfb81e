"""The device probes: each checks on the real device, with a few elements, what a row of ``features.py``
says by version (``Feature.probe``)."""

from __future__ import annotations

from typing import Callable

from .env import Env
from .rules import Verdict

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
