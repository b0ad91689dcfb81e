"""mpsboost.bench.models: one table of the measured models, one loader of the shipped configs."""

from __future__ import annotations

import json

import pytest
import torch

from mpsboost.bench import BenchError
from mpsboost.bench.models import CONFIGS, MODELS, VIDEO_VAES, ZOO, ModelSpec, build, config, model_config, read_config


def test_every_shipped_config_is_json_and_names_its_source():
    files = sorted(CONFIGS.glob("*/*/*.json"))
    families = {p.parent.parent.name for p in files}
    assert {"wan22_ti2v", "qwen_image", "qwen3_moe", "qwen3_dense", "qwen3_5_moe"} <= families
    for path in files:
        data = json.loads(path.read_text())
        if path.name != "run.json":
            assert "_source" in data, path
        assert not any(k.startswith("_") for k in config(*path.relative_to(CONFIGS).parts)), path


def test_a_missing_config_names_what_is_shipped():
    with pytest.raises(BenchError, match="no shipped config wan22_ti2v/huge/vae.json.*wan22_ti2v/tiny/vae.json"):
        read_config("wan22_ti2v", "huge", "vae.json")
    with pytest.raises(BenchError, match="no model 'nope'.*wan22_vae:demo"):
        model_config("nope")


def test_rows_derive_from_the_one_structure():
    real, demo, tiny = model_config("wan22_vae:real"), model_config("wan22_vae:demo"), model_config("wan22_vae:tiny")
    # the demo is the real Wan2.2-TI2V-5B structure with its widths reduced, nothing else changed
    assert {k for k in real if real[k] != demo[k]} == {"base_dim", "decoder_base_dim"}
    assert (demo["base_dim"], demo["decoder_base_dim"]) == (8, 16)
    small = model_config("wan22_vae:bench_small")
    assert small["z_dim"] == 16 and len(small["latents_mean"]) == 16 and small["dim_mult"] == tiny["dim_mult"]
    # a fresh copy each time: a caller that changes a list does not change the table
    real["dim_mult"].append(99)
    assert model_config("wan22_vae:real")["dim_mult"] == [1, 2, 4, 4]


def _small_diffusers_rows():
    return [n for n, s in MODELS.items() if not n.endswith(":real") and s.library == "diffusers" and not s.components]


@pytest.mark.parametrize("name", _small_diffusers_rows())
def test_every_small_diffusers_row_builds(name):
    pytest.importorskip("diffusers")
    torch.manual_seed(0)
    model = build(name)
    assert type(model).__name__ == MODELS[name].model_class
    scalars = {k: v for k, v in model_config(name).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    assert all(model.config[k] == v for k, v in scalars.items()), name


@pytest.mark.parametrize("name", [n for n, s in MODELS.items() if s.library == "transformers"])
def test_every_transformers_row_builds(name):
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = build(name)
    assert type(model).__name__ == MODELS[name].model_class
    scalars = {k: v for k, v in model_config(name).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    assert scalars and all(getattr(model.config, k) == v for k, v in scalars.items()), name


@pytest.mark.parametrize("name", [n for n, s in MODELS.items() if s.components])
def test_a_pipeline_row_builds_its_components_from_their_rows(name):
    pytest.importorskip("diffusers")
    spec = MODELS[name]
    torch.manual_seed(0)
    pipe = build(name)
    assert type(pipe).__name__ == spec.model_class
    for part, comp in spec.components.items():
        row, changed = comp if isinstance(comp, tuple) else (comp, {})
        got = getattr(pipe, part)
        if row is None:
            assert got is None, (name, part)
            continue
        assert type(got).__name__ == MODELS[row].model_class, (name, part)
        for k, v in {**model_config(row), **changed}.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                cfg = got.config
                assert (cfg[k] if isinstance(cfg, dict) else getattr(cfg, k)) == v, (name, part, k)
    assert type(pipe.scheduler).__name__ == spec.scheduler[0]


def test_the_kind_comes_from_the_class_name():
    assert MODELS["wan22_vae:tiny"].kind == "vae"
    assert MODELS["wan22_transformer:tiny"].kind == "dit"
    assert MODELS["qwen3_5_moe:test"].kind == "lm"
    assert MODELS["umt5_encoder:tiny"].kind == "encoder"
    assert MODELS["wan22_ti2v_pipeline:test"].kind == "pipeline"
    with pytest.raises(ValueError, match="no kind of"):
        ModelSpec("diffusers", "UNet2DConditionModel")
    with pytest.raises(ValueError, match="names its config class"):
        ModelSpec("transformers", "LlamaForCausalLM")
    with pytest.raises(ValueError, match="only one, names its components"):
        ModelSpec("diffusers", "WanPipeline")
    with pytest.raises(ValueError, match="library must be"):
        ModelSpec("mlx", "LlamaForCausalLM", "LlamaConfig")


def test_the_zoos_name_rows(monkeypatch):
    from mpsboost.bench import models

    assert set(ZOO.values()) <= set(MODELS) and {row for row, _ in VIDEO_VAES.values()} <= set(MODELS)
    monkeypatch.setitem(models.ZOO, "ghost", "ghost:tiny")
    with pytest.raises(ValueError, match="ZOO names rows that MODELS lacks: ghost:tiny"):
        models._check_table()
    monkeypatch.delitem(models.ZOO, "ghost")
    monkeypatch.setitem(models.MODELS, "bad", ModelSpec("diffusers", "AutoencoderKLWan"))
    with pytest.raises(ValueError, match="named family:size"):
        models._check_table()
    monkeypatch.delitem(models.MODELS, "bad")
    monkeypatch.setitem(models.MODELS, "x:y", ModelSpec("diffusers", "AutoencoderKLWan", base="nope:tiny"))
    with pytest.raises(ValueError, match="base 'nope:tiny' is no row"):
        models._check_table()


def test_build_on_a_device_and_with_overrides():
    pytest.importorskip("diffusers")
    model = build("wan22_vae:tiny", device="meta", num_res_blocks=2)
    assert next(model.parameters()).device.type == "meta" and model.config.num_res_blocks == 2
