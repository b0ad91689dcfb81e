"""``mpsboost demo``: the main job on an embedded default, stock vs patched, four separate records.

On the best device present (mps, then cuda, then cpu; ``--device`` overrides) it builds the seed's two
models, real architectures with random weights, at widths that finish in a minute or two on a 2-core CPU:

* a Qwen3.6-architecture causal LM (transformers ``Qwen3_5MoeForCausalLM``, the text model of
  Qwen3.6-35B-A3B): three Gated DeltaNet layers to one gated full-attention layer, routed experts with a
  shared expert, at toy widths: a prefill of a prompt longer than one 64-token DeltaNet chunk and a greedy
  decode of a few tokens with the cache;
* a Qwen-Image VAE (diffusers ``AutoencoderKLQwenImage``) at a sixth of its width, decoding one image.

Each runs stock, then ``mpsboost.patch(...)``-ed with the default recipes (the patch report is
printed), and the records are printed side by side: throughput, time of the main operator,
correctness against a CPU fp32 reference (and patched against stock), and memory peaks. Timing and
memory are separate passes. Weights are random: the figures show the machinery, not a checkpoint.

Throughput times the whole job; the operator line times one call of the main operator alone (its
largest call in the job), each variant on the inputs its own run hands that call. The two can go
opposite ways (a recipe changes every other call and the work between calls too); the demo then says
so next to the figures (:func:`measure_lines`). Every line it prints fits a terminal (:data:`WIDTH`).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import re
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from .bench.harness import BUSY_SPREAD, best_device, count_pad5d, machine_load, measure_job, ratio_lines
from .bench.models import build, model_config

# BUSY_SPREAD and ratio_lines are the harness's (one busy-machine check for every entry point), named here too.
__all__ = [
    "main",
    "run_demo",
    "MODELS",
    "QWEN36_DEMO_CONFIG",
    "QWEN_IMAGE_VAE_DEMO_CONFIG",
    "BUSY_SPREAD",
    "ratio_lines",
    "WIDTH",
]

#: No line the demo prints is longer.
WIDTH = 100

# The model configs live with every other measured model in mpsboost.bench.models (rows "qwen3_5_moe:demo",
# "qwen_image_vae:demo"): Qwen3.6-35B-A3B's text model layout at toy widths, the Qwen-Image VAE at a sixth of
# its width.
QWEN36_DEMO_CONFIG: dict[str, Any] = model_config("qwen3_5_moe:demo")
PROMPT_TOKENS = 96  # one and a half 64-token DeltaNet chunks: the state crosses a chunk boundary
DECODE_TOKENS = 8

QWEN_IMAGE_VAE_DEMO_CONFIG: dict[str, Any] = model_config("qwen_image_vae:demo")
# Latent (frames, height, width): one image, 16x16 -> 128x128 pixels (8x spatial compression).
QWEN_IMAGE_LATENT = (1, 16, 16)

#: --only choices, in the order the demo runs them.
MODELS = ("qwen36", "qwen_image_vae")


def _need(package: str, extra: str):
    import importlib

    try:
        return importlib.import_module(package)
    except ImportError:
        raise SystemExit(_missing_text(package, extra)) from None


def _missing_text(package: str, extra: str) -> str:
    from .install import extra_hint

    return f"mpsboost demo needs {package}, which is not installed; {extra_hint(extra)}"


# model key -> (package it needs, the extra that brings it)
_NEEDS = {"qwen_image_vae": ("diffusers", "diffusers"), "qwen36": ("transformers", "transformers")}


def missing_extras(models: Sequence[str]) -> list[str]:
    """One line per package the selected models need and that is not installed (checked before any work)."""
    import importlib.util

    out = []
    for key in models:
        package, extra = _NEEDS[key]
        if importlib.util.find_spec(package) is None:
            out.append(_missing_text(package, extra))
    return out


def _say(msg: str) -> None:
    print(msg, flush=True)


# --------------------------------------------------------------------------------------------------
# Capturing the main operator's inputs


@dataclass
class _OpCall:
    module: Any = None
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    size: int = -1


@contextlib.contextmanager
def _capture_largest_call(root, class_name: str, out: _OpCall):
    """Keep the inputs of the largest call (by first-input numel) to any submodule of class
    ``class_name`` during the block, to time that operator alone afterwards on the same inputs."""
    import torch

    handles = []

    def hook(module, args, kwargs):
        x = args[0] if args else next(iter(kwargs.values()), None)
        n = x.numel() if isinstance(x, torch.Tensor) else 0
        if n > out.size:
            clone = lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v  # noqa: E731
            out.module, out.size = module, n
            out.args = tuple(clone(a) for a in args)
            out.kwargs = {k: clone(v) for k, v in kwargs.items()}

    for m in root.modules():
        if type(m).__name__ == class_name:
            handles.append(m.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        yield out
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def _keep(cm, into: list):
    """Enter ``cm`` and keep what it yields in ``into`` (read after the block)."""
    with cm as value:
        into.append(value)
        yield value


def _layout(t) -> str:
    import torch

    if t.dim() == 5 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last_3d):
        return "channels_last_3d"
    if t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last):
        return "channels_last"
    return "contiguous" if t.is_contiguous() else "strided"


# --------------------------------------------------------------------------------------------------
# One measured job


@dataclass
class _Job:
    name: str  # workload name
    shape: dict
    run: Callable[[], Any]  # the whole job, returns the output compared for correctness
    items: float  # units per call, for throughput
    unit: str  # "frames/s", "tokens/s"
    op_name: str
    op_class: str  # class name of the main operator's module
    psnr: bool
    data_range: float | None
    root: Any = None  # the model, to find the operator's modules in
    count_pads: bool = False


def _measure(job: _Job, variant: str, env, device: str, *, ref_cpu, stock_out, op: _OpCall, repeats: int, warmup: int):
    from .bench import Record, Workload, correctness
    from .bench.quality import as_tensor

    extra: dict[str, Any] = {}
    watch: list = []
    if op.module is None:
        watch.append(lambda: _capture_largest_call(job.root, job.op_class, op))
    if job.count_pads:
        # The aten-level count (every route to a pad kernel), the one the recipes' tests assert is zero.
        pads: list = []
        watch.append(lambda: _keep(count_pad5d(), pads))

    def ops() -> dict:
        if op.module is None:
            return {}
        module, args, kwargs = op.module, op.args, op.kwargs
        return {job.op_name: lambda: module(*args, **kwargs)}

    # The output call (untimed; the first warm-up call, the operator's inputs, the pad count), the timing
    # of the whole job, the operator alone, then a memory pass separate from timing.
    m = measure_job(
        job.run,
        device=device,
        repeats=repeats,
        warmup=warmup,
        output="first",
        memory="last",
        watch=tuple(watch),
        ops=ops,
        op_warmup=max(warmup, 1),
        op_repeats=max(repeats, 5),
    )
    out = as_tensor(m.output)
    if job.count_pads:
        extra["pad_calls_5d"] = pads[0].total
    extra["first_call_s"] = m.first_call_s
    throughput = m.timing.throughput(job.items, job.unit)
    op_time = {name: t.op_time() for name, t in m.op_timings.items()}
    if op.module is not None:
        args = op.args
        extra["op_input_shape"] = list(args[0].shape) if args and hasattr(args[0], "shape") else None
        extra["op_input_layout"] = _layout(args[0]) if args and hasattr(args[0], "shape") else None
    memory = m.memory

    # correctness against the CPU fp32 reference; patched also against stock
    corr = correctness(out, ref_cpu, reference="cpu-fp32", data_range=job.data_range, psnr_too=job.psnr)
    if stock_out is not None:
        vs = correctness(out, stock_out, reference="stock", data_range=job.data_range, psnr_too=job.psnr)
        extra["vs_stock"] = {k: v for k, v in vs.to_dict().items() if k != "reference"}
    rec = Record(
        workload=Workload(job.name, job.shape),
        variant=variant,
        env=env,
        throughput=throughput,
        op_time=op_time or None,
        correctness=corr,
        memory=memory,
        extra=extra,
    )
    return rec, out


# --------------------------------------------------------------------------------------------------
# The two models


def _qwen_image_vae(device: str, dtype) -> tuple[Any, list[_Job], Callable[[], Any]]:
    import torch

    _need("diffusers", "diffusers")
    vae = build("qwen_image_vae:demo").eval()
    # torch.nn.Module.to: ModelMixin.to warns on every dtype cast about _keep_in_fp32_modules,
    # which this VAE does not have.
    torch.nn.Module.to(vae, device=device, dtype=dtype)
    t, h, w = QWEN_IMAGE_LATENT
    z_dim = vae.config.z_dim
    z = torch.randn(1, z_dim, t, h, w, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    scale = vae.spatial_compression_ratio
    job = _Job(
        name="qwen_image_vae_decode",
        shape={
            "arch": "Qwen-Image VAE (a sixth of its width)",
            "latent": [1, z_dim, t, h, w],
            "frames": t,
            "height": h * scale,
            "width": w * scale,
        },
        run=lambda: vae.decode(z).sample,
        items=t,
        unit="images/s",
        op_name="QwenImageCausalConv3d",
        op_class="QwenImageCausalConv3d",
        psnr=True,
        data_range=2.0,  # the decoder clamps its output to [-1, 1]
        root=vae,
        count_pads=True,
    )

    def reference():
        from .bench import cpu_reference

        return cpu_reference(vae, z, fn=lambda m, zz: m.decode(zz).sample)

    return vae, [job], reference


def _slow_decay_gates(lm, seed: int) -> None:
    """Gated DeltaNet gates that keep the state across chunks: with transformers' random init (A_log from
    log U(0.01, 16), dt_bias 1) a token's gate is about -9.5, every chunk's state decays to exp(-600) = 0
    before the next chunk reads it, and the demo would not run the part of the scan that carries it."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lm.modules():
            if hasattr(m, "A_log") and hasattr(m, "dt_bias"):
                a = torch.empty(m.A_log.shape).uniform_(0.002, 0.05, generator=g)
                m.A_log.copy_(a.log())
                m.dt_bias.fill_(-1.0)


