"""`mpsboost doctor` and `mpsboost plan` as a user runs them: subprocesses on folders the test makes."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "mpsboost.cli", *args], capture_output=True, text=True, timeout=240)
    if check and proc.returncode != 0:
        raise AssertionError(f"mpsboost {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def test_doctor_reports_build_devices_and_gate():
    out = _run("doctor").stdout
    assert "torch" in out and "devices:" in out and "cpu" in out
    for feature in ("pad_constant_native", "grouped_mm", "float8_storage", "device_streams"):
        assert feature in out


def test_doctor_simulated_json():
    proc = _run("doctor", "--device", "mps", "--torch", "2.14.1", "--json")
    info = json.loads(proc.stdout)
    assert info["env"]["device_type"] == "mps" and info["env"]["simulated"] is True
    feats = info["features"]
    assert feats["pad_constant_native"]["available"] is False
    assert "pytorch#195368" in feats["pad_constant_native"]["reason"]
    info215 = json.loads(_run("doctor", "--device", "mps", "--torch", "2.15.0", "--json").stdout)
    assert info215["features"]["pad_constant_native"]["available"] is True
    assert info215["features"]["device_streams"]["available"] is False


def test_doctor_rejects_a_nonsense_version():
    proc = _run("doctor", "--device", "mps", "--torch", "banana", check=False)
    assert proc.returncode == 2
    assert "banana" in proc.stderr


@pytest.fixture(scope="module")
def model_folders(tmp_path_factory) -> dict[str, Path]:
    """A tiny transformers model folder and a tiny diffusers pipeline folder: configs only, no weights."""
    root = tmp_path_factory.mktemp("folders")
    from transformers import Qwen3MoeConfig

    lm = root / "qwen3moe"
    Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2,
        architectures=["Qwen3MoeForCausalLM"],
    ).save_pretrained(lm)

    from diffusers import AutoencoderKLWan

    pipe = root / "wanpipe"
    (pipe / "vae").mkdir(parents=True)
    AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[False]).save_config(pipe / "vae")
    (pipe / "model_index.json").write_text(json.dumps({
        "_class_name": "WanPipeline", "_diffusers_version": "0.42.1",
        "vae": ["diffusers", "AutoencoderKLWan"], "scheduler": ["diffusers", "UniPCMultistepScheduler"],
        "tokenizer": ["transformers", "AutoTokenizer"], "transformer": [None, None],
    }))
    return {"lm": lm, "pipe": pipe}


def test_plan_on_a_transformers_folder(model_folders):
    proc = _run("plan", str(model_folders["lm"]), "--device", "mps", "--torch", "2.15.0", "--json")
    report = json.loads(proc.stdout)
    assert report["mode"] == "plan" and report["target_type"] == "Qwen3MoeForCausalLM"
    assert report["env"]["device_type"] == "mps" and report["env"]["torch_version"] == "2.15.0"
    assert isinstance(report["rows"], list)


def test_plan_on_a_diffusers_pipeline_folder(model_folders):
    proc = _run("plan", str(model_folders["pipe"]), "--device", "mps", "--torch", "2.14.1")
    assert "WanPipeline" in proc.stdout and "2.14.1" in proc.stdout


def test_plan_on_a_missing_folder(tmp_path):
    proc = _run("plan", str(tmp_path / "nope"), check=False)
    assert proc.returncode != 0 and "not a folder" in proc.stderr
