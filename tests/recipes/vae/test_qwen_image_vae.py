"""qwen_image_vae on a tiny real Qwen-Image VAE (random weights, fresh random inputs per test).

Tolerances: fp32 max abs difference <= 1e-5 against stock; bf16 relative error <= 2e-2.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

import mpsboost

pytest.importorskip("diffusers")
from diffusers import AutoencoderKLQwenImage  # noqa: E402
from diffusers.models.autoencoders import autoencoder_kl_qwenimage as qwen  # noqa: E402

RECIPE = "qwen_image_vae"
# Tiles of 4 latent pixels (spatial factor 4), strides of 2 and 3 latent pixels.
TILES = dict(
    tile_sample_min_height=16, tile_sample_min_width=16, tile_sample_stride_height=8, tile_sample_stride_width=12
)


def tiny() -> AutoencoderKLQwenImage:
    # Two downsampling levels; base_dim 8 keeps the channel RMS norms well conditioned.
    return AutoencoderKLQwenImage(
        base_dim=8,
        z_dim=4,
        dim_mult=[1, 2, 2],
        num_res_blocks=1,
        temperal_downsample=[False, True],
        latents_mean=[0.0] * 4,
        latents_std=[1.0] * 4,
    ).eval()


@contextlib.contextmanager
def counting(name: str):
    """Count calls of torch.nn.functional.<name> inside the block (wrapped in this test only)."""
    real = getattr(F, name)
    calls = [0]

    def wrapped(*a, **k):
        calls[0] += 1
        return real(*a, **k)

    with mock.patch(f"torch.nn.functional.{name}", wrapped):
        yield calls


def roundtrip(vae, x):
    with torch.no_grad():
        z = vae.encode(x).latent_dist.mode()
        return z, vae.decode(z).sample


@pytest.mark.parametrize("tiled,frames", [(False, 1), (False, 5), (True, 1), (True, 5)])
def test_patched_matches_stock_fp32_and_calls_no_pad(tiled, frames, rng_seed):
    vae = tiny()
    if tiled:
        vae.enable_tiling(**TILES)
        x = torch.rand(1, 3, frames, 16, 24) * 2 - 1
    else:
        x = torch.rand(1, 3, frames, 24, 32) * 2 - 1
    with counting("pad") as stock_pads:
        z_ref, ref = roundtrip(vae, x)
    with mpsboost.patched(vae, recipes=[RECIPE]) as report:
        assert report.rows[0].backing == "conv padding fold, 2-D conv for single frame"
        with counting("pad") as pads:
            z, out = roundtrip(vae, x)
    assert stock_pads[0] > 0 and pads[0] == 0
    assert (z - z_ref).abs().max().item() <= 1e-5
    assert (out - ref).abs().max().item() <= 1e-5


def test_image_roundtrip_runs_no_3d_convolution(rng_seed):
    # Structural proof of the 2-D path: a single-frame roundtrip calls conv3d zero times.
    vae = tiny()
    x = torch.rand(1, 3, 1, 32, 32) * 2 - 1
    z_ref, ref = roundtrip(vae, x)
    with counting("conv3d") as stock3d:
        roundtrip(vae, x)
    with mpsboost.patched(vae, recipes=[RECIPE]), counting("conv3d") as c3d, counting("conv2d") as c2d:
        z, out = roundtrip(vae, x)
    assert stock3d[0] > 0
    assert c3d[0] == 0 and c2d[0] >= stock3d[0]
    assert (out - ref).abs().max().item() <= 1e-5


def test_single_frame_path_equals_the_3d_path(rng_seed):
    vae = tiny()
    x = torch.rand(1, 3, 1, 24, 24) * 2 - 1
    with mpsboost.patched(vae, recipes=[RECIPE], options={RECIPE: {"single_frame_2d": False}}):
        z3, out3 = roundtrip(vae, x)
    with mpsboost.patched(vae, recipes=[RECIPE]):
        z2, out2 = roundtrip(vae, x)
    assert (z2 - z3).abs().max().item() <= 1e-5
    assert (out2 - out3).abs().max().item() <= 1e-5


def test_bf16_within_stated_tolerance(rng_seed):
    vae = tiny().to(torch.bfloat16)
    vae.enable_tiling(**TILES)
    x = (torch.rand(1, 3, 1, 16, 24) * 2 - 1).to(torch.bfloat16)
    z_ref, ref = roundtrip(vae, x)
    with mpsboost.patched(vae, recipes=[RECIPE]), counting("pad") as pads:
        z, out = roundtrip(vae, x)
    assert pads[0] == 0
    for a, b in ((z, z_ref), (out, ref)):
        assert ((a.float() - b.float()).norm() / b.float().norm()).item() <= 2e-2


def test_channels_last_and_fused_norm_path(rng_seed):
    vae = tiny()
    x = torch.rand(1, 3, 1, 24, 32) * 2 - 1
    z_ref, ref = roundtrip(vae, x)
    with mpsboost.patched(vae, recipes=[RECIPE], options={RECIPE: {"layout": "channels_last"}}) as report:
        assert report.rows[0].details["fused_norm"] is True  # follows the layout by default
        z, out = roundtrip(vae, x)
    assert out.is_contiguous() and z.is_contiguous()
    assert (z - z_ref).abs().max().item() <= 1e-5
    assert (out - ref).abs().max().item() <= 1e-5


def test_unpatch_restores_identical_forwards_and_results(rng_seed):
    vae = tiny()
    before = {n: m.__dict__.get("forward") for n, m in vae.named_modules()}
    methods = {a: vae.__dict__.get(a) for a in ("_decode", "_encode", "tiled_decode", "tiled_encode")}
    weights = {n: p for n, p in vae.named_parameters()}
    x = torch.rand(1, 3, 1, 16, 16) * 2 - 1
    z_ref, ref = roundtrip(vae, x)
    mpsboost.patch(vae, recipes=[RECIPE], options={RECIPE: {"layout": "channels_last"}})
    assert all("forward" in m.__dict__ for m in vae.modules() if isinstance(m, qwen.QwenImageCausalConv3d))
    mpsboost.unpatch(vae)
    assert all(m.__dict__.get("forward") is before[n] for n, m in vae.named_modules())
    assert all(vae.__dict__.get(a) is v for a, v in methods.items())
    assert all(p is weights[n] and p.is_contiguous() for n, p in vae.named_parameters())
    z, out = roundtrip(vae, x)
    assert torch.equal(z, z_ref) and torch.equal(out, ref)


def test_plan_reasons_mps_2141_vs_2150():
    vae = tiny()
    old = mpsboost.plan(vae, device="mps", torch_version="2.14.1", recipes=[RECIPE]).rows[0]
    new = mpsboost.plan(vae, device="mps", torch_version="2.15.0", recipes=[RECIPE]).rows[0]
    assert old.status == new.status == "would apply"
    assert old.backing == new.backing == "conv padding fold, 2-D conv for single frame"
    assert "avoids pytorch#195368" in old.reason and "pytorch#194922" in old.reason
    assert "for speed:" in new.reason
    cuda = mpsboost.plan(vae, device="cuda", torch_version="2.11.0", recipes=[RECIPE]).rows[0]
    assert "channels-last" in cuda.backing and "for speed:" in cuda.reason


def test_qwen_image_pipeline_patch(rng_seed):
    import tiny_models

    pipe = tiny_models.build("qwen_image_pipeline")
    ref = tiny_models.run("qwen_image_pipeline", pipe, rng_seed, size=32, steps=1)
    with mpsboost.patched(pipe, recipes=[RECIPE]) as report:
        rows = [r for r in report.rows if r.recipe == RECIPE]
        assert [(r.target, r.status) for r in rows] == [("vae", "applied")]
        with counting("pad") as pads, counting("conv3d") as c3d:
            out = tiny_models.run("qwen_image_pipeline", pipe, rng_seed, size=32, steps=1)
    assert pads[0] == 0 and c3d[0] == 0
    assert (out - ref).abs().max().item() <= 1e-4


def test_qwen_image_edit_pipeline_patch(rng_seed):
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageEditPipeline

    pipe = QwenImageEditPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=tiny(),
        text_encoder=None,
        tokenizer=None,
        processor=None,
        transformer=None,
    )
    x = torch.rand(1, 3, 1, 16, 16) * 2 - 1
    z_ref, ref = roundtrip(pipe.vae, x)
    with mpsboost.patched(pipe, recipes=[RECIPE]) as report:
        assert [(r.target, r.status) for r in report.rows] == [("vae", "applied")]
        with counting("pad") as pads:
            z, out = roundtrip(pipe.vae, x)
    assert pads[0] == 0 and (out - ref).abs().max().item() <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("frames", [1, 5])
def test_no_5d_pad_where_the_mps_fault_triggers(frames, rng_seed):
    # pytorch#194922 corrupts constant time-padding of rank-5 tensors once H*W >= 65536 (the cause of
    # ComfyUI#16433). This tiny VAE (spatial factor 4) decodes a 64x64 latent to 256x256 = 65536 pixels.
    # Patched for a simulated MPS 2.14.1, no pad of a rank-5 tensor runs (aten level); for a video the
    # 3-D convolutions still see inputs of that size. Results equal stock within 1e-4 (the single-frame
    # 2-D convolution sums in another order; more terms at this size than in the small tests).
    import tiny_models as tm
    from mpsboost.gate import Env

    vae = tiny()
    x = torch.rand(1, 3, frames, 256, 256) * 2 - 1
    with tm.Pad5dCounter() as stock:
        z_ref, ref = roundtrip(vae, x)
    assert any(s[3] * s[4] >= 65536 for _, s in stock.calls)
    with mpsboost.patched(vae, recipes=[RECIPE], device=Env.simulate("mps", "2.14.1")) as report:
        assert report.rows[0].status == "applied"
        with tm.Pad5dCounter() as patched:
            z, out = roundtrip(vae, x)
    assert patched.calls == []
    if frames > 1:
        assert any(len(s) == 5 and s[3] * s[4] >= 65536 for s in patched.conv_inputs)
    assert (z - z_ref).abs().max().item() <= 1e-4 and (out - ref).abs().max().item() <= 1e-4