def _qwen36(device: str, dtype) -> tuple[Any, list[_Job], Callable[[], Any]]:
    import torch

    _need("transformers", "transformers")
    torch.manual_seed(2)
    lm = build("qwen3_5_moe:demo").eval()
    _slow_decay_gates(lm, seed=5)
    lm = lm.to(device=device, dtype=dtype)
    config = lm.config
    vocab = config.vocab_size
    ids = torch.randint(0, vocab, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(3)).to(device)

    def prefill():
        return lm(input_ids=ids, use_cache=False).logits

    # Decode feeds fixed next tokens (teacher forcing) rather than each variant's own argmax, so
    # that stock, patched and the reference follow one token path and their logits compare.
    new_ids = torch.randint(0, vocab, (1, DECODE_TOKENS), generator=torch.Generator().manual_seed(4)).to(device)

    # transformers renamed `past_key_values` to `cache` (5.2x); use whichever this version takes.
    cache_kw = "cache" if "cache" in inspect.signature(type(lm).forward).parameters else "past_key_values"

    def decode_steps(m, prompt, new):
        out = m(input_ids=prompt, use_cache=True)
        past, steps = getattr(out, cache_kw), []
        for i in range(new.shape[1]):
            out = m(input_ids=new[:, i : i + 1], use_cache=True, **{cache_kw: past})
            past = getattr(out, cache_kw)
            steps.append(out.logits[:, -1])
        return torch.stack(steps, 1)

    def decode():
        return decode_steps(lm, ids, new_ids)

    kinds = list(config.layer_types)
    arch = {
        "arch": "Qwen3.6 text model (toy widths)",
        "batch": 1,
        "prompt": PROMPT_TOKENS,
        "layers": config.num_hidden_layers,
        "deltanet_layers": kinds.count("linear_attention"),
        "attention_layers": kinds.count("full_attention"),
        "experts": config.num_experts,
        "top_k": config.num_experts_per_tok,
    }
    jobs = [
        _Job(
            name="qwen36_prefill",
            shape=dict(arch),
            run=prefill,
            items=PROMPT_TOKENS,
            unit="tokens/s",
            op_name="Qwen3_5MoeGatedDeltaNet",
            op_class="Qwen3_5MoeGatedDeltaNet",
            psnr=False,
            data_range=None,
            root=lm,
        ),
        _Job(
            name="qwen36_decode",
            shape={**arch, "new_tokens": DECODE_TOKENS},
            run=decode,
            items=DECODE_TOKENS,  # the prefill inside is part of the job; tokens/s counts new tokens
            unit="tokens/s",
            op_name="Qwen3_5MoeSparseMoeBlock",
            op_class="Qwen3_5MoeSparseMoeBlock",
            psnr=False,
            data_range=None,
            root=lm,
        ),
    ]

    def reference():
        from .bench import cpu_reference

        def run_ref(m, ii, new):
            return {
                "qwen36_prefill": m(input_ids=ii, use_cache=False).logits,
                "qwen36_decode": decode_steps(m, ii, new),
            }

        return cpu_reference(lm, ids, new_ids, fn=run_ref)

    return lm, jobs, reference


