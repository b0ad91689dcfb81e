"""The bug probes: each known upstream MPS bug at its trigger size, stock torch against a CPU reference.

Every probe names its upstream issue or pull request and the gate feature it confirms or refutes,
runs plain torch (no mpsboost code) on the device at the size where the bug shows, compares with the
CPU (or times against a workaround) and records one verdict:

* ``has the bug``: this build shows it;
* ``fixed``: this build does not;
* ``not applicable``: the bug is MPS-only and this run is not on MPS (the probe still runs, at a
  small size, so that the file shows it works);
* ``skipped``: not run here (memory, time budget, a single process), with why;
* ``error``: the probe itself broke (the message says how).

Each probe keeps memory and time bounded so that a 16 GB Mac survives the whole run: the attention
probe asks for its memory first and is skipped when the device cannot spare it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "PROBES",
    "VERDICTS",
    "Probe",
    "decisions",
    "feature_ok",
    "gemm_sample",
    "gemm_verdict",
    "run_probe",
    "run_probes",
]

VERDICTS = ("has the bug", "fixed", "not applicable", "skipped", "error")
EVIDENCE = ("has the bug", "fixed")  # verdicts that are a finding about this build


@dataclass(frozen=True)
class Probe:
    name: str
    upstream: tuple[str, ...]  # issue / pull request numbers, the first one is the bug
    what: str  # the bug, in words
    trigger: str  # the size at which it shows
    feature: str | None  # the gate feature a "fixed" confirms and a "has the bug" refutes (None: no gate decision)
    run: Callable[[Ctx], dict]
    decision: str = ""  # the mpsboost decision the verdict informs, in words


@dataclass(frozen=True)
class Ctx:
    device: str
    small: bool  # CPU and CI runs: small sizes
    repeats: int

    def to(self, x):
        return x.to(self.device)


def _out(verdict: str, detail: str, **measured: Any) -> dict:
    return {"verdict": verdict, "detail": detail, "measured": measured}


def _rel(got, ref) -> float:
    got, ref = got.detach().float().cpu(), ref.detach().float().cpu()
    den = float(ref.norm())
    return float((got - ref).norm()) / den if den > 0 else float((got - ref).norm())


def _time(ctx: Ctx, fn: Callable[[], Any], calls: int = 1) -> float:
    from ..bench import time_fn

    return time_fn(fn, device=ctx.device, warmup=3, repeats=max(3, ctx.repeats), calls=calls).median_s


def _mps_only(ctx: Ctx, result: dict) -> dict:
    """On a device other than MPS an MPS-only bug is not applicable; the measurement stays in the record."""
    if ctx.device == "mps":
        return result
    return dict(result, verdict="not applicable", detail=f"MPS-only bug; on {ctx.device}: {result['detail']}")


# ------------------------------------------------------------------------------------------ probes


def _pad_rank5(ctx: Ctx, mode: str = "constant") -> dict:
    import torch
    import torch.nn.functional as F

    # Wan's causal conv pads (1, 1, 1, 1, 2, 0): width, height, then two frames in front.
    hw = 16 if ctx.small else 256  # 256 x 256 = 65536 = 2^16, the first size that corrupts
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 4, 3, hw, hw, generator=g)
    pad = (1, 1, 1, 1, 2, 0)
    ref = F.pad(x, pad, mode=mode)
    got = F.pad(ctx.to(x), pad, mode=mode).cpu()
    wrong = float((got - ref).abs().gt(1e-6).float().mean())
    detail = (
        f"F.pad {mode} {pad} on [1, 4, 3, {hw}, {hw}] (H*W = {hw * hw}): {wrong:.1%} of elements differ from the CPU"
    )
    return _mps_only(ctx, _out("has the bug" if wrong > 0 else "fixed", detail, wrong_fraction=wrong, hw=hw * hw))


def _pad_driver_memory(ctx: Ctx) -> dict:
    import torch
    import torch.nn.functional as F

    calls = 8 if ctx.small else 200
    hw = 16 if ctx.small else 64
    x = ctx.to(torch.randn(1, 96, 3, hw, hw))
    out_bytes = 96 * 5 * (hw + 2) ** 2 * 4  # one fp32 output of the pad
    if ctx.device != "mps":
        for _ in range(calls):
            F.pad(x, (1, 1, 1, 1, 2, 0))
        return _mps_only(ctx, _out("fixed", f"{calls} pads ran; driver memory is an MPS counter", calls=calls))
    torch.mps.synchronize()
    torch.mps.empty_cache()
    before = torch.mps.driver_allocated_memory()
    for _ in range(calls):
        y = F.pad(x, (1, 1, 1, 1, 2, 0))
        del y
    torch.mps.synchronize()
    torch.mps.empty_cache()
    grown = torch.mps.driver_allocated_memory() - before
    per_call = grown / calls
    # Fixed: the outputs are freed and the cache emptied, nothing stays. The bug kept about 31 MiB per
    # call in MPSGraph (270 GiB over 8,764 pads of a Wan2.2 decode); more than one output per call kept is the bug.
    bad = per_call > out_bytes
    detail = (
        f"{calls} constant pads of [1, 96, 3, {hw}, {hw}]: driver memory grew {grown / 2**20:.1f} MiB "
        f"({per_call / 2**20:.2f} MiB per call)"
    )
    return _out("has the bug" if bad else "fixed", detail, grown_bytes=int(grown), per_call_bytes=per_call, calls=calls)


def _grouped_mm(ctx: Ctx) -> dict:
    import torch

    fn = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if fn is None:
        return _mps_only(ctx, _out("has the bug", "this torch build has no grouped_mm at all"))
    e, k, n = (4, 16, 16) if ctx.small else (8, 256, 256)
    counts = [(i * 7) % 13 + (1 if ctx.small else 40) for i in range(e)]  # uneven groups, one per expert
    m = sum(counts)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(m, k, generator=g), torch.randn(e, k, n, generator=g)
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    ref = torch.cat([a[s:t] @ b[i] for i, (s, t) in enumerate(zip([0] + ends.tolist()[:-1], ends.tolist()))])
    dtype = torch.float32 if ctx.device == "cpu" else torch.bfloat16
    try:
        got = fn(ctx.to(a).to(dtype), ctx.to(b).to(dtype), offs=ctx.to(ends)).float().cpu()
    except (NotImplementedError, RuntimeError) as e_:
        first = str(e_).strip().splitlines()[0][:200]
        return _mps_only(
            ctx,
            _out("has the bug", f"grouped_mm with offsets does not run on {ctx.device}: {type(e_).__name__}: {first}"),
        )
    err = _rel(got, ref)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    detail = (
        f"grouped_mm of {e} groups ({m} rows, K={k}, N={n}) with offsets on the device: rel. error {err:.1e} vs CPU"
    )
    return _mps_only(ctx, _out("has the bug" if err > tol else "fixed", detail, rel_error=err, rows=m))


def _fp8_cast(ctx: Ctx) -> dict:
    import torch

    if not hasattr(torch, "float8_e4m3fn"):
        return _mps_only(ctx, _out("has the bug", "this torch build has no torch.float8_e4m3fn"))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g) * 8
    ref = x.to(torch.float8_e4m3fn).float()
    try:
        got = ctx.to(x).to(torch.float8_e4m3fn).float().cpu()
    except (TypeError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0][:200]
        return _mps_only(ctx, _out("has the bug", f"float8_e4m3fn on {ctx.device}: {type(e).__name__}: {first}"))
    same = bool(torch.equal(got, ref))
    return _mps_only(
        ctx,
        _out(
            "fixed" if same else "has the bug",
            "4096 values cast to float8_e4m3fn on the device and back: "
            f"{'identical to' if same else 'differ from'} the CPU cast",
        ),
    )


def _scaled_mm(ctx: Ctx) -> dict:
    import torch

    # F.scaled_mm (aten::_scaled_mm_v2): the 2.15.0 macOS wheel registers an MPS kernel for it alone; its
    # torch._scaled_mm (v1) is CPU only there (data/mps_wheels.json), so probing v1 would report a false miss.
    F = torch.nn.functional
    if getattr(F, "scaled_mm", None) is None or not hasattr(torch, "float8_e4m3fn"):
        return _mps_only(ctx, _out("has the bug", "this torch build has no torch.nn.functional.scaled_mm / float8"))
    rw = F.ScalingType.RowWise

    def fn(a, b, *, scale_a, scale_b, out_dtype):
        return F.scaled_mm(a, b, scale_a, rw, scale_b, rw, output_dtype=out_dtype)

    m, k, n = (16, 64, 64) if ctx.small else (1024, 2048, 2048)  # M >= 512: the slow general kernel of #196916
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) / k**0.5
    sa = x.abs().amax(1, keepdim=True) / 448
    sb = w.abs().amax(1, keepdim=True) / 448
    xq, wq = (x / sa).to(torch.float8_e4m3fn), (w / sb).to(torch.float8_e4m3fn)
    ref = (xq.float() * sa) @ (wq.float() * sb).t()
    d = ctx.device
    args = (
        ctx.to(xq),
        ctx.to(wq).t(),
    )
    kw = {"scale_a": ctx.to(sa), "scale_b": ctx.to(sb.t().contiguous()), "out_dtype": torch.bfloat16}
    try:
        got = fn(*args, **kw)
    except (NotImplementedError, RuntimeError, TypeError) as e:
        first = str(e).strip().splitlines()[0][:200]
        return _mps_only(ctx, _out("has the bug", f"rowwise F.scaled_mm on {d}: {type(e).__name__}: {first}"))
    err = _rel(got, ref)
    t_fp8 = _time(ctx, lambda: fn(*args, **kw))
    xb, wb = ctx.to(x).to(torch.bfloat16), ctx.to(w).to(torch.bfloat16)
    t_bf16 = _time(ctx, lambda: xb @ wb.t())
    speed = t_bf16 / t_fp8 if t_fp8 > 0 else None
    detail = (
        f"rowwise F.scaled_mm at M={m}, K={k}, N={n}: rel. error {err:.1e} vs CPU; {speed:.2f}x the speed of bf16 "
        "(pytorch#196916: 0.12-0.25x for M >= 512, a storage format only)"
    )
    return _mps_only(
        ctx,
        _out(
            "has the bug" if err > 2e-2 else "fixed",
            detail,
            rel_error=err,
            fp8_s=t_fp8,
            bf16_s=t_bf16,
            speed_vs_bf16=speed,
            m=m,
        ),
    )


def _fp8_metal_gemv(ctx: Ctx) -> dict:
    """mpsboost's Metal fp8 GEMV (mpsboost.ops.fp8_metal), the one probe of mpsboost's own code: compiled and
    checked against the reference (its patch-time self-check), then timed at decode against the bf16 product and
    against torch's F.scaled_mm few-rows kernels (the activation quantised first, as fp8_weights does), at the
    Qwen3.6 widths: a dense [4096, 2048] layer, and the routed experts of one token (8 of 256, gate/up [1024, 2048])
    by the grouped call on the whole stack against bf16 grouped_mm."""
    import torch

    if ctx.device != "mps":  # not a torch bug: mpsboost's own kernel, which only a Mac compiles
        return _out(
            "not applicable", f"mpsboost's own Metal kernel, not a torch bug: it runs on MPS only, not on {ctx.device}"
        )
    if not callable(getattr(torch.mps, "compile_shader", None)):
        return _out("has the bug", "this torch build has no torch.mps.compile_shader")
    from ..ops import fp8_metal

    why = fp8_metal.self_check(ctx.device)
    if why is not None:
        return _out("has the bug", f"self-check failed: {why}")
    n, k = (64, 128) if ctx.small else (4096, 2048)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g) / k**0.5
    sw = w.abs().amax(1, keepdim=True) / 448
    q = ctx.to((w / sw).to(torch.float8_e4m3fn))
    x = ctx.to(torch.randn(1, k, generator=g)).to(torch.bfloat16)
    swd, wb = ctx.to(sw), ctx.to(w).to(torch.bfloat16)
    t_metal = _time(ctx, lambda: fp8_metal.rows_gemv(x, q, swd, None, bn=1, bk=k), calls=20)
    t_bf16 = _time(ctx, lambda: x @ wb.t(), calls=20)
    measured: dict[str, Any] = {"dense_metal_s": t_metal, "dense_bf16_s": t_bf16, "n": n, "k": k}
    detail = f"dense [{n}, {k}], one row: {t_bf16 / t_metal:.2f}x the speed of bf16"
    F = torch.nn.functional
    if getattr(F, "scaled_mm", None) is not None:
        from ..ops.fp8 import quantize_rows_few, scaled_mm_v2

        wt, srow = q.t(), swd.t().contiguous()

        def sm():
            xq, xs = quantize_rows_few(x.clone())
            return scaled_mm_v2(xq, wt, xs, srow, None, torch.bfloat16)

        try:
            measured["dense_scaled_mm_s"] = t_sm = _time(ctx, sm, calls=20)
            detail += f", {t_sm / t_metal:.2f}x that of F.scaled_mm (quantisation included)"
        except (NotImplementedError, RuntimeError, TypeError) as e:
            detail += f"; F.scaled_mm: {type(e).__name__}"
    e_all, top, inter = (8, 2, 32) if ctx.small else (256, 8, 512)
    h = k
    codes = ctx.to((torch.randn(e_all, 2 * inter, h, generator=g) * 8).to(torch.float8_e4m3fn))
    scale = ctx.to(torch.full((e_all, 2 * inter, 1), 1.0 / 64))
    ids = torch.randperm(e_all, generator=g)[:top].sort().values
    offs = ctx.to(torch.searchsorted(ids, torch.arange(e_all), right=True).to(torch.int32))
    rows = x.expand(top, h)
    t_grouped = _time(ctx, lambda: fp8_metal.rows_gemv(rows, codes, scale, offs, bn=1, bk=h), calls=20)
    measured["experts_metal_s"] = t_grouped
    grouped = getattr(torch, "_grouped_mm", None)
    if grouped is not None:
        stack = codes.to(torch.bfloat16).transpose(1, 2)
        try:
            t_gbf = _time(ctx, lambda: grouped(rows, stack, offs=offs), calls=20)
            measured["experts_bf16_grouped_mm_s"] = t_gbf
            detail += f"; routed experts ({top} of {e_all}): {t_gbf / t_grouped:.2f}x the speed of bf16 grouped_mm"
        except (NotImplementedError, RuntimeError, TypeError) as e:
            detail += f"; bf16 grouped_mm: {type(e).__name__}"
        del stack
    return _out("fixed", f"compiled, matches the reference; {detail}", **measured)


def _affine_metal_gemv(ctx: Ctx) -> dict:
    """mpsboost's Metal low-bit kernels for MLX affine weights (mpsboost.ops.affine_metal): compiled and checked
    against the reference (their patch-time self-check), then timed at decode, one row, at the Qwen3.6 widths
    (hidden 2048; DeltaNet in_proj_qkvz [12288, 2048], out_proj [2048, 4096]; gated attention q_proj [8192, 2048],
    k/v_proj [512, 2048]): 4-bit and 8-bit (groups of 64, bf16 scales) against bf16 and torch's own
    _weight_int4pack_mm / _weight_int8pack_mm (int8pack fed a per-channel requantisation: a timing stand-in); and
    the routed experts of one token (8 of 256, gate/up [1024, 2048], down [2048, 512]) by the grouped call on the
    whole stack against bf16 grouped_mm. Off a Mac the kernels do not run: not evidence."""
    import torch

    if ctx.device != "mps":
        return _mps_only(
            ctx, _out("not applicable", "the kernels are Metal (mpsboost's own): they run on MPS only; not evidence")
        )
    if not callable(getattr(torch.mps, "compile_shader", None)):
        return _out("has the bug", "this torch build has no torch.mps.compile_shader")
    from ..ops import affine, affine_metal

    why = affine_metal.self_check(ctx.device)
    if why is not None:
        return _out("has the bug", f"self-check failed: {why}")
    g = torch.Generator().manual_seed(0)
    gs = 64

    def weights(*shape: int, bits: int):
        *lead, n, k = shape
        words = torch.randint(-(2**31), 2**31 - 1, (*lead, n, k * bits // 32), generator=g, dtype=torch.int32)
        s = (torch.rand(*lead, n, k // gs, generator=g) * 0.02 + 0.001).to(torch.bfloat16)
        b = (-s.float() * (1 << (bits - 1))).to(torch.bfloat16)
        return ctx.to(words.view(torch.uint32)), ctx.to(s), ctx.to(b)

    shapes = [(64, 128), (32, 256)] if ctx.small else [(12288, 2048), (2048, 4096), (8192, 2048), (512, 2048)]
    measured: dict[str, Any] = {"group_size": gs}
    parts = []
    for n, k in shapes:
        x = ctx.to(torch.randn(1, k, generator=g)).to(torch.bfloat16)
        wb = ctx.to(torch.randn(n, k, generator=g) / k**0.5).to(torch.bfloat16)
        t_bf16 = _time(ctx, lambda: x @ wb.t(), calls=20)
        row = {"bf16_s": t_bf16}
        for bits in (4, 8):
            q, s, b = weights(n, k, bits=bits)
            row[f"metal_{bits}bit_s"] = _time(
                ctx, lambda: affine_metal.rows_gemv(x, q, s, b, None, bits=bits, group_size=gs), calls=20
            )
            try:
                if bits == 4:
                    pk, sz, _ = affine.to_int4pack(q, s, b, gs, dtype=x.dtype, device_type=q.device.type)
                    row["int4pack_s"] = _time(ctx, lambda: affine.int4pack_linear(x, pk, sz, gs), calls=20)
                else:
                    w8, sc = affine.to_int8pack(q.cpu(), s.cpu(), b.cpu(), gs, dtype=x.dtype, exact=False)
                    w8, sc = ctx.to(w8), ctx.to(sc)
                    row["int8pack_s"] = _time(ctx, lambda: affine.int8pack_linear(x, w8, sc), calls=20)
            except (NotImplementedError, RuntimeError, TypeError, ValueError) as e:  # ValueError: no pack here
                row[f"int{bits}pack_error"] = f"{type(e).__name__}: {str(e)[:120]}"
        measured[f"dense_{n}x{k}"] = row
        parts.append(
            f"[{n}, {k}]: 4-bit {t_bf16 / row['metal_4bit_s']:.2f}x, 8-bit {t_bf16 / row['metal_8bit_s']:.2f}x bf16"
            + (f", int4pack {t_bf16 / row['int4pack_s']:.2f}x" if "int4pack_s" in row else "")
            + (f", int8pack {t_bf16 / row['int8pack_s']:.2f}x" if "int8pack_s" in row else "")
        )
    e_all, top, inter, h = (8, 2, 32, 128) if ctx.small else (256, 8, 512, 2048)
    ids = torch.randperm(e_all, generator=g)[:top].sort().values
    offs = ctx.to(torch.searchsorted(ids, torch.arange(e_all), right=True).to(torch.int32))
    xe = ctx.to(torch.randn(1, h, generator=g)).to(torch.bfloat16)
    rows = xe.expand(top, h)
    for bits in (4, 8):
        q, s, b = weights(e_all, 2 * inter, h, bits=bits)
        t = _time(ctx, lambda: affine_metal.rows_gemv(rows, q, s, b, offs, bits=bits, group_size=gs), calls=20)
        measured[f"experts_gate_up_metal_{bits}bit_s"] = t
    grouped = getattr(torch, "_grouped_mm", None)
    detail = "; ".join(parts)
    if grouped is not None:
        stack = ctx.to(torch.randn(e_all, h, 2 * inter, generator=g) / h**0.5).to(torch.bfloat16)
        try:
            t_gbf = _time(ctx, lambda: grouped(rows, stack, offs=offs), calls=20)
            measured["experts_gate_up_bf16_grouped_mm_s"] = t_gbf
            detail += (
                f"; routed experts ({top} of {e_all}) gate/up: 4-bit "
                f"{t_gbf / measured['experts_gate_up_metal_4bit_s']:.2f}x, 8-bit "
                f"{t_gbf / measured['experts_gate_up_metal_8bit_s']:.2f}x bf16 grouped_mm"
            )
        except (NotImplementedError, RuntimeError, TypeError) as e:
            detail += f"; bf16 grouped_mm: {type(e).__name__}"
        del stack
    return _out("fixed", f"compiled, matches the reference; speed vs bf16, one row: {detail}", **measured)


def _dispatch_cost(ctx: Ctx) -> dict:
    """The constants of mpsboost's Mac cost model (``mpsboost.bench.decode_cost.predict``), measured here:
    ``c_metal_us``, the time per dispatch of a Metal-shader op (an in-place add of a 1-element tensor, 200 calls
    between synchronisations); ``c_graph_us``, the same for an MPSGraph op (``prelu``: an MPSGraph in the 2.14.1 and
    2.15.0 wheels, data/mps_dispatch_kinds.json); ``achieved_gbs``, the bandwidth of a bf16 GEMV at decode (one
    row by a 64 MiB weight, the read of a decode step's projections) and ``eta``, its share of the chip's peak
    where the chip is one the model names. The validator accepts them only within physical bounds
    (``report.COST_BOUNDS``). Off a Mac the numbers are the CPU's: not evidence."""
    import torch

    from ..bench.decode_cost import CHIPS
    from .machine import _chip

    x = ctx.to(torch.zeros(1))
    a, w = ctx.to(torch.randn(1, 8)), ctx.to(torch.full((1,), 0.25))
    calls = 20 if ctx.small else 200
    t_metal = _time(ctx, lambda: x.add_(1.0), calls=calls) / calls
    t_graph = _time(ctx, lambda: torch.prelu(a, w), calls=calls) / calls
    n, k = (64, 64) if ctx.small else (8192, 4096)
    dtype = torch.float32 if ctx.device == "cpu" else torch.bfloat16
    weight = ctx.to(torch.randn(n, k) / k**0.5).to(dtype)
    row = ctx.to(torch.randn(1, k)).to(dtype)
    t_gemv = _time(ctx, lambda: row @ weight.t(), calls=10) / 10
    gbs = weight.numel() * weight.element_size() / t_gemv / 1e9
    chip = _chip() if ctx.device == "mps" else ""
    known = [c for c in sorted(CHIPS, key=len, reverse=True) if chip.endswith(c)]
    eta = gbs / CHIPS[known[0]][0] if known and ctx.device == "mps" else None
    measured = {
        "c_metal_us": t_metal * 1e6,
        "c_graph_us": t_graph * 1e6,
        "achieved_gbs": gbs,
        "eta": eta,
        "chip_model": known[0] if known else None,
    }
    detail = (
        f"per dispatch: Metal shader {t_metal * 1e6:.2f} us, MPSGraph {t_graph * 1e6:.2f} us; bf16 GEMV "
        f"{gbs:.0f} GB/s" + (f", eta {eta:.2f} of {known[0]}'s peak" if eta is not None else "")
    )
    return _mps_only(ctx, _out("fixed", f"measured (the cost model's constants): {detail}", **measured))


def _linear_b1k(ctx: Ctx) -> dict:
    import torch
    import torch.nn.functional as F

    b, k, n = (4, 64, 64) if ctx.small else (4, 4096, 4096)
    dtype = torch.float32 if ctx.device == "cpu" else torch.bfloat16
    g = torch.Generator().manual_seed(0)
    w = ctx.to(torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    x2 = ctx.to(torch.randn(b, k, generator=g)).to(dtype)
    x3 = x2[:, None, :]
    t2 = _time(ctx, lambda: F.linear(x2, w), calls=10)
    t3 = _time(ctx, lambda: F.linear(x3, w), calls=10)
    err = _rel(F.linear(x3, w)[:, 0], F.linear(x2, w))
    slow = t3 / t2 if t2 > 0 else 1.0
    detail = (
        f"F.linear [{b},1,{k}] vs [{b},{k}] by a {n}x{k} weight: {slow:.2f}x the time "
        "(pytorch#189847: 8.5x before the fix)"
    )
    bad = slow > 2.0 or err > 1e-3
    return _mps_only(ctx, _out("has the bug" if bad else "fixed", detail, ratio=slow, s_2d=t2, s_3d=t3, rel_error=err))


def _softmax_wide(ctx: Ctx) -> dict:
    import torch

    v = 4096 if ctx.small else 128256
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, v, generator=g) * 4
    xd = ctx.to(x)
    err = _rel(torch.softmax(xd, -1), torch.softmax(x, -1))
    t_soft = _time(ctx, lambda: torch.softmax(xd, -1), calls=20)
    t_mul = _time(ctx, lambda: xd * 1.5, calls=20)  # same bytes read and written: what a native kernel costs
    ratio = t_soft / t_mul if t_mul > 0 else 1.0
    detail = (
        f"fp32 softmax of one row of {v}: {t_soft * 1e6:.1f} us, {ratio:.1f}x an elementwise op of the same bytes "
        f"(pytorch#196071: 57.4 -> 7.1 us); rel. error {err:.1e} vs CPU"
    )
    bad = ratio > 4.0 or err > 1e-4
    return _mps_only(
        ctx,
        _out(
            "has the bug" if bad else "fixed", detail, softmax_s=t_soft, elementwise_s=t_mul, ratio=ratio, rel_error=err
        ),
    )


def _unit_lower(n_heads: int, c: int, device: str):
    import torch

    g = torch.Generator().manual_seed(0)
    a = torch.randn(1, n_heads, c, c, generator=g).tril(-1) * 0.1
    return (a + torch.eye(c)).to(device)


def _matmul_inverse(a):
    """Inverse of a unit lower-triangular ``a = I + N`` by (I - N)(I + N^2)(I + N^4)...: N is nilpotent."""
    import torch

    eye = torch.eye(a.shape[-1], device=a.device, dtype=a.dtype)
    n = eye - a  # a = I - n, inverse = I + n + n^2 + ... = (I + n)(I + n^2)(I + n^4)...
    inv, p = eye + n, n
    steps = max(1, (a.shape[-1] - 1).bit_length())
    for _ in range(steps - 1):
        p = p @ p
        inv = inv + inv @ p
    return inv


def _solve_triangular(ctx: Ctx) -> dict:
    import torch

    heads, c = (4, 16) if ctx.small else (32, 64)  # Qwen3.6 Gated DeltaNet: 32 value heads, 64-token chunks
    a = _unit_lower(heads, c, ctx.device)
    eye = torch.eye(c, device=ctx.device).expand_as(a)
    ref = torch.linalg.inv(a.cpu().double()).float()
    solve = lambda: torch.linalg.solve_triangular(a, eye, upper=False, unitriangular=True)
    err_s, err_m = _rel(solve(), ref), _rel(_matmul_inverse(a), ref)
    t_s = _time(ctx, solve)
    t_m = _time(ctx, lambda: _matmul_inverse(a))
    ratio = t_s / t_m if t_m > 0 else 1.0
    detail = (
        f"solve_triangular on [1, {heads}, {c}, {c}]: {t_s * 1e3:.2f} ms, {ratio:.1f}x a matmul-based inverse "
        f"({t_m * 1e3:.2f} ms; reflex#1: ~15 ms per call on MPS, 4x slower); rel. errors {err_s:.1e} / {err_m:.1e}"
    )
    bad = (ratio > 3.0 and t_s > 1e-3) or err_s > 1e-4
    return _mps_only(
        ctx,
        _out(
            "has the bug" if bad else "fixed",
            detail,
            solve_s=t_s,
            matmul_inverse_s=t_m,
            ratio=ratio,
            rel_error=err_s,
            matmul_inverse_rel_error=err_m,
        ),
    )


def _free_bytes(device: str) -> int | None:
    import torch

    if device == "mps":
        return int(torch.mps.recommended_max_memory()) - int(torch.mps.driver_allocated_memory())
    if device == "cuda":
        return int(torch.cuda.mem_get_info()[0])
    return None


def _sdpa_2p31(ctx: Ctx) -> dict:
    import torch
    import torch.nn.functional as F

    # 16 heads x 11586^2 = 2,147,766,336 scores, just above 2^31 = 2,147,483,648.
    h, length, d = (2, 64, 64) if ctx.small else (16, 11586, 64)
    scores = h * length * length
    dtype = torch.float32 if ctx.device == "cpu" else torch.float16
    # A path that materialises the scores holds them in fp16 and fp32 at once at worst: 6 bytes each.
    need = scores * 6 + (1 << 30)
    free = _free_bytes(ctx.device)
    if not ctx.small and free is not None and free < need:
        return _out(
            "skipped",
            f"needs {need / 2**30:.0f} GiB of device memory, {free / 2**30:.1f} GiB free here",
            need_bytes=need,
        )
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, length, d, generator=g) for _ in range(3))
    got = F.scaled_dot_product_attention(*(ctx.to(t).to(dtype) for t in (q, k, v)))
    rows = torch.cat([torch.arange(0, 16), torch.arange(length - 16, length)])
    picked = got[:, :, rows.to(got.device)].float().cpu()
    del got
    ref = F.scaled_dot_product_attention(q[:, :, rows], k, v)  # 32 query rows on the CPU: cheap
    err = _rel(picked, ref)
    detail = (
        f"SDPA with B*H*Lq*Lk = {scores:,} scores ({'above' if scores >= 2**31 else 'below'} 2^31), "
        f"{str(dtype).replace('torch.', '')}: rel. error {err:.1e} vs CPU on 32 query rows"
    )
    return _mps_only(ctx, _out("has the bug" if err > 5e-3 else "fixed", detail, scores=scores, rel_error=err))


