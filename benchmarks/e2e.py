#!/usr/bin/env python3
"""The end-to-end mode matrix: the jobs users run, stock vs ``mpsboost.patch()``, in each way they run them.

    python benchmarks/e2e.py --device cuda --size real --only qwen3-8b --modes eager --out OUT
    python benchmarks/e2e.py --device cpu --size tiny --out OUT          # a smoke run in seconds

Workloads (real architectures, random weights built from shipped configs directly on the device):

* ``qwen3-8b`` (Qwen3-8B shape, ``mpsboost/bench/configs/qwen3_dense``), ``qwen3-30b-a3b`` (Qwen3-30B-A3B
  shape, ``mpsboost/bench/configs/qwen3_moe``) and ``qwen3.6-35b-a3b`` (Qwen3.6-35B-A3B: 30 Gated DeltaNet + 10
  attention layers, 256 experts, ``mpsboost/bench/configs/qwen3_5_moe``): ``generate()`` of ``--new-tokens``
  after a prompt of ``--prompt-tokens`` random ids, greedy and sampled (``do_sample=True``, the global RNG seeded before
  every call). Modes: ``eager`` (the default dynamic cache) and ``static``
  (``cache_implementation="static"``: transformers compiles the forward itself). Variants: ``stock``,
  ``mpsboost`` (``mpsboost.patch(model)`` on the same model, unpatched again for every stock call) and
  ``fp8`` (a second model built from the same seed and patched with ``fp8="rowwise"``, which cannot be
  undone; its baseline is the stock bf16 model of the same run) and ``mac`` (``mpsboost:mac-2.15.0``:
  the same model patched with the decisions a Mac on torch ``--mac-torch`` gets,
  ``patch(model, device=Env.simulate("mps", V))``, computing on this device. Its tokens and logits check
  the Mac paths for correctness at real size; its speed here says nothing about a Mac). Each round times one
  ``generate(max_new_tokens=N)`` call of every variant: prefill (time to first token) runs from the call to
  the first call of a logits processor (a mark: a CUDA event on the stream, or one synchronisation on MPS),
  and decode time per token is the rest of the call over ``N - 1``. The share of the bandwidth limit is
  (weight bytes read per decoded token / measured device copy bandwidth) / decode time per token,
  where the bytes are every parameter and buffer of the model except the input embedding (one row is
  read), with 3-D expert weights counted at top_k/num_experts. Generated tokens are compared with the
  first stock round's (reported, not asserted); the last-position logits of one forward over the
  prompt are compared with stock's (relative error, SQNR). Mode ``hooked`` writes its own records
  (``e2e-breakdown``, never mixed with the throughput): each module kind (Gated DeltaNet, attention, MoE
  block, of which experts) timed with device-synchronising forward hooks over the prompt's forward and
  ``--breakdown-steps`` greedy decode steps, in the same paired rounds, medians per kind.
* ``wan22-ti2v-5b`` (``WanPipeline``, 480x832, 81 frames) and ``qwen-image`` (``QwenImagePipeline``,
  1024x1024): ``--steps`` denoising steps and the VAE decode. No text encoder is built: the pipeline
  gets random ``prompt_embeds`` (and negative ones) of the text encoder's output shape and dtype; the
  records say so. Modes: ``eager``, ``compile`` (``pipe.transformer = torch.compile(pipe.transformer)``)
  and ``offload`` (``pipe.enable_model_cpu_offload()``). Variants: ``stock`` and ``mpsboost``. Each
  patched output is compared with the stock output of the same mode (PSNR, relative error).

Every (workload, mode) runs in one process, on one model built once (the patched variants patch it and
unpatch it again: patching is never timed, and after every unpatch the model is checked to be stock again,
object for object and bit for bit). One untimed warm-up call per variant (compilation included; its time is
recorded), then ``--rounds`` paired rounds (at least 5 for a figure to publish) through the harness's one
measure loop (:func:`mpsboost.bench.harness.paired_rounds`): every variant once a round, stock and patched
alternating (the order reversed every other round, to cancel drift). Each round gives each variant a ratio to
stock (stock's time / the variant's, same round); a record keeps every round's ratio, their median (the
published figure), min..max and IQR, and a label: "faster in every round", "slower in every round", or
"not faster: rounds straddle 1.0" whatever the median says. Memory peaks come from an untimed call per variant
(the warm-up call where nothing compiles, else one more call after the rounds): memory sampling is never
inside a timed call. Records are appended to ``OUT/e2e.jsonl`` as each (workload, mode) finishes;
``--budget-s`` stops starting new work once spent (and cuts rounds short, saying so).

The seed's Qwen3.6 on one GPU, native and Mac 2.15.0 decisions (each command builds the 40-layer model once):

    python benchmarks/e2e.py --device cuda --only qwen3.6-35b-a3b --modes eager,hooked --variants mpsboost,mac \
        --decoding greedy --rounds 7 --new-tokens 32 --out OUT
    python benchmarks/e2e.py --device cuda --only qwen3.6-35b-a3b --modes static --variants mpsboost,mac \
        --decoding greedy --rounds 5 --new-tokens 32 --out OUT
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

import mpsboost
from mpsboost.api import is_patched
from mpsboost.bench import models as C  # the shipped configs (config, default_dtype, dtype_name), as the cookbook's
from mpsboost.bench.harness import RoundRatios, best_device, copy_bandwidth, mark, paired_rounds, round_ratios
from mpsboost.bench.memory import measure_memory
from mpsboost.bench.quality import correctness
from mpsboost.bench.records import Correctness, OpTime, Record, RecordEnv, Throughput, Workload
from mpsboost.bench.timing import _quantile, synchronize

NAME = "e2e"
# workload -> its family in the shipped configs (mpsboost.bench.models)
LLM = {"qwen3-8b": "qwen3_dense", "qwen3-30b-a3b": "qwen3_moe", "qwen3.6-35b-a3b": "qwen3_5_moe"}
DIFFUSION = {"wan22-ti2v-5b": "wan22_ti2v", "qwen-image": "qwen_image"}
WORKLOADS = tuple(LLM) + tuple(DIFFUSION)
LLM_MODES = ("eager", "static", "hooked")  # hooked: the per-module breakdown, its own records
DIFFUSION_MODES = ("eager", "compile", "offload")
LLM_VARIANTS = ("stock", "mpsboost", "fp8", "mac", "options")
DIFFUSION_VARIANTS = ("stock", "mpsboost")
FP8_VARIANT = "mpsboost:fp8-rowwise"
OPTIONS_VARIANT = "mpsboost:options"  # patch(model, options=--options): a choice measured before it becomes a default
MAC_PREFIX = "mpsboost:mac-"  # + the simulated torch version: the decisions a Mac gets, computed here
# The diffusers workloads at real size (the brief's shapes, not the 704x1280 of the cookbook's run.json).
REAL_VIDEO = {"height": 480, "width": 832, "frames": 81}
REAL_IMAGE = {"height": 1024, "width": 1024}


# ---------------------------------------------------------------------------------------- run state


class Run:
    def __init__(self, args: argparse.Namespace, filename: str = f"{NAME}.jsonl"):
        self.args = args
        self.device = args.device
        self.t0 = time.perf_counter()
        self.records: list[Record] = []
        self.out = args.out
        self.path = None
        if self.out is not None:
            self.out.mkdir(parents=True, exist_ok=True)
            self.path = self.out / filename
        self._bw: tuple[float, str] | None = None

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def spent(self) -> bool:
        return self.args.budget_s is not None and self.elapsed() > self.args.budget_s

    def log(self, text: str) -> None:
        print(f"[e2e {self.elapsed():7.1f}s] {text}", flush=True)

    def add(self, recs: list[Record]) -> None:
        self.records += recs
        if self.path is not None:
            with self.path.open("a", encoding="utf-8") as fh:
                fh.write("".join(r.to_json() + "\n" for r in recs))

    def copy_bandwidth(self) -> tuple[float, str]:
        """Device copy bandwidth (read + write bytes over time), measured once per run.

        The harness's probe, as benchmarks/moe.py uses it (a 2 GiB copy on CUDA); 64 MiB elsewhere so that a
        CPU smoke run stays short (measured on the CPU too: the smoke run exercises the bandwidth share).
        """
        if self._bw is None:
            dev = self.device
            nbytes = (2 << 30) if torch.device(dev).type == "cuda" else (1 << 26)
            bw = copy_bandwidth(dev, nbytes=nbytes, on_cpu=True)
            self._bw = (
                bw,
                f"measured in this run: device copy of {nbytes >> 20} MiB, read + write bytes over median time",
            )
        return self._bw


def free(reset_dynamo: bool = True) -> None:
    gc.collect()
    if reset_dynamo:
        try:
            torch._dynamo.reset()
        except Exception:  # noqa: BLE001 - nothing compiled, or dynamo unavailable
            pass
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def summary(samples: list[float]) -> dict:
    """Best, median, worst and the spread of a list of seconds (the spread relative to the median)."""
    xs = sorted(samples)
    med = statistics.median(xs)
    return {
        "best": xs[0],
        "median": med,
        "worst": xs[-1],
        "spread": xs[-1] - xs[0],
        "rel_spread": (xs[-1] - xs[0]) / med if med > 0 else None,
        "n": len(xs),
        "samples": list(samples),
    }


def op_time(samples: list[float], warmup: int, calls: int = 1) -> OpTime:
    xs = sorted(samples)
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return OpTime(
        median_us=statistics.median(xs) * 1e6,
        min_us=xs[0] * 1e6,
        max_us=xs[-1] * 1e6,
        iqr_us=(q[2] - q[0]) * 1e6,
        repeats=len(xs),
        warmup=warmup,
        method="synchronize+perf_counter",
        calls=calls,
    )


def patch_summary(report: Any) -> dict:
    """Applied and skipped counts of a patch report, its backing paths and skip reasons (folded)."""
    backing: dict[str, int] = {}
    reasons: dict[str, str] = {}
    for row in report.applied:
        key = f"{row.recipe}: {row.backing}"
        backing[key] = backing.get(key, 0) + 1
    for row in report.skipped:
        reasons.setdefault(row.recipe, row.reason)
    return {"applied": len(report.applied), "skipped": len(report.skipped), "backing": backing, "skip_reasons": reasons}


def graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process so far (to show that no timed round recompiled)."""
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:  # noqa: BLE001 - dynamo unavailable
        return 0


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:400] if str(exc) else ''}"


