"""moe_block: router logits and the aux loss as stock gives them (``output_router_logits=True``, transformers'
output capture hooks on the router module), a normal decode step without the router's own ops, and intermediate
widths the grouped kernel cannot take (rows not a multiple of 16 bytes) on a path that works."""

from __future__ import annotations

import copy

import pytest
import torch

import mpsboost
from mpsboost.gate import Env
from mpsboost.ops import moe as moe_ops

from mpsboost.bench.models import TINY_LM
from tiny_models import gated_deltanet_lm
from mpsboost.bench import ModuleOps, relative_error

MPS215 = Env.simulate("mps", "2.15.0")
MPS214 = Env.simulate("mps", "2.14.1")
ENVS = [None, MPS215, MPS214]
ENV_IDS = ["native", "mps-2.15.0", "mps-2.14.1"]
FAMILIES = ["qwen3_5_moe", "qwen3_next", "qwen3_moe", "qwen2_moe", "olmoe", "mixtral"]


def _lm(family: str, inter: int = 16, dtype: torch.dtype = torch.float32, **extra):
    """A tiny LM of ``family`` with routed experts of intermediate width ``inter``; random weights N(0, 0.2)."""
    import transformers as t

    moe = dict(moe_intermediate_size=inter, num_experts=8, num_experts_per_tok=2)
    if family in ("qwen3_5_moe", "qwen3_next"):
        m = gated_deltanet_lm(family, moe_intermediate_size=inter, **extra)
    elif family in ("qwen3_moe", "qwen3_moe_norm"):
        cfg = t.Qwen3MoeConfig(**TINY_LM, head_dim=32, norm_topk_prob=family.endswith("norm"), **moe, **extra)
        m = t.Qwen3MoeForCausalLM(cfg)
    elif family == "qwen2_moe":
        m = t.Qwen2MoeForCausalLM(t.Qwen2MoeConfig(**TINY_LM, shared_expert_intermediate_size=32, **moe, **extra))
    elif family == "olmoe":
        cfg = t.OlmoeConfig(**TINY_LM, intermediate_size=inter, num_experts=8, num_experts_per_tok=2, **extra)
        m = t.OlmoeForCausalLM(cfg)
    elif family == "mixtral":
        cfg = t.MixtralConfig(
            **TINY_LM, head_dim=32, intermediate_size=inter, num_local_experts=8, num_experts_per_tok=2, **extra
        )
        m = t.MixtralForCausalLM(cfg)
    else:
        raise KeyError(family)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.2)
    return m.to(dtype).eval()


def _patched(stock, env, **kw):
    m = copy.deepcopy(stock)
    report = mpsboost.patch(m, device=env, **kw)
    rows = [r for r in report.rows if r.recipe == "moe_block"]
    assert rows and all(r.status == "applied" for r in rows), report
    return m, rows


def _steps(m, ids, mask, g, **kw):
    """A prefill (left padding, a mask), two one-token steps of the batch and a two-token one (4 tokens: the
    recipe's path up to its bound), each with ``kw``; the outputs."""
    out = m(input_ids=ids, attention_mask=mask, use_cache=True, **kw)
    outs, past = [out], out.past_key_values
    for width in (1, 1, 2):  # stock's aux loss takes no attention mask past the prefill (transformers raises)
        out = m(input_ids=torch.randint(3, 128, (ids.shape[0], width), generator=g), past_key_values=past, **kw)
        outs.append(out)
        past = out.past_key_values
    return outs


@pytest.mark.parametrize("family", FAMILIES)
def test_router_logits_and_aux_loss_equal_stock(family, rng_seed):
    """Natively and under Mac 2.15.0 and 2.14.1 decisions, with the config's ``output_router_logits=True`` (as
    fine-tuned checkpoints ship it): a prefill, decode steps of 1 and 2 tokens a row of 2, generate() of one row
    (single-token steps). Every router logit of every layer and the aux loss equal stock's (float32, 1e-5), the
    logits too, and generate() gives stock's tokens."""
    stock = _lm(family, output_router_logits=True)
    ids = torch.randint(3, 128, (2, 6))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    ids[1, :2] = 0
    seed = torch.randint(0, 2**31, ()).item()
    kw = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref = _steps(stock, ids, mask, torch.Generator().manual_seed(seed))
        ref_tokens = stock.generate(ids[:1], **kw)
    for env, name in zip(ENVS, ENV_IDS):
        m, _ = _patched(stock, env)
        with torch.no_grad():
            got = _steps(m, ids, mask, torch.Generator().manual_seed(seed))
            for r, o in zip(ref, got):
                assert len(o.router_logits) == len(r.router_logits) == stock.config.num_hidden_layers, name
                for a, b in zip(o.router_logits, r.router_logits):
                    # atol 5e-5: one run in four saw 1.46e-5 on Qwen3.5-MoE (float32 order of the composed path)
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=5e-5, msg=lambda e: f"{name}: {e}")
                torch.testing.assert_close(o.aux_loss, r.aux_loss, rtol=1e-5, atol=1e-6, msg=lambda e: f"{name}: {e}")
                # the logits the same way: float32 order of the composed path (one seed saw 1.07e-5 on Qwen3-Next)
                torch.testing.assert_close(o.logits, r.logits, rtol=1e-5, atol=5e-5, msg=lambda e: f"{name}: {e}")
            assert torch.equal(m.generate(ids[:1], **kw), ref_tokens), name


