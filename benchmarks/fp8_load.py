"""fp8_load: loading a published fp8 checkpoint with ``mpsboost.load_fp8`` against loading bf16 and converting.

Workloads (real widths, random weights; ``--layers`` cuts the depth, ``--only`` picks workloads):

* ``qwen3_8b``: Qwen3-8B shape (hidden 4096, 36 layers, 32 heads, 8 KV heads, intermediate 12288,
  vocab 151936), transformers' fine-grained FP8 with 128x128 block scales (as Qwen/Qwen3-8B-FP8);
* ``qwen3_30b_a3b``: Qwen3-30B-A3B shape (mpsboost/bench/configs/qwen3_moe/real), same format, experts
  stored one Linear per expert as in Qwen/Qwen3-30B-A3B-FP8; default 12 of its 48 layers (disk and time);
* ``qwen_image``: the Qwen-Image transformer (mpsboost/bench/configs/qwen_image/real/transformer.json) as a
  single ``scaled_fp8`` file (one scale per weight); default 16 of its 60 blocks.
* ``qwen3.6``: Qwen3.6-35B-A3B (``Qwen3_5MoeForCausalLM``: hidden 2048, 40 layers, 3 of 4 Gated DeltaNet,
  256 experts top-8 of width 512, a shared expert, vocab 248,320) in the layout of
  ``Qwen/Qwen3.6-35B-A3B-FP8``: the multimodal wrapper's ``model.language_model.*`` keys, 128x128
  blocks with BF16 ``weight_scale_inv``, experts one Linear per expert, the published
  ``modules_to_not_convert`` (router, ``shared_expert_gate``, ``in_proj_a``/``in_proj_b``, conv, norms,
  embeddings, ``lm_head``) in bf16. Default: all 40 layers (the fp8 file is ~36 GB; no bf16 file is
  written: the bf16 path is the model built on the device from its config, random weights, then
  converted, which is the bf16 model's own device peak). ``--tiny``: a small config of the same class
  for a CPU smoke test.

For each: both checkpoints are written from the same random bf16 values (generated on the device,
tensor by tensor: the bf16 model never exists in memory while writing). Then two fresh processes:

* ``bf16 + convert`` (stock path): ``from_pretrained(bf16 folder, device_map=device)``, the decode step
  timed in bf16, then ``mpsboost.patch(model, fp8="rowwise")`` converts in place;
* ``load_fp8``: the model built on the meta device from its config, ``mpsboost.load_fp8(model, fp8
  checkpoint, device=device)``; the decode step timed in fp8; then the logits against a reference
  that holds the file's exact dequantisation (codes x scales in float32, rounded once to bf16, an
  independent formula) computed by the stock forward; then that reference model in float32 (the same
  weight values, a float32 forward): the distance of each bf16 forward from it, so that a difference
  of summation order (the fp8 GEMV of M = 1 layers against cuBLAS) is seen next to stock bf16's own.

Each process reports its load time, peak device memory (``max_memory_allocated`` / reserved over the
load and conversion) and peak host memory (``VmHWM`` over the load, reset first). Targets: peak memory
while loading <= 0.55x of the bf16 path; logits relative error <= 1e-3. The decode step: one token
after a 128-token prefill for the LMs (median of 16 steps, CUDA events), one 512x512 denoising
forward for Qwen-Image.

    python benchmarks/fp8_load.py --device cuda --out benchmarks/results                   # ~8 min on an H200
    python benchmarks/fp8_load.py --device cuda --only qwen3_8b --layers 8 --out /tmp/r    # a quick look
    python benchmarks/fp8_load.py --device cuda --only qwen3.6 --layers 40 --out benchmarks/results
    python benchmarks/fp8_load.py --device cpu --only qwen3.6 --tiny --out /tmp/r           # CPU smoke test
    python benchmarks/fp8_load.py --device cuda --only qwen3.6 --layers 40 --decode-rounds 8 --out benchmarks/results

``--decode-rounds N`` (qwen3.6) adds the paired decode: in one process per decisions (native, then a Mac's on torch
``--mac``, default 2.15.0, computed on this device), the bf16 model built on the device and patched, and the fp8 model
loaded from the written file with ``load_fp8(..., requantize="rowwise")``; one token after a 128-token prefill, eager,
timed in N alternating rounds (``mpsboost.bench.harness.measure_variants``); records ``fp8_decode_paired``.
``--skip-load`` leaves out the load comparison.

Records go to ``OUT/fp8_load.jsonl`` with the environment of the run. Files are written under
``--workdir`` (default: a temporary folder; needs about 40 GB free at the defaults) and removed after.
Load times are measured with the files in the page cache (just written), for both paths alike.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from mpsboost.bench.models import read_config

ROOT = Path(__file__).resolve().parents[1]

WORKLOADS = ("qwen3_8b", "qwen3_30b_a3b", "qwen_image", "qwen3.6")
DEFAULT_LAYERS = {"qwen3_8b": 36, "qwen3_30b_a3b": 12, "qwen_image": 16, "qwen3.6": 40}
# Qwen/Qwen3.6-35B-A3B-FP8's layout: mpsboost.bench.published.qwen36_fp8_layout (tests/recipes/fp8/test_fp8_qwen36.py
# writes the same by hand, as an independent check).
# A small config of the same class, for --tiny (a CPU smoke test of the whole benchmark).
QWEN36_TINY = {
    "vocab_size": 512,
    "hidden_size": 256,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 128,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 192,
}
TARGET_PEAK = 0.55
TARGET_REL = 1e-3


# ------------------------------------------------------------------------------------------ models


def _config(name: str, layers: int, tiny: bool = False):
    if name == "qwen3.6":
        from transformers import Qwen3_5MoeTextConfig

        # The class defaults are Qwen3.6-35B-A3B's widths; every 4th layer is full attention.
        types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
        return Qwen3_5MoeTextConfig(
            num_hidden_layers=layers,
            layer_types=types,
            tie_word_embeddings=False,
            architectures=["Qwen3_5MoeForCausalLM"],
            **(QWEN36_TINY if tiny else {}),
        )
    if tiny:
        raise SystemExit(f"--tiny is a size of the qwen3.6 workload only, not of {name}")
    if name == "qwen3_8b":
        from transformers import Qwen3Config

        return Qwen3Config(
            vocab_size=151936,
            hidden_size=4096,
            num_hidden_layers=layers,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=12288,
            max_position_embeddings=40960,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            architectures=["Qwen3ForCausalLM"],
        )
    if name == "qwen3_30b_a3b":
        from transformers import Qwen3MoeConfig

        cfg = read_config("qwen3_moe", "real", "config.json")
        cfg = {k: v for k, v in cfg.items() if not k.startswith("_") and k != "model_type"}
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.pop("rope_theta")}
        cfg["num_hidden_layers"] = layers
        return Qwen3MoeConfig(**cfg)
    cfg = read_config("qwen_image", "real", "transformer.json")
    cfg = {k: v for k, v in cfg.items() if k != "_source"}
    cfg["num_layers"] = layers
    return cfg


def _meta_model(name: str, cfg):
    from accelerate import init_empty_weights

    with init_empty_weights():
        if name == "qwen_image":
            from diffusers import QwenImageTransformer2DModel

            return QwenImageTransformer2DModel.from_config(cfg).to(torch.bfloat16)
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)


# ------------------------------------------------------------------------------------------ writing


def write_checkpoints(name: str, cfg, work: Path, device: str) -> dict:
    """The bf16 checkpoint and the published fp8 one, from the same values, one tensor at a time
    (qwen3.6: the fp8 one only)."""
    from mpsboost.bench.published import StreamWriter, write_published

    meta = _meta_model(name, cfg)
    state = meta.state_dict(keep_vars=True)
    bf16_dir = work / "bf16"
    bf16_dir.mkdir(parents=True, exist_ok=True)
    fname = "diffusion_pytorch_model.safetensors" if name == "qwen_image" else "model.safetensors"
    specs = [(k, torch.bfloat16 if v.is_floating_point() else v.dtype, tuple(v.shape)) for k, v in state.items()]
    w16 = StreamWriter(bf16_dir / fname, specs) if name != "qwen3.6" else None
    g = torch.Generator(device=device).manual_seed(0)

    def values():
        for key, t in state.items():
            if not t.is_floating_point():
                v = torch.zeros(t.shape, dtype=t.dtype, device=device)
            elif key.endswith("norm.weight") or ".norm" in key and key.endswith(".weight"):
                v = (1 + 0.1 * torch.randn(t.shape, generator=g, device=device)).to(torch.bfloat16)
            else:
                v = (0.02 * torch.randn(t.shape, generator=g, device=device)).to(torch.bfloat16)
            if w16 is not None:
                w16.write(key, v)
            yield key, v

    t0 = time.perf_counter()
    if name == "qwen3.6":
        return _write_qwen36(meta, cfg, work, values, t0)
    if name == "qwen_image":
        meta.save_config(bf16_dir)
        path, _ = write_published(meta, "scaled_fp8", work / "fp8", tensors=values(), keep_reference=False)
    else:
        cfg.save_pretrained(bf16_dir)
        path, _ = write_published(
            meta,
            "transformers",
            work / "fp8",
            block=(128, 128),
            tensors=values(),
            config=cfg.to_dict(),
            keep_reference=False,
        )
    w16.close()
    sizes = {
        "bf16_bytes": (bf16_dir / fname).stat().st_size,
        "fp8_bytes": sum(f.stat().st_size for f in ([path] if path.is_file() else path.glob("*.safetensors"))),
    }
    return {"bf16": str(bf16_dir), "fp8": str(path), "write_s": time.perf_counter() - t0, **sizes}


def _write_qwen36(meta, cfg, work: Path, values, t0: float) -> dict:
    """Qwen/Qwen3.6-35B-A3B-FP8's layout: the wrapper's config and key prefix, BF16 block scales, per-expert Linears."""
    from mpsboost.bench.published import qwen36_fp8_layout, write_published

    lay = qwen36_fp8_layout(cfg)
    path, _ = write_published(
        meta,
        "transformers",
        work / "fp8",
        block=(128, 128),
        tensors=values(),
        config=lay.config,
        keep_reference=False,
        rename=lay.rename,
        keep=lay.keep,
        scale_dtype=torch.bfloat16,
        modules_to_not_convert=lay.modules_to_not_convert,
    )
    bf16_bytes = sum(t.numel() * 2 for t in meta.state_dict().values())
    return {
        "bf16": None,
        "fp8": str(path),
        "write_s": time.perf_counter() - t0,
        "bf16_bytes": bf16_bytes,
        "fp8_bytes": sum(f.stat().st_size for f in Path(path).glob("*.safetensors")),
    }


# ------------------------------------------------------------------------------------------ one process per path


def _host_peak_reset() -> int:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass
    return _status("VmRSS:")


def _status(field: str) -> int:
    try:
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    elif device == "mps":
        torch.mps.synchronize()


def _decode_step(name: str, model, device: str, cfg, dtype: torch.dtype = torch.bfloat16) -> tuple[float, torch.Tensor]:
    """(median ms of the decode step, output for correctness); ``dtype``: of the float inputs."""
    times = []
    with torch.no_grad():
        if name == "qwen_image":
            g = torch.Generator().manual_seed(3)
            side = 32  # 512x512 pixels -> 64x64 latent, patch 2 -> 32x32 tokens
            hs = torch.randn(1, side * side, cfg["in_channels"], generator=g).to(device, torch.bfloat16).to(dtype)
            enc = torch.randn(1, 64, cfg["joint_attention_dim"], generator=g).to(device, torch.bfloat16).to(dtype)
            mask = torch.ones(1, 64, dtype=torch.long, device=device)
            t = torch.tensor([0.5], device=device, dtype=torch.bfloat16).to(dtype)

            def run():
                return model(
                    hidden_states=hs,
                    encoder_hidden_states=enc,
                    encoder_hidden_states_mask=mask,
                    timestep=t,
                    img_shapes=[[(1, side, side)]],
                    return_dict=False,
                )[0]

            out = run()
            for _ in range(3):
                _sync(device)
                t0 = time.perf_counter()
                run()
                _sync(device)
                times.append((time.perf_counter() - t0) * 1e3)
            return sorted(times)[1], out.float()
        from transformers import DynamicCache

        g = torch.Generator().manual_seed(7)
        ids = torch.randint(0, cfg.vocab_size, (1, 128), generator=g).to(device)
        cache = DynamicCache(config=model.config)  # the hybrid models (Qwen3.6) need their layer types
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        logits = out.logits.float()
        tok = out.logits[:, -1:].argmax(-1)
        for _ in range(16):
            _sync(device)
            t0 = time.perf_counter()
            out = model(input_ids=tok, past_key_values=cache, use_cache=True)
            _sync(device)
            times.append((time.perf_counter() - t0) * 1e3)
            tok = out.logits[:, -1:].argmax(-1)
        ts = sorted(times[2:])
        return ts[len(ts) // 2], logits


def _exact_reference(name: str, model, cfg, device: str) -> torch.nn.Module:
    """The stock model holding the fp8 model's exact dequantisation (independent formula), plain tensors shared."""
    meta = _meta_model(name, cfg)
    state = {}
    fp8_mods = {}
    for mname, mod in model.named_modules():
        entry = mod.__dict__.get("_mpsboost_patches", {}).get("fp8_weights")
        if entry is not None:
            fp8_mods[mname] = getattr(entry["fp8"], "block", None)
    for key, t in model.state_dict().items():
        mod, _, attr = key.rpartition(".")
        if attr.endswith("_scale") and mod in fp8_mods:
            continue
        if mod in fp8_mods and t.dtype in (torch.uint8, torch.float8_e4m3fn):
            s = model.get_submodule(mod)._buffers[attr + "_scale"].float()
            c = t.view(torch.float8_e4m3fn).float() if t.dtype == torch.uint8 else t.float()
            block = fp8_mods[mod]
            if block is not None:
                bn, bk = block
                n, k = c.shape[-2:]
                s = s.repeat_interleave(bn, -2)[..., :n, :].repeat_interleave(bk, -1)[..., :k]
            state[key] = (c * s).to(torch.bfloat16)
            del c
        else:
            state[key] = t
    meta.load_state_dict(state, strict=False, assign=True)
    for mname, mod in meta.named_modules():  # rotary tables and other non-persistent buffers: from the fp8 model
        for b, v in list(mod._buffers.items()):
            if v is not None and (v.device.type == "meta" or v.device.type != torch.device(device).type):
                mod._buffers[b] = model.get_submodule(mname)._buffers[b]
    return meta.eval()


