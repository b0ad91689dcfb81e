"""`mpsboost doctor`, `mpsboost plan` and `mpsboost bench --list` as a user runs them, called in process
(``mpsboost.cli.main(argv)`` is the console script's function) on folders the test makes; two fresh
interpreters: the entry point itself, and that the help of the CLI and of every cookbook script answers
before torch is imported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import tiny_models as tm

from mpsboost.cli import WIDTH, main, shipped_models

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = (
    "Qwen/Qwen3.6-35B-A3B",
    "Qwen/Qwen3-8B",
    "Qwen/Qwen3-30B-A3B",
    "Qwen/Qwen-Image",
    "Wan-AI/Wan2.2-TI2V-5B-Diffusers",
)


def _cli(capsys, *args: str, check: bool = True) -> tuple[int, str, str]:
    """``mpsboost ARGS`` in this process: (exit status, stdout, stderr)."""
    capsys.readouterr()  # nothing printed before belongs to this call
    try:
        rc = main(list(args))
    except SystemExit as exc:  # argparse: --help, --version, a bad choice
        rc = exc.code if isinstance(exc.code, int) else 2
    out, err = capsys.readouterr()
    if check and rc != 0:
        raise AssertionError(f"mpsboost {' '.join(args)} exited {rc}:\n{out}\n{err}")
    return rc, out, err


def _one_line_user_error(result: tuple[int, str, str], *needles: str) -> str:
    """A user error: exit status 2, one line on stderr naming what is wrong, no traceback."""
    rc, _, err = result
    err = err.strip()
    assert rc == 2, (rc, err)
    assert "\n" not in err and "Traceback" not in err, err
    for n in needles:
        assert n in err, (n, err)
    return err


def _fits(text: str, lines: int | None = None) -> list[str]:
    rows = text.rstrip("\n").splitlines()
    too_wide = [r for r in rows if len(r) > WIDTH]
    assert not too_wide, too_wide
    if lines is not None:
        assert len(rows) <= lines, f"{len(rows)} lines:\n{text}"
    return rows


# ------------------------------------------------------------------------------------------ fresh interpreters

# Each call's exit status and whether torch was imported after it; run in one fresh interpreter.
_HELP_PROBE = """
import contextlib, io, json, runpy, sys
from pathlib import Path
from mpsboost.cli import main
seen = {}
calls = [
    ("mpsboost --help", lambda: main(["--help"])),
    ("mpsboost selftest --help", lambda: main(["selftest", "--help"])),
]
for script in sorted(Path(sys.argv[1]).glob("[a-z]*.py")):
    def run(script=script):
        sys.argv = [str(script), "--help"]
        runpy.run_path(str(script), run_name="__main__")
    calls.append((script.name + " --help", run))
for name, call in calls:
    text = io.StringIO()
    try:
        with contextlib.redirect_stdout(text):
            call()
        rc = 0
    except SystemExit as exc:
        rc = exc.code
    seen[name] = [rc, "torch" in sys.modules, "usage:" in text.getvalue()]