def _long_k(ctx: Ctx) -> dict:
    import torch

    m = 64
    k1, k2 = (256, 320) if ctx.small else (32768, 33280)  # K > 32768 goes to the slow kernel on M1/M2
    dtype = torch.float32 if ctx.device == "cpu" else torch.bfloat16
    g = torch.Generator().manual_seed(0)
    a, b = (ctx.to(torch.randn(m, k2, generator=g)).to(dtype), ctx.to(torch.randn(k2, m, generator=g)).to(dtype))
    a1, b1 = a[:, :k1].contiguous(), b[:k1].contiguous()  # contiguous: no copy inside the timed call
    t1 = _time(ctx, lambda: a1 @ b1)
    t2 = _time(ctx, lambda: a @ b)
    ratio = (t2 / k2) / (t1 / k1) if t1 > 0 else 1.0
    detail = (
        f"matmul {m}x{k2}x{m} vs {m}x{k1}x{m}: {ratio:.1f}x the time per K "
        "(pytorch#198182: 6-10x on M1/M2, macOS >= 14.4)"
    )
    return _mps_only(ctx, _out("has the bug" if ratio > 3.0 else "fixed", detail, ratio=ratio, s_short=t1, s_long=t2))


def _sdpa_broadcast(ctx: Ctx) -> dict:
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    length = 16 if ctx.small else 256
    q = torch.randn(2, 8, length, 64, generator=g)
    kb, vb = torch.randn(1, 8, length, 64, generator=g), torch.randn(1, 8, length, 64, generator=g)  # batch broadcast
    kh, vh = torch.randn(2, 1, length, 64, generator=g), torch.randn(2, 1, length, 64, generator=g)  # head broadcast
    errs = []
    for k, v in ((kb, vb), (kh, vh)):
        ref = F.scaled_dot_product_attention(q, k.expand(2, 8, -1, -1), v.expand(2, 8, -1, -1))
        try:
            got = F.scaled_dot_product_attention(ctx.to(q), ctx.to(k), ctx.to(v))
        except RuntimeError as e:
            first = str(e).strip().splitlines()[0][:200]
            return _mps_only(
                ctx, _out("has the bug", f"SDPA with a broadcast batch/head dimension raises: RuntimeError: {first}")
            )
        errs.append(_rel(got, ref))
    worst = max(errs)
    detail = (
        f"SDPA with K/V broadcast over batch and over heads (L={length}): "
        f"rel. errors {errs[0]:.1e} / {errs[1]:.1e} vs CPU"
    )
    return _mps_only(ctx, _out("has the bug" if worst > 1e-4 else "fixed", detail, rel_errors=errs))


