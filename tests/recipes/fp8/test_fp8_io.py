"""mpsboost.save_fp8 / load_fp8: safetensors round trips, and every bad file refused by name with the
model left exactly as it was."""

from __future__ import annotations

import json
import struct

import pytest
import torch

import mpsboost
import tiny_models as tm
from mpsboost.checkpoints import Fp8FileError, Fp8MismatchError, Fp8StateError
from mpsboost.gate import Env

FP8 = torch.float8_e4m3fn


def _fp8_state(model) -> dict:
    """Every fp8 buffer of a patched model, as uint8 bits (float8 and uint8 storage compare equal)."""
    out = {}
    for name, b in model.named_buffers():
        if b.dtype in (FP8, torch.uint8):
            out[name] = b.view(torch.uint8)
        elif name.endswith("_scale"):
            out[name] = b
    return out


@pytest.fixture
def saved(tmp_path):
    model = tm.build("qwen3_moe", dtype="bfloat16", seed=0)
    mpsboost.patch(model, fp8="rowwise")
    path = mpsboost.save_fp8(model, tmp_path / "qwen3_moe.fp8.safetensors")
    return model, path


def test_round_trip_into_a_fresh_model_is_exact(saved, rng_seed):
    model, path = saved
    fresh = tm.build("qwen3_moe", dtype="bfloat16", seed=0)
    report = mpsboost.load_fp8(fresh, path)
    rows = [r for r in report.rows_for("fp8_weights") if r.status == "applied"]
    assert rows and all("experts" in r.target or r.target.endswith("_proj") for r in rows)
    a, b = _fp8_state(model), _fp8_state(fresh)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    seed = rng_seed % 1000
    # Same codes and scales; the loaded layers apply the scales in float32 and round once (the file's exact
    # dequantisation), the converted ones in bf16: the outputs agree to bf16 rounding.
    a_out, b_out = (
        tm.run("qwen3_moe", fresh, seed, dtype="bfloat16"),
        tm.run("qwen3_moe", model, seed, dtype="bfloat16"),
    )
    assert ((a_out - b_out).norm() / b_out.norm()).item() < 2e-2
    # The file is plain safetensors: any reader sees float8 codes, float32 scales and the metadata.
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        keys = list(f.keys())
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight").dtype == FP8
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight_scale").dtype == torch.float32
    assert (
        meta["format"] == "mpsboost.fp8"
        and meta["format_version"] == "2"
        and meta["granularity"] == "rowwise"
        and meta["mpsboost_version"]
    )
    modules = json.loads(meta["modules"])
    assert modules["model.layers.0.mlp.experts"]["kind"] == "experts"
    assert modules["model.layers.0.self_attn.q_proj"]["compute_dtype"] == "bfloat16"
    # A complete checkpoint: the layers kept in high precision are in the file too, with the config.
    assert "lm_head.weight" in keys and "model.norm.weight" in keys
    assert json.loads(meta["config"])["model_type"] == "qwen3_moe"


