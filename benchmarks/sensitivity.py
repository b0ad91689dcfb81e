#!/usr/bin/env python3
"""How far a random-weight MoE model's logits move under a perturbation of one rounding step.

End-to-end logits of a random-weight MoE LM are a poor test of a recipe: its routers sit near ties, so
any change of summation order can flip an expert choice, and the flip grows through the layers. This
script measures that floor on the same model the end-to-end matrix uses, so that a variant's logits
error can be read against it:

* ``noise``: stock, with the hidden states after the embedding multiplied by (1 + e), e ~ N(0, s^2),
  s = 2^-9 (about half a bf16 rounding step), against stock: the amplification of one rounding;
* ``router flips``: the share of (token, layer) top-k expert sets that differ between the two runs;
* ``rms_norm``: every RMSNorm of the model patched by mpsboost's ``rms_norm`` recipe (asked for on
  this device with ``options``) against the module's own code, on that norm's real input: the largest
  relative error of one norm (the recipe's own difference, before any amplification).

    python benchmarks/sensitivity.py --device cuda --layers 40 --out OUT/sensitivity.json
    python benchmarks/sensitivity.py --device cpu --size tiny --out /tmp/s.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent


def _e2e():
    spec = importlib.util.spec_from_file_location("mpsboost_bench_e2e", ROOT / "e2e.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> int:
    from mpsboost.bench.harness import best_device

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default=best_device())  # what `mpsboost bench` picks: mps, cuda, cpu
    p.add_argument("--size", choices=("tiny", "real"), default="real")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    e2e = _e2e()
    import mpsboost
    from mpsboost.bench.quality import relative_error

    cfg = e2e.llm_config("qwen3.6-35b-a3b", a.size, a.layers)
    model = e2e.build_llm(cfg, a.device, torch.bfloat16, a.seed)
    ids = torch.randint(
        0, cfg.vocab_size, (1, a.prompt_tokens), generator=torch.Generator().manual_seed(a.seed + 1)
    ).to(a.device)

    routes: list[torch.Tensor] = []

    def keep_route(mod, args, out):
        routes.append(out[2].detach().sort(dim=-1).values.cpu())  # (router logits, scores, indices)

    gates = [m.gate for m in model.modules() if type(m).__name__.endswith("SparseMoeBlock")]
    hooks = [g.register_forward_hook(keep_route) for g in gates]
    with torch.no_grad():
        ref = model(ids).logits[0].float()
    ref_routes, routes[:] = list(routes), []
    g = torch.Generator(device=a.device).manual_seed(a.seed + 2)

    def noise(mod, args, out):
        return out * (1 + torch.randn(out.shape, generator=g, device=out.device, dtype=torch.float32) * 2.0**-9).to(
            out.dtype
        )

    h = model.get_input_embeddings().register_forward_hook(noise)
    with torch.no_grad():
        noisy = model(ids).logits[0].float()
    h.remove()
    for hk in hooks:
        hk.remove()
    flips = sum(int((x != y).any(-1).sum()) for x, y in zip(ref_routes, routes))
    total = sum(x.shape[0] for x in ref_routes)

    # the rms_norm recipe on this device, norm by norm, on each norm's real input
    inputs: dict[str, torch.Tensor] = {}
    norms = {n: m for n, m in model.named_modules() if type(m).__name__.endswith("RMSNorm") and "linear_attn" not in n}
    caps = [
        m.register_forward_hook(lambda mod, args, out, n=n: inputs.__setitem__(n, args[0].detach()))
        for n, m in norms.items()
    ]
    with torch.no_grad():
        model(ids[:, :64])
    for c in caps:
        c.remove()
    stock_out = {n: norms[n](x) for n, x in inputs.items()}
    report = mpsboost.patch(
        model, recipes=["rms_norm"], options={"rms_norm": {"devices": (torch.device(a.device).type,)}}
    )
    with torch.no_grad():
        errs = {n: relative_error(norms[n](x), stock_out[n]) for n, x in inputs.items()}
        maxabs = max(float((norms[n](x).float() - stock_out[n].float()).abs().max()) for n, x in inputs.items())
        patched_logits = model(ids).logits[0].float()
    out = {
        "workload": f"qwen3.6-35b-a3b ({cfg.num_hidden_layers} layers, bf16, random weights N(0, 0.02), norms 1)",
        "device": torch.cuda.get_device_name() if torch.device(a.device).type == "cuda" else a.device,
        "torch": torch.__version__,
        "prompt_tokens": a.prompt_tokens,
        "noise_rel_std": 2.0**-9,
        "logits_rel_error_under_noise": relative_error(noisy, ref),
        "router_topk_sets_changed_under_noise": flips,
        "router_topk_sets": total,
        "rms_norm_applied": len(report.applied),
        "rms_norm_max_rel_error_per_norm": max(errs.values()) if errs else None,
        "rms_norm_max_abs_error_per_norm": maxabs,
        "rms_norm_logits_rel_error": relative_error(patched_logits, ref),
    }
    print(json.dumps(out, indent=1))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
