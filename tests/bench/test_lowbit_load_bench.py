"""benchmarks/lowbit_load.py at tiny size on the CPU, in-process: the folder its streaming writer makes is mlx-lm's
layout (router gates at 8 bits in ``config.json``, switch_mlp stacks, uint32 codes), ``from_pretrained`` loads it, its
independent unpacking equals ``mx.dequantize``, and the load phase's logits and greedy tokens agree with the exact
dequantisation reference."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def lb():
    spec = importlib.util.spec_from_file_location("mpsboost_bench_lowbit_load", ROOT / "benchmarks" / "lowbit_load.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


@pytest.mark.parametrize("bits", [4, 8])
def test_unpack_equals_mlx_dequantize(lb, bits):
    mx = pytest.importorskip("mlx.core")
    import numpy as np

    w = np.random.default_rng(bits).standard_normal((40, 320)).astype(np.float32)
    q, s, b = mx.quantize(mx.array(w), group_size=64, bits=bits)
    want = torch.from_numpy(np.array(mx.dequantize(q, s, b, group_size=64, bits=bits)))
    codes = torch.from_numpy(np.array(q).view(np.int32)).view(torch.uint32)
    got = lb.unpack_dequantize(codes, torch.from_numpy(np.array(s)), torch.from_numpy(np.array(b)), bits, 64)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    # float32 scales: computed in float32 as MLX does, then rounded once to bf16: within half a bf16 ulp of MLX's
    torch.testing.assert_close(got.float(), want, rtol=2**-8, atol=1e-6)
    # bf16 scales (the checkpoints' case): mx.dequantize computes in bf16, and the "mlx" rounding is its bit for
    # bit, where the default (float32, rounded once: the low-bit layers' rule) differs in part of the weights
    s16, b16 = mx.array(s).astype(mx.bfloat16), mx.array(b).astype(mx.bfloat16)
    want16 = torch.from_numpy(np.array(mx.dequantize(q, s16, b16, group_size=64, bits=bits).astype(mx.float32)))
    t16 = [torch.from_numpy(np.array(t.astype(mx.float32))).bfloat16() for t in (s16, b16)]
    assert torch.equal(lb.unpack_dequantize(codes, *t16, bits, 64, rounding="mlx").float(), want16)
    once = lb.unpack_dequantize(codes, *t16, bits, 64).float()
    assert not torch.equal(once, want16)


@pytest.mark.slow  # minutes on a busy 2-core machine: a forward of the tiny model is slow on the CPU
def test_tiny_write_and_load_phase(lb, tmp_path, monkeypatch):
    monkeypatch.setattr(lb, "NEW_TOKENS", 8)
    cfg = lb._config("qwen3.6", 4, True)  # layer 3 is full attention (a cache of linear layers alone has no length)
    files = lb.write_mlx(cfg, 4, 64, tmp_path / "f", "cpu")
    folder = Path(files["folder"])
    conf = json.loads((folder / "config.json").read_text())
    q = conf["quantization"]
    assert (q["bits"], q["group_size"]) == (4, 64)
    gates = {k for k, v in q.items() if isinstance(v, dict)}
    want = {f"language_model.model.layers.{i}.{g}" for i in range(4) for g in lb.ROUTER_GATES}
    assert gates == want and all(q[k] == {"group_size": 64, "bits": 8} for k in gates)
    from mpsboost.quant.io import open_folder

    ents = open_folder(folder).entries
    assert ents["language_model.model.layers.0.mlp.switch_mlp.gate_proj.weight"].dtype == "U32"
    assert ents["language_model.model.layers.0.mlp.gate.weight"].shape == (cfg.num_experts, cfg.hidden_size // 4)
    assert ents["language_model.lm_head.scales"].shape == (cfg.vocab_size, cfg.hidden_size // 64)
    assert files["file_bytes"] == sum(f.stat().st_size for f in folder.glob("*.safetensors"))

    r = lb.load_phase(files, cfg, "cpu")
    assert r["rel_error"] < 1e-2, r["rel_error"]
    assert len(r["layer_errors"]) == 4 and max(r["layer_errors"]) < 1e-2, r["layer_errors"]
    assert r["reference_gap"] > 0  # the two rounding rules give other weights
    assert r["tokens_equal"], (r["first_divergence"], r["tokens"], r["reference_tokens"])
    assert len(r["tokens"]) == lb.NEW_TOKENS
    assert any(k.startswith("low_bit_weights: ") for k in r["paths"])
    recs = lb.load_records(files, r, 4, True, "cpu")
    assert recs[0].correctness.rel_error == r["rel_error"] and recs[0].workload.shape["bits"] == 4