def _decode_ops(m, past, tok, **kw) -> list[str]:
    with torch.no_grad(), ModuleOps() as c:
        m(input_ids=tok, past_key_values=copy.deepcopy(past), use_cache=True, **kw)
    return c.bare


@pytest.mark.parametrize("family", ["qwen3_5_moe", "mixtral"])
def test_a_normal_decode_step_keeps_its_ops_once_capture_hooks_exist(family):
    """transformers installs its capture hooks on the router the first time any output is asked for, and keeps
    them. A later decode step that asks for none dispatches exactly the ops it did before (the router module is
    not run for hooks that record nothing); one that asks for router logits runs the router (its softmax)."""
    stock = _lm(family)
    m, _ = _patched(stock, MPS215)
    ids = torch.randint(3, 128, (1, 5))
    tok = torch.randint(3, 128, (1, 1))
    with torch.no_grad():
        past = m(input_ids=ids, use_cache=True).past_key_values
    before = _decode_ops(m, past, tok)
    routers = [mod.gate for name, mod in m.named_modules() if name.endswith("mlp") and hasattr(mod, "gate")]
    assert routers and not any(r._forward_hooks for r in routers)
    with torch.no_grad():
        m(input_ids=ids, use_cache=False, output_router_logits=True)
    assert all(r._forward_hooks for r in routers)  # installed, and kept
    assert _decode_ops(m, past, tok) == before
    assert _decode_ops(m, past, tok, output_hidden_states=True).count("_softmax") == before.count("_softmax")
    wanted = _decode_ops(m, past, tok, output_router_logits=True)
    # each router module's softmax over its experts (stock's), beside the aux loss's own
    assert wanted.count("_softmax") >= before.count("_softmax") + len(routers)


def _shift_routing(module, args, out):
    """A user's hook that routes every token to the next experts (ids + 1 mod E), weights kept."""
    logits, scores, ids = out
    module.calls = getattr(module, "calls", 0) + 1
    return logits, scores, (ids + 1) % logits.shape[-1]


