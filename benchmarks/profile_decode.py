"""profile_decode: where the GPU time of a static-cache ``generate()`` goes, stock bf16 against ``fp8="rowwise"``.

A diagnostic, not a benchmark: it explains an end-to-end figure of ``benchmarks/e2e.py`` by kernel.
A Qwen3-8B-shaped model (random weights, ``--layers`` of its 36) runs ``generate(max_new_tokens=N,
cache_implementation="static")`` once to compile, then once under ``torch.profiler``; the table lists
the kernels by total CUDA time, grouped into GEMV/GEMM, attention, fp8 kernels and the rest, and
the wall time of the call next to the summed kernel time (the difference is host time the GPU waited),
and the median wall time of five calls without the profiler (which adds host time of its own).

    python benchmarks/profile_decode.py --device cuda --layers 36 --out OUT

``--workload qwen-image`` profiles one denoising forward of the Qwen-Image transformer instead (real
widths, random weights, ``--layers`` of its 60 blocks, 1024 image and 64 text tokens: a 512x512 image),
stock bf16 against ``patch(transformer, fp8="rowwise")`` (what ``load_fp8`` of a scaled_fp8 file
gives), each forward run twice first:

    python benchmarks/profile_decode.py --device cuda --workload qwen-image --layers 16 --out OUT

``--workload qwen3.6-eager`` profiles eager decode steps of the Qwen3.6-35B-A3B shape (real widths, random
weights, ``--layers`` of its 40, default 8: three Gated DeltaNet layers to one attention layer as in the model)
on a 512-token cache, stock against the default patch and the decisions of a Mac on torch 2.15.0 (patched and
unpatched on one model): per variant the wall time of a step without the profiler, the aten ops and kernel
launches per step, the summed kernel time, the host time of each module kind (the time the host spends
inside it: in eager mode the step is host-bound when this sum approaches the step's wall time), the aten ops
by their own host time, and the host synchronisations:

    python benchmarks/profile_decode.py --device cuda --workload qwen3.6-eager --layers 8 --out OUT

``--host-profile`` adds a cProfile of one call (the Python functions by their own time); for
``qwen3.6-eager``, of four decode steps and of one ``generate()`` of 17 tokens in the second round
(``--pstats DIR`` keeps the whole profiles).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _diag import append_jsonl  # noqa: E402
from mpsboost.bench.timing import time_fn  # noqa: E402


def _group(name: str) -> str:
    n = name.lower()
    if "fp8_gemv" in n or "quant_rows" in n or "_splitk_reduce_kernel" in n or "_dequant_kernel" in n:
        return "mpsboost fp8"
    if "gemv" in n or "gemm" in n or "sm90_xmma" in n or "cutlass" in n or "nvjet" in n:
        return "cuBLAS GEMM/GEMV"
    if "flash" in n or "attention" in n or "sdpa" in n or "fmha" in n:
        return "attention"
    if "triton" in n:
        return "inductor triton"
    return "other"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--workload", choices=("qwen3-8b", "qwen-image", "qwen3.6-eager"), default="qwen3-8b")
    p.add_argument(
        "--layers", type=int, default=None, help="default: 36 (qwen3-8b), 16 (qwen-image), 8 (qwen3.6-eager)"
    )
    p.add_argument(
        "--host-profile", action="store_true", help="also cProfile one call: the Python functions by own time"
    )
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--pstats", default=None, help="with --host-profile (qwen3.6-eager): write the whole profiles here")
    p.add_argument(
        "--fp8",
        action="store_true",
        help="qwen3.6-eager: Mac 2.15.0 decisions, patched bf16 against patch(fp8='rowwise') on a second model of the "
        "same weights (the fp8 path's kernel time against bf16's; on CUDA the Metal kernel's Triton twin runs)",
    )
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.device != "cuda" or not torch.cuda.is_available():
        print("profile_decode profiles CUDA kernels: run it with --device cuda on a CUDA machine")
        return 2
    import e2e  # the same model builders and configs as the matrix

    import mpsboost

    if a.workload == "qwen3.6-eager":
        return _qwen36_eager(a)
    if a.layers is None:
        a.layers = 36 if a.workload == "qwen3-8b" else 16
    if a.workload == "qwen-image":
        call, build, per, unit = _qwen_image(a.layers)
    else:
        cfg = e2e.llm_config("qwen3-8b", "real", a.layers)
        prompt = torch.randint(0, cfg.vocab_size, (1, 512), generator=torch.Generator().manual_seed(1)).cuda()
        kw = dict(
            max_new_tokens=a.new_tokens,
            min_new_tokens=a.new_tokens,
            do_sample=False,
            cache_implementation="static",
            attention_mask=torch.ones_like(prompt),
        )

        def call(model):
            return model.generate(prompt, **kw)

        def build():
            return e2e.build_llm(cfg, "cuda", torch.bfloat16, 0)

        per, unit = a.new_tokens, "token"
    rows = []
    for variant in ("stock", "fp8"):
        model = build()
        report = mpsboost.patch(model, fp8="rowwise") if variant == "fp8" else None
        with torch.no_grad():
            # Two untimed calls (compile the static cache, tune, allocate), then the call timed five
            # times without the profiler's own host cost.
            timed = time_fn(functools.partial(call, model), device="cuda", warmup=2, repeats=5)
            plain_ms = timed.median_s * 1e3
            plain = [v * 1e3 for v in timed.samples_s]
            host = _host_profile(call, model) if a.host_profile else None
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                t = time.perf_counter()
                call(model)
                torch.cuda.synchronize()
                wall = time.perf_counter() - t
        kernels: dict[str, float] = {}
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                kernels[ev.name] = kernels.get(ev.name, 0.0) + ev.device_time_total / 1e3  # ms
        total = sum(kernels.values())
        groups: dict[str, float] = {}
        for k, v in kernels.items():
            groups[_group(k)] = groups.get(_group(k), 0.0) + v
        what = f"{a.new_tokens} new tokens after 512" if a.workload == "qwen3-8b" else "one 512x512 denoising forward"
        print(
            f"== {a.workload} {variant}: {a.layers} layers, {what}: wall {wall * 1e3:.1f} ms, "
            f"kernels {total:.1f} ms ({total / wall / 10:.0f}% of wall); "
            f"without the profiler: median {plain_ms:.1f} ms of 5"
        )
        for g, v in sorted(groups.items(), key=lambda x: -x[1]):
            print(f"   {g:20s} {v:8.2f} ms  {v / per:7.3f} ms/{unit}")
        top = sorted(kernels.items(), key=lambda x: -x[1])[:12]
        for k, v in top:
            print(f"      {v:8.2f} ms  {k[:110]}")
        applied = sorted({f"{r.recipe}: {r.backing}" for r in report.rows if r.status == "applied"}) if report else []
        rows.append(
            {
                "workload": a.workload,
                "variant": variant,
                "layers": a.layers,
                "new_tokens": per,
                "unit": unit,
                "wall_ms": wall * 1e3,
                "plain_wall_ms": plain_ms,
                "plain_wall_all_ms": plain,
                "kernel_ms": total,
                "groups_ms": groups,
                "top_kernels_ms": dict(top),
                "applied": applied,
                "host_profile": host,
                "torch": torch.__version__,
                "device": torch.cuda.get_device_name(),
            }
        )
        del model
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    append_jsonl(a.out, "profile_decode.jsonl", rows)
    return 0


def _host_profile(call, model, top: int = 40, dump: Path | None = None) -> list[dict]:
    """cProfile of one call: the ``top`` Python functions by own (exclusive) time, printed and returned."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    call(model)
    torch.cuda.synchronize()
    prof.disable()
    if dump is not None:
        dump.parent.mkdir(parents=True, exist_ok=True)
        prof.dump_stats(dump)  # the whole profile, for pstats
    st = pstats.Stats(prof)
    rows = sorted(((v[2], v[3], v[1], f"{Path(k[0]).name}:{k[1]}:{k[2]}") for k, v in st.stats.items()), reverse=True)[
        :top
    ]
    out = []
    for tt, ct, calls, where in rows:
        print(f"      host {tt * 1e3:8.2f} ms own, {ct * 1e3:8.2f} ms cumulative, {calls:6d} calls  {where}")
        out.append({"own_ms": tt * 1e3, "cumulative_ms": ct * 1e3, "calls": calls, "function": where})
    return out