# --------------------------------------------------------------------------------------------------
# Driver


def _default_dtype(device: str):
    import torch

    # bf16 is what pipelines run in on GPUs; fp32 on the CPU, where bf16 convolutions are slow.
    return torch.float32 if device == "cpu" else torch.bfloat16


def run_demo(
    device: str,
    dtype=None,
    *,
    repeats: int = 3,
    warmup: int | None = None,
    models: Sequence[str] = MODELS,
):
    """Run the demo; returns (records, reports). Prints progress and reports as it goes."""
    from .bench import RecordEnv

    dtype = _default_dtype(device) if dtype is None else dtype
    if warmup is None:
        # Every job's output pass runs first and warms it up; GPUs get one more call for their
        # lazy initialisation (cuBLAS handles, Metal pipeline states) to settle.
        warmup = 0 if device == "cpu" else 1
    env = RecordEnv.capture(device, dtype)
    records, reports = [], []
    builders = {"qwen36": _qwen36, "qwen_image_vae": _qwen_image_vae}
    with _short_fallback_warnings():
        for key in models:
            _run_model(key, builders[key], device, dtype, env, repeats, warmup, records, reports)
    return records, reports


class _FallbackNote:
    """transformers' one-time warning that a kernel package is missing and its PyTorch reference runs (a line
    of 200 characters), said in a line that fits :data:`WIDTH`."""

    _TEXT = re.compile(
        r"`(?P<func>[\w.]+)` is falling back to its reference PyTorch implementation because `(?P<dist>[\w.-]+)`"
    )

    def filter(self, record) -> bool:
        m = self._TEXT.search(record.getMessage())
        if m is None:
            return True
        _say(fit(f"  (transformers runs its PyTorch reference of {m['func']}: {m['dist']} is not installed)"))
        return False


