"""metal_attention: routes to the Metal SDPA kernels each MPS build has; a real SDPA code path, run on CPU by
forcing it.

Plans on simulated MPS 2.12 / 2.13 (nightlies either side of the GQA merge) / 2.14.1 / 2.15.0 / 2.16
nightlies (before and after a merge date), CUDA, CPU;
patched vs stock on tiny transformers (eager and sdpa, grouped-query attention, padding) and diffusers
models (sliced attention); unpatch restores the very same processors and implementations.
"""

from __future__ import annotations

import dataclasses
import datetime as dt

import pytest
import torch

import mpsboost
from mpsboost import gate
from mpsboost.ops.attention import sdpa

from tiny_models import build

FORCE = {"metal_attention": {"force": True}}


def _llama(impl: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation=impl,
    )
    return LlamaForCausalLM(cfg).eval()


def _unet():
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    return UNet2DConditionModel(
        block_out_channels=(32, 64),
        layers_per_block=1,
        sample_size=16,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=2,
        norm_num_groups=32,  # 2 heads of 32 channels
    ).eval()


def _row(model, tv, device="mps", **kw):
    (row,) = mpsboost.plan(model, device=device, torch_version=tv, recipes=["metal_attention"], **kw).rows
    return row


def test_plans_follow_the_gate():
    model = _llama("eager")
    for tv in ("2.11.0", "2.12.0", "2.12.1"):
        row = _row(model, tv)
        assert row.status == "skipped" and "pytorch#181575" in row.reason and "2.13" in row.reason and tv in row.reason
        assert "2.16" in row.reason
    # 2.13 to 2.15 already run the Metal prefill kernels natively: eager models are routed to them.
    for tv in ("2.13.0", "2.14.1", "2.15.0"):
        row = _row(model, tv)
        assert row.status == "would apply" and row.backing.startswith("sdpa"), (tv, row.reason)
        assert "pytorch#181575" in row.reason and "#183280" in row.reason and "'eager' kept in the config" in row.reason
        assert "only in torch 2.16 nightlies" in row.reason
    full = _row(model, "2.16.0.dev20261201")
    assert (
        full.status == "would apply"
        and full.reason.startswith("attention fully on Metal")
        and "'eager' kept in the config" in full.reason
    )
    for dev in ("cuda:9.0", "cpu"):
        row = _row(model, "2.16.0", device=dev)
        assert row.status == "skipped" and "not available on" in row.reason


def test_macos26_fix_named_on_213_only():
    model = _llama("eager")
    r213 = _row(model, "2.13.0")
    r214 = _row(model, "2.14.0")
    assert "pytorch#191794" in r213.reason and "macOS 26" in r213.reason
    assert "pytorch#191794" not in r214.reason
    # A Mac known to run macOS 15 is not affected by the macOS 26 issue, nor eligible for the MPP kernels.
    env15 = gate.Env.simulate("mps", "2.13.0", macos="15.5")
    (row,) = mpsboost.plan(model, env=env15, recipes=["metal_attention"]).rows
    assert row.status == "would apply" and "pytorch#191794" not in row.reason and "#182256" not in row.reason
    env262 = gate.Env.simulate("mps", "2.13.0", macos="26.2")
    (row,) = mpsboost.plan(model, env=env262, recipes=["metal_attention"]).rows
    # MPP kernels (prefill_attention_mpp_*) first ship in the 2.14.0 macOS wheel: none on 2.13.0
    assert "#182256" not in row.reason and "pytorch#191794" in row.reason


def test_gqa_merge_date_on_213_nightlies():
    model = _llama("eager")  # 4 heads, 2 K/V heads
    before = _row(model, "2.13.0.dev20260510")
    after = _row(model, "2.13.0.dev20260511")
    assert before.status == after.status == "would apply"
    assert "K/V repeated" in before.reason and "predates the merge" in before.reason and "2026-05-11" in before.reason
    assert "K/V repeated" not in after.reason and "pytorch#183280" in after.reason


def test_sdpa_model_is_routed_only_for_the_contiguous_copy(monkeypatch):
    """transformers on 'sdpa' reaches the same Metal kernels itself (enable_gqa on MPS from torch 2.13); the route
    is taken for the copy of strided q/k/v alone (sdpa_strided_correct), on every build, and left to stock once
    the gate knows the build reads strided views right."""
    model = _llama("sdpa")
    for tv in ("2.12.0", "2.13.0", "2.15.0", "2.16.0.dev20261201"):
        row = _row(model, tv)
        assert row.status == "would apply" and "sdpa_strided_correct" in row.reason, (tv, row.reason)
        assert "made contiguous" in row.backing
    feat = gate.FEATURES["sdpa_strided_correct"]
    fixed = {**feat.rules, "mps": (gate.Rule(since="2.15"),)}
    monkeypatch.setitem(gate.FEATURES, "sdpa_strided_correct", dataclasses.replace(feat, rules=fixed))
    row = _row(model, "2.15.0")
    assert row.status == "skipped" and "stock already does it" in row.reason, row.reason
    assert _row(model, "2.12.0").status == "would apply"  # still affected before the fix