_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
_KINDS = {"linear_attn": "Gated DeltaNet", "self_attn": "attention", "mlp": "MoE block"}


def _profile_summary(prof, n_steps: int) -> tuple:
    """``(kernel_ms, launches, kinds, kernels, copies, syncs, own)`` of a profile of ``n_steps`` decode steps: device
    kernel time and count, host ms per module kind, per-kernel device ms a step, device copies a step, host syncs by
    the outermost aten op that issued them, and each aten op's calls and own host ms a step."""
    kernel_ms = launches = 0.0
    kinds: dict[str, float] = {}
    kernels: dict[str, float] = {}
    copies: dict[str, float] = {}
    syncs: dict[str, int] = {}
    own: dict[str, list] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.name.startswith("## "):
            continue  # the device-side range of a module kind, not a kernel
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.name.startswith(("Memcpy", "Memset")):
            copies[ev.name] = copies.get(ev.name, 0) + 1 / n_steps
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            kernel_ms += ev.device_time_total / 1e3
            launches += 1
            kernels[ev.name] = kernels.get(ev.name, 0.0) + ev.device_time_total / 1e3 / n_steps
        elif ev.name.startswith("## "):
            kinds[ev.name[3:]] = kinds.get(ev.name[3:], 0.0) + ev.cpu_time_total / 1e3
        elif ev.name.startswith(_SYNCS):
            parent = ev.cpu_parent
            while parent is not None and not parent.name.startswith("aten::"):
                parent = parent.cpu_parent
            # the outermost aten op that issued it
            while parent is not None and parent.cpu_parent is not None and parent.cpu_parent.name.startswith("aten::"):
                parent = parent.cpu_parent
            key = f"{ev.name} in {parent.name if parent is not None else '(no aten op)'}"
            syncs[key] = syncs.get(key, 0) + 1
    for ev in prof.key_averages():
        if ev.key.startswith("aten::"):
            own[ev.key] = [ev.count / n_steps, ev.self_cpu_time_total / 1e3 / n_steps]
    return kernel_ms, launches, kinds, kernels, copies, syncs, own