# ---------------------------------------------------------------------------------------- LLM


def llm_config(workload: str, size: str, layers: int | None):
    from transformers import AutoConfig

    data = C.config(LLM[workload], size, "config.json")
    if layers is not None:
        data["num_hidden_layers"] = layers
    model_type = data.pop("model_type")
    return AutoConfig.for_model(model_type, **data)


def build_llm(cfg, device: str, dtype: torch.dtype, seed: int):
    """Random weights initialised on the device itself in ``dtype`` (no CPU pass, no fp32 copy)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    with torch.no_grad():
        # Explicit, seeded values (the same for the bf16 and the fp8 model): norms 1, the rest N(0, 0.02).
        torch.manual_seed(seed)
        for p in model.parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    # Random weights emit the end token at random: always generate the full number of tokens.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def weight_bytes_per_token(model) -> int:
    """Bytes of weights one decoded token reads (batch 1): all parameters and buffers, the input
    embedding as one row (unless tied to the output head), 3-D expert weights at top_k/num_experts."""
    cfg = model.config
    experts = getattr(cfg, "num_experts", None)
    top_k = getattr(cfg, "num_experts_per_tok", None)
    emb = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    tied = out is not None and out.weight.data_ptr() == emb.data_ptr()
    seen: set[int] = set()
    total = 0
    for _, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.data_ptr() in seen or t.numel() == 0:
            continue
        seen.add(t.data_ptr())
        nbytes = t.numel() * t.element_size()
        if t.data_ptr() == emb.data_ptr() and not tied:
            nbytes = emb.shape[-1] * emb.element_size()
        elif experts and top_k and t.dim() == 3 and t.shape[0] == experts:
            nbytes = nbytes * top_k // experts
        total += nbytes
    return total


# The blocks of a decoder layer the breakdown times, by the attribute names transformers gives them; an MoE
# block is an ``mlp`` with ``experts`` (timed too, inside it).
BREAKDOWN_KINDS = {"linear_attn": "linear_attention", "self_attn": "attention", "mlp": "moe_block"}


def breakdown_kinds(model) -> dict[str, list[torch.nn.Module]]:
    """{kind: modules} for the breakdown: the Gated DeltaNet layers, attention layers, MoE blocks and
    their experts of every decoder layer (``model.model.layers[i].<linear_attn|self_attn|mlp>``)."""
    layers = next(m for n, m in model.named_modules() if n.endswith("layers") and isinstance(m, torch.nn.ModuleList))
    found: dict[str, list[torch.nn.Module]] = {}
    for layer in layers:
        for attr, kind in BREAKDOWN_KINDS.items():
            mod = getattr(layer, attr, None)
            experts = getattr(mod, "experts", None) if kind == "moe_block" else None
            if mod is None or (kind == "moe_block" and experts is None):
                continue
            found.setdefault(kind, []).append(mod)
            if experts is not None:
                found.setdefault("experts", []).append(experts)
    return found


def module_breakdown(model, prompt: torch.Tensor, mask: torch.Tensor, steps: int, dev: str) -> dict:
    """Time per module kind with device-synchronising forward hooks: one forward over the prompt (prefill)
    and ``steps`` greedy decode steps on its cache. Untimed by the rounds; the hooks' synchronisation
    makes the step slower than in the rounds, so the figures are shares of a hooked step, in ms."""
    kinds = breakdown_kinds(model)
    acc = {k: 0.0 for k in kinds}
    starts: dict[int, float] = {}
    hooks = []
    for kind, mods in kinds.items():
        for m in mods:

            def pre(mod, args, kwargs=None):
                synchronize(dev)
                starts[id(mod)] = time.perf_counter()

            def post(mod, args, out, kind=kind):
                synchronize(dev)
                acc[kind] += time.perf_counter() - starts.pop(id(mod))

            hooks.append(m.register_forward_pre_hook(pre))
            hooks.append(m.register_forward_hook(post))
    try:
        with torch.no_grad():
            synchronize(dev)
            t0 = time.perf_counter()
            out = model(prompt, attention_mask=mask, use_cache=True)
            synchronize(dev)
            prefill_s = time.perf_counter() - t0
            prefill = dict(acc)
            for k in acc:
                acc[k] = 0.0
            cache, am = out.past_key_values, mask
            nxt = out.logits[:, -1:].argmax(-1)
            synchronize(dev)
            t0 = time.perf_counter()
            for _ in range(steps):
                am = torch.cat([am, am.new_ones(am.shape[0], 1)], dim=1)
                out = model(nxt, attention_mask=am, past_key_values=cache, use_cache=True)
                nxt = out.logits[:, -1:].argmax(-1)
            synchronize(dev)
            decode_s = time.perf_counter() - t0
    finally:
        for h in hooks:
            h.remove()
    return {
        "decode_ms_per_token": {k: v / steps * 1e3 for k, v in acc.items()},
        "decode_step_ms_hooked": decode_s / steps * 1e3,
        "prefill_ms": {k: v * 1e3 for k, v in prefill.items()},
        "prefill_ms_hooked": prefill_s * 1e3,
        "modules": {k: len(v) for k, v in kinds.items()},
        "steps": steps,
        "method": "forward pre/post hooks that synchronise the device; experts are inside moe_block (of which)",
    }


class StockState:
    """The stock model as ``unpatch`` must give it back, checked after every unpatch between rounds.

    :meth:`snapshot` before a patch takes every module's type and instance attribute names, and every parameter
    and buffer (the same object, shape, strides, dtype, device); :meth:`check` after the unpatch compares them
    (transformers itself adds attributes in ``generate()``, such as its static cache: hence a snapshot per
    patch, not one per run). A tensor whose storage moved since the model was built (a recipe that fuses
    projections gives the same Parameter new storage back) must hold the bits it held then: an exact checksum
    of its integer view, taken on the device when the model was built, is compared (one synchronisation).
    :meth:`check` raises naming the first difference; a run whose stock is not stock times nothing.
    """

    _INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

    def __init__(self, model: torch.nn.Module):
        self.structure, self.ptrs, self.tensors = self._take(model)
        self.sums = {key: self._sum(t) for key, t in self.tensors.items()}

    @staticmethod
    def _take(model: torch.nn.Module):
        structure, ptrs, tensors = [], {}, {}
        for name, mod in model.named_modules():
            structure.append((name, type(mod).__qualname__, tuple(sorted(vars(mod)))))
            for kind, items in (("param", mod._parameters), ("buffer", mod._buffers)):
                for pname, t in items.items():
                    if t is None:
                        continue
                    key = f"{name}.{pname}" if name else pname
                    structure.append((kind, key, id(t), tuple(t.shape), t.stride(), str(t.dtype), str(t.device)))
                    ptrs[key] = t.data_ptr()
                    tensors[key] = t
        return structure, ptrs, tensors

    @classmethod
    def _sum(cls, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        if t.is_complex() or t.element_size() not in cls._INT:
            return t.float().sum()
        return t.view(cls._INT[t.element_size()]).sum(dtype=torch.int64)

    def snapshot(self, model: torch.nn.Module) -> list:
        return self._take(model)[0]

    def check(self, model: torch.nn.Module, before: list | None = None) -> None:
        """Raise unless ``model`` is as it was at ``before`` (a :meth:`snapshot`; default: when built)."""
        before = self.structure if before is None else before
        structure, ptrs, tensors = self._take(model)
        if structure != before:
            diff = next(
                (_first_difference(x, y) for x, y in zip(before, structure) if x != y),
                f"{len(before)} entries became {len(structure)}",
            )
            raise RuntimeError(f"unpatch did not restore the stock model: {diff}")
        moved = [k for k, p in ptrs.items() if p != self.ptrs[k]]
        if moved:
            now = torch.stack([self._sum(tensors[k]) for k in moved])
            was = torch.stack([self.sums[k] for k in moved])
            bad = (now != was).nonzero().flatten().tolist()
            if bad:
                raise RuntimeError(f"unpatch did not restore the stock model: {moved[bad[0]]} holds other values")


def _first_difference(was: tuple, now: tuple) -> str:
    if was[0] == now[0] and len(was) == len(now) == 3:  # a module: say which attributes came or went
        gone, new = sorted(set(was[2]) - set(now[2])), sorted(set(now[2]) - set(was[2]))
        return f"module {was[0] or '<root>'} ({was[1]}): attributes removed {gone}, added {new}"
    return f"{was} became {now}"


def round_summary(samples: list[float]) -> dict:
    """:func:`summary` plus the quartiles (the IQR) of a phase's per-round times."""
    out = summary(samples)
    xs = sorted(samples)
    out.update(q1=_quantile(xs, 0.25), q3=_quantile(xs, 0.75))
    out["iqr"] = out["q3"] - out["q1"]
    return out