@contextlib.contextmanager
def _short_fallback_warnings():
    import logging

    note = _FallbackNote()
    log = logging.getLogger("transformers.integrations.hub_kernels")
    log.addFilter(note)
    try:
        yield
    finally:
        log.removeFilter(note)


def _run_model(key, builder, device, dtype, env, repeats, warmup, records, reports) -> None:
    """One model: its CPU reference, stock, patched, unpatched; its records and report appended."""
    import torch

    import mpsboost

    t0 = time.perf_counter()
    _say(f"[{key}] building the model with random weights on {device} ({str(dtype).replace('torch.', '')})")
    torch.manual_seed(0)
    model, jobs, reference = builder(device, dtype)
    n_params = sum(p.numel() for p in model.parameters())
    _say(f"[{key}] {type(model).__name__}, {n_params / 1e6:.1f}M parameters; CPU fp32 reference run")
    ref = reference()
    refs = ref if isinstance(ref, dict) else {jobs[0].name: ref}
    ops = {j.name: _OpCall() for j in jobs}
    stock_outs = {}
    for j in jobs:
        _say(f"[{key}] stock: {j.name}")
        rec, out = _measure(
            j,
            "stock",
            env,
            device,
            ref_cpu=refs[j.name],
            stock_out=None,
            op=ops[j.name],
            repeats=repeats,
            warmup=warmup,
        )
        records.append(rec)
        stock_outs[j.name] = out
    report = mpsboost.patch(model)
    reports.append((key, report))
    _say(f"[{key}] mpsboost.patch report:\n{report.format(WIDTH)}")
    try:
        for j in jobs:
            _say(f"[{key}] mpsboost: {j.name}")
            # The operator is timed on the inputs the patched job itself hands it (captured in its own
            # output pass): the same shapes as stock's, in the layout the patched job produces.
            rec, _ = _measure(
                j,
                "mpsboost",
                env,
                device,
                ref_cpu=refs[j.name],
                stock_out=stock_outs[j.name],
                op=_OpCall(),
                repeats=repeats,
                warmup=warmup,
            )
            records.append(
                rec.replace(
                    extra={
                        **rec.extra,
                        "patched": [f"{r.recipe} @ {r.target or '(root)'}" for r in _applied_rows(report)],
                    }
                )
            )
    finally:
        # Nothing to undo when no recipe applied (unpatch would say so with an error).
        from .api import is_patched

        if is_patched(model):
            mpsboost.unpatch(model)
            _say(f"[{key}] unpatched")
    _say(f"[{key}] done in {time.perf_counter() - t0:.1f} s")
    del model, jobs