def _kind_scopes(inner, record_function) -> list:
    """Forward hooks that open a profiler range ``## <kind>`` around each decoder layer's Gated DeltaNet, attention
    and MoE block (:data:`_KINDS`); returns the hook handles."""
    hooks = []
    scopes: list = []
    for layer in inner:
        for attr, kind in _KINDS.items():
            mod = getattr(layer, attr, None)
            if mod is None:
                continue

            def pre(m, args, kind=kind):
                scopes.append(record_function(f"## {kind}"))
                scopes[-1].__enter__()

            def post(m, args, out):
                scopes.pop().__exit__(None, None, None)

            hooks.append(mod.register_forward_pre_hook(pre))
            hooks.append(mod.register_forward_hook(post))
    return hooks


def _qwen36_eager(a) -> int:
    """Eager decode steps of the Qwen3.6 shape, stock / default patch / Mac 2.15.0 decisions (see the docstring)."""
    import e2e
    from torch.profiler import ProfilerActivity, profile, record_function
    from torch.utils._python_dispatch import TorchDispatchMode

    import mpsboost
    from mpsboost.gate import Env

    layers = a.layers or 8
    cfg = e2e.llm_config("qwen3.6-35b-a3b", "real", layers)
    model = base = e2e.build_llm(cfg, "cuda", torch.bfloat16, 0)
    prompt = torch.randint(0, cfg.vocab_size, (1, 512), generator=torch.Generator().manual_seed(1)).cuda()
    mac = Env.simulate("mps", "2.15.0")
    fp8_model = fp8_report = None
    if a.fp8:  # converted once (irreversible), then alternated with the bf16 model patched the same way
        fp8_model = e2e.build_llm(cfg, "cuda", torch.bfloat16, 0)
        fp8_report = mpsboost.patch(fp8_model, device=mac, fp8="rowwise")

    def steps(n: int, timed: list | None = None) -> None:
        """Prefill, then ``n`` greedy decode steps on its cache (each step's wall time into ``timed``)."""
        out = model(prompt, use_cache=True)
        cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        for _ in range(n):
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = model(nxt, past_key_values=cache, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            if timed is not None:
                timed.append((time.perf_counter() - t) * 1e3)

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    variants = [("stock", None), ("mpsboost", None), ("mpsboost:mac-2.15.0", mac)]
    if a.fp8:
        variants = [("mpsboost:mac-2.15.0", mac), ("mpsboost:mac-2.15.0 fp8-rowwise", mac)]
    rows = []
    for _ in range(2):  # two rounds, variants alternated: the host is shared and noisy
        for variant, env in variants:
            fp8 = variant.endswith("fp8-rowwise")
            model = fp8_model if fp8 else base
            inner = next(
                m for n, m in model.named_modules() if n.endswith("layers") and isinstance(m, torch.nn.ModuleList)
            )
            report = None
            if fp8:
                report = fp8_report  # patched once above; kept
            elif variant != "stock":
                report = mpsboost.patch(model, device=env) if env is not None else mpsboost.patch(model)
            hooks = _kind_scopes(inner, record_function)
            try:
                with torch.no_grad():
                    steps(3)
                    plain: list[float] = []
                    steps(12, plain)
                    n_steps = 4
                    out = model(prompt, use_cache=True)
                    cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
                    Count.n = 0
                    with Count():
                        out = model(nxt, past_key_values=cache, use_cache=True)
                    ops = Count.n
                    nxt = out.logits[:, -1:].argmax(-1)
                    torch.cuda.synchronize()
                    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                        t = time.perf_counter()
                        for _ in range(n_steps):
                            out = model(nxt, past_key_values=cache, use_cache=True)
                            nxt = out.logits[:, -1:].argmax(-1)
                        torch.cuda.synchronize()
                        wall = (time.perf_counter() - t) * 1e3 / n_steps
                    host = host_gen = None
                    if a.host_profile and len(rows) >= len(variants):  # second round only
                        out = model(prompt, use_cache=True)
                        state = [out.past_key_values, out.logits[:, -1:].argmax(-1)]

                        def decode4(m, state=state):
                            for _ in range(4):
                                o = m(state[1], past_key_values=state[0], use_cache=True)
                                state[1] = o.logits[:, -1:].argmax(-1)

                        dump = Path(a.pstats) / f"pstats-{variant.replace(':', '_')}" if a.pstats else None
                        host = _host_profile(decode4, model, dump=dump and dump.with_suffix(".decode4"))
                        gkw = dict(max_new_tokens=17, min_new_tokens=17, do_sample=False)
                        model.generate(prompt, **gkw)
                        host_gen = _host_profile(
                            lambda m: m.generate(prompt, **gkw), model, dump=dump and dump.with_suffix(".gen17")
                        )
            finally:
                for h in hooks:
                    h.remove()
                if report is not None and not fp8:
                    mpsboost.unpatch(model)
            kernel_ms, launches, kinds, kernels, copies, syncs, own = _profile_summary(prof, n_steps)
            top = dict(sorted(own.items(), key=lambda kv: -kv[1][1])[:15])
            plain.sort()
            row = {
                "workload": "qwen3.6-eager",
                "variant": variant,
                "layers": layers,
                "step_ms": plain[len(plain) // 2],
                "step_all_ms": plain,
                "profiled_step_ms": wall,
                "aten_ops_per_step": ops,
                "kernels_per_step": launches / n_steps,
                "kernel_ms_per_step": kernel_ms / n_steps,
                "host_ms_per_step": {k: v / n_steps for k, v in kinds.items()},
                "syncs_per_step": {k: v / n_steps for k, v in syncs.items()},
                "device_copies_per_step": copies,
                "top_own_host_ms_per_step": top,
                "host_profile_4_steps": host,
                "host_profile_generate_17": host_gen,
                "top_kernels_ms_per_step": dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:10]),
                "applied": sorted({f"{r.recipe}: {r.backing}" for r in report.rows if r.status == "applied"})
                if report
                else [],
                "torch": torch.__version__,
                "device": torch.cuda.get_device_name(),
            }
            rows.append(row)
            print(
                f"== {variant}: {layers} layers, step {row['step_ms']:.2f} ms (median of 12; profiled {wall:.2f}), "
                f"{ops} aten ops, {row['kernels_per_step']:.0f} kernels, kernel time {row['kernel_ms_per_step']:.2f} ms"
            )
            print("   host per kind: " + ", ".join(f"{k} {v:.2f} ms" for k, v in row["host_ms_per_step"].items()))
            print("   device copies per step: " + (", ".join(f"{k} {v:g}" for k, v in copies.items()) or "none"))
            print("   syncs per step: " + (", ".join(f"{k} {v:g}" for k, v in row["syncs_per_step"].items()) or "none"))
            for k, (c, ms) in top.items():
                print(f"      {ms:7.3f} ms own  {c:6.1f} calls  {k}")
            for k, ms in row["top_kernels_ms_per_step"].items():
                print(f"      {ms:7.3f} ms kernel  {k[:100]}")
    append_jsonl(a.out, "profile_decode.jsonl", rows)
    return 0


