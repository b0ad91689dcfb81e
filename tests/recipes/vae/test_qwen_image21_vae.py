"""qwen_image_vae on a tiny real Qwen-Image-2.1 VAE (``AutoencoderKLQwenImage21``; random weights,
fresh random inputs per test).

Pads are counted at the aten level (``mpsboost.bench.count_pad5d``, every rank in ``by_rank``): a
stock roundtrip runs 4-D ``constant_pad_nd`` before every frame convolution and 5-D ones in the
encoder's ``AvgDown3D`` blocks; patched, none, in every simulated environment.

Tolerances: fp32 relative error ||patched - stock|| / ||stock|| <= 1e-5 (the fold itself is
bit-exact on the CPU; the channels-last path of CUDA rounds the fused RMS norm differently, ~1e-7);
bf16 relative error <= 2e-2.
"""

from __future__ import annotations

import gc
import weakref
from unittest import mock

import pytest
import torch

import mpsboost
from mpsboost.bench import relative_error
import tiny_models as tm
from mpsboost.bench import count_pad5d
from mpsboost.errors import NotPatchedError, PatchError
from mpsboost.gate import Env

pytest.importorskip("diffusers")
from diffusers.models.autoencoders import autoencoder_kl_qwenimage21 as q21  # noqa: E402

RECIPE = "qwen_image_vae"
NAME = "qwen_image21_vae"  # the tiny model of tests/tiny_models.py (spatial factor 8, RGBA)
# Tiles of 2 latent pixels (16 px) with strides of 1 and 2 latent pixels: a 16x24 image gives a 2x2 grid or more.
TILES = dict(
    tile_sample_min_height=16, tile_sample_min_width=16, tile_sample_stride_height=8, tile_sample_stride_width=16
)
ENVS = {
    "mps 2.14.1": Env.simulate("mps", "2.14.1"),
    "mps 2.15.0": Env.simulate("mps", "2.15.0"),
    "cuda sm90": Env.simulate("cuda:9.0"),
    "cpu": Env.detect("cpu"),
}


def tiny():
    return tm.build(NAME, seed=torch.randint(0, 2**31, ()).item())


def image(h: int, w: int) -> torch.Tensor:
    return torch.rand(1, 4, 1, h, w) * 2 - 1


def roundtrip(vae, x):
    with torch.no_grad():
        z = vae.encode(x).latent_dist.mode()
        return z, vae.decode(z).sample


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return relative_error(a, b)


# Tiled only where the code differs (contiguous vs channels-last with the fused norm): the tile loop is the same.
CASES = [(e, False) for e in ENVS] + [("mps 2.14.1", True), ("cuda sm90", True)]


@pytest.mark.parametrize("env_name,tiled", CASES)
def test_roundtrip_runs_no_pad_at_the_aten_level_and_equals_stock(env_name, tiled, rng_seed):
    vae = tiny()
    x = image(16, 24) if tiled else image(32, 40)
    if tiled:
        vae.enable_tiling(**TILES)
    with count_pad5d() as stock:
        z_ref, ref = roundtrip(vae, x)
    # The stock roundtrip pads 4-D (frame convolutions, ZeroPad2d) and 5-D (AvgDown3D): a patched
    # count of 0 below is the recipe's doing.
    assert stock.by_rank.get(4, 0) > 0 and stock.by_rank.get(5, 0) > 0
    with mpsboost.patched(vae, recipes=[RECIPE], device=ENVS[env_name]) as report:
        row = report.rows[0]
        assert (row.status, row.target) == ("applied", "<root>")
        assert row.backing.startswith("conv2d padding fold")
        with count_pad5d() as patched:
            z, out = roundtrip(vae, x)
    assert patched.all_ranks == 0, patched.to_dict()
    assert out.shape == ref.shape and out.is_contiguous()
    assert rel(z, z_ref) <= 1e-5 and rel(out, ref) <= 1e-5


def test_every_frame_convolution_avg_down_and_zero_pad_is_patched():
    vae = tiny()
    with mpsboost.patched(vae, recipes=[RECIPE]) as report:
        d = report.rows[0].details
        convs = [m for m in vae.modules() if isinstance(m, q21.QwenImage21CausalConv3d)]
        avg = [m for m in vae.modules() if isinstance(m, q21.QwenImage21AvgDown3D)]
        assert d["causal_convs"] == len(convs) == sum(vae._cached_conv_counts.values()) + 2  # + quant convs
        assert d["avg_down"] == len(avg) > 0 and d["zero_pads"] > 0
        assert all("forward" in m.__dict__ for m in convs + avg)
        assert d["whole_vae"] is True