@pytest.mark.parametrize("env", [MPS215, MPS214], ids=["mps-2.15.0", "mps-2.14.1"])
@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_a_users_router_hook_sees_the_call_and_its_routing_is_used(family, env):
    """A forward hook a user puts on the router runs at every decode step, as in stock, and the block routes by
    what the hooked router returns (here: other experts than the router picked)."""
    stock = _lm(family)
    m, _ = _patched(stock, env)
    for model in (stock, m):
        for name, mod in model.named_modules():
            if name.endswith("mlp") and hasattr(mod, "gate"):
                mod.gate.register_forward_hook(_shift_routing)
    ids = torch.randint(3, 128, (1, 5))
    with torch.no_grad():
        kw = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
        out_stock = stock.generate(ids, output_logits=True, return_dict_in_generate=True, **kw)
        out = m.generate(ids, output_logits=True, return_dict_in_generate=True, **kw)
    assert torch.equal(out.sequences, out_stock.sequences)
    for a, b in zip(out.logits, out_stock.logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    gates = [mod.gate for name, mod in m.named_modules() if name.endswith("mlp") and hasattr(mod, "gate")]
    assert all(g.calls == 3 for g in gates)  # the prefill and two decode steps


# ----------------------------------------------------------------------------------------- odd intermediate widths


def _odd_pair(family, inter, dtype, **options):
    """A stock model (transformers' eager experts: its grouped_mm raises on these widths on the CPU) and a copy
    patched under Mac 2.15.0 decisions with transformers' default experts (the recipe's own path runs)."""
    stock = _lm(family, inter=inter, dtype=dtype)
    stock.set_experts_implementation("eager")
    m = copy.deepcopy(stock)
    m.set_experts_implementation("grouped_mm")
    report = mpsboost.patch(m, device=MPS215, options={"moe_block": options} if options else None)
    rows = [r for r in report.rows if r.recipe == "moe_block"]
    assert rows and all(r.status == "applied" for r in rows), report
    return stock, m, rows


def _blocks(m):
    return [mod for name, mod in m.named_modules() if name.endswith("mlp") and hasattr(mod, "experts")]


def _assert_blocks_equal(stock, m, dtype):
    """Every MoE block on fresh inputs of 1 token, 1 token a row of 2, 3 tokens (the recipe's path) and 6 (the
    block's own forward): float32 within 1e-5 of stock, bfloat16 relative error under 1e-2 (one rounding order)."""
    hidden = stock.config.hidden_size
    for ref_block, block in zip(_blocks(stock), _blocks(m)):
        for shape in ((1, 1), (2, 1), (1, 3), (1, 6)):
            x = torch.randn(*shape, hidden).to(dtype)
            with torch.no_grad():
                got, ref = block(x), ref_block(x)
            if dtype == torch.float32:
                torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
            else:
                assert relative_error(got.float(), ref.float()) < 1e-2, shape


@pytest.mark.parametrize(
    "family,inter,dtype",
    [
        *[(f, 6, torch.float32) for f in FAMILIES],  # 24-byte rows
        ("qwen3_moe_norm", 10, torch.float32),  # 40-byte rows
        ("qwen3_5_moe", 12, torch.bfloat16),  # 24-byte rows (48 in float32: fine there)
        ("mixtral", 4, torch.bfloat16),  # the up weights' rows (2 x 4 x 2 = 16 bytes) pass, the down weights' do not
    ],
)
def test_intermediate_widths_grouped_mm_cannot_take_run_gathered_under_mac_215(family, inter, dtype):
    """Mac 2.15.0 decisions, routed experts whose rows are not a multiple of 16 bytes (the grouped kernel's input
    check raises "strides should be multiple of 16 bytes" for them): the report says so and names the widths, the
    gathered path runs, and every block equals stock's."""
    stock, m, rows = _odd_pair(family, inter, dtype)
    es = torch.empty((), dtype=dtype).element_size()
    for r in rows:
        assert "gathered bmm" in r.backing and "16 bytes" in r.reason and f"[{inter}] x {es} bytes" in r.reason, r
    _assert_blocks_equal(stock, m, dtype)


def test_forcing_grouped_mm_on_widths_it_cannot_take_says_why_and_runs():
    stock, m, rows = _odd_pair("qwen3_moe", 6, torch.float32, path="grouped_mm")
    assert all("option path='grouped_mm' not taken" in r.reason and "[6]" in r.reason for r in rows), rows
    assert all("gathered bmm" in r.backing for r in rows), rows
    _assert_blocks_equal(stock, m, torch.float32)


def test_a_dtype_change_after_patch_that_misaligns_the_down_weights_steps_to_gather():
    """Patched in float32 (intermediate 4: 16-byte rows, grouped_mm decided), then cast to bfloat16: the down
    weights' rows are 8 bytes, the up weights' 16. The check of the rebuilt weights reads the down weights too."""
    stock, m, rows = _odd_pair("mixtral", 4, torch.float32)
    assert all("grouped_mm" in r.backing and "(<= 4 tokens)" in r.backing for r in rows), rows
    _assert_blocks_equal(stock.to(torch.bfloat16), m.to(torch.bfloat16), torch.bfloat16)


def test_native_grouped_mm_ok_reads_the_down_weights():
    x = torch.randn(4, 32)
    up = torch.randn(3, 8, 32).transpose(-2, -1)  # [E, H, 2I] rows of 32 floats
    down_ok = torch.randn(3, 32, 4).transpose(-2, -1)  # [E, I, H], row stride 4 x 4 = 16 bytes
    down_odd = torch.randn(3, 32, 6).transpose(-2, -1)  # row stride 6 x 4 = 24 bytes
    assert moe_ops.native_grouped_mm_ok(x, up, down_ok)
    assert not moe_ops.native_grouped_mm_ok(x, up, down_odd)
    assert not moe_ops.native_grouped_mm_ok(x, up, down_ok.bfloat16())  # dtype mismatch
    # The rule's premise: the kernel refuses the down projection's operands of that width.
    if hasattr(torch.nn.functional, "grouped_mm"):
        with pytest.raises(RuntimeError, match="16 bytes"):
            torch.nn.functional.grouped_mm(torch.randn(4, 6), down_odd, offs=torch.tensor([1, 2, 4], dtype=torch.int32))


def test_grouped_mm_widths_ok_holds_mps_to_the_kernels_stride_rule():
    ok = moe_ops.grouped_mm_widths_ok
    assert ok({64, 32, 16}, torch.float32, "mps") == (True, "")
    good, why = ok({64, 12, 6}, torch.float32, "mps")
    assert not good and "MPS" in why and "[6]" in why and "16 bytes" in why
    good, why = ok({64, 24, 12}, torch.bfloat16, "mps")
    assert not good and "[12]" in why
    assert ok({64, 24, 12}, torch.float32, "mps") == (True, "")
