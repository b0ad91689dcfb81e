"""attention_decode's fused q/k step (``mpsboost::attn_qk_rope_cache``: q/k RMS norm, rotary and their dense copy
in one call) under Mac decisions (simulated on the CPU, where the operator runs its composed reference behind one
call): equal to stock on every family (partial rotary, grouped heads, a projection bias), at most 16 aten ops per
attention layer and decode step, ``.data`` edits of the q/k norms followed from the next prompt, compile-transparent,
reversible; the patch-time choice (simulated: the static choice, nothing timed; a stubbed real Mac: timed, refused
on a failed check)."""

from __future__ import annotations

import copy

import pytest
from mpsboost.bench.models import TINY_LM
from mpsboost.bench import ModuleOps, relative_error
import tiny_models as tm
import torch
import torch.nn.functional as F
from recipes.attention.test_attention_decode import FAMILIES, FP32_TOL, _attentions, _steps
from recipes.attention.test_attention_decode import _model as _family_model

import mpsboost
from mpsboost import ondevice
from mpsboost.gate import Env, parse_torch_version
from mpsboost.ops import attn_step
from mpsboost.recipes import attention_decode as ad

pytest.importorskip("transformers")

MAX_OPS = 16  # aten ops of one full-attention layer's decode step with the fused operator (batch 1 and 2)
OP = "mpsboost.attn_qk_rope_cache"
MACS = ("2.15.0", "2.14.1")


def _model(family: str, seed: int = 0) -> torch.nn.Module:
    """The tiny models of test_attention_decode.py with random q/k norm weights (transformers initialises the
    zero-centred ones to 0 and the others to 1: a weight read as ``w`` or as ``1 + w``, or rounded in another
    order, would show no difference), and a Llama whose q/k/v projections carry a (random) bias."""
    if family == "llama_bias":
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(seed)
        model = LlamaForCausalLM(LlamaConfig(**TINY_LM, intermediate_size=64, attention_bias=True))
        model.config._attn_implementation = "sdpa"
        model.eval()
    else:
        model = _family_model(family, seed=seed)
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for layer in _attentions(model):
            for name in ad._PROJ if family == "llama_bias" else ():
                getattr(layer, name).bias.copy_(0.5 * torch.randn(getattr(layer, name).bias.shape, generator=g))
            for norm in (getattr(layer, "q_norm", None), getattr(layer, "k_norm", None)):
                if norm is not None:
                    centre = 0.0 if family.startswith("qwen3_5") or family == "qwen3_next" else 1.0
                    norm.weight.copy_(centre + 0.3 * torch.randn(norm.weight.shape, generator=g))
    return model


def _patch(model, mac: str = "2.15.0", recipes=None, **opts) -> list:
    report = mpsboost.patch(model, recipes=recipes, device=Env.simulate("mps", mac), options={ad.NAME: opts})
    rows = [r for r in report.rows if r.recipe == ad.NAME]
    assert rows and all(r.status == "applied" for r in rows) and len(rows) == len(_attentions(model)), str(report)
    return rows


def _step_ops(model, batch: int) -> list[str]:
    """The ops of every attention layer in one decode step after a prefill of 8 tokens."""
    return tm.decode_step_ops(model, _attentions(model), batch)


def _calls(counter: ModuleOps) -> int:
    """How many times the fused operator ran while ``counter`` (over the whole model) was active."""
    return counter.names.count(OP)


# ------------------------------------------------------------------------------------------ exactness

CASES = [(f, "2.15.0") for f in (*FAMILIES, "llama_bias")] + [(f, "2.14.1") for f in ("qwen3_5", "qwen3_moe", "llama")]


