"""What the VAE benchmarks share (``wan_vae.py``, ``qwen_image_vae.py``, ``mps_streams.py``): the budget, the
log, one workload's variants measured through :mod:`mpsboost.bench.harness`, the records streamed as they come.

Benchmark-only helpers live here; what a benchmark shares with the cookbook or the demo (the measure loop,
the models, the configs) is in the package, :mod:`mpsboost.bench`.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

import mpsboost
from mpsboost.bench import Record, RecordEnv, Workload, correctness, measure_memory
from mpsboost.bench.harness import MIN_REPEATS, count_pad5d, measure_variants, release
from mpsboost.bench.timing import synchronize

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_T0 = time.monotonic()


def budget_left() -> float:
    """Seconds left of ``MPSBOOST_BENCH_BUDGET_S`` (counted from import); inf when unset."""
    total = os.environ.get("MPSBOOST_BENCH_BUDGET_S")
    if not total:
        return float("inf")
    return float(total) - (time.monotonic() - _T0)


def log(msg: str) -> None:
    print(f"[{time.monotonic() - _T0:7.1f}s] {msg}", flush=True)


# Device synchronisation and the release of cached memory between workloads are the harness's.
sync = synchronize
free = release


Variant = tuple  # (name, recipes or None for stock, patch options or None)


def measure_workload(
    *,
    workload: Workload,
    variants: list[Variant],
    model: torch.nn.Module,
    device: str,
    dtype: torch.dtype,
    fn: Callable[[], torch.Tensor],
    setup: Callable[[], None] = lambda: None,
    repeats: int = MIN_REPEATS,
    reference: torch.Tensor | None = None,
    reference_name: str = "stock",
    extra: Callable[[str, Any], dict] | None = None,
    data_range: float = 2.0,
) -> tuple[list[Record], torch.Tensor | None]:
    """Every variant of one workload on the one ``model``: per variant a memory pass (also its warm-up,
    with the aten-level count of 5-D pads and the output), then the time of all variants in alternating
    rounds (each variant patched by ``mpsboost.patched`` around its own samples, outside the timing).

    Without ``reference``, non-stock variants are compared with stock's output of this same run.
    ``extra(variant, report)`` adds detail to a variant's record. Returns the records and stock's output.
    """

    def ctx(recipes, options):
        return (lambda: patched(model, recipes, options)) if recipes else contextlib.nullcontext

    passes: dict[str, dict] = {}
    stock_out = None
    for name, recipes, options in variants:
        with guarded(f"{workload.describe()} {name} (memory pass)"):
            with torch.no_grad(), ctx(recipes, options)() as report:
                setup()
                with count_pad5d() as pads, measure_memory(device) as probe:
                    out = fn()
                sync(device)
            ref = reference if reference is not None else (None if name == "stock" else stock_out)
            corr = correctness(out, ref, reference=reference_name, data_range=data_range) if ref is not None else None
            passes[name] = {
                "memory": probe.peaks(),
                "pads": pads.to_dict(),
                "corr": corr,
                "extra": {"patch": report_rows(report) if report else [], **((extra or (lambda *_: {}))(name, report))},
            }
            if name == "stock" and reference is None:
                stock_out = out
            elif name != "stock" and stock_out is not None:
                passes[name]["extra"]["identical_to_stock"] = bool(torch.equal(out, stock_out))
            del out
        free(device)
    names = [v for v in variants if v[0] in passes]
    if not names:
        return [], stock_out

    def setup_in(recipes, options):
        @contextlib.contextmanager
        def cm():
            with torch.no_grad(), ctx(recipes, options)():
                setup()
                yield

        return cm

    m = measure_variants(
        {n: fn for n, _, _ in names},
        device=device,
        repeats=repeats,
        warmup=0,
        contexts={n: setup_in(r, o) for n, r, o in names},
    )
    records = []
    env = RecordEnv.capture(device, dtype)
    for name, _, _ in names:
        p, t = passes[name], m.timings[name]
        rec = Record(
            workload=workload,
            variant=name,
            env=env,
            throughput=t.throughput(unit="s/call"),
            correctness=p["corr"],
            memory=p["memory"],
            extra={
                "pad5d_aten": p["pads"],
                "measured_through": "patch()" if name != "stock" else "stock model",
                **m.extra(name),
                **p["extra"],
            },
        )
        stream_record(rec)
        records.append(rec)
        log(
            f"{workload.describe()} {name} {str(dtype).replace('torch.', '')}: "
            f"{t.median_s:.4f} s/call ({t.min_s:.4f}..{t.max_s:.4f}, "
            f"{t.repeats} alternating rounds{', busy machine' if m.busy else ''}), "
            f"{p['pads']['total']} 5-D pads, {p['pads'].get('all_ranks', '-')} of any rank (aten)"
            + ("" if name == "stock" else f", {m.ratio(name):.2f}x stock ({m.verdict(name)})")
            + (f", rel err vs {reference_name} {p['corr'].rel_error:.2e}" if p["corr"] else "")
        )
    return records, stock_out


def stream_record(rec: Record) -> None:
    """Append ``rec`` at once to ``$MPSBOOST_BENCH_STREAM_JSONL`` when set, so that an interrupted
    run keeps what it measured."""
    path = os.environ.get("MPSBOOST_BENCH_STREAM_JSONL")
    if path:
        from mpsboost.bench import append_jsonl

        append_jsonl(path, [rec])


@contextlib.contextmanager
def guarded(what: str) -> Iterator[None]:
    """Run one workload; on an error, log it and carry on with the next (a long device run should
    not lose every later workload to one failure)."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - reported, then the run continues
        import traceback

        log(f"FAILED {what}: {type(exc).__name__}: {exc}")
        traceback.print_exc()
        if os.environ.get("MPSBOOST_BENCH_STRICT"):
            raise


