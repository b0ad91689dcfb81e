"""fp8 checkpoints as people publish them, loaded onto models built on the meta device.

Each format's files are written here by hand from a tiny real model, following the format's own
documented key and scale layout (not with mpsboost's writer):

* transformers fine-grained FP8 (``quantization_config.quant_method = "fp8"``, ``weight_block_size``,
  ``<layer>.weight`` F8_E4M3 + ``<layer>.weight_scale_inv`` per block, value = code * scale_inv;
  experts as one 2-D Linear per expert, as in the Qwen3/DeepSeek FP8 releases, or as 3-D stacks);
* compressed-tensors ``float-quantized`` (``<layer>.weight`` + ``<layer>.weight_scale``, ``[1]`` per
  tensor or ``[N, 1]`` per channel, ``input_scale`` present and unused);
* single-file ``scaled_fp8`` diffusion checkpoints (``scaled_fp8`` marker, ``<layer>.scale_weight``,
  the original Wan repository's module names under ``model.diffusion_model.``).

The reference is the stock model holding weights dequantised by hand (a loop over blocks, float32
products) and the file's other tensors; outputs are compared with a stated tolerance. Environments:
simulated MPS 2.14.1 (uint8 storage), MPS 2.15.0 (float8 storage), and the real CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from mpsboost.bench.models import TINY_LM, build as build_row
from mpsboost.bench import relative_error

import mpsboost
import tiny_models as tm
from mpsboost.errors import IrreversiblePatchError
from mpsboost.checkpoints import Fp8FileError, Fp8MismatchError
from mpsboost.gate import Env

FP8 = torch.float8_e4m3fn
ENVS = {
    "mps-2.14.1": lambda: Env.simulate("mps", "2.14.1"),
    "mps-2.15.0": lambda: Env.simulate("mps", "2.15.0"),
    "cpu": lambda: "cpu",
}
# Stock forward on hand-dequantised weights vs the fp8 forward: same products, other summation order.
RTOL = 1e-4


# ------------------------------------------------------------------------------------------ by-hand quantisation


def _codes(w: torch.Tensor, scale_per_elem: torch.Tensor) -> torch.Tensor:
    return (w.float() / scale_per_elem).clamp(-448, 448).to(FP8)


def quant_block(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scale_inv [ceil(N/bn), ceil(K/bk)]) with one amax/448 scale per block; short last blocks."""
    bn, bk = block
    n, k = w.shape
    s = torch.empty(-(-n // bn), -(-k // bk))
    per = torch.empty(n, k)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk].float()
            s[i, j] = max(blk.abs().max().item(), 1e-12) / 448.0
            per[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = s[i, j]
    return _codes(w, per), s


def dequant_block(q: torch.Tensor, s: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    bn, bk = block
    w = q.float().clone()
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] *= s[i, j]
    return w


def quant_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = (w.float().abs().amax(dim=1, keepdim=True) / 448.0).clamp_min(1e-12)
    return _codes(w, s), s


def quant_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = torch.tensor([max(w.float().abs().max().item(), 1e-12) / 448.0])
    return _codes(w, s), s


def _save(tensors: dict, path: Path, config: dict | None = None) -> Path:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    if config is not None:
        (path.parent / "config.json").write_text(json.dumps(config))
    return path


def _is_router(name: str) -> bool:
    return name.endswith("mlp.gate")


# ------------------------------------------------------------------------------------------ writers


def write_transformers_fp8(model, folder: Path, block=(16, 48), experts="per_expert"):
    """transformers' fine-grained FP8; returns the reference state dict (dequantised by hand)."""
    tensors, ref = {}, {}
    sd = model.state_dict()
    linears = {
        n for n, m in model.named_modules() if type(m) is torch.nn.Linear and n != "lm_head" and not _is_router(n)
    }
    for key, t in sd.items():
        mod = key.rsplit(".", 1)[0]
        if key.endswith(".weight") and mod in linears:
            q, s = quant_block(t, block)
            tensors[key], tensors[key + "_scale_inv"] = q, s
            ref[key] = dequant_block(q, s, block)
        elif key.endswith("experts.gate_up_proj") or key.endswith("experts.down_proj"):
            base = key.rsplit(".", 1)[0]
            stacks, scales = [], []
            for e in range(t.shape[0]):
                if key.endswith("gate_up_proj"):
                    inter = t.shape[1] // 2
                    pieces = {"gate_proj": t[e, :inter], "up_proj": t[e, inter:]}
                else:
                    pieces = {"down_proj": t[e]}
                deq = []
                for name, w in pieces.items():
                    q, s = quant_block(w, block)
                    if experts == "per_expert":
                        tensors[f"{base}.{e}.{name}.weight"], tensors[f"{base}.{e}.{name}.weight_scale_inv"] = q, s
                    deq.append((q, s))
                ref_e = torch.cat([dequant_block(q, s, block) for q, s in deq])
                stacks.append(ref_e)
                if experts == "stacked":
                    scales.append((torch.cat([q for q, _ in deq]), torch.cat([s for _, s in deq])))
            ref[key] = torch.stack(stacks)
            if experts == "stacked":
                tensors[key] = torch.stack([q for q, _ in scales])
                tensors[key + "_scale_inv"] = torch.stack([s for _, s in scales])
        else:
            tensors[key] = t.clone()
            ref[key] = t.clone()
    cfg = model.config.to_dict()
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
        "modules_to_not_convert": ["lm_head"],
    }
    if "lm_head.weight" in tensors and getattr(model.config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight")
    _save(tensors, folder / "model.safetensors", cfg)
    return ref


def write_compressed_tensors(model, folder: Path, strategy="channel"):
    """compressed-tensors float-quantized, per-channel ([N, 1], bf16 scales) or per-tensor ([1], fp32)."""
    tensors, ref = {}, {}
    linears = {
        n for n, m in model.named_modules() if type(m) is torch.nn.Linear and n != "lm_head" and not _is_router(n)
    }
    for key, t in model.state_dict().items():
        mod = key.rsplit(".", 1)[0]
        if key.endswith(".weight") and mod in linears:
            if strategy == "channel":
                q, s = quant_rows(t)
                s = s.to(torch.bfloat16)  # compressed-tensors often stores scales in the model dtype
            else:
                q, s = quant_tensor(t)
            tensors[key], tensors[mod + ".weight_scale"] = q, s
            tensors[mod + ".input_scale"] = torch.ones(1)  # static activation scale: unused by a weight-only forward
            ref[key] = q.float() * s.float()
        elif key.endswith("experts.gate_up_proj") or key.endswith("experts.down_proj"):
            base = key.rsplit(".", 1)[0]
            stacks = []
            for e in range(t.shape[0]):
                inter = t.shape[1] // 2
                pieces = (
                    {"gate_proj": t[e, :inter], "up_proj": t[e, inter:]}
                    if key.endswith("gate_up_proj")
                    else {"down_proj": t[e]}
                )
                deq = []
                for name, w in pieces.items():
                    q, s = quant_tensor(w)  # one scale per expert projection: joined into exact per-row scales
                    tensors[f"{base}.{e}.{name}.weight"], tensors[f"{base}.{e}.{name}.weight_scale"] = q, s
                    deq.append(q.float() * s)
                stacks.append(torch.cat(deq))
            ref[key] = torch.stack(stacks)
        else:
            tensors[key] = t.clone()
            ref[key] = t.clone()
    cfg = model.config.to_dict()
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False},
            }
        },
    }
    _save(tensors, folder / "model.safetensors", cfg)
    return ref