@pytest.mark.parametrize("family,mac", CASES)
def test_fused_step_equals_stock_fp32(family, mac, rng_seed):
    stock = _model(family)
    patched = copy.deepcopy(stock)
    rows = _patch(patched, mac)
    assert all(OP.replace(".", "::") in r.backing for r in rows), [r.backing for r in rows]
    assert all(m.__dict__[ad._STATE].fused for m in _attentions(patched))
    steps = 4
    for batch in (1, 2):
        ref = tm._run_lm(stock, rng_seed + batch, batch=batch, prompt=6, steps=steps)
        with ModuleOps() as calls:
            got = tm._run_lm(patched, rng_seed + batch, batch=batch, prompt=6, steps=steps)
        assert _calls(calls) == steps * len(_attentions(patched)), _calls(calls)  # every decode step, no prefill
        err = relative_error(got, ref)
        assert err <= FP32_TOL, f"{family} mac {mac} batch {batch}: logits {err:.2e} from stock"


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3"])
def test_bf16_error_no_worse_than_stock(family):
    """As test_attention_decode.py states it: the bf16 decode steps' layer outputs, against the float32 model, no
    worse than 1.5x stock's error. And against stock bf16 within 1e-3: the operator rounds where stock's norm and
    rotary round (0 measured here; the composed path's own rounding order: 1e-3 to 9e-3; a gated norm rounded as
    qk_norm rounds: 5e-3)."""
    ref_model = _model(family, seed=13)
    stock = copy.deepcopy(ref_model).to(torch.bfloat16)
    patched = copy.deepcopy(stock)
    _patch(patched, recipes=[ad.NAME])  # this recipe alone: the others' rounding of the layers' inputs aside
    assert all(m.__dict__[ad._STATE].derived["fused"] for m in _attentions(patched))
    ids = torch.randint(3, 128, (1, 16), generator=torch.Generator().manual_seed(14))
    ref, s, p = [], [], []
    _steps(ref_model, ids, 10, outputs=ref)
    _steps(stock, ids, 10, outputs=s)
    with ModuleOps() as calls:
        _steps(patched, ids, 10, outputs=p)
    assert _calls(calls) == 6 * len(_attentions(patched))
    flat = [torch.cat([t[:, -1:].flatten().float() for t in ts[len(_attentions(stock)) :]]) for ts in (ref, s, p)]
    e_stock, e_patched = relative_error(flat[1], flat[0]), relative_error(flat[2], flat[0])
    assert 0 < e_stock < 0.1
    assert e_patched <= 1.5 * e_stock, (e_patched, e_stock)
    for step, (a, b) in enumerate(zip(s, p)):
        assert relative_error(b.float(), a.float()) <= 1e-3, step


# ------------------------------------------------------------------------------------------ op counts


