"""moe_block's fused decode path: the router's chains, the gated activations and the combine on mpsboost::moe_route,
moe_glu and moe_combine (mpsboost.ops.moe_route), at most 12 aten ops per block under Mac 2.15.0 decisions with
bf16, fp8 and low-bit experts, equal to stock, never more ops than stock in a whole generate(), chosen at patch time
by mpsboost.ondevice.choose (a real Mac times it; everything else takes the static choice)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import mpsboost
from mpsboost.gate import Env, parse_torch_version
from mpsboost.ondevice import TimingCache
from mpsboost.recipes import moe_block

from recipes.moe.test_moe_block import FAMILIES, _blocks, _decode_logits, _inputs, _lm
from mpsboost.bench.models import TINY_LM
from tiny_models import gated_deltanet_lm
from mpsboost.bench import ModuleOps

MPS215 = Env.simulate("mps", "2.15.0")
MPS214 = Env.simulate("mps", "2.14.1")
OFF = {"moe_block": {"fused": "off"}}


def _step_ops(block, hidden, dtype=torch.float32, tokens=1):
    """The aten ops of one decode call of ``block`` after a prefill (constants built), views included."""
    with torch.no_grad():
        block(torch.randn(1, 8, hidden, dtype=dtype))
        x = torch.randn(1, tokens, hidden, dtype=dtype)
        with ModuleOps() as seen:
            block(x)
    return seen.names


def _lowbit_lm(family="qwen3_5_moe"):
    """A tiny LM whose widths take 4-bit groups of 32 (expert and shared widths 64), its experts and shared expert
    quantized in memory by low_bit_weights (MLX affine, 4 bits), bf16."""
    import transformers as t

    if family == "qwen3_5_moe":
        m = gated_deltanet_lm("qwen3_5_moe", moe_intermediate_size=64, shared_expert_intermediate_size=64)
    else:
        cfg = t.Qwen3MoeConfig(**TINY_LM, head_dim=32, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2)
        m = t.Qwen3MoeForCausalLM(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.2)
    m = m.to(torch.bfloat16).eval()
    opts = {"low_bit_weights": {"bits": 4, "group_size": 32}}
    mpsboost.patch(m, device=MPS215, recipes=["low_bit_weights"], options=opts)
    return m


# ------------------------------------------------------------------ ops per block


@pytest.mark.parametrize("weights", ["float32", "bfloat16", "fp8", "low-bit"])
def test_qwen35_block_at_most_12_ops_under_mac_215(weights):
    """One decode token through a Qwen3.5-MoE block (shared expert with its sigmoid gate): <= 12 aten ops with the
    fused operators (24 composed), whatever the experts are stored in, and the grouped products are the stacks' own
    operator (torch's grouped_mm, mpsboost::grouped_mm on fp8 codes, mpsboost::affine_grouped_gemv on low bits)."""
    if weights == "low-bit":
        m = _lowbit_lm()
        mpsboost.patch(m, device=MPS215, exclude=["moe_experts"])
        dt, grouped = torch.bfloat16, "mpsboost.affine_grouped_gemv"
    else:
        m = _lm("qwen3_5_moe")
        dt = torch.float32 if weights == "float32" else torch.bfloat16
        m = m.to(dt)
        mpsboost.patch(m, device=MPS215, **({"fp8": "rowwise"} if weights == "fp8" else {}))
        grouped = "mpsboost.grouped_mm" if weights == "fp8" else "aten._grouped_mm"
    block = _blocks(m)[0]
    names = _step_ops(block, m.config.hidden_size, dt)
    assert len(names) <= 12, names
    assert names.count(grouped) == 2, names
    assert {"mpsboost.moe_route", "mpsboost.moe_glu", "mpsboost.moe_combine"} <= set(names), names
    for op in ("aten.topk", "aten.sort", "aten.sigmoid", "aten.silu", "aten.searchsorted", "aten.addmm"):
        assert op not in names, names


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_fewer_ops_fused_than_composed(family):
    """Mac 2.15.0: at most 12 ops a block in every family (7 without a shared expert), fewer than the composed path;
    Mac 2.14.1 (the gathered path): at most 14 for two tokens."""
    counts = {}
    for label, env, opts, tokens in (
        ("fused", MPS215, None, 1),
        ("composed", MPS215, OFF, 1),
        ("fused214", MPS214, None, 2),
    ):
        m = _lm(family)
        mpsboost.patch(m, device=env, options=opts)
        counts[label] = len(_step_ops(_blocks(m)[0], m.config.hidden_size, tokens=tokens))
    shared = family in ("qwen3_5_moe", "qwen3_next", "qwen2_moe")
    assert counts["fused"] <= (12 if shared else 7) < counts["composed"], counts
    assert counts["fused214"] <= (19 if shared else 14), counts


# ------------------------------------------------------------------ equal to stock


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_decode_equals_stock_within_bf16_noise(family):
    """bf16, batch 2 left-padded, three decode steps: the fused path within bf16 noise of stock (its error against
    a float32 model at most twice stock's own, plus one bf16 ulp of the logits' scale)."""
    base = _lm(family)
    stock = copy.deepcopy(base).to(torch.bfloat16)
    m = copy.deepcopy(stock)
    mpsboost.patch(m, device=MPS215)
    ids, mask = _inputs(m.config.vocab_size, 2)
    with torch.no_grad():
        ref32 = _decode_logits(base, ids, mask)
        err = (_decode_logits(m, ids, mask).float() - ref32).abs().max()
        err_stock = (_decode_logits(stock, ids, mask).float() - ref32).abs().max()
    assert err <= 2 * err_stock + 1e-2 * ref32.abs().max(), (float(err), float(err_stock))


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_moe"])
def test_low_bit_experts_equal_low_bit_alone(family):
    """Low-bit experts and shared expert (affine_grouped_gemv, affine_gemv): the fused block equals the same low-bit
    model without moe_block (bf16 noise: 2e-2 of the logits' scale), decode and generate() tokens."""
    alone = _lowbit_lm(family)
    m = copy.deepcopy(alone)
    rep = mpsboost.patch(m, device=MPS215, exclude=["moe_experts"])
    assert all(r.status == "applied" for r in rep.rows if r.recipe == "moe_block") and any(
        r.recipe == "moe_block" for r in rep.rows
    ), rep
    assert type(_blocks(m)[0].experts).__name__.startswith("Affine")
    ids, mask = _inputs(m.config.vocab_size, 2)
    with torch.no_grad():
        got, ref = _decode_logits(m, ids, mask).float(), _decode_logits(alone, ids, mask).float()
    assert float((got - ref).abs().max()) <= 2e-2 * float(ref.abs().max())


@pytest.mark.parametrize("family", ["qwen3_5_moe", "mixtral", "olmoe"])
def test_fused_equals_composed_fp32_more_tokens(family):
    """max_tokens 8: a 6-token left-padded prefill and decode through the fused path equal the composed path (float32,
    1e-5) and stock."""
    stock = _lm(family)
    outs = []
    for opts in ({"moe_block": {"max_tokens": 8}}, {"moe_block": {"max_tokens": 8, "fused": "off"}}):
        m = copy.deepcopy(stock)
        mpsboost.patch(m, device=MPS215, options=opts)
        ids, mask = _inputs(m.config.vocab_size, 2)
        with torch.no_grad():
            outs.append(_decode_logits(m, ids, mask))
    with torch.no_grad():
        ref = _decode_logits(stock, ids, mask)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[0], ref, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ never more than stock


def _generate_ops(m):
    """Aten ops of a whole generate() (prompt 70, 4 new tokens, batch 2, the second row left-padded by 9, fp32):
    (all, inside the MoE blocks)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, m.config.vocab_size, (2, 70), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    ids[1, :9] = 0
    with torch.no_grad(), ModuleOps() as total, ModuleOps(_blocks(m)) as moe:
        out = m.generate(ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    return total.count, moe.count, out


@pytest.mark.slow
@pytest.mark.parametrize("env", [MPS214, MPS215], ids=["mps-2.14.1", "mps-2.15.0"])
@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next", "qwen3_moe", "qwen2_moe", "olmoe", "mixtral"])
def test_whole_generate_moe_blocks_never_more_ops_than_stock(family, env):
    """A whole generate() (prefill and decode) of the patched model dispatches no more aten ops than stock's, and
    neither do its MoE blocks alone; the tokens are stock's. (Counted on the CPU, where F.rms_norm and SDPA are
    composites: on MPS each is one kernel, so the CPU count errs on stock's side.)"""
    stock = _lm(family)
    m = copy.deepcopy(stock)
    mpsboost.patch(m, device=env)
    all_stock, moe_stock, ref = _generate_ops(stock)
    all_patched, moe_patched, got = _generate_ops(m)
    assert torch.equal(got, ref)
    assert moe_patched <= moe_stock, (moe_patched, moe_stock)
    assert all_patched <= all_stock, (all_patched, all_stock)


# ------------------------------------------------------------------ the patch-time decision


def test_report_names_the_fused_path_and_the_static_choice():
    rep = mpsboost.plan(_lm("qwen3_5_moe"), env=MPS215)
    row = next(r for r in rep.rows if r.recipe == "moe_block")
    assert "fused (mpsboost::moe_*)" in row.backing and "about 12 aten ops" in row.reason, row
    assert "not timed: simulated environment" in row.reason, row
    off = mpsboost.plan(_lm("qwen3_5_moe"), env=MPS215, options=OFF)
    row = next(r for r in off.rows if r.recipe == "moe_block")
    assert "fused" not in row.backing and "option fused='off'" in row.reason, row


def test_patch_on_a_simulated_mac_never_times(monkeypatch):
    """A simulated Mac (and the CPU) take the static choice: the timer, the self-check and the contenders never run."""
    from mpsboost import ondevice

    def boom(*a, **k):
        raise AssertionError("timed on a simulated environment")

    monkeypatch.setattr(ondevice, "default_timer", boom)
    monkeypatch.setattr(moe_block, "_metal_check", boom)
    monkeypatch.setattr(moe_block.moe_route, "timing_pair", boom)
    for env in (MPS215, MPS214, Env.simulate("cpu", "2.13.0")):
        m = _lm("qwen3_moe")
        mpsboost.patch(m, device=env)
        assert _blocks(m)[0].__dict__["_mpsboost_moe_block"].plan.fused


def test_option_fused_is_checked():
    from mpsboost.errors import PatchError

    m = _lm("qwen3_moe")
    with pytest.raises(PatchError, match="fused='yes': expected one of auto, static, off"):
        mpsboost.patch(m, device=MPS215, options={"moe_block": {"fused": "yes"}})
    assert "forward" not in _blocks(m)[0].__dict__


def _real_mac():
    return Env(torch_version=parse_torch_version("2.15.0"), device_type="mps", simulated=False, macos=(26, 1))


class _Timer:
    """Seconds per call by contender (the composed chain or the fused one), counting the calls; the contenders run
    for real on CPU tensors (device="cpu"), so a broken contender raises."""

    def __init__(self, composed, fused):
        self.t = {"composed": composed, "fused": fused}
        self.calls: list[str] = []

    def __call__(self, fn):
        fn()
        name = fn.__name__
        self.calls.append(name)
        val = self.t[name]
        if isinstance(val, Exception):
            raise val
        return val


def _layout():
    lay = moe_block._layout(_blocks(_lm("qwen3_5_moe"))[0])
    assert not isinstance(lay, str)
    return lay


def _choose(tmp_path, timer, mode="auto", check=lambda: None, env=None):
    return moe_block.fusion_choice(
        _layout(),
        torch.float32,
        env or _real_mac(),
        mode,
        device="cpu",
        timer=timer,
        cache=TimingCache(tmp_path / "t.json"),
        chip="Apple M3 Ultra",
        check_fn=check,
    )


def test_a_real_mac_takes_the_fused_path_only_when_faster(tmp_path):
    t = _Timer(10e-6, 6e-6)
    ch = _choose(tmp_path, t)
    assert ch.taken and ch.source == "timed" and ch.ratio == pytest.approx(0.6)
    assert "0.60x" in ch.describe() and "mpsboost::moe_route" in ch.describe()
    assert t.calls.count("composed") == t.calls.count("fused") > 0
    for slow in (10e-6, 12e-6):  # a tie and a slower fused chain go to the composed path
        ch = _choose(tmp_path / str(slow), _Timer(10e-6, slow))
        assert not ch.taken and ch.path == "composed aten ops" and ch.source == "timed"


def test_a_cache_hit_times_nothing(tmp_path):
    _choose(tmp_path, _Timer(10e-6, 6e-6))
    raw = json.loads((tmp_path / "t.json").read_text())
    assert any(k.startswith(moe_block.KERNEL + "|E=4 k=2 H=64 I=16 shared=16") for k in raw["entries"]), raw
    t = _Timer(10e-6, 20e-6)
    ch = _choose(tmp_path, t)
    assert ch.taken and ch.source == "cache" and t.calls == []


def test_a_failed_self_check_or_timing_error_keeps_the_composed_path(tmp_path):
    t = _Timer(10e-6, 6e-6)
    ch = _choose(tmp_path, t, check=lambda: "the MoE route kernel gives other ids")
    assert not ch.taken and ch.source == "self-check failed" and "other ids" in ch.reason and t.calls == []
    ch = _choose(tmp_path, _Timer(10e-6, RuntimeError("MTLCommandBuffer error")))
    assert not ch.taken and ch.source == "timing error" and "MTLCommandBuffer" in ch.reason
    ch = _choose(tmp_path, _Timer(10e-6, 6e-6), mode="static")
    assert ch.taken and ch.source == "static" and "option keeps the static choice" in ch.reason


def test_unpatch_restores_and_fullgraph_compile_of_the_fused_step():
    m = _lm("qwen3_5_moe").to(torch.bfloat16)  # the grouped matmul's meta kernel takes bf16 only
    block = _blocks(m)[0]
    mpsboost.patch(m, device=MPS215)
    x = torch.randn(1, 1, m.config.hidden_size, dtype=torch.bfloat16)
    state = block.__dict__["_mpsboost_moe_block"]
    with torch.no_grad():
        block(x)
        assert state.stacks is not None and state.stacks.kind == "dense"
        w, lay = state.weights, state.layout

        def step(x2):
            return moe_block.moe_route.fused_sparse_moe_block(
                x2, w, top_k=lay.top_k, norm=lay.norm, cast_weights=lay.cast, path="grouped", stacks=state.stacks,
                act_fn=block.experts.act_fn, shared_act=block.shared_expert.act_fn, silu=True, shared_silu=True,
                shape=[1, 1, lay.hidden],
            )  # fmt: skip

        torch._dynamo.reset()
        x2 = x.view(1, -1)
        torch.testing.assert_close(torch.compile(step, fullgraph=True, backend="eager")(x2), step(x2))
        want = block(x)
    mpsboost.unpatch(m)
    assert "forward" not in block.__dict__ and "_mpsboost_moe_block" not in block.__dict__
    with torch.no_grad():
        torch.testing.assert_close(block(x), want, rtol=2e-2, atol=2e-2)  # stock's bf16 rounding
