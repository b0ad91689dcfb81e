"""mps_streams: the side-stream tile loop (gate, plans, exact output, unpatch identity).

On the CPU torch has no streams; the same code path runs in order there (SideStream on "cpu"), so
its output is checked against stock bit for bit. The real side stream is checked on CUDA (marker).
"""

from __future__ import annotations

import datetime as dt

import pytest
import torch

import mpsboost
from mpsboost import gate
from mpsboost.gate import Env, Rule
from mpsboost.recipes.vae import tiles as vae_tiles
from mpsboost.recipes.vae import common as vae_patch
from mpsboost.recipes.vae.families import family
from mpsboost.ops.streams import SideStream

pytest.importorskip("diffusers")
from diffusers import AutoencoderKLQwenImage, AutoencoderKLWan  # noqa: E402
from diffusers.models.autoencoders import autoencoder_kl_wan as wan  # noqa: E402

RECIPE = "mps_streams"
ON_CUDA = {RECIPE: {"on_cuda": True}}


def wan22() -> AutoencoderKLWan:
    vae = AutoencoderKLWan(
        base_dim=3,
        decoder_base_dim=4,
        z_dim=16,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        is_residual=True,
        in_channels=12,
        out_channels=12,
        patch_size=2,
        scale_factor_spatial=16,
        scale_factor_temporal=4,
        latents_mean=[0.0] * 16,
        latents_std=[1.0] * 16,
    ).eval()
    vae.enable_tiling(
        tile_sample_min_height=64, tile_sample_min_width=64, tile_sample_stride_height=32, tile_sample_stride_width=48
    )
    return vae


def qwen() -> AutoencoderKLQwenImage:
    vae = AutoencoderKLQwenImage(
        base_dim=8,
        z_dim=4,
        dim_mult=[1, 2, 2],
        num_res_blocks=1,
        temperal_downsample=[False, True],
        latents_mean=[0.0] * 4,
        latents_std=[1.0] * 4,
    ).eval()
    vae.enable_tiling(
        tile_sample_min_height=16, tile_sample_min_width=16, tile_sample_stride_height=8, tile_sample_stride_width=12
    )
    return vae


def _row(vae, **kw):
    rows = [r for r in mpsboost.plan(vae, recipes=[RECIPE], **kw).rows]
    assert len(rows) == 1
    return rows[0]


def test_plans_by_environment():
    vae = wan22()
    old = _row(vae, device="mps", torch_version="2.14.1")
    assert old.status == "skipped" and "pytorch#191415" in old.reason and "2.14.1" in old.reason
    # 2.15.0 ships torch.mps.Stream, but its Event raises off the default stream: no events across streams
    row = _row(vae, device="mps", torch_version="2.15.0")
    assert row.status == "skipped" and "pytorch#194111" in row.reason and "2.16" in row.reason
    assert "Non-default streams are not yet supported." in row.reason
    nightly = _row(vae, device="mps", torch_version="2.16.0.dev20261101")
    assert nightly.status == "would apply" and "side stream" in nightly.backing
    cpu = _row(vae, device="cpu", torch_version="2.13.0")
    assert cpu.status == "skipped" and "not available on cpu" in cpu.reason
    cuda = _row(vae, device="cuda", torch_version="2.11.0")
    assert cuda.status == "skipped" and "on_cuda" in cuda.reason  # opt-in there, with the measured reason
    cuda_on = _row(vae, device="cuda", torch_version="2.11.0", options=ON_CUDA)
    assert cuda_on.status == "would apply"


def test_nightly_merge_date_rule(monkeypatch):
    # The gate compares a 2.16 nightly's date with the merge date of pytorch#194111 (events across
    # streams) where it is known (FEATURES leaves it None while the pull request is open); with a date
    # set, nightlies before it are refused and later ones accepted.
    feat = gate.FEATURES["cross_stream_events"]
    merged = dt.date(2026, 9, 15)
    rules = dict(feat.rules)
    rules["mps"] = (Rule(since="2.16", nightly_only=True, upstream="pytorch#194111", merged=merged),)
    monkeypatch.setitem(
        gate.FEATURES, "cross_stream_events", gate.Feature(feat.name, feat.description, rules, feat.probe)
    )
    vae = qwen()
    before = _row(vae, device="mps", torch_version="2.16.0.dev20260901")
    after = _row(vae, device="mps", torch_version="2.16.0.dev20261001")
    assert before.status == "skipped" and "predates the merge" in before.reason and "2026-09-15" in before.reason
    assert after.status == "would apply"
    assert _row(vae, device="mps", torch_version="2.15.0").status == "skipped"


