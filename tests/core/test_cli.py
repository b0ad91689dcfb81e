"""`mpsboost doctor` and `mpsboost plan` as a user runs them: subprocesses on folders the test makes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import tiny_models as tm


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    # A hang guard only: a loaded 2-core machine stretches the wall time of importing torch, transformers
    # and diffusers 5-10x (see tests/integration/test_examples.py), so it is far above a quiet run's few seconds.
    proc = subprocess.run([sys.executable, "-m", "mpsboost.cli", *args], capture_output=True, text=True, timeout=600)
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
    assert info215["features"]["device_streams"]["available"] is True  # torch/mps/streams.py in the 2.15.0 wheel
    assert info215["features"]["cross_stream_events"]["available"] is False


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
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        architectures=["Qwen3MoeForCausalLM"],
    ).save_pretrained(lm)

    from diffusers import AutoencoderKLWan

    pipe = root / "wanpipe"
    (pipe / "vae").mkdir(parents=True)
    AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[False]).save_config(
        pipe / "vae"
    )
    (pipe / "model_index.json").write_text(
        json.dumps(
            {
                "_class_name": "WanPipeline",
                "_diffusers_version": "0.42.1",
                "vae": ["diffusers", "AutoencoderKLWan"],
                "scheduler": ["diffusers", "UniPCMultistepScheduler"],
                "tokenizer": ["transformers", "AutoTokenizer"],
                "transformer": [None, None],
            }
        )
    )
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


def _one_line_user_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """A user error: exit status 2, one line on stderr naming what is wrong, no traceback."""
    err = proc.stderr.strip()
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "\n" not in err and "Traceback" not in err, err
    for n in needles:
        assert n in err, (n, err)
    return err


def test_plan_names_the_file_and_the_problem(tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"architectures": ["Qwen3MoeForCausalLM"], ')
    _one_line_user_error(
        _run("plan", str(broken), check=False), str(broken / "config.json"), "not valid JSON", "line 1"
    )

    bad_value = tmp_path / "bad_value"
    bad_value.mkdir()
    (bad_value / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKLWan", "dim_mult": 7}))
    _one_line_user_error(
        _run("plan", str(bad_value), check=False), str(bad_value / "config.json"), "AutoencoderKLWan cannot be built"
    )

    pipe = tmp_path / "pipe"
    (pipe / "vae").mkdir(parents=True)
    (pipe / "model_index.json").write_text("[1, 2]")
    _one_line_user_error(_run("plan", str(pipe), check=False), "model_index.json", "not an object")

    nameless = tmp_path / "nameless"
    nameless.mkdir()
    (nameless / "config.json").write_text("{}")
    _one_line_user_error(_run("plan", str(nameless), check=False), "names no class")

    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"_class_name": "NoSuchModel"}))
    _one_line_user_error(_run("plan", str(unknown), check=False), "has no class 'NoSuchModel'")


def test_user_errors_share_exit_status_2(tmp_path, model_folders):
    _one_line_user_error(_run("plan", str(tmp_path / "nope"), check=False), "not a folder")
    _one_line_user_error(_run("plan", str(model_folders["lm"]), "--device", "tpu", check=False), "tpu")
    _one_line_user_error(_run("doctor", "--device", "tpu", check=False), "tpu", "cpu, cuda, mps")


def test_bench_takes_recipe_names_and_lists_them():
    from mpsboost.bench.cli import BENCHMARKS, catalogue, find_benchmark
    from mpsboost.registry import all_recipes

    # every recipe with a benchmark script is reachable by its own name
    root = Path(__file__).resolve().parents[2] / "benchmarks"
    assert find_benchmark("moe_experts") == find_benchmark("moe") == root / "moe.py"
    assert find_benchmark("wan_vae_pad") == root / "wan_vae.py"
    assert find_benchmark("fp8_weights") == root / "fp8.py"
    assert BENCHMARKS["e2e"] == "e2e"
    names = [n for n, _, _ in catalogue()]
    assert names[: len(BENCHMARKS)] == list(BENCHMARKS)
    recipes = {r.name for r in all_recipes()}
    for name, stem, path in catalogue():
        if name in recipes and name != "e2e" and (root / f"{stem}.py").is_file():
            assert path == root / f"{stem}.py"
    listed = _run("bench", "--list").stdout
    assert "moe_experts" in listed and "moe.py" in listed and "e2e" in listed


def test_bench_without_a_benchmarks_folder_says_where_they_live(monkeypatch, capsys):
    from mpsboost.bench import cli as bench_cli

    monkeypatch.setattr(bench_cli, "benchmark_dirs", lambda explicit=None: [])
    assert bench_cli.main(["moe_experts"]) == 2
    err = capsys.readouterr().err
    assert "not part of the installed package" in err and "benchmarks/ folder" in err and "--benchmarks-dir" in err
    assert bench_cli.main(["--list"]) == 1
    assert "not part of the installed package" in capsys.readouterr().out


def test_device_errors_offer_each_present_device_once():
    import torch

    from mpsboost.bench.cli import check_device, present_devices
    from mpsboost.bench.errors import BenchError

    assert present_devices()[-1] == "cpu" and len(set(present_devices())) == len(present_devices())
    if torch.backends.mps.is_available():
        pytest.skip("needs a machine without MPS")
    with pytest.raises(BenchError) as info:
        check_device("mps")
    assert "cpu, cpu" not in str(info.value) and "present here: " in str(info.value)


def test_doctor_and_plan_say_which_path_an_fp8_checkpoint_takes(tmp_path, model_folders):
    """The same file takes uint8 storage on MPS 2.14.1 and native float8 on 2.15.0 (pytorch#194074)."""
    import tiny_models as tm

    import mpsboost

    model = tm.build("qwen3", dtype="bfloat16", seed=0)
    mpsboost.patch(model, fp8="rowwise")
    ck = mpsboost.save_fp8(model, tmp_path / "ck")
    old = _run("doctor", "--device", "mps", "--torch", "2.14.1", "--fp8-checkpoint", str(ck)).stdout
    new = _run("doctor", "--device", "mps", "--torch", "2.15.0", "--fp8-checkpoint", str(ck), "--json").stdout
    line_old = old.split(f"fp8 checkpoint {ck}:", 1)[1].strip()
    line_new = json.loads(new)["fp8_checkpoint"]
    assert "uint8" in line_old and "uint8" not in line_new, (line_old, line_new)
    plan = _run(
        "plan", str(model_folders["lm"]), "--device", "mps", "--torch", "2.14.1", "--fp8-checkpoint", str(ck)
    ).stdout
    assert line_old in plan
    _one_line_user_error(
        _run("doctor", "--fp8-checkpoint", str(tmp_path / "nothing-here"), check=False), "nothing-here"
    )


# ------------------------------------------------------------------------------------------ doctor: hub kernels


@pytest.mark.parametrize(
    "kernels, flag, would, words",
    [
        (None, None, False, ["`kernels` package is not installed", "kernels>=0.18.2,<0.19.0"]),
        ("0.17.2", None, False, ["kernels 0.17.2 is installed", "needs kernels>=0.18.2,<0.19.0", "silently"]),
        ("0.19.1", None, False, ["kernels 0.19.1 is installed"]),
        ("0.18.3", None, True, ["kernels 0.18.3 fits kernels>=0.18.2,<0.19.0"]),
        ("0.18.3", "0", False, ["USE_HUB_KERNELS=0 turns them off"]),
    ],
)
def test_doctor_says_whether_transformers_hub_kernels_would_load(monkeypatch, kernels, flag, would, words):
    """transformers 5.24 loads kernels-community/metal-flash-sdpa and mlx-rmsnorm only with kernels>=0.18.2,<0.19."""
    from mpsboost.cli import _hub_kernels
    from mpsboost.gate import Env

    pytest.importorskip("transformers")
    tm.fake_versions(monkeypatch, kernels=kernels)
    if flag is None:
        monkeypatch.delenv("USE_HUB_KERNELS", raising=False)
    else:
        monkeypatch.setenv("USE_HUB_KERNELS", flag)
    info = _hub_kernels(Env.simulate("mps", "2.15.0"))
    assert info["would_load"] is would and info["kernels"] == kernels
    assert info["repos"] == ["kernels-community/metal-flash-sdpa", "kernels-community/mlx-rmsnorm"]
    for w in words:
        assert w in info["why"], info["why"]
    off_mac = _hub_kernels(Env.simulate("cpu", "2.15.0"))
    assert off_mac["would_load"] is False and "Metal kernels and this is cpu" in off_mac["why"]


def test_doctor_prints_hub_kernels_and_who_decided(capsys):
    from mpsboost.cli import main as cli_main

    assert cli_main(["doctor", "--device", "mps", "--torch", "2.15.0"]) == 0
    out = capsys.readouterr().out
    assert "transformers hub kernels for Metal" in out and "metal-flash-sdpa" in out
    assert "[by version]" in out and "[table]" not in out
    assert "mps_compile_shader" in out and "mps_load_metallib" in out
    assert cli_main(["doctor", "--device", "mps", "--torch", "2.15.0", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert set(info["hub_kernels"]) >= {"would_load", "why", "kernels", "needs", "repos"}
    assert info["features"]["device_streams"]["decided_by"] == "by version"


def test_every_listed_benchmark_script_exists_and_recipes_without_one_say_so():
    from mpsboost.bench.cli import catalogue, find_benchmark, recipes_without_benchmark
    from mpsboost.bench.errors import BenchmarkNotFoundError
    from mpsboost.registry import recipe_names

    root = Path(__file__).resolve().parents[2] / "benchmarks"
    rows = catalogue(root)
    assert rows and all(path is not None and path.is_file() for _, _, path in rows), rows
    listed = _run("bench", "--list").stdout
    for name, stem, _ in rows:
        assert name in listed and (root / f"{stem}.py").is_file()
    # Every recipe either has a script or is named as having none; none points at a missing file.
    missing = recipes_without_benchmark()
    assert set(missing) | {n for n, _, _ in rows} >= set(recipe_names())
    assert "metal_attention" in missing and "recipes without a benchmark: " in listed
    for name in missing:
        with pytest.raises(BenchmarkNotFoundError, match=f"recipe {name} has no benchmark of its own") as info:
            find_benchmark(name, root)
        assert f"{name}.py" not in str(info.value)
