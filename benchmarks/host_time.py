"""host_time: the host time of one eager decode step, per block, stock against patched (CPU, tiny model).

On a Mac transformers runs eagerly and a decode step at real size is host bound until its ops are few: every
aten op and every line of Python around it costs host time. This measures that host time where nothing else
does: on the CPU with a Qwen3.5/3.6-MoE of tiny widths (hidden 64), whose kernels take next to nothing, so the
step's time is dispatch and Python. One process, stock and each patched variant alternated in paired rounds,
each round the median of ``--steps`` decode steps after a 20-token prefill; per block (the Gated DeltaNet,
attention and MoE blocks, timed by forward hooks) and the whole step. Mac decisions are simulated
(``Env.simulate``): the same Python and the same ops a Mac runs, on the CPU's kernels.

    python benchmarks/host_time.py --out OUT            # writes OUT/host_time.json, prints the table

Figures hold for this host's CPU; what carries to a Mac is the ratio, not the microseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
import mpsboost  # noqa: E402
from mpsboost.gate import Env  # noqa: E402

BLOCKS = ("linear_attn", "self_attn", "mlp")


def _model() -> torch.nn.Module:
    import transformers as t

    kw = dict(
        vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=8,
        num_experts_per_tok=2, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16,
    )  # fmt: skip
    torch.manual_seed(0)
    return t.Qwen3_5MoeForCausalLM(t.Qwen3_5MoeTextConfig(**kw)).eval()


class _Timed:
    """A model, its prefilled cache and hooks that time each block's forward (host clock)."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.acc, self._t0 = model, {}, [0.0]
        for name, mod in model.named_modules():
            label = name.split(".")[-1]
            if name.count(".") == 3 and label in BLOCKS:
                mod.register_forward_pre_hook(lambda m, a: self._t0.__setitem__(0, time.perf_counter()))
                mod.register_forward_hook(
                    lambda m, a, o, label=label: self.acc.setdefault(label, []).append(
                        time.perf_counter() - self._t0[0]
                    )
                )
        ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            out = model(ids, use_cache=True)
        self.past, self.next = out.past_key_values, out.logits[:, -1:].argmax(-1)

    def round(self, steps: int) -> dict[str, float]:
        """Medians in microseconds of ``steps`` decode steps (the cache grows by one token each)."""
        self.acc.clear()
        total = []
        with torch.no_grad():
            for _ in range(steps):
                t0 = time.perf_counter()
                self.model(self.next, past_key_values=self.past, use_cache=True)
                total.append(time.perf_counter() - t0)
        out = {k: statistics.median(v) * 1e6 for k, v in self.acc.items()}
        out["step"] = statistics.median(total) * 1e6
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=60, help="decode steps per round (median)")
    p.add_argument("--envs", default="mps-2.15.0,mps-2.14.1", help="simulated decision sets, comma separated")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    import transformers

    variants = {"stock": _Timed(_model())}
    for env in a.envs.split(","):
        dev, _, ver = env.partition("-")
        m = _model()
        mpsboost.patch(m, device=Env.simulate(dev, ver or None))
        variants[f"mpsboost:{env}"] = _Timed(m)
    for t in variants.values():
        t.round(20)  # warm-up
    rounds: list[dict[str, dict[str, float]]] = []
    names = list(variants)
    for r in range(a.rounds):
        order = names if r % 2 == 0 else names[::-1]
        rounds.append({n: variants[n].round(a.steps) for n in order})
    keys = ("step", *BLOCKS)
    result = {
        "benchmark": "host_time",
        "what": "host time of one eager decode step per block, tiny Qwen3.5-MoE on the CPU (us, medians)",
        "env": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "mpsboost": getattr(mpsboost, "__version__", "?"),
            "python": platform.python_version(),
            "machine": platform.machine(),
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "threads": torch.get_num_threads(),
        },
        "rounds": rounds,
        "ratios": {},
    }
    print(f"{'block':<12}" + "".join(f"{n:>28}" for n in names))
    for k in keys:
        med = {n: statistics.median(rd[n][k] for rd in rounds) for n in names}
        cells = []
        for n in names:
            if n == "stock":
                cells.append(f"{med[n]:.0f} us")
                continue
            ratios = sorted(rd["stock"][k] / rd[n][k] for rd in rounds)
            result["ratios"].setdefault(n, {})[k] = {
                "median": statistics.median(ratios), "min": ratios[0], "max": ratios[-1]
            }  # fmt: skip
            cells.append(f"{med[n]:.0f} us {statistics.median(ratios):.2f}x ({ratios[0]:.2f}..{ratios[-1]:.2f})")
        print(f"{k:<12}" + "".join(f"{c:>28}" for c in cells))
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        path = a.out / "host_time.json"
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
