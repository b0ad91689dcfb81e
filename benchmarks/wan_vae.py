"""Benchmark of ``wan_vae_pad``: the Wan2.2 VAE decode, stock vs mpsboost, fp32 and bf16.

Workloads (size "real": the Wan2.2-TI2V-5B VAE config, row ``wan22_vae:real`` of ``mpsboost.bench.models``, random
weights):

* ``wan22_vae_decode`` 480x832, 81 frames (latent 21x30x52), tiled (15 tiles of 256 px, stride 192)
  and untiled;
* ``wan22_vae_decode`` 704x1280 tiled (28 tiles), 21 frames (latent 6x44x80): fewer frames than a
  full clip so that the run fits the device time it is given (the tile count is the real one);
* ``wan22_vae_decode_ref``: a reduced decode (latent 2x4x4) against a CPU fp32 reference.

Every record keeps the four kinds apart: time (the variants of one workload timed in alternating
rounds, each patched by ``mpsboost.patched`` around its own samples; median, min and max kept), the
count of aten-level pads of 5-D tensors in one decode (:func:`mpsboost.bench.harness.count_pad5d`), correctness (mpsboost vs stock of the same run; stock vs the CPU fp32 reference of the
reduced decode), and the memory peaks of a separate pass. Sizes "tiny" and "small" run the same
code on small configs (tiny finishes in seconds on a CPU).

    python benchmarks/wan_vae.py --device cuda --size real --out benchmarks/results
    mpsboost bench wan_vae --device cuda --size real

The helpers below are shared by ``qwen_image_vae.py`` and ``mps_streams.py``.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

import mpsboost
from mpsboost.bench import Record, RecordEnv, Workload, correctness, measure_memory
from mpsboost.bench.harness import MIN_REPEATS, count_pad5d, measure_variants, release
from mpsboost.bench.models import build
from mpsboost.bench.timing import synchronize

# ------------------------------------------------------------------------------------------ shared

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
            passes[name] = {"memory": probe.peaks(), "pads": pads.to_dict(), "corr": corr,
                            "extra": {"patch": report_rows(report) if report else [], **((extra or (lambda *_: {}))(name, report))}}
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

    m = measure_variants({n: fn for n, _, _ in names}, device=device, repeats=repeats, warmup=0,
                         contexts={n: setup_in(r, o) for n, r, o in names})
    records = []
    env = RecordEnv.capture(device, dtype)
    for name, _, _ in names:
        p, t = passes[name], m.timings[name]
        rec = Record(workload=workload, variant=name, env=env, throughput=t.throughput(unit="s/call"), correctness=p["corr"],
                     memory=p["memory"], extra={"pad5d_aten": p["pads"], "measured_through": "patch()" if name != "stock" else "stock model",
                                                **m.extra(name), **p["extra"]})
        stream_record(rec)
        records.append(rec)
        log(f"{workload.describe()} {name} {str(dtype).replace('torch.', '')}: {t.median_s:.4f} s/call ({t.min_s:.4f}..{t.max_s:.4f}, "
            f"{t.repeats} alternating rounds{', busy machine' if m.busy else ''}), {p['pads']['total']} 5-D pads, {p['pads'].get('all_ranks', '-')} of any rank (aten)"
            + ("" if name == "stock" else f", {m.ratio(name):.2f}x stock ({m.verdict(name)})")
            + (f", rel err vs {reference_name} {p['corr'].rel_error:.2e}" if p["corr"] else ""))
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

    lines = [f"{'workload':58s} {'variant':20s} {'s/call':>8s} {'x stock':>7s} {'pads':>6s} {'alloc GiB':>9s} {'resv GiB':>8s} {'rel err':>8s} {'PSNR':>6s}"]
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
            what = f"{r.workload.name} {sh.get('video') or sh.get('image') or sh.get('label') or sh.get('latent')} {sh.get('dtype', '')}"
            lines.append(
                f"{what[:58]:58s} {r.variant[:20]:20s} {r.throughput.value:8.4f} "
                + (f"{ratio:7.2f}" if ratio else f"{'':>7s}")
                + f" {(r.extra.get('pad5d_aten') or {}).get('total', r.extra.get('pad_calls', '-')):>6} {gib(r.memory.tensor_allocated if r.memory else None)}"
                + f" {gib(r.memory.allocator_reserved if r.memory else None)[1:]}"
                + (f" {c.rel_error:8.1e} {c.psnr_db:6.1f}" if c and c.rel_error is not None and c.psnr_db is not None else "")
            )
    return "\n".join(lines)


def cpu_fp32_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A stock copy of ``model`` on the CPU in fp32 (the model must not be patched)."""
    import copy

    if mpsboost.api.is_patched(model):
        raise RuntimeError("take the CPU reference from the stock (unpatched) model")
    ref = copy.deepcopy(model).to("cpu", torch.float32).eval()
    return ref


