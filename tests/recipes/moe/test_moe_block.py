"""moe_block: sparse MoE blocks at decode in few ops, equal to stock, reversible, compile-transparent."""

from __future__ import annotations

import copy

import pytest
import torch

import mpsboost
from mpsboost.gate import Env

from mpsboost.bench.models import TINY_LM
from tiny_models import gated_deltanet_lm
from mpsboost.bench import ModuleOps

MPS215 = Env.simulate("mps", "2.15.0")
MPS214 = Env.simulate("mps", "2.14.1")


def _lm(family: str, **extra):
    import transformers as t

    moe = dict(moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2)
    if family == "qwen3_5_moe":
        m = gated_deltanet_lm("qwen3_5_moe")
    elif family == "qwen3_next":
        m = gated_deltanet_lm("qwen3_next")
    elif family in ("qwen3_moe", "qwen3_moe_norm"):
        cfg = t.Qwen3MoeConfig(**TINY_LM, head_dim=32, norm_topk_prob=family.endswith("norm"), **moe, **extra)
        m = t.Qwen3MoeForCausalLM(cfg)
    elif family == "qwen2_moe":
        cfg = t.Qwen2MoeConfig(**TINY_LM, shared_expert_intermediate_size=32, **moe, **extra)
        m = t.Qwen2MoeForCausalLM(cfg)
    elif family == "olmoe":
        m = t.OlmoeForCausalLM(t.OlmoeConfig(**TINY_LM, intermediate_size=16, num_experts=8, num_experts_per_tok=2))
    elif family == "mixtral":
        cfg = t.MixtralConfig(**TINY_LM, head_dim=32, intermediate_size=16, num_local_experts=8, num_experts_per_tok=2)
        m = t.MixtralForCausalLM(cfg)
    else:
        raise KeyError(family)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.2)
    return m.eval()


FAMILIES = ["qwen3_5_moe", "qwen3_next", "qwen3_moe", "qwen3_moe_norm", "qwen2_moe", "olmoe", "mixtral"]


def _blocks(m):
    return [mod for name, mod in m.named_modules() if name.endswith("mlp") and hasattr(mod, "experts")]


def _decode_logits(m, ids, mask, steps=3):
    """Prefill with left padding and a mask, then teacher-forced one-token steps."""
    out = m(input_ids=ids, attention_mask=mask, use_cache=True)
    logits = [out.logits]
    past = out.past_key_values
    g = torch.Generator().manual_seed(7)
    for _ in range(steps):
        nxt = torch.randint(3, m.config.vocab_size, (ids.shape[0], 1), generator=g)
        mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
        out = m(input_ids=nxt, attention_mask=mask, past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits.append(out.logits)
    return torch.cat(logits, dim=1)


def _inputs(vocab, batch=2):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, vocab, (batch, 6), generator=g)
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[1, :2] = 0  # left padding of the second row
        ids[1, :2] = 0
    return ids, mask