def _qwen_image(layers: int):
    """(call, build, calls per profile, unit) for one denoising forward of the Qwen-Image transformer."""
    import e2e

    def build():
        pipe, _ = e2e.build_pipe("qwen-image", "real", "cuda", torch.bfloat16, 0, layers)
        model = pipe.transformer
        del pipe
        return model.eval()

    cfg = e2e.C.config("qwen_image", "real", "transformer.json")
    g = torch.Generator().manual_seed(3)
    side = 32  # 512x512 pixels -> 64x64 latent, patch 2 -> 32x32 tokens
    hs = torch.randn(1, side * side, cfg["in_channels"], generator=g).to("cuda", torch.bfloat16)
    enc = torch.randn(1, 64, cfg["joint_attention_dim"], generator=g).to("cuda", torch.bfloat16)
    mask = torch.ones(1, 64, dtype=torch.long, device="cuda")
    t = torch.tensor([0.5], device="cuda", dtype=torch.bfloat16)

    def call(model):
        return model(
            hidden_states=hs,
            encoder_hidden_states=enc,
            encoder_hidden_states_mask=mask,
            timestep=t,
            img_shapes=[[(1, side, side)]],
            return_dict=False,
        )[0]

    return call, build, 1, "forward"


if __name__ == "__main__":
    sys.exit(main())