def _applied_rows(report) -> list:
    rows = getattr(report, "rows", None) or []
    return [r for r in rows if r.status == "applied"]


def _vs_stock_lines(records) -> list[str]:
    lines = []
    for r in records:
        vs = r.extra.get("vs_stock")
        if not vs:
            continue
        parts = []
        from .bench.table import fmt_number

        for k, label in (
            ("psnr_db", "PSNR dB"),
            ("sqnr_db", "SQNR dB"),
            ("rel_error", "rel error"),
            ("max_abs", "max abs"),
        ):
            v = vs.get(k)
            if v is not None:
                parts.append(f"{label} {fmt_number(float(v), 3)}")
        lines.append(f"  {r.workload.name}: {r.variant} vs stock: " + ", ".join(parts))
    pads = [(r.workload.name, r.variant, r.extra["pad_calls_5d"]) for r in records if "pad_calls_5d" in r.extra]
    for name, variant, n in pads:
        lines.append(f"  {name}: {variant}: {n} pad calls on 5-D tensors per decode (aten level)")
    return lines


def measure_lines(records) -> list[str]:
    """What the throughput and op rows measure, and, for each workload where the two ratios go opposite
    ways (one faster than stock, the other slower), why that is no contradiction. Logical lines: the
    demo wraps them to :data:`WIDTH` when it prints (:func:`fit`)."""
    groups: dict[str, dict[str, Any]] = {}
    for r in records:
        groups.setdefault(r.workload.name, {})[r.variant] = r
    ops = sorted({op for r in records for op in (r.op_time or {})})
    lines = ["  throughput: the whole job (every call, and the work between calls), median over the repeats."]
    if ops:
        lines.append(
            f"  op {'/'.join(ops)}: one call of that module alone (its largest call in the job), on the inputs "
            "of each variant's own run, device-synchronised, median over the repeats."
        )
    for name, variants in groups.items():
        base = variants.get("stock")
        if base is None or base.throughput is None:
            continue
        for variant, rec in variants.items():
            if rec is base or rec.throughput is None or not rec.throughput.seconds_per_call:
                continue
            tp = base.throughput.seconds_per_call / rec.throughput.seconds_per_call
            for op, vo in (rec.op_time or {}).items():
                bo = (base.op_time or {}).get(op)
                if bo is None or not vo.median_us:
                    continue
                r_op = bo.median_us / vo.median_us
                if (tp > 1.0) == (r_op > 1.0) or tp == 1.0 or r_op == 1.0:
                    continue
                faster, slower = ("throughput", f"op {op}") if tp > 1.0 else (f"op {op}", "throughput")
                lines.append(
                    f"  {name}: {variant} vs stock: op {op} {r_op:.2f}x but throughput {tp:.2f}x. These time "
                    f"different work: a recipe also changes the other calls and the work between them. "
                    f"{faster.capitalize()} is faster and {slower} slower here: the whole-job figure says what "
                    "the patch buys."
                )
    return lines


