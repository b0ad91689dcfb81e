"""The VAE family table: every row names classes that exist, each recipe selects its rows, the rows
refuse what they cannot mean, and the decisions carry typed plans whose details are the report's."""

from __future__ import annotations

import dataclasses
import importlib

import pytest

from mpsboost.gate import Env
from mpsboost.recipes.vae import common, streams, video
from mpsboost.recipes.vae.families import FAMILIES, PadSite, VaeFamily, family, rows_for
from mpsboost.registry import get_recipe

pytest.importorskip("diffusers")
import tiny_models as tm  # noqa: E402


def _class_paths(row: VaeFamily) -> list[str]:
    paths = [row.vae, *row.blocks, *(s.cls for s in row.pads)]
    return paths + [p for p in (row.conv, row.norm, row.resample, row.avg_down) if p]


@pytest.mark.parametrize("row", FAMILIES, ids=lambda r: r.name)
def test_every_class_path_names_a_diffusers_class(row):
    for path in _class_paths(row):
        mod, name = path.rsplit(".", 1)
        assert isinstance(getattr(importlib.import_module(mod), name, None), type), path
    if row.treatment == "causal":
        mod = importlib.import_module(row.module)
        assert all(callable(getattr(mod, n, None)) for n in row.patch_fns) or not row.patchify, row.patch_fns


def test_each_recipe_selects_its_rows():
    assert [r.name for r in rows_for("wan_vae_pad")] == ["wan"]
    assert [r.name for r in rows_for("qwen_image_vae")] == ["qwen", "qwen21"]
    assert len(rows_for("video_vae_pad")) == 11 and video.VAES == tuple(r.vae for r in rows_for("video_vae_pad"))
    assert [r.name for r in streams.ROWS] == ["wan", "qwen"]
    assert {r.recipe for r in FAMILIES} == {"wan_vae_pad", "qwen_image_vae", "video_vae_pad"}
    assert all(r.treatment == ("pad" if r.recipe == "video_vae_pad" else "causal") for r in FAMILIES)


def test_rows_refuse_what_they_cannot_mean():
    with pytest.raises(ValueError, match="how='fold' .* pass one of route"):
        PadSite("x.Y", "fold")
    with pytest.raises(ValueError, match="not both"):
        VaeFamily("both", "video_vae_pad", "x.Vae", conv="x.Conv", pads=(PadSite("x.Y"),))
    with pytest.raises(ValueError, match="conv_kind='conv1d'"):
        VaeFamily("odd", "wan_vae_pad", "x.Vae", conv="x.Conv", conv_kind="conv1d")
    with pytest.raises(ValueError, match="no VAE family 'nope'; the table has wan, qwen"):
        family("nope")
    with pytest.raises(dataclasses.FrozenInstanceError):
        family("wan").recipe = "other"  # type: ignore[misc]


def test_decisions_carry_typed_plans():
    mps = Env.simulate("mps", "2.14.1")
    wan = tm.build("wan22_vae")
    (match,) = get_recipe("wan_vae_pad").find(wan)
    assert match.data == common.VaeTarget("wan", whole_vae=True)
    d = common.decide("wan_vae_pad", match, mps, common.VaePadOptions())
    assert isinstance(d.plan, common.CausalPlan) and d.plan.family == "wan" and d.plan.options.layout == "contiguous"
    assert dict(d.details) == d.plan.report_details() and d.plan.counts.causal_convs == d.details["causal_convs"] > 0
    hv = tm.build_video_vae("hunyuan_video")
    (vm,) = get_recipe("video_vae_pad").find(hv)
    vd = common.decide_pads(vm, mps, force=False)
    assert vd.plan == common.PadPlan("hunyuan_video", folded=0, written_out=42, routed=0)
    assert dict(vd.details) == vd.plan.report_details()