def _wan_original_name(key: str) -> str:
    """diffusers' Wan key -> the original Wan repository's (mpsboost.bench.published, which the cookbook's
    fp8_checkpoint.py writes such files with offline); diffusers' own single-file conversion maps them back."""
    from mpsboost.bench.published import wan_original_name

    return wan_original_name(key)


def write_scaled_fp8(model, path: Path, prefix="model.diffusion_model.", original_names=True):
    """A single-file scaled fp8 checkpoint: Linear weights of the blocks in fp8 with one scale_weight each."""
    tensors, ref = {"scaled_fp8": torch.empty(0, dtype=FP8)}, {}
    linears = {n for n, m in model.named_modules() if type(m) is torch.nn.Linear}
    for key, t in model.state_dict().items():
        mod = key.rsplit(".", 1)[0]
        name = prefix + (_wan_original_name(key) if original_names else key)
        if (
            key.endswith(".weight")
            and mod in linears
            and (key.startswith("blocks.") or key.startswith("transformer_blocks."))
        ):
            q, s = quant_tensor(t)
            base = name[: -len("weight")]
            tensors[name], tensors[base + "scale_weight"] = q, s.reshape(())
            tensors[base + "scale_input"] = torch.ones(())  # used by fp8-matmul UIs; unused by a weight-only forward
            ref[key] = q.float() * s
        else:
            tensors[name] = t.clone()
            ref[key] = t.clone()
    _save(tensors, path)
    return ref


# ------------------------------------------------------------------------------------------ models


def _qwen3_moe_config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        **TINY_LM,
        head_dim=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_experts=8,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        norm_topk_prob=True,
    )


def _qwen3_config():
    from transformers import Qwen3Config

    return Qwen3Config(**TINY_LM, head_dim=32, intermediate_size=64)


def _lm(cfg_fn, seed=0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg_fn()).eval()


def _meta_lm(cfg_fn):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg_fn()).eval()


def _reference(build, ref_state):
    """The stock model holding the hand-dequantised weights (float32)."""
    model = build()
    missing, unexpected = model.load_state_dict(ref_state, strict=False)
    assert not unexpected and all("inv_freq" in k or "rope" in k for k in missing), (missing, unexpected)
    return model


