"""``load_fp8`` and ``patch(fp8=...)`` build the same fp8 layer: one class, one state type, one forward
function, the same path, committed through one transaction (``api.adopt`` is patch()'s).

Two files are loaded: mpsboost's own (``save_fp8`` of a patched model) and a compressed-tensors
``float-quantized`` folder written by hand (per-channel scales, experts as one 2-D Linear per expert, as
published) from the codes and scales of that same patched model. Both hold the patched model's codes,
so the loaded model must give the patched model's outputs bit for bit on fresh random inputs.
Environments: the real CPU, simulated MPS 2.14.1 (uint8 storage), MPS 2.15.0 and CUDA sm_90 (the fused
path; its registered operators run their CPU references on these CPU tensors).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch

import mpsboost
from mpsboost.bench.models import TINY_LM
import tiny_models as tm
from mpsboost import api
from mpsboost.errors import IrreversiblePatchError, PatchError
from mpsboost.gate import Env
from mpsboost.patching import replace_tensors, set_instance_attr
from mpsboost.recipes.fp8.layers import Fp8State, fp8_state

# patch(recipes=[], fp8=...) keeps lm_head in bf16 and says so: expected here.
pytestmark = pytest.mark.filterwarnings("ignore:mpsboost. requested recipe fp8_weights was skipped")

FP8 = torch.float8_e4m3fn
ENVS = {
    "cpu": lambda: Env.detect("cpu"),
    "mps-2.14.1": lambda: Env.simulate("mps", "2.14.1"),
    "mps-2.15.0": lambda: Env.simulate("mps", "2.15.0"),
    "cuda-sm90": lambda: Env.simulate("cuda:9.0", "2.11.0"),
}


def _moe_config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        **TINY_LM,
        head_dim=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_experts=8,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        norm_topk_prob=True,
    )


def _lm(seed: int = 0):
    """bf16 weights; the rotary tables stay float32, as in a model built on the meta device and loaded."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(_moe_config(), dtype=torch.bfloat16).eval()


def _meta_lm():
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(_moe_config()).eval()


def _logits(model, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (2, 9), generator=g)
    with torch.no_grad():
        return model(input_ids=ids).logits