@pytest.mark.parametrize("make,latent", [(wan22, (1, 16, 3, 4, 6)), (qwen, (1, 4, 1, 4, 6))])
def test_patched_output_is_stock_bit_for_bit(make, latent, rng_seed):
    vae = make()
    z = torch.randn(latent)
    before = vae.__dict__.get("tiled_decode")
    with torch.no_grad():
        ref = vae.decode(z).sample
    # A simulated CUDA environment applies the recipe; on this CPU the side stream runs in order.
    report = mpsboost.patch(vae, recipes=[RECIPE], device=Env.simulate("cuda", "2.11.0"), options=ON_CUDA)
    assert [r.status for r in report.rows] == ["applied"]
    assert vae.__dict__.get("tiled_decode") is not None
    with torch.no_grad():
        out = vae.decode(z).sample
    mpsboost.unpatch(vae)
    assert vae.__dict__.get("tiled_decode") is before
    assert torch.equal(out, ref)
    with torch.no_grad():
        assert torch.equal(vae.decode(z).sample, ref)


def test_side_stream_loop_with_the_pad_recipe(rng_seed):
    # Both recipes together: the streams loop runs the folded convolutions; unpatch unwinds both.
    vae = wan22()
    z = torch.randn(1, 16, 2, 4, 6)
    with torch.no_grad():
        ref = vae.decode(z).sample
        env = Env.simulate("cuda", "2.11.0")
        opts = {**ON_CUDA, "wan_vae_pad": {"layout": "contiguous", "fused_norm": False}}
        with mpsboost.patched(vae, recipes=["wan_vae_pad", RECIPE], device=env, options=opts) as report:
            assert [r.recipe for r in report.rows if r.status == "applied"] == ["wan_vae_pad", RECIPE]
            out = vae.decode(z).sample
    # The folded 2-D convolution of the first frame sums in another order: as tests/recipes/vae/test_wan_vae.py,
    # a bound of 5e-5 on outputs of magnitude <= 1 (1.37e-5 seen over random seeds), and relative 1e-5.
    assert (out - ref).abs().max().item() <= 5e-5
    assert ((out - ref).norm() / ref.norm()).item() <= 1e-5
    assert "tiled_decode" not in vae.__dict__ and "_decode" not in vae.__dict__


def test_side_stream_helper_on_cpu_runs_in_order():
    s = SideStream("cpu")
    assert not s.accelerated
    s.fork()
    with s:
        t = torch.ones(3) * 2
    s.keep(t)
    s.join()
    assert torch.equal(t, torch.full((3,), 2.0))
    vae = wan22()
    spec = vae_patch.loop_spec(vae, family("wan"), patchify=wan.patchify, unpatchify=wan.unpatchify)
    z = torch.randn(1, 16, 2, 4, 6)
    with torch.no_grad():
        assert torch.equal(
            vae_tiles.tiled_decode(vae, z, spec, side=SideStream("cpu")), vae_tiles.tiled_decode(vae, z, spec)
        )


@pytest.mark.cuda
def test_cuda_side_stream_equals_stock():
    vae = wan22().to("cuda")
    z = torch.randn(1, 16, 3, 4, 6, device="cuda")
    with torch.no_grad():
        ref = vae.decode(z).sample
        with mpsboost.patched(vae, recipes=[RECIPE], options=ON_CUDA) as report:
            assert report.rows[0].status == "applied"
            out = vae.decode(z).sample
    torch.cuda.synchronize()
    assert torch.equal(out, ref)


def test_opt_in_everywhere_as_the_doctor_says(capsys):
    """Never measured harmless (no MPS record; no gain on an H200): a plain patch() leaves it out even on
    an MPS build with user streams, naming it applies it there, and the doctor's tag says so."""
    import json

    from mpsboost.cli import main as cli_main
    from mpsboost.registry import get_recipe

    nightly = Env.simulate("mps", "2.16.0.dev20271231")
    assert gate.check("device_streams", nightly).ok and gate.check("cross_stream_events", nightly).ok
    assert get_recipe(RECIPE).default is False
    vae = wan22()
    default = mpsboost.plan(vae, env=nightly)
    assert RECIPE not in default.recipes() and "wan_vae_pad" in default.recipes("would apply")
    named = mpsboost.plan(vae, env=nightly, recipes=["wan_vae_pad", RECIPE])
    assert {r.status for r in named.rows_for(RECIPE)} == {"would apply"}
    assert cli_main(["doctor", "--json"]) == 0
    recipes = {r["name"]: r for r in json.loads(capsys.readouterr().out)["recipes"]}
    assert recipes[RECIPE]["default"] is False and recipes["wan_vae_pad"]["default"] is True