def _lm_out(model, seed=5):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (2, 9), generator=g)
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def _all_fp8_rows_loaded(report, count: int) -> list:
    rows = [r for r in report.rows if r.recipe == "fp8_weights" and r.status == "applied"]
    assert len(rows) == count, [r.target for r in rows]
    return rows


# ------------------------------------------------------------------------------------------ each format


@pytest.mark.parametrize("env", list(ENVS))
@pytest.mark.parametrize("experts", ["per_expert", "stacked"])
def test_transformers_fp8_moe_blocks(tmp_path, env, experts):
    src = _lm(_qwen3_moe_config)
    ref_state = write_transformers_fp8(src, tmp_path / "ckpt", block=(16, 48), experts=experts)
    model = _meta_lm(_qwen3_moe_config)
    report = mpsboost.load_fp8(model, tmp_path / "ckpt", device=ENVS[env]())
    rows = _all_fp8_rows_loaded(report, 2 * 4 + 2)  # q/k/v/o of two layers, and two experts modules
    assert all(r.details["granularity"] == "block" and r.details["block"] == [16, 48] for r in rows)
    want_storage = "uint8" if env == "mps-2.14.1" else "float8"
    assert {r.details["storage"] for r in rows} == {want_storage}
    experts_mod = model.model.layers[0].mlp.experts
    assert experts_mod.gate_up_proj.dtype == (torch.uint8 if want_storage == "uint8" else FP8)
    assert experts_mod.gate_up_proj_scale.shape == (8, 2, 2)  # [E, ceil(32/16), ceil(64/48)]: kept, not folded
    assert not any(t.device.type == "meta" for t in list(model.parameters()) + list(model.buffers()))
    ref = _reference(lambda: _lm(_qwen3_moe_config, seed=1), ref_state)
    assert relative_error(_lm_out(model), _lm_out(ref)) < RTOL
    with pytest.raises(IrreversiblePatchError, match="fp8_weights"):
        mpsboost.unpatch(model)
    # The loaded layers print as what they are, as after patch(fp8=...).
    q = model.model.layers[0].self_attn.q_proj
    assert type(q).__name__ == "FP8Linear" and isinstance(q, torch.nn.Linear)
    assert "granularity=block" in repr(q) and "block=[16, 48]" in repr(q) and "backing=block-scaled fp8" in repr(q)
    assert type(experts_mod).__name__.startswith("FP8") and isinstance(experts_mod, type(experts_mod).__mro__[1])


@pytest.mark.parametrize("env", ["mps-2.14.1", "cpu"])
def test_block_scaled_moe_compiles_fullgraph(tmp_path, env):
    """The loaded block-scaled experts trace with fullgraph=True (no host read of the expert counts) and
    give the eager logits (fp32; the traced path dequantises the whole stack: another summation order)."""
    src = _lm(_qwen3_moe_config)
    write_transformers_fp8(src, tmp_path / "ckpt", block=(16, 48), experts="stacked")
    model = _meta_lm(_qwen3_moe_config)
    mpsboost.load_fp8(model, tmp_path / "ckpt", device=ENVS[env]())
    eager = _lm_out(model)
    torch._dynamo.reset()
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        compiled = torch.compile(model, fullgraph=True, backend="eager")(input_ids=ids).logits.float()
    assert relative_error(compiled, eager) < RTOL


@pytest.mark.parametrize("env", list(ENVS))
def test_transformers_fp8_dense_block_codes_are_the_files(tmp_path, env):
    src = _lm(_qwen3_config)
    ref_state = write_transformers_fp8(src, tmp_path / "ckpt", block=(16, 48))
    model = _meta_lm(_qwen3_config)
    mpsboost.load_fp8(model, tmp_path / "ckpt", device=ENVS[env]())
    from safetensors.torch import load_file

    f = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    q = model.model.layers[1].mlp.down_proj
    assert torch.equal(q.weight.view(torch.uint8), f["model.layers.1.mlp.down_proj.weight"].view(torch.uint8))
    assert torch.equal(q.weight_scale, f["model.layers.1.mlp.down_proj.weight_scale_inv"])
    ref = _reference(lambda: _lm(_qwen3_config, seed=1), ref_state)
    assert relative_error(_lm_out(model), _lm_out(ref)) < RTOL