def _write_compressed_tensors_from(patched, folder: Path) -> None:
    """A compressed-tensors float-quantized folder holding ``patched``'s own fp8 codes and float32 per-channel
    scales: ``<layer>.weight`` + ``<layer>.weight_scale [N, 1]``, experts as ``experts.<e>.{gate,up,down}_proj``."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for key, t in patched.state_dict().items():
        mod_name, _, attr = key.rpartition(".")
        if attr.endswith("_scale"):
            continue
        if t.dtype not in (FP8, torch.uint8):
            tensors[key] = t.clone()
            continue
        codes, scale = t.view(FP8), getattr(patched.get_submodule(mod_name), attr + "_scale")
        if attr == "weight":
            tensors[key], tensors[mod_name + ".weight_scale"] = codes.clone(), scale.clone()
            tensors[mod_name + ".input_scale"] = torch.ones(1)  # static activation scale: unused here
            continue
        for e in range(codes.shape[0]):
            if attr == "gate_up_proj":
                inter = codes.shape[1] // 2
                pieces = {"gate_proj": slice(0, inter), "up_proj": slice(inter, 2 * inter)}
            else:
                pieces = {"down_proj": slice(0, codes.shape[1])}
            for name, rows in pieces.items():
                tensors[f"{mod_name}.{e}.{name}.weight"] = codes[e, rows].clone()
                tensors[f"{mod_name}.{e}.{name}.weight_scale"] = scale[e, rows].clone()
    cfg = patched.config.to_dict()
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
            }
        },
    }
    folder.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg))


def _fp8_layers(model) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in model.named_modules() if fp8_state(m) is not None}


@pytest.mark.parametrize("env", list(ENVS))
@pytest.mark.parametrize("fmt", ["mpsboost", "compressed-tensors"])
def test_load_fp8_and_patch_build_the_same_layer(tmp_path, env, fmt, rng_seed):
    patched = _lm()
    mpsboost.patch(patched, recipes=[], fp8="rowwise", device=ENVS[env]())
    if fmt == "mpsboost":
        path = mpsboost.save_fp8(patched, tmp_path / "ckpt")
        loaded = _lm(seed=1)  # other weights: every tensor must come from the file
    else:
        path = tmp_path / "ct"
        _write_compressed_tensors_from(patched, path)
        loaded = _meta_lm()
    report = mpsboost.load_fp8(loaded, path, device=ENVS[env](), lossless_recipes=False)

    want, got = _fp8_layers(patched), _fp8_layers(loaded)
    assert len(want) == 10 and want.keys() == got.keys()  # q/k/v/o of two layers, two experts modules
    rows = {r.target: r for r in report.rows if r.recipe == "fp8_weights"}
    assert rows.keys() == want.keys()
    for name, p in want.items():
        q = got[name]
        # One class: FP8Linear, or the one FP8<Experts> class made for the experts class.
        assert type(q) is type(p) and type(q).__name__.startswith("FP8"), name
        # One forward function: the same code, built by the same builder, bound on the instance.
        assert q.forward.__func__.__code__ is p.forward.__func__.__code__, name
        assert q.forward.__func__.__qualname__ == p.forward.__func__.__qualname__, name
        # One state type, and the same path in it (the recipe decided both).
        sp, sq = fp8_state(p), fp8_state(q)
        assert type(sp) is type(sq) is Fp8State and sq.converted, name
        assert dataclasses.asdict(sq) == dataclasses.asdict(sp), (name, sq, sp)
        assert rows[name].backing == sp.backing, name
        for t in ("weight",) if isinstance(p, torch.nn.Linear) else ("gate_up_proj", "down_proj"):
            assert getattr(q, t).dtype == getattr(p, t).dtype, (name, t)
            assert torch.equal(getattr(q, t).view(torch.uint8), getattr(p, t).view(torch.uint8)), (name, t)
            assert torch.equal(getattr(q, t + "_scale"), getattr(p, t + "_scale")), (name, t)
    # The same codes through the same forwards: the same logits, bit for bit.
    seed = rng_seed % 10_000
    a, b = _logits(loaded, seed), _logits(patched, seed)
    rel = ((a.float() - b.float()).norm() / b.float().norm()).item()
    assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a, b), rel
    # One record store: the loaded model is patched, its report is the latest, and unpatch refuses as after
    # patch(fp8=...).
    assert api.is_patched(loaded) and mpsboost.last_report(loaded) is report
    before = tm.snapshot(loaded)
    with pytest.raises(IrreversiblePatchError, match="fp8_weights") as info:
        mpsboost.unpatch(loaded)
    assert "load_fp8" in str(info.value) and "Nothing was changed" in str(info.value)
    assert not tm.diff_snapshot(before, tm.snapshot(loaded))


def test_a_failing_lossless_recipe_undoes_the_whole_load(tmp_path, monkeypatch):
    """The lossless recipes run in load_fp8's transaction: one failing undoes every tensor read and every
    layer built, and names the recipe."""
    from mpsboost.registry import get_recipe

    src = _lm()
    mpsboost.patch(src, recipes=[], fp8="rowwise")
    path = mpsboost.save_fp8(src, tmp_path / "ckpt")
    model = _lm(seed=1)
    before = tm.snapshot(model)
    classes = {n: type(m) for n, m in model.named_modules()}
    softmax = get_recipe("softmax")

    def broken(*args, **kw):
        raise RuntimeError("softmax apply failed")

    monkeypatch.setattr(type(softmax), "apply", broken)
    with pytest.raises(PatchError, match="softmax apply failed") as info:
        mpsboost.load_fp8(model, path, device="cpu")
    assert info.value.recipe == "softmax"
    assert not tm.diff_snapshot(before, tm.snapshot(model))
    assert {n: type(m) for n, m in model.named_modules()} == classes
    assert not api.is_patched(model)
    with pytest.raises(mpsboost.NotPatchedError):
        mpsboost.unpatch(model)


def test_load_with_lossless_recipes_is_one_record(tmp_path):
    """One transaction, one record: the load's report holds the fp8 rows and the lossless recipes' rows,
    and unpatch refuses the whole of it, changing nothing (the lossless patches stay too)."""
    src = _lm()
    mpsboost.patch(src, recipes=[], fp8="rowwise")
    path = mpsboost.save_fp8(src, tmp_path / "ckpt")
    model = _lm(seed=1)
    report = mpsboost.load_fp8(model, path, device="cpu")
    recipes = {r.recipe for r in report.rows}
    assert recipes >= {"fp8_weights", "softmax"} and "moe_experts" not in recipes
    assert report.rows_for("softmax")[0].status == "applied"
    # moe_block composes with the loaded fp8 experts (their module runs inside its decode path)
    assert report.rows_for("moe_block")[0].status == "applied"
    assert len(model.__dict__[api._RECORDS_ATTR]) == 1 and mpsboost.last_report(model) is report
    applied = {a.recipe.name for r in model.__dict__[api._RECORDS_ATTR] for a in r.applied}
    assert applied == {"fp8_weights", "softmax", "moe_block"}
    before = tm.snapshot(model)
    with pytest.raises(IrreversiblePatchError):
        mpsboost.unpatch(model)
    assert not tm.diff_snapshot(before, tm.snapshot(model))


# ------------------------------------------------------------------------------------------ api.adopt itself


def test_adopt_commits_rolls_back_and_records_through_patch_transaction():
    from mpsboost.registry import Decision

    lin = torch.nn.Linear(4, 3)
    model = torch.nn.Sequential(lin)
    weight = lin.weight
    new = torch.nn.Parameter(torch.zeros(3, 4), requires_grad=False)

    def boom():
        raise OSError("disk went away")

    steps = [
        api.Adopted("fp8_weights", "0", lambda: replace_tensors(lin, {"weight": new}, explanation="reload")),
        api.Adopted(
            "fp8_weights",
            "0",
            lambda: set_instance_attr(lin, "fp8_weights", "marker", 1),
            module=lin,
            decision=Decision.apply("a test change", "adopted"),
        ),
        api.Adopted("fp8_weights", "0", boom),
    ]
    before = tm.snapshot(model)
    with pytest.raises(OSError, match="disk went away"):
        api.adopt(model, steps, device="cpu")
    # Rolled back in reverse: the very same Parameter, no attribute, no record.
    assert lin.weight is weight and "marker" not in lin.__dict__ and not api.is_patched(model)
    assert not tm.diff_snapshot(before, tm.snapshot(model))

    report = api.adopt(model, steps[:2], device="cpu")
    assert lin.weight is new and lin.marker == 1
    rows = [(r.recipe, r.target, r.status, r.backing) for r in report.rows]
    assert rows == [("fp8_weights", "0", "applied", "a test change")]
    assert mpsboost.last_report(model) is report
    # The recorded change belongs to an irreversible recipe: unpatch refuses and changes nothing.
    with pytest.raises(IrreversiblePatchError, match="fp8_weights"):
        mpsboost.unpatch(model)
    assert lin.weight is new and lin.marker == 1


def test_adopt_refuses_what_is_not_a_change():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="Adopted"):
        api.adopt(model, [lambda: None], device="cpu")
    with pytest.raises(TypeError, match="must return an mpsboost.patching.Patch"):
        api.adopt(model, [api.Adopted("fp8_weights", "<root>", lambda: None)], device="cpu")
    assert not api.is_patched(model)


def test_replace_tensors_keeps_places_and_forgets_originals_at_commit():
    lin = torch.nn.Linear(4, 3)
    weight, bias = lin.weight, lin.bias
    order = list(lin.state_dict())
    codes = torch.zeros(3, 4, dtype=torch.uint8)
    p = replace_tensors(
        lin, {"weight": codes, "bias": torch.nn.Parameter(torch.ones(3), requires_grad=False)}, explanation="reload"
    )
    assert "weight" in lin._buffers and "weight" not in lin._parameters and lin.weight is codes
    assert list(lin._parameters) == ["bias"] and torch.equal(lin.bias, torch.ones(3))
    p()  # before commit: the very same tensors, in their order
    assert lin.weight is weight and lin.bias is bias and list(lin.state_dict()) == order and not lin._buffers
    q = replace_tensors(lin, {"bias": torch.nn.Parameter(torch.zeros(3), requires_grad=False)}, explanation="reload")
    q.commit()
    assert not q.reversible and q.explanation == "reload"
    with pytest.raises(RuntimeError, match="committed already"):
        q()
    with pytest.raises(TypeError, match="tensors or None"):
        replace_tensors(lin, {"bias": [1.0, 2.0]}, explanation="reload")
    assert copy.deepcopy(lin).bias.shape == (3,)