def run_llm(run: Run, workload: str, modes: list[str], variants: list[str], decodings: list[str]) -> None:
    a = run.args
    dev, dtype = run.device, torch.bfloat16 if a.dtype == "bfloat16" else torch.float32
    cfg = llm_config(workload, a.size, a.layers)
    run.log(f"{workload}: building ({cfg.num_hidden_layers} layers, {dtype})")
    t = time.perf_counter()
    model = build_llm(cfg, dev, dtype, a.seed)
    build_s = time.perf_counter() - t
    fp8_model, fp8_report, fp8_error, fp8_build_s = None, None, None, None
    if "fp8" in variants:
        try:
            t = time.perf_counter()
            fp8_model = build_llm(cfg, dev, dtype, a.seed)
            fp8_report = mpsboost.patch(fp8_model, fp8="rowwise")
            fp8_build_s = time.perf_counter() - t
        except Exception as exc:  # noqa: BLE001 - recorded, the other variants still run
            fp8_error = f"build or patch: {error_text(exc)}"
            fp8_model = None
            free()
    run.log(f"{workload}: built in {build_s:.1f} s" + (f", fp8 model {fp8_build_s:.1f} s" if fp8_build_s else ""))
    t = time.perf_counter()
    stock = StockState(model)
    run.log(f"{workload}: stock state taken in {time.perf_counter() - t:.1f} s")
    mac_name = MAC_PREFIX + a.mac_torch
    reports: dict[str, Any] = {FP8_VARIANT: fp8_report}
    for name, want in (("mpsboost", "mpsboost"), (mac_name, "mac"), (OPTIONS_VARIANT, "options")):
        if want == "mpsboost" or want in variants:
            reports[name] = apply_variant(model, name, a)
            if is_patched(model):  # a default that applies nothing on this device leaves nothing to undo
                mpsboost.unpatch(model)
            stock.check(model)
    bw, bw_source = run.copy_bandwidth()
    gen = torch.Generator().manual_seed(a.seed + 1)
    prompt = torch.randint(0, cfg.vocab_size, (1, a.prompt_tokens), generator=gen).to(dev)
    mask = torch.ones_like(prompt)
    ctx = LlmContext(
        run=run,
        workload=workload,
        cfg=cfg,
        model=model,
        fp8_model=fp8_model,
        fp8_error=fp8_error,
        reports=reports,
        stock=stock,
        prompt=prompt,
        mask=mask,
        bw=bw,
        bw_source=bw_source,
        dtype=dtype,
        build_s={"stock": build_s, FP8_VARIANT: fp8_build_s},
    )
    try:
        for mode in modes:
            for decoding in ["greedy"] if mode == "hooked" else decodings:
                if run.spent():
                    run.log(f"{workload} {mode} {decoding}: budget spent, not started")
                    continue
                try:
                    if mode == "hooked":
                        llm_breakdown(ctx, variants)
                    else:
                        llm_mode(ctx, mode, decoding, variants)
                except Exception as exc:  # noqa: BLE001 - the next mode or decoding still runs
                    run.log(f"{workload} {mode} {decoding}: failed: {error_text(exc)}")
                    traceback.print_exc(limit=5)
                    if is_patched(model):
                        mpsboost.unpatch(model)
                free(reset_dynamo=False)  # greedy and sampled share the compiled forward
            free()
    finally:
        del model, fp8_model, ctx, stock, reports  # the stock state holds the parameters too
        free()


def mac_env(version: str):
    """The decisions a Mac on torch ``version`` gets (the model still computes on this device)."""
    from mpsboost.gate import Env

    return Env.simulate("mps", version)


def apply_variant(model, name: str, a: argparse.Namespace):
    """Patch the shared model as variant ``name`` asks (through ``mpsboost.patch``); returns the report."""
    if name == "mpsboost":
        return mpsboost.patch(model)
    if name.startswith(MAC_PREFIX):
        return mpsboost.patch(model, device=mac_env(a.mac_torch))
    if name == OPTIONS_VARIANT:
        env = mac_env(a.mac_torch) if a.options_mac else None
        return mpsboost.patch(model, options=a.options, **({"device": env} if env is not None else {}))
    raise ValueError(f"no patch for variant {name!r}")