print(json.dumps(seen))
"""


def test_help_answers_before_torch_is_imported():
    """`mpsboost --help`, `mpsboost selftest --help` and every cookbook script's --help import no torch."""
    proc = subprocess.run(
        [sys.executable, "-c", _HELP_PROBE, str(ROOT / "recipes")], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    scripts = {p.name for p in (ROOT / "recipes").glob("[a-z]*.py")}
    assert set(seen) == {"mpsboost --help", "mpsboost selftest --help"} | {f"{s} --help" for s in scripts}
    assert len(scripts) >= 6
    for name, (rc, torch_loaded, usage) in seen.items():
        assert rc == 0 and usage, (name, rc, usage)
        assert not torch_loaded, f"{name} imported torch"


def test_the_entry_point_runs_as_a_command():
    """The console script's module as a command (`python -m mpsboost`): help, then a user error's exit status."""
    proc = subprocess.run(
        [sys.executable, "-m", "mpsboost", "plan", "Nobody/no-such-model"], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 2 and proc.stdout == "", (proc.returncode, proc.stdout, proc.stderr)
    err = proc.stderr.strip()
    assert err.startswith("mpsboost plan: Nobody/no-such-model") and "\n" not in err and "Qwen/Qwen3.6-35B-A3B" in err
    from importlib.metadata import entry_points

    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "mpsboost"]
    assert script.value == "mpsboost.cli:main" and script.load() is main


# ------------------------------------------------------------------------------------------ doctor


def test_doctor_all_reports_build_devices_and_gate(capsys):
    _, out, _ = _cli(capsys, "doctor", "--all")
    assert "torch" in out and "devices:" in out and "cpu" in out
    for feature in ("pad_constant_native", "grouped_mm", "float8_storage", "device_streams"):
        assert feature in out
    _fits(out)


def _table(out: str) -> dict[str, dict[str, str]]:
    """The doctor's recipes x shipped models table: {recipe: {model label: mark}}."""
    rows = out.splitlines()
    head = next(i for i, r in enumerate(rows) if r.startswith("recipes on the shipped models"))
    labels = rows[head + 1].split()
    table = {}
    for r in rows[head + 2 :]:
        cells = r.split()
        if len(cells) != len(labels) + 1:
            break
        table[cells[0].rstrip("*")] = dict(zip(labels, cells[1:]))
    return table


def test_doctor_first_screen_says_what_applies_on_a_simulated_mac(capsys):
    """The first screen fits a terminal (about 24 lines, 100 characters) and says, per shipped model, which
    recipes apply under that build: torch 2.14.1 on a Mac needs decode_linear's [B,K] layout (F.linear on
    [B,1,K] is 8.5x slower there, pytorch#189855), 2.15.0 does not."""
    _, old, _ = _cli(capsys, "doctor", "--device", "mps", "--torch", "2.14.1")
    _, new, _ = _cli(capsys, "doctor", "--device", "mps", "--torch", "2.15.0")
    for out in (old, new):
        rows = _fits(out, lines=25)
        assert "decisions for torch 2." in rows[2] and "on mps" in rows[2]
        assert rows[-1].startswith("next: mpsboost plan Qwen/Qwen3.6-35B-A3B")
        assert "[by version]" not in out and "upstream" not in out  # the matrix's facts are behind --all
        t = _table(out)
        assert list(t["linear_attention"].values()) == ["yes", "-", "-", "-", "-"], t  # DeltaNet: Qwen3.6 only
        assert t["attention_decode"]["Qwen3.6-35B-A3B"] == "yes"  # its one gated attention layer in four
        assert t["wan_vae_pad"]["Wan2.2-TI2V-5B"] == "yes" and t["qwen_image_vae"]["Qwen-Image"] == "yes"
        assert t["moe_experts"]["Qwen3-30B-A3B"] == "yes" and t["moe_experts"]["Qwen3-8B"] == "-"
        assert t["fp8_weights"]["Qwen3.6-35B-A3B"] == "yes"  # opt-in, starred
        assert "fp8_weights*" in out and "fp8='rowwise'" in out
    assert _table(old)["decode_linear"]["Qwen3-8B"] == "yes"
    assert "decode_linear" not in _table(new) and "stock kept on every shipped model here: decode_linear" in new
    assert "not: pad_constant_native" in old and "pad_constant_native" not in new  # the 2.15 pad kernel


def test_doctor_first_screen_on_this_machine(capsys, monkeypatch):
    monkeypatch.delenv("USE_HUB_KERNELS", raising=False)
    _, out, _ = _cli(capsys, "doctor")
    rows = _fits(out, lines=25)
    assert "(this machine)" in rows[2]
    assert rows[-1] == "      a Mac's decisions: mpsboost doctor --device mps --torch 2.15.0"
    assert "Hub kernels" in out and "would not load" in out  # they are Metal kernels, and this is no Mac


def test_doctor_simulated_json(capsys):
    info = json.loads(_cli(capsys, "doctor", "--device", "mps", "--torch", "2.14.1", "--json")[1])
    assert info["env"]["device_type"] == "mps" and info["env"]["simulated"] is True
    feats = info["features"]
    assert feats["pad_constant_native"]["available"] is False
    assert "pytorch#195368" in feats["pad_constant_native"]["reason"]
    info215 = json.loads(_cli(capsys, "doctor", "--device", "mps", "--torch", "2.15.0", "--json")[1])
    assert info215["features"]["pad_constant_native"]["available"] is True
    assert info215["features"]["device_streams"]["available"] is True  # torch/mps/streams.py in the 2.15.0 wheel
    assert info215["features"]["cross_stream_events"]["available"] is False
    qwen36 = info215["applies"]["models"]["Qwen/Qwen3.6-35B-A3B"]
    assert qwen36["class"] == "Qwen3_5MoeForCausalLM" and qwen36["status"]["linear_attention"] == "would apply"
    assert qwen36["status"]["decode_linear"] == "skipped" and qwen36["skipped_because"]["decode_linear"]


def test_doctor_rejects_a_nonsense_version(capsys):
    _one_line_user_error(_cli(capsys, "doctor", "--device", "mps", "--torch", "banana", check=False), "banana")


def test_doctor_prints_hub_kernels_and_who_decided(capsys):
    _, out, _ = _cli(capsys, "doctor", "--device", "mps", "--torch", "2.15.0", "--all")
    assert "transformers hub kernels for Metal" in out and "metal-flash-sdpa" in out
    assert "[by version]" in out and "[table]" not in out
    assert "mps_compile_shader" in out and "mps_load_metallib" in out
    info = json.loads(_cli(capsys, "doctor", "--device", "mps", "--torch", "2.15.0", "--json")[1])
    assert set(info["hub_kernels"]) >= {"would_load", "why", "kernels", "needs", "repos"}
    assert info["features"]["device_streams"]["decided_by"] == "by version"


def test_doctor_plans_on_one_layer_of_each_kind_and_decides_as_on_the_whole_model():
    """The doctor builds each shipped model with one layer of each kind (fast); every recipe decides there as
    it does on the whole published model (the layers of a kind are the same modules)."""
    from mpsboost import plan
    from mpsboost.cli import _build_shipped
    from mpsboost.gate import Env

    for hub_id in ("Qwen/Qwen3-8B", "Wan-AI/Wan2.2-TI2V-5B-Diffusers"):
        _, few = _build_shipped(hub_id, layers="few")
        _, whole = _build_shipped(hub_id)
        for env in (Env.simulate("mps", "2.14.1"), Env.simulate("mps", "2.15.0"), Env.simulate("cpu", "2.13.0")):

            def decided(comps):
                target = comps[""] if "" in comps else comps
                return {(r.recipe, r.status, r.backing) for r in plan(target, env=env).rows}

            assert decided(few) == decided(whole), (hub_id, env.describe())
        n_few = sum(1 for c in few.values() for _ in c.modules())
        assert n_few < sum(1 for c in whole.values() for _ in c.modules()) / 2, hub_id


# ------------------------------------------------------------------------------------------ plan


def test_plan_takes_the_hub_id_of_a_shipped_config(capsys):
    """`mpsboost plan Qwen/Qwen3.6-35B-A3B`: the published config (40 layers: 30 Gated DeltaNet, 10 attention),
    built on the meta device from the copy inside the package, offline."""
    assert tuple(shipped_models()) == SHIPPED
    _, out, _ = _cli(capsys, "plan", "Qwen/Qwen3.6-35B-A3B", "--device", "mps", "--torch", "2.15.0")
    _fits(out)
    assert out.startswith("mpsboost plan for Qwen/Qwen3.6-35B-A3B (Qwen3_5MoeForCausalLM): torch 2.15.0 on mps")
    assert "30 targets: model.layers.*.linear_attn" in out and "10 targets: model.layers.*.self_attn" in out
    assert "qwen3_5_moe/real/config.json" in out and "nothing downloaded" in out
    report = json.loads(_cli(capsys, "plan", "Wan-AI/Wan2.2-TI2V-5B-Diffusers", "--json")[1])
    assert report["target_type"] == "Wan-AI/Wan2.2-TI2V-5B-Diffusers"
    assert {r["target"].split(".")[0] for r in report["rows"] if r["target"]} >= {"transformer", "vae"}
    assert [Path(f).name for f in report["shipped_config"]] == ["transformer.json", "vae.json"]


def test_plan_of_an_unknown_hub_id_lists_the_shipped_ones(capsys, tmp_path, monkeypatch):
    err = _one_line_user_error(
        _cli(capsys, "plan", "Qwen/Qwen3.6-35B-A3B-FP8", check=False), "neither a local folder nor a hub id"
    )
    for hub_id in SHIPPED:
        assert hub_id in err
    # A local folder that looks like a hub id is a folder.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "Qwen" / "Qwen3-8B").mkdir(parents=True)
    (tmp_path / "Qwen" / "Qwen3-8B" / "config.json").write_text("{}")
    _one_line_user_error(_cli(capsys, "plan", "Qwen/Qwen3-8B", check=False), "config.json", "names no class")


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


def test_plan_on_a_transformers_folder(capsys, model_folders):
    out = _cli(capsys, "plan", str(model_folders["lm"]), "--device", "mps", "--torch", "2.15.0", "--json")[1]
    report = json.loads(out)
    assert report["mode"] == "plan" and report["target_type"] == "Qwen3MoeForCausalLM"
    assert report["env"]["device_type"] == "mps" and report["env"]["torch_version"] == "2.15.0"
    assert isinstance(report["rows"], list)


def test_plan_on_a_diffusers_pipeline_folder(capsys, model_folders):
    out = _cli(capsys, "plan", str(model_folders["pipe"]), "--device", "mps", "--torch", "2.14.1")[1]
    assert "WanPipeline" in out and "2.14.1" in out


def test_plan_on_a_missing_folder(capsys, tmp_path):
    rc, _, err = _cli(capsys, "plan", str(tmp_path / "nope"), check=False)
    assert rc != 0 and "not a folder" in err


def test_plan_names_the_file_and_the_problem(capsys, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"architectures": ["Qwen3MoeForCausalLM"], ')
    _one_line_user_error(
        _cli(capsys, "plan", str(broken), check=False), str(broken / "config.json"), "not valid JSON", "line 1"
    )

    bad_value = tmp_path / "bad_value"
    bad_value.mkdir()
    (bad_value / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKLWan", "dim_mult": 7}))
    _one_line_user_error(
        _cli(capsys, "plan", str(bad_value), check=False),
        str(bad_value / "config.json"),
        "AutoencoderKLWan cannot be built",
    )

    pipe = tmp_path / "pipe"
    (pipe / "vae").mkdir(parents=True)
    (pipe / "model_index.json").write_text("[1, 2]")
    _one_line_user_error(_cli(capsys, "plan", str(pipe), check=False), "model_index.json", "not an object")

    nameless = tmp_path / "nameless"
    nameless.mkdir()
    (nameless / "config.json").write_text("{}")
    _one_line_user_error(_cli(capsys, "plan", str(nameless), check=False), "names no class")

    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"_class_name": "NoSuchModel"}))
    _one_line_user_error(_cli(capsys, "plan", str(unknown), check=False), "has no class 'NoSuchModel'")


