"""decode_linear: one-token bf16 ``F.linear`` over 96 layer shapes of real models, stock vs ``mpsboost.patch()``.

Every variant is a real ``nn.Linear`` inside a transformers ``PreTrainedModel`` (the recipe patches only the
linears of transformers and diffusers models), and every patched variant is made by ``mpsboost.patch()``
on that model; nothing is copied from another variant's timing. Per shape (``size="real"``: the 96
distinct ``(N, K, bias)`` layer shapes of the models in ``MODELS`` and ``DIFFUSERS``), on a ``[1, 1, K]``
bf16 input:

* ``stock``: the unpatched model;
* ``mpsboost``: ``mpsboost.patch(model)`` with its defaults (on CUDA: the Triton GEMV inside CUDA graphs for
  the shapes of the shipped table, cuBLAS elsewhere); the report row of the layer goes into the record;
* ``mpsboost:triton`` (CUDA) / ``mpsboost:fold`` (elsewhere): ``patch()`` with the path forced, the
  measurement behind the shipped table.

The variants share their weights and are timed in alternating rounds (:func:`mpsboost.bench.harness.measure_variants`,
at least 5 rounds, min/median/max kept): on CUDA by CUDA-graph replay of one graph of as many calls as there
are weight copies, the copies rotated so that together they exceed the 60 MB L2 (every call reads its weight
from HBM, as in a real decode step), and again eagerly with CUDA events. Ratios are only within one shape
of one run; a shape counts as a Triton win when the forced-Triton spread lies entirely below stock's.
Also recorded: the fraction of the copy bandwidth measured in the same run, and both outputs against an
fp32 reference of the same weights and input.

Whole model (``size="real"`` on CUDA): one-token decode steps of a Qwen3-0.6B-shaped model (random
weights, bf16, eager, DynamicCache): stock, ``mpsboost.patch(model)`` and ``patch()`` with the Triton path
forced in eager mode, in alternating rounds; each record says how many layers ``patch()`` changed.

    python benchmarks/decode_linear.py --device cuda --size real --out OUT
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

import mpsboost
from mpsboost.bench import Correctness, Record, RecordEnv, Workload, relative_error
from mpsboost.bench.harness import copy_bandwidth, measure_variants
from mpsboost.report import APPLIED

# name, hidden, heads, kv heads, head_dim, intermediate, vocab, qkv bias
MODELS = [
    ("Qwen3-0.6B", 1024, 16, 8, 128, 3072, 151936, False),
    ("Qwen3-1.7B", 2048, 16, 8, 128, 6144, 151936, False),
    ("Qwen3-4B", 2560, 32, 8, 128, 9728, 151936, False),
    ("Qwen3-8B", 4096, 32, 8, 128, 12288, 151936, False),
    ("Qwen3-14B", 5120, 40, 8, 128, 17408, 151936, False),
    ("Qwen3-32B", 5120, 64, 8, 128, 25600, 151936, False),
    ("Qwen3-30B-A3B", 2048, 32, 4, 128, 768, 151936, False),
    ("Llama-3.2-1B", 2048, 32, 8, 64, 8192, 128256, False),
    ("Llama-3.2-3B", 3072, 24, 8, 128, 8192, 128256, False),
    ("Llama-3.1-8B", 4096, 32, 8, 128, 14336, 128256, False),
    ("Llama-3.1-70B", 8192, 64, 8, 128, 28672, 128256, False),
    ("Qwen2.5-0.5B", 896, 14, 2, 64, 4864, 151936, True),
    ("Qwen2.5-1.5B", 1536, 12, 2, 128, 8960, 151936, True),
    ("Qwen2.5-7B", 3584, 28, 4, 128, 18944, 152064, True),
    ("Gemma-2-2B", 2304, 8, 4, 256, 9216, 256000, False),
    ("Mistral-Small-24B", 5120, 32, 8, 128, 32768, 131072, False),
]
# One-row linears of diffusion transformers (time embeddings, AdaLN modulation; [B, dim] inputs) and
# gpt-oss attention (biased projections): label, N, K, bias.
DIFFUSERS = [
    ("Flux.1.norm1.linear", 18432, 3072, True),
    ("Flux.1.single.norm.linear", 9216, 3072, True),
    ("Flux.1.time_embed.linear_1", 3072, 256, True),
    ("Flux.1.time_embed.linear_2", 3072, 3072, True),
    ("Flux.1.text_embed.linear_1", 3072, 768, True),
    ("Flux.1.norm_out.linear", 6144, 3072, True),
    ("Wan2.1-14B.time_embed.linear_1", 5120, 256, True),
    ("Wan2.1-14B.time_embed.linear_2", 5120, 5120, True),
    ("Wan2.1-14B.time_projection", 30720, 5120, True),
    ("Wan2.1-1.3B.time_embed.linear_1", 1536, 256, True),
    ("Wan2.1-1.3B.time_embed.linear_2", 1536, 1536, True),
    ("Wan2.1-1.3B.time_projection", 9216, 1536, True),
    ("SD3.5-L.norm1.linear", 14592, 2432, True),
    ("SD3.5-L.time_embed.linear_1", 2432, 256, True),
    ("SD3.5-L.text_embed.linear_1", 2432, 2048, True),
    ("gpt-oss-20b.q_proj", 4096, 2880, True),
    ("gpt-oss-20b.k_proj", 512, 2880, True),
    ("gpt-oss-20b.o_proj", 2880, 4096, True),
    ("gpt-oss-20b.router", 32, 2880, True),
]
N_SHAPES = 96
L2_BYTES = 60 * 2**20  # H200


def shapes() -> list[tuple[str, int, int, bool]]:
    """The 96 distinct (label, N, K, bias) one-token layer shapes, labelled by their first model."""
    seen: dict[tuple[int, int, bool], str] = {}
    for name, h, nh, kv, hd, inter, vocab, qkv_bias in MODELS:
        for lab, n, k, b in (
            ("q_proj", nh * hd, h, qkv_bias),
            ("k_proj", kv * hd, h, qkv_bias),
            ("o_proj", h, nh * hd, False),
            ("gate_proj", inter, h, False),
            ("down_proj", h, inter, False),
            ("lm_head", vocab, h, False),
        ):
            seen.setdefault((n, k, b), f"{name}.{lab}")
    for lab, n, k, b in DIFFUSERS:
        seen.setdefault((n, k, b), lab)
    out = [(lab, n, k, b) for (n, k, b), lab in seen.items()]
    return out[:N_SHAPES]


def _make_layers(n: int, k: int, bias: bool, copies: int, device: str, dtype: torch.dtype) -> list[torch.nn.Linear]:
    layers = []
    for _ in range(copies):
        lin = torch.nn.Linear(k, n, bias=bias, device=device, dtype=dtype).requires_grad_(False)
        with torch.no_grad():
            lin.weight.normal_(0, k**-0.5)
            if bias:
                lin.bias.normal_(0, 0.1)
        layers.append(lin)
    return layers


def _twins(layers: list[torch.nn.Linear]) -> list[torch.nn.Linear]:
    """New ``nn.Linear`` modules holding the very same Parameters (no copy of the weights)."""
    out = []
    for lin in layers:
        twin = torch.nn.Linear(
            lin.in_features, lin.out_features, bias=lin.bias is not None, device="meta", dtype=lin.weight.dtype
        )
        twin.weight = lin.weight
        twin.bias = lin.bias
        out.append(twin.requires_grad_(False))
    return out


_HOLDER = None


def _holder(layers: list[torch.nn.Linear]) -> torch.nn.Module:
    """The layers inside a transformers model, where ``mpsboost.patch()`` looks for them in a real one."""
    global _HOLDER
    if _HOLDER is None:
        from transformers import PretrainedConfig, PreTrainedModel

        class DecodeLinearLayers(PreTrainedModel):
            config_class = PretrainedConfig
            base_model_prefix = "layers"

            def __init__(self, mods: list[torch.nn.Linear]):
                super().__init__(PretrainedConfig())
                self.layers = torch.nn.ModuleList(mods)

        _HOLDER = DecodeLinearLayers
    return _HOLDER(layers).eval()


def _variants(cuda: bool) -> list[tuple[str, dict | None, bool]]:
    """(name, patch options or None for stock, timed under CUDA graphs)."""
    if cuda:
        return [
            ("stock", None, True),
            ("mpsboost", {}, True),
            ("mpsboost:triton", {"decode_linear": {"path": "triton"}}, True),
            ("mpsboost:triton-eager", {"decode_linear": {"path": "triton", "cuda_eager": True}}, False),
        ]
    return [
        ("stock", None, False),
        ("mpsboost", {}, False),
        ("mpsboost:fold", {"decode_linear": {"path": "fold"}}, False),
    ]


def _patch(model: torch.nn.Module, options: dict) -> dict:
    """``mpsboost.patch(model)`` and what it did to the first layer, for the record."""
    report = mpsboost.patch(model, options=options or None)
    rows = report.rows_for("decode_linear")
    first = next((r for r in rows if r.target.endswith("layers.0")), rows[0] if rows else None)
    return {
        "layers_patched": sum(1 for r in rows if r.status == APPLIED),
        "patch_row": None
        if first is None
        else {"status": first.status, "backing": first.backing, "reason": first.reason},
        "options": options,
    }


def _rotating(mods: list[torch.nn.Module], xs: list[torch.Tensor]):
    state = {"i": 0}

    def fn():
        i = state["i"]
        state["i"] = (i + 1) % len(mods)
        return mods[i](xs[i])

    return fn


def run(device: str, size: str, out: Path) -> list[Record]:
    dev = torch.device(device)
    dtype = torch.bfloat16
    env = RecordEnv.capture(device, dtype)
    cuda = dev.type == "cuda"
    all_shapes = shapes()
    if size == "tiny":
        todo = [(lab, max(8, n // 64), max(16, k // 64), b) for lab, n, k, b in all_shapes[:4]] + [
            ("router", 32, 64, True)
        ]
    elif size == "small":
        todo = all_shapes[::4]
    else:
        todo = all_shapes
    bw = copy_bandwidth(device) if cuda else None
    records: list[Record] = []
    table = []
    repeats = 10 if size == "real" else 5
    torch.manual_seed(0)
    with torch.no_grad():
        for lab, n, k, bias in todo:
            wbytes = n * k * 2
            copies = max(2, min(32, math.ceil(3 * L2_BYTES / wbytes))) if cuda else 2
            layers = _make_layers(n, k, bias, copies, device, dtype)
            xs = [torch.randn(1, 1, k, device=device, dtype=dtype) for _ in range(copies)]
            bytes_moved = wbytes + 2 * k + 2 * n + (2 * n if bias else 0)
            workload = Workload(
                "decode_linear", {"label": lab, "N": n, "K": k, "bias": bias, "rows": 1, "input": [1, 1, k]}
            )
            ref = F.linear(xs[0].float(), layers[0].weight.float(), None if not bias else layers[0].bias.float()).cpu()

            models, patches, graph_names = {}, {}, []
            for name, options, graphed in _variants(cuda):
                model = _holder(layers if options is None else _twins(layers))
                patches[name] = {"layers_patched": 0} if options is None else _patch(model, options)
                models[name] = list(model.layers)
                if graphed:
                    graph_names.append(name)
            rel = {name: relative_error(mods[0](xs[0]).float().cpu(), ref) for name, mods in models.items()}
            graph = None
            if cuda:
                graph = measure_variants(
                    {v: _rotating(models[v], xs) for v in graph_names},
                    device=device,
                    repeats=repeats,
                    warmup=2,
                    calls=copies,
                    cuda_graph=True,
                )
            eager = measure_variants(
                {v: _rotating(models[v], xs) for v in models},
                device=device,
                repeats=repeats,
                warmup=3,
                calls=32 if cuda else copies * 4,
            )
            for name in models:
                ops, extra = {"linear_eager": eager.timings[name].op_time()}, {"eager": eager.extra(name)}
                if graph is not None and name in graph.timings:
                    t = graph.timings[name]
                    ops["linear_graph"] = t.op_time()
                    extra["graph"] = graph.extra(name)
                    extra["fraction_of_bandwidth_limit"] = (bytes_moved / t.median_s) / bw
                records.append(
                    Record(
                        workload,
                        name,
                        env,
                        op_time=ops,
                        correctness=Correctness(f"{dev.type}-fp32 (eager call)", rel_error=rel[name]),
                        extra={
                            "measured_through": "patch()" if name != "stock" else "stock module",
                            **patches[name],
                            "bytes_moved": bytes_moved,
                            "copy_bandwidth_Bps": bw,
                            "weight_copies_rotated": copies,
                            **extra,
                        },
                    )
                )
            main = graph if graph is not None else eager
            forced = "mpsboost:triton" if cuda else "mpsboost:fold"
            table.append(
                (
                    lab,
                    n,
                    k,
                    bias,
                    main.timings["stock"].median_us,
                    main.timings["mpsboost"].median_us,
                    main.ratio("mpsboost"),
                    main.verdict("mpsboost"),
                    main.ratio(forced),
                    main.verdict(forced),
                    (patches["mpsboost"].get("patch_row") or {}).get("status"),
                    main.busy,
                )
            )
            del layers, models, xs
            if cuda:
                torch.cuda.empty_cache()

    if cuda and size == "real":
        records += _model_level(device, env, repeats=5)
    _print_table(table, cuda, bw)
    return records


def _model_level(device: str, env: RecordEnv, repeats: int) -> list[Record]:
    """One-token decode steps of a Qwen3-0.6B-shaped model (random weights), each variant made by ``patch()``."""
    import copy

    from transformers import Qwen3Config, Qwen3ForCausalLM
    from transformers.cache_utils import DynamicCache

    cfg = Qwen3Config(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    with torch.device(device):
        stock = Qwen3ForCausalLM(cfg).to(torch.bfloat16).eval()
    prompt = torch.randint(0, cfg.vocab_size, (1, 64), device=device)
    steps = 24
    options = {
        "stock": None,
        "mpsboost": {},
        "mpsboost:triton-eager": {"decode_linear": {"path": "triton", "cuda_eager": True}},
    }
    models, patches, fns = {}, {}, {}
    with torch.no_grad():
        for name, opts in options.items():
            model = stock if opts is None else copy.deepcopy(stock)
            patches[name] = {"layers_patched": 0} if opts is None else _patch(model, opts)
            try:
                cache = DynamicCache(config=cfg)
            except TypeError:  # older transformers
                cache = DynamicCache()
            out = model(prompt, past_key_values=cache, use_cache=True)  # prefill: not timed
            state = {"tok": out.logits[:, -1:].argmax(-1), "cache": cache}

            def step(model=model, state=state):
                o = model(state["tok"], past_key_values=state["cache"], use_cache=True)
                state["tok"] = o.logits[:, -1:].argmax(-1)

            models[name], fns[name] = model, step
        m = measure_variants(fns, device=device, repeats=repeats, warmup=2, calls=steps)
    context = {name: fns[name].__defaults__[1]["cache"].get_seq_length() for name in fns}
    workload = Workload(
        "decode_linear.model",
        {
            "model": "Qwen3-0.6B-shaped (random weights)",
            "prompt": 64,
            "steps_per_sample": steps,
            "cache": "dynamic",
            "mode": "eager",
        },
    )
    records = []
    for name, t in m.timings.items():
        records.append(
            Record(
                workload,
                name,
                env,
                throughput=t.throughput(items_per_call=1, unit="tokens/s"),
                extra={
                    "measured_through": "patch()" if name != "stock" else "stock model",
                    **patches[name],
                    "context_at_end": context[name],
                    **m.extra(name),
                },
            )
        )
    print(
        "\nmodel-level decode (Qwen3-0.6B-shaped, eager, ms/token, median (min..max)): "
        + "; ".join(
            f"{k} {t.median_s * 1e3:.2f} ({t.min_s * 1e3:.2f}..{t.max_s * 1e3:.2f}), "
            f"{patches[k]['layers_patched']} layers patched"
            + ("" if k == "stock" else f", {m.ratio(k):.2f}x {m.verdict(k)}")
            for k, t in m.timings.items()
        )
    )
    return records


def _print_table(table, cuda: bool, bw: float | None) -> None:
    how = "CUDA-graph replay" if cuda else "eager"
    if bw:
        print(f"\ncopy bandwidth {bw / 1e12:.2f} TB/s")
    print(f"\n{how}; median us per call; ratios within each shape; verdict: min..max spreads apart or not")
    print(
        f"{'layer':34s} {'N':>6s} {'K':>6s} b {'stock_us':>9s} {'mps_us':>9s} {'mps/stk':>7s} {'verdict':>13s} "
        f"{'forced':>6s} {'verdict':>13s} {'patch row':>10s} busy"
    )
    for lab, n, k, b, s, mu, r, v, fr, fv, st, busy in table:
        print(
            f"{lab[:34]:34s} {n:6d} {k:6d} {int(b)} {s:9.2f} {mu:9.2f} {r:7.3f} {v:>13s} "
            f"{fr:6.3f} {fv:>13s} {str(st):>10s} {'yes' if busy else ''}"
        )
    for col, name in ((7, "mpsboost (patch() defaults)"), (9, "forced path")):
        verdicts = [row[col] for row in table]
        print(
            f"{name}: "
            + ", ".join(f"{verdicts.count(v)} {v}" for v in ("faster", "slower", "no difference"))
            + f" of {len(table)} shapes"
        )
    if cuda:
        from mpsboost.recipes.decode_linear import MIN_SPEEDUP

        winners = {
            (n, k, bool(b), "bfloat16"): round(fr, 3)
            for lab, n, k, b, s, mu, r, v, fr, fv, st, busy in table
            if fv == "faster" and fr >= MIN_SPEEDUP
        }
        print("forced Triton faster with spreads apart and >= MIN_SPEEDUP:", winners)


if __name__ == "__main__":
    from mpsboost.bench.cli import script_main

    raise SystemExit(script_main(__file__, run))