def fit(text: str, width: int = WIDTH) -> str:
    """``text`` with every line longer than ``width`` wrapped, its continuation indented two more spaces."""
    out = []
    for line in text.splitlines():
        if len(line) <= width:
            out.append(line)
            continue
        lead = line[: len(line) - len(line.lstrip())]
        out += textwrap.wrap(
            line.strip(),
            width,
            initial_indent=lead,
            subsequent_indent=lead + "  ",
            break_long_words=True,
            break_on_hyphens=False,
        )
    return "\n".join(out)


def next_lines(device: str) -> list[str]:
    """The commands to run after the demo: what applies on this machine, then the evidence to send."""
    lines = ["next: mpsboost doctor            what applies on this machine (recipes per model, features)"]
    if device == "mps":
        lines.append("      mpsboost selftest          evidence from this Mac, in a file to send (README)")
    else:
        lines.append("      mpsboost plan Qwen/Qwen3.6-35B-A3B --device mps --torch 2.15.0   a Mac's decisions")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``mpsboost demo``; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="mpsboost demo",
        description="The seed's models with random weights (a Qwen3.6-architecture LM with its Gated DeltaNet "
        "layers, a Qwen-Image VAE), stock vs mpsboost.patch(), with four separate records: throughput, op "
        "time, correctness, memory.",
    )
    parser.add_argument("--device", choices=("mps", "cuda", "cpu"), help="default: the best present (mps, cuda, cpu)")
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16", "float16"), help="default: float32 on cpu, bfloat16 elsewhere"
    )
    parser.add_argument("--only", choices=MODELS, action="append", help="run only this model (repeatable)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per job (default 3)")
    parser.add_argument("--out", help="also write demo.jsonl, demo.txt (and demo.png with matplotlib) into this folder")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")

    models = tuple(args.only or MODELS)
    missing = missing_extras(models)  # before any work: not after the first model has run
    if missing:
        for line in missing:
            print(fit(line), file=sys.stderr)
        return 2

    import torch

    from .bench.cli import check_device
    from .bench.errors import BenchError
    from .bench.table import compare_table

    device = args.device or best_device()
    try:
        check_device(device)
    except BenchError as exc:
        print(f"mpsboost demo: {exc}", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype) if args.dtype else None
    t0 = time.perf_counter()
    load_before = machine_load()
    records, _ = run_demo(device, dtype, repeats=args.repeats, models=models)
    table = compare_table(records)
    _say("\n" + "=" * WIDTH)
    _say(fit("records (random weights: the figures show the harness and the recipes, not a checkpoint's quality)"))
    _say("")
    _say(fit(table))
    spread = ratio_lines(records, load_before=load_before)
    if spread:
        _say("speed ratios with their range over the repeats:")
        _say(fit("\n".join(spread)))
    measured = measure_lines(records)
    _say("what the speed rows measure:")
    _say(fit("\n".join(measured)))
    lines = _vs_stock_lines(records)
    if lines:
        _say("patched against stock, and structure:")
        _say(fit("\n".join(lines)))
    if args.out:
        from .bench import write_jsonl
        from .bench.cli import _plot_or_explain

        out = Path(args.out)
        path = write_jsonl(out / "demo.jsonl", records)
        (out / "demo.txt").write_text(table + "\n".join(spread + measured + lines) + "\n", encoding="utf-8")
        _say(fit(f"\nrecords: {path}"))
        png = _plot_or_explain(records, out / "demo.png", lambda m: _say(fit(m)))
        if png is not None:
            _say(fit(f"chart:   {png}"))
    _say(f"\ndemo finished in {time.perf_counter() - t0:.1f} s")
    _say("\n".join(next_lines(device)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