@pytest.mark.parametrize("env", [*ENVS, "cuda-sm90-simulated"])
@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_compressed_tensors(tmp_path, env, strategy):
    src = _lm(_qwen3_moe_config)
    ref_state = write_compressed_tensors(src, tmp_path / "ckpt", strategy=strategy)
    model = _meta_lm(_qwen3_moe_config)
    # The simulated CUDA build takes the fused path (its registered operators run their CPU references
    # on these CPU tensors): the GEMV for few rows, the exact dequantised linear above.
    device = Env.simulate("cuda:9.0", "2.11.0") if env == "cuda-sm90-simulated" else ENVS[env]()
    report = mpsboost.load_fp8(model, tmp_path / "ckpt", device=device)
    rows = _all_fp8_rows_loaded(report, 10)
    if env == "cuda-sm90-simulated":
        assert {r.backing for r in rows if r.details["kind"] == "linear"} == {
            "fp8 GEMV (triton, float32 activations; tf32 in its 16-row tile kernel) for M<=16; "
            "dequantize then linear above"
        }
    lin = {r.details["granularity"] for r in rows if r.details["kind"] == "linear"}
    assert lin == {"rowwise" if strategy == "channel" else "tensorwise"}
    # Per-expert per-tensor scales of gate and up: joined as exact per-row scales of the gate_up stack;
    # down_proj keeps one scale per expert.
    experts = model.model.layers[1].mlp.experts
    assert experts.gate_up_proj_scale.shape == (8, 32, 1) and experts.down_proj_scale.shape == (8, 1, 1)
    assert {r.details["granularity"] for r in rows if r.details["kind"] == "experts"} == {"rowwise+tensorwise"}
    ref = _reference(lambda: _lm(_qwen3_moe_config, seed=1), ref_state)
    assert relative_error(_lm_out(model), _lm_out(ref)) < RTOL


def _wan_out(model, seed=3):
    return tm._run_wan_transformer(model, seed, frames=2, size=4)


@pytest.mark.parametrize("env", list(ENVS))
def test_scaled_fp8_wan_through_diffusers_key_conversion(tmp_path, env):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    src = build_row("wan22_transformer:tiny", in_channels=16, out_channels=16).eval()
    ref_state = write_scaled_fp8(src, tmp_path / "wan_fp8_scaled.safetensors")
    with torch.device("meta"):
        model = WanTransformer3DModel.from_config(src.config).eval()
    report = mpsboost.load_fp8(model, tmp_path / "wan_fp8_scaled.safetensors", device=ENVS[env]())
    rows = _all_fp8_rows_loaded(report, 2 * (4 + 4 + 2))  # attn1 q/k/v/o, attn2 q/k/v/o, ffn x2, per block
    assert all(r.details["format"] == "scaled_fp8" and r.details["granularity"] == "tensorwise" for r in rows)
    assert model.blocks[0].attn1.to_q.weight_scale.shape == ()
    torch.manual_seed(1)
    ref = build_row("wan22_transformer:tiny", in_channels=16, out_channels=16).eval()
    ref.load_state_dict(ref_state)
    assert relative_error(_wan_out(model), _wan_out(ref)) < RTOL


def test_scaled_fp8_qwen_image(tmp_path):
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(0)
    src = build_row("qwen_image_transformer:tiny").eval()
    ref_state = write_scaled_fp8(src, tmp_path / "qwen_image_fp8_scaled.safetensors", original_names=False)
    from accelerate import init_empty_weights

    with init_empty_weights():
        model = QwenImageTransformer2DModel.from_config(src.config).eval()
    mpsboost.load_fp8(model, tmp_path / "qwen_image_fp8_scaled.safetensors", device=Env.simulate("mps", "2.14.1"))
    torch.manual_seed(1)
    ref = build_row("qwen_image_transformer:tiny").eval()
    ref.load_state_dict(ref_state)
    out = tm._run_qwen_image_transformer(model, 2)
    assert relative_error(out, tm._run_qwen_image_transformer(ref, 2)) < RTOL


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["transformers", "compressed-tensors"])
def test_published_checkpoints_on_cuda(tmp_path, fmt):
    src = _lm(_qwen3_moe_config)
    if fmt == "transformers":
        ref_state = write_transformers_fp8(src, tmp_path / "ckpt", block=(16, 48))
    else:
        ref_state = write_compressed_tensors(src, tmp_path / "ckpt", strategy="channel")
    model = _meta_lm(_qwen3_moe_config)
    report = mpsboost.load_fp8(model, tmp_path / "ckpt", device="cuda")
    assert report.env.device_type == "cuda"
    assert all(t.device.type == "cuda" for t in list(model.parameters()) + list(model.buffers()))
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == FP8
    ref = _reference(lambda: _lm(_qwen3_moe_config, seed=1), ref_state).cuda()
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 128, (2, 9), generator=g).cuda()
    with torch.no_grad():
        got, want = model(input_ids=ids).logits.float(), ref(input_ids=ids).logits.float()
    # fp32 compute on both sides; the fused CUDA paths quantise activations for M > 16 rows (rowwise scales).
    assert relative_error(got, want) < (RTOL if fmt == "transformers" else 5e-2)


# ---------------------------------------------------------------------------------- mpsboost's own complete checkpoints


