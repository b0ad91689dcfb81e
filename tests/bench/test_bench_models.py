"""mpsboost.bench.models: one table of the measured models, one loader of the shipped configs."""

from __future__ import annotations

import json

import pytest
import torch

from mpsboost.bench import BenchError
from mpsboost.bench.models import CONFIGS, MODELS, build, config, model_config, read_config


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


@pytest.mark.parametrize("name", [n for n, s in MODELS.items() if not n.endswith(":real") and s.library == "diffusers"])
def test_every_small_diffusers_row_builds(name):
    pytest.importorskip("diffusers")
    torch.manual_seed(0)
    model = build(name)
    assert type(model).__name__ == MODELS[name].model_class
    scalars = {k: v for k, v in model_config(name).items() if isinstance(v, (int, float))}
    assert scalars and all(model.config[k] == v for k, v in scalars.items()), name


@pytest.mark.parametrize("name", [n for n, s in MODELS.items() if s.library == "transformers"])
def test_every_transformers_row_builds(name):
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = build(name)
    assert type(model).__name__ == MODELS[name].model_class
    assert model.config.hidden_size == model_config(name)["hidden_size"]


def test_build_on_a_device_and_with_overrides():
    pytest.importorskip("diffusers")
    model = build("wan22_vae:tiny", device="meta", num_res_blocks=2)
    assert next(model.parameters()).device.type == "meta" and model.config.num_res_blocks == 2