def _conv3d(ctx: Ctx) -> dict:
    import torch
    import torch.nn.functional as F

    c, t, hw = (8, 3, 16) if ctx.small else (128, 4, 64)
    dtype = torch.float32 if ctx.device == "cpu" else torch.float16
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, c, t + 2, hw + 2, hw + 2, generator=g)
    w = torch.randn(c, c, 3, 3, 3, generator=g) / (27 * c) ** 0.5
    ref = F.conv3d(x, w)
    xd, wd = ctx.to(x).to(dtype), ctx.to(w).to(dtype)
    err = _rel(F.conv3d(xd, wd), ref)
    t_conv = _time(ctx, lambda: F.conv3d(xd, wd))
    # The same multiply-adds as one matmul: [T*H*W, 27*C] x [27*C, C].
    a = ctx.to(torch.randn(t * hw * hw, 27 * c, generator=g)).to(dtype)
    b = ctx.to(torch.randn(27 * c, c, generator=g)).to(dtype)
    t_mm = _time(ctx, lambda: a @ b)
    share = t_mm / t_conv if t_conv > 0 else 1.0
    detail = (
        f"conv3d 3x3x3, {c} channels, [{t}, {hw}, {hw}] output, {str(dtype).replace('torch.', '')}: "
        f"{share:.0%} of the throughput "
        "of a matmul with the same multiply-adds (issue pytorch#192213: 7% on 2.12, 97% on 2.14); "
        f"rel. error {err:.1e} vs CPU"
    )
    bad = share < 0.25 or err > 1e-2
    return _mps_only(
        ctx, _out("has the bug" if bad else "fixed", detail, conv_s=t_conv, matmul_s=t_mm, share=share, rel_error=err)
    )


