"""The VAE recipes' folded convolutions never take a strided view on MPS (issue pytorch#169342: a convolution of a
chunk() view or a frame slice is right for the first batch element only; gate conv_strided_batch_correct).

diffusers' causal convolutions ``F.pad`` every input, a fresh dense copy; with the padding folded into the
convolution, the frame loop's slices (``x[:, :, :1]`` of a batch of videos, the frames kept past a longer cache)
would reach the convolution as they are. Under Mac decisions the recipes copy such a view first; elsewhere
they do not (the CPU and CUDA read strides right), which is how the test knows it can see a strided input.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import mpsboost
from mpsboost.bench import relative_error
import tiny_models as tm
from mpsboost.bench.decode_cost import OpRecorder
from mpsboost.gate import Env

CONVS = {"convolution", "conv2d", "conv3d", "_convolution"}


def _dense(t: torch.Tensor) -> bool:
    fmt = torch.channels_last_3d if t.dim() == 5 else torch.channels_last
    return t.is_contiguous() or (t.dim() in (4, 5) and t.is_contiguous(memory_format=fmt))


def _run(vae, x):
    """The roundtrip's output and the shapes of the strided inputs of its convolutions (batch > 1 only)."""
    strided = []

    def note(func, args, kwargs, out):
        if func.overloadpacket.__name__ in CONVS and args[0].shape[0] > 1 and not _dense(args[0]):
            strided.append((tuple(args[0].shape), tuple(args[0].stride())))

    with torch.no_grad(), OpRecorder(note):
        out = vae(x, sample_posterior=False).sample
    return out, strided


@pytest.mark.parametrize("name,release", [("wan21_vae", "2.15.0"), ("wan22_vae", "2.14.1")])
def test_under_mac_decisions_every_folded_convolution_gets_a_dense_input(name, release):
    stock = tm.build(name)
    mac, cpu = copy.deepcopy(stock), copy.deepcopy(stock)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rep_mac = mpsboost.patch(mac, device=Env.simulate("mps", release))
        rep_cpu = mpsboost.patch(cpu, device=Env.simulate("cpu"))
    (row,) = [r for r in rep_mac.applied if r.recipe == "wan_vae_pad"]
    assert "pytorch#169342" in row.reason and row.details["dense_inputs"] is True
    assert all("pytorch#169342" not in r.reason for r in rep_cpu.applied)
    chans = stock.config.in_channels // (stock.config.patch_size or 1) ** 2
    g = torch.Generator().manual_seed(4)
    x = torch.rand(2, chans, 5, 32, 32, generator=g) * 2 - 1  # two videos: the batch the bug needs
    with torch.no_grad():
        ref = stock(x, sample_posterior=False).sample
    out_cpu, strided_cpu = _run(cpu, x)
    out_mac, strided_mac = _run(mac, x)
    assert strided_cpu, "the fold hands no strided view to a convolution here: this test could not see the bug"
    assert not strided_mac, strided_mac
    for out in (out_cpu, out_mac):  # the copy changes no value: the same as stock, each batch element
        for b in range(2):
            assert relative_error(out[b], ref[b]) < 1e-5
    mpsboost.unpatch(mac)
    assert not _run(mac, x)[1]  # stock again: diffusers' F.pad copies every input