# ------------------------------------------------------------------------------------------ Wan2.2

def build_wan22(size: str, device: str) -> torch.nn.Module:
    """The Wan2.2 VAE at ``size``: rows wan22_vae:real, :bench_small, :bench_tiny of mpsboost.bench.models."""
    name = {"real": "wan22_vae:real", "small": "wan22_vae:bench_small", "tiny": "wan22_vae:bench_tiny"}[size]
    torch.manual_seed(0)
    # Random init directly on the device: 705M parameters initialise in well under a second there.
    vae = build(name, device=device)
    return vae.eval().requires_grad_(False)


def wan_workloads(size: str) -> list[dict]:
    """(name, latent shape, tiled, note) of each decode workload at ``size``."""
    if size == "real":
        return [
            {"label": "480x832x81 tiled", "latent": (1, 48, 21, 30, 52), "tiled": True, "frames": 81},
            {"label": "480x832x81 untiled", "latent": (1, 48, 21, 30, 52), "tiled": False, "frames": 81},
            {"label": "704x1280x21 tiled", "latent": (1, 48, 6, 44, 80), "tiled": True, "frames": 21,
             "note": "21 of 81 frames to fit the device time; 28 tiles as at full length"},
        ]
    if size == "small":
        return [
            {"label": "128x160x9 tiled", "latent": (1, 16, 3, 8, 10), "tiled": True, "frames": 9},
            {"label": "128x160x9 untiled", "latent": (1, 16, 3, 8, 10), "tiled": False, "frames": 9},
        ]
    return [
        {"label": "64x96x5 tiled", "latent": (1, 16, 2, 4, 6), "tiled": True, "frames": 5},
        {"label": "64x96x5 untiled", "latent": (1, 16, 2, 4, 6), "tiled": False, "frames": 5},
    ]


def tiling(vae: torch.nn.Module, size: str, on: bool) -> None:
    vae.use_tiling = False
    if on:
        if size == "real":
            vae.enable_tiling()  # diffusers' defaults: 256 px tiles, stride 192
        else:
            vae.enable_tiling(tile_sample_min_height=64, tile_sample_min_width=64, tile_sample_stride_height=32, tile_sample_stride_width=48)


def _variants(device: str) -> list[tuple[str, list[str] | None, dict | None]]:
    v: list[tuple[str, list[str] | None, dict | None]] = [("stock", None, None), ("mpsboost", ["wan_vae_pad"], None)]
    if device.startswith("cuda"):
        # What the channels-last layout and the fused norm add on top of the fold and the tile loop.
        v.append(("mpsboost:contiguous", ["wan_vae_pad"], {"wan_vae_pad": {"layout": "contiguous", "fused_norm": False}}))
    return v


def _ref_with_label(c: Any, label: str) -> Any:
    return None if c is None else c.__class__(**{**c.to_dict(), "reference": label})


def reference_pass(vae: torch.nn.Module, variants, fn, ref_in: torch.Tensor, cpu_ref: torch.Tensor, *, workload: Workload,
                   device: str, dtype: torch.dtype, repeats: int, untile, label: str) -> tuple[list[Record], dict[str, Any]]:
    """The reduced workload ``fn(vae, ref_in)`` of every variant, untiled, against the CPU fp32 reference.

    Returns its records and each variant's correctness (the full-size records cite it).
    """
    records, _ = measure_workload(workload=workload, variants=variants, model=vae, device=device, dtype=dtype,
                                  fn=lambda: fn(vae, ref_in), setup=lambda: untile(vae), repeats=repeats,
                                  reference=cpu_ref, reference_name="cpu-fp32")
    return records, {r.variant: r.correctness for r in records}