def phase(
    kind: str, name: str, layers: int, files: dict, device: str, tiny: bool = False, lossless: bool = True
) -> dict:
    import mpsboost
    from mpsboost.bench.quality import relative_error

    cfg = _config(name, layers, tiny)
    cuda = device.startswith("cuda")
    base_host = _host_peak_reset()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    if kind == "bf16":
        if name == "qwen3.6":
            # No bf16 file (disk): the bf16 model built on the device (random weights); its peak is the bf16 model's.
            from transformers import AutoModelForCausalLM

            with torch.device(device):
                model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        elif name == "qwen_image":
            from diffusers import QwenImageTransformer2DModel

            model = QwenImageTransformer2DModel.from_pretrained(
                files["bf16"], torch_dtype=torch.bfloat16, device_map=device
            )
        else:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(files["bf16"], dtype=torch.bfloat16, device_map=device)
        model.eval()
        _sync(device)
        load_s = time.perf_counter() - t0
        host_load = _status("VmHWM:") - base_host
        ms, _ = _decode_step(name, model, device, cfg)
        t1 = time.perf_counter()
        mpsboost.patch(model, fp8="rowwise")
        _sync(device)
        convert_s = time.perf_counter() - t1
        out = {
            "load_s": load_s,
            "convert_s": convert_s,
            "total_s": load_s + convert_s,
            "decode_ms": ms,
            "host_peak": host_load,
        }
    else:
        model = _meta_model(name, cfg).eval()
        report = mpsboost.load_fp8(model, files["fp8"], device=device, lossless_recipes=lossless)
        _sync(device)
        load_s = time.perf_counter() - t0
        host_load = _status("VmHWM:") - base_host
        if cuda:  # the load's own peak, before the exact reference model below is built beside it
            load_peak = (torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())
        ms, got = _decode_step(name, model, device, cfg)
        ref = _exact_reference(name, model, cfg, device)
        _, want = _decode_step(name, ref, device, cfg)
        rel = relative_error(got, want)
        equal = bool(torch.equal(got, want))
        # The same weights (the exact dequantisation's bf16 values) in a float32 forward: the function
        # both bf16 forwards approximate. How far the stock bf16 forward lands from it is the floor any
        # bf16 kernel with another summation order (the fp8 GEMV against cuBLAS) is measured against.
        del model
        exact32 = None
        ref_bytes = sum(p.numel() * p.element_size() for p in ref.parameters())
        if not cuda or torch.cuda.mem_get_info()[0] > 1.2 * ref_bytes:  # a float32 copy of the whole reference must fit
            ref.float()
            _, exact32 = _decode_step(name, ref, device, cfg, torch.float32)
        rows = [r for r in report.rows if r.recipe == "fp8_weights" and r.status == "applied"]
        out = {
            "load_s": load_s,
            "total_s": load_s,
            "decode_ms": ms,
            "host_peak": host_load,
            "rel_error": rel,
            "logits_equal": equal,
            "rel_error_vs_fp32": None if exact32 is None else relative_error(got, exact32),
            "bf16_reference_vs_fp32": None if exact32 is None else relative_error(want, exact32),
            "fp8_modules": len(rows),
            "backing": sorted({r.backing for r in rows}),
            "lossless_recipes": lossless,
        }
        if cuda:
            out.update(device_peak=load_peak[0], device_reserved=load_peak[1])
    if cuda and "device_peak" not in out:
        out.update(device_peak=torch.cuda.max_memory_allocated(), device_reserved=torch.cuda.max_memory_reserved())
    return out