@dataclass
class LlmContext:
    """What every mode of one LLM workload shares: the model (built once), its stock state, the reports."""

    run: Run
    workload: str
    cfg: Any
    model: Any
    fp8_model: Any
    fp8_error: str | None
    reports: dict
    stock: StockState
    prompt: torch.Tensor
    mask: torch.Tensor
    bw: float
    bw_source: str
    dtype: torch.dtype
    build_s: dict

    def names(self, variants: list[str]) -> list[str]:
        a = self.run.args
        return (
            ["stock"]
            + (["mpsboost"] if "mpsboost" in variants else [])
            + ([FP8_VARIANT] if self.fp8_model is not None else [])
            + ([MAC_PREFIX + a.mac_torch] if "mac" in variants else [])
            + ([OPTIONS_VARIANT] if "options" in variants else [])
        )

    def model_of(self, name: str):
        return self.fp8_model if name == FP8_VARIANT else self.model

    def state(self, name: str, switch_s: dict[str, list[float]]) -> Callable[[], Any]:
        """The variant's state around its calls, entered outside every timed region: a patched variant
        of the shared model is patched on entry (the time it takes goes to ``switch_s``, not to a sample)
        and unpatched on exit, and the stock state is checked after every unpatch."""
        model = self.model

        @contextlib.contextmanager
        def state():
            if name in (FP8_VARIANT, "stock"):
                if is_patched(model):
                    raise RuntimeError(f"the shared model is still patched when {name} runs")
                yield
                return
            before = self.stock.snapshot(model)
            t = time.perf_counter()
            apply_variant(model, name, self.run.args)
            switch_s.setdefault(name, []).append(time.perf_counter() - t)
            try:
                yield
            finally:
                if is_patched(model):
                    mpsboost.unpatch(model)
                self.stock.check(model, before)

        return state