def run(device: str, size: str, out: Path) -> list[Record]:
    records: list[Record] = []
    vae = build_wan22(size, device)
    repeats = MIN_REPEATS
    gen = torch.Generator(device="cpu").manual_seed(1)
    work = wan_workloads(size)
    latents = {w["label"]: torch.randn(w["latent"], generator=gen) for w in work}
    ref_shape = (1, vae.config.z_dim, 2, 4, 4) if size != "tiny" else (1, vae.config.z_dim, 2, 2, 2)
    ref_latent = torch.randn(ref_shape, generator=gen)
    ref_label = "x".join(str(d) for d in ref_shape[2:])

    # CPU fp32 reference of a reduced decode (stock model), taken before anything is patched.
    log("CPU fp32 reference (reduced decode)")
    cpu_vae = cpu_fp32_copy(vae)
    with torch.no_grad():
        cpu_ref = cpu_vae.decode(ref_latent).sample
    del cpu_vae
    free(device)

    for dname, dtype in DTYPES.items():
        vae.to(dtype)
        ref_in = ref_latent.to(device, dtype)
        wl = Workload("wan22_vae_decode_ref", {"latent": list(ref_shape), "dtype": dname, "tiled": False, "reference": "cpu-fp32"})
        ref_records, ref_corr = reference_pass(
            vae, _variants(device), lambda v, x: v.decode(x).sample, ref_in, cpu_ref, workload=wl, device=device,
            dtype=dtype, repeats=repeats, untile=lambda v: tiling(v, size, False), label=f"reduced decode {dname}")
        records += ref_records
        for w in work:
            if budget_left() < 60:
                log(f"budget: skipping {w['label']} {dname}")
                continue
            z = latents[w["label"]].to(device, dtype)
            shape = {"video": w["label"], "latent": list(w["latent"]), "dtype": dname, "tiled": w["tiled"], "frames": w["frames"]}
            if "note" in w:
                shape["note"] = w["note"]
            wl = Workload("wan22_vae_decode", shape)
            variants = [v for v in _variants(device) if v[0] != "mpsboost:contiguous" or (w["tiled"] and w["frames"] == 81)]

            def cref(name, report, ref_corr=ref_corr):
                c = ref_corr.get(name)
                return {} if name == "stock" else {"cpu_ref_reduced": c.to_dict() if c else None}

            stock_out = None
            with guarded(f"{w['label']} {dname}"):
                recs, stock_out = measure_workload(workload=wl, variants=variants, model=vae, device=device, dtype=dtype,
                                                   fn=lambda: vae.decode(z).sample, setup=lambda: tiling(vae, size, w["tiled"]),
                                                   repeats=repeats, extra=cref)
                for rec in recs:
                    if rec.variant == "stock":
                        # The stock record's correctness: the reduced decode against CPU fp32.
                        rec = rec.replace(correctness=_ref_with_label(
                            ref_corr.get("stock"), f"cpu-fp32, reduced decode of latent {ref_label} (wan22_vae_decode_ref)"))
                    records.append(rec)
            free(device)
            del stock_out, z
            free(device)
        tiling(vae, size, False)
    if device.startswith("cuda") and size == "real" and budget_left() > 40:
        # Where the time goes: one profile of a 2-frame tiled decode per variant.
        vae.to(torch.float32)
        z = latents[work[0]["label"]][:, :, :2].to(device)
        tiling(vae, size, True)
        for variant, recipes, options in _variants(device)[:2]:
            with guarded(f"profile {variant}"):
                ctx = patched(vae, recipes, options) if recipes else contextlib.nullcontext(None)
                with ctx:
                    with torch.no_grad():
                        vae.decode(z)
                    ops = top_ops(lambda: vae.decode(z), device)
                rec = Record(workload=Workload("wan22_vae_decode_profile", {"latent": list(z.shape), "dtype": "fp32", "tiled": True}),
                             variant=variant, env=RecordEnv.capture(device, torch.float32), extra={"top_device_ops": ops})
                stream_record(rec)
                records.append(rec)
                log(f"profile {variant}: " + "; ".join(f"{o['op']} {o['self_us'] / 1e3:.1f} ms x{o['calls']}" for o in ops[:8]))
    vae = None  # noqa: F841 - release the model before the next benchmark
    free(device)
    return records


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from mpsboost.bench.cli import script_main

    raise SystemExit(script_main(__file__, run))
