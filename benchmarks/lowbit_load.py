"""lowbit_load: Qwen3.6-35B-A3B in the MLX layout at 4 and 8 bits, loaded by ``mpsboost.from_pretrained``: the load's
device peak against the file, the logits and greedy tokens against the file's exact dequantisation, and eager decode
against patched bf16 under a Mac's decisions.

Workload ``qwen3.6``: ``Qwen3_5MoeForCausalLM`` at Qwen3.6-35B-A3B's config (hidden 2048, 40 layers, 3 of 4 Gated
DeltaNet, 256 experts top-8 of width 512, a shared expert, vocab 248,320; the config of
benchmarks/fp8_load.py), random weights, written as mlx-lm's converter writes ``mlx-community/Qwen3.6-35B-A3B-4bit``:
keys ``language_model.model.layers.N.*``, every ``nn.Linear`` and ``nn.Embedding`` (head and embedding included)
and the experts' ``switch_mlp.{gate,up,down}_proj`` stacks at ``--bits``, groups of ``--group-size``; the router
gates ``mlp.gate`` and ``mlp.shared_expert_gate`` at 8 bits, groups of 64 (mlx-lm's ``quant_predicate``; entries
per module in ``config.json``'s ``quantization``); conv1d ``[C, K, 1]``, zero-centred norms ``+1``, ``A_log``
float32. The writer never holds the bf16 model: each tensor is drawn in bf16 on the device, quantised
(``mpsboost.recipes.low_bit.layers.quantize``, ``mx.quantize``'s codes) and only the codes are kept until
``mpsboost.quant.io.write_folder`` writes the shards. ``--tiny``: a small config of the same class (CPU smoke test).

Load (per bit width, one file at a time under ``--workdir``, removed after; a fresh process loads it):
``mpsboost.from_pretrained(folder, device=...)``; ``torch.cuda.max_memory_allocated`` / reserved over the load
against the file size (target <= 1.15x), the load time (file in the page cache, just written), the host peak
(VmHWM). Then the logits of a 16-token prompt against a reference: the stock model whose weights are the file's
codes unpacked here (shifts and masks of the uint32 words, an independent formula), ``scales * q + biases`` in
float32 rounded once to bf16, computed by the stock forward on the same device (the routers, which the loader
dequantises into their own parameter, taken as loaded); relative error, and 32 greedy tokens equal or the first
position where they differ. Then each decoder layer fed the reference layer's own input (the error one layer
makes, apart from what the depth amplifies); and the logits against weights rounded as ``mx.dequantize`` rounds
them (bf16 product, then bf16 sum: about half the weights one bf16 step off), with the two references' own
distance: how far this random-weight model carries a one-rounding difference in its weights.

Decode (``--decode-rounds N``, N >= 5; records ``lowbit_decode_paired``): one process with the decisions of a Mac on
torch ``--mac`` (``Env.simulate("mps", mac)``, computed on this device; ``--mac ''``: this device's own): each bit
width written again and loaded by ``from_pretrained(folder, device=env)`` (a simulated Env loads into host memory;
the model is then moved here; the folder is removed once loaded), and the bf16 model built on the device from its
config and ``mpsboost.patch``-ed; one token after a 128-token prefill, eager, ``DynamicCache``, in N alternating
rounds (``mpsboost.bench.harness.measure_variants``); median per-round ratios against patched bf16 with their
min..max and quartiles. Each model's report rows (recipe, backing) are recorded: the path each layer took. The
Metal kernels do not run on CUDA: where a Mac's decisions put a layer on ``torch.ops.mpsboost.affine_*``, those
registered operators run their reference implementation here (dequantise, then matmul), and the record says so.

Device time (one H200, estimated from the sizes: ~19 GiB of 4-bit codes and ~35 GiB of 8-bit, written through the
page cache; the bf16 reference 65 GiB beside the loaded model: 84 / 100 GiB of 139 GiB): the load command writes,
loads and checks 4 then 8 bits in ~4-7 min; the decode command writes and loads both again and builds bf16 (118 GiB
at once) in ~4-6 min. ``--budget-s`` (default 560 on CUDA, none elsewhere) stops a run before a phase it cannot
finish, and the records taken so far are written. Commands:

    python benchmarks/lowbit_load.py --device cuda --only qwen3.6 --layers 40 --bits 4,8 --workdir /tmp/lb \
        --out benchmarks/results                                                         # the load, 4 then 8 bits
    python benchmarks/lowbit_load.py --device cuda --only qwen3.6 --layers 40 --bits 4,8 --workdir /tmp/lb \
        --skip-load --decode-rounds 8 --out benchmarks/results/decode                     # the paired decode
    python benchmarks/lowbit_load.py --device cpu --only qwen3.6 --tiny --decode-rounds 2 --out /tmp/r  # CPU smoke

Records go to ``OUT/lowbit_load.jsonl`` with the environment of the run (each command replaces the file: give the
two commands different ``--out`` folders, or rename in between).
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
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fp8_load import _config, _host_peak_reset, _status, _sync  # noqa: E402

WORKLOADS = ("qwen3.6",)
TARGET_PEAK = 1.15
ROUTER_GATES = ("mlp.gate", "mlp.shared_expert_gate")  # mlx-lm's quant_predicate: 8 bits, groups of 64
ROUTER_PARAMS = (8, 64)
PROMPT = 16
NEW_TOKENS = 32
PREFILL = 128
FORMAT = "MLX affine (mlx-lm's converter layout), router gates 8-bit g64"
REFERENCE = (
    "the file's codes unpacked independently (shifts and masks), scales*q+biases in float32 rounded once to bf16, "
    "stock forward on the same device"
)
REFERENCE_ON_CUDA = (
    "torch.ops.mpsboost.affine_* are registered with a Metal kernel for MPS only: on CUDA and the CPU the operator "
    "runs its reference (dequantise, then matmul)"
)


# ------------------------------------------------------------------------------------------ writing


def _value(key: str, shape, dtype: torch.dtype, fam, g: torch.Generator, device: str) -> torch.Tensor:
    """A random tensor of the model's ``key`` on ``device`` (norms near their identity, the rest small)."""
    if not dtype.is_floating_point:
        return torch.zeros(shape, dtype=dtype, device=device)
    r = torch.randn(shape, generator=g, device=device)
    if any(key.endswith(s) for s in fam.zero_centred):
        v = 0.1 * r  # transformers computes x * (1 + w)
    elif key.endswith("norm.weight"):
        v = 1 + 0.1 * r
    else:
        v = 0.02 * r
    return v.to(torch.float32 if any(key.endswith(s) for s in fam.keep_float32) else torch.bfloat16)


