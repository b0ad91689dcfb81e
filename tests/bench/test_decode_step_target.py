"""The whole decode step of the tiny Qwen3.5-MoE under Mac 2.15.0 decisions, counted as a Mac dispatches it
(``mpsboost.bench.decode_cost``, ``as_on_mps``): at most 160 aten ops, at most 10 a Gated DeltaNet layer, 12 a MoE
block and 16 the attention layer, with bf16, fp8 and 4-bit operands; bytes no more than stock's. And the counting
rules it rests on: an ``F.rms_norm`` that MPS runs as one ``_fused_rms_norm`` Metal kernel counts as that one op,
an ``F.linear`` as MPS's own ``linear`` kernel, one whose conditions send MPS to the composite counts the composite,
and nothing inside a recorded op is recorded again."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mpsboost
from mpsboost.bench import decode_cost as dc
from mpsboost.gate import Env

aten = torch.ops.aten
MAC = Env.simulate("mps", "2.15.0")
STEP = 160
PER_LAYER = {"linear_attn": 10, "mlp": 12, "self_attn": 16}


# ----------------------------------------------------------------------------- the counting rule


def _recorded(fn, *, as_on_mps=True):
    seen = []
    with dc.OpRecorder(lambda f, a, k, o: seen.append((f, a, o)), as_on_mps=as_on_mps):
        out = fn()
    return out, seen


def test_rms_norm_with_a_same_dtype_weight_is_one_fused_op_reading_input_and_weight():
    x, w = torch.randn(3, 5, 96), torch.randn(96)
    out, seen = _recorded(lambda: F.rms_norm(x, (96,), w, 1e-6))
    assert [f for f, _, _ in seen] == [aten._fused_rms_norm.default]
    torch.testing.assert_close(out, F.rms_norm(x, (96,), w, 1e-6), rtol=0, atol=0)  # the call runs as it does
    f, a, o = seen[0]
    assert dc._moved(f, a, {}, o) == (x.numel() + w.numel() + out.numel()) * 4
    assert dc.launches(f, a, {}, o) and dc.kind(f) == "metal"


def test_rms_norm_of_a_strided_input_adds_its_contiguous_copy():
    x, w = torch.randn(5, 3, 64).transpose(0, 1), torch.randn(64)
    _, seen = _recorded(lambda: F.rms_norm(x, (64,), w))
    assert [f for f, _, _ in seen] == [aten.clone.default, aten._fused_rms_norm.default]
    assert seen[1][1][0].is_contiguous()


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(lambda x, w: F.rms_norm(x, (64,)), id="no-weight"),
        pytest.param(lambda x, w: F.rms_norm(x, (64,), w.double()), id="weight-of-another-dtype"),
        pytest.param(lambda x, w: F.rms_norm(x.bfloat16(), (64,), w), id="input-of-another-dtype"),
    ],
)
def test_rms_norm_that_mps_runs_as_the_composite_counts_the_composite(case):
    x, w = torch.randn(2, 64), torch.randn(64)
    _, mapped = _recorded(lambda: case(x, w))
    _, cpu = _recorded(lambda: case(x, w), as_on_mps=False)
    names = [f.overloadpacket.__name__ for f, _, _ in mapped]
    assert "_fused_rms_norm" not in names and len(names) >= 4
    assert names == [f.overloadpacket.__name__ for f, _, _ in cpu]


def test_rms_norm_recording_autograd_is_the_composite():
    x, w = torch.randn(2, 64, requires_grad=True), torch.randn(64)
    _, seen = _recorded(lambda: F.rms_norm(x, (64,), w))
    assert aten._fused_rms_norm.default not in [f for f, _, _ in seen]


def test_without_as_on_mps_the_cpu_composite_is_counted():
    x, w = torch.randn(2, 64), torch.randn(64)
    _, seen = _recorded(lambda: F.rms_norm(x, (64,), w), as_on_mps=False)
    names = {f.overloadpacket.__name__ for f, _, _ in seen}
    assert "_fused_rms_norm" not in names and {"rsqrt", "mean"} <= names


@pytest.mark.parametrize(
    "shape, bias",
    [((1, 96), True), ((1, 96), False), ((2, 1, 96), True), ((2, 3, 96), False), ((96,), True)],
    ids=["2d-bias", "2d", "3d-bias", "3d", "1d-bias"],
)
def test_linear_is_one_op_reading_input_weight_and_bias(shape, bias):
    # On a Mac aten::linear is its own MPS kernel (_mps_linear); the CPU composes it of t, mm/addmm and views.
    lin = torch.nn.Linear(96, 40, bias=bias)
    x = torch.randn(*shape)
    with torch.no_grad():
        out, seen = _recorded(lambda: lin(x))
        _, cpu = _recorded(lambda: lin(x), as_on_mps=False)
    assert [f for f, _, _ in seen] == [aten.linear.default]
    torch.testing.assert_close(out, F.linear(x, lin.weight, lin.bias), rtol=0, atol=0)  # the call runs as it does
    f, a, o = seen[0]
    want = (x.numel() + lin.weight.numel() + (40 if bias else 0) + out.numel()) * 4
    launched = [(g, b_, p) for g, b_, p in cpu if dc.launches(g, b_, {}, p)]  # what the CPU's composite moves
    assert dc._moved(f, a, {}, o) == want == sum(dc._moved(g, b_, {}, p) for g, b_, p in launched)
    assert len(cpu) >= 2 and dc.launches(f, a, {}, o) and dc.kind(f) == "mixed"


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(lambda x, w: F.linear(x.requires_grad_(), w), id="autograd"),
        pytest.param(lambda x, w: F.linear(x.to(torch.int64), w.to(torch.int64)), id="integer"),
    ],
)
def test_linear_that_mps_does_not_take_counts_the_composite(case):
    x, w = torch.randn(2, 64), torch.randn(8, 64)
    _, seen = _recorded(lambda: case(x.clone(), w))
    assert aten.linear.default not in [f for f, _, _ in seen] and len(seen) >= 2


def test_what_runs_inside_a_recorded_op_is_not_recorded_again():
    # A registered operator whose reference kernel calls F.linear and F.rms_norm: one op, its own.
    lib = torch.library.Library("mpsboost_test_decode", "FRAGMENT")
    lib.define("lin_norm(Tensor x, Tensor w) -> Tensor")
    lib.impl("lin_norm", lambda x, w: F.rms_norm(F.linear(x, w), (w.shape[0],), None), "CompositeExplicitAutograd")
    x, w = torch.randn(2, 64), torch.randn(8, 64)
    with torch.no_grad():
        _, seen = _recorded(lambda: torch.ops.mpsboost_test_decode.lin_norm(x, w))
    assert [f for f, _, _ in seen] == [torch.ops.mpsboost_test_decode.lin_norm.default]


def test_only_ops_that_launch_a_kernel_move_bytes(monkeypatch):
    # Each op "moves" one byte here: the step's bytes are then its dispatches, not its ops (views, aliases and bare
    # allocations launch nothing and move nothing).
    m = _bf16()
    monkeypatch.setattr(dc, "_moved", lambda *a: 1)
    cost = dc.decode_cost(m, as_on_mps=False)
    dispatches = sum(sum(kinds.values()) for kinds in cost["dispatches"].values())
    assert sum(cost["bytes"].values()) == dispatches < sum(cost["ops"].values())


def test_a_wheel_row_takes_precedence_over_the_source_kind(monkeypatch):
    table = dict(dc._table("2.15.0"), _fused_rms_norm="mixed")
    monkeypatch.setattr(dc, "_table", lambda release: table)
    assert dc.kind(aten._fused_rms_norm.default) == "mixed"


# ----------------------------------------------------------------------------- the step


def _bf16():
    m = dc.build("tiny", torch.bfloat16)
    mpsboost.patch(m, device=MAC)
    return m


def _fp8():
    m = dc.build("tiny", torch.bfloat16)
    mpsboost.patch(m, device=MAC, fp8="rowwise")
    return m


def _low_bit():
    m = dc.build("tiny")
    opts = {"low_bit_weights": {"bits": 4, "group_size": 32}}
    mpsboost.patch(m, device=MAC, recipes=["low_bit_weights"], options=opts)
    mpsboost.patch(m, device=MAC)
    return m


@pytest.fixture(scope="module")
def stock_bf16():
    return dc.decode_cost(dc.build("tiny", torch.bfloat16))


@pytest.mark.parametrize("make", [_bf16, _fp8, _low_bit], ids=["bf16", "fp8", "4-bit"])
def test_tiny_step_within_the_op_targets_and_stock_bytes(make, stock_bf16):
    m = make()
    blocks = dc.blocks_of(m)
    cost = dc.decode_cost(m)
    assert sum(cost["ops"].values()) <= STEP, cost["ops"]
    for block, cap in PER_LAYER.items():
        assert cost["ops"][block] <= cap * blocks[block], (block, cost["ops"])
    assert sum(cost["bytes"].values()) <= sum(stock_bf16["bytes"].values())
    assert sum(cost["ops"].values()) < sum(stock_bf16["ops"].values()) / 3  # stock: 674 ops


def test_the_rest_of_the_step_counts_each_rms_norm_once(monkeypatch):
    # The model's 9 RMS norms outside the blocks (4 input, 4 post-attention, the final one): one op each on a Mac.
    # (The rms_norm route alone here; the linear route's count is the tests' above.)
    m = _bf16()
    cpu = dc.decode_cost(m, as_on_mps=False)
    monkeypatch.setattr(dc, "MPS_ROUTES", {k: v for k, v in dc.MPS_ROUTES.items() if v is dc._rms_norm_route})
    mapped = dc.decode_cost(m)
    fused = mapped["names"]["metal"].get("aten::_fused_rms_norm", 0)
    assert fused >= 9
    assert sum(cpu["ops"].values()) - sum(mapped["ops"].values()) == 5 * fused  # six CPU ops become one
