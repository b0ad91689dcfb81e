"""The attention recipes patch the instance, never a config object.

transformers shares one config object between every module of a model and every model built from it,
and reads ``config._attn_implementation`` to pick the attention function and the mask format; its own
suites assert it (``test_sdpa_can_dispatch_non_composite_models`` in ``tests/test_modeling_common.py``:
a model loaded by default says ``"sdpa"``, one loaded with ``attn_implementation="eager"`` says
``"eager"`` and has no SDPA attention class). Under Mac decisions (simulated MPS 2.14.1 and 2.15.0)
attention_split applies to ``sdpa`` models and metal_attention to ``eager`` ones; here:

(a) those upstream assertions hold on patched tiny models of several families;
(b) a model built afterwards from the same config object is untouched (config and forwards);
(c) patched outputs equal stock (fp32, relative 1e-5, the tolerance of the recipes' own tests), with
    a small split budget so that the split really runs; unpatch restores the very same forwards.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import mpsboost
from mpsboost.gate import Env
from mpsboost.recipes import _hf

from mpsboost.bench import relative_error
import tiny_models as tm

pytest.importorskip("transformers")

FAMILIES = ("qwen3_moe", "mixtral", "qwen3", "llama", "deepseek_v3")
ENVS = {"2.15.0": Env.simulate("mps", "2.15.0"), "2.14.1": Env.simulate("mps", "2.14.1")}
ATTENTION = ("attention_split", "metal_attention")


def _statuses(report) -> dict[str, str]:
    return {r.recipe: r.status for r in report.rows if r.recipe in ATTENTION}


def _instance_forwards(model) -> dict[str, object]:
    return {n: m.__dict__["forward"] for n, m in model.named_modules() if "forward" in m.__dict__}


@pytest.mark.parametrize("tv", sorted(ENVS))
@pytest.mark.parametrize("family", FAMILIES)
def test_upstream_sdpa_dispatch_assertions_hold_patched(family, tv, tmp_path):
    """What transformers' test_sdpa_can_dispatch_non_composite_models asserts, on patched models."""
    cls = type(tm.build(family))
    tm.build(family).save_pretrained(tmp_path)

    model_sdpa = cls.from_pretrained(tmp_path).eval()
    report = mpsboost.patch(model_sdpa, device=ENVS[tv])
    assert _statuses(report)["attention_split"] == "applied", str(report)
    assert model_sdpa.config._attn_implementation == "sdpa"

    model_eager = cls.from_pretrained(tmp_path, attn_implementation="eager").eval()
    report = mpsboost.patch(model_eager, device=ENVS[tv])
    assert model_eager.config._attn_implementation == "eager"
    for _, sub in model_eager.named_modules():
        name = type(sub).__name__
        assert "SdpaAttention" not in name and "SdpaSelfAttention" not in name
    if family != "deepseek_v3":  # its head dims (MLA) have no Metal kernel: metal_attention skips there
        assert _statuses(report)["metal_attention"] == "applied", str(report)
    # Every sub-config too (transformers writes the implementation into each).
    assert {c._attn_implementation for c in _hf.configs(model_sdpa)} <= {"sdpa", None}
    assert {c._attn_implementation for c in _hf.configs(model_eager)} <= {"eager", None}
    mpsboost.unpatch(model_sdpa)
    mpsboost.unpatch(model_eager)


@pytest.mark.parametrize("impl,recipe", [("sdpa", "attention_split"), ("eager", "metal_attention")])
def test_a_model_built_later_from_the_same_config_is_untouched(impl, recipe):
    first = tm.build("qwen3_moe")
    cfg = first.config
    cfg._attn_implementation = impl  # as from_pretrained(attn_implementation=...) records it
    cls = type(first)
    torch.manual_seed(0)
    patched = cls(cfg).eval()
    report = mpsboost.patch(patched, device=ENVS["2.15.0"])
    assert _statuses(report)[recipe] == "applied", str(report)
    assert patched.config is cfg and cfg._attn_implementation == impl
    torch.manual_seed(0)
    later = cls(cfg).eval()  # built after the patch, from the very same config object
    assert later.config is cfg and cfg._attn_implementation == impl
    assert _instance_forwards(later) == {}
    assert not any(m.__dict__.get("_mpsboost_patches") for m in later.modules())
    # Its attention modules run transformers' own function for the configured implementation.
    patched_attn = [m for _, m in _hf.attention_modules(patched)]
    later_attn = [m for _, m in _hf.attention_modules(later)]
    assert patched_attn and all("forward" in m.__dict__ for m in patched_attn)
    assert later_attn and all("forward" not in m.__dict__ for m in later_attn)
    mpsboost.unpatch(patched)