# ------------------------------------------------------------------------------------------ paired decode


DECODE_SCALES = {
    "rowwise": "load_fp8(requantize='rowwise') of the written Qwen3.6-FP8-layout file",
    "file": "load_fp8 of the written Qwen3.6-FP8-layout file, its 128x128 block scales kept (exact)",
}


def decode_phase(
    name: str,
    layers: int,
    files: dict,
    device: str,
    mac: str | None,
    rounds: int,
    tiny: bool,
    scales: str = "rowwise",
) -> dict:
    """Eager decode, fp8 against patched bf16 in alternating rounds (mpsboost.bench.harness.measure_variants), in
    one process: the bf16 model built on the device (random weights) and patched, the fp8 model loaded from the
    written file with ``requantize="rowwise"`` (``scales="rowwise"``: the rowwise decode paths) or as it is
    (``scales="file"``: its block scales applied exactly). ``mac``: the decisions of a Mac on that
    torch build (``Env.simulate("mps", mac)``) for both models, computed on this device (load_fp8 with a simulated
    Env reads into host memory; the loaded model is then moved here)."""
    import mpsboost
    from mpsboost.bench.harness import measure_variants
    from mpsboost.gate import Env
    from transformers import AutoModelForCausalLM, DynamicCache

    cfg = _config(name, layers, tiny)
    env = Env.simulate("mps", mac) if mac else None
    with torch.device(device):
        bf = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    mpsboost.patch(bf, **({"device": env} if env else {}))
    fp = _meta_model(name, cfg).eval()
    t0 = time.perf_counter()
    requant = {"requantize": "rowwise"} if scales == "rowwise" else {}
    report = mpsboost.load_fp8(fp, files["fp8"], device=env or device, **requant)
    if env is not None:
        fp.to(device)
    _sync(device)
    load_s = time.perf_counter() - t0
    rows = [r for r in report.rows if r.recipe == "fp8_weights" and r.status == "applied"]
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, cfg.vocab_size, (1, 128), generator=g).to(device)
    states = {}
    with torch.no_grad():
        for label, model in (("bf16 patched", bf), ("fp8", fp)):
            cache = DynamicCache(config=model.config)
            out = model(input_ids=ids, past_key_values=cache, use_cache=True)
            states[label] = {"model": model, "cache": cache, "tok": out.logits[:, -1:].argmax(-1)}

    def step(label: str):
        st = states[label]
        with torch.no_grad():
            out = st["model"](input_ids=st["tok"], past_key_values=st["cache"], use_cache=True)
        st["tok"] = out.logits[:, -1:].argmax(-1)

    m = measure_variants(
        {label: (lambda label=label: step(label)) for label in states}, device=device, repeats=rounds, warmup=2
    )
    t_bf, t_fp = m.timings["bf16 patched"], m.timings["fp8"]
    return {
        "decisions": f"mac-{mac}" if mac else "native",
        "bf16_ms": t_bf.median_s * 1e3,
        "fp8_ms": t_fp.median_s * 1e3,
        "bf16_samples_ms": [x * 1e3 for x in t_bf.samples_s],
        "fp8_samples_ms": [x * 1e3 for x in t_fp.samples_s],
        "speedup": m.ratio("fp8", "bf16 patched"),
        "verdict": m.verdict("fp8", "bf16 patched"),
        "measurement": m.extra("fp8", "bf16 patched"),
        "fp8_load_s": load_s,
        "fp8_backing": sorted({r.backing for r in rows}),
        "scales": scales,
    }


