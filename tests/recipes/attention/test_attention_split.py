"""attention_split: no SDPA call above 2^31 scores on (simulated) MPS; same numbers as stock.

The shapes of every ``F.scaled_dot_product_attention`` call are recorded by a ``TorchFunctionMode``
in the test (entered outside the model, so it sees the calls the patch makes, after splitting).
Numerics: on the CPU with a forced small budget the split result equals stock within 1e-6 absolute
(fp32): the rows are the same dot products and softmaxes, but the matmul kernels may block a
shorter query slice differently, so the last bit may differ.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import mpsboost
from mpsboost.gate import Env
from mpsboost.ops import attention_split as ops

import tiny_models as tm

RECIPE = "attention_split"
MPS = Env.simulate("mps", "2.14.1")
LIMIT = 2**31


class RecordSdpa(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls: list[tuple[tuple, tuple]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q = kwargs.get("query", args[0] if args else None)
            k = kwargs.get("key", args[1] if len(args) > 1 else None)
            self.calls.append((tuple(q.shape), tuple(k.shape)))
        return func(*args, **kwargs)


def scores(call) -> int:
    q, k = call
    return math.prod(q[:-1]) * k[-2]


def _wan22_ti2v_like():
    from diffusers import WanTransformer3DModel

    # Wan2.2-TI2V-5B's attention shape (24 heads, patch 1x2x2, 48 latent channels) with one layer and
    # small widths: the score count depends on heads and tokens only.
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=24,
        attention_head_dim=4,
        in_channels=48,
        out_channels=48,
        text_dim=32,
        freq_dim=256,
        ffn_dim=32,
        num_layers=1,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=1024,
    ).eval()


def test_wan22_720p_121_frames_no_call_above_2_31_scores():
    pytest.importorskip("diffusers")
    tr = _wan22_ti2v_like()
    report = mpsboost.patch(tr, recipes=[RECIPE], device=MPS)
    try:
        assert report.rows[0].status == "applied" and report.rows[0].details["attention_modules"] == 2
        tr = tr.to("meta")  # shapes only: the forward runs on the meta device
        # 121 frames at 704x1280 through the Wan2.2 VAE (4x time, 16x space): a 31x44x80 latent.
        hs = torch.empty(1, 48, 31, 44, 80, device="meta")
        enc = torch.empty(1, 512, 32, device="meta")
        t = torch.zeros(1, dtype=torch.long, device="meta")
        with torch.no_grad(), RecordSdpa() as rec:
            tr(hidden_states=hs, timestep=t, encoder_hidden_states=enc, return_dict=False)
    finally:
        mpsboost.unpatch(tr)
    tokens = max(q[-2] for q, _ in rec.calls)
    assert sum(q[-2] for q, k in rec.calls if k[-2] == tokens) == tokens  # the self-attention, all of it
    assert tokens == 31 * 22 * 40
    assert 24 * tokens * tokens > 8 * LIMIT  # unsplit, one call would hold 8x the budget
    assert max(scores(c) for c in rec.calls) <= LIMIT
    # without the patch the same forward makes one call over the budget
    with torch.no_grad(), RecordSdpa() as stock:
        tr(hidden_states=hs, timestep=t, encoder_hidden_states=enc, return_dict=False)
    assert max(scores(c) for c in stock.calls) > LIMIT


@pytest.mark.parametrize("name", ["wan_transformer", "qwen_image_transformer"])
def test_diffusers_numerics_with_small_budget(name, rng_seed):
    pytest.importorskip("diffusers")
    model = tm.build(name, seed=rng_seed)
    ref = tm.run(name, model, rng_seed)
    before = {n: m.__dict__.get("forward") for n, m in model.named_modules()}
    with RecordSdpa() as stock_rec:
        tm.run(name, model, rng_seed)
    budget = max(scores(c) for c in stock_rec.calls) // 5
    with mpsboost.patched(model, recipes=[RECIPE], device=MPS, options={RECIPE: {"max_scores": budget}}):
        with RecordSdpa() as rec:
            out = tm.run(name, model, rng_seed)
    assert len(rec.calls) > len(stock_rec.calls) and max(scores(c) for c in rec.calls) <= budget
    assert (out - ref).abs().max().item() <= 1e-6 * max(1.0, ref.abs().max().item())
    assert all(m.__dict__.get("forward") is before[n] for n, m in model.named_modules())


def test_transformers_numerics_with_small_budget(rng_seed):
    pytest.importorskip("transformers")
    model = tm.build("qwen3", seed=rng_seed)
    model.set_attn_implementation("sdpa")
    ids = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(rng_seed))
    with torch.no_grad():
        ref = model(ids).logits
    with mpsboost.patched(
        model, recipes=[RECIPE], device=MPS, options={RECIPE: {"max_scores": 2 * 2 * 5 * 24}}
    ) as report:
        assert report.rows[0].status == "applied" and model.config._attn_implementation == "sdpa"
        with torch.no_grad(), RecordSdpa() as rec:
            out = model(ids).logits
    assert model.config._attn_implementation == "sdpa"
    assert rec.calls and max(scores(c) for c in rec.calls) <= 2 * 2 * 5 * 24
    assert (out - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mask", [None, "bool", "float", "row"])
def test_sdpa_split_equals_sdpa(causal, mask, rng_seed):
    g = torch.Generator().manual_seed(rng_seed)
    q = torch.randn(2, 3, 37, 8, generator=g)
    k = torch.randn(2, 3, 37, 8, generator=g)
    v = torch.randn(2, 3, 37, 5, generator=g)
    m = None
    if mask == "bool":
        m = torch.rand(2, 1, 37, 37, generator=g) > 0.3
        m[..., 0] = True  # every row sees one key at least (no all -inf rows)
    elif mask == "float":
        m = torch.randn(1, 3, 37, 37, generator=g)
    elif mask == "row":
        m = torch.randn(2, 1, 1, 37, generator=g)  # broadcast over the queries
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=causal and m is None)
    out = ops.sdpa_split(q, k, v, m, is_causal=causal and m is None, max_scores=2 * 3 * 37 * 4)
    assert (out - ref).abs().max().item() <= 1e-6


def test_plans_by_environment():
    pytest.importorskip("diffusers")
    tr = tm.build("wan_transformer")
    rows = {
        (dev, ver): mpsboost.plan(tr, device=dev, torch_version=ver, recipes=[RECIPE]).rows[0]
        for dev, ver in (
            ("mps", "2.14.1"),
            ("mps", "2.15.0"),
            ("mps", "2.16.0.dev20261201"),
            ("cuda", "2.11.0"),
            ("cpu", "2.13.0"),
        )
    }
    from mpsboost.gate import FEATURES

    for (dev, ver), row in rows.items():
        if dev != "mps":
            assert row.status != "would apply" and "stock kept" in row.reason
        elif "sdpa_large_scores_correct" not in FEATURES:
            assert row.status == "would apply" and "ComfyUI#14837" in row.reason
    with pytest.raises(mpsboost.errors.PatchError, match="max_scores"):
        mpsboost.patch(tr, recipes=[RECIPE], device=MPS, options={RECIPE: {"max_scores": 0}})


def test_patching_twice_is_a_noop():
    pytest.importorskip("diffusers")
    tr = tm.build("wan_transformer")
    mpsboost.patch(tr, recipes=[RECIPE], device=MPS)
    try:
        assert mpsboost.patch(tr, recipes=[RECIPE], device=MPS).noop
    finally:
        mpsboost.unpatch(tr)
    assert not any("_mpsboost_patches" in m.__dict__ for m in tr.modules())