class FirstToken:
    """A logits processor that marks the first token's logits (:func:`mpsboost.bench.harness.mark`): the
    prefill forward has run. On CUDA the mark is an event on the stream (no synchronisation); on MPS it waits
    for the device once (the prefill must finish before the first token is chosen anyway)."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        mark("first_token")  # the first call counts; later calls change nothing
        return scores


def llm_mode(ctx: LlmContext, mode: str, decoding: str, variants: list[str]) -> None:
    """generate() of every variant in paired rounds (:func:`mpsboost.bench.harness.paired_rounds`): one
    ``generate(max_new_tokens=N)`` call of each variant a round; its prefill (time to the first token) runs to
    the first call of a logits processor, and decode per token is the rest of the call over ``N - 1``."""
    run, a, dev = ctx.run, ctx.run.args, ctx.run.device
    workload, prompt, mask = ctx.workload, ctx.prompt, ctx.mask
    N = a.new_tokens
    names = ctx.names(variants)
    mac_name = MAC_PREFIX + a.mac_torch
    errors: dict[str, str] = {}
    if "fp8" in variants and ctx.fp8_model is None:
        errors[FP8_VARIANT] = ctx.fp8_error or "not built"
    kw: dict[str, Any] = {"attention_mask": mask, "do_sample": decoding == "sampled"}
    if mode == "static":
        kw["cache_implementation"] = "static"
    switch_s: dict[str, list[float]] = {}
    outs: dict[str, list[torch.Tensor]] = {n: [] for n in names}

    from transformers import LogitsProcessorList

    def job(name: str) -> Callable[[], Any]:
        m = ctx.model_of(name)

        def call():
            torch.manual_seed(a.seed + 2)  # the sampling seed, the same for every call
            with torch.no_grad():
                out = m.generate(
                    prompt,
                    max_new_tokens=N,
                    min_new_tokens=N,
                    logits_processor=LogitsProcessorList([FirstToken()]),
                    **kw,
                )
            outs[name].append(out)  # a device tensor: read after the rounds, no sync in a timed call
            return out

        return call

    jobs = {n: {"generate": job(n)} for n in names}
    states = {n: ctx.state(n, switch_s) for n in names}
    label = f"{workload} {mode} {decoding}"
    # Eager: the memory peaks are taken on the untimed warm-up call (nothing compiles there), which
    # saves a call per variant; compiled: on a separate call after the rounds (compilation allocates).
    mem_on_warmup = mode == "eager"
    warm, mem, warm_graphs = warm_up(
        run, names, lambda n: states[n], lambda n: jobs[n]["generate"], dev, mem_on_warmup, errors, label
    )
    if "stock" not in names:
        run.log(f"{label}: stock failed; nothing to compare")
        return
    for n in names:
        outs[n].clear()
    graphs0 = graphs_compiled()
    rounds = paired_rounds(
        {n: jobs[n] for n in names},
        device=dev,
        rounds=a.rounds,
        warmup=0,
        baseline="stock",
        contexts={n: states[n] for n in names},
        stop=lambda done: done < a.rounds and run.spent(),
    )
    recompiled = graphs_compiled() - graphs0
    budget_cut = rounds.rounds < a.rounds
    if budget_cut:
        run.log(f"{label}: budget spent after {rounds.rounds} round(s)")
    pre = {n: list(rounds.samples[n]["generate@first_token"]) for n in names}
    full = {n: list(rounds.samples[n]["generate"]) for n in names}
    decode = {n: [(f - p) / max(N - 1, 1) for f, p in zip(full[n], pre[n])] for n in names}
    for r in range(rounds.rounds):
        run.log(
            f"{label}: round {r + 1} ({', '.join(rounds.orders[r])}): "
            + ", ".join(f"{n} prefill {pre[n][r] * 1e3:.1f} ms decode {decode[n][r] * 1e3:.2f} ms/tok" for n in names)
        )
    paired: dict[str, dict[str, RoundRatios]] = {}
    for n in names:
        if n == "stock":
            continue
        paired[n] = {
            "prefill": round_ratios(pre["stock"], pre[n]),
            "decode": round_ratios(decode["stock"], decode[n]),
            "call": round_ratios(full["stock"], full[n]),
        }
        run.log(f"{label}: {n} vs stock: " + "; ".join(f"{k} {v}" for k, v in paired[n].items()))
    tokens = {n: [o[0, prompt.shape[1] :].tolist() for o in outs[n]] for n in names}
    logits: dict[str, torch.Tensor] = {}
    for name in names:
        try:
            with states[name]():
                if not mem_on_warmup:
                    with measure_memory(dev) as probe:
                        jobs[name]["generate"]()
                    mem[name] = probe.peaks()
                with torch.no_grad():
                    logits[name] = ctx.model_of(name)(prompt, attention_mask=mask).logits[0, -1].float().cpu()
        except Exception as exc:  # noqa: BLE001
            errors.setdefault(name, f"memory pass: {error_text(exc)}")

    env = RecordEnv.capture(dev, ctx.dtype, compile="transformers-static-cache" if mode == "static" else False)
    work = Workload(f"{NAME}-generate", llm_shape(ctx, mode, decoding))
    ref_tokens = tokens["stock"][0] if tokens.get("stock") else None
    recs = []
    for name in ["stock", "mpsboost", FP8_VARIANT, mac_name, OPTIONS_VARIANT]:
        if name not in names and name not in errors:
            continue
        extra: dict[str, Any] = {
            "mode": mode,
            "decoding": decoding,
            "sampling_seed": a.seed + 2 if decoding == "sampled" else None,
            "generate_kwargs": {k: v for k, v in kw.items() if k != "attention_mask"},
            "build_s": ctx.build_s.get(name) or ctx.build_s["stock"],
            "warmup_s": warm.get(name),
            "rounds_requested": a.rounds,
            "switch_s": switch_s.get(name) or None,
            "budget_cut": budget_cut,
            "graphs_compiled_during_rounds": recompiled,
            "graphs_compiled_in_warmup": warm_graphs.get(name),
            "sampling": (
                {k: getattr(ctx.model.generation_config, k, None) for k in ("temperature", "top_k", "top_p")}
                if decoding == "sampled"
                else None
            ),
            "timing": (
                f"{rounds.describe_order()} (mpsboost.bench.harness.paired_rounds, {rounds.methods.get(name, '-')}); "
                "one generate(max_new_tokens=N) call a round; prefill: from its start to the first call of a "
                "logits processor (harness.mark: a CUDA event, no sync); decode per token: (call - prefill) / "
                "(N - 1); patching between rounds is not timed and the stock model is checked after every unpatch"
            ),
        }
        if name in errors:
            extra["error"] = errors[name]
        extra["memory_pass"] = (
            "the untimed warm-up call (eager: nothing compiles)"
            if mem_on_warmup
            else "one untimed call after the rounds"
        )
        if name == OPTIONS_VARIANT:
            extra["options"] = a.options
            if a.options_mac:
                extra["decisions"] = (
                    f"simulated: the decisions of an Apple MPS machine on torch {a.mac_torch} with these options, "
                    "computed on this device; the speed here says nothing about a Mac"
                )
        if ctx.reports.get(name) is not None:
            extra["patch"] = patch_summary(ctx.reports[name])
        if name == mac_name:
            extra["decisions"] = (
                f"simulated: the decisions of an Apple MPS machine on torch {a.mac_torch}, computed on this "
                "device; tokens and logits check the Mac paths, the speed here says nothing about a Mac"
            )
        if name == FP8_VARIANT:
            extra["baseline"] = "stock bf16 model of this run (fp8 cannot be undone: a second model, same seed)"
        throughput = ops = corr = None
        if name in names:
            dec = decode[name]
            wbytes = weight_bytes_per_token(ctx.model_of(name))
            limit_s = wbytes / ctx.bw
            extra.update(
                {
                    "rounds": rounds.rounds,
                    "round_orders": [list(o) for o in rounds.orders],
                    "prefill_s": round_summary(pre[name]),
                    "decode_s_per_token": round_summary(dec),
                    "generate_call_s": round_summary(full[name]),
                    "tokens_equal_stock": bool(ref_tokens is not None and all(t == ref_tokens for t in tokens[name])),
                    "tokens_reference": "stock, first timed round"
                    + (" (same sampling seed)" if decoding == "sampled" else ""),
                    "token_match_fraction": (
                        min(sum(x == y for x, y in zip(t, ref_tokens)) / len(ref_tokens) for t in tokens[name])
                        if ref_tokens
                        else None
                    ),
                    "bandwidth": {
                        "weight_bytes_per_token": wbytes,
                        "copy_bandwidth_bytes_per_s": ctx.bw,
                        "copy_bandwidth_source": ctx.bw_source,
                        "limit_s_per_token": limit_s,
                        "share_of_limit": limit_s / statistics.median(dec) if statistics.median(dec) > 0 else None,
                        "counted": (
                            "parameters and buffers; input embedding one row; 3-D expert weights x top_k/num_experts; "
                            "KV cache not counted"
                        ),
                    },
                }
            )
            if name in paired:
                extra["paired_rounds"] = {
                    "baseline": "stock",
                    "ratio": "stock time / this variant's time in the same round (> 1 faster)",
                    **{k: v.to_dict() for k, v in paired[name].items()},
                }
                extra["ratio_vs_stock"] = {k: v.median for k, v in paired[name].items()}
                extra["verdict_vs_stock"] = {k: v.label for k, v in paired[name].items()}
                extra["ratio_note"] = "median over the paired rounds of stock / this variant (> 1 faster)"
            throughput = Throughput(
                value=statistics.median(dec) * 1e3,
                unit="ms/token",
                seconds_per_call=statistics.median(full[name]),
                items_per_call=N,
                repeats=len(dec),
                warmup=1,
                spread={"min_ms": min(dec) * 1e3, "max_ms": max(dec) * 1e3},
            )
            ops = {
                "prefill": op_time(pre[name], 1),
                "decode_token": op_time(dec, 1),
                "generate_call": op_time(full[name], 1),
            }
            if name != "stock" and "stock" in logits and name in logits:
                c = correctness(logits[name], logits["stock"], reference="stock", psnr_too=False)
                corr = Correctness(
                    "stock: last-position logits of one forward over the prompt",
                    rel_error=c.rel_error,
                    sqnr_db=c.sqnr_db,
                    max_abs=c.max_abs,
                )
        recs.append(
            Record(
                workload=work,
                variant=name,
                env=env,
                throughput=throughput,
                op_time=ops,
                correctness=corr,
                memory=mem.get(name),
                extra=extra,
            )
        )
    ctx.run.add(recs)


def llm_shape(ctx: LlmContext, mode: str, decoding: str) -> dict:
    return {
        "model": ctx.workload,
        "layers": ctx.cfg.num_hidden_layers,
        "mode": mode,
        "decoding": decoding,
        "prompt_tokens": int(ctx.prompt.shape[1]),
        "new_tokens": ctx.run.args.new_tokens,
        "batch": 1,
        "weights": "random (seeded, N(0, 0.02))",
    }


def warm_up(
    run: Run,
    names: list[str],
    state_of: Callable[[str], Any],
    call_of: Callable[[str], Callable[[], Any]],
    dev: str,
    mem_on_warmup: bool,
    errors: dict[str, str],
    label: str,
) -> tuple[dict[str, float], dict[str, Any], dict[str, int]]:
    """One untimed call of every variant inside its state: its wall time, the graphs it compiled and, where
    ``mem_on_warmup``, its memory peaks. A variant that fails is recorded in ``errors`` and removed from ``names``."""
    warm: dict[str, float] = {}
    mem: dict[str, Any] = {}
    warm_graphs: dict[str, int] = {}
    for name in list(names):
        try:
            with state_of(name)():
                g0 = graphs_compiled()
                if mem_on_warmup:
                    with measure_memory(dev) as probe:
                        warm[name] = wall(call_of(name), dev)
                    mem[name] = probe.peaks()
                else:
                    warm[name] = wall(call_of(name), dev)
                warm_graphs[name] = graphs_compiled() - g0
            run.log(f"{label}: warm-up {name} {warm[name]:.1f} s")
        except Exception as exc:  # noqa: BLE001 - a variant that cannot run is recorded and left out
            errors[name] = f"warm-up: {error_text(exc)}"
            run.log(f"{label}: {name} failed: {errors[name]}")
            traceback.print_exc(limit=3)
            names.remove(name)
            free(reset_dynamo=False)  # a reset would drop the other variants' compiled code
    return warm, mem, warm_graphs


def wall(fn: Callable[[], Any], device: str) -> float:
    """Seconds of one untimed call (a warm-up: compilation included), synchronised."""
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - t0


def llm_breakdown(ctx: LlmContext, variants: list[str]) -> None:
    """The hooked breakdown, its own records (``e2e-breakdown``, never mixed with the throughput rounds): per
    round, each variant's forward over the prompt and ``--breakdown-steps`` greedy decode steps with
    device-synchronising hooks around each Gated DeltaNet layer, attention layer, MoE block and its experts;
    the rounds paired and alternated as the throughput's are. Figures are medians over the rounds, in ms."""
    run, a, dev = ctx.run, ctx.run.args, ctx.run.device
    names = [n for n in ctx.names(variants) if n != FP8_VARIANT or ctx.fp8_model is not None]
    switch_s: dict[str, list[float]] = {}
    passes: dict[str, list[dict]] = {n: [] for n in names}

    def job(name: str) -> Callable[[], None]:
        def call():
            passes[name].append(module_breakdown(ctx.model_of(name), ctx.prompt, ctx.mask, a.breakdown_steps, dev))

        return call

    states = {n: ctx.state(n, switch_s) for n in names}
    rounds = paired_rounds(
        {n: job(n) for n in names},
        device=dev,
        rounds=a.rounds,
        warmup=1,
        baseline="stock",
        contexts=states,
        stop=lambda done: done < a.rounds and run.spent(),
    )
    for n in names:
        del passes[n][0]  # the warm-up pass
    env = RecordEnv.capture(dev, ctx.dtype, compile=False)
    shape = dict(llm_shape(ctx, "hooked", "greedy"), decode_steps=a.breakdown_steps)
    shape.pop("new_tokens")
    work = Workload(f"{NAME}-breakdown", shape)
    recs = []
    for name in names:
        ps = passes[name]
        med = lambda key: {  # noqa: E731
            k: statistics.median(p[key][k] for p in ps) for k in ps[0][key]
        }
        per_kind = {k: [p["decode_ms_per_token"][k] for p in ps] for k in ps[0]["decode_ms_per_token"]}
        extra = {
            "mode": "hooked",
            "rounds": rounds.rounds,
            "round_orders": [list(o) for o in rounds.orders],
            "switch_s": switch_s.get(name) or None,
            "breakdown": {
                "decode_ms_per_token": med("decode_ms_per_token"),
                "decode_ms_per_token_rounds": per_kind,
                "decode_step_ms_hooked": statistics.median(p["decode_step_ms_hooked"] for p in ps),
                "prefill_ms": med("prefill_ms"),
                "prefill_ms_hooked": statistics.median(p["prefill_ms_hooked"] for p in ps),
                "modules": ps[0]["modules"],
                "steps": a.breakdown_steps,
                "method": ps[0]["method"] + "; medians over paired, alternated rounds",
            },
            "note": "hooks synchronise the device around every timed module: never compare with throughput records",
        }
        if ctx.reports.get(name) is not None:
            extra["patch"] = patch_summary(ctx.reports[name])
        if name != "stock":
            # A module kind that one variant never calls on its own (moe_block runs the experts inline, so
            # their hook reads 0) has no ratio: it is left out rather than divided by zero.
            extra["paired_rounds"] = {
                kind: round_ratios(per_kind_stock, per_kind_var).to_dict()
                for kind, per_kind_stock, per_kind_var in (
                    (k, [p["decode_ms_per_token"][k] for p in passes["stock"]], v) for k, v in per_kind.items()
                )
                if min(per_kind_stock) > 0 and min(per_kind_var) > 0
            }
        run.log(
            f"{ctx.workload} hooked: {name} decode per token (medians): "
            + ", ".join(f"{k} {v:.2f} ms" for k, v in extra["breakdown"]["decode_ms_per_token"].items())
        )
        recs.append(Record(workload=work, variant=name, env=env, extra=extra))
    run.add(recs)