def _sdpa_strided(ctx: Ctx) -> dict:
    import torch
    import torch.nn.functional as F

    # Each case: SDPA on views as models make them, on the device, against the CPU on dense copies (fp32).
    g = torch.Generator().manual_seed(0)
    cases = []
    # pytorch#163597: a query from .view(B, L, H, D).transpose(1, 2), query length <= 8 (the decode vector
    # kernels), head dims 64 and 128; K/V as long as a short cache.
    for d in (64, 128):
        q = torch.randn(2, 4, 8, d, generator=g)
        kv = torch.randn(2, 2, 32 if ctx.small else 256, 8, d, generator=g)
        cases.append((f"transposed query [2, 8, 4, {d}]", q, kv[0], kv[1], (1, 2)))
    # pytorch#181133: q/k/v all from permute(0, 2, 1, 3) of [B, S, H, D] = [84, 3, 3, 64].
    b = 8 if ctx.small else 84
    qkv = torch.randn(3, b, 3, 3, 64, generator=g)
    cases.append((f"permuted q/k/v [{b}, 3, 3, 64]", qkv[0], qkv[1], qkv[2], (1, 2)))
    # diffusers' Wan / Qwen-Image VAE attention block: q, k, v = qkv.chunk(3, dim=-1) of [N, 1, H*W, 3C]
    # (one head of C channels; 384 in the Wan decoder's middle block).
    c, hw = (64, 64) if ctx.small else (384, 1024)
    fused = torch.randn(2, 1, hw, 3 * c, generator=g)
    cases.append((f"qkv.chunk(3, -1) of [2, 1, {hw}, {3 * c}]", fused, None, None, "chunk"))
    errs = {}
    for label, q, k, v, how in cases:
        if how == "chunk":
            ref = F.scaled_dot_product_attention(*(t.contiguous() for t in q.chunk(3, dim=-1)))
            got = F.scaled_dot_product_attention(*ctx.to(q).chunk(3, dim=-1))
        else:
            dense = [t.transpose(*how).contiguous() for t in (q, k, v)]
            ref = F.scaled_dot_product_attention(*dense)
            got = F.scaled_dot_product_attention(*(ctx.to(t).transpose(*how) for t in (q, k, v)))
        errs[label] = _rel(got, ref)
    worst = max(errs.values())
    detail = "SDPA on strided views vs the CPU on dense copies, fp32: " + "; ".join(
        f"{k}: rel. error {e:.1e}" for k, e in errs.items()
    )
    return _mps_only(ctx, _out("has the bug" if worst > 1e-3 else "fixed", detail, rel_errors=errs))