def write_mlx(cfg, bits: int, group: int, folder: Path, device: str, seed: int = 0) -> dict:
    """The MLX folder of ``cfg``'s random model at ``bits``/``group`` (router gates at 8 bits), tensor by tensor:
    only the codes, scales and biases are ever held (on ``device``) until the shards are written."""
    import mpsboost.quant.save as mlx_save
    from mpsboost.quant.families import family_for
    from mpsboost.quant.io import write_folder
    from mpsboost.quant.load import build_meta_model
    from mpsboost.recipes.low_bit.layers import quantize

    t0 = time.perf_counter()
    meta = build_meta_model(cfg, torch.bfloat16)
    fam = family_for("qwen3_5_moe")
    mods = dict(meta.named_modules())
    g = torch.Generator(device=device).manual_seed(seed)
    tensors: list[tuple[str, torch.Tensor]] = []
    special: dict[str, dict] = {}

    def put(file_module: str, w: torch.Tensor, b: int, gs: int) -> None:
        q, s, z = quantize(w, b, gs)
        tensors.extend([(f"{file_module}.weight", q), (f"{file_module}.scales", s), (f"{file_module}.biases", z)])
        if (b, gs) != (bits, group):
            special[file_module] = {"group_size": gs, "bits": b}

    for key, t in meta.state_dict(keep_vars=True).items():
        mpath, leaf = key.rsplit(".", 1)
        mod = mods[mpath]
        v = _value(key, tuple(t.shape), t.dtype, fam, g, device)
        fm = fam.to_file_key(mpath + ".")[:-1]
        if leaf in ("gate_up_proj", "down_proj") and mpath.endswith(".experts"):
            pre = fm.rsplit(".experts", 1)[0] + ".switch_mlp"
            halves = v.chunk(2, dim=1) if leaf == "gate_up_proj" else (v,)
            names = ("gate_proj", "up_proj") if leaf == "gate_up_proj" else ("down_proj",)
            for proj, half in zip(names, halves):
                put(f"{pre}.{proj}", half.contiguous(), bits, group)
        elif leaf == "weight" and mpath.endswith(ROUTER_GATES):
            put(fm, v, *ROUTER_PARAMS)
        elif leaf == "weight" and type(mod) in (torch.nn.Linear, torch.nn.Embedding) and v.shape[-1] % group == 0:
            put(fm, v, bits, group)
        elif fam.conv1d and key.endswith("conv1d.weight"):
            tensors.append((fam.to_file_key(key), v.permute(0, 2, 1).contiguous()))  # [C, 1, K] -> [C, K, 1]
        elif any(key.endswith(s) for s in fam.zero_centred):
            tensors.append((fam.to_file_key(key), (v.float() + 1.0).to(v.dtype)))
        else:
            tensors.append((fam.to_file_key(key), v))
        del v
    quantization = {"group_size": group, "bits": bits, "mode": "affine", **dict(sorted(special.items()))}
    files = write_folder(folder, tensors, meta={"format": "mlx"}, max_shard_bytes=5 * 2**30)
    (folder / "config.json").write_text(json.dumps(mlx_save._config(meta, fam, quantization), indent=4) + "\n")
    n = len(tensors)
    tensors.clear()  # the codes: freed before the file is loaded
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {
        "folder": str(folder),
        "bits": bits,
        "group_size": group,
        "file_bytes": sum(f.stat().st_size for f in files),
        "tensors": n,
        "modules_8bit": len(special) if bits != 8 else None,
        "write_s": time.perf_counter() - t0,
    }


