"""After ``load_fp8`` (and ``patch(fp8=...)``), decode_linear leaves mpsboost's own fp8 layers alone and says why:
their forward is fp8_weights' (it once said they carried "an accelerate offload hook"). A forward another
library put on the instance is still named as such."""

from __future__ import annotations

import types

import pytest
import torch

import mpsboost
from mpsboost.gate import Env
from test_fp8_qwen36 import _meta_model, write_qwen36_fp8
from tiny_models import build

MAC_214 = Env.simulate("mps", "2.14.1")  # decode_linear applies to one-token linears there


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    f = tmp_path_factory.mktemp("qwen36dl") / "Qwen3.6-FP8-tiny"
    write_qwen36_fp8(f)
    return f


def _decode_linear_rows(report):
    return {r.target: r for r in report.rows if r.recipe == "decode_linear"}


def test_after_load_fp8_the_fp8_layers_are_named_as_mpsboosts(folder):
    report = mpsboost.load_fp8(_meta_model(), folder, device=MAC_214)
    fp8 = {r.target for r in report.rows if r.recipe == "fp8_weights" and r.status == "applied"}
    rows = _decode_linear_rows(report)
    on_fp8 = [rows[t] for t in fp8 if t in rows]
    assert on_fp8 and all(r.status == "skipped" for r in on_fp8)
    assert {r.reason for r in on_fp8} == {
        "its forward is mpsboost's fp8_weights (which runs this layer's decode on its own path); left alone"
    }
    assert not any("accelerate" in r.reason for r in rows.values())
    assert any(r.status == "applied" for r in rows.values())  # the bf16 linears still get decode_linear


def test_a_forward_another_library_wrapped_is_still_left_alone_as_such():
    model = build("qwen3").eval()
    name, lin = next((n, m) for n, m in model.named_modules() if type(m) is torch.nn.Linear)
    lin.forward = types.MethodType(lambda self, x: torch.nn.Linear.forward(self, x), lin)
    row = _decode_linear_rows(mpsboost.plan(model, device=MAC_214, recipes=["decode_linear"]))[name]
    assert row.status == "skipped" and "another library" in row.reason and "mpsboost" not in row.reason