def _conv_chunk_batch(ctx: Ctx) -> dict:
    import torch
    import torch.nn.functional as F

    # pytorch#169342: x.chunk(2, dim=1) of a conv output at batch 2, the second half through a 3x3 conv: only
    # the first batch element right. The same strided batch as the frame slices a VAE's frame loop hands its
    # first convolution (x[:, :, i] of [N, C, T, H, W]), 2-D and 3-D.
    g = torch.Generator().manual_seed(0)
    hw = 16 if ctx.small else 32
    x = torch.randn(2, 3, hw, hw, generator=g)
    w1, b1 = torch.randn(64, 3, 3, 3, generator=g) / 27**0.5, torch.randn(64, generator=g)
    w2, b2 = torch.randn(32, 32, 3, 3, generator=g) / (9 * 32) ** 0.5, torch.randn(32, generator=g)
    video = torch.randn(2, 16, 3, hw, hw, generator=g)
    wf = torch.randn(16, 16, 3, 3, generator=g) / (9 * 16) ** 0.5
    w3 = torch.randn(16, 16, 1, 3, 3, generator=g) / (9 * 16) ** 0.5

    def chunk_conv(t, w1, b1, w2, b2, dense=False):  # the model: conv, chunk, conv on the second half
        half = F.conv2d(t, w1, b1, padding=1).chunk(2, dim=1)[1]
        return F.conv2d(half.contiguous() if dense else half, w2, b2, padding=1)

    def frame_conv(t, w, dense=False):
        frame = t[:, :, 1]
        return F.conv2d(frame.contiguous() if dense else frame, w, padding=1)

    def frames_conv(t, w, dense=False):
        frames = t[:, :, 1:]
        return F.conv3d(frames.contiguous() if dense else frames, w, padding=(0, 1, 1))

    cases = (
        (f"conv2d, chunk(2, dim=1)[1], conv2d 3x3 on [2, 3, {hw}, {hw}]", x, chunk_conv, (w1, b1, w2, b2)),
        (f"frame x[:, :, 1] of [2, 16, 3, {hw}, {hw}] -> conv2d 3x3", video, frame_conv, (wf,)),
        ("frames x[:, :, 1:] -> conv3d 1x3x3", video, frames_conv, (w3,)),
    )
    errs, first, rest = {}, {}, {}
    for label, base, conv, weights in cases:
        ref = conv(base, *weights, dense=True)
        got = conv(ctx.to(base), *(ctx.to(w) for w in weights)).cpu()
        errs[label] = _rel(got, ref)
        first[label] = _rel(got[:1], ref[:1])
        rest[label] = _rel(got[1:], ref[1:])
    worst = max(errs.values())
    detail = "convolutions of strided views at batch 2 vs the CPU on dense copies, fp32: " + "; ".join(
        f"{k}: rel. error {errs[k]:.1e} (first element {first[k]:.1e}, others {rest[k]:.1e})" for k in errs
    )
    return _mps_only(
        ctx,
        _out("has the bug" if worst > 1e-4 else "fixed", detail, rel_errors=errs, first=first, others=rest),
    )