# ---------------------------------------------------------------------------------------- diffusers


def build_pipe(workload: str, size: str, device: str, dtype: torch.dtype, seed: int, layers: int | None):
    folder = DIFFUSION[workload]
    run = C.config(folder, size, "run.json")
    tcfg = C.config(folder, size, "transformer.json")
    if layers is not None:
        tcfg["num_layers"] = layers
    torch.manual_seed(seed)
    if workload == "wan22-ti2v-5b":
        from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel

        if size == "real":
            run.update(REAL_VIDEO)
        with C.default_dtype(dtype), torch.device(device):
            transformer = WanTransformer3DModel.from_config(tcfg)
            vae = AutoencoderKLWan.from_config(C.config(folder, size, "vae.json"))
        sched = UniPCMultistepScheduler(
            prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=run["flow_shift"]
        )
        pipe = WanPipeline(
            tokenizer=None,
            text_encoder=None,
            vae=vae,
            scheduler=sched,
            transformer=transformer,
            transformer_2=None,
            boundary_ratio=None,
            expand_timesteps=True,
        )
    else:
        from diffusers import (
            AutoencoderKLQwenImage,
            FlowMatchEulerDiscreteScheduler,
            QwenImagePipeline,
            QwenImageTransformer2DModel,
        )

        if size == "real":
            run.update(REAL_IMAGE)
        with C.default_dtype(dtype), torch.device(device):
            transformer = QwenImageTransformer2DModel.from_config(tcfg)
            vae = AutoencoderKLQwenImage.from_config(C.config(folder, size, "vae.json"))
        pipe = QwenImagePipeline(
            scheduler=FlowMatchEulerDiscreteScheduler(),
            vae=vae,
            text_encoder=None,
            tokenizer=None,
            transformer=transformer,
        )
    keep_fp32(pipe.transformer)
    pipe.to(device=device)
    if run.get("vae_tiling"):
        pipe.vae.enable_tiling()
    pipe.set_progress_bar_config(disable=True)
    return pipe, run


def keep_fp32(model) -> list[str]:
    """Put the modules the class keeps in float32 back in float32, as ``from_pretrained(torch_dtype=...)`` does."""
    keep = getattr(model, "_keep_in_fp32_modules", None) or []
    done = []
    for name, mod in model.named_modules():
        if name and any(k in name.split(".") for k in keep):
            mod.float()
            done.append(name)
    return done


def pipe_inputs(
    workload: str, pipe, run: dict, device: str, dtype: torch.dtype, seed: int, steps: int
) -> tuple[dict, dict]:
    """Call arguments with random prompt embeddings of the text encoder's output shape; and their description."""
    g = torch.Generator().manual_seed(seed + 1)
    n = run["text_tokens"]
    if workload == "wan22-ti2v-5b":
        dim = pipe.transformer.config.text_dim
        emb = torch.randn(1, n, dim, generator=g).to(device, dtype)
        neg = torch.randn(1, n, dim, generator=g).to(device, dtype)
        kw = {
            "prompt_embeds": emb,
            "negative_prompt_embeds": neg,
            "height": run["height"],
            "width": run["width"],
            "num_frames": run["frames"],
            "guidance_scale": run["guidance_scale"],
        }
        desc = {
            "prompt_embeds": (
                f"random N(0,1) [1, {n}, {dim}] {C.dtype_name(dtype)} (UMT5 output shape; no text encoder built)"
            ),
            "negative_prompt_embeds": "random, same shape",
            "guidance_scale": run["guidance_scale"],
        }
    else:
        dim = pipe.transformer.config.joint_attention_dim
        emb = torch.randn(1, n, dim, generator=g).to(device, dtype)
        neg = torch.randn(1, n, dim, generator=g).to(device, dtype)
        m = torch.ones(1, n, dtype=torch.long, device=device)
        kw = {
            "prompt_embeds": emb,
            "prompt_embeds_mask": m,
            "negative_prompt_embeds": neg,
            "negative_prompt_embeds_mask": m,
            "true_cfg_scale": run["true_cfg_scale"],
            "height": run["height"],
            "width": run["width"],
        }
        desc = {
            "prompt_embeds": (
                f"random N(0,1) [1, {n}, {dim}] {C.dtype_name(dtype)} with an all-ones mask "
                "(Qwen2.5-VL output shape; no text encoder built)"
            ),
            "negative_prompt_embeds": "random, same shape",
            "true_cfg_scale": run["true_cfg_scale"],
        }
    kw["num_inference_steps"] = steps
    kw["output_type"] = "pt"
    return kw, desc


def run_diffusion(run: Run, workload: str, modes: list[str], variants: list[str]) -> None:
    a = run.args
    dev = run.device
    dtype = torch.bfloat16 if a.dtype == "bfloat16" else torch.float32
    run.log(f"{workload}: building")
    t = time.perf_counter()
    pipe, cfg = build_pipe(workload, a.size, dev, dtype, a.seed, a.layers)
    for key in ("height", "width", "frames"):
        if getattr(a, key, None) is not None and key in cfg:
            cfg[key] = getattr(a, key)
    build_s = time.perf_counter() - t
    run.log(f"{workload}: built in {build_s:.1f} s")
    kw, desc = pipe_inputs(workload, pipe, cfg, dev, dtype, a.seed, a.steps)
    original = pipe.transformer
    try:
        for mode in modes:
            if run.spent():
                run.log(f"{workload} {mode}: budget spent, not started")
                continue
            if mode == "offload" and torch.device(dev).type == "cpu":
                run.log(
                    f"{workload} offload: needs an accelerator (the model moves between the CPU and it); not run on cpu"
                )
                continue
            try:
                if mode == "compile":
                    pipe.transformer = torch.compile(original)
                elif mode == "offload":
                    pipe.enable_model_cpu_offload(device=dev)
                diffusion_mode(run, workload, mode, variants, pipe, kw, desc, cfg, dtype, build_s)
            except Exception as exc:  # noqa: BLE001 - e.g. offload without accelerate: the other modes still count
                run.log(f"{workload} {mode}: failed: {error_text(exc)}")
                traceback.print_exc(limit=5)
            finally:
                if is_patched(pipe):
                    mpsboost.unpatch(pipe)
                if mode == "compile":
                    pipe.transformer = original
                free()
    finally:
        del pipe, original
        free()