@pytest.mark.parametrize("env", list(ENVS))
def test_complete_checkpoint_sharded_round_trip(tmp_path, env):
    src = tm.build("qwen3_moe", dtype="bfloat16", seed=0)
    mpsboost.patch(src, fp8="rowwise")
    out = mpsboost.save_fp8(src, tmp_path / "ck", max_shard_size="40KB")
    files = sorted(p.name for p in out.iterdir())
    assert "config.json" in files and "model.fp8.safetensors.index.json" in files
    shards = [f for f in files if f.startswith("model.fp8-")]
    assert len(shards) > 1 and all(f.endswith(f"-of-{len(shards):05d}.safetensors") for f in shards)
    index = json.loads((out / "model.fp8.safetensors.index.json").read_text())
    assert "lm_head.weight" in index["weight_map"] and "model.embed_tokens.weight" in index["weight_map"]
    model = _meta_lm(lambda: src.config)
    mpsboost.load_fp8(model, out, device=ENVS[env]())
    a, b = src.state_dict(), model.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        x, y = a[k], b[k]
        if x.dtype in (FP8, torch.uint8):
            x, y = x.view(torch.uint8), y.view(torch.uint8)
        if "inv_freq" not in k:  # the source was cast to bf16 whole; a fresh build keeps its rotary table in fp32
            assert x.dtype == y.dtype and torch.equal(x, y), k


def test_complete_checkpoint_of_a_pipeline(tmp_path):
    pipe = tm.build("wan22_ti2v_pipeline", dtype="bfloat16")
    mpsboost.patch(pipe, fp8="tensorwise")
    out = mpsboost.save_fp8(pipe, tmp_path / "pipe")
    assert (out / "transformer" / "config.json").is_file() and (
        out / "text_encoder" / "model.fp8.safetensors"
    ).is_file()
    fresh = tm.build("wan22_ti2v_pipeline", dtype="bfloat16")
    metas = {}
    for name in ("transformer", "text_encoder", "vae"):
        comp = getattr(pipe, name)
        with torch.device("meta"):
            metas[name] = type(comp).from_config(comp.config) if name != "text_encoder" else type(comp)(comp.config)
        setattr(fresh, name, metas[name].eval())
        fresh.register_modules(**{name: metas[name]})
    report = mpsboost.load_fp8(fresh, out, device="cpu")
    assert any(r.target.startswith("transformer.blocks.0.") for r in report.rows if r.recipe == "fp8_weights")
    assert any(r.target.startswith("text_encoder.") for r in report.rows if r.recipe == "fp8_weights")
    for name in ("transformer", "text_encoder"):
        a, b = getattr(pipe, name).state_dict(), getattr(fresh, name).state_dict()
        assert a.keys() == b.keys()
        assert all(
            torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8))
            if a[k].dtype in (FP8, torch.uint8)
            else torch.equal(a[k], b[k])
            for k in a
        )
    # The rotary tables differ: the source was cast to bf16 whole, a fresh build keeps them in float32.
    assert (
        relative_error(
            tm.run("wan22_ti2v_pipeline", fresh, 4, steps=1), tm.run("wan22_ti2v_pipeline", pipe, 4, steps=1)
        )
        < 2e-2
    )


def test_save_of_a_loaded_published_checkpoint_round_trips(tmp_path):
    src = _lm(_qwen3_moe_config)
    write_transformers_fp8(src, tmp_path / "ckpt", block=(16, 48))
    model = _meta_lm(_qwen3_moe_config)
    mpsboost.load_fp8(model, tmp_path / "ckpt", device="cpu")
    mpsboost.save_fp8(model, tmp_path / "again.safetensors")
    again = _meta_lm(_qwen3_moe_config)
    report = mpsboost.load_fp8(again, tmp_path / "again.safetensors", device="cpu")
    assert {r.details["granularity"] for r in report.rows if r.recipe == "fp8_weights"} == {"block"}
    assert torch.equal(_lm_out(again), _lm_out(model))


def test_describe_checkpoint_names_format_storage_and_path(tmp_path):
    from mpsboost.quant.fp8_plan import describe_checkpoint

    write_transformers_fp8(_lm(_qwen3_moe_config), tmp_path / "tf", block=(16, 48))
    old = describe_checkpoint(tmp_path / "tf", Env.simulate("mps", "2.14.1"))
    assert (
        "format transformers-fp8" in old
        and "block 16x48" in old
        and "storage: uint8" in old
        and "pytorch#194074" in old
    )
    assert "stacked into [E, out, in]" in old
    new = describe_checkpoint(tmp_path / "tf", Env.simulate("mps", "2.15.0"))
    assert "storage: float8" in new and "uint8" not in new
    write_compressed_tensors(_lm(_qwen3_config), tmp_path / "ct", strategy="tensor")
    cuda = describe_checkpoint(tmp_path / "ct", Env.simulate("cuda:9.0", "2.11.0"))
    assert "compressed-tensors" in cuda and "tensorwise" in cuda and "fp8 GEMV (triton)" in cuda