@pytest.mark.slow
def test_mps_2141_where_the_rank5_fault_triggers(rng_seed):
    # pytorch#194922 corrupts constant time padding of rank-5 tensors once H*W >= 65536; in this VAE
    # those pads are the encoder's AvgDown3D ones (QwenLM/Qwen-Image-2.1#6). A 256x256 image reaches
    # that size at the first AvgDown3D. Patched for a simulated MPS 2.14.1: no pad of any rank.
    vae = tiny()
    x = image(256, 256)
    with count_pad5d() as stock:
        z_ref, ref = roundtrip(vae, x)
    assert stock.by_op["constant_pad_nd"] > 0
    with mpsboost.patched(vae, recipes=[RECIPE], device=ENVS["mps 2.14.1"]), count_pad5d() as patched:
        z, out = roundtrip(vae, x)
    assert patched.all_ranks == 0
    assert rel(z, z_ref) <= 1e-5 and rel(out, ref) <= 1e-5


def test_bf16_within_stated_tolerance(rng_seed):
    vae = tiny().to(torch.bfloat16)
    x = image(32, 32).to(torch.bfloat16)
    z_ref, ref = roundtrip(vae, x)
    with mpsboost.patched(vae, recipes=[RECIPE], device=ENVS["mps 2.14.1"]), count_pad5d() as pads:
        z, out = roundtrip(vae, x)
    assert pads.all_ranks == 0 and out.dtype == torch.bfloat16
    assert rel(z.float(), z_ref.float()) <= 2e-2 and rel(out.float(), ref.float()) <= 2e-2


def test_more_frames_or_a_cache_raise_as_in_diffusers():
    # The 2.1 convolutions are for single images: diffusers refuses a cache; the patched forward hands
    # such calls to the stock forward, so the error is diffusers' own.
    vae = tiny()
    conv = vae.encoder.conv_in
    x = torch.randn(1, 4, 1, 8, 8)
    with pytest.raises(ValueError, match="cannot take a feature cache") as stock_err:
        conv(x, x)
    with mpsboost.patched(vae, recipes=[RECIPE]):
        assert "forward" in conv.__dict__
        with pytest.raises(ValueError, match="cannot take a feature cache") as err:
            conv(x, x)
        with pytest.raises(RuntimeError):
            conv(torch.randn(1, 4, 2, 8, 8))  # two frames: Conv2d refuses a 5-D input, as stock does
    assert str(err.value) == str(stock_err.value)


def test_unpatch_restores_the_very_same_objects(rng_seed):
    vae = tiny()
    methods = {a: vae.__dict__.get(a) for a in ("_decode", "_encode", "tiled_decode", "tiled_encode")}
    params = dict(vae.named_parameters())
    x = image(16, 16)
    z_ref, ref = roundtrip(vae, x)
    before = tm.snapshot(vae)  # after a first call: diffusers' clear_cache adds instance attributes then
    mpsboost.patch(vae, recipes=[RECIPE], options={RECIPE: {"layout": "channels_last"}})
    assert any(not p.is_contiguous() for p in vae.parameters())  # channels-last weights while patched
    mpsboost.unpatch(vae)
    assert tm.diff_snapshot(before, tm.snapshot(vae)) == []
    assert all(vae.__dict__.get(a) is v for a, v in methods.items())
    assert all(p is params[n] and p.is_contiguous() for n, p in vae.named_parameters())
    z, out = roundtrip(vae, x)
    assert torch.equal(z, z_ref) and torch.equal(out, ref)


def test_a_dropped_patched_vae_is_freed():
    vae = tiny()
    mpsboost.patch(vae, recipes=[RECIPE], device=ENVS["mps 2.14.1"])
    roundtrip(vae, image(16, 16))
    ref = weakref.ref(vae)
    del vae
    gc.collect()
    assert ref() is None


