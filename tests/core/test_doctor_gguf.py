"""``mpsboost doctor``: would transformers' GGUF-on-MPS kernels load, and why not (installed versions faked)."""

from __future__ import annotations

import json

import pytest
import tiny_models as tm

from mpsboost.gate import Env

pytest.importorskip("transformers")


def _has_gguf_path() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformers.integrations.gguf.kernels") is not None


@pytest.mark.parametrize(
    "kernels, gguf, would, words",
    [
        (None, "0.17.1", False, ["`kernels` package is not installed", "kernels>=0.18.2,<0.19.0"]),
        ("0.17.2", "0.17.1", False, ["kernels 0.17.2 is installed, needs >=0.18.2,<0.19.0", "unpacks"]),
        ("0.19.0", "0.17.1", False, ["kernels 0.19.0 is installed"]),
        ("0.18.2", None, False, ["`gguf` package (to read .gguf files) is not installed", "gguf>=0.10.0"]),
        ("0.18.2", "0.9.0", False, ["gguf 0.9.0 is installed, needs >=0.10.0"]),
        ("0.18.2", "0.17.1", True, ["kernels 0.18.2 and gguf 0.17.1 fit kernels>=0.18.2,<0.19.0, gguf>=0.10.0"]),
    ],
)
def test_gguf_kernels_need_kernels_0182(monkeypatch, kernels, gguf, would, words):
    """transformers 5.24 (integrations/gguf/kernels.py) fetches ggml's Metal kernels through `kernels` only when
    transformers' own is_kernels_available() holds: KERNELS_MIN_VERSION <= kernels < KERNELS_MAX_VERSION."""
    from mpsboost.cli import _gguf_kernels

    if not _has_gguf_path():
        pytest.skip("this transformers has no GGUF-on-MPS path (5.24+)")
    tm.fake_versions(monkeypatch, kernels=kernels, gguf=gguf)
    tm.pin_kernels_bounds(monkeypatch)
    info = _gguf_kernels(Env.simulate("mps", "2.15.0"))
    assert info["would_load"] is would, info["why"]
    assert info["kernels"] == kernels and info["gguf"] == gguf
    assert "ggml-org/ggml-quantization" in info["repos"] and "qwen35moe" in info["architectures"]
    for w in words:
        assert w in info["why"], info["why"]
    off_mac = _gguf_kernels(Env.simulate("cuda", "2.11.0"))
    assert off_mac["would_load"] is False and "Metal kernels and this is cuda" in off_mac["why"]


def test_gguf_kernels_without_the_transformers_path(monkeypatch):
    import importlib.util

    from mpsboost.cli import _gguf_kernels

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "transformers.integrations.gguf.kernels" else real(name, *a),
    )
    tm.fake_versions(monkeypatch, transformers="5.22.0", kernels="0.18.2", gguf="0.17.1")
    info = _gguf_kernels(Env.simulate("mps", "2.15.0"))
    assert not info["would_load"] and "transformers 5.22.0 has no GGUF-on-MPS path" in info["why"]


def test_doctor_prints_gguf_kernels_and_the_wheel(capsys, monkeypatch):
    from mpsboost.cli import main as cli_main

    tm.fake_versions(monkeypatch, kernels="0.17.2")
    tm.pin_kernels_bounds(monkeypatch)
    assert cli_main(["doctor", "--device", "mps", "--torch", "2.15.0", "--all"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # --all wraps its lines at 100 characters
    assert "transformers GGUF-on-MPS kernels" in out and "would not load" in out
    assert "torch-2.15.0-cp312-cp312-macosx_14_0_arm64.whl (macOS 14.0 or later)" in out
    assert "macOS wheels: triangular_solve_small_16 from the 2.15.0 macOS wheel" in out
    assert cli_main(["doctor", "--device", "mps", "--torch", "2.15.0", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["gguf_kernels"]["kernels"] == "0.17.2" and info["gguf_kernels"]["would_load"] is False
    assert "kernels 0.17.2 is installed, needs >=0.18.2" in info["gguf_kernels"]["why"]
    rule = info["features"]["solve_triangular_fast"]["rules"][0]
    assert rule["evidence"] == "triangular_solve_small"
