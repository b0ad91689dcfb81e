"""Where ``load_fp8(..., requantize="rowwise")`` changes the decode path, as recipes/qwen36_fp8.py, the
load_fp8 docstring and docs/fp8-checkpoints.md state it: on a Mac whose Metal fp8 GEMV runs, block scales and
rowwise decode on that same kernel (requantising only costs accuracy); where that kernel is off, rowwise takes
torch 2.15's few-rows ``scaled_mm`` and block scales dequantise; on CUDA, rowwise takes the Triton GEMV.
(That a Mac with the Metal kernel decodes rowwise on it: test_fp8_requantize.py; block scales: test_fp8_qwen36.py.)"""

from __future__ import annotations

import pytest

import mpsboost
from mpsboost.gate import Env, Verdict
from mpsboost.recipes.fp8 import paths as fp8_paths
from test_fp8_qwen36 import _meta_model, write_qwen36_fp8

LINEAR = "model.layers.0.linear_attn.in_proj_qkv"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    f = tmp_path_factory.mktemp("qwen36rqp") / "Qwen3.6-FP8-tiny"
    write_qwen36_fp8(f)
    return f


def _backing(folder, env, requantize):
    report = mpsboost.load_fp8(_meta_model(), folder, device=env, requantize=requantize)
    return {r.target: r.backing for r in report.rows if r.recipe == "fp8_weights" and r.status == "applied"}[LINEAR]


def test_where_the_metal_kernel_is_off_rowwise_takes_the_few_rows_scaled_mm(folder, monkeypatch):
    monkeypatch.setattr(fp8_paths, "metal_verdict", lambda env: Verdict(False, "self-check failed (test)"))
    mac = Env.simulate("mps", "2.15.0")
    assert _backing(folder, mac, None) == "block-scaled fp8 128x128, dequantise then linear"
    assert _backing(folder, mac, "rowwise").startswith("scaled_mm rowwise for M<=4")


def test_on_cuda_rowwise_takes_the_triton_gemv(folder):
    cuda = Env.simulate("cuda", "2.15.0")
    assert _backing(folder, cuda, None) == "block-scaled fp8 128x128, dequantise then linear"
    assert _backing(folder, cuda, "rowwise").startswith("fp8 GEMV (triton)")