@pytest.mark.parametrize("family", ["qwen3_moe", "llama"])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_patched_equals_stock_and_unpatch_restores(family, impl, rng_seed):
    model = tm.build(family, seed=rng_seed)
    model.config._attn_implementation = impl
    before = tm.snapshot(model)
    ref = tm.run(family, model, rng_seed)
    # A budget of a few hundred scores: every prefill call of the tiny model is split.
    opts = {"attention_split": {"max_scores": 2 * 2 * 3 * 6}}
    report = mpsboost.patch(model, device=ENVS["2.14.1"], options=opts)
    applied = {r for r, s in _statuses(report).items() if s == "applied"}
    # On 'sdpa' metal_attention routes for the contiguous copy of q/k/v alone (sdpa_strided_correct).
    assert applied == ({"attention_split", "metal_attention"} if impl == "sdpa" else {"metal_attention"}), str(report)
    assert model.config._attn_implementation == impl
    got = tm.run(family, model, rng_seed)
    assert relative_error(got, ref) < 1e-5
    mpsboost.unpatch(model)
    assert tm.same_snapshot(before, tm.snapshot(model)), tm.diff_snapshot(before, tm.snapshot(model))
    assert model.config._attn_implementation == impl


class _RecordSdpa(TorchFunctionMode):
    """Score counts (B * H * Lq * Lk) of every SDPA call made inside it, after any split."""

    def __init__(self):
        super().__init__()
        self.scores: list[int] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q = kwargs.get("query", args[0] if args else None)
            k = kwargs.get("key", args[1] if len(args) > 1 else None)
            self.scores.append(math.prod(q.shape[:-1]) * k.shape[-2])
        return func(*args, **kwargs)


def test_split_runs_in_transformers_attention_modules():
    """The bound forwards really split: with a budget below one prefill call, no call exceeds it."""
    model = tm.build("qwen3")
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), _RecordSdpa() as stock:
        ref = model(ids).logits
    budget = 2 * 2 * 3 * 12  # batch 2, 2 heads, 3 query rows against 12 keys
    assert max(stock.scores) > budget
    mpsboost.patch(model, device=ENVS["2.15.0"], options={"attention_split": {"max_scores": budget}})
    with torch.no_grad(), _RecordSdpa() as rec:
        got = model(ids).logits
    assert len(rec.scores) > len(stock.scores) and max(rec.scores) <= budget
    assert relative_error(got, ref) < 1e-5
    mpsboost.unpatch(model)


def test_output_attentions_of_an_eager_model_still_come_back():
    """metal_attention hands the cases SDPA does not cover (returned attention weights) to the eager function."""
    model = tm.build("llama_eager")
    ids = torch.randint(3, 128, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids, output_attentions=True).attentions
    mpsboost.patch(model, device=ENVS["2.15.0"])
    with torch.no_grad():
        got = model(ids, output_attentions=True).attentions
    assert ref is not None and got is not None and len(got) == len(ref)
    assert all(g is not None and torch.allclose(g, r, atol=1e-6) for g, r in zip(got, ref))
    mpsboost.unpatch(model)


def test_the_split_bound_reads_the_mask_by_name_and_never_underestimates():
    """The per-call bound of a transformers attention module: the mask's key length when a mask is
    passed (by position or keyword), else the config's longest sequence; never a tensor in another slot."""
    from mpsboost.recipes.attention_split import _hf_may_exceed_for

    model = tm.build("qwen3")
    attn = next(m for _, m in _hf.attention_modules(model))
    bound = _hf_may_exceed_for(attn)
    heads = model.config.num_attention_heads
    hidden = torch.zeros(2, 5, model.config.hidden_size)
    pos = (torch.zeros(2, 5, 32), torch.zeros(2, 5, 32))
    mask = torch.zeros(2, 1, 5, 40, dtype=torch.bool)  # 40 keys: 35 cached + 5 new
    exact = 2 * heads * 5 * 40
    for args, kwargs in (
        ((hidden, pos, mask), {}),
        ((hidden, pos), {"attention_mask": mask}),
        ((), {"hidden_states": hidden, "position_embeddings": pos, "attention_mask": mask}),
    ):
        assert bound(attn, args, kwargs, exact) is False
        assert bound(attn, args, kwargs, exact - 1) is True
    # No mask: bounded by max_position_embeddings (64 here), never by Lq alone.
    longest = 2 * heads * 5 * model.config.max_position_embeddings
    assert bound(attn, (hidden, pos, None), {}, longest) is False
    assert bound(attn, (hidden, pos, None), {}, longest - 1) is True