def diffusion_mode(
    run: Run,
    workload: str,
    mode: str,
    variants: list[str],
    pipe,
    kw: dict,
    desc: dict,
    cfg: dict,
    dtype,
    build_s: float,
) -> None:
    a = run.args
    dev = run.device
    names = ["stock"] + (["mpsboost"] if "mpsboost" in variants else [])
    errors: dict[str, str] = {}
    reports: dict[str, Any] = {}

    def select(name: str):
        if name == "mpsboost" and not is_patched(pipe):
            reports.setdefault(name, mpsboost.patch(pipe))
        elif name == "stock" and is_patched(pipe):
            mpsboost.unpatch(pipe)

    def state(name: str) -> Callable[[], Any]:
        # patched on entry, unpatched on exit: outside every timed region (patching is a one-time cost)
        @contextlib.contextmanager
        def cm():
            select(name)
            try:
                yield
            finally:
                select("stock")

        return cm

    last: dict[str, Any] = {}

    def call(name: str):
        with torch.no_grad():
            out = pipe(**kw, generator=torch.Generator(device="cpu").manual_seed(a.seed))
        last[name] = out.frames if workload == "wan22-ti2v-5b" else out.images  # read after the rounds
        return last[name]

    label = f"{workload} {mode}"
    mem_on_warmup = mode != "compile"  # as for generate(): no compilation in the warm-up call
    warm, mem, warm_graphs = warm_up(run, names, state, lambda n: lambda: call(n), dev, mem_on_warmup, errors, label)
    times: dict[str, list[float]] = {n: [] for n in names}
    outputs: dict[str, torch.Tensor] = {}
    graphs0 = graphs_compiled()
    budget_cut = False
    paired: dict[str, RoundRatios] = {}
    orders: list[list[str]] = []
    if "stock" in names:
        rounds = paired_rounds(
            {n: (lambda n=n: call(n)) for n in names},
            device=dev,
            rounds=a.rounds,
            warmup=0,
            baseline="stock",
            contexts={n: state(n) for n in names},
            stop=lambda done: done < a.rounds and run.spent(),
        )
        budget_cut = rounds.rounds < a.rounds
        orders = [list(o) for o in rounds.orders]
        times = {n: list(rounds.samples[n]["call"]) for n in names}
        outputs = {n: torch.as_tensor(last[n]).detach().float().cpu() for n in names}
        for r in range(rounds.rounds):
            run.log(f"{label}: round {r + 1}: " + ", ".join(f"{n} {times[n][r]:.3f} s" for n in rounds.orders[r]))
        paired = {n: rounds.ratios(n, "call") for n in names if n != "stock"}
        for n, rr in paired.items():
            run.log(f"{label}: {n} vs stock: {rr}")
    recompiled = graphs_compiled() - graphs0
    for name in names:
        if not times[name] or mem_on_warmup:
            continue
        try:
            with state(name)():
                with measure_memory(dev) as probe:
                    call(name)
            mem[name] = probe.peaks()
        except Exception as exc:  # noqa: BLE001
            errors.setdefault(name, f"memory pass: {error_text(exc)}")
    env = RecordEnv.capture(dev, dtype, compile=True if mode == "compile" else False)
    shape = {
        "pipeline": type(pipe).__name__,
        "mode": mode,
        "height": cfg["height"],
        "width": cfg["width"],
        "steps": kw["num_inference_steps"],
        "transformer_layers": pipe.transformer.config.num_layers,
        "vae_tiling": bool(getattr(pipe.vae, "use_tiling", False)),
        "weights": "random (seeded)",
        "fp32_modules": list(getattr(pipe.transformer, "_keep_in_fp32_modules", None) or []),
        "text_tokens": cfg["text_tokens"],
    }
    if "frames" in cfg:
        shape["frames"] = cfg["frames"]
    work = Workload(f"{NAME}-{workload}", shape)
    recs = []
    for name in ["stock", "mpsboost"]:
        if name not in names and name not in errors:
            continue
        extra: dict[str, Any] = {
            "mode": mode,
            "inputs": desc,
            "build_s": build_s,
            "warmup_s": warm.get(name),
            "rounds_requested": a.rounds,
            "budget_cut": budget_cut,
            "graphs_compiled_during_rounds": recompiled,
            "graphs_compiled_in_warmup": warm_graphs.get(name),
            "mode_setup": {
                "eager": "pipeline on the device",
                "compile": "pipe.transformer = torch.compile(pipe.transformer)",
                "offload": "pipe.enable_model_cpu_offload()",
            }[mode],
        }
        if name in errors:
            extra["error"] = errors[name]
        extra["memory_pass"] = (
            "the untimed warm-up call (no compilation in this mode)"
            if mem_on_warmup
            else "one untimed call after the rounds"
        )
        if name in reports:
            extra["patch"] = patch_summary(reports[name])
        throughput = ops = corr = None
        if times.get(name):
            extra.update({"rounds": len(times[name]), "round_orders": orders, "call_s": round_summary(times[name])})
            if name in paired:
                extra["paired_rounds"] = {
                    "baseline": "stock",
                    "ratio": "stock time / this variant's time in the same round (> 1 faster)",
                    "call": paired[name].to_dict(),
                }
                extra["ratio_vs_stock"] = {"call": paired[name].median}
                extra["verdict_vs_stock"] = {"call": paired[name].label}
                extra["ratio_note"] = "median over the paired rounds of stock / this variant (> 1 faster)"
            xs = times[name]
            throughput = Throughput(
                value=statistics.median(xs),
                unit="s/call",
                seconds_per_call=statistics.median(xs),
                items_per_call=None,
                repeats=len(xs),
                warmup=1,
                spread={"min_s": min(xs), "max_s": max(xs)},
            )
            ops = {"pipeline_call": op_time(xs, 1)}
            if name != "stock" and "stock" in outputs and name in outputs:
                corr = correctness(
                    outputs[name], outputs["stock"], reference=f"stock ({mode}), first timed round", data_range=1.0
                )
        recs.append(
            Record(
                workload=work,
                variant=name,
                env=env,
                throughput=throughput,
                op_time=ops,
                correctness=corr,
                memory=mem.get(name),
                extra=extra,
            )
        )
    run.add(recs)


# ---------------------------------------------------------------------------------------- summary


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


SHORT_LABEL = {"faster in every round": "faster", "slower in every round": "slower"}


def _ratio_cell(extra: dict, key: str) -> str:
    """The median of the paired rounds' ratios, their min..max, and the label (``straddles 1.0``: not faster)."""
    p = (extra.get("paired_rounds") or {}).get(key)
    if not p:
        return f"{extra['ratio_vs_stock'][key]:.2f}"
    label = SHORT_LABEL.get(p["label"], "NOT FASTER, straddles 1.0" if "straddle" in p["label"] else p["label"])
    return f"{p['median']:.2f} ({p['min']:.2f}..{p['max']:.2f}, {label})"