def _gemm_placeholder(ctx: Ctx) -> dict:
    # Decided across processes by gemm_verdict; a single process cannot tell.
    return _out("skipped", "measured in every process; the verdict needs two or more (--processes)")


def gemm_sample(device: str, small: bool) -> float:
    """Seconds of one bf16 GEMM with M in [768, 3072] (the range of pytorch#182815) in this process."""
    import torch

    from ..bench import time_fn

    m, k, n = (64, 64, 64) if small else (1024, 2048, 2048)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(m, k, generator=g).to(device, dtype), torch.randn(k, n, generator=g).to(device, dtype))
    return time_fn(lambda: a @ b, device=device, warmup=3, repeats=10, calls=5).median_s


def gemm_verdict(samples: list[float], device: str) -> dict:
    """The verdict of the fresh-process GEMM probe from one sample per process."""
    if len(samples) < 2:
        return _out("skipped", "measured in one process only; run with --processes 2 or more", samples_s=samples)
    lo, hi = min(samples), max(samples)
    spread = hi / lo if lo > 0 else 1.0
    detail = (
        f"one GEMM (bf16 M=1024, K=N=2048 on a GPU; small fp32 on a CPU) in {len(samples)} fresh processes: "
        f"fastest {lo * 1e3:.3f} ms, slowest "
        f"{hi * 1e3:.3f} ms ({spread:.2f}x; pytorch#182815: 2-3x slower in about 40% of processes)"
    )
    res = _out("has the bug" if spread > 1.8 else "fixed", detail, samples_s=samples, spread=spread)
    return (
        res if device == "mps" else dict(res, verdict="not applicable", detail=f"MPS-only bug; on {device}: {detail}")
    )