def _decode_records(name: str, layers: int, files: dict, results: list[dict], device: str):
    from mpsboost.bench import Record, RecordEnv, Throughput, Workload

    env = RecordEnv.capture(device, torch.bfloat16)
    recs = []
    for r in results:
        shape = {
            "workload": name,
            "layers": layers,
            "weights": "random",
            "decisions": r["decisions"],
            "step": "one token after a 128-token prefill, eager, DynamicCache",
            "fp8": DECODE_SCALES[r.get("scales", "rowwise")],
            "bf16": "built on the device from the config, mpsboost.patch(model)",
        }
        wl = Workload("fp8_decode_paired", shape)
        recs.append(
            Record(
                wl,
                "bf16 patched",
                env,
                throughput=Throughput(r["bf16_ms"], "ms"),
                extra={"samples_ms": r["bf16_samples_ms"]},
            )
        )
        recs.append(
            Record(
                wl,
                "mpsboost fp8",
                env,
                throughput=Throughput(r["fp8_ms"], "ms"),
                extra={
                    "samples_ms": r["fp8_samples_ms"],
                    "speedup_vs_bf16_patched": r["speedup"],
                    "verdict_vs_bf16_patched": r["verdict"],
                    "backing": r["fp8_backing"],
                    "load_s": r["fp8_load_s"],
                    **r["measurement"],
                },
            )
        )
    return recs