def test_load_into_a_converted_model_replaces_the_values(saved):
    model, path = saved
    other = tm.build("qwen3_moe", dtype="bfloat16", seed=3)
    mpsboost.patch(other, fp8="rowwise")
    q = other.model.layers[0].self_attn.q_proj.weight
    report = mpsboost.load_fp8(other, path)  # a report on a converted model too, not None
    assert report.rows and not [
        r for r in report.rows if r.recipe == "fp8_weights" and r.status == "applied"
    ]  # new values only
    assert other.model.layers[0].self_attn.q_proj.weight.dtype == q.dtype
    a, b = _fp8_state(model), _fp8_state(other)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_uint8_storage_saves_the_same_file_contents(tmp_path, saved):
    model, path = saved
    mps_like = tm.build("qwen3_moe", dtype="bfloat16", seed=0)
    mpsboost.patch(mps_like, fp8="rowwise", device=Env.simulate("mps", "2.14.1"))
    assert mps_like.model.layers[0].self_attn.q_proj.weight.dtype == torch.uint8
    other = mpsboost.save_fp8(mps_like, tmp_path / "u8.safetensors")
    from safetensors.torch import load_file

    x, y = load_file(str(path)), load_file(str(other))
    assert x.keys() == y.keys() and all(
        torch.equal(
            x[k].view(torch.uint8) if x[k].dtype == FP8 else x[k], y[k].view(torch.uint8) if y[k].dtype == FP8 else y[k]
        )
        for k in x
    )
    # And a converted uint8-storage model takes a file's values into its uint8 buffers.
    target = tm.build("qwen3_moe", dtype="bfloat16", seed=5)
    mpsboost.patch(target, fp8="rowwise", device=Env.simulate("mps", "2.14.1"))
    assert mpsboost.load_fp8(target, path).rows
    assert target.model.layers[1].mlp.experts.down_proj.dtype == torch.uint8
    a, b = _fp8_state(model), _fp8_state(target)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_pipeline_round_trip_keeps_component_paths(tmp_path):
    pipe = tm.build("wan22_ti2v_pipeline")
    mpsboost.patch(pipe, fp8="tensorwise")
    path = mpsboost.save_fp8(pipe, tmp_path / "wan")
    from safetensors import safe_open

    with safe_open(str(path / "transformer" / "model.fp8.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert json.loads(f.metadata()["architectures"])[""] == "WanTransformer3DModel"
    assert any(k.startswith("blocks.0.") for k in keys) and (path / "text_encoder" / "model.fp8.safetensors").is_file()
    # The VAE has no fp8 layer, and is written whole all the same (a complete checkpoint).
    assert (path / "vae" / "config.json").is_file()
    fresh = tm.build("wan22_ti2v_pipeline")
    mpsboost.load_fp8(fresh, path)
    assert torch.equal(
        fresh.transformer.blocks[0].ffn.net[2].weight.view(torch.uint8),
        pipe.transformer.blocks[0].ffn.net[2].weight.view(torch.uint8),
    )


def test_saving_an_unconverted_model_says_what_to_do(tmp_path):
    with pytest.raises(Fp8StateError, match="fp8='rowwise'"):
        mpsboost.save_fp8(tm.build("qwen3"), tmp_path / "x.safetensors")
    assert not (tmp_path / "x.safetensors").exists()


# ------------------------------------------------------------------------------------------ bad files


def _rewrite(path, out, *, drop=None, replace=None, meta=None):
    """A copy of the safetensors file at ``path`` with tensors dropped/replaced or metadata changed."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        md = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    for k in drop or ():
        tensors.pop(k)
    for k, v in (replace or {}).items():
        tensors[k] = v
    md.update(meta or {})
    save_file(tensors, str(out), metadata=md)
    return out


Q = "model.layers.1.self_attn.o_proj.weight"
E = "model.layers.0.mlp.experts.gate_up_proj"


def _bad_files(path, tmp):
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        q, e = f.get_tensor(Q), f.get_tensor(E)
    yield (
        "wrong shape",
        Fp8MismatchError,
        _rewrite(path, tmp / "shape.safetensors", replace={Q: q[:, :-8].contiguous()}),
        "shape",
    )
    yield (
        "wrong dtype",
        Fp8MismatchError,
        _rewrite(path, tmp / "dtype.safetensors", replace={Q: q.to(torch.bfloat16)}),
        "dtype BF16",
    )
    yield (
        "missing tensor",
        Fp8MismatchError,
        _rewrite(path, tmp / "missing.safetensors", drop=[E + "_scale"]),
        "missing",
    )
    yield (
        "extra tensor",
        Fp8MismatchError,
        _rewrite(path, tmp / "extra.safetensors", replace={"foo.weight": q}),
        "foo.weight",
    )
    yield (
        "wrong experts shape",
        Fp8MismatchError,
        _rewrite(path, tmp / "experts.safetensors", replace={E: e[:, :-2].contiguous()}),
        E,
    )
    yield (
        "other version",
        Fp8FileError,
        _rewrite(path, tmp / "plain.safetensors", meta={"format_version": "7"}),
        "version '7'",
    )
    # Version 1 (written by unreleased development builds only) is one more version this mpsboost does not read.
    yield "version 1", Fp8FileError, _rewrite(path, tmp / "v1.safetensors", meta={"format_version": "1"}), "reads '2'"
    mods = tmp / "mods.safetensors"
    yield (
        "unknown module",
        Fp8MismatchError,
        _rewrite(
            path,
            mods,
            meta={
                "modules": json.dumps(
                    {"model.nope": {"kind": "linear", "tensors": ["weight"], "granularity": "rowwise"}}
                )
            },
        ),
        "model.nope",
    )
    pickle = tmp / "model.bin"
    torch.save({Q: q}, pickle)
    yield "pickle file", Fp8FileError, pickle, "not a readable safetensors file"
    trunc = tmp / "trunc.safetensors"
    data = path.read_bytes()
    trunc.write_bytes(data[: len(data) - 100])
    yield "truncated", Fp8FileError, trunc, "truncated"
    hdr = tmp / "header.safetensors"
    hdr.write_bytes(struct.pack("<Q", 12) + b"{not json!!" + b" " + data[8:])
    yield "broken header", Fp8FileError, hdr, "JSON"


def test_every_bad_file_is_refused_by_name_and_changes_nothing(saved, tmp_path):
    _, path = saved
    cases = list(_bad_files(path, tmp_path))
    assert len(cases) == 11
    for label, err, bad, words in cases:
        target = tm.build("qwen3_moe", dtype="bfloat16", seed=1)
        before = tm.snapshot(target)
        with pytest.raises(err) as info:
            mpsboost.load_fp8(target, bad)
        msg = str(info.value)
        assert bad.name in msg and words in msg, (label, msg)
        assert not tm.diff_snapshot(before, tm.snapshot(target)), label
        assert not mpsboost.api.is_patched(target), label


def test_a_converted_model_with_other_scales_is_refused(saved, tmp_path):
    _, path = saved
    target = tm.build("qwen3_moe", dtype="bfloat16", seed=1)
    mpsboost.patch(target, fp8="tensorwise")
    before = tm.snapshot(target)
    with pytest.raises(Fp8MismatchError, match="other scales"):
        mpsboost.load_fp8(target, path)
    assert not tm.diff_snapshot(before, tm.snapshot(target))


def test_missing_file_and_bad_path_type():
    model = tm.build("qwen3_moe")
    with pytest.raises(FileNotFoundError, match="nope.safetensors"):
        mpsboost.load_fp8(model, "/nonexistent/nope.safetensors")
    with pytest.raises(TypeError, match="os.PathLike"):
        mpsboost.load_fp8(model, 42)


# ---------------------------------------------------------------------------------- plain loaders refuse a saved folder


def _plain_load_refused(load, folder) -> str:
    with pytest.raises((OSError, ValueError)) as err:
        load(folder)
    return str(err.value)


@pytest.mark.parametrize("granularity", ["rowwise", "tensorwise"])
def test_plain_transformers_from_pretrained_of_a_saved_folder_refuses(tmp_path, granularity):
    """Before: config.json + model.safetensors, and AutoModelForCausalLM.from_pretrained built a bf16 model
    that read the fp8 codes as weights (logits 1.39 relative away). Now it raises, naming load_fp8."""
    import warnings

    from transformers import AutoModelForCausalLM, Qwen3MoeForCausalLM

    model = tm.build("qwen3_moe", dtype="bfloat16", seed=0)
    mpsboost.patch(model, fp8=granularity)
    folder = mpsboost.save_fp8(model, tmp_path / "ck", max_shard_size="60KB" if granularity == "tensorwise" else "5GB")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for load in (
            AutoModelForCausalLM.from_pretrained,
            Qwen3MoeForCausalLM.from_pretrained,
            lambda f: AutoModelForCausalLM.from_pretrained(f, dtype=torch.bfloat16),
        ):
            assert "mpsboost.load_fp8" in _plain_load_refused(load, folder)
    # mpsboost reads the folder all the same, into a model built without weights: the saved model's output.
    with torch.device("meta"):
        fresh = AutoModelForCausalLM.from_config(model.config).eval()
    mpsboost.load_fp8(fresh, folder, device="cpu", lossless_recipes=False)
    a, b = _fp8_state(model), _fp8_state(fresh)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    x, y = tm.run("qwen3_moe", fresh, 3, dtype="bfloat16"), tm.run("qwen3_moe", model, 3, dtype="bfloat16")
    assert ((x - y).norm() / y.norm()).item() < 2e-2  # same codes and scales; bf16 rounding of the two forwards


def test_plain_diffusers_from_pretrained_of_a_saved_folder_refuses(tmp_path):
    import warnings

    from diffusers import WanTransformer3DModel as cls

    tr = tm.build("wan_transformer", dtype="bfloat16")
    mpsboost.patch(tr, fp8="rowwise")
    folder = mpsboost.save_fp8(tr, tmp_path / "transformer")
    assert json.loads((folder / "config.json").read_text())["_class_name"] == "WanTransformer3DModel"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert "mpsboost.load_fp8" in _plain_load_refused(cls.from_pretrained, folder)
        assert "mpsboost.load_fp8" in _plain_load_refused(
            lambda f: cls.from_pretrained(f, torch_dtype=torch.bfloat16), folder
        )
        from diffusers import AutoModel

        assert "mpsboost.load_fp8" in _plain_load_refused(AutoModel.from_pretrained, folder)


def test_a_folder_of_the_earlier_layout_still_loads(tmp_path):
    """Folders written before the guard (model.safetensors, no decoy index) stay readable by load_fp8."""
    model = tm.build("qwen3", dtype="bfloat16", seed=0)
    mpsboost.patch(model, fp8="rowwise")
    folder = mpsboost.save_fp8(model, tmp_path / "ck")
    (folder / "model.fp8.safetensors").rename(folder / "model.safetensors")
    for name in ("model.safetensors.index.json", "diffusion_pytorch_model.safetensors.index.json"):
        (folder / name).unlink()
    fresh = tm.build("qwen3", dtype="bfloat16", seed=1)
    mpsboost.load_fp8(fresh, folder, device="cpu", lossless_recipes=False)
    a, b = _fp8_state(model), _fp8_state(fresh)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
