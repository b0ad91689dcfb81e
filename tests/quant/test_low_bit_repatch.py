"""A model that ``mpsboost.from_pretrained`` loaded from an MLX folder, patched again by the user.

``from_pretrained`` swaps in mpsboost's low-bit layers (the experts keep their stacks as MLX affine codes) and
patches with the default recipes in the same transaction, moe_experts included. Neither that call nor a later
``mpsboost.patch(model)`` (or one that names ``moe_experts``) may bind the moe_experts forward over the low-bit
experts, which multiplies the codes as weights (it raised a shape error on the first forward): the recipe steps
aside with a reason naming the low-bit layer, and the logits stay those of the loaded model. ``unpatch`` of a
loaded model restores nothing: the low-bit layers were converted in place (low_bit_weights is irreversible), so it
raises ``IrreversiblePatchError``, changes nothing, and the model computes the same logits still.
"""

from __future__ import annotations

import pytest
import torch

import mpsboost
from conftest import MLX_ERROR, hf_model, needs_mlx, write_mlx
from mpsboost.errors import IrreversiblePatchError
from mpsboost.report import APPLIED, SKIPPED

MOE = ("qwen3_5_moe", "qwen3_moe", "qwen3_next")
ENVS = {"mps-2.15.0": lambda: mpsboost.Env.simulate("mps", "2.15.0"), "cpu": lambda: "cpu"}
REL = 1e-6  # float32; the same layers compute both, so equal in practice


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """One tiny MLX 4-bit folder per MoE family, written by mlx-lm (conftest.write_mlx), shared by the tests."""
    if MLX_ERROR:  # the tests that use it skip
        return None
    root = tmp_path_factory.mktemp("mlx_moe")
    for fam in MOE:
        write_mlx(fam, root / fam)
    return root


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.float()


def _same(got, ref, what):
    err = float((got.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))
    assert err <= REL, f"{what}: logits moved by {err:.2e} relative (tolerance {REL})"


def _low_bit_experts(model):
    from mpsboost.recipes.low_bit.layers import affine_state

    return {n for n, m in model.named_modules() if (s := affine_state(m)) is not None and s.kind == "experts"}


def _skipped(report, experts):
    """Every low-bit experts module has a moe_experts row, skipped with the reason naming the low-bit layer."""
    rows = report.rows_for("moe_experts")
    assert {r.target for r in rows} == experts
    for r in rows:
        assert r.status == SKIPPED, f"{r.target}: {r.status} ({r.reason})"
        assert "low-bit layer Affine" in r.reason and "moe_experts steps aside" in r.reason, r.reason
        assert "4-bit g64" in r.reason, r.reason
    assert all(r.recipe != "moe_experts" for r in report.rows if r.status == APPLIED)


@needs_mlx
@pytest.mark.parametrize("recipes", [None, ("moe_experts",)], ids=["default", "named"])
@pytest.mark.parametrize("env", list(ENVS))
@pytest.mark.parametrize("family", MOE)
def test_second_patch_steps_aside_for_low_bit_experts(family, env, recipes, folders, rng_seed):
    device = ENVS[env]()
    model = mpsboost.from_pretrained(folders / family, dtype=torch.float32, device=device)
    experts = _low_bit_experts(model)
    assert experts, "the loaded model has no low-bit experts: nothing is tested"
    _skipped(mpsboost.last_report(model), experts)  # from_pretrained's own transaction planned moe_experts too
    g = torch.Generator().manual_seed(rng_seed)
    prompts = [torch.randint(3, 128, (1, n), generator=g) for n in (12, 3)]  # many rows; a decode's few (<= 4)
    before = [_logits(model, ids) for ids in prompts]

    if recipes is None:
        report = mpsboost.patch(model, device=device)
    else:  # a recipe asked for by name and skipped also warns (DESIGN.md)
        with pytest.warns(UserWarning, match="moe_experts"):
            report = mpsboost.patch(model, device=device, recipes=list(recipes))
    _skipped(report, experts)
    for ids, ref in zip(prompts, before):
        _same(_logits(model, ids), ref, f"after the second patch ({ids.shape[1]} tokens)")

    # unpatch of a loaded model: the low-bit layers were converted in place; it refuses, naming them, and
    # changes nothing (api._unpatch_records checks reversibility before it undoes anything).
    with pytest.raises(IrreversiblePatchError, match="low_bit_weights"):
        mpsboost.unpatch(model)
    assert _low_bit_experts(model) == experts
    for ids, ref in zip(prompts, before):
        _same(_logits(model, ids), ref, f"after unpatch ({ids.shape[1]} tokens)")


def test_second_patch_steps_aside_for_loaded_fp8_experts(tmp_path, rng_seed):
    """The same for experts that load_fp8 read as fp8 codes (load_fp8 leaves moe_experts out just as
    from_pretrained does): a later patch() skips them, naming the fp8 layer, and the logits stay."""
    import transformers

    env = mpsboost.Env.simulate("mps", "2.15.0")
    src = hf_model("qwen3_moe")
    mpsboost.patch(src, device=env, fp8="rowwise")
    mpsboost.save_fp8(src, tmp_path / "fp8")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(src.config, dtype=torch.float32)
    mpsboost.load_fp8(model, tmp_path / "fp8", device=env, dtype=torch.float32)
    model.eval()
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(rng_seed))
    before = _logits(model, ids)
    report = mpsboost.patch(model, device=env)
    rows = report.rows_for("moe_experts")
    assert rows and all(r.status == SKIPPED and "fp8 layer FP8" in r.reason for r in rows), [r.reason for r in rows]
    _same(_logits(model, ids), before, "after the second patch of an fp8-loaded model")
