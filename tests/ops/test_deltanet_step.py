"""mpsboost::deltanet_step on the CPU: its reference implementation (the composed step) against transformers' own
functions (tests/deltanet_reference.py), as one registered call (an op counter sees one op), its schema (the conv
state, the state and the output declared mutated: torch.library.opcheck), its fake (torch.compile fullgraph=True),
and its errors."""

from __future__ import annotations

import pytest
import torch

from deltanet_reference import compare, independent
from mpsboost.bench import ModuleOps
from mpsboost.ops.deltanet_step import check, deltanet_step, random_inputs

CASES = [
    pytest.param(1, 2, 1, torch.float32, False, id="b1-r1-f32"),
    pytest.param(2, 2, 2, torch.float32, True, id="b2-r2-f32-bias"),
    pytest.param(4, 1, 4, torch.float32, False, id="b4-r4-f32"),
    pytest.param(3, 2, 2, torch.bfloat16, False, id="b3-r2-bf16"),
    pytest.param(2, 1, 4, torch.float16, True, id="b2-r4-f16-bias"),
]


def _call(args, kw):
    return deltanet_step(*args, **kw)


@pytest.mark.parametrize("b,hk,r,dt,bias", CASES)
def test_reference_matches_transformers_over_continued_steps(rng_seed, b, hk, r, dt, bias):
    g = torch.Generator().manual_seed(rng_seed)
    args, kw = random_inputs(g, b=b, hk=hk, r=r, dk=16, dv=32, dtype=dt, bias=bias)
    ref = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    for i in range(3):
        if i:
            args[0].copy_(torch.randn(args[0].shape, generator=g).to(dt))
            ref[0] = args[0].clone()
        want = independent(ref, kw)
        ref[1], ref[2] = want[1].clone(), want[2].clone()
        _call(args, kw)
        compare(args, want, f"step {i}")


def test_beta_scale_two_is_olmo_hybrids_negative_eigenvalues(rng_seed):
    g = torch.Generator().manual_seed(rng_seed)
    args, kw = random_inputs(g, b=2, hk=2, r=2, dk=16, dv=16)
    kw["beta_scale"] = 2.0
    want = independent([a.clone() if isinstance(a, torch.Tensor) else a for a in args], kw)
    _call(args, kw)
    compare(args, want)


def test_one_registered_call_is_one_op(rng_seed):
    g = torch.Generator().manual_seed(rng_seed)
    args, kw = random_inputs(g, b=1, hk=2, r=2, dk=16, dv=16, dtype=torch.bfloat16)
    with torch.no_grad(), ModuleOps() as mode:
        _call(args, kw)
    assert mode.names == ["mpsboost.deltanet_step"]


def test_schema_fake_and_mutations_pass_opcheck(rng_seed):
    # opcheck runs the op under a schema checker (an input mutated but not declared fails), its fake against the
    # real kernel, and aot_autograd's functionalisation of the mutations
    g = torch.Generator().manual_seed(rng_seed)
    args, kw = random_inputs(g, b=2, hk=2, r=2, dk=16, dv=16, bias=True)
    torch.library.opcheck(
        torch.ops.mpsboost.deltanet_step.default,
        (*args, kw["hk"], kw["dk"], kw["norm_eps"], kw["beta_scale"]),
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"),
    )


def test_traces_with_fullgraph_and_updates_the_states_in_place(rng_seed):
    g = torch.Generator().manual_seed(rng_seed)
    args, kw = random_inputs(g, b=2, hk=1, r=2, dk=16, dv=16, dtype=torch.bfloat16)
    eager = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    _call(eager, kw)

    def step(y, cs, st, cw, dtb, alog, nw):
        out = torch.empty(y.shape[0], alog.shape[0] * nw.shape[0], dtype=y.dtype)
        return deltanet_step(y, cs, st, cw, None, dtb, alog, nw, out, **kw) * 1.0

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    y, cs, st, cw, _, dtb, alog, nw, _ = args
    with torch.no_grad():
        got = compiled(y, cs, st, cw, dtb, alog, nw)
    assert torch.equal(got, eager[8]) and torch.equal(cs, eager[1]) and torch.equal(st, eager[2])


def test_bad_inputs_are_clear_errors(rng_seed):
    g = torch.Generator().manual_seed(rng_seed)
    args, kw = random_inputs(g, b=2, hk=2, r=2, dk=16, dv=16)
    good = list(args)

    def err(i, t, **over):
        a = list(good)
        a[i] = t
        k = {"hk": kw["hk"], "dk": kw["dk"], **over}
        with pytest.raises(ValueError, match="mpsboost::deltanet_step") as e:
            check(*a, k["hk"], k["dk"])
        return str(e.value)

    assert "float32 [2, 4, 16, 16]" in err(2, good[2].to(torch.bfloat16))
    assert "conv_state must be [2, " in err(1, good[1][:1])
    assert "columns" in err(0, good[0][:, :-1])
    assert "out must be contiguous" in err(8, good[8].t())
    assert "multiple of key heads" in err(0, good[0], hk=3)