# ------------------------------------------------------------------------------------------ bad files


@pytest.fixture
def fp8_folder(tmp_path):
    src = _lm(_qwen3_config)
    write_transformers_fp8(src, tmp_path / "ckpt", block=(16, 48))
    return tmp_path / "ckpt"


def _rewrite(folder: Path, out: Path, *, drop=(), replace=None, config=None) -> Path:
    from safetensors.torch import load_file

    t = load_file(str(folder / "model.safetensors"))
    for k in drop:
        t.pop(k)
    t.update(replace or {})
    cfg = json.loads((folder / "config.json").read_text())
    if config is not None:
        cfg = config(cfg)
    _save(t, out / "model.safetensors", cfg)
    return out


def _unchanged_after(model, call, err, *words):
    before = tm.snapshot(model)
    classes = {name: type(m) for name, m in model.named_modules()}
    with pytest.raises(err) as info:
        call()
    msg = str(info.value)
    for w in words:
        assert w in msg, (w, msg)
    assert not tm.diff_snapshot(before, tm.snapshot(model))
    assert {name: type(m) for name, m in model.named_modules()} == classes  # no layer left as FP8Linear
    assert not mpsboost.api.is_patched(model)
    assert all(p.device.type == "meta" for p in model.parameters())
    return msg


def test_bad_files_are_refused_by_format_and_change_nothing(fp8_folder, tmp_path):
    from safetensors.torch import load_file

    f = load_file(str(fp8_folder / "model.safetensors"))
    key = "model.layers.0.self_attn.q_proj.weight"
    model = _meta_lm(_qwen3_config)
    load = lambda p: lambda: mpsboost.load_fp8(model, p, device="cpu")  # noqa: E731
    # A scale missing: the format and the key are named.
    bad = _rewrite(fp8_folder, tmp_path / "noscale", drop=[key + "_scale_inv"])
    _unchanged_after(model, load(bad), Fp8MismatchError, "transformers-fp8", key + "_scale_inv", "missing")
    # Scales of the wrong shape for the declared blocks.
    bad = _rewrite(fp8_folder, tmp_path / "shape", replace={key + "_scale_inv": torch.ones(3, 3)})
    _unchanged_after(model, load(bad), Fp8MismatchError, key + "_scale_inv", "[3, 3]", "blocks [16, 48]")
    # Codes of the wrong shape.
    bad = _rewrite(fp8_folder, tmp_path / "codes", replace={key: f[key][:, :32].contiguous()})
    _unchanged_after(model, load(bad), Fp8MismatchError, key, "shape [64, 32]")
    # A plain tensor missing (partial file).
    bad = _rewrite(fp8_folder, tmp_path / "partial", drop=["model.norm.weight"])
    _unchanged_after(model, load(bad), Fp8MismatchError, "model.norm.weight: missing")
    # Truncated file.
    trunc = tmp_path / "trunc"
    trunc.mkdir()
    data = (fp8_folder / "model.safetensors").read_bytes()
    (trunc / "model.safetensors").write_bytes(data[:-100])
    _unchanged_after(model, load(trunc), Fp8FileError, "truncated")
    # A config that says fp8 but a file without any scale: partial or mislabelled.
    bad = _rewrite(fp8_folder, tmp_path / "noscales", drop=[k for k in f if k.endswith("_scale_inv")])
    _unchanged_after(model, load(bad), Fp8FileError, "transformers-fp8", "weight_scale_inv")
    # Another format: a plain bf16 checkpoint is not an fp8 one.
    plain = _save({"model.norm.weight": torch.ones(64, dtype=torch.bfloat16)}, tmp_path / "plain" / "model.safetensors")
    _unchanged_after(model, load(plain), Fp8FileError, "not an fp8 checkpoint")
    # fp8 codes but no scale layout at all, no config.
    (tmp_path / "bare").mkdir()
    bare = _save({key: f[key]}, tmp_path / "bare" / "x.safetensors")
    _unchanged_after(model, load(bare), Fp8FileError, "float8", "none of the scale layouts")
    # A model of another shape.
    from transformers import Qwen3Config

    def other():
        return Qwen3Config(**dict(TINY_LM, hidden_size=96), head_dim=32, intermediate_size=64)

    wrong = _meta_lm(other)
    _unchanged_after(wrong, lambda: mpsboost.load_fp8(wrong, fp8_folder, device="cpu"), Fp8MismatchError, "shape")


def test_sharded_folder_with_a_shard_missing(tmp_path):
    src = tm.build("qwen3", dtype="bfloat16")
    mpsboost.patch(src, fp8="rowwise")
    out = mpsboost.save_fp8(src, tmp_path / "ck", max_shard_size="30KB")
    victim = sorted(out.glob("model.fp8-*.safetensors"))[1]
    victim.unlink()
    model = _meta_lm(lambda: src.config)
    _unchanged_after(model, lambda: mpsboost.load_fp8(model, out, device="cpu"), Fp8FileError, "partial", victim.name)