def patched(model: torch.nn.Module, recipes: list[str], options: dict | None = None):
    """``mpsboost.patched`` for the named recipes; the report's rows go into the records' extra."""
    return mpsboost.patched(model, recipes=recipes, options=options)


def report_rows(report: Any) -> list[dict]:
    return [{"recipe": r.recipe, "target": r.target, "status": r.status, "backing": r.backing} for r in report.rows]


def top_ops(fn: Callable[[], Any], device: str, n: int = 12) -> list[dict]:
    """The ``n`` operators with the most self device time in one call of ``fn`` (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with torch.no_grad(), profile(activities=acts) as prof:
        fn()
        sync(device)
    rows = []
    key = "self_device_time_total" if device.startswith("cuda") else "self_cpu_time_total"
    for ev in sorted(prof.key_averages(), key=lambda e: getattr(e, key, 0.0), reverse=True)[:n]:
        rows.append({"op": ev.key, "calls": ev.count, "self_us": round(float(getattr(ev, key, 0.0)), 1)})
    return rows


def summary(paths: list[Path]) -> str:
    """A short table of every workload: stock vs each variant (time ratio, pads, peaks, error)."""
    from mpsboost.bench import read_jsonl

    lines = [
        f"{'workload':58s} {'variant':20s} {'s/call':>8s} {'x stock':>7s} {'pads':>6s} "
        f"{'alloc GiB':>9s} {'resv GiB':>8s} {'rel err':>8s} {'PSNR':>6s}"
    ]
    for path in paths:
        if not Path(path).exists():
            continue
        recs = read_jsonl(path)
        stock = {r.workload.key: r for r in recs if r.variant == "stock" and r.throughput}
        for r in recs:
            if r.throughput is None:
                continue
            st = stock.get(r.workload.key)
            ratio = (st.throughput.value / r.throughput.value) if st and r.variant != "stock" else None
            gib = lambda b: f"{b / 2**30:9.2f}" if b else f"{'-':>9s}"  # noqa: E731
            c = r.correctness
            sh = r.workload.shape
            what = (
                f"{r.workload.name} "
                f"{sh.get('video') or sh.get('image') or sh.get('label') or sh.get('latent')} {sh.get('dtype', '')}"
            )
            lines.append(
                f"{what[:58]:58s} {r.variant[:20]:20s} {r.throughput.value:8.4f} "
                + (f"{ratio:7.2f}" if ratio else f"{'':>7s}")
                + (
                    f" {(r.extra.get('pad5d_aten') or {}).get('total', r.extra.get('pad_calls', '-')):>6} "
                    f"{gib(r.memory.tensor_allocated if r.memory else None)}"
                )
                + f" {gib(r.memory.allocator_reserved if r.memory else None)[1:]}"
                + (
                    f" {c.rel_error:8.1e} {c.psnr_db:6.1f}"
                    if c and c.rel_error is not None and c.psnr_db is not None
                    else ""
                )
            )
    return "\n".join(lines)


def cpu_fp32_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A stock copy of ``model`` on the CPU in fp32 (the model must not be patched)."""
    import copy

    if mpsboost.api.is_patched(model):
        raise RuntimeError("take the CPU reference from the stock (unpatched) model")
    ref = copy.deepcopy(model).to("cpu", torch.float32).eval()
    return ref


def _ref_with_label(c: Any, label: str) -> Any:
    return None if c is None else c.__class__(**{**c.to_dict(), "reference": label})


def reference_pass(
    vae: torch.nn.Module,
    variants,
    fn,
    ref_in: torch.Tensor,
    cpu_ref: torch.Tensor,
    *,
    workload: Workload,
    device: str,
    dtype: torch.dtype,
    repeats: int,
    untile,
    label: str,
) -> tuple[list[Record], dict[str, Any]]:
    """The reduced workload ``fn(vae, ref_in)`` of every variant, untiled, against the CPU fp32 reference.

    Returns its records and each variant's correctness (the full-size records cite it).
    """
    records, _ = measure_workload(
        workload=workload,
        variants=variants,
        model=vae,
        device=device,
        dtype=dtype,
        fn=lambda: fn(vae, ref_in),
        setup=lambda: untile(vae),
        repeats=repeats,
        reference=cpu_ref,
        reference_name="cpu-fp32",
    )
    return records, {r.variant: r.correctness for r in records}
