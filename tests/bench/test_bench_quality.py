"""Quality metrics against hand-computed values, and the CPU fp32 reference run."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from mpsboost.bench import QualityError, as_tensor, correctness, cpu_reference, max_abs, psnr, relative_error, sqnr
from mpsboost.bench import quality as quality_mod

X = torch.tensor([1.0, 2.0, 3.0, 4.0])
REF = torch.tensor([1.0, 2.0, 3.0, 5.0])


def test_hand_computed_values():
    # error (0, 0, 0, -1): MSE = 1/4; reference range 5 - 1 = 4; ||ref||^2 = 1 + 4 + 9 + 25 = 39
    assert psnr(X, REF) == pytest.approx(10 * math.log10(16 / 0.25))  # 18.0618 dB
    assert psnr(X, REF, data_range=2.0) == pytest.approx(10 * math.log10(4 / 0.25))  # 12.0412 dB
    assert relative_error(X, REF) == pytest.approx(1 / math.sqrt(39))
    assert sqnr(X, REF) == pytest.approx(10 * math.log10(39))  # 15.9106 dB
    assert max_abs(X, REF) == 1.0
    c = correctness(X, REF, reference="hand", data_range=2.0)
    assert (c.reference, c.data_range) == ("hand", 2.0)
    assert c.psnr_db == pytest.approx(10 * math.log10(16)) and c.sqnr_db == pytest.approx(10 * math.log10(39))
    assert c.rel_error == pytest.approx(39**-0.5) and c.max_abs == 1.0
    assert correctness(X, REF, reference="hand", psnr_too=False).psnr_db is None


def test_identical_and_degenerate_inputs():
    assert psnr(REF, REF) == math.inf and sqnr(REF, REF) == math.inf
    assert relative_error(REF, REF) == 0.0 and max_abs(REF, REF) == 0.0
    zeros = torch.zeros(4)
    assert relative_error(zeros, zeros) == 0.0
    assert relative_error(X, zeros) == math.inf
    with pytest.raises(QualityError, match="reference is constant"):
        psnr(X, torch.ones(4))
    with pytest.raises(QualityError, match=r"shapes differ: output \(4,\) vs reference \(2, 2\)"):
        psnr(X, REF.reshape(2, 2))
    with pytest.raises(QualityError, match="empty"):
        sqnr(torch.empty(0), torch.empty(0))


def test_float64_accumulation_and_chunking_match_a_direct_computation(monkeypatch, rng_seed):
    ref = torch.randn(3, 1000, dtype=torch.float32)
    x = ref.to(torch.bfloat16)  # a bf16 output judged against an fp32 reference
    d = x.double() - ref.double()
    want_sqnr = 10 * math.log10(float((ref.double() ** 2).sum() / (d**2).sum()))
    want_rel = float(d.norm() / ref.double().norm())
    monkeypatch.setattr(quality_mod, "_CHUNK", 257)  # force many uneven chunks
    assert sqnr(x, ref) == pytest.approx(want_sqnr, rel=1e-12)
    assert relative_error(x, ref) == pytest.approx(want_rel, rel=1e-12)
    assert max_abs(x, ref) == pytest.approx(float(d.abs().max()))
    # bf16 keeps 8 significant bits: about 50 dB of SQNR for Gaussian data
    assert 45 < want_sqnr < 60


def test_as_tensor_finds_the_main_output():
    t = torch.ones(2)
    assert as_tensor(t) is t
    assert as_tensor(SimpleNamespace(sample=t)) is t
    assert as_tensor(SimpleNamespace(logits=t)) is t
    assert as_tensor(("text", t)) is t
    assert as_tensor({"a": t}) is t
    with pytest.raises(QualityError, match="cannot find a tensor"):
        as_tensor("nothing")


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 8)
        self.register_buffer("pos", torch.arange(8))  # an integer buffer must keep its dtype

    def forward(self, x, scale=1.0):
        return self.lin(x) * scale + self.pos

    def twice(self, x):
        return 2 * self(x)


def test_cpu_reference_runs_an_fp32_copy_and_leaves_the_module_alone(rng_seed):
    m = _Tiny().to(torch.bfloat16)
    weight = m.lin.weight
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    ref = cpu_reference(m, x, scale=3.0)
    assert ref.dtype == torch.float32
    want = (torch.nn.functional.linear(x.float(), weight.float(), m.lin.bias.float()) * 3.0 + torch.arange(8)).float()
    torch.testing.assert_close(ref, want, rtol=1e-6, atol=1e-6)
    # the module itself is untouched: same parameter object, still bf16
    assert m.lin.weight is weight and weight.dtype == torch.bfloat16 and m.pos.dtype == torch.int64
    torch.testing.assert_close(cpu_reference(m, x, method="twice"), 2 * cpu_reference(m, x))
    torch.testing.assert_close(
        cpu_reference(m, x, fn=lambda mm, xx: mm.lin(xx)),
        torch.nn.functional.linear(x.float(), weight.float(), m.lin.bias.float()),
    )
    with pytest.raises(QualityError, match="has no method 'encode'"):
        cpu_reference(m, x, method="encode")
    with pytest.raises(QualityError, match="nn.Module"):
        cpu_reference(lambda x: x, x)


def test_cpu_reference_refuses_meta_weights():
    with torch.device("meta"):
        m = _Tiny()
    with pytest.raises(QualityError, match="meta device"):
        cpu_reference(m, torch.randn(1, 16))
