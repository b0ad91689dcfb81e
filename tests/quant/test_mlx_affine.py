"""MLX affine checkpoints, written by mlx-lm itself, loaded by ``mpsboost.from_pretrained``: the same numbers as
mlx-lm's own forward of the same folder (float32 logits within 1e-4 relative, greedy tokens equal over 32 steps)
for every family, and the bits / group / scale-dtype grid on two of them."""

from __future__ import annotations

import json

import pytest
import torch

import mpsboost
from mpsboost.bench import relative_error
from conftest import (
    FAMILIES,
    mlx_greedy,
    mlx_logits,
    mlx_model,
    needs_mlx,
    torch_greedy,
    write_mlx,
)
from mpsboost.quant import codec
from mpsboost.recipes.low_bit.layers import affine_state
from mpsboost.quant.errors import QuantFileError, QuantMismatchError

pytestmark = needs_mlx
TOL = 1e-4


def _ids(n: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def _load(folder, **kw):
    return mpsboost.from_pretrained(folder, dtype=torch.float32, device="cpu", **kw)


def _same_as_mlx(folder, model, *, steps: int = 32) -> float:
    mm = mlx_model(folder)
    ids = _ids()
    with torch.no_grad():
        got = model(ids).logits
    err = relative_error(got, mlx_logits(mm, ids))
    assert err <= TOL, f"logits differ from mlx-lm's by {err:.2e} (tolerance {TOL})"
    if steps:
        a, b = [], []
        assert torch_greedy(model, ids, steps, a) == mlx_greedy(mm, ids, steps, b)
        dec = relative_error(a[0], b[0])  # the last decode step's logits (one token, through the caches)
        assert dec <= TOL, f"decode logits differ from mlx-lm's by {dec:.2e} (tolerance {TOL})"
    return err


# ------------------------------------------------------------------------------------------ the code itself


@pytest.mark.parametrize("bits", codec.BITS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_quantize_and_dequantize_equal_mlx_bit_for_bit(bits, dtype):
    import mlx.core as mx
    import numpy as np

    g = torch.Generator().manual_seed(bits)
    for group in codec.GROUP_SIZES:
        w = torch.randn(6, 256, generator=g) * 0.05
        w[0, :group] = 0.0  # a constant group: scale eps, bias 0
        w[1, :group] = 1.5  # constant, nonzero: q0 == 0 branch
        w[2, :group] = torch.linspace(-1.0, 3.0, group)  # |max| > |min|: the negated scale
        w[3, :group] = torch.linspace(-3.0, 1.0, group)
        w = w.to(getattr(torch, dtype))
        mw = mx.array(w.float().numpy()).astype(getattr(mx, dtype))
        mq, ms, mb = mx.quantize(mw, group_size=group, bits=bits)
        before = w.clone()
        q, s, b = codec.quantize(w, bits, group)
        assert torch.equal(w, before), "quantize changed the weight it was given"  # it works in its own copy
        assert np.array_equal(np.array(mq).view(np.uint32), q.view(torch.int32).numpy().view(np.uint32)), (bits, group)
        assert torch.equal(torch.from_numpy(np.array(ms.astype(mx.float32))), s.float())
        assert torch.equal(torch.from_numpy(np.array(mb.astype(mx.float32))), b.float())
        md = mx.dequantize(mq, ms, mb, group_size=group, bits=bits)
        d = codec.dequantize(q, s, b, bits, group)
        assert torch.equal(torch.from_numpy(np.array(md.astype(mx.float32))), d.float())
        assert torch.equal(codec.pack(codec.unpack(q, bits), bits).view(torch.int32), q.view(torch.int32))


# ------------------------------------------------------------------------------------------ every family


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_computes_what_mlx_lm_computes(family, tmp_path):
    write_mlx(family, tmp_path)
    model = _load(tmp_path)
    assert type(model).__name__ == FAMILIES[family][1]
    _same_as_mlx(tmp_path, model)
    rows = mpsboost.last_report(model).rows_for("low_bit_weights")
    assert rows and all(r.status == "applied" for r in rows)
    # the experts' stacks stay quantized: uint32 codes, no floating copy
    for name, mod in model.named_modules():
        if name.endswith("mlp.experts"):
            assert mod.gate_up_proj.dtype == torch.uint32 and mod.down_proj.dtype == torch.uint32
            assert "Affine" in type(mod).__name__


@pytest.mark.parametrize("family", ["olmoe", "qwen3_moe"])
def test_the_low_bit_layers_alone_compute_what_mlx_lm_computes(family, tmp_path):
    """patch=False: no other recipe, so the low-bit layers' own forwards run every step (the experts' per-pair decode
    path and their hit-experts prefill path)."""
    write_mlx(family, tmp_path)
    model = _load(tmp_path, patch=False)
    assert mpsboost.last_report(model).recipes("applied") == ["low_bit_weights"]
    _same_as_mlx(tmp_path, model)


@pytest.mark.parametrize(
    "bits,group_size,dtype",
    [(4, 32, "float32"), (4, 128, "bfloat16"), (8, 32, "float16"), (8, 64, "float32"), (8, 128, "bfloat16")],
)
def test_bits_groups_and_scale_dtypes(bits, group_size, dtype, tmp_path):
    write_mlx("qwen3_5_moe", tmp_path, bits=bits, group_size=group_size, dtype=dtype, hidden_size=128)
    model = _load(tmp_path)
    lin = model.model.layers[0].linear_attn.in_proj_qkv
    assert lin.scales.dtype == getattr(torch, dtype)  # the file's dtype, kept
    assert lin.weight.shape[-1] == 128 * bits // 32 and lin.scales.shape[-1] == 128 // group_size
    _same_as_mlx(tmp_path, model, steps=8)


@pytest.mark.parametrize("bits", [2, 3, 5, 6])
def test_the_other_bit_widths(bits, tmp_path):
    write_mlx("qwen3_moe", tmp_path, bits=bits, group_size=64)
    _same_as_mlx(tmp_path, _load(tmp_path), steps=0)


def test_mixed_bits_per_module(tmp_path):
    """mlx-lm's mixed recipes give some modules more bits (config.json names each); routers at 8 by default."""

    def predicate(path, module):
        if "down_proj" in path or "v_proj" in path or "lm_head" in path:
            return {"group_size": 32, "bits": 8}
        if path.endswith("mlp.gate"):
            return {"group_size": 64, "bits": 8}
        return {"group_size": 64, "bits": 4}

    write_mlx("qwen3_moe", tmp_path, predicate=predicate)
    q = json.loads((tmp_path / "config.json").read_text())["quantization"]
    assert q["model.layers.0.mlp.switch_mlp.down_proj"]["bits"] == 8
    model = _load(tmp_path)
    experts = model.model.layers[0].mlp.experts
    state = affine_state(experts)
    assert (state.params["down_proj"].bits, state.params["gate_up_proj"].bits) == (8, 4)
    assert affine_state(model.lm_head).params["weight"].group_size == 32
    _same_as_mlx(tmp_path, model, steps=8)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5_moe"])
def test_tied_embeddings_serve_as_the_head(family, tmp_path):
    write_mlx(family, tmp_path, tie_word_embeddings=True)
    model = _load(tmp_path)
    emb, head = model.get_input_embeddings(), model.lm_head
    assert head.weight is emb.weight and head.scales is emb.scales  # one copy of the codes
    _same_as_mlx(tmp_path, model, steps=8)


# ------------------------------------------------------------------------------------------ errors


def _rewrite(folder, drop=(), config=None):
    from safetensors.torch import load_file, save_file

    f = folder / "model.safetensors"
    sd = {k: v for k, v in load_file(str(f)).items() if k not in drop}
    save_file(sd, str(f), metadata={"format": "mlx"})
    idx = json.loads((folder / "model.safetensors.index.json").read_text())
    idx["weight_map"] = {k: v for k, v in idx["weight_map"].items() if k not in drop}
    (folder / "model.safetensors.index.json").write_text(json.dumps(idx))
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))


