"""A low-bit projection's decode operand (``AffineOperand``) written into a caller's buffer: one
``mpsboost::affine_gemv_out`` dispatch where the buffer's layout is one the operator takes (a column range of a row,
a contiguous block), a product then a copy where it is not; the values are the layer's own forward's (dequantize
then linear) within 1e-5 relative in fp32."""

from __future__ import annotations

import pytest
from mpsboost.bench import relative_error
import torch

import mpsboost
from mpsboost.bench.decode_cost import OpRecorder, build
from mpsboost.gate import Env
from mpsboost.recipes._operand import decode_operand

pytest.importorskip("transformers")

TOL = 1e-5  # the same codes on both sides; only the summation order differs


@pytest.fixture(scope="module")
def q_proj():
    m = build("tiny")
    opts = {"low_bit_weights": {"bits": 4, "group_size": 32}}
    mpsboost.patch(m, device=Env.simulate("mps", "2.15.0"), recipes=["low_bit_weights"], options=opts)
    return m.model.layers[3].self_attn.q_proj


def _ops(fn):
    names = []
    with OpRecorder(lambda f, a, k, o: names.append(f.name())):
        fn()
    return names


@pytest.mark.parametrize("rows", [1, 3])
def test_out_into_a_column_range_is_one_dispatch(q_proj, rows):
    op = decode_operand(q_proj)
    assert type(op).__name__ == "AffineOperand"
    x = torch.randn(rows, q_proj.in_features)
    n = op.out_features
    buf = torch.full((rows, n + 40), float("nan"))
    cols = buf[:, 24 : 24 + n]  # unit column stride, row stride n + 40
    names = _ops(lambda: op(x, out=cols))
    assert names == ["mpsboost::affine_gemv_out"], names
    with torch.no_grad():
        ref = q_proj(x)
    assert relative_error(cols, ref) <= TOL
    assert buf[:, :24].isnan().all() and buf[:, 24 + n :].isnan().all()  # nothing outside its columns


def test_out_of_a_layout_the_operator_refuses_is_a_copy(q_proj):
    op = decode_operand(q_proj)
    x = torch.randn(2, q_proj.in_features)
    out = torch.empty(op.out_features, 2).t()  # [2, N] with column stride 2
    names = _ops(lambda: op(x, out=out))
    assert "mpsboost::affine_gemv_out" not in names and "aten::copy_" in names, names
    with torch.no_grad():
        assert relative_error(out, q_proj(x)) <= TOL


def test_no_out_is_one_product(q_proj):
    op = decode_operand(q_proj)
    x = torch.randn(1, q_proj.in_features)
    names = _ops(lambda: op(x))
    assert names == ["mpsboost::affine_gemv"], names
