"""First contact, as a new user has it: build the wheel, install it into a fresh virtual environment
with each extra in turn (``mpsboost``, then ``mpsboost[diffusers]``, then ``mpsboost[transformers]``),
and after each step run ``mpsboost doctor`` and import the public API.

One venv is built (the extras are added in sequence) to keep this under a few minutes. torch comes
from this machine's disk: the exact build that runs the tests is pinned, so pip never fetches a CUDA
torch; the extras' packages come from the package index. ``import mpsboost`` time in a fresh
interpreter is measured there and printed (it is dominated by ``import torch``, measured alongside).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow

PUBLIC = ("patch", "unpatch", "patched", "plan", "last_report", "save_fp8", "load_fp8", "Env", "check",
          "PatchReport", "Recipe", "register", "recipe_names", "MpsboostError", "PatchError", "UnsupportedTargetError")

IMPORT_PROBE = """
import json, sys, time
t0 = time.perf_counter(); import torch; t1 = time.perf_counter()
import mpsboost; t2 = time.perf_counter()
names = mpsboost.recipe_names()
missing = [n for n in {public!r} if not hasattr(mpsboost, n)]
heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('diffusers', 'transformers', 'accelerate'))
print(json.dumps({{"torch_s": t1 - t0, "mpsboost_s": t2 - t1, "version": mpsboost.__version__, "recipes": names,
                  "missing": missing, "heavy": heavy, "file": mpsboost.__file__}}))
"""


def _run(cmd: list[str], *, timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _clean_env() -> dict:
    # Nothing from the test environment may leak into the fresh venv (no PYTHONPATH to src/).
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def test_wheel_with_each_extra_in_a_fresh_venv(tmp_path, record_property):
    env = _clean_env()
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", str(ROOT), "-w", str(dist)], env=env)
    wheels = list(dist.glob("mpsboost-*.whl"))
    assert len(wheels) == 1, wheels
    wheel = wheels[0]
    import zipfile

    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("mpsboost/recipes/") for n in names) and "mpsboost/cli.py" in names
    assert not any(n.startswith(("tests/", "recipes/", "benchmarks/")) for n in names), "test or cookbook files in the wheel"

    venv_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True, clear=True).create(venv_dir)
    py = str(venv_dir / "bin" / "python")
    cli = str(venv_dir / "bin" / "mpsboost")
    # The torch build running these tests, from the local disk (never a CUDA download).
    _run([py, "-m", "pip", "install", "-q", f"torch=={torch.__version__}"], env=env)

    figures = {}
    for extra in ("", "diffusers", "transformers"):
        spec = f"{wheel}[{extra}]" if extra else str(wheel)
        _run([py, "-m", "pip", "install", "-q", spec], env=env)
        doctor = _run([cli, "doctor", "--json"], env=env, timeout=300)
        info = json.loads(doctor.stdout)
        assert info["mpsboost"] == "0.1.0" and info["features"] and info["recipes"], extra
        assert {f["available"] for f in info["features"].values()} <= {True, False}
        text = _run([cli, "doctor"], env=env, timeout=300).stdout
        assert "gate for" in text and "recipes:" in text
        probe = json.loads(_run([py, "-c", IMPORT_PROBE.format(public=PUBLIC)], env=env, timeout=300).stdout)
        assert probe["file"].startswith(str(venv_dir)), probe["file"]  # the installed wheel, not src/
        assert not probe["missing"], probe["missing"]
        assert not probe["heavy"], f"import mpsboost imported {probe['heavy']}"
        assert [r["name"] for r in info["recipes"]] == probe["recipes"] and len(probe["recipes"]) >= 1
        figures[extra or "base"] = probe
        check = {
            "": "import importlib.util as u; assert u.find_spec('diffusers') is None and u.find_spec('transformers') is None",
            "diffusers": "import mpsboost, diffusers, torch; from diffusers import AutoencoderKLWan as A; "
                         "v = A(base_dim=3, z_dim=16, dim_mult=[1,1,1,1], num_res_blocks=1, temperal_downsample=[False,True,True]); "
                         "r = mpsboost.plan(v, device='mps', torch_version='2.14.1'); assert r.rows, r; print(len(r.applied))",
            "transformers": "import mpsboost, transformers, torch; from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM as M; "
                            "m = M(Qwen3MoeConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, "
                            "num_key_value_heads=1, head_dim=16, intermediate_size=32, moe_intermediate_size=16, num_experts=4, "
                            "num_experts_per_tok=2)); r = mpsboost.patch(m); assert r.rows; mpsboost.unpatch(m) if r.applied else None",
        }[extra]
        _run([py, "-c", check], env=env, timeout=300)
    line = "; ".join(f"{k}: import torch {v['torch_s']:.2f} s, then import mpsboost {v['mpsboost_s'] * 1000:.0f} ms"
                     for k, v in figures.items())
    print("fresh-venv import times: " + line)
    record_property("import_times", line)
    # `import mpsboost` after torch stays light: no diffusers/transformers, well under a second.
    assert all(v["mpsboost_s"] < 1.0 for v in figures.values()), line