def test_scaled_fp8_without_scales_and_compressed_tensors_wrong_scales(tmp_path):
    torch.manual_seed(0)
    src = build_row("wan22_transformer:tiny", in_channels=16, out_channels=16).eval()
    write_scaled_fp8(src, tmp_path / "w.safetensors")
    from safetensors.torch import load_file

    t = load_file(str(tmp_path / "w.safetensors"))
    victim = "model.diffusion_model.blocks.1.ffn.2.scale_weight"
    t.pop(victim)
    _save(t, tmp_path / "w2.safetensors")
    from diffusers import WanTransformer3DModel

    with torch.device("meta"):
        model = WanTransformer3DModel.from_config(src.config)
    _unchanged_after(
        model,
        lambda: mpsboost.load_fp8(model, tmp_path / "w2.safetensors", device="cpu"),
        Fp8MismatchError,
        "scaled_fp8",
        victim,
        "missing",
    )
    lm = _lm(_qwen3_config)
    write_compressed_tensors(lm, tmp_path / "ct", strategy="channel")
    key = "model.layers.0.mlp.up_proj.weight_scale"
    _rewrite(tmp_path / "ct", tmp_path / "ct2", replace={key: torch.ones(7, 1)})
    meta = _meta_lm(_qwen3_config)
    _unchanged_after(
        meta,
        lambda: mpsboost.load_fp8(meta, tmp_path / "ct2", device="cpu"),
        Fp8MismatchError,
        "compressed-tensors",
        key,
        "[7, 1]",
    )


@pytest.mark.parametrize("fmt", ["mpsboost", "compressed-tensors"])
@pytest.mark.parametrize("fail_at", ["early", "late"])
def test_a_failure_while_reading_puts_every_tensor_back(fp8_folder, tmp_path, monkeypatch, fail_at, fmt):
    from mpsboost.quant import io as fp8_formats  # the one tensor reader every loader calls

    if fmt == "compressed-tensors":  # published formats are read by load_fp8 itself, layer by layer
        write_compressed_tensors(_lm(_qwen3_config), tmp_path / "ct", strategy="channel")
        fp8_folder = tmp_path / "ct"

    real = fp8_formats.read_tensor
    total = {"n": 0}

    def counting(entry, out=None):
        total["n"] += 1
        return real(entry, out)

    monkeypatch.setattr(fp8_formats, "read_tensor", counting)
    mpsboost.load_fp8(_meta_lm(_qwen3_config), fp8_folder, device="cpu")
    # early: among the first tensors; late: after almost every tensor was read into place
    stop = 12 if fail_at == "early" else total["n"] - 2
    model = _meta_lm(_qwen3_config)
    calls = {"n": 0}

    def flaky(entry, out=None):
        calls["n"] += 1
        if calls["n"] == stop:
            raise OSError("disk went away")
        return real(entry, out)

    monkeypatch.setattr(fp8_formats, "read_tensor", flaky)
    _unchanged_after(
        model,
        lambda: mpsboost.load_fp8(model, fp8_folder, device="cpu"),
        Fp8FileError,
        "disk went away",
        "nothing was changed",
    )
    assert calls["n"] == stop


