"""Both directions: mpsboost's quantiser writes mlx-lm's codes bit for bit (quantize-at-load of a bf16/fp32
checkpoint against mlx-lm's own conversion of the same weights), and mlx-lm's forward of the folder mpsboost saves
equals mpsboost's (1e-4 relative, greedy tokens equal)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import mpsboost
from conftest import hf_model, mlx_greedy, mlx_logits, mlx_model, needs_mlx, torch_greedy, write_mlx
from mpsboost.bench import relative_error
from mpsboost.recipes.low_bit.layers import affine_state
from mpsboost.quant.save import _family

pytestmark = needs_mlx


def _ids():
    return torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("family,bits,group_size", [("qwen3_5_moe", 4, 64), ("mixtral", 8, 32), ("qwen3", 4, 128)])
def test_quantize_at_load_writes_mlx_lms_codes(family, bits, group_size, tmp_path):
    """The same tiny model converted by mlx-lm and quantised by mpsboost while it is read: every quantized tensor
    mlx-lm wrote (codes, scales, biases) is the one mpsboost holds, bit for bit, the experts' stacks included."""
    over = {"hidden_size": 128} if group_size == 128 else {}
    write_mlx(family, tmp_path / "mlx", bits=bits, group_size=group_size, **over)
    hf = hf_model(family, **over)
    hf.save_pretrained(tmp_path / "hf")
    model = mpsboost.from_pretrained(
        tmp_path / "hf", dtype=torch.float32, device="cpu", quantize={"bits": bits, "group_size": group_size}
    )
    ref = load_file(str(tmp_path / "mlx" / "model.safetensors"))
    fam = _family(model)
    compared = 0
    for name, mod in model.named_modules():
        state = affine_state(mod)
        if state is None:
            continue
        if state.kind == "experts":
            pre = fam.to_file_key(name.rsplit(".experts", 1)[0] + ".")[:-1] + ".switch_mlp"
            for sfx, ours in (("weight", mod.gate_up_proj), ("scales", mod.gate_up_proj_scales)):
                gate, up = ours.chunk(2, dim=1)
                assert torch.equal(ref[f"{pre}.gate_proj.{sfx}"].view(torch.int32), gate.contiguous().view(torch.int32))
                assert torch.equal(ref[f"{pre}.up_proj.{sfx}"].view(torch.int32), up.contiguous().view(torch.int32))
            assert torch.equal(ref[f"{pre}.down_proj.biases"], mod.down_proj_biases)
            compared += 1
            continue
        fm = fam.to_file_key(name + ".")[:-1]
        if f"{fm}.scales" not in ref or name.endswith("shared_expert_gate"):
            continue
        assert torch.equal(ref[f"{fm}.weight"].view(torch.int32), mod.weight.view(torch.int32)), name
        assert torch.equal(ref[f"{fm}.scales"], mod.scales) and torch.equal(ref[f"{fm}.biases"], mod.biases), name
        compared += 1
    assert compared >= 8


@pytest.mark.parametrize("family", ["qwen3_5_moe", "mixtral", "qwen2_moe"])
def test_mlx_lm_computes_what_mpsboost_computes_from_the_saved_folder(family, tmp_path):
    hf = hf_model(family)
    hf.save_pretrained(tmp_path / "hf")
    model = mpsboost.from_pretrained(tmp_path / "hf", dtype=torch.float32, device="cpu", quantize={"bits": 4})
    out = mpsboost.save_mlx(model, tmp_path / "mlx")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization"]["bits"] == 4 and cfg["quantization_config"] == cfg["quantization"]
    mm = mlx_model(out)  # mlx-lm's own loader (strict: every tensor it expects is there, nothing more)
    ids = _ids()
    with torch.no_grad():
        ours = model(ids).logits
    assert relative_error(ours, mlx_logits(mm, ids)) <= 1e-4
    assert torch_greedy(model, ids, 32) == mlx_greedy(mm, ids, 32)
    # and mpsboost reads its own folder back to the same numbers
    again = mpsboost.from_pretrained(out, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        assert torch.equal(again(ids).logits, ours)


def test_patch_quantizes_in_memory_to_the_same_codes(tmp_path):
    """patch(recipes=["low_bit_weights"]) on a model with weights: the codes of quantize-at-load, the same logits."""
    hf = hf_model("qwen3_moe")
    hf.save_pretrained(tmp_path / "hf")
    loaded = mpsboost.from_pretrained(tmp_path / "hf", dtype=torch.float32, device="cpu", quantize={"bits": 4})
    report = mpsboost.patch(
        hf, recipes=["low_bit_weights"], options={"low_bit_weights": {"bits": 4, "group_size": 64}}, device="cpu"
    )
    assert report.recipes("applied") == ["low_bit_weights"]
    q1 = hf.model.layers[0].self_attn.q_proj
    q2 = loaded.model.layers[0].self_attn.q_proj
    assert torch.equal(q1.weight.view(torch.int32), q2.weight.view(torch.int32))
    ids = _ids()
    with torch.no_grad():
        assert relative_error(hf(ids).logits, loaded(ids).logits) <= 1e-6
