"""video_vae_pad on tiny real diffusers video VAEs (random weights, fresh random inputs per test).

Patched for a simulated MPS 2.14.1 (the builds with the 5-D pad faults) and run on the CPU: every
pad of a rank-5 tensor is counted at the aten level (``constant_pad_nd``, ``replication_pad3d``,
``reflection_pad3d``, ``pad``). Tolerance: none. The pads become copies of the same values and the
folded convolutions read the same zeros at the border, so encode and decode are bit-identical to
stock in fp32 and bf16.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mpsboost
from mpsboost.gate import Env
from mpsboost.ops import pad5d as p5

pytest.importorskip("diffusers")
import tiny_models as tm  # noqa: E402

RECIPE = "video_vae_pad"
MPS_OLD = Env.simulate("mps", "2.14.1")


def forwards(vae) -> dict:
    return {name: m.__dict__.get("forward", None) for name, m in vae.named_modules()}


@pytest.mark.parametrize("name", tm.VIDEO_VAE_NAMES)
def test_no_5d_pad_bit_exact_and_unpatch_restores(name, rng_seed):
    vae = tm.build_video_vae(name, seed=rng_seed)
    x = tm.video_vae_input(name, rng_seed)
    before = forwards(vae)
    with tm.Pad5dCounter() as stock:
        z_ref, ref = tm.video_vae_roundtrip(vae, x)
    report = mpsboost.patch(vae, recipes=[RECIPE], device=MPS_OLD)
    try:
        (row,) = report.rows
        assert row.status == "applied", row.reason
        assert "pytorch#195368" in row.reason and "2.14.1" in row.reason
        with tm.Pad5dCounter() as patched:
            z, out = tm.video_vae_roundtrip(vae, x)
    finally:
        mpsboost.unpatch(vae)
    assert stock.calls, "the stock VAE pads 5-D tensors: the zero below proves the patch removes them"
    assert patched.calls == []
    assert torch.equal(z, z_ref) and torch.equal(out, ref)
    after = forwards(vae)
    assert all(after[k] is before[k] for k in before)
    assert not any("_mpsboost_patches" in m.__dict__ for m in vae.modules())
    with tm.Pad5dCounter() as again:
        z2, out2 = tm.video_vae_roundtrip(vae, x)
    assert len(again.calls) == len(stock.calls) and torch.equal(out2, ref)


@pytest.mark.parametrize("name", ["hunyuan_video", "vidtok"])  # replicate pads; a folded zero pad
def test_bf16_bit_exact(name, rng_seed):
    vae = tm.build_video_vae(name, seed=rng_seed).to(torch.bfloat16)
    x = tm.video_vae_input(name, rng_seed).to(torch.bfloat16)
    z_ref, ref = tm.video_vae_roundtrip(vae, x)
    with mpsboost.patched(vae, recipes=[RECIPE], device=MPS_OLD), tm.Pad5dCounter() as c:
        z, out = tm.video_vae_roundtrip(vae, x)
    assert c.calls == [] and torch.equal(z, z_ref) and torch.equal(out, ref)


def test_plans_by_environment():
    vae = tm.build_video_vae("hunyuan_video")
    rows = {
        label: mpsboost.plan(vae, device=dev, torch_version=ver, recipes=[RECIPE]).rows[0]
        for label, dev, ver in (
            ("mps214", "mps", "2.14.1"),
            ("mps215", "mps", "2.15.0"),
            ("cuda", "cuda", "2.11.0"),
            ("cpu", "cpu", "2.13.0"),
        )
    }
    assert rows["mps214"].status == "would apply" and rows["mps214"].backing == "pad as slice copies"
    assert "pytorch#194922" in rows["mps214"].reason
    assert rows["mps214"].details["written_out"] == 42  # one causal conv per pad site counted in the module docstring
    for label in ("mps215", "cuda", "cpu"):
        assert rows[label].status != "would apply", label
        assert "native and correct" in rows[label].reason
    cosmos = mpsboost.plan(tm.build_video_vae("cosmos"), device="mps", torch_version="2.14.1", recipes=[RECIPE]).rows[0]
    assert cosmos.backing == "conv padding fold + pad as slice copies" and cosmos.details["folded"] > 0
    forced = mpsboost.plan(
        vae, device="cpu", torch_version="2.13.0", recipes=[RECIPE], options={RECIPE: {"force": True}}
    ).rows[0]
    assert forced.status == "would apply"


def test_wan_and_qwen_vaes_are_left_to_their_own_recipes():
    for name in ("wan21_vae", "qwen_image_vae"):
        rows = mpsboost.plan(tm.build(name), device="mps", torch_version="2.14.1", recipes=[RECIPE]).rows
        assert not any(r.recipe == RECIPE and r.status == "would apply" for r in rows)


@pytest.mark.parametrize("mode", ["constant", "replicate", "reflect", "circular"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pad5d_equals_f_pad(mode, dtype, rng_seed):
    g = torch.Generator().manual_seed(rng_seed)
    for _ in range(12):
        shape = [int(v) for v in torch.randint(1, 4, (2,), generator=g)] + [
            int(v) for v in torch.randint(3, 7, (3,), generator=g)
        ]
        x = torch.randn(*shape, generator=g).to(dtype)
        # F.pad takes 2, 4 or 6 amounts for constant pads of rank-5 tensors, 6 for the other modes.
        n = int(torch.randint(1, 4, (1,), generator=g)) * 2 if mode == "constant" else 6
        pad = [int(v) for v in torch.randint(0, 3, (n,), generator=g)]
        if mode == "constant":
            pad = [p - 1 for p in pad]  # negative amounts crop, as in F.pad
        value = 0.5 if mode == "constant" else None
        ref = F.pad(x, pad, mode=mode, value=value)
        out = p5.pad5d(x, pad, mode, value)
        assert out.shape == ref.shape and torch.equal(out, ref), (shape, pad)
    xl = torch.randn(1, 4, 3, 5, 6).contiguous(memory_format=torch.channels_last_3d)
    assert torch.equal(p5.pad5d(xl, (1, 1, 1, 1, 2, 0), mode), F.pad(xl, (1, 1, 1, 1, 2, 0), mode=mode))


def test_pad5d_mode_reroutes_only_rank5_pads():
    with tm.Pad5dCounter() as c, p5.Pad5dMode() as mode:
        F.pad(torch.randn(1, 2, 3, 4, 5), (1, 1, 1, 1, 2, 0), mode="replicate")
        torch.nn.Conv3d(2, 2, 3, padding=1, padding_mode="reflect")(torch.randn(1, 2, 3, 4, 5))
        F.pad(torch.randn(2, 3, 4, 5), (1, 1, 1, 1), mode="reflect")  # rank 4: left to F.pad
    assert c.calls == [] and mode.calls == 2
    with p5.Pad5dMode(), pytest.raises(NotImplementedError):
        F.pad(torch.randn(1, 1, 2, 2, 2), (1, 1), mode="replicate")  # refused by F.pad itself, as without the mode
    with pytest.raises(ValueError, match="smaller than dimension"):
        p5.pad5d(torch.randn(1, 1, 2, 2, 2), (2, 2), "reflect")


def test_patching_twice_is_a_noop():
    vae = tm.build_video_vae("hunyuan_video")
    mpsboost.patch(vae, recipes=[RECIPE], device=MPS_OLD)
    try:
        again = mpsboost.patch(vae, recipes=[RECIPE], device=MPS_OLD)
        assert again.noop
    finally:
        mpsboost.unpatch(vae)
    assert not any("_mpsboost_patches" in m.__dict__ for m in vae.modules()) and "_mpsboost_pad5d" not in vae.__dict__