def test_failure_part_way_leaves_the_vae_as_it_was():
    # The 5th binding fails (a frame convolution deep in the encoder): everything bound before it is undone.
    from mpsboost.recipes.vae import common as _vae

    vae = tiny()
    before = tm.snapshot(vae)
    real = _vae.bind_module_forward
    calls = [0]

    def failing(*a, **k):
        calls[0] += 1
        if calls[0] == 5:
            raise RuntimeError("injected")
        return real(*a, **k)

    with mock.patch.object(_vae, "bind_module_forward", side_effect=failing), pytest.raises(PatchError) as info:
        mpsboost.patch(vae, recipes=[RECIPE], device=ENVS["mps 2.14.1"])
    assert info.value.recipe == RECIPE and isinstance(info.value.__cause__, RuntimeError)
    assert calls[0] == 5
    assert tm.diff_snapshot(before, tm.snapshot(vae)) == []
    with pytest.raises(NotPatchedError):
        mpsboost.unpatch(vae)


def test_plan_under_mac_and_other_decisions():
    vae = tiny()
    stock_plan = mpsboost.plan(vae, device="mps", torch_version="2.14.1")
    rows = [r for r in stock_plan.rows if r.status == "would apply"]
    assert [(r.recipe, r.backing) for r in rows] == [(RECIPE, "conv2d padding fold")]
    old = rows[0]
    assert "avoids pytorch#195368" in old.reason and "pytorch#194922" in old.reason and "Qwen-Image-2.1#6" in old.reason
    assert "2-D conv" not in old.reason  # the 1.0 VAE's single-frame note does not apply: these are 2-D already
    new = mpsboost.plan(vae, device="mps", torch_version="2.15.0", recipes=[RECIPE]).rows[0]
    assert new.status == "would apply" and "for speed:" in new.reason and new.backing == "conv2d padding fold"
    assert "Qwen-Image-2.1#6" not in new.reason
    cuda = mpsboost.plan(vae, device="cuda", torch_version="2.11.0", recipes=[RECIPE]).rows[0]
    assert cuda.backing == "conv2d padding fold + channels-last, fused RMS norm" and "for speed:" in cuda.reason


def test_bare_decoder_is_patched_without_the_tile_loop(rng_seed):
    vae = tiny()
    z = torch.randn(1, 4, 1, 4, 4)
    with torch.no_grad():
        ref = vae.decoder(z, first_chunk=True)
    with mpsboost.patched(vae.decoder, recipes=[RECIPE], device=ENVS["mps 2.14.1"]) as report:
        assert report.rows[0].details["whole_vae"] is False
        with torch.no_grad(), count_pad5d() as pads:
            out = vae.decoder(z, first_chunk=True)
    assert pads.all_ranks == 0 and rel(out, ref) <= 1e-5


def test_patched_down_block_traces_fullgraph(rng_seed):
    # One residual down block holds every forward the recipe installs: frame convolutions (fold),
    # RMS norms and SiLUs (fused / in place on the simulated CUDA path), the AvgDown3D shortcut (zero
    # slab) and the downsampler's ZeroPad2d (buffer copy). fullgraph=True raises on any graph break.
    vae = tiny()
    block = vae.encoder.down_blocks[1]  # a time-and-space AvgDown3D (factor_t 2): the zero-slab path
    assert block.avg_shortcut.factor_t == 2 and block.downsampler is not None
    x = torch.randn(1, block.avg_shortcut.in_channels, 1, 8, 8)
    with torch.no_grad():
        ref = block(x)
    torch._dynamo.reset()
    try:
        with mpsboost.patched(vae, recipes=[RECIPE], device=ENVS["cuda sm90"]), torch.no_grad():
            out = torch.compile(block, fullgraph=True, backend="eager")(x)
    finally:
        torch._dynamo.reset()
    assert rel(out, ref) <= 1e-5


def test_the_harness_counter_sees_pads_of_every_rank():
    # The counter the assertions above rely on: 4-D pads go to by_rank only, 5-D ones to both.
    import torch.nn.functional as F

    x = torch.randn(1, 2, 1, 4, 4)
    with count_pad5d() as c:
        F.pad(x.squeeze(2), (1, 1, 1, 1))  # what the stock frame convolution does
        torch.nn.ZeroPad2d((0, 1, 0, 1))(x.squeeze(2))
        F.pad(x, (0, 0, 0, 0, 1, 0))  # AvgDown3D's time pad
    assert c.by_rank == {4: 2, 5: 1} and c.all_ranks == 3 and c.total == 1
    assert c.to_dict()["by_rank"] == {"4": 2, "5": 1}