PROBES: dict[str, Probe] = {
    p.name: p
    for p in [
        Probe(
            "pad_rank5_65536",
            ("pytorch#194922", "fix pytorch#194944", "fix pytorch#195147"),
            "constant time-padding of rank-5 tensors corrupts about 80% of elements",
            "H*W = 65536 (2^16) and above",
            "pad_rank5_correct",
            _pad_rank5,
            "wan_vae_pad / qwen_image_vae fold the padding into the conv on MPS < 2.15",
        ),
        Probe(
            "pad3d_replicate_65536",
            ("pytorch#195147", "issue pytorch#194922"),
            "replicate pad3d on rank-5 tensors wrong from the same size",
            "H*W = 65536",
            "pad3d_all_modes_correct",
            lambda ctx: _pad_rank5(ctx, "replicate"),
            "video_vae_pad replaces replicate time padding on MPS < 2.15",
        ),
        Probe(
            "pad_driver_memory",
            ("pytorch#195368",),
            "each constant pad builds an MPSGraph that keeps driver memory (270 GiB in a Wan2.2 tiled decode)",
            "hundreds of 5-D pads",
            "pad_constant_native",
            _pad_driver_memory,
            "wan_vae_pad removes every 5-D F.pad on MPS < 2.15",
        ),
        Probe(
            "grouped_mm_offsets",
            ("pytorch#194917", "pytorch#194933"),
            "no grouped matmul with device offsets on MPS",
            "any MoE routing",
            "grouped_mm",
            _grouped_mm,
            "moe_experts picks grouped_mm or batched_mm per device and torch",
        ),
        Probe(
            "fp8_cast",
            ("pytorch#194074",),
            "float8_e4m3fn tensors cannot live on MPS",
            "any fp8 tensor",
            "float8_storage",
            _fp8_cast,
            "fp8_weights stores float8 on the device, or steps aside",
        ),
        Probe(
            "fp8_metal_gemv",
            ("pytorch#148972", "pytorch#141478"),
            "mpsboost's own Metal fp8 GEMV (through torch.mps.compile_shader, public since pytorch#148972): does it "
            "compile and match the reference here, and how fast is it at decode",
            "decode: one row, dense and routed experts",
            "fp8_metal_gemv",
            _fp8_metal_gemv,
            "fp8_weights decodes fp8 layers on it on a Mac (option mps_kernel='scaled_mm' keeps torch's kernels)",
        ),
        Probe(
            "affine_metal_gemv",
            ("pytorch#148972", "pytorch/ao#4868"),
            "mpsboost's own Metal low-bit kernels for MLX affine weights (torch's int4pack/int8pack are dense only and "
            "called very slow in pytorch/ao#4868): do they compile and match the reference here, and how fast at "
            "decode against bf16 and torch's int4pack/int8pack",
            "decode: one row, 4-bit and 8-bit, dense and routed experts at the Qwen3.6 widths",
            "affine_metal_gemv",
            _affine_metal_gemv,
            "MLX 4-bit/8-bit layers decode on them on a Mac (torch's int4pack/int8pack selectable for comparison)",
        ),
        Probe(
            "fp8_scaled_mm",
            ("pytorch#196916",),
            "fp8 _scaled_mm missing, or 0.12-0.25x of bf16 for M >= 512",
            "M = 1024",
            "scaled_mm",
            _scaled_mm,
            "fp8_weights forward: scaled_mm or dequantize then linear",
        ),
        Probe(
            "linear_b1k",
            ("issue pytorch#189847", "fix pytorch#189855"),
            "F.linear on [B,1,K] 8.5x slower than on [B,K]",
            "one decode token, 4096x4096 bf16",
            "linear_3d_fast",
            _linear_b1k,
            "decode_linear routes [B,1,K] to [B,K]",
        ),
        Probe(
            "softmax_128256",
            ("pytorch#196071",),
            "fp32 softmax of a 128,256-wide row on MPSGraph: 57.4 us vs 7.1 us (the figures of pytorch#196071)",
            "one row of 128,256",
            "softmax_native",
            _softmax_wide,
            "softmax recipe for sampling",
        ),
        Probe(
            "solve_triangular",
            ("kshetrajna12/reflex#1",),
            "solve_triangular ~15 ms per call on MPS, 4x a matmul-based inverse",
            "[1, 32, 64, 64] (a Gated DeltaNet prefill chunk)",
            None,
            _solve_triangular,
            "linear_attention: chunked prefill without solve_triangular on MPS",
        ),
        Probe(
            "sdpa_above_2p31",
            ("issue pytorch#179352", "fix pytorch#179592 (not confirmed merged)", "ComfyUI#14837"),
            "attention wrong once B*H*Lq*Lk >= 2^31 (32-bit indexing)",
            "16 heads x 11586^2 scores",
            "sdpa_large_scores_correct",
            _sdpa_2p31,
            "attention_split splits attention below 2^31 scores",
        ),
        Probe(
            "sdpa_broadcast",
            ("pytorch#189631", "pytorch#179771"),
            "SDPA wrong or failing with K/V broadcast over batch or heads",
            "batch 2 / 8 heads against K/V of 1",
            "sdpa_broadcast",
            _sdpa_broadcast,
            "metal_attention expands K/V where the build needs it",
        ),
        Probe(
            "sdpa_strided",
            ("issue pytorch#163597", "fix pytorch#163598", "pytorch#181133", "pytorch#170837", "ComfyUI#10681"),
            "SDPA wrong on non-contiguous q/k/v (a transposed query at decode lengths, permuted q/k/v, a chunked "
            "qkv): one cause ComfyUI#10681 names for black images",
            "query [2, 8, 4, 64|128] transposed; [84, 3, 3, 64] permuted; the VAE block's qkv.chunk(3) of "
            "[2, 1, 1024, 1152]",
            "sdpa_strided_correct",
            _sdpa_strided,
            "metal_attention and the VAE attention blocks hand SDPA contiguous q/k/v on MPS",
        ),
        Probe(
            "conv_chunk_batch",
            ("issue pytorch#169342", "ComfyUI#10681"),
            "a convolution of a chunk() view (or a frame slice) right for the first batch element only",
            "conv2d, chunk(2, dim=1), conv2d 3x3 at batch 2; frame slices of [2, 16, 3, 32, 32]",
            "conv_strided_batch_correct",
            _conv_chunk_batch,
            "wan_vae_pad / qwen_image_vae give every folded convolution a dense input on MPS",
        ),
        Probe(
            "conv3d_throughput",
            ("issue pytorch#192213", "pytorch#188802", "pytorch#192229"),
            "conv3d at 7% of matmul throughput on MPSGraph (before the Metal kernels)",
            "a 3x3x3 conv, 128 channels",
            "conv3d_metal",
            _conv3d,
            "qwen_image_vae's single-frame 2-D path: sold on speed before 2.14, on memory after",
        ),
        Probe(
            "long_k_matmul",
            ("pytorch#198182",),
            "on M1/M2 with macOS >= 14.4 matmuls with K > 32768 take a 6-10x slower kernel",
            "K = 33280",
            None,
            _long_k,
            "none yet (a measurement hygiene fact)",
        ),
        Probe(
            "dispatch_cost",
            ("pytorch#148219", "qwisp#143"),
            "a decode step pays per dispatch: about 1.3 us host for a Metal shader, 20 us for an MPSGraph op",
            "1-element ops, 200 calls between synchronisations; a bf16 GEMV by a 64 MiB weight",
            None,
            _dispatch_cost,
            "the constants of mpsboost's Mac cost model (mpsboost.bench.decode_cost.predict), measured on this Mac",
        ),
        Probe(
            "gemm_fresh_process",
            ("pytorch#182815",),
            "MPSGraph picks a 2-3x slower GEMM kernel in about 40% of fresh processes",
            "M in [768, 3072], across processes",
            None,
            _gemm_placeholder,
            "selftest and benchmarks time across fresh processes",
        ),
    ]
}


