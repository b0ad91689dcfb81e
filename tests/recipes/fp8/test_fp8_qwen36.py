"""Qwen3.6-35B-A3B-FP8's published layout, at reduced size, loaded with ``mpsboost.load_fp8``.

The file is written here by hand in the layout of ``Qwen/Qwen3.6-35B-A3B-FP8`` (transformers'
fine-grained FP8, read from transformers 5.24's loader: ``integrations/finegrained_fp8.py``,
``quantizers/quantizer_finegrained_fp8.py`` and the ``qwen3_5_moe_text`` conversion mapping):

* keys of the multimodal wrapper ``Qwen3_5MoeForConditionalGeneration``: ``model.language_model.*``
  (transformers' ``PrefixChange(prefix_to_remove="language_model", model_prefix="model")`` maps them onto
  ``Qwen3_5MoeForCausalLM``'s ``model.*``), ``lm_head.weight`` at the top, plus ``model.visual.*`` and
  ``mtp.*`` tensors that the text model ignores (its ``_keys_to_ignore_on_load_unexpected``);
* ``config.json`` of the wrapper (``text_config``, ``vision_config``) with the published
  ``quantization_config``: ``quant_method "fp8"``, ``weight_block_size [128, 128]``, ``activation_scheme
  "dynamic"``, ``modules_to_not_convert`` naming every bf16 module;
* fp8 (F8_E4M3 codes, ``<layer>.weight_scale_inv`` BF16 ``[ceil(N/128), ceil(K/128)]``, value = code *
  scale): full-attention ``q/k/v/o_proj``, Gated DeltaNet ``in_proj_qkv``, ``in_proj_z``, ``out_proj``,
  ``shared_expert.{gate,up,down}_proj`` and the routed experts one Linear per expert
  (``mlp.experts.<e>.{gate,up,down}_proj.weight``, which transformers' ``qwen2_moe`` converter stacks into
  ``gate_up_proj [E, 2I, H]`` (gate rows first) and ``down_proj [E, H, I]``);
* bf16: embeddings, ``lm_head``, norms, ``mlp.gate`` (router), ``shared_expert_gate``, ``in_proj_a``,
  ``in_proj_b``, ``conv1d``, ``dt_bias``; ``A_log`` float32.

The file is written from a tiny ``Qwen3_5MoeForConditionalGeneration`` (its real bf16 vision tower
included) and loaded into both classes built on the meta device: ``Qwen3_5MoeForCausalLM`` (what
``AutoModelForCausalLM.from_config`` builds from the published config) and the wrapper itself. The
reference is the stock class holding the file's exact dequantisation (code x scale in float32, rounded
once to bf16) and the file's other tensors as they are: logits are compared for equality.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import mpsboost
from mpsboost.errors import Fp8MismatchError
from mpsboost.gate import Env

FP8 = torch.float8_e4m3fn
BLOCK = (128, 128)
# uint8 storage (MPS before 2.15, pytorch#194074) and float8 storage; block-scaled layers take the same
# dequantise-then-linear path on every device (MPS 2.15's float8 storage is covered by the CPU's).
ENVS = {
    "mps-2.14.1": lambda: Env.simulate("mps", "2.14.1"),
    "cpu": lambda: "cpu",
}
# Widths chosen so that blocks are both whole (128) and ragged (the shared expert's 192 rows, the
# in_proj_z / attention widths of 320 columns would be too big: 192 = 128 + 64 is the ragged case).
TEXT = dict(
    vocab_size=250,
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=128,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_conv_kernel_dim=4,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=128,
    shared_expert_intermediate_size=192,
    full_attention_interval=4,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    rms_norm_eps=1e-6,
)
PREFIX = "model.language_model."
# The published modules_to_not_convert, per layer (besides lm_head and the embeddings).
_BF16_LINEARS = ("mlp.gate", "mlp.shared_expert_gate", "linear_attn.in_proj_a", "linear_attn.in_proj_b")


def _config():
    from transformers import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(**TEXT)


def quant_block(w: torch.Tensor, block=BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(F8_E4M3 codes, BF16 scale_inv [ceil(N/bn), ceil(K/bk)]): one amax/448 scale per block, short last blocks."""
    bn, bk = block
    n, k = w.shape
    nb, kb = -(-n // bn), -(-k // bk)
    pad = torch.zeros(nb * bn, kb * bk)
    pad[:n, :k] = w.float()
    amax = pad.view(nb, bn, kb, bk).abs().amax(dim=(1, 3))
    scale = (amax / 448.0).clamp_min(1e-8).to(torch.bfloat16)
    per = scale.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (w.float() / per).clamp(-448, 448).to(FP8), scale


def dequant_block(q: torch.Tensor, s: torch.Tensor, block=BLOCK) -> torch.Tensor:
    """The file's exact dequantisation, in float32 (an independent formula: per-element scale, one product)."""
    n, k = q.shape
    per = s.float().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return q.float() * per


def _not_converted(n_layers: int) -> list[str]:
    out = ["lm_head", PREFIX + "embed_tokens", PREFIX + "norm"]
    for i in range(n_layers):
        p = f"{PREFIX}layers.{i}."
        out += [
            p + "input_layernorm",
            p + "post_attention_layernorm",
            p + "mlp.gate",
            p + "mlp.shared_expert_gate",
            p + "linear_attn.A_log",
            p + "linear_attn.conv1d",
            p + "linear_attn.dt_bias",
            p + "linear_attn.in_proj_a",
            p + "linear_attn.in_proj_b",
            p + "linear_attn.norm",
            p + "self_attn.q_norm",
            p + "self_attn.k_norm",
        ]
    return out + ["model.visual", "mtp"]


VISION = {
    "depth": 1,
    "hidden_size": 32,
    "num_heads": 2,
    "intermediate_size": 64,
    "out_hidden_size": 256,
    "patch_size": 4,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}


def _wrapper_config():
    from transformers import Qwen3_5MoeConfig

    return Qwen3_5MoeConfig(text_config=dict(TEXT), vision_config=dict(VISION), tie_word_embeddings=False)


def write_qwen36_fp8(folder: Path, seed: int = 0) -> dict:
    """The published layout from a random-weight tiny ``Qwen3_5MoeForConditionalGeneration``; returns the
    reference state under the file's (the wrapper's) keys: the exact dequantisation of every fp8 tensor."""
    from safetensors.torch import save_file
    from transformers import Qwen3_5MoeForConditionalGeneration

    torch.manual_seed(seed)
    src = Qwen3_5MoeForConditionalGeneration(_wrapper_config())
    tensors: dict[str, torch.Tensor] = {}
    ref: dict[str, torch.Tensor] = {}
    fp8_linears = {
        n
        for n, m in src.named_modules()
        if type(m) is torch.nn.Linear and n.startswith(PREFIX) and not n.endswith(_BF16_LINEARS)
    }
    for key, t in src.state_dict().items():
        mod = key.rsplit(".", 1)[0]
        if key.endswith(".weight") and mod in fp8_linears:
            q, s = quant_block(t)
            tensors[key], tensors[key + "_scale_inv"] = q, s
            ref[key] = dequant_block(q, s).to(torch.bfloat16)
        elif key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            base = key.rsplit(".", 1)[0]
            deq = torch.empty(t.shape)
            for e in range(t.shape[0]):
                inter = t.shape[1] // 2
                pieces = (
                    {"gate_proj": (0, inter), "up_proj": (inter, 2 * inter)}
                    if key.endswith("gate_up_proj")
                    else {"down_proj": (0, t.shape[1])}
                )
                for name, (r0, r1) in pieces.items():
                    q, s = quant_block(t[e, r0:r1])
                    tensors[f"{base}.{e}.{name}.weight"], tensors[f"{base}.{e}.{name}.weight_scale_inv"] = q, s
                    deq[e, r0:r1] = dequant_block(q, s)
            ref[key] = deq.to(torch.bfloat16)
        else:  # bf16 as published (the vision tower too); A_log float32
            v = t.float() if key.endswith("A_log") else t.to(torch.bfloat16)
            tensors[key] = v
            ref[key] = v
    # The multi-token-prediction head, which neither transformers class loads (fp8 among its tensors).
    g = torch.Generator().manual_seed(seed + 1)
    tensors["mtp.fc.weight"] = torch.randn(256, 512, generator=g).to(FP8)
    tensors["mtp.fc.weight_scale_inv"] = torch.ones(2, 4, dtype=torch.bfloat16)
    tensors["mtp.norm.weight"] = torch.ones(256, dtype=torch.bfloat16)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    config = _wrapper_config().to_dict()
    config["architectures"] = ["Qwen3_5MoeForConditionalGeneration"]
    config["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": list(BLOCK),
        "modules_to_not_convert": _not_converted(TEXT["num_hidden_layers"]),
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return ref


def _text_state(ref: dict) -> dict:
    """The wrapper-keyed reference under Qwen3_5MoeForCausalLM's keys (transformers' PrefixChange)."""
    return {
        ("model." + k[len(PREFIX) :] if k.startswith(PREFIX) else k): v
        for k, v in ref.items()
        if k.startswith((PREFIX, "lm_head."))
    }


def _meta_model():
    from transformers import Qwen3_5MoeForCausalLM

    with torch.device("meta"):
        return Qwen3_5MoeForCausalLM(_config()).eval()


def _reference(ref_state: dict):
    from transformers import Qwen3_5MoeForCausalLM

    # Built in float32 and given the file's tensors (assign): the rotary inv_freq stays float32, as
    # from_pretrained keeps it (a model.to(bf16) would round it and move the attention layers' outputs).
    model = Qwen3_5MoeForCausalLM(_config()).eval()
    missing, unexpected = model.load_state_dict(_text_state(ref_state), strict=False, assign=True)
    assert not unexpected and all("inv_freq" in k for k in missing), (missing, unexpected)
    return model


def _logits(model, seed: int = 5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, TEXT["vocab_size"], (2, 11), generator=g)
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


@pytest.fixture(scope="module")
def qwen36_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen36") / "Qwen3.6-35B-A3B-FP8-tiny"
    return folder, write_qwen36_fp8(folder)


@pytest.mark.parametrize("env", list(ENVS))
def test_qwen36_fp8_layout_loads_into_a_meta_model_exactly(qwen36_folder, env, caplog):
    folder, ref_state = qwen36_folder
    model = _meta_model()
    with caplog.at_level("INFO", logger="mpsboost"):
        report = mpsboost.load_fp8(model, folder, device=ENVS[env]())
    # The vision tower and the mtp head of the wrapper's file are skipped, as transformers skips them, and said so.
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        skipped = sum(k.startswith(("model.visual.", "mtp.")) for k in f.keys())  # noqa: SIM118 (a safe_open handle)
    assert skipped > 3
    assert f"{skipped} tensor(s) of Qwen3.6-35B-A3B-FP8-tiny are not part of this Qwen3_5MoeForCausalLM" in caplog.text
    rows = {r.target: r for r in report.rows if r.recipe == "fp8_weights" and r.status == "applied"}
    # Per linear-attention layer: in_proj_qkv, in_proj_z, out_proj; per full-attention layer q/k/v/o; per
    # layer the shared expert's three projections and the experts module.
    layers = TEXT["num_hidden_layers"]
    want = set()
    for i in range(layers):
        p = f"model.layers.{i}."
        if i % TEXT["full_attention_interval"] == TEXT["full_attention_interval"] - 1:
            want |= {p + f"self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
        else:
            want |= {p + f"linear_attn.{n}" for n in ("in_proj_qkv", "in_proj_z", "out_proj")}
        want |= {p + f"mlp.shared_expert.{n}" for n in ("gate_proj", "up_proj", "down_proj")} | {p + "mlp.experts"}
    assert set(rows) == want
    assert {r.details["granularity"] for r in rows.values()} == {"block"}
    assert {tuple(r.details["block"]) for r in rows.values()} == {BLOCK}
    assert {r.details["format"] for r in rows.values()} == {"transformers-fp8"}
    want_storage = "uint8" if env == "mps-2.14.1" else "float8"
    assert {r.details["storage"] for r in rows.values()} == {want_storage}
    experts = rows["model.layers.0.mlp.experts"].backing
    assert experts.startswith("block-scaled fp8 128x128: ") and "dequantise only the hit experts" in experts
    # On a Mac (2.14 and 2.15 decisions alike) decode runs mpsboost's Metal kernel with the block scales in it.
    assert ("mpsboost's Metal fp8 grouped GEMV" in experts) == env.startswith("mps"), experts
    qkv = rows["model.layers.0.linear_attn.in_proj_qkv"].backing
    assert ("mpsboost's Metal fp8 GEMV, the block scales applied in it" in qkv) == env.startswith("mps"), qkv
    # Module classes: the fp8 layers print as what they are, the bf16 ones stay stock.
    la = model.model.layers[0].linear_attn
    assert type(la.in_proj_qkv).__name__ == "FP8Linear" and type(la.out_proj).__name__ == "FP8Linear"
    assert type(la.in_proj_a) is torch.nn.Linear and la.in_proj_a.weight.dtype == torch.bfloat16
    mlp = model.model.layers[0].mlp
    assert type(mlp.gate).__name__ == "Qwen3_5MoeTopKRouter" and mlp.gate.weight.dtype == torch.bfloat16
    assert type(mlp.shared_expert_gate) is torch.nn.Linear and type(mlp.experts).__name__ == "FP8Qwen3_5MoeExperts"
    assert model.model.layers[0].linear_attn.A_log.dtype == torch.float32
    assert type(model.lm_head) is torch.nn.Linear and model.lm_head.weight.dtype == torch.bfloat16
    # Stacked like transformers' converter: [E, 2I, H] gate rows first; block scales kept, not folded.
    codes = mlp.experts.gate_up_proj
    assert codes.shape == (4, 256, 256) and codes.dtype == (torch.uint8 if want_storage == "uint8" else FP8)
    assert mlp.experts.gate_up_proj_scale.shape == (4, 2, 2) and mlp.experts.down_proj_scale.shape == (4, 2, 1)
    assert mlp.shared_expert.gate_proj.weight_scale.shape == (2, 2)  # 192 rows: one whole and one ragged block
    assert not any(t.device.type == "meta" for t in list(model.parameters()) + list(model.buffers()))
    ref = _reference(ref_state)
    got, want_logits = _logits(model), _logits(ref)
    # The same bf16 weight values through the same ops (block dequantisation rounds code x scale once, as
    # the reference does; the routed experts run per expert in transformers' own order): equal, not close.
    assert got.dtype == want_logits.dtype and torch.equal(got, want_logits), (
        (got - want_logits).norm() / want_logits.norm()
    ).item()


def test_qwen36_fp8_every_dense_layer_holds_the_files_codes(qwen36_folder):
    folder, _ = qwen36_folder
    model = _meta_model()
    mpsboost.load_fp8(model, folder, device="cpu")
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        for key in (
            "layers.0.linear_attn.in_proj_qkv",
            "layers.3.self_attn.q_proj",
            "layers.1.mlp.shared_expert.down_proj",
        ):
            mod = model.model.get_submodule(key)
            assert torch.equal(mod.weight.view(torch.uint8), f.get_tensor(PREFIX + key + ".weight").view(torch.uint8))
            assert torch.equal(mod.weight_scale, f.get_tensor(PREFIX + key + ".weight_scale_inv").float())
        ex = model.model.layers[2].mlp.experts
        for e in range(TEXT["num_experts"]):
            g = f.get_tensor(f"{PREFIX}layers.2.mlp.experts.{e}.gate_proj.weight").view(torch.uint8)
            u = f.get_tensor(f"{PREFIX}layers.2.mlp.experts.{e}.up_proj.weight").view(torch.uint8)
            assert torch.equal(ex.gate_up_proj[e].view(torch.uint8), torch.cat([g, u]))


def test_qwen36_fp8_file_with_a_mislabelled_module_is_refused(qwen36_folder, tmp_path):
    """A module the published config keeps in bf16 but the file holds as fp8 (a broken export) is refused."""
    from safetensors.torch import load_file, save_file

    folder, _ = qwen36_folder
    bad = tmp_path / "bad"
    bad.mkdir()
    tensors = load_file(str(folder / "model.safetensors"))
    key = PREFIX + "layers.0.mlp.shared_expert_gate.weight"
    q, s = quant_block(tensors[key].float())
    tensors[key], tensors[key + "_scale_inv"] = q, s
    save_file(tensors, str(bad / "model.safetensors"))
    (bad / "config.json").write_text((folder / "config.json").read_text())
    model = _meta_model()
    with pytest.raises(Fp8MismatchError, match="shared_expert_gate.*modules_to_not_convert"):
        mpsboost.load_fp8(model, bad, device="cpu")
    assert all(t.device.type == "meta" for t in model.parameters())


# ------------------------------------------------------------------------------------------ memory while loading

_MEM_SCRIPT = """
import json, sys, torch
import mpsboost
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024

cfg = Qwen3_5MoeTextConfig(**json.loads(sys.argv[2]))
with torch.device("meta"):
    model = Qwen3_5MoeForCausalLM(cfg)
mpsboost.load_fp8(model, sys.argv[1], device="cpu", lossless_recipes=False)  # warm-up: imports, first-call costs
del model
with torch.device("meta"):
    model = Qwen3_5MoeForCausalLM(cfg)
with open("/proc/self/clear_refs", "w") as fh:
    fh.write("5")  # resets the peak resident set size (VmHWM) to the current one
base = rss("VmRSS:")
mpsboost.load_fp8(model, sys.argv[1], device="cpu", lossless_recipes=False)
print(json.dumps({"base": base, "peak": rss("VmHWM:"), "after": rss("VmRSS:")}))
"""

_MEM_TEXT = {
    **TEXT,
    "vocab_size": 32000,
    "hidden_size": 1024,
    "num_experts": 32,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 128,
}


def _write_random_qwen36(folder: Path) -> tuple[int, int]:
    """The published layout with random codes and scales, from the meta model's shapes (no bf16 model):
    (file bytes, bytes of the largest tensor as loaded)."""
    from safetensors.torch import save_file
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    with torch.device("meta"):
        model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**_MEM_TEXT))
    g = torch.Generator().manual_seed(0)
    fp8_linears = {
        n
        for n, m in model.named_modules()
        if type(m) is torch.nn.Linear and n != "lm_head" and not n.endswith(_BF16_LINEARS)
    }
    tensors, largest = {}, 0

    def codes(n, k):
        q = torch.randint(0, 0x7E, (n, k), generator=g, dtype=torch.uint8).view(FP8)  # no NaN codes
        s = (torch.rand(-(-n // BLOCK[0]), -(-k // BLOCK[1]), generator=g) * 1e-3).to(torch.bfloat16)
        return q, s

    for key, p in model.state_dict().items():
        fkey = key if key.startswith("lm_head") else PREFIX + key[len("model.") :]
        if key.rsplit(".", 1)[0] in fp8_linears:
            tensors[fkey], tensors[fkey + "_scale_inv"] = codes(*p.shape)
            largest = max(largest, p.numel())
        elif key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            base = fkey.rsplit(".", 1)[0]
            e, n, k = p.shape
            subs = ("gate_proj", "up_proj") if key.endswith("gate_up_proj") else ("down_proj",)
            for i in range(e):
                for sub in subs:
                    tensors[f"{base}.{i}.{sub}.weight"], tensors[f"{base}.{i}.{sub}.weight_scale_inv"] = codes(
                        n // len(subs), k
                    )
            largest = max(largest, p.numel())
        else:
            tensors[fkey] = (torch.randn(tuple(p.shape), generator=g) * 0.02).to(torch.bfloat16)
            largest = max(largest, 2 * p.numel())
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Qwen3_5MoeForConditionalGeneration"],
                "model_type": "qwen3_5_moe",
                "text_config": _MEM_TEXT,
                "quantization_config": {
                    "quant_method": "fp8",
                    "weight_block_size": list(BLOCK),
                    "activation_scheme": "dynamic",
                    "modules_to_not_convert": _not_converted(_MEM_TEXT["num_hidden_layers"]),
                },
            }
        )
    )
    return (folder / "model.safetensors").stat().st_size, largest


@pytest.mark.slow
def test_qwen36_layout_loads_within_file_plus_largest_layer(tmp_path):
    import os
    import subprocess
    import sys

    size, largest = _write_random_qwen36(tmp_path / "big")
    assert size > 200 * 2**20
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(Path(mpsboost.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
        PYTHONWARNINGS="ignore",
    )
    out = subprocess.run(
        [sys.executable, "-c", _MEM_SCRIPT, str(tmp_path / "big"), json.dumps(_MEM_TEXT)],
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
        f"peak over baseline {peak / 2**20:.1f} MiB"
    )
    assert peak <= size + largest + margin, (peak, size, largest)


def test_qwen36_fp8_loads_into_the_multimodal_wrapper_built_from_the_published_config(qwen36_folder):
    """The file's own class, built as a user would from its config.json (``AutoConfig`` -> the wrapper):
    keys match as they are; the bf16 vision tower is read, the mtp head is not; text logits equal the
    stock wrapper holding the exact dequantisation."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    folder, ref_state = qwen36_folder
    cfg = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(cfg).eval()
    assert type(model).__name__ == "Qwen3_5MoeForConditionalGeneration"
    report = mpsboost.load_fp8(model, folder, device="cpu")
    rows = [r for r in report.rows if r.recipe == "fp8_weights" and r.status == "applied"]
    assert rows and all(r.target.startswith(PREFIX) for r in rows)
    assert not any(r.target.startswith("model.visual") for r in rows)
    assert model.model.visual.blocks[0].attn.qkv.weight.dtype == torch.bfloat16
    ref = type(model)(_wrapper_config()).eval()
    missing, unexpected = ref.load_state_dict(ref_state, strict=False, assign=True)
    assert not unexpected and all("inv_freq" in k for k in missing), (missing, unexpected)
    got, want = _logits(model), _logits(ref)
    assert torch.equal(got, want), ((got - want).norm() / want.norm()).item()


def _decode_logits(model, steps: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(0, TEXT["vocab_size"], (1, 11), generator=g)
    outs = []
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        for _ in range(steps):
            nxt = out.logits[:, -1:].argmax(-1)
            out = model(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True)
            outs.append(out.logits.float())
    return outs


@pytest.mark.parametrize("ver", ["2.15.0", "2.14.1"])
def test_qwen36_fp8_decodes_on_the_metal_kernel_with_the_files_block_scales(qwen36_folder, ver):
    # The published layout as it is (128x128 block scales, in_proj_b/a in bf16 beside fp8 in_proj_qkv/z): a Mac's
    # decode steps run mpsboost's Metal GEMV with the block scales applied in it (here its reference operators),
    # every lossless recipe on. Against the file's exact dequantisation run by transformers' own code: the same
    # weight values, only the order of the bf16/fp32 sums differs (stated bound: 2e-2 of the logits' norm).
    from mpsboost.bench import ModuleOps

    folder, ref_state = qwen36_folder
    model = _meta_model()
    report = mpsboost.load_fp8(model, folder, device=Env.simulate("mps", ver))
    assert {"linear_attention", "moe_block"} <= {r.recipe for r in report.applied}
    ref = _reference(ref_state)
    with ModuleOps() as seen:
        got = _decode_logits(model)
    want = _decode_logits(ref)
    for a, b in zip(got, want):
        assert ((a - b).norm() / b.norm()).item() < 2e-2
    # Every fp8 projection one call of the block GEMV, the experts two grouped calls: no layer dequantised.
    assert {"fp8_block_gemv", "fp8_block_gemv_out", "grouped_mm"} <= set(seen.bare), set(seen.bare)
    assert "_to_copy" not in {n for n in seen.bare if n.startswith("fp8")}


def test_qwen36_fp8_file_decode_step_ops_within_1_1x_of_patched_bf16(qwen36_folder):
    # Issue 28's op target on the published layout as it is, Mac 2.15.0 decisions, every recipe on both sides.
    from mpsboost.bench.decode_cost import decode_cost

    folder, ref_state = qwen36_folder
    mac = Env.simulate("mps", "2.15.0")
    model = _meta_model()
    mpsboost.load_fp8(model, folder, device=mac)
    bf = _reference(ref_state).to(torch.bfloat16)
    mpsboost.patch(bf, device=mac)
    fp8_ops, bf16_ops = (decode_cost(m, TEXT["vocab_size"])["ops"] for m in (model, bf))
    assert sum(fp8_ops.values()) <= 1.1 * sum(bf16_ops.values()), (fp8_ops, bf16_ops)
    # in_proj_b/in_proj_a kept in bf16 beside fp8 in_proj_qkv/z: one copy side by side, as the bf16 step has them.
    assert fp8_ops["linear_attn"] == bf16_ops["linear_attn"], (fp8_ops, bf16_ops)
    assert fp8_ops["self_attn"] == bf16_ops["self_attn"], (fp8_ops, bf16_ops)