# ------------------------------------------------------------------------------------------ the reference


def unpack_dequantize(
    q: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, bits: int, group: int, rounding: str = "float32"
):
    """``[..., K]`` bf16 from MLX affine ``q [..., K*bits/32]`` (uint32 words, the lowest bits first), written here
    from the format's definition: code j of a row is ``(word[j // (32/bits)] >> bits * (j % (32/bits))) & mask``;
    the weight ``scale * code + bias``. ``rounding``: ``"float32"``, in float32 rounded once (what mpsboost's
    low-bit layers use; MLX's quantized matmul never rounds the weight at all); ``"mlx"``, as ``mx.dequantize``
    computes it in the scales' dtype (bf16 scales: the product rounded to bf16, then the sum; about half the
    weights one bf16 step off the former). A slice of rows at a time (bounded scratch)."""
    if rounding not in ("mlx", "float32"):
        raise ValueError(f"rounding must be 'mlx' or 'float32', got {rounding!r}")
    per = 32 // bits
    lead, words = q.shape[:-1], q.shape[-1]
    k = words * per
    rows_q = q.reshape(-1, words)
    rows_s = scales.reshape(-1, k // group).float()
    rows_b = biases.reshape(-1, k // group).float()
    out = torch.empty(rows_q.shape[0], k, dtype=torch.bfloat16, device=q.device)
    shifts = torch.arange(per, device=q.device, dtype=torch.int64) * bits
    step = max(1, (1 << 24) // k)
    for r in range(0, rows_q.shape[0], step):
        w = rows_q[r : r + step].view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        codes = ((w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(w.shape[0], k // group, group)
        s, b = rows_s[r : r + step].unsqueeze(-1), rows_b[r : r + step].unsqueeze(-1)
        if rounding == "mlx":  # in the scales' own dtype: each operation rounds its result to it
            w_rows = codes.to(scales.dtype) * s.to(scales.dtype) + b.to(scales.dtype)
        else:
            w_rows = codes.float() * s + b
        out[r : r + step] = w_rows.reshape(w.shape[0], k).to(torch.bfloat16)
    return out.reshape(*lead, k)


def exact_reference(model: torch.nn.Module, cfg, rounding: str = "float32") -> torch.nn.Module:
    """The stock model of ``cfg`` whose weights are ``model``'s low-bit codes unpacked by :func:`unpack_dequantize`
    (``rounding`` as there); every other tensor (norms, routers, conv, rotary tables) shared with ``model``."""
    from mpsboost.quant.load import build_meta_model
    from mpsboost.recipes.low_bit.layers import affine_state

    ref = build_meta_model(cfg, torch.bfloat16)
    for mpath, mod in ref.named_modules():
        src = model.get_submodule(mpath)
        state = affine_state(src)
        for name in [n for n, t in list(mod._parameters.items()) + list(mod._buffers.items()) if t is not None]:
            if state is not None and name in state.params:
                p = state.params[name]
                s_name, b_name = ("scales", "biases") if name == "weight" else (f"{name}_scales", f"{name}_biases")
                trio = (getattr(src, name), getattr(src, s_name), getattr(src, b_name))
                t = unpack_dequantize(*trio, p.bits, p.group_size, rounding)
            else:
                t = getattr(src, name)
            if name in mod._parameters:
                mod._parameters[name] = torch.nn.Parameter(t.detach(), requires_grad=False)
            else:
                mod._buffers[name] = t
    return ref.eval()


def per_layer(model: torch.nn.Module, ref: torch.nn.Module, ids: torch.Tensor) -> list[float]:
    """Each decoder layer of ``model`` fed the very input ``ref``'s layer got (one forward of the prompt, no
    cache): the relative error of its output against ``ref``'s, layer by layer. Separates what one layer computes
    differently from what the model's depth amplifies."""
    from mpsboost.bench.quality import relative_error

    seen: list = []

    def hook(mod, args, kwargs, out):
        seen.append((args, kwargs, out))

    hooks = [layer.register_forward_hook(hook, with_kwargs=True) for layer in ref.model.layers]
    try:
        with torch.no_grad():
            ref(input_ids=ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    errs = []
    with torch.no_grad():
        for layer, (args, kwargs, out) in zip(model.model.layers, seen):
            got = layer(*args, **kwargs)
            first = lambda t: t[0] if isinstance(t, tuple) else t
            errs.append(relative_error(first(got), first(out)))
    return errs


def greedy(model, ids: torch.Tensor, n: int) -> tuple[torch.Tensor, list[int]]:
    """(the prompt's float32 logits, ``n`` greedy tokens), eager, DynamicCache."""
    from transformers import DynamicCache

    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        logits = out.logits.float()
        tok = out.logits[:, -1:].argmax(-1)
        toks = [tok]
        for _ in range(n - 1):
            tok = model(input_ids=tok, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            toks.append(tok)
    return logits, torch.cat(toks, 1)[0].tolist()


def _paths(model) -> dict[str, int]:
    """``"recipe: backing"`` -> how many layers took it, over the applied rows of the model's report."""
    import mpsboost

    rows = mpsboost.last_report(model).rows
    return dict(Counter(f"{r.recipe}: {r.backing}" for r in rows if r.status == "applied"))


# ------------------------------------------------------------------------------------------ phases (fresh processes)


def load_phase(files: dict, cfg, device: str, patch: bool = True) -> dict:
    import mpsboost
    from mpsboost.bench.quality import relative_error

    cuda = device.startswith("cuda")
    base_host = _host_peak_reset()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    model = mpsboost.from_pretrained(files["folder"], dtype=torch.bfloat16, device=device, patch=patch)
    _sync(device)
    out = {"load_s": time.perf_counter() - t0, "host_peak": _status("VmHWM:") - base_host, "paths": _paths(model)}
    out["patched"] = patch
    if cuda:
        out.update(
            device_peak=torch.cuda.max_memory_allocated() - base,
            device_reserved=torch.cuda.max_memory_reserved(),
            device_after=torch.cuda.memory_allocated() - base,
        )
    ids = torch.randint(0, cfg.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(7)).to(device)
    got, got_toks = greedy(model, ids, NEW_TOKENS)
    ref = exact_reference(model, cfg, "float32")
    want, want_toks = greedy(ref, ids, NEW_TOKENS)
    layer_errors = per_layer(model, ref, ids)
    del ref  # one bf16 reference at a time (65 GiB at real size)
    ref = exact_reference(model, cfg, "mlx")
    want_mx, _ = greedy(ref, ids, NEW_TOKENS)
    del ref
    diverge = next((i for i, (a, b) in enumerate(zip(got_toks, want_toks)) if a != b), None)
    out.update(
        rel_error=relative_error(got, want),
        rel_error_mx_dequantize_weights=relative_error(got, want_mx),
        reference_gap=relative_error(want_mx, want),  # the two references' own distance: the model's sensitivity
        layer_errors=layer_errors,
        logits_equal=bool(torch.equal(got, want)),
        tokens_equal=got_toks == want_toks,
        first_divergence=diverge,
        tokens=got_toks,
        reference_tokens=want_toks,
    )
    return out


def decode_phase(cfg, bits: list[int], group: int, work: Path, device: str, mac: str | None, rounds: int) -> dict:
    """Eager decode of each bit width (written, loaded, the folder removed) and of patched bf16, alternating rounds."""
    import mpsboost
    from mpsboost.bench.harness import measure_variants, round_ratios
    from mpsboost.gate import Env
    from transformers import AutoModelForCausalLM, DynamicCache

    env = Env.simulate("mps", mac) if mac else None
    models, info = {}, {}
    for b in bits:
        files = write_mlx(cfg, b, group, work / f"decode-{b}bit", device)
        t0 = time.perf_counter()
        m = mpsboost.from_pretrained(files["folder"], dtype=torch.bfloat16, device=env or device).eval()
        if env is not None:
            m.to(device)
        _sync(device)
        shutil.rmtree(files["folder"], ignore_errors=True)
        label = f"{b}-bit"
        models[label] = m
        info[label] = {"load_s": time.perf_counter() - t0, "file_bytes": files["file_bytes"], "paths": _paths(m)}
    with torch.device(device):
        bf = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    mpsboost.patch(bf, **({"device": env} if env else {}))
    models["bf16 patched"] = bf
    info["bf16 patched"] = {"paths": _paths(bf)}
    ids = torch.randint(0, cfg.vocab_size, (1, PREFILL), generator=torch.Generator().manual_seed(7)).to(device)
    live = {}
    with torch.no_grad():
        for label, m in models.items():
            cache = DynamicCache(config=m.config)
            live[label] = [m, cache, m(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)]

    def step(label: str) -> None:
        m, cache, tok = live[label]
        with torch.no_grad():
            live[label][2] = m(input_ids=tok, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)

    meas = measure_variants({k: (lambda k=k: step(k)) for k in models}, device=device, repeats=rounds, warmup=2)
    base = meas.timings["bf16 patched"]
    for label, t in meas.timings.items():
        info[label].update(ms=t.median_s * 1e3, samples_ms=[x * 1e3 for x in t.samples_s], **meas.extra(label, "x"))
        if label != "bf16 patched":
            rr = round_ratios(base.samples_s, t.samples_s)
            info[label].update(
                ratio_vs_bf16_patched={"median": rr.median, "min": rr.min, "max": rr.max, "q1": rr.q1, "q3": rr.q3},
                verdict_vs_bf16_patched=meas.verdict(label, "bf16 patched"),
            )
    if device.startswith("cuda"):
        info["_device_peak"] = torch.cuda.max_memory_allocated()
    return {"decisions": f"mac-{mac}" if mac else "native", "rounds": rounds, "variants": info}


# ------------------------------------------------------------------------------------------ records


def _shape(layers: int, tiny: bool, **more) -> dict:
    return {
        "workload": "qwen3.6",
        "model": "Qwen3_5MoeForCausalLM, Qwen3.6-35B-A3B config" + (" (tiny widths)" if tiny else ""),
        "layers": layers,
        "weights": "random",
        "format": FORMAT,
        **more,
    }


def load_records(files: dict, r: dict, layers: int, tiny: bool, device: str):
    from mpsboost.bench import Correctness, Memory, Record, RecordEnv, Throughput, Workload

    shape = _shape(layers, tiny, bits=files["bits"], group_size=files["group_size"], file_bytes=files["file_bytes"])
    ratio = r["device_peak"] / files["file_bytes"] if r.get("device_peak") is not None else None
    return [
        Record(
            Workload("lowbit_load", shape),
            "mpsboost.from_pretrained" + ("" if r.get("patched", True) else ", low-bit layers alone (patch=False)"),
            RecordEnv.capture(device, torch.bfloat16),
            throughput=Throughput(r["load_s"], "s"),
            memory=Memory(tensor_allocated=r.get("device_peak"), allocator_reserved=r.get("device_reserved")),
            correctness=Correctness(reference=REFERENCE, rel_error=r["rel_error"]),
            extra={
                "device_peak_over_file": ratio,
                "target_peak_over_file": TARGET_PEAK,
                "peak_ok": None if ratio is None else ratio <= TARGET_PEAK,
                "device_after_load_bytes": r.get("device_after"),
                "host_peak_bytes": r["host_peak"],
                "write_s": files["write_s"],
                "logits_equal": r["logits_equal"],
                "rel_error_mx_dequantize_weights": r.get("rel_error_mx_dequantize_weights"),
                "reference_gap": r.get("reference_gap"),
                "layer_errors": r.get("layer_errors"),
                "prompt_tokens": PROMPT,
                "greedy_tokens": NEW_TOKENS,
                "tokens_equal": r["tokens_equal"],
                "first_divergence": r["first_divergence"],
                "paths": r["paths"],
                "note": REFERENCE_ON_CUDA,
            },
        )
    ]


def decode_records(res: dict, layers: int, tiny: bool, device: str):
    from mpsboost.bench import Record, RecordEnv, Throughput, Workload

    env = RecordEnv.capture(device, torch.bfloat16)
    shape = _shape(
        layers,
        tiny,
        decisions=res["decisions"],
        step=f"one token after a {PREFILL}-token prefill, eager, DynamicCache",
        bf16="built on the device from the config, mpsboost.patch(model)",
        lowbit="the written MLX folder, mpsboost.from_pretrained(folder, device=decisions' Env), moved to the device",
    )
    recs = []
    for label, v in res["variants"].items():
        if label.startswith("_"):
            continue
        extra = {k: x for k, x in v.items() if k != "ms"}
        extra["note"] = REFERENCE_ON_CUDA
        variant = label if label == "bf16 patched" else f"mpsboost {label}"
        recs.append(
            Record(
                Workload("lowbit_decode_paired", shape), variant, env, throughput=Throughput(v["ms"], "ms"), extra=extra
            )
        )
    return recs


# ------------------------------------------------------------------------------------------ driver


def _run_phase(args, extra: list[str], timeout: float) -> dict:
    cmd = [sys.executable, __file__, "--device", args.device, "--layers", str(args.layers), *extra]
    cmd += ["--tiny"] if args.tiny else []
    cmd += ["--no-lossless-recipes"] if args.no_lossless_recipes else []
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=None if timeout == float("inf") else timeout,
        env=dict(os.environ, PYTHONWARNINGS="ignore"),
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        print(proc.stdout[-2000:] + proc.stderr[-4000:], file=sys.stderr)
        raise RuntimeError(f"phase {extra[:2]} failed (rc {proc.returncode})")
    return json.loads(line[len("RESULT ") :])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cuda")
    p.add_argument("--only", default="qwen3.6", help=f"workloads: {', '.join(WORKLOADS)}")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 40; --tiny: 4)")
    p.add_argument("--bits", default="4,8", help="comma-separated bit widths, each measured in turn")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--tiny", action="store_true", help="a small config of the same class (CPU smoke test)")
    p.add_argument("--workdir", type=Path, default=None, help="where the folders are written (each removed after)")
    p.add_argument("--out", type=Path, default=None, help="folder for lowbit_load.jsonl")
    p.add_argument("--decode-rounds", type=int, default=0, help="paired eager decode rounds (>= 5; 0: not timed)")
    p.add_argument("--mac", default="2.15.0", help="torch version of the simulated Mac of the decode ('': native)")
    p.add_argument("--skip-load", action="store_true", help="only the paired decode")
    p.add_argument(
        "--no-lossless-recipes",
        action="store_true",
        help="load with the low-bit layers alone (from_pretrained(patch=False)): the logits comparison then runs the "
        "same code on both sides but the low-bit layers",
    )
    p.add_argument(
        "--budget-s", type=float, default=None, help="stop before a phase that would end past this (cuda: 560)"
    )
    p.add_argument("--phase", choices=("load", "decode"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--files", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    from mpsboost.bench.harness import MIN_REPEATS

    args.layers = args.layers or (4 if args.tiny else 40)
    if args.budget_s is None:
        args.budget_s = 560.0 if args.device.startswith("cuda") else float("inf")
    bits = [int(b) for b in args.bits.split(",") if b.strip()]
    cfg = _config("qwen3.6", args.layers, args.tiny)
    if args.phase == "load":
        res = load_phase(json.loads(args.files), cfg, args.device, not args.no_lossless_recipes)
        print("RESULT " + json.dumps(res))
        return 0
    if args.phase == "decode":
        work = Path(json.loads(args.files)["work"])
        res = decode_phase(cfg, bits, args.group_size, work, args.device, args.mac or None, args.decode_rounds)
        print("RESULT " + json.dumps(res))
        return 0
    bad = [n for n in args.only.split(",") if n.strip() and n.strip() not in WORKLOADS]
    if bad:
        raise SystemExit(f"--only {bad}: the workload here is qwen3.6")
    if args.decode_rounds and args.decode_rounds < MIN_REPEATS:
        print(f"--decode-rounds {args.decode_rounds}: the harness takes at least {MIN_REPEATS}; using {MIN_REPEATS}")
        args.decode_rounds = MIN_REPEATS
    from mpsboost.bench import write_jsonl

    start = time.monotonic()
    left = lambda: args.budget_s - (time.monotonic() - start)  # noqa: E731
    recs, failed, rows, last = [], False, [], None
    work = Path(tempfile.mkdtemp(prefix="lowbit_load_", dir=args.workdir))
    try:
        for b in [] if args.skip_load else bits:
            # A phase costs about its file size times the last one's seconds per byte.
            if last is not None and left() < last[0] * b / last[1]:
                need = last[0] * b / last[1]
                print(f"budget: {left():.0f} s left, the {b}-bit load would take ~{need:.0f} s: stopped")
                failed = True
                break
            t0 = time.monotonic()
            files = write_mlx(cfg, b, args.group_size, work / f"{b}bit", args.device)
            print(f"{b}-bit: wrote {files['file_bytes'] / 2**30:.2f} GiB in {files['write_s']:.0f} s", flush=True)
            try:
                r = _run_phase(args, ["--phase", "load", "--files", json.dumps(files)], max(1.0, left()))
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                print(f"{b}-bit load: {exc}", file=sys.stderr)
                failed = True
                break
            finally:
                shutil.rmtree(files["folder"], ignore_errors=True)
            last = (time.monotonic() - t0, b)
            recs += load_records(files, r, args.layers, args.tiny, args.device)
            peak = r.get("device_peak")
            rows.append(
                f"{b}-bit  file {files['file_bytes'] / 2**30:7.2f} GiB  load {r['load_s']:6.1f} s  device peak "
                + ("   n/a" if peak is None else f"{peak / 2**30:7.2f} GiB ({peak / files['file_bytes']:.3f}x)")
                + f"  rel err {r['rel_error']:.2e} (vs weights rounded as mx.dequantize "
                + f"{r['rel_error_mx_dequantize_weights']:.2e}; "
                + f"the two references {r['reference_gap']:.2e})  tokens "
                + ("equal" if r["tokens_equal"] else f"differ from {r['first_divergence']}")
                + "\n    per layer (each fed the reference's input): "
                + " ".join(f"{e:.1e}" for e in r["layer_errors"])
            )
            print(rows[-1], flush=True)
        if args.decode_rounds and not failed:
            extra = ["--phase", "decode", "--files", json.dumps({"work": str(work)}), "--bits", args.bits]
            extra += ["--group-size", str(args.group_size), "--decode-rounds", str(args.decode_rounds)]
            extra += ["--mac", args.mac]
            try:
                res = _run_phase(args, extra, max(1.0, left()))
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                print(f"decode: {exc}", file=sys.stderr)
                failed = True
            else:
                recs += decode_records(res, args.layers, args.tiny, args.device)
                for label, v in res["variants"].items():
                    if label.startswith("_"):
                        continue
                    rr = v.get("ratio_vs_bf16_patched")
                    rows.append(
                        f"decode ({res['decisions']}) {label:12s} {v['ms']:8.2f} ms"
                        + ("" if rr is None else f"  {rr['median']:.2f}x bf16 patched")
                        + ("" if rr is None else f" [{rr['min']:.2f}..{rr['max']:.2f}]")
                    )
                    print(rows[-1])
                    for path, n in sorted(v["paths"].items()):
                        print(f"    {n:5d}  {path}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if args.out is not None and recs:
            print(f"records written to {write_jsonl(args.out / 'lowbit_load.jsonl', recs)}")
    print("\n".join(["", "summary:", *rows]))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