def _release(device: str) -> None:
    """Hand a probe's buffers back before the next one (the attention probe alone may hold GiBs)."""
    from ..bench.harness import release

    release(device)


def run_probe(probe: Probe, device: str, small: bool, repeats: int = 5) -> dict:
    """One probe's record: name, upstream numbers, gate feature, verdict, detail, measured values, seconds."""
    t0 = time.perf_counter()
    try:
        res = probe.run(Ctx(device, small, repeats))
    except Exception as e:  # noqa: BLE001 - a probe that breaks is a finding about the probe, not the end of the selftest
        first = (str(e).strip().splitlines() or [""])[0][:300]
        res = _out("error", f"{type(e).__name__}: {first}")
    _release(device)
    return {
        "kind": "probe",
        "name": probe.name,
        "upstream": list(probe.upstream),
        "what": probe.what,
        "trigger": probe.trigger,
        "feature": probe.feature,
        "decision": probe.decision,
        **res,
        "seconds": round(time.perf_counter() - t0, 3),
        "small": small,
    }


def run_probes(
    device: str,
    small: bool,
    *,
    deadline: float | None = None,
    only: tuple[str, ...] = (),
    echo: Callable[[str], None] = print,
    clock: Callable[[], float] = time.perf_counter,
) -> list[dict]:
    out = []
    for probe in PROBES.values():
        if only and probe.name not in only:
            continue
        if deadline is not None and clock() > deadline:
            rec = {
                "kind": "probe",
                "name": probe.name,
                "upstream": list(probe.upstream),
                "what": probe.what,
                "trigger": probe.trigger,
                "feature": probe.feature,
                "decision": probe.decision,
                **_out("skipped", "time budget spent"),
                "seconds": 0.0,
                "small": small,
            }
        else:
            rec = run_probe(probe, device, small)
        echo(f"  probe {probe.name}: {rec['verdict']} ({rec['seconds']:.1f} s)")
        out.append(rec)
    return out


def feature_ok(verdict: str) -> bool | None:
    """What a probe verdict says about its gate feature: True (present/fixed), False (bug), None (no evidence)."""
    return {"fixed": True, "has the bug": False}.get(verdict)


def decisions() -> list[dict]:
    """For each MPS decision of the gate, the probe that confirms or refutes it (selftest probe, gate API
    probe, or none)."""
    from ..gate import FEATURES

    rows = []
    for name, feat in FEATURES.items():
        if "mps" not in feat.rules:
            continue
        probes = [p.name for p in PROBES.values() if p.feature == name]
        rows.append(
            {
                "feature": name,
                "description": feat.description,
                "selftest_probes": probes,
                "gate_probe": feat.probe is not None,
                "upstream": "; ".join(r.upstream for r in feat.rules["mps"] if r.upstream),
            }
        )
    return rows