def table(records: list[Record]) -> str:
    """One line per record: the figures of its medians, its ratio to stock of the same run, memory, agreement."""
    head = (
        "workload",
        "mode",
        "decoding",
        "variant",
        "rounds",
        "prefill ms",
        "decode ms/tok (best..worst)",
        "call s",
        "x stock",
        "bw share",
        "peak alloc GiB",
        "reserved GiB",
        "tokens=stock / PSNR dB",
        "note",
    )
    rows = [head]
    for r in records:
        e, s = r.extra, r.workload.shape
        ratio = e.get("ratio_vs_stock", {})
        if "decode_s_per_token" in e:
            d = e["decode_s_per_token"]
            dec = f"{d['median'] * 1e3:.2f} ({d['best'] * 1e3:.2f}..{d['worst'] * 1e3:.2f})"
            pre = f"{e['prefill_s']['median'] * 1e3:.1f}"
            call = f"{e['generate_call_s']['median']:.3f}"
            x = f"dec {_ratio_cell(e, 'decode')} pre {_ratio_cell(e, 'prefill')}" if "decode" in ratio else ""
            share = e["bandwidth"]["share_of_limit"]
            bws = "-" if share is None else f"{share * 100:.1f}%"
            agree = str(e["tokens_equal_stock"])
        elif "call_s" in e:
            c = e["call_s"]
            dec, pre, bws = "-", "-", "-"
            call = f"{c['median']:.3f} ({c['best']:.3f}..{c['worst']:.3f})"
            x = _ratio_cell(e, "call") if "call" in ratio else ""
            agree = "-" if r.correctness is None else f"{r.correctness.psnr_db:.1f}"
        else:
            dec = pre = call = x = bws = agree = "-"
        m = r.memory
        rows.append(
            (
                str(s.get("model") or r.workload.name.replace(f"{NAME}-", "")),
                str(s.get("mode")),
                str(s.get("decoding", "-")),
                r.variant,
                str(e.get("rounds", 0)),
                pre,
                dec,
                call,
                x,
                bws,
                _gib(m.tensor_allocated if m else None),
                _gib(m.allocator_reserved if m else None),
                agree,
                (e.get("error") or "")[:60],
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)


# ---------------------------------------------------------------------------------------- main


def _list(text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad:
        raise SystemExit(f"--{what}: unknown {bad}; accepted: {', '.join(allowed)}")
    return items


def _json_options(text: str) -> dict:
    """--options JSON with its lists as tuples (recipe options take tuples; JSON has none)."""

    def tup(v):
        if isinstance(v, list):
            return tuple(tup(x) for x in v)
        if isinstance(v, dict):
            return {k: tup(x) for k, x in v.items()}
        return v

    return tup(json.loads(text))


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--device", default=best_device())  # what `mpsboost bench` picks: mps, cuda, cpu
    p.add_argument("--size", choices=("tiny", "real"), default="real")
    p.add_argument("--only", default=",".join(WORKLOADS), help=f"workloads: {', '.join(WORKLOADS)}")
    p.add_argument(
        "--modes",
        default=",".join(dict.fromkeys(LLM_MODES + DIFFUSION_MODES)),
        help=(
            "LLM: eager, static, hooked (the per-module breakdown, its own records); diffusers: eager, compile, "
            "offload (each workload runs those of its kind)"
        ),
    )
    p.add_argument(
        "--variants",
        default="mpsboost,fp8",
        help=(
            "besides stock (always run): mpsboost, fp8 (LLM only), mac (LLM only: Mac decisions, see --mac-torch), "
            "options (LLM only: --options)"
        ),
    )
    p.add_argument(
        "--options",
        type=_json_options,
        default=None,
        help='the options variant\'s patch(options=...), as JSON, e.g. \'{"rms_norm": {"devices": ["cuda"]}}\'',
    )
    p.add_argument(
        "--options-mac",
        action="store_true",
        help="the options variant patches with the Mac decisions of --mac-torch (a Mac choice measured on the GPU)",
    )
    p.add_argument("--mac-torch", default="2.15.0", help="the torch version of the simulated Mac of the 'mac' variant")
    p.add_argument(
        "--breakdown-steps",
        type=int,
        default=8,
        help="mode hooked: greedy decode steps of each per-module breakdown pass",
    )
    p.add_argument("--decoding", default="greedy,sampled", help="LLM decoding: greedy, sampled")
    p.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="paired rounds, each running every variant once (>= 5 for figures you report)",
    )
    p.add_argument(
        "--layers", type=int, default=None, help="override the number of layers (transformer blocks) of every model"
    )
    p.add_argument("--prompt-tokens", type=int, default=None, help="LLM prompt length (default: 512 real, 16 tiny)")
    p.add_argument("--new-tokens", type=int, default=None, help="LLM new tokens (default: 64 real, 8 tiny)")
    p.add_argument("--steps", type=int, default=2, help="diffusers denoising steps")
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--frames", type=int, default=None, help="Wan frames (4k+1)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--budget-s", type=float, default=None, help="start no new work after this many seconds; what ran is written"
    )
    p.add_argument("--out", type=Path, default=None, help="folder for e2e.jsonl (appended to)")
    a = p.parse_args(argv)
    a.only = _list(a.only, WORKLOADS, "only")
    a.modes = _list(a.modes, tuple(dict.fromkeys(LLM_MODES + DIFFUSION_MODES)), "modes")
    a.variants = _list(a.variants, ("stock",) + LLM_VARIANTS[1:], "variants")
    a.decoding = _list(a.decoding, ("greedy", "sampled"), "decoding")
    if "options" in a.variants and not isinstance(a.options, dict):
        raise SystemExit("--variants options needs --options '{\"recipe\": {...}}'")
    if a.rounds < 1:
        raise SystemExit("--rounds must be >= 1")
    if "hooked" in a.modes and a.breakdown_steps < 1:
        raise SystemExit("--breakdown-steps must be >= 1 with --modes hooked")
    if a.prompt_tokens is None:
        a.prompt_tokens = 512 if a.size == "real" else 16
    if a.new_tokens is None:
        a.new_tokens = 64 if a.size == "real" else 8
    if a.new_tokens < 2:
        raise SystemExit(
            "--new-tokens must be >= 2 (decode time per token is the call after the first token over N - 1)"
        )
    kind = torch.device(a.device).type
    if kind == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {a.device}: torch sees no CUDA device")
    return a


def run(device: str, size: str, out: Path) -> list[Record]:
    """The entry point of ``mpsboost bench e2e --device D --size S --out DIR``.

    Further options come from ``MPSBOOST_E2E_ARGS`` (e.g. ``"--only qwen3-8b --modes eager"``). Records
    are appended to ``DIR/e2e.partial.jsonl`` as they come (the command then writes ``DIR/e2e.jsonl``).
    Size ``small``: the real widths with 2 layers, a quick look at a real-size run.
    """
    import os
    import shlex

    argv = ["--device", device, "--size", "real" if size == "small" else size, "--out", str(out)]
    if size == "small":
        argv += ["--layers", "2"]
    argv += shlex.split(os.environ.get("MPSBOOST_E2E_ARGS", ""))
    return _main(parse(argv), filename=f"{NAME}.partial.jsonl")


def main(argv=None) -> int:
    _main(parse(argv))
    return 0


def _main(a: argparse.Namespace, filename: str = f"{NAME}.jsonl") -> list[Record]:
    run = Run(a, filename)
    run.log(
        f"torch {torch.__version__}, device {a.device}, size {a.size}, workloads {a.only}, modes {a.modes}, "
        f"variants stock+{a.variants}, rounds {a.rounds}, budget {a.budget_s}"
    )
    for workload in a.only:
        if run.spent():
            run.log(f"{workload}: budget spent, not started")
            continue
        try:
            if workload in LLM:
                modes = [m for m in a.modes if m in LLM_MODES]
                if modes:
                    run_llm(run, workload, modes, a.variants, a.decoding)
            else:
                # offload last: it moves the pipeline to the CPU and is not undone
                modes = [m for m in DIFFUSION_MODES if m in a.modes]
                if modes:
                    run_diffusion(run, workload, modes, [v for v in a.variants if v in DIFFUSION_VARIANTS])
        except Exception as exc:  # noqa: BLE001 - one workload failing (build, OOM) must not lose the others
            run.log(f"{workload}: failed: {error_text(exc)}")
            traceback.print_exc(limit=5)
            free()
    print()
    print(table(run.records))
    if run.path is not None:
        print(f"\n{len(run.records)} records appended to {run.path} in {run.elapsed():.0f} s")
    return run.records


if __name__ == "__main__":
    sys.exit(main())