# ------------------------------------------------------------------------------------------ driver


LOAD_VARIANT = "mpsboost load_fp8"


def _records(name: str, layers: int, files: dict, a: dict, b: dict, device: str):
    from mpsboost.bench import Correctness, Memory, Record, RecordEnv, Throughput, Workload

    env = RecordEnv.capture(device, torch.bfloat16)
    shape = {
        "workload": name,
        "layers": layers,
        "weights": "random",
        "format": "scaled_fp8" if name == "qwen_image" else "transformers-fp8 (128x128 blocks)",
        "bf16_bytes": files["bf16_bytes"],
        "fp8_bytes": files["fp8_bytes"],
    }
    if name == "qwen3.6":
        shape.update(
            layout="Qwen/Qwen3.6-35B-A3B-FP8 (model.language_model.* keys, BF16 scale_inv, per-expert Linears)",
            bf16_path="built on the device from the config (random weights, no file), then patch(fp8='rowwise')",
        )
    ratio = b.get("device_peak", 0) / a["device_peak"] if a.get("device_peak") else None
    host_ratio = b["host_peak"] / a["host_peak"] if a.get("host_peak") else None
    recs = [
        Record(
            Workload("fp8_load", shape),
            "bf16 load + convert",
            env,
            throughput=Throughput(a["total_s"], "s"),
            memory=Memory(tensor_allocated=a.get("device_peak"), allocator_reserved=a.get("device_reserved")),
            extra={"host_peak_bytes": a["host_peak"], "load_s": a["load_s"], "convert_s": a["convert_s"]},
        ),
        Record(
            Workload("fp8_load", shape),
            LOAD_VARIANT if b.get("lossless_recipes", True) else LOAD_VARIANT + ", no other recipes",
            env,
            throughput=Throughput(b["total_s"], "s"),
            memory=Memory(tensor_allocated=b.get("device_peak"), allocator_reserved=b.get("device_reserved")),
            correctness=Correctness(
                reference="the file's exact dequantisation, stock forward", rel_error=b["rel_error"]
            ),
            extra={
                "host_peak_bytes": b["host_peak"],
                "device_peak_ratio": ratio,
                "host_peak_ratio": host_ratio,
                "target_peak_ratio": TARGET_PEAK,
                "target_rel_error": TARGET_REL,
                "peak_ok": ratio is not None and ratio <= TARGET_PEAK,
                "rel_ok": b["rel_error"] <= TARGET_REL,
                "rel_error_vs_fp32": b.get("rel_error_vs_fp32"),
                "bf16_reference_vs_fp32": b.get("bf16_reference_vs_fp32"),
                "fp8_modules": b["fp8_modules"],
                "backing": b["backing"],
                "logits_equal": b.get("logits_equal"),
                "lossless_recipes": b.get("lossless_recipes", True),
            },
        ),
        Record(Workload("fp8_decode_step", shape), "bf16", env, throughput=Throughput(a["decode_ms"], "ms")),
        Record(
            Workload("fp8_decode_step", shape),
            LOAD_VARIANT if b.get("lossless_recipes", True) else LOAD_VARIANT + ", no other recipes",
            env,
            throughput=Throughput(b["decode_ms"], "ms"),
        ),
    ]
    return recs, ratio, host_ratio


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cuda")
    p.add_argument("--only", default=",".join(WORKLOADS), help=f"comma-separated subset of {', '.join(WORKLOADS)}")
    p.add_argument(
        "--layers",
        type=int,
        default=None,
        help="layers (blocks) of every workload; default per workload: "
        + ", ".join(f"{k} {v}" for k, v in DEFAULT_LAYERS.items()),
    )
    p.add_argument("--workdir", type=Path, default=None, help="where the checkpoints are written (removed after)")
    p.add_argument("--out", type=Path, default=None, help="folder for fp8_load.jsonl")
    p.add_argument(
        "--tiny", action="store_true", help="qwen3.6 only: a small config of the same class (CPU smoke test)"
    )
    p.add_argument(
        "--decode-rounds",
        type=int,
        default=0,
        help="qwen3.6: also time eager decode, fp8 (requantize='rowwise') against patched bf16, in this many "
        "alternating rounds (>= 5), natively and with the decisions of --mac (default 0: not timed)",
    )
    p.add_argument("--mac", default="2.15.0", help="torch version of the simulated Mac of the paired decode")
    p.add_argument(
        "--decode-scales",
        choices=tuple(DECODE_SCALES),
        default="rowwise",
        help="the paired decode's fp8 model: 'rowwise' (load_fp8(requantize='rowwise')) or 'file' (the file's block "
        "scales kept and applied exactly)",
    )
    p.add_argument("--skip-load", action="store_true", help="qwen3.6: only the paired decode (no load comparison)")
    p.add_argument(
        "--no-lossless-recipes",
        action="store_true",
        help="load_fp8(..., lossless_recipes=False): the fp8 layers alone, no other recipe (the logits comparison "
        "then runs the same code on both sides but the fp8 layers)",
    )
    p.add_argument("--phase", choices=("bf16", "fp8", "decode"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--workload", default=None, help=argparse.SUPPRESS)
    p.add_argument("--files", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    from mpsboost.bench.harness import MIN_REPEATS

    if args.decode_rounds and args.decode_rounds < MIN_REPEATS:
        raise SystemExit(f"--decode-rounds {args.decode_rounds}: the harness takes at least {MIN_REPEATS} rounds")
    if args.phase == "decode":
        res = decode_phase(
            args.workload,
            args.layers,
            json.loads(args.files),
            args.device,
            args.mac or None,
            args.decode_rounds,
            args.tiny,
            args.decode_scales,
        )
        print("RESULT " + json.dumps(res))
        return 0
    if args.phase:
        res = phase(
            args.phase,
            args.workload,
            args.layers,
            json.loads(args.files),
            args.device,
            args.tiny,
            lossless=not args.no_lossless_recipes,
        )
        print("RESULT " + json.dumps(res))
        return 0
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    bad = [n for n in names if n not in WORKLOADS]
    if bad:
        raise SystemExit(f"--only {bad}: known workloads are {', '.join(WORKLOADS)}")
    from mpsboost.bench import write_jsonl

    all_recs = []
    failed = False
    for name in names:
        layers = args.layers or DEFAULT_LAYERS[name]
        work = Path(tempfile.mkdtemp(prefix=f"fp8_load_{name}_", dir=args.workdir))
        try:
            files = write_checkpoints(name, _config(name, layers, args.tiny), work, args.device)
            print(
                f"{name} ({layers} layers{', tiny' if args.tiny else ''}): "
                f"wrote bf16 {files['bf16_bytes'] / 2**30:.2f} GiB"
                f"{'' if files['bf16'] else ' (size only: no file)'} and fp8 "
                f"{files['fp8_bytes'] / 2**30:.2f} GiB in {files['write_s']:.0f} s",
                flush=True,
            )

            def run_phase(kind: str, *extra: str) -> dict:
                proc = subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--phase",
                        kind,
                        "--workload",
                        name,
                        "--layers",
                        str(layers),
                        "--files",
                        json.dumps(files),
                        "--device",
                        args.device,
                        *extra,
                    ]
                    + (["--tiny"] if args.tiny else []),
                    capture_output=True,
                    text=True,
                    env=dict(os.environ, PYTHONWARNINGS="ignore"),
                )
                line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
                if proc.returncode != 0 or line is None:
                    print(proc.stdout[-2000:] + proc.stderr[-4000:], file=sys.stderr)
                    raise RuntimeError(f"{name} {kind} phase failed")
                return json.loads(line[len("RESULT ") :])

            if args.decode_rounds and name == "qwen3.6":
                paired = []
                for mac in ("", args.mac):  # native decisions, then a Mac's, each in its own process
                    r = run_phase(
                        "decode",
                        "--decode-rounds",
                        str(args.decode_rounds),
                        "--mac",
                        mac,
                        "--decode-scales",
                        args.decode_scales,
                    )
                    paired.append(r)
                    print(
                        f"  decode ({r['decisions']} decisions, {args.decode_rounds} alternating rounds): "
                        f"bf16 patched {r['bf16_ms']:.2f} ms, fp8 {r['fp8_ms']:.2f} ms "
                        f"({r['speedup']:.2f}x, {r['verdict']})",
                        flush=True,
                    )
                all_recs += _decode_records(name, layers, files, paired, args.device)
            if args.skip_load:
                continue
            res = {
                "bf16": run_phase("bf16"),
                "fp8": run_phase("fp8", *(["--no-lossless-recipes"] if args.no_lossless_recipes else [])),
            }
            recs, ratio, host_ratio = _records(name, layers, files, res["bf16"], res["fp8"], args.device)
            all_recs += recs
            a, b = res["bf16"], res["fp8"]
            print(
                f"  bf16 + convert: {a['total_s']:.1f} s, "
                f"device peak {a.get('device_peak', 0) / 2**30:.2f} GiB, host peak "
                f"{a['host_peak'] / 2**30:.2f} GiB, decode step {a['decode_ms']:.2f} ms"
            )
            print(
                f"  load_fp8{'' if b['lossless_recipes'] else ' (no other recipes)'}: {b['total_s']:.1f} s, "
                f"device peak {b.get('device_peak', 0) / 2**30:.2f} GiB "
                f"({ratio if ratio is None else round(ratio, 3)}x, target <= {TARGET_PEAK}), "
                f"host peak {b['host_peak'] / 2**30:.2f} GiB "
                f"({host_ratio if host_ratio is None else round(host_ratio, 3)}x), "
                f"decode step {b['decode_ms']:.2f} ms, "
                f"rel error {b['rel_error']:.2e} (target <= {TARGET_REL}; bit-equal: {b.get('logits_equal')})"
                + (
                    ""
                    if b["rel_error_vs_fp32"] is None
                    else f"; against the fp32 forward of the same weights: fp8 "
                    f"{b['rel_error_vs_fp32']:.2e}, stock bf16 {b['bf16_reference_vs_fp32']:.2e}"
                ),
                flush=True,
            )
        except Exception as exc:  # one workload failing does not lose the others' records
            failed = True
            print(f"{name}: {type(exc).__name__}: {exc}", file=sys.stderr)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    if args.out is not None and all_recs:
        args.out.mkdir(parents=True, exist_ok=True)
        print(f"records written to {write_jsonl(args.out / 'fp8_load.jsonl', all_recs)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