def test_user_errors_share_exit_status_2(capsys, tmp_path, model_folders):
    _one_line_user_error(_cli(capsys, "plan", str(tmp_path / "nope"), check=False), "not a folder")
    _one_line_user_error(_cli(capsys, "plan", str(model_folders["lm"]), "--device", "tpu", check=False), "tpu")
    _one_line_user_error(_cli(capsys, "doctor", "--device", "tpu", check=False), "tpu", "cpu, cuda, mps")


def test_doctor_and_plan_say_which_path_an_fp8_checkpoint_takes(capsys, tmp_path, model_folders):
    """The same file takes uint8 storage on MPS 2.14.1 and native float8 on 2.15.0 (pytorch#194074)."""
    import mpsboost

    model = tm.build("qwen3", dtype="bfloat16", seed=0)
    mpsboost.patch(model, fp8="rowwise")
    ck = mpsboost.save_fp8(model, tmp_path / "ck")
    old = _cli(capsys, "doctor", "--device", "mps", "--torch", "2.14.1", "--fp8-checkpoint", str(ck))[1]
    new = _cli(capsys, "doctor", "--device", "mps", "--torch", "2.15.0", "--fp8-checkpoint", str(ck), "--json")[1]
    line_old = " ".join(old.split(f"fp8 checkpoint {ck}:", 1)[1].split())
    line_new = json.loads(new)["fp8_checkpoint"]
    assert "uint8" in line_old and "uint8" not in line_new, (line_old, line_new)
    plan = _cli(
        capsys, "plan", str(model_folders["lm"]), "--device", "mps", "--torch", "2.14.1", "--fp8-checkpoint", str(ck)
    )[1]
    assert line_old in " ".join(plan.split())
    _one_line_user_error(
        _cli(capsys, "doctor", "--fp8-checkpoint", str(tmp_path / "nothing-here"), check=False), "nothing-here"
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
    """transformers loads its Metal hub kernels only with `kernels` within its own bounds (read from transformers;
    pinned to 5.24's, >=0.18.2,<0.19)."""
    from mpsboost.cli import _hub_kernels, _hub_repos
    from mpsboost.gate import Env

    pytest.importorskip("transformers")
    tm.fake_versions(monkeypatch, kernels=kernels)
    tm.pin_kernels_bounds(monkeypatch)
    if flag is None:
        monkeypatch.delenv("USE_HUB_KERNELS", raising=False)
    else:
        monkeypatch.setenv("USE_HUB_KERNELS", flag)
    info = _hub_kernels(Env.simulate("mps", "2.15.0"))
    assert info["would_load"] is would and info["kernels"] == kernels
    assert info["repos"] == _hub_repos() and "kernels-community/metal-flash-sdpa" in info["repos"]  # 5.24, 5.25
    for w in words:
        assert w in info["why"], info["why"]
    off_mac = _hub_kernels(Env.simulate("cpu", "2.15.0"))
    assert off_mac["would_load"] is False and "Metal kernels and this is cpu" in off_mac["why"]


def test_doctor_names_the_metal_hub_kernels_the_transformers_source_names(tmp_path, monkeypatch):
    """The repositories come from transformers' source (5.25 dropped the mps RMSNorm mapping to mlx-rmsnorm): a
    tree that names only one lists only it; one that names none would load none, and says so."""
    import mpsboost.cli as cli
    from mpsboost.gate import Env

    (tmp_path / "integrations").mkdir()
    (tmp_path / "integrations" / "hub_kernels.py").write_text('repo_id="kernels-community/mlx-rmsnorm"\n')
    assert cli._hub_repos(str(tmp_path)) == ["kernels-community/mlx-rmsnorm"]
    (tmp_path / "integrations" / "hub_kernels.py").write_text('repo_id="kernels-community/rmsnorm"\n')
    assert cli._hub_repos(str(tmp_path)) == []
    tm.fake_versions(monkeypatch, kernels="0.18.3", transformers="5.99.0")
    tm.pin_kernels_bounds(monkeypatch)
    monkeypatch.delenv("USE_HUB_KERNELS", raising=False)
    real = cli._hub_repos
    monkeypatch.setattr(cli, "_hub_repos", lambda root=None: real(str(tmp_path)))  # that tree as the installed one
    info = cli._hub_kernels(Env.simulate("mps", "2.15.0"))
    assert info["repos"] == [] and info["would_load"] is False
    assert "transformers 5.99.0 names none of kernels-community/metal-flash-sdpa" in info["why"], info["why"]


# ------------------------------------------------------------------------------------------ bench


def test_bench_takes_recipe_names_and_lists_them(capsys):
    from mpsboost.bench.cli import BENCHMARKS, catalogue, find_benchmark
    from mpsboost.registry import all_recipes

    # every recipe with a benchmark script is reachable by its own name
    root = ROOT / "benchmarks"
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
    listed = _cli(capsys, "bench", "--list")[1]
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


def test_every_listed_benchmark_script_exists_and_recipes_without_one_say_so(capsys):
    from mpsboost.bench.cli import catalogue, find_benchmark, recipes_without_benchmark
    from mpsboost.bench.errors import BenchmarkNotFoundError
    from mpsboost.registry import recipe_names

    root = ROOT / "benchmarks"
    rows = catalogue(root)
    assert rows and all(path is not None and path.is_file() for _, _, path in rows), rows
    listed = _cli(capsys, "bench", "--list")[1]
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