def test_nightly_merge_date_is_honoured(monkeypatch):
    """With a merge date for 'fully on Metal', earlier 2.16 nightlies get the 2.13-2.15 kernels' reason."""
    feat = gate.FEATURES["metal_attention"]
    dated = tuple(dataclasses.replace(r, merged=dt.date(2026, 11, 15)) for r in feat.rules["mps"])
    monkeypatch.setitem(gate.FEATURES, "metal_attention", dataclasses.replace(feat, rules={**feat.rules, "mps": dated}))
    model = _llama("eager")
    before = _row(model, "2.16.0.dev20261101")
    after = _row(model, "2.16.0.dev20261201")
    assert before.status == "would apply" and "only in torch 2.16 nightlies" in before.reason
    assert after.status == "would apply" and after.reason.startswith("attention fully on Metal")


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_transformers_patched_matches_stock(impl, rng_seed):
    model = _llama(impl)
    ids = torch.randint(3, 128, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
    greedy_ref = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    report = mpsboost.patch(model, recipes=["metal_attention"], options=FORCE)
    assert [r.status for r in report.rows] == ["applied"]
    assert model.config._attn_implementation == impl  # the config is not touched; the attention modules are
    with torch.no_grad():
        got = model(ids, attention_mask=mask).logits
    greedy = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    mpsboost.unpatch(model)
    assert model.config._attn_implementation == impl
    # Padded query positions are undefined (eager and sdpa differ there too); compare the real ones.
    valid = mask.bool()
    err = ((got[valid] - ref[valid]).norm() / ref[valid].norm()).item()
    assert err < 1e-5, err
    assert torch.equal(greedy, greedy_ref)


def test_sdpa_op_grouped_kv_and_masks(rng_seed):
    b, h, hkv, lq, lk, d = 2, 8, 2, 5, 11, 64
    q = torch.randn(b, h, lq, d)
    k = torch.randn(b, hkv, lk, d)
    v = torch.randn(b, hkv, lk, d)
    kr, vr = (t.repeat_interleave(h // hkv, dim=1) for t in (k, v))
    bool_mask = torch.rand(b, 1, lq, lk) > 0.3
    bool_mask[..., 0] = True
    ref = torch.nn.functional.scaled_dot_product_attention(q, kr, vr, attn_mask=bool_mask)
    assert torch.allclose(sdpa(q, k, v, bool_mask), ref, atol=1e-5)
    # a float mask of another dtype is cast; causal with a mask becomes the combined mask
    fmask = torch.zeros(b, 1, lq, lk, dtype=torch.float64).masked_fill(~bool_mask, -1e30)
    assert torch.allclose(sdpa(q, k, v, fmask), ref, atol=1e-5)
    causal = torch.ones(lq, lk, dtype=torch.bool).tril()
    ref_c = torch.nn.functional.scaled_dot_product_attention(q, kr, vr, attn_mask=bool_mask & causal)
    assert torch.allclose(sdpa(q, k, v, bool_mask, is_causal=True), ref_c, atol=1e-5)


def test_diffusers_sliced_attention_to_sdpa(rng_seed):
    unet = _unet()
    unet.set_attention_slice(1)  # what enable_attention_slicing() does on low-memory Macs
    before = dict(unet.attn_processors)
    assert {type(p).__name__ for p in before.values()} == {"SlicedAttnProcessor"}
    x, ts, enc = torch.randn(1, 4, 16, 16), torch.tensor([10]), torch.randn(1, 7, 32)
    with torch.no_grad():
        ref = unet(x, ts, enc).sample
    # Under MPS decisions the matmul processor is kept: diffusers' SDPA processors pass strided q/k/v, which no
    # build is known to read right (sdpa_strided_correct); forced (any device) the routing itself is checked.
    plan = mpsboost.plan(unet, device="mps", torch_version="2.16.0.dev20261201", recipes=["metal_attention"])
    assert {r.status for r in plan.rows} == {"skipped"} and len(plan.rows) == len(before)
    assert all("strided" in r.reason for r in plan.rows)
    mpsboost.patch(unet, recipes=["metal_attention"], options=FORCE)
    assert {type(p).__name__ for p in unet.attn_processors.values()} == {"AttnProcessor2_0"}
    with torch.no_grad():
        got = unet(x, ts, enc).sample
    mpsboost.unpatch(unet)
    assert all(unet.attn_processors[k] is v for k, v in before.items())
    assert torch.allclose(got, ref, rtol=1e-4, atol=1e-5), (got - ref).abs().max()


def test_diffusers_attention_already_on_sdpa_is_left_alone():
    # Wan's attention modules dispatch to SDPA themselves: nothing to route.
    (row,) = mpsboost.plan(
        build("wan_transformer"), device="mps", torch_version="2.16.0.dev20261201", recipes=["metal_attention"]
    ).rows
    assert row.status == "not applicable"
    # Attention modules on the default SDPA processor are found and skipped with the reason.
    rows = mpsboost.plan(_unet(), device="mps", torch_version="2.16.0.dev20261201", recipes=["metal_attention"]).rows
    assert rows and {r.status for r in rows} == {"skipped"}
    assert all("AttnProcessor2_0 is not a matmul processor" in r.reason for r in rows)


def test_unsupported_head_dim_keeps_stock():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=48,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        attn_implementation="eager",
    )  # head_dim 24
    (row,) = mpsboost.plan(
        LlamaForCausalLM(cfg), device="mps", torch_version="2.16.0.dev20261201", recipes=["metal_attention"]
    ).rows
    assert row.status == "skipped" and "head_dim 24" in row.reason
