"""The memory watch of the Wan / Qwen-Image tile loops, with simulated driver-memory counters.

A fake device: every tile adds ``per_tile`` bytes of cached memory to the driver counter, and
``empty_cache`` drops it back to the tensors in use. The watch must free exactly when the counter
reaches the threshold share of the recommended maximum, never otherwise, and leave the decoded
values untouched (compared bit for bit with the unwatched patched loop).
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

import mpsboost
from mpsboost.gate import Env
from mpsboost.recipes.vae.tiles import MemoryWatcher

pytest.importorskip("diffusers")
import tiny_models as tm  # noqa: E402

MPS = Env.simulate("mps", "2.14.1")
GiB = 2**30


class FakeDevice:
    """Driver counter of a fake device: each decoder call (one per tile here: one latent frame)
    leaves ``per_tile`` cached bytes; ``empty_cache`` returns them."""

    def __init__(self, recommended: int, in_use: int, per_tile: int):
        self.recommended, self.in_use, self.per_tile = recommended, in_use, per_tile
        self.cached = 0
        self.empties = 0

    def attach(self, vae):
        return vae.decoder.register_forward_hook(lambda *a: setattr(self, "cached", self.cached + self.per_tile))

    def driver_allocated(self) -> int:
        return self.in_use + self.cached

    def empty_cache(self) -> None:
        self.empties += 1
        self.cached = 0

    def watcher(self, threshold: float = 0.85) -> MemoryWatcher:
        return MemoryWatcher(
            threshold,
            driver_allocated=self.driver_allocated,
            recommended_max=lambda: self.recommended,
            empty_cache=self.empty_cache,
        )


def _tiled_decode(name: str, vae, z, options):
    with mpsboost.patched(vae, recipes=[name], device=MPS, options={name: options}) as report:
        with torch.no_grad():
            out = vae.decode(z).sample
    return out, report


@pytest.mark.parametrize("family", ["wan22", "qwen"])
def test_frees_at_the_threshold_and_leaves_values_alone(family, rng_seed):
    if family == "wan22":
        name, vae = "wan_vae_pad", tm.build("wan22_vae", seed=rng_seed)
        vae.enable_tiling(
            tile_sample_min_height=64,
            tile_sample_min_width=64,
            tile_sample_stride_height=32,
            tile_sample_stride_width=32,
        )
        z = torch.randn(1, vae.config.z_dim, 1, 6, 6)  # tiles of 4x4 latents, stride 2: 3x3 tiles
    else:
        name, vae = "qwen_image_vae", tm.build("qwen_image_vae", seed=rng_seed)
        vae.enable_tiling(
            tile_sample_min_height=32,
            tile_sample_min_width=32,
            tile_sample_stride_height=16,
            tile_sample_stride_width=16,
        )
        z = torch.randn(1, vae.config.z_dim, 1, 12, 12)  # tiles of 8x8 latents, stride 4: 3x3 tiles
    plain, _ = _tiled_decode(name, vae, z, {"memory_watch": False})
    # 10 GiB in use, 1 GiB cached per tile, 16 GiB recommended: 85% (13.6 GiB) is reached at the 4th tile
    dev = FakeDevice(recommended=16 * GiB, in_use=10 * GiB, per_tile=1 * GiB)
    w = dev.watcher()
    hook = dev.attach(vae)
    out, report = _tiled_decode(name, vae, z, {"memory_watch": w})
    hook.remove()
    assert report.rows[0].details["memory_watch"] == 0.85
    assert w.checks == 9  # one check per tile
    assert [f[0] for f in w.frees] == [4, 8]  # GiB after each tile: 11, 12, 13, 14 -> free; 11, 12, 13, 14 -> free; 11
    assert all(before >= 0.85 * 16 * GiB > after for _, before, after in w.frees)
    assert dev.empties == 2
    assert torch.equal(out, plain)


def test_never_frees_below_the_threshold(rng_seed):
    vae = tm.build("wan21_vae", seed=rng_seed)
    vae.enable_tiling(
        tile_sample_min_height=16, tile_sample_min_width=16, tile_sample_stride_height=8, tile_sample_stride_width=8
    )
    z = torch.randn(1, 16, 1, 4, 4)
    dev = FakeDevice(recommended=64 * GiB, in_use=1 * GiB, per_tile=1)
    w = dev.watcher(0.5)
    dev.attach(vae)
    _tiled_decode("wan_vae_pad", vae, z, {"memory_watch": w})
    assert w.checks > 1 and w.frees == [] and dev.empties == 0


def test_default_on_for_mps_only_and_reported():
    vae = tm.build("wan22_vae")
    rows = {
        dev: mpsboost.plan(vae, device=dev, torch_version=ver, recipes=["wan_vae_pad"]).rows[0]
        for dev, ver in (("mps", "2.14.1"), ("cuda", "2.11.0"), ("cpu", "2.13.0"))
    }
    assert rows["mps"].details["memory_watch"] == 0.85 and "85% of the recommended maximum" in rows["mps"].reason
    for dev in ("cuda", "cpu"):
        assert rows[dev].details["memory_watch"] is None and "recommended maximum" not in rows[dev].reason
    custom = mpsboost.plan(
        vae,
        device="mps",
        torch_version="2.15.0",
        recipes=["wan_vae_pad"],
        options={"wan_vae_pad": {"memory_threshold": 0.6}},
    ).rows[0]
    assert custom.details["memory_watch"] == 0.6 and "60%" in custom.reason
    off = mpsboost.plan(
        vae,
        device="mps",
        torch_version="2.15.0",
        recipes=["wan_vae_pad"],
        options={"wan_vae_pad": {"memory_watch": False}},
    ).rows[0]
    assert off.details["memory_watch"] is None
    with pytest.raises(mpsboost.errors.PatchError, match="memory_threshold"):
        mpsboost.patch(vae, recipes=["wan_vae_pad"], device=MPS, options={"wan_vae_pad": {"memory_threshold": 1.5}})


def test_default_watch_leaves_tensors_off_mps_alone(rng_seed):
    # Patched for a simulated MPS, run on CPU tensors: the default watch must not call torch.mps.
    vae = tm.build("wan21_vae", seed=rng_seed)
    vae.enable_tiling(
        tile_sample_min_height=16, tile_sample_min_width=16, tile_sample_stride_height=8, tile_sample_stride_width=8
    )
    z = torch.randn(1, 16, 1, 4, 4)
    boom = mock.Mock(side_effect=AssertionError("torch.mps called for a CPU tensor"))
    with (
        mock.patch.object(torch.mps, "driver_allocated_memory", boom),
        mock.patch.object(torch.mps, "empty_cache", boom),
    ):
        out, report = _tiled_decode("wan_vae_pad", vae, z, {})
    assert report.rows[0].details["memory_watch"] == 0.85 and out.shape[-1] == 32
    assert boom.call_count == 0


def test_watcher_refuses_a_bad_threshold():
    with pytest.raises(ValueError, match="fraction"):
        MemoryWatcher(0.0)
