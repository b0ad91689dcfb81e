"""The two probes for the strided-view MPS bugs behind black images on Macs (ComfyUI#10681): SDPA on non-contiguous
q/k/v (pytorch#163597, #181133) and a convolution of a chunk() view at batch > 1 (pytorch#169342).

No Mac here: a buggy build is simulated by a Ctx whose 'device' is the CPU marked as MPS, with the op under test
replaced by one that goes wrong the way the issue describes (only for strided inputs; only past the first batch
element); the same probe on a correct op says 'fixed'; on the CPU it runs its reference logic and says
'not applicable'.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mpsboost import gate
from mpsboost.selftest import PROBES, decisions, probes


class _Mps:
    """A Ctx on 'mps' whose tensors stay on the CPU (what the probes compare is all that changes)."""

    device, small, repeats = "mps", True, 1

    def to(self, x):
        return x.clone()


def test_on_the_cpu_each_runs_its_reference_and_says_not_applicable():
    for name in ("sdpa_strided", "conv_chunk_batch"):
        rec = probes.run_probe(PROBES[name], "cpu", small=True)
        assert rec["verdict"] == "not applicable" and rec["detail"].startswith("MPS-only bug; on cpu"), rec
        errs = rec["measured"]["rel_errors"]
        assert len(errs) >= 3 and max(errs.values()) < 1e-6, errs  # the CPU reads strides right: views == copies


def test_sdpa_probe_finds_a_kernel_that_ignores_the_query_strides(monkeypatch):
    real = F.scaled_dot_product_attention

    def wrong_on_strided(q, k, v, *a, **kw):
        # pytorch#163597: the fast kernel read the query as if dense; here: the dense reading of its storage
        if not q.is_contiguous():
            q = torch.as_strided(q, q.shape, torch.empty(q.shape).stride(), q.storage_offset())
        return real(q, k, v, *a, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", wrong_on_strided)
    bad = probes._sdpa_strided(_Mps())
    assert bad["verdict"] == "has the bug", bad
    assert all(e > 1e-2 for e in bad["measured"]["rel_errors"].values()), bad["measured"]
    assert "transposed query" in bad["detail"] and "qkv.chunk(3, -1)" in bad["detail"]
    monkeypatch.setattr(F, "scaled_dot_product_attention", real)
    assert probes._sdpa_strided(_Mps())["verdict"] == "fixed"


def test_conv_probe_finds_a_kernel_right_for_the_first_batch_element_only(monkeypatch):
    real2, real3 = F.conv2d, F.conv3d

    def first_only(real):
        def conv(x, w, *a, **kw):
            out = real(x, w, *a, **kw)
            if x.shape[0] > 1 and not x.is_contiguous():  # pytorch#169342: elements after the first are wrong
                out = out.clone()
                out[1:] = real(x[:1].expand_as(x), w, *a, **kw)[1:]  # the first element's data read again
            return out

        return conv

    monkeypatch.setattr(F, "conv2d", first_only(real2))
    monkeypatch.setattr(F, "conv3d", first_only(real3))
    bad = probes._conv_chunk_batch(_Mps())
    m = bad["measured"]
    assert bad["verdict"] == "has the bug", bad
    assert all(m["first"][k] < 1e-6 and m["others"][k] > 0.1 for k in m["rel_errors"]), m
    assert "chunk(2, dim=1)" in bad["detail"] and "first element" in bad["detail"]
    monkeypatch.setattr(F, "conv2d", real2)
    monkeypatch.setattr(F, "conv3d", real3)
    assert probes._conv_chunk_batch(_Mps())["verdict"] == "fixed"


def test_each_backs_a_gate_row_that_names_the_issue_and_is_off_on_every_mac_release():
    rows = {r["feature"]: r for r in decisions()}
    for probe, feature, issue in (
        ("sdpa_strided", "sdpa_strided_correct", "pytorch#163597"),
        ("conv_chunk_batch", "conv_strided_batch_correct", "pytorch#169342"),
    ):
        p = PROBES[probe]
        assert p.feature == feature and issue in p.upstream[0] and "ComfyUI#10681" in p.upstream
        assert rows[feature]["selftest_probes"] == [probe] and issue in rows[feature]["upstream"]
        for v in ("2.14.1", "2.15.0", "2.16.0.dev20261201"):
            assert not gate.check(feature, gate.Env.simulate("mps", v)).ok  # no release known fixed: routed around
        assert gate.check(feature, gate.Env.simulate("cpu")).ok and gate.check(feature, gate.Env.simulate("cuda")).ok