def test_a_missing_key_is_named(tmp_path):
    write_mlx("qwen3", tmp_path)
    _rewrite(tmp_path, drop=("model.layers.1.self_attn.k_norm.weight",))
    with pytest.raises(QuantMismatchError, match=r"model\.layers\.1\.self_attn\.k_norm\.weight"):
        _load(tmp_path)


def test_a_file_tensor_with_no_place_is_named(tmp_path):
    write_mlx("qwen3", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["num_hidden_layers"] = 1
    cfg["layer_types"] = cfg.get("layer_types", ["full_attention"])[:1]
    _rewrite(tmp_path, config=cfg)
    with pytest.raises(QuantMismatchError, match=r"model\.layers\.1\."):
        _load(tmp_path)


@pytest.mark.parametrize(
    "edit,field",
    [
        (lambda c: c.update(model_type="llama4"), "model_type='llama4'"),
        (lambda c: c["quantization"].update(mode="mxfp4"), "quantization.mode='mxfp4'"),
        (lambda c: c["quantization"].update({"model.layers.0.mlp.gate_proj": {"bits": 4, "scale": 2}}), "unknown key"),
        (
            lambda c: c["quantization"].update({"model.layers.0.self_attn.q_proj": {"bits": 8, "group_size": 64}}),
            r"quantization\['model.layers.0.self_attn.q_proj'\] says bits=8",
        ),
        (lambda c: c["quantization"].pop("bits"), "quantization.bits is missing"),
    ],
)
def test_a_config_field_that_cannot_be_read_is_named(edit, field, tmp_path):
    write_mlx("qwen3", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    edit(cfg)
    _rewrite(tmp_path, config=cfg)
    with pytest.raises(QuantMismatchError, match=field):
        _load(tmp_path)


def test_a_folder_of_no_known_format(tmp_path):
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    with pytest.raises(QuantFileError, match="no known low-bit format"):
        _load(tmp_path)


def test_a_failure_halfway_leaves_nothing_patched(tmp_path, monkeypatch):
    """A read failing at the 20th tensor: every step made so far is undone (the model built for the load is back to
    its meta tensors and classes), and the error says nothing was returned."""
    from mpsboost.quant import io, load

    write_mlx("qwen3_moe", tmp_path)
    built = []
    real_build, real_read = load.build_meta_model, io.read_tensor
    monkeypatch.setattr(load, "build_meta_model", lambda *a, **k: built.append(real_build(*a, **k)) or built[-1])
    calls = [0]

    def failing(entry, out=None):
        calls[0] += 1
        if calls[0] == 20:
            raise OSError("disk went away")
        return real_read(entry, out)

    monkeypatch.setattr(io, "read_tensor", failing)
    monkeypatch.setattr("mpsboost.quant.formats.read_tensor", failing)
    with pytest.raises(QuantFileError, match="disk went away.*nothing was returned"):
        _load(tmp_path)
    (model,) = built
    assert calls[0] == 20
    assert all(t.device.type == "meta" for t in model.parameters())
    assert not any("Affine" in type(m).__name__ for m in model.modules())
    assert not any("_mpsboost_patches" in m.__dict__ and m.__dict__["_mpsboost_patches"] for m in model.modules())


def test_unpatch_says_to_reload_and_print_shows_the_codes(tmp_path):
    write_mlx("qwen3_moe", tmp_path)
    model = _load(tmp_path)
    with pytest.raises(mpsboost.IrreversiblePatchError, match="from_pretrained"):
        mpsboost.unpatch(model)
    text = repr(model.model.layers[0].self_attn.q_proj)
    assert "affine 4-bit g64" in text and "AffineLinear" in text