def test_a_failure_while_binding_gives_back_every_class(tmp_path, monkeypatch):
    # Published formats: every tensor is read first, then each layer gets its forward and its fp8 class
    # (bound by the fp8_weights recipe, as for patch(fp8=...)); a failure at the third layer must give the
    # first two back their original class (and tensors).
    from mpsboost.recipes.fp8 import recipe as fp8_recipe

    write_compressed_tensors(_lm(_qwen3_config), tmp_path / "ct", strategy="channel")
    model = _meta_lm(_qwen3_config)
    real = fp8_recipe.bind_forward
    calls = {"n": 0}

    def flaky(*args, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("bind failed")
        return real(*args, **kw)

    monkeypatch.setattr(fp8_recipe, "bind_forward", flaky)
    _unchanged_after(
        model,
        lambda: mpsboost.load_fp8(model, tmp_path / "ct", device="cpu"),
        Fp8FileError,
        "bind failed",
        "nothing was changed",
    )
    assert calls["n"] == 3


# ------------------------------------------------------------------------------------------ memory

_MEM_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    import mpsboost
    from transformers import AutoModelForCausalLM, Qwen3Config

    def rss(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) * 1024

    cfg = Qwen3Config(**json.loads(sys.argv[2]))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    mpsboost.load_fp8(model, sys.argv[1], device="cpu", lossless_recipes=False)  # warm-up: imports, first-call costs
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # resets the peak resident set size (VmHWM) to the current one
    base = rss("VmRSS:")
    mpsboost.load_fp8(model, sys.argv[1], device="cpu", lossless_recipes=False)
    print(json.dumps({"base": base, "peak": rss("VmHWM:"), "after": rss("VmRSS:")}))
    """
)

_MEM_CFG = dict(
    vocab_size=32000,
    hidden_size=1024,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=64,
    intermediate_size=3072,
    tie_word_embeddings=False,
    max_position_embeddings=256,
)


def _write_random_fp8(folder: Path, cfg: dict, block=(128, 128)) -> tuple[int, int]:
    """A transformers-fp8 checkpoint with random codes, written from the meta model's shapes (no bf16 model).

    Returns (file bytes, bytes of the largest single tensor as loaded)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(Qwen3Config(**cfg))
    g = torch.Generator().manual_seed(0)
    tensors = {}
    linears = {n for n, m in model.named_modules() if type(m) is torch.nn.Linear and n != "lm_head"}
    largest = 0
    for key, p in model.state_dict().items():
        if key.rsplit(".", 1)[0] in linears:
            codes = torch.randint(0, 0x7E, tuple(p.shape), generator=g, dtype=torch.uint8)  # no NaN codes
            tensors[key] = codes.view(FP8)
            n, k = p.shape
            tensors[key + "_scale_inv"] = torch.rand(-(-n // block[0]), -(-k // block[1]), generator=g) * 1e-3
            largest = max(largest, codes.numel())
        else:
            tensors[key] = (torch.randn(tuple(p.shape), generator=g) * 0.02).to(torch.bfloat16)
            largest = max(largest, p.numel() * 2)
    conf = dict(
        cfg,
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        quantization_config={"quant_method": "fp8", "weight_block_size": list(block), "activation_scheme": "dynamic"},
    )
    path = _save(tensors, folder / "model.safetensors", conf)
    return path.stat().st_size, largest


@pytest.mark.slow
def test_peak_memory_while_loading_stays_under_file_plus_largest_layer(tmp_path):
    size, largest = _write_random_fp8(tmp_path / "big", _MEM_CFG)
    assert size > 200 * 2**20  # a model of a few hundred MB
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(Path(mpsboost.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
    )
    out = subprocess.run(
        [sys.executable, "-c", _MEM_SCRIPT, str(tmp_path / "big"), json.dumps(_MEM_CFG)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    m = json.loads(out.stdout.strip().splitlines()[-1])
    peak = m["peak"] - m["base"]
    margin = 48 * 2**20  # Python objects, allocator slack, the rotary tables of a donor build
    print(
        f"file {size / 2**20:.1f} MiB, largest tensor {largest / 2**20:.1f} MiB, "
        f"peak over baseline {peak / 2**20:.1f} MiB, "
        f"held after load {(m['after'] - m['base']) / 2**20:.1f} MiB"
    )
    assert peak <= size + largest + margin, (peak, size, largest)


# ------------------------------------------------------------------------------------------ the cookbook script


@pytest.mark.parametrize("fmt", ["compressed-tensors", "scaled_fp8"])
def test_cookbook_script_writes_and_loads_each_format(tmp_path, fmt, monkeypatch, capsys):
    from cookbook import run_script

    args = ("--random-weights", "tiny", "--write-format", fmt, "--device", "cpu", "--repeats", "1", "--warmup", "0")
    rc, out, _, err = run_script(monkeypatch, capsys, "fp8_checkpoint", *args, "--out", str(tmp_path))
    assert rc == 0, out[-3000:] + err[-3000:]
    from mpsboost.bench import read_jsonl

    recs = read_jsonl(tmp_path / "fp8_checkpoint.jsonl")
    patched = next(r for r in recs if r.variant != "stock")
    assert patched.extra["format"] == fmt and patched.correctness.rel_error <= RTOL
    assert f"format {'scaled_fp8' if fmt == 'scaled_fp8' else fmt}" in out


@pytest.mark.parametrize("env", list(ENVS))
@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_bf16_layers_apply_the_files_scales_exactly(tmp_path, env, strategy):
    """In bf16, a loaded layer computes with code x scale in float32 rounded once: bit-identical to F.linear
    on the hand-dequantised weight."""
    src = _lm(_qwen3_config).to(torch.bfloat16)
    ref_state = write_compressed_tensors(src, tmp_path / "ckpt", strategy=strategy)
    model = _meta_lm(_qwen3_config)
    mpsboost.load_fp8(model, tmp_path / "ckpt", device=ENVS[env]())
    layer = model.model.layers[1].mlp.down_proj
    x = torch.randn(3, 5, layer.in_features, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    want = torch.nn.functional.linear(x, ref_state["model.layers.1.mlp.down_proj.weight"].to(torch.bfloat16))
    with torch.no_grad():
        assert torch.equal(layer(x), want)