@pytest.mark.parametrize("batch", [1, 2], ids=["one-sequence", "batch2-left-padded"])
@pytest.mark.parametrize("env", [MPS215, MPS214], ids=["mps-2.15.0", "mps-2.14.1"])
@pytest.mark.parametrize("family", FAMILIES)
def test_outputs_and_tokens_equal_stock(family, env, batch):
    stock = _lm(family)
    m = copy.deepcopy(stock)
    report = mpsboost.patch(m, device=env)
    assert any(r.recipe == "moe_block" and r.status == "applied" for r in report.rows), report
    ids, mask = _inputs(m.config.vocab_size, batch)
    with torch.no_grad():
        ref, got = _decode_logits(stock, ids, mask), _decode_logits(m, ids, mask)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        ref_nc = stock(input_ids=ids, attention_mask=mask, use_cache=False).logits
        torch.testing.assert_close(
            m(input_ids=ids, attention_mask=mask, use_cache=False).logits, ref_nc, rtol=1e-5, atol=1e-5
        )
        kw = dict(attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
        for _ in range(2):  # a second generate() call
            assert torch.equal(m.generate(ids, **kw), stock.generate(ids, **kw))


def _block_ops(block, hidden):
    x = torch.randn(1, 1, hidden)
    with torch.no_grad(), ModuleOps() as c:
        block(x)
    return c.count


@pytest.mark.parametrize("env", [MPS215, MPS214], ids=["mps-2.15.0", "mps-2.14.1"])
@pytest.mark.parametrize("family", FAMILIES)
def test_decode_ops_at_most_25(family, env):
    m = _lm(family)
    mpsboost.patch(m, device=env)
    block = _blocks(m)[0]
    assert _block_ops(block, m.config.hidden_size) <= 25


@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_moe", "mixtral"])
def test_grouped_decode_orders_ids_by_topk_not_sort(family, tokens):
    """The routed ids reach the grouped matmuls in ascending order through ``topk(largest=False)``: on MPS
    the same one-dispatch block sort as ``sort``; on CUDA (the GPU proxy of a Mac) ``sort`` of a few ids is
    cub's segmented sort with three device copies. Equal to stock at 1e-5 for 1 and 3 tokens. (The composed
    path: option fused='off'; the fused path orders them inside mpsboost::moe_route.)"""
    stock = _lm(family)
    m = copy.deepcopy(stock)
    mpsboost.patch(m, device=MPS215, options={"moe_block": {"fused": "off"}})
    block, ref = _blocks(m)[0], _blocks(stock)[0]
    x = torch.randn(1, tokens, m.config.hidden_size, generator=torch.Generator().manual_seed(tokens))
    with torch.no_grad(), ModuleOps() as seen:
        got = block(x)
    assert "_grouped_mm" in seen.bare, seen.bare  # the grouped path ran
    assert "topk" in seen.bare and "sort" not in seen.bare, seen.bare
    with torch.no_grad():
        want = ref(x)
    torch.testing.assert_close(
        got[0] if isinstance(got, tuple) else got, want[0] if isinstance(want, tuple) else want, rtol=1e-5, atol=1e-5
    )


FUSED = {"moe_block": {"fused_inputs": True}}


@pytest.mark.parametrize("batch", [1, 2], ids=["one-sequence", "batch2-left-padded"])
@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next", "qwen2_moe"])
def test_fused_inputs_equal_stock_in_fewer_ops(family, batch):
    """Option fused_inputs: router, shared gate and shared gate/up in one matmul on a copy side by side;
    decode logits and greedy tokens equal stock's (float32, 1e-5), 22 ops per one-token block."""
    stock = _lm(family)
    m = copy.deepcopy(stock)
    report = mpsboost.patch(m, device=MPS215, options=FUSED)
    row = next(r for r in report.rows if r.recipe == "moe_block")
    assert row.status == "applied" and "one matmul" in row.backing and "per block" in row.reason, row
    ids, mask = _inputs(m.config.vocab_size, batch)
    with torch.no_grad():
        torch.testing.assert_close(_decode_logits(m, ids, mask), _decode_logits(stock, ids, mask), rtol=1e-5, atol=1e-5)
        kw = dict(attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
        assert torch.equal(m.generate(ids, **kw), stock.generate(ids, **kw))
    block = _blocks(m)[0]
    assert block.__dict__["_mpsboost_moe_block"].weights.inputs_t is not None
    assert _block_ops(block, m.config.hidden_size) <= 22


def test_fused_inputs_follow_a_weight_change_and_default_off():
    stock = _lm("qwen3_5_moe")
    m = copy.deepcopy(stock)
    mpsboost.patch(m, device=MPS215, options=FUSED)
    b, rb = _blocks(m)[0], _blocks(stock)[0]
    x = torch.randn(1, 1, m.config.hidden_size, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        b(x)  # the fused copy is built
        for blk in (b, rb):  # the same in-place writes to the shared expert's up weight and the router
            blk.shared_expert.up_proj.weight.mul_(-0.5)
            blk.gate.weight.add_(0.25)
        torch.testing.assert_close(b(x), rb(x), rtol=1e-5, atol=1e-5)
    plain = copy.deepcopy(stock)
    mpsboost.patch(plain, device=MPS215)
    pb = _blocks(plain)[0]
    with torch.no_grad():
        pb(x)
    assert pb.__dict__["_mpsboost_moe_block"].weights.inputs_t is None  # off unless asked


def test_fused_inputs_must_be_a_bool():
    with pytest.raises(TypeError, match="fused_inputs='yes' has type str; fused_inputs takes bool"):
        mpsboost.patch(_lm("qwen3_5_moe"), device=MPS215, options={"moe_block": {"fused_inputs": "yes"}})


@pytest.mark.parametrize("family", ["qwen3_5_moe", "mixtral"])
def test_one_token_block_equals_stock_bf16_within_noise(family):
    stock = _lm(family).to(torch.bfloat16)
    m = copy.deepcopy(stock)
    mpsboost.patch(m, device=MPS215)
    b_ref, b = _blocks(stock)[0], _blocks(m)[0]
    x = torch.randn(1, 1, m.config.hidden_size, dtype=torch.bfloat16)
    with torch.no_grad():
        ref32 = _blocks(_lm(family))[0](x.float())
        err = (b(x).float() - ref32).abs().max()
        err_stock = (b_ref(x).float() - ref32).abs().max()
    assert err <= 2 * err_stock + 1e-2


def test_unpatch_restores_forward_and_storage():
    m = _lm("qwen3_5_moe")
    block = _blocks(m)[0]
    before = {n: p.detach().clone() for n, p in block.named_parameters()}
    ptrs = {n: p.data_ptr() for n, p in block.named_parameters()}
    params = dict(block.named_parameters())
    mpsboost.patch(m, device=MPS215)
    assert "forward" in block.__dict__
    with torch.no_grad():
        block(torch.randn(1, 1, m.config.hidden_size))  # the recipe's path ran
    # each weight stays in its own storage (a shared one reads as an undeclared tie: test_no_false_ties.py)
    assert {n: p.data_ptr() for n, p in block.named_parameters()} == ptrs
    assert len({p.untyped_storage().data_ptr() for p in block.parameters()}) == len(ptrs)
    mpsboost.unpatch(m)
    assert "forward" not in block.__dict__
    for n, p in block.named_parameters():
        assert p is params[n] and torch.equal(p, before[n])
    storages = {p.untyped_storage().data_ptr() for p in block.parameters()}
    assert len(storages) == len(ptrs)


def test_user_choice_after_patching_runs_the_experts_module():
    m = _lm("qwen3_moe")
    mpsboost.patch(m, device=MPS215)
    m.set_experts_implementation("eager")
    calls = []
    block = _blocks(m)[0]
    h = block.experts.register_forward_hook(lambda *a: calls.append(1))
    with torch.no_grad():
        block(torch.randn(1, 1, m.config.hidden_size))
    h.remove()
    assert calls == [1]


def test_fullgraph_compile_of_decode_step():
    m = _lm("qwen3_5_moe")
    mpsboost.patch(m, device=MPS215)
    block = _blocks(m)[0]
    x = torch.randn(1, 1, m.config.hidden_size)
    torch._dynamo.reset()
    with torch.no_grad():
        ref = block(x)
        got = torch.compile(block, fullgraph=True, backend="eager")(x)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_decisions_per_environment():
    m = _lm("qwen3_5_moe")

    def row(env):
        rep = mpsboost.plan(m, env=env)
        return next(r for r in rep.rows if r.recipe == "moe_block")

    assert "grouped_mm" in row(MPS215).backing
    assert "gathered" in row(MPS214).backing
    assert row(Env.simulate("cuda", "2.11.0", capability=(9, 0))).status == "skipped"
    assert row(Env.simulate("cpu", "2.13.0")).status == "would apply"


FP8_FAMILIES = ["qwen3_5_moe", "qwen3_moe", "qwen2_moe"]


def _fp8_pair(family, env):
    """The same model twice with fp8 rowwise layers: without moe_block (the reference) and with it."""
    alone = _lm(family)
    m = copy.deepcopy(alone)
    mpsboost.patch(alone, device=env, fp8="rowwise", exclude=["moe_block"])
    report = mpsboost.patch(m, device=env, fp8="rowwise")
    assert all(r.status == "applied" for r in report.rows if r.recipe == "moe_block"), report
    assert any(r.recipe == "moe_block" for r in report.rows), report
    return alone, m


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("env", [MPS215, MPS214], ids=["mps-2.15.0", "mps-2.14.1"])
@pytest.mark.parametrize("family", FP8_FAMILIES)
def test_fp8_experts_and_shared_expert_inside_the_block_equal_fp8_alone(family, env, batch):
    """fp8 experts and an fp8 shared expert run their own modules inside the recipe's path (its routing and
    combine kept): float32 within 1e-5 of the fp8 model without moe_block."""
    alone, m = _fp8_pair(family, env)
    block = _blocks(m)[0]
    assert type(block.experts).__name__.startswith("FP8")
    if family != "qwen3_moe":
        assert type(block.shared_expert.up_proj).__name__ == "FP8Linear"
    calls = []
    h = block.experts.register_forward_hook(lambda *a: calls.append(a[1][0].shape[0]))
    ids, mask = _inputs(m.config.vocab_size, batch)
    with torch.no_grad():
        got, ref = _decode_logits(m, ids, mask), _decode_logits(alone, ids, mask)
    h.remove()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert calls and all(n <= batch for n in calls[1:])  # the decode steps called the experts module
    assert block.__dict__["_mpsboost_moe_block"].weights is not None  # the recipe's path, not the block's own


@pytest.mark.parametrize("env", [MPS215, MPS214], ids=["mps-2.15.0", "mps-2.14.1"])
@pytest.mark.parametrize("family", FP8_FAMILIES)
def test_fp8_decode_block_in_fewer_ops_than_fp8_alone(family, env):
    """After a prefill, one decode token through an fp8 block dispatches fewer ops than the block's own
    forward over the same fp8 layers (qwen3_5_moe tiny, mps 2.15.0: 54 against 59)."""
    alone, m = _fp8_pair(family, env)
    hidden = m.config.hidden_size
    counts = []
    for model in (alone, m):
        block = _blocks(model)[0]
        with torch.no_grad():
            block(torch.randn(1, 8, hidden))  # a prefill
        counts.append(_block_ops(block, hidden))
    assert counts[1] < counts[0], counts


def test_fp8_experts_present_at_decide_and_unpatch_restores():
    """Experts and shared expert already fp8 when the recipe decides (as after load_fp8): it applies, equal to
    fp8 without it; leaving mpsboost.patched() restores the block's forward, the fp8 modules untouched."""
    base = _lm("qwen3_5_moe")
    mpsboost.patch(base, device=MPS215, fp8="rowwise", recipes=["fp8_weights"])
    alone = copy.deepcopy(base)
    block = _blocks(base)[0]
    experts_fwd = block.experts.__dict__.get("forward")
    ids, mask = _inputs(base.config.vocab_size, 2)
    with mpsboost.patched(base, recipes=["moe_block"], device=MPS215) as rep:
        assert [r.status for r in rep.rows if r.recipe == "moe_block"] == ["applied"] * len(_blocks(base)), rep
        with torch.no_grad():
            torch.testing.assert_close(
                _decode_logits(base, ids, mask), _decode_logits(alone, ids, mask), rtol=1e-5, atol=1e-5
            )
    assert "forward" not in block.__dict__ and "_mpsboost_moe_block" not in block.__dict__
    assert block.experts.__dict__.get("forward") is experts_fwd
    with torch.no_grad():
        assert torch.equal(_decode_logits(base, ids, mask), _decode_logits(alone, ids, mask))


def test_simulated_mac_decisions_on_another_gpu_keep_the_grouped_path(monkeypatch):
    """The GPU proxy runs Mac decisions on CUDA tensors: where the simulated Mac has the grouped kernel, the
    real GPU's kernel stands in (not the dense fallback over every expert)."""
    from mpsboost.recipes import moe_experts

    cuda = Env.simulate("cuda", "2.11.0", capability=(9, 0))
    monkeypatch.setattr(moe_experts.Env, "detect", classmethod(lambda cls, device=None: cuda))
    stand_in = moe_experts.MoeExperts._stand_in_pairs
    dev = torch.device("cuda")
    pairs = {("mps", torch.bfloat16), ("mps", torch.float32), ("cpu", torch.bfloat16)}
    assert stand_in(dev, MPS215, pairs, {64, 32, 16}) == {("cuda", torch.bfloat16)}
    assert stand_in(dev, MPS214, set(), {64, 32, 16}) == set()  # no kernel on the simulated Mac: nothing
    old = Env.simulate("cuda", "2.7.0", capability=(9, 0))
    monkeypatch.setattr(moe_experts.Env, "detect", classmethod(lambda cls, device=None: old))
    assert stand_in(dev, MPS215, pairs, {64, 32, 16}) == set()  # the real GPU has no grouped kernel


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_moe", "mixtral"])
def test_many_tokens_through_the_recipe_path_equal_stock(family):
    """max_tokens above the prompt: prefill of a left-padded batch runs the recipe's many-token path too."""
    stock = _lm(family)
    m = copy.deepcopy(stock)
    mpsboost.patch(m, device=MPS215, options={"moe_block": {"max_tokens": 64}})
    ids, mask = _inputs(m.config.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(_decode_logits(m, ids, mask), _decode_logits(stock, ids, mask), rtol=1e-5, atol=1e-5)


def test_bad_options_are_named():
    m = _lm("qwen3_moe")
    from mpsboost.errors import PatchError

    with pytest.raises(PatchError, match="max_tokens=0: expected an int >= 1"):
        mpsboost.patch(m, device=MPS215, options={"moe_block": {"max_tokens": 0}})
    with pytest.raises(PatchError, match="path='dense'"):
        mpsboost.patch(m, device=MPS215, options={"moe_block": {"path": "dense"}})
    assert "forward" not in _blocks(m)[0].__dict__