@pytest.mark.parametrize("family", FAMILIES)
def test_at_most_16_ops_per_layer_and_fewer_than_composed(family):
    """Per attention layer and decode step (fp32, DynamicCache), fused / composed (fused="off"), counted here:
    gated (Qwen3.5/3.6, Qwen3-Next) 15/31 for one sequence, 16/32 for two; qk_norm (Qwen3, Qwen3-MoE) 12/25, 13/27;
    plain (Llama) 12/18, 13/20."""
    base = _model(family)
    fused, composed = copy.deepcopy(base), copy.deepcopy(base)
    _patch(fused)
    rows = _patch(composed, fused="off")
    assert all("attn_qk_rope_cache" not in r.backing and "option fused='off'" in r.reason for r in rows)
    n = len(_attentions(base))
    for batch in (1, 2):
        names, names_c = _step_ops(fused, batch), _step_ops(composed, batch)
        assert names.count(OP) == n and OP not in names_c, (names, names_c)
        assert len(names) <= MAX_OPS * n, (batch, len(names) // n, names)
        assert len(names) < len(names_c), (batch, len(names) // n, len(names_c) // n)


def test_the_composed_path_under_mps_still_hands_sdpa_a_dense_query(rng_seed, monkeypatch):
    """fused="off" on a Mac: the composed step's strided query is copied before SDPA (sdpa_strided_correct), and
    it equals stock."""
    stock = _model("qwen3_5_moe")
    patched = copy.deepcopy(stock)
    _patch(patched, recipes=[ad.NAME], fused="off")
    ref = tm._run_lm(stock, rng_seed, batch=1, prompt=5, steps=2)
    sdpa, seen = F.scaled_dot_product_attention, []

    def spy(*args, **kwargs):
        if args[0].shape[-2] == 1:  # the decode steps' calls (one query row per head)
            seen.append(all(t.is_contiguous() for t in args[:3]))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    got = tm._run_lm(patched, rng_seed, batch=1, prompt=5, steps=2)
    assert len(seen) == 2 and all(seen), seen
    assert relative_error(got, ref) <= FP32_TOL


# ------------------------------------------------------------------------------------------ the report, options


@pytest.mark.parametrize("mac", MACS)
def test_report_says_fused_and_why(mac):
    model = _model("qwen3_5")
    (row,) = [r for r in mpsboost.plan(model, env=Env.simulate("mps", mac)).rows if r.recipe == ad.NAME]
    assert row.status == "would apply" and "mpsboost::attn_qk_rope_cache" in row.backing, row
    assert "not timed: simulated environment" in row.reason and "1 dispatch instead of" in row.reason, row.reason
    assert row.details["fused"] is True


def test_off_the_mac_and_with_option_off_the_step_is_composed():
    model = _model("qwen3")
    everywhere = {ad.NAME: {"devices": ("mps", "cuda", "cpu")}}
    for env in (Env.detect("cpu"), Env.simulate("cuda:9.0")):
        rows = [r for r in mpsboost.plan(model, env=env, options=everywhere).rows if r.recipe == ad.NAME]
        assert rows and all(r.status == "would apply" for r in rows)
        assert all("attn_qk_rope_cache" not in r.backing and "kernel is Metal" in r.reason for r in rows), rows
        assert all(r.details["fused"] is False for r in rows)
    opts = {ad.NAME: {"fused": "off"}}
    rows = [
        r for r in mpsboost.plan(model, env=Env.simulate("mps", "2.15.0"), options=opts).rows if r.recipe == ad.NAME
    ]
    assert all("attn_qk_rope_cache" not in r.backing and "fused='off'" in r.reason for r in rows)


def test_a_layout_the_operator_cannot_take_steps_aside_with_the_reason():
    """Qwen3's norms multiply by their weight in its own dtype: bf16 activations with float32 norm weights (the
    operator would round the weight to bf16) keep the composed ops, with the reason in the report (stock itself
    then hands SDPA float32 q/k and bf16 v, which SDPA refuses: nothing to run here)."""
    model = _model("qwen3").to(torch.bfloat16)
    for layer in _attentions(model):
        layer.q_norm.float(), layer.k_norm.float()
    rows = [r for r in mpsboost.plan(model, env=Env.simulate("mps", "2.15.0")).rows if r.recipe == ad.NAME]
    assert rows and all(r.status == "would apply" for r in rows), rows
    assert all("attn_qk_rope_cache" not in r.backing and "q/k norm weights in" in r.reason for r in rows), rows


def test_bad_option_is_a_clear_error():
    with pytest.raises((ValueError, mpsboost.PatchError), match="'fused' must be one of"):
        mpsboost.plan(_model("llama"), env=Env.simulate("mps", "2.15.0"), options={ad.NAME: {"fused": "always"}})


# ------------------------------------------------------------------------------------------ .data edits


def _norm_delta(w: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (0.5 * torch.randn(w.shape, generator=g) * (w.detach().abs().mean() + 0.2)).to(w.dtype)


@pytest.mark.parametrize("family,fused", [("qwen3_5", "auto"), ("qwen3", "auto"), ("qwen3", "off")])
def test_a_data_edit_of_the_qk_norms_is_followed_from_the_next_prompt(family, fused, rng_seed):
    """``q_norm.weight.data += delta`` (no version bump, no new pointer: no host-side check can see it) between two
    prompts: the patched decode steps follow it as stock does, on the fused path as on the composed one."""
    stock = _model(family, seed=3)
    patched = copy.deepcopy(stock)
    _patch(patched, recipes=[ad.NAME], fused=fused)
    tm._run_lm(patched, rng_seed, batch=1, prompt=5, steps=2)  # the step's constants in use now
    before = tm._run_lm(stock, rng_seed + 1, batch=2, prompt=5, steps=3)
    for model in (stock, patched):
        for i, layer in enumerate(_attentions(model)):
            for j, norm in enumerate((layer.q_norm, layer.k_norm)):
                norm.weight.data += _norm_delta(norm.weight, 40 + 2 * i + j)
    ref = tm._run_lm(stock, rng_seed + 1, batch=2, prompt=5, steps=3)
    assert relative_error(ref, before) > 1e-3  # the edit changes what stock computes
    got = tm._run_lm(patched, rng_seed + 1, batch=2, prompt=5, steps=3)
    assert relative_error(got, ref) <= FP32_TOL


# ------------------------------------------------------------------------------------------ compile, unpatch


def test_fused_step_traces_with_fullgraph():
    """One decode step of Qwen3.5-MoE's gated layer (partial rotary) under torch.compile(fullgraph=True): one graph
    holding the fused operator, equal to the module's own forward."""
    from transformers import DynamicCache

    torch._dynamo.reset()
    model = _model("qwen3_5_moe", seed=17)
    _patch(model)
    layer = _attentions(model)[0]
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(18))
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(ids[:, :8], past_key_values=cache, use_cache=True)
        twin = copy.deepcopy(cache)
        x = torch.randn(1, 1, 64, generator=torch.Generator().manual_seed(19))
        pe = model.model.rotary_emb(x, torch.tensor([[8]]).expand(3, 1, 1))
        graphs = []

        def backend(gm, example_inputs):  # records the traced graph, runs it as traced
            graphs.append(gm)
            return gm.forward

        def step(h, c):
            return layer(h, position_embeddings=pe, attention_mask=None, cache=c)[0]

        got = torch.compile(step, fullgraph=True, backend=backend)(x, cache)
        ref = ad.call_original(layer, ad.NAME, x, position_embeddings=pe, attention_mask=None, cache=twin)[0]
    torch._dynamo.reset()
    assert len(graphs) == 1 and "attn_qk_rope_cache" in str(graphs[0].graph), graphs
    assert relative_error(got, ref) <= FP32_TOL
    k, tk = cache.layers[layer.layer_idx].keys, twin.layers[layer.layer_idx].keys
    assert k.shape == tk.shape and relative_error(k, tk) <= FP32_TOL


def test_a_copy_keeps_the_fused_path_and_unpatch_restores_the_forward(rng_seed):
    stock = _model("qwen3_5")
    patched = copy.deepcopy(stock)
    _patch(patched)
    twin = copy.deepcopy(patched)
    assert all(m.__dict__[ad._STATE].fused for m in _attentions(twin))
    with ModuleOps() as calls:
        got = tm._run_lm(twin, rng_seed, batch=1, prompt=5, steps=2)
    assert _calls(calls) == 2 * len(_attentions(twin))
    ref = tm._run_lm(stock, rng_seed, batch=1, prompt=5, steps=2)
    assert relative_error(got, ref) <= FP32_TOL
    layers = _attentions(patched)
    assert all("forward" in m.__dict__ for m in layers)
    mpsboost.unpatch(patched)
    assert all("forward" not in m.__dict__ and ad._STATE not in m.__dict__ for m in layers)
    with ModuleOps() as calls:
        after = tm._run_lm(patched, rng_seed, batch=1, prompt=5, steps=2)
    assert _calls(calls) == 0 and torch.equal(after, ref)


# ------------------------------------------------------------------------------------------ the choice on a real Mac


def _real_mac() -> Env:
    return Env(torch_version=parse_torch_version("2.15.0"), device_type="mps", simulated=False, macos=(26, 1))


@pytest.fixture
def stub_mac(monkeypatch, tmp_path):
    """The real-Mac path of the choice without a Mac: timing_pair's runs on CPU tensors (``state["off"]`` shifts
    the fused q), the kernel's self-check passing, the timing cache in tmp_path, the timer ``state["timer"]``."""
    from mpsboost.ops import attn_metal

    monkeypatch.setenv("MPSBOOST_CACHE_DIR", str(tmp_path))
    state = {"off": 0.0, "timer": None, "built": [], "timed": []}

    def timing_pair(**kw):
        state["built"].append(kw)
        q, k = torch.ones(1, kw["hq"], 1, kw["d"]), torch.ones(1, kw["hkv"], 1, kw["d"])

        def composed():
            return q, k

        def fused():
            return q + state["off"], k

        return composed, fused

    def timer(fn):
        state["timed"].append(fn.__name__)
        return {"stock_run": 10e-6, "fused_run": 6e-6}[fn.__name__]

    monkeypatch.setattr(attn_step, "timing_pair", timing_pair)
    monkeypatch.setattr(attn_metal, "self_check", lambda device="mps": None)
    monkeypatch.setattr(ondevice, "default_timer", timer)
    return state


def _rows(env, **opts):
    report = mpsboost.plan(_model("qwen3_5"), recipes=[ad.NAME], env=env, options={ad.NAME: opts})
    rows = [r for r in report.rows if r.recipe == ad.NAME]
    assert rows and all(r.status == "would apply" for r in rows), str(report)
    return rows


def test_real_mac_times_the_layer_shape_and_takes_the_faster(stub_mac):
    rows = _rows(_real_mac())
    assert all("mpsboost::attn_qk_rope_cache" in r.backing and "0.60x" in r.reason for r in rows), rows
    (kw,) = stub_mac["built"]
    assert (kw["batch"], kw["hq"], kw["hkv"], kw["d"], kw["q_stride"], kw["rotary"]) == (1, 2, 1, 32, 64, 8), kw
    assert kw["mode"] == 1 and kw["dtype"] == torch.float32
    assert stub_mac["timed"].count("fused_run") == ondevice.ROUNDS
    stub_mac["timed"].clear()
    rows = _rows(_real_mac(), fused="static")
    assert all("mpsboost::attn_qk_rope_cache" in r.backing and "static choice" in r.reason for r in rows)
    assert stub_mac["timed"] == []


def test_real_mac_keeps_the_composed_path_when_the_outputs_differ(stub_mac):
    stub_mac["off"] = 1e-3
    rows = _rows(_real_mac())
    assert all("attn_qk_rope_cache" not in r.backing and "self-check" in r.reason for r in rows), rows
    assert stub_mac["timed"] == []
