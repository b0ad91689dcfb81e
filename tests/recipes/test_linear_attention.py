"""linear_attention: Gated DeltaNet layers of transformers (Qwen3.5/3.6 MoE and dense, Qwen3-Next,
OLMo-Hybrid) against stock, on tiny real models with random weights (CPU; MPS and CUDA decisions simulated)."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
from mpsboost.bench import ModuleOps, relative_error
import tiny_models as tm
import torch

import mpsboost
from mpsboost.errors import PatchError
from mpsboost.gate import Env, check
from mpsboost.ops import gated_delta as gd
from mpsboost.recipes import linear_attention as la

pytest.importorskip("transformers")

FAMILIES = ("qwen3_5_moe", "qwen3_5", "qwen3_next", "olmo_hybrid")
RATIOS = (1, 2, 4)  # value heads per key head: 4 value heads over 4, 2 or 1 key heads
ENVS = {
    "mps-2.14.1": lambda: Env.simulate("mps", "2.14.1"),
    "mps-2.15.0": lambda: Env.simulate("mps", "2.15.0"),
    "cuda-sm90": lambda: Env.simulate("cuda:9.0"),
    "cpu": lambda: Env.detect("cpu"),
}
FP32_TOL = 1e-5  # relative, on each DeltaNet layer's output (the recipe's stated float32 bound)
BF16_FACTOR = 1.5  # patched bf16 error vs a float32 reference, at most this times stock's
OPS_PER_LAYER = 35  # aten ops of one DeltaNet layer's eager decode step, any batch size, fp32 or bf16
# Per-token log decay g: "slow" as trained checkpoints (and tiny_models' DeltaNet layers): -0.06 to 0, so a
# 64-token chunk keeps most of its state for the next (a scan that carries it wrongly is off by 1e-3 and
# more); "fast" as transformers' initialisation: each chunk's state decays to about 0 before the next reads it.
GATE_SCALE = {"slow": 0.06, "fast": 1.0}


def _model(
    family: str = "qwen3_5_moe", ratio: int = 2, layers: tuple[str, ...] | None = None, seed: int = 0
) -> torch.nn.Module:
    torch.manual_seed(seed)
    over = {"linear_num_key_heads": 4 // ratio, "linear_num_value_heads": 4}
    if layers is not None:
        over |= {"layer_types": list(layers), "num_hidden_layers": len(layers)}
    return tm.gated_deltanet_lm(family, **over).eval()


def _deltanets(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if la._family(m) is not None]


def _patch(model: torch.nn.Module, env: Env, **opts) -> mpsboost.PatchReport:
    report = mpsboost.patch(
        model, recipes=["linear_attention"], device=env, options={"linear_attention": opts} if opts else None
    )
    applied = [r for r in report.rows if r.recipe == "linear_attention" and r.status == "applied"]
    assert applied, str(report)
    return report


def _steps(
    model: torch.nn.Module, ids: torch.Tensor, prompt: int, *, outputs: list | None = None
) -> list[torch.Tensor]:
    """Logits of a prefill of ``prompt`` tokens, then one decode step per remaining token; every DeltaNet
    layer's output is appended to ``outputs``."""
    hooks = (
        [m.register_forward_hook(lambda _m, _a, o: outputs.append(o.detach().clone())) for m in _deltanets(model)]
        if outputs is not None
        else []
    )
    logits = []
    try:
        with torch.no_grad():
            out = model(ids[:, :prompt], use_cache=True)
            logits.append(out.logits)
            for i in range(prompt, ids.shape[1]):
                out = model(ids[:, i : i + 1], past_key_values=out.past_key_values, use_cache=True)
                logits.append(out.logits)
    finally:
        for h in hooks:
            h.remove()
    return logits


def _assert_layers_match(stock, patched, ids, prompt, what):
    ref, got = [], []
    _steps(stock, ids, prompt, outputs=ref)
    _steps(patched, ids, prompt, outputs=got)
    assert len(ref) == len(got) == 1 + ids.shape[1] - prompt
    for step, (r, g) in enumerate(zip(ref, got)):
        err = relative_error(g, r)
        assert err <= FP32_TOL, f"{what} step {step}: relative error {err:.2e}"


# Every family and head ratio with both Mac decision sets; the other environments on Qwen3.6's classes.
CASES = [(f, r, e) for e in ("mps-2.14.1", "mps-2.15.0") for f in FAMILIES for r in RATIOS] + [
    ("qwen3_5_moe", r, e) for e in ("cuda-sm90", "cpu") for r in RATIOS
]


@pytest.mark.parametrize("family,ratio,env_name", CASES)
def test_layer_outputs_match_stock_fp32(family, ratio, env_name):
    stock = _model(family, ratio)
    patched = copy.deepcopy(stock)
    _patch(patched, ENVS[env_name]())
    long = 70 if env_name.startswith("mps") else 9  # 70: two 64-token chunks, the second padded (the matmul solve)
    for batch, prompt, seed in ((1, long, 1), (2, 9, 2)):
        ids = torch.randint(3, 128, (batch, prompt + 3), generator=torch.Generator().manual_seed(seed))
        _assert_layers_match(stock, patched, ids, prompt, f"{family} r={ratio} {env_name} batch {batch}")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("ratio", RATIOS)
def test_decode_without_the_buffers_matches_stock(family, ratio):
    """The step a concurrent caller gets (the layer's buffers busy) and traced code runs: every result
    freshly allocated, every view taken of it (a result laid out otherwise is made contiguous first)."""
    stock = _model(family, ratio, seed=20)
    patched = copy.deepcopy(stock)
    _patch(patched, Env.simulate("mps", "2.15.0"))
    states = [m.__dict__[la._STATE] for m in _deltanets(patched)]
    for st in states:
        assert st.lock.acquire(blocking=False)
    try:
        for batch in (1, 2):
            ids = torch.randint(3, 128, (batch, 9), generator=torch.Generator().manual_seed(21 + batch))
            _assert_layers_match(stock, patched, ids, 6, f"{family} r={ratio} batch {batch}, no buffers")
        assert all(st.work is None for st in states)  # the busy buffers were never made nor touched
    finally:
        for st in states:
            st.lock.release()


@pytest.mark.parametrize("ratio", RATIOS)
def test_patched_decode_uses_the_cache_tensors_in_place(ratio):
    """The recurrent state stays float32 in the model's own cache, where stock keeps it: a stock layer can
    continue from a patched layer's cache and the other way round."""
    stock = _model(ratio=ratio)
    patched = copy.deepcopy(stock)
    _patch(patched, Env.simulate("mps", "2.15.0"))
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        cache = patched(ids[:, :8], use_cache=True).past_key_values
        state = cache.layers[0].recurrent_states[0]
        conv = cache.layers[0].conv_states[0]
        assert state.dtype == torch.float32
        ref_cache = stock(ids[:, :8], use_cache=True).past_key_values
        for i in range(8, 12):  # alternate: patched, stock, patched, stock on the same cache
            m = patched if i % 2 == 0 else stock
            out = m(ids[:, i : i + 1], past_key_values=cache, use_cache=True).logits
            ref = stock(ids[:, i : i + 1], past_key_values=ref_cache, use_cache=True).logits
            assert relative_error(out, ref) <= FP32_TOL
        assert cache.layers[0].recurrent_states[0] is state and cache.layers[0].conv_states[0] is conv
        # the step updates the conv state where no cache call sees it; the cache still counts its tokens (transformers
        # >= 5.25 reads them from layer 0, a linear one: positions would stall and the attention layers drift)
        assert cache.get_seq_length() == ref_cache.get_seq_length() == 12


def _record(cache) -> bool:
    """Turn on the cache's past recording (four recurrent states kept where transformers >= 5.25 keeps them, the
    version that can crop a linear layer back); whether crop() can take tokens back."""
    keeps = hasattr(cache, "get_recurrent_states_to_keep")
    cache.activate_past_recording(**({"recurrent_states_to_keep": 4} if keeps else {}))
    return keeps


def _count_recorded_steps(monkeypatch) -> list:
    """A list that gains an entry for each one-token step the recipe runs on a recording cache."""
    recorded = []
    real = la._recorded_decode
    monkeypatch.setattr(la, "_recorded_decode", lambda *a: recorded.append(1) or real(*a))
    return recorded


@pytest.mark.parametrize("fused_step", ["auto", "off"])
def test_a_cache_recording_the_past_decodes_on_the_recipe_and_crops_back(fused_step, monkeypatch):
    """Assisted decoding (and, on a Mac, transformers' deferred stop check when the cache is returned) records the
    past so that crop() can take rejected tokens back. A multi-token step then runs stock (it keeps its
    intermediate states); a one-token step runs the recipe's step on copies and hands the cache the new conv column
    and state. The logits, the sequence length and the state after a crop are stock's (float32 bound)."""
    stock = _model(seed=50)
    patched = copy.deepcopy(stock)
    _patch(patched, Env.simulate("mps", "2.15.0"), fused_step=fused_step)
    recorded = _count_recorded_steps(monkeypatch)
    ids = torch.randint(3, 128, (2, 14), generator=torch.Generator().manual_seed(51))
    runs = []
    for m in (stock, patched):
        with torch.no_grad():
            cache = m(ids[:, :8], use_cache=True).past_key_values
            crops = _record(cache)
            logits = [m(ids[:, 8:11], past_key_values=cache, use_cache=True).logits]  # three drafted tokens
            if crops:
                cache.crop(-1)  # the third rejected
            for i in range(10, 13):
                logits.append(m(ids[:, i : i + 1], past_key_values=cache, use_cache=True).logits)
            if crops:
                cache.crop(-1)  # one step taken back again
            logits.append(m(ids[:, 12:13], past_key_values=cache, use_cache=True).logits)
            runs.append((torch.cat(logits, dim=1), cache.get_seq_length(), cache.layers[0].recurrent_states[0]))
    assert relative_error(runs[1][0], runs[0][0]) <= FP32_TOL
    assert runs[1][1] == runs[0][1]
    assert relative_error(runs[1][2], runs[0][2]) <= FP32_TOL
    assert len(recorded) == 4 * len(_deltanets(patched))  # every one-token step on the recipe's step


class _HostEvent:
    """``torch.Event`` on the CPU, which has none: its work is done when the call returns, so record and
    synchronize have nothing to wait for."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, *args) -> None:
        pass

    def synchronize(self) -> None:
        pass


def test_generate_with_a_mac_deferred_stop_check_returns_stock_tokens_and_cache(monkeypatch):
    """transformers (5.25+) defers generate()'s stop check by a step on "mps", and when the cache is returned it
    records the past so that finish() can crop the step that ran past the end. The check forced on here (its
    device events made host no-ops): greedy tokens, logits and the returned cache's state equal stock's, the
    steps run the recipe's recorded step, and an end-of-sequence token stops one step late and is cropped."""
    gu = pytest.importorskip("transformers.generation.utils")
    if not hasattr(gu, "DeferredStopCheck"):
        pytest.skip("this transformers has no deferred stop check (5.25+)")
    monkeypatch.setattr(gu.DeferredStopCheck, "is_supported", staticmethod(lambda *a, **k: True))
    monkeypatch.setattr(torch, "Event", _HostEvent)
    stock = _model(seed=70)
    patched = copy.deepcopy(stock)
    _patch(patched, Env.simulate("mps", "2.15.0"))
    recorded = _count_recorded_steps(monkeypatch)
    ids = torch.randint(3, 128, (1, 7), generator=torch.Generator().manual_seed(71))
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, max_new_tokens=8)
    with torch.no_grad():
        eos = int(stock.generate(ids, **kw)[0, 7 + 4])  # the fifth new token: generation stops there
        outs = [
            m.generate(ids, eos_token_id=eos, return_dict_in_generate=True, output_logits=True, **kw)
            for m in (stock, patched)
        ]
    assert outs[0].sequences.shape[1] < 7 + 8 and int(outs[0].sequences[0, -1]) == eos  # stopped by the token
    assert torch.equal(outs[1].sequences, outs[0].sequences)
    assert relative_error(torch.stack(outs[1].logits), torch.stack(outs[0].logits)) <= FP32_TOL
    caches = [o.past_key_values for o in outs]
    assert caches[1].get_seq_length() == caches[0].get_seq_length()
    states = [c.layers[0].recurrent_states[0] for c in caches]
    assert relative_error(states[1], states[0]) <= FP32_TOL
    assert recorded  # the decode steps ran the recipe's step, not stock


def test_an_assistant_cache_records_from_a_prompt_shorter_than_the_conv():
    """An assistant model's cache records from its first token: a 2-token prompt leaves a conv state narrower than
    the kernel (transformers pads only when it does not record). The recipe's one-token steps pad it with the
    causal conv's zeros and give stock's logits."""
    from transformers import DynamicCache

    stock = _model(seed=52)
    patched = copy.deepcopy(stock)
    _patch(patched, Env.simulate("mps", "2.15.0"))
    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(53))
    runs = []
    for m in (stock, patched):
        cache = DynamicCache(config=m.config)
        _record(cache)
        with torch.no_grad():
            logits = [m(ids[:, :2], past_key_values=cache, use_cache=True).logits]
            for i in range(2, 6):
                logits.append(m(ids[:, i : i + 1], past_key_values=cache, use_cache=True).logits)
        runs.append(torch.cat(logits, dim=1))
    assert relative_error(runs[1], runs[0]) <= FP32_TOL


def _left_padded(batch_lengths: tuple[int, ...], width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (len(batch_lengths), width), generator=g)
    mask = torch.zeros(len(batch_lengths), width, dtype=torch.long)
    for i, n in enumerate(batch_lengths):
        mask[i, width - n :] = 1
    # The padded positions keep random tokens: the pad token's embedding row is zero in these models, which
    # would hide a layer that ignores the mask; only the mask says what is padding here.
    return ids, mask


def _generate(model, ids, mask, **kw):
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=6,
        min_new_tokens=6,
        do_sample=False,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
        **kw,
    )
    return out.sequences, torch.stack(out.logits)


@pytest.mark.parametrize("fused_step", ["auto", "off"])  # the fused operator, and the composed step's state view
def test_two_sequences_decoded_in_turn_keep_their_own_state(fused_step):
    """Two conversations of one batch size decoded in turn, each with its own cache (a server's two slots): each
    step reads its own recurrent state (the step's view of the cache's state is made once per state tensor, and
    must never be another cache's). Logits within the float32 bound of stock's."""
    stock = _model(seed=30)
    patched = copy.deepcopy(stock)
    _patch(patched, Env.simulate("mps", "2.15.0"), fused_step=fused_step)
    ids = [torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(s)) for s in (31, 32)]
    runs = []
    for m in (stock, patched):
        logits = []
        with torch.no_grad():
            outs = [m(x[:, :5], use_cache=True) for x in ids]
            for i in range(5, 9):
                for j, x in enumerate(ids):
                    outs[j] = m(x[:, i : i + 1], past_key_values=outs[j].past_key_values, use_cache=True)
                    logits.append(outs[j].logits)
        runs.append(torch.cat(logits, dim=1))
    assert relative_error(runs[1], runs[0]) <= FP32_TOL


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("ratio", RATIOS)
def test_generate_left_padded_batch_equals_stock(family, ratio):
    """generate() with a left-padded batch of two and its attention mask, with and without the cache, then
    a second call with another batch size: greedy tokens equal and logits within the float32 bound. Mac
    2.14.1 decisions, where the recipe runs the prefill too (the padding reaches its forward)."""
    stock = _model(family, ratio, seed=30)
    patched = copy.deepcopy(stock)
    _patch(patched, Env.simulate("mps", "2.14.1"))
    ids, mask = _left_padded((5, 11), 11, seed=31)
    with torch.no_grad():
        for kw in ({}, {"use_cache": False}):
            ref_tokens, ref_logits = _generate(stock, ids, mask, **kw)
            tokens, logits = _generate(patched, ids, mask, **kw)
            assert torch.equal(tokens, ref_tokens), kw
            assert relative_error(logits, ref_logits) <= FP32_TOL, kw
        ids1, mask1 = _left_padded((7,), 7, seed=32)  # a second call, one sequence: the buffers change size
        ref_tokens, ref_logits = _generate(stock, ids1, mask1)
        tokens, logits = _generate(patched, ids1, mask1)
    assert torch.equal(tokens, ref_tokens)
    assert relative_error(logits, ref_logits) <= FP32_TOL


def test_greedy_tokens_equal_over_32_new_tokens():
    stock = _model(seed=4)
    patched = copy.deepcopy(stock)
    _patch(patched, Env.simulate("mps", "2.15.0"))
    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(5))
    kw = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        a = stock.generate(ids, **kw)
        b = patched.generate(ids, **kw)
    assert a.shape[1] == 38
    assert torch.equal(a, b)


def _decode_ops(model, batch: int) -> int:
    """Ops of the DeltaNet layers in the first decode step after a prefill (what the decode_ops tool counts)."""
    return len(tm.decode_step_ops(model, _deltanets(model), batch))


OPS_CASES = [(f, r, "float32", e) for f in FAMILIES for r in RATIOS for e in ("mps-2.15.0", "mps-2.14.1")] + [
    ("qwen3_5_moe", r, "bfloat16", "mps-2.15.0") for r in RATIOS
]


@pytest.mark.parametrize("family,ratio,dtype,env_name", OPS_CASES)
def test_decode_step_ops_per_layer(family, ratio, dtype, env_name):
    """At most OPS_PER_LAYER aten ops per DeltaNet layer and decode step (stock: 103), one sequence or two."""
    layers = ("linear_attention", "linear_attention", "full_attention")
    stock = _model(family, ratio, layers=layers).to(getattr(torch, dtype))
    patched = copy.deepcopy(stock)
    _patch(patched, ENVS[env_name]())
    for batch in (1, 2):
        n_stock, n_patched = _decode_ops(stock, batch), _decode_ops(patched, batch)
        assert n_stock >= 2 * 90, n_stock  # about 103 per layer in transformers 5.24
        assert n_patched <= 2 * OPS_PER_LAYER, (batch, n_patched, n_stock)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("ratio", RATIOS)
def test_decode_step_compiles_fullgraph(family, ratio):
    stock = _model(family, ratio, seed=7)
    patched = copy.deepcopy(stock)
    _patch(patched, Env.simulate("mps", "2.15.0"))
    _decode_step_compiles(stock, patched)


def test_decode_step_compiles_fullgraph_cpu_recipe_option():
    stock = _model(seed=7)
    patched = copy.deepcopy(stock)
    _patch(patched, Env.detect("cpu"), compiled="recipe")
    _decode_step_compiles(stock, patched)


def _decode_step_compiles(stock, patched, backend="aot_eager"):
    """One DeltaNet layer's decode step under torch.compile(fullgraph=True): output and cache updates equal
    the stock layer's on a copy of the same cache."""
    torch._dynamo.reset()
    layer, ref_layer = _deltanets(patched)[0], _deltanets(stock)[0]
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        cache = patched(ids[:, :8], use_cache=True).past_key_values
        twin = copy.deepcopy(cache)
        x = torch.randn(1, 1, 64, generator=torch.Generator().manual_seed(9))
        compiled = torch.compile(lambda h, c: layer(h, cache=c), fullgraph=True, backend=backend)
        got = compiled(x, cache)
        ref = ref_layer(x, cache=twin)
    torch._dynamo.reset()
    assert relative_error(got, ref) <= FP32_TOL
    assert relative_error(cache.layers[0].recurrent_states[0], twin.layers[0].recurrent_states[0]) <= FP32_TOL
    assert torch.equal(cache.layers[0].conv_states[0], twin.layers[0].conv_states[0])


def _tied_groups(model: torch.nn.Module) -> list[list[str]]:
    """The state_dict names that share one storage by transformers' own helper (what its tied-weight checks,
    save_pretrained's dedup and accelerate's offload read), less the ties the model declares."""
    import re

    from transformers.pytorch_utils import id_tensor_storage

    groups: dict = {}
    for name, t in model.state_dict().items():
        groups.setdefault(id_tensor_storage(t), []).append(name)
    declared = list(model._tied_weights_keys or {})
    return [
        [n for n in names if not any(re.search(k, n) for k in declared)] for names in groups.values() if len(names) > 1
    ]


@pytest.mark.parametrize("family", FAMILIES)
def test_no_tie_appears_and_save_pretrained_round_trips(family, tmp_path):
    """The projections keep their own storages: transformers' id_tensor_storage finds the same (no) ties as
    in the stock model, before and after decoding; save_pretrained / from_pretrained round-trips."""
    model = _model(family, seed=40)
    stock_groups = _tied_groups(model)
    _patch(model, Env.simulate("mps", "2.15.0"))
    assert _tied_groups(model) == stock_groups == []
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(41))
    logits = _steps(model, ids, 6)
    assert _tied_groups(model) == []
    model.save_pretrained(tmp_path)
    reloaded = type(model).from_pretrained(tmp_path).eval()
    sd, rd = model.state_dict(), reloaded.state_dict()
    assert list(sd) == list(rd) and all(torch.equal(sd[k], rd[k]) for k in sd)
    for a, b in zip(logits, _steps(reloaded, ids, 6)):
        assert relative_error(a, b) <= FP32_TOL


def test_unpatch_restores_the_same_objects():
    model = _model()
    before = tm.snapshot(model)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    layer = _deltanets(model)[0]
    projs = [layer.in_proj_qkv.weight, layer.in_proj_z.weight, layer.in_proj_b.weight, layer.in_proj_a.weight]
    storages = [p.untyped_storage().data_ptr() for p in projs]
    _patch(model, Env.simulate("mps", "2.14.1"))
    _steps(model, torch.randint(3, 128, (1, 6)), 5)
    # The same Parameter objects, untouched: same storages, same state_dict keys and values.
    assert [layer.in_proj_qkv.weight, layer.in_proj_z.weight, layer.in_proj_b.weight, layer.in_proj_a.weight] == projs
    assert [p.untyped_storage().data_ptr() for p in projs] == storages
    after = model.state_dict()
    assert list(after) == list(sd) and all(torch.equal(after[k], v) for k, v in sd.items())
    mpsboost.unpatch(model)
    assert tm.same_snapshot(before, tm.snapshot(model)), tm.diff_snapshot(before, tm.snapshot(model))
    assert "forward" not in layer.__dict__ and la._STATE not in layer.__dict__


def test_failure_halfway_rolls_back(monkeypatch):
    model = _model(layers=("linear_attention", "linear_attention", "full_attention"))
    before = tm.snapshot(model)
    calls = []
    real = la.set_instance_attr

    def failing(*a, **k):  # the second layer fails after the first was patched
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected")
        return real(*a, **k)

    monkeypatch.setattr(la, "set_instance_attr", failing)
    with pytest.raises(PatchError, match="linear_attention"):
        mpsboost.patch(model, recipes=["linear_attention"], device=Env.simulate("mps", "2.15.0"))
    assert len(calls) == 2
    assert tm.same_snapshot(before, tm.snapshot(model)), tm.diff_snapshot(before, tm.snapshot(model))
    for layer in _deltanets(model):
        assert "forward" not in layer.__dict__ and la._STATE not in layer.__dict__


def test_dropped_patched_model_is_freed():
    """Nothing outside the model holds it or any part of it: weak references to the model, to every patched
    layer and to what the recipe keeps on them (constants, decode buffers) all die with it."""
    model = _model(layers=("linear_attention", "linear_attention", "full_attention"))
    _patch(model, Env.simulate("mps", "2.15.0"))
    _steps(model, torch.randint(3, 128, (2, 6)), 4)  # decode steps made the buffers
    layers = _deltanets(model)
    states = [m.__dict__[la._STATE] for m in layers]
    assert all(st.work is not None and st.derived is not None for st in states)
    refs = [weakref.ref(x) for x in (model, *layers, *states, *(st.work for st in states))]
    del model, layers, states
    gc.collect()
    assert [r() is None for r in refs] == [True] * len(refs)


@pytest.mark.parametrize("ratio", RATIOS)
def test_bf16_error_no_worse_than_stock(ratio):
    """bfloat16: the DeltaNet layer's outputs over a prefill and 8 decode steps, against the float32 model
    on the same tokens, taken together (one step alone is noisy: both see the same bf16-rounded input).
    Measured: patched 0.5-1.1x stock's error (the recipe keeps q/k/v, gates and norm in float32)."""
    ref_model = _model(ratio=ratio, seed=10)
    stock = copy.deepcopy(ref_model).to(torch.bfloat16)
    patched = copy.deepcopy(stock)
    _patch(patched, Env.simulate("mps", "2.15.0"))
    ids = torch.randint(3, 128, (1, 24), generator=torch.Generator().manual_seed(11))
    ref, s, p = [], [], []
    _steps(ref_model, ids, 16, outputs=ref)
    _steps(stock, ids, 16, outputs=s)
    _steps(patched, ids, 16, outputs=p)
    flat = [torch.cat([t.flatten().float() for t in ts]) for ts in (ref, s, p)]
    e_stock, e_patched = relative_error(flat[1], flat[0]), relative_error(flat[2], flat[0])
    assert 0 < e_stock < 0.1
    assert e_patched <= BF16_FACTOR * e_stock, (e_patched, e_stock)


def test_moved_after_patch_derives_again_and_unpatches():
    stock = _model("qwen3_5", seed=12)  # dense: transformers' MoE experts take no float64
    patched = copy.deepcopy(stock)
    _patch(patched, Env.simulate("mps", "2.15.0"))
    stock, patched = stock.double(), patched.double()  # replaces every Parameter's storage
    ids = torch.randint(3, 128, (1, 7), generator=torch.Generator().manual_seed(13))
    ref, got = [], []
    _steps(stock, ids, 5, outputs=ref)
    _steps(patched, ids, 5, outputs=got)
    assert len(got) == 3 and all(relative_error(g, r) <= FP32_TOL for g, r in zip(got, ref))  # float32 inside the step
    layer = _deltanets(patched)[0]
    assert layer.in_proj_z.weight.dtype == torch.float64
    assert layer.__dict__[la._STATE].derived["proj"][0].dtype == torch.float64  # derived from the moved weights
    mpsboost.unpatch(patched)
    assert "forward" not in layer.__dict__ and la._STATE not in layer.__dict__


def test_autograd_reaches_the_parameters():
    model = _model(seed=14)
    _patch(model, Env.simulate("mps", "2.15.0"))
    ids = torch.randint(3, 128, (1, 5))
    model(ids).logits.sum().backward()
    layer = _deltanets(model)[0]
    assert layer.in_proj_qkv.weight.grad is not None and layer.in_proj_qkv.weight.grad.abs().sum() > 0


def test_decisions_per_device():
    """Prefill: the recipe's chunked rule with solve_triangular where the gate says it is fast on the build (the
    report names the gate's reason), the matmul inverse elsewhere; read from the gate, so the test follows its
    evidence."""
    model = _model()
    for name, make in ENVS.items():
        env = make()
        report = mpsboost.plan(model, recipes=["linear_attention"], env=env)
        (row,) = [r for r in report.rows if r.recipe == "linear_attention"]
        verdict = check("solve_triangular_fast", env)
        assert ("prefill chunked, solve_triangular" in row.backing) is verdict.ok, (name, row.backing)
        assert ("matmul triangular inverse" in row.backing) is (not verdict.ok), (name, row.backing)
        assert verdict.reason in row.reason, (name, row.reason)
        assert row.details["prefill"] == ("triangular" if verdict.ok else "matmul")


@pytest.mark.parametrize("ok", [True, False])
def test_prefill_decision_follows_the_verdict_and_names_it(monkeypatch, ok):
    """Whatever the gate concludes for a build, the plan carries it: solve_triangular in the chunked prefill
    with the verdict's reason (the kernel it found) where it is fast, the matmul inverse where not."""
    from mpsboost.gate import Verdict

    reason = "triangular_solve_small_{16,32,64} kernels in the 2.15.0 macOS wheel (test verdict)"
    real = la.check
    monkeypatch.setattr(
        la, "check", lambda f, env: Verdict(ok, reason) if f == "solve_triangular_fast" else real(f, env)
    )
    report = mpsboost.plan(_model(), recipes=["linear_attention"], env=Env.simulate("mps", "2.15.0"))
    (row,) = [r for r in report.rows if r.recipe == "linear_attention"]
    assert ("solve_triangular" in row.backing) is ok and ("matmul triangular inverse" in row.backing) is not ok
    assert row.details["prefill"] == ("triangular" if ok else "matmul") and reason in row.reason


def test_steps_aside_for_cuda_kernels_and_odd_layers(monkeypatch):
    model = _model()
    monkeypatch.setattr(la, "_fast_path_packages", lambda: ["fla"])
    report = mpsboost.plan(model, recipes=["linear_attention"], env=Env.simulate("cuda:9.0"))
    (row,) = [r for r in report.rows if r.recipe == "linear_attention"]
    assert row.status != "would apply" and "fla" in row.reason
    report = mpsboost.plan(model, recipes=["linear_attention"], env=Env.simulate("mps", "2.15.0"))
    assert [r.status for r in report.rows if r.recipe == "linear_attention"] == ["would apply"]
    layer = _deltanets(model)[0]
    layer.out_proj.bias = torch.nn.Parameter(torch.zeros(64))
    report = mpsboost.plan(model, recipes=["linear_attention"], env=Env.simulate("mps", "2.15.0"))
    (row,) = [r for r in report.rows if r.recipe == "linear_attention"]
    assert row.status != "would apply" and "out_proj: has a bias" in row.reason
    with pytest.raises(PatchError, match="prefill"):
        mpsboost.plan(
            model,
            recipes=["linear_attention"],
            env=Env.simulate("mps", "2.15.0"),
            options={"linear_attention": {"prefill": "fast"}},
        )
    with pytest.raises(TypeError, match="linear_attention"):
        mpsboost.plan(model, recipes=["linear_attention"], options={"linear_attention": {"prefill": 1}})


@pytest.mark.parametrize("n", [1, 5, 64])
def test_unit_lower_solve_matches_solve_triangular(n):
    g = torch.Generator().manual_seed(n)
    a = torch.randn(3, n, n, generator=g, dtype=torch.float64) * 0.3
    rhs = torch.randn(3, n, 7, generator=g, dtype=torch.float64)
    ref = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)
    assert relative_error(gd.unit_lower_solve(a, rhs), ref) <= 1e-12


def test_chunked_rule_matches_transformers_reference():
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
        torch_chunk_gated_delta_rule as ref_rule,
    )

    g = torch.Generator().manual_seed(15)
    b, s, hk, hv, d = 2, 100, 2, 4, 32
    q, k = torch.randn(b, s, hk, d, generator=g), torch.randn(b, s, hk, d, generator=g)
    v = torch.randn(b, s, hv, d, generator=g)
    gate = -torch.rand(b, s, hv, generator=g) * GATE_SCALE["slow"]
    beta = torch.rand(b, s, hv, generator=g)
    init = torch.randn(b, hv, d, d, generator=g) * 0.1
    ref, ref_state = ref_rule(
        q, k, v, g=gate, beta=beta, initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    for solve in ("matmul", "triangular"):
        out, state = gd.chunk_gated_delta_rule(
            q, k, v, gate, beta, initial_state=init, output_final_state=True, solve=solve
        )
        assert relative_error(out, ref) <= FP32_TOL and relative_error(state, ref_state) <= FP32_TOL


@pytest.mark.parametrize(
    ("b", "s", "hk", "hv", "init", "decay"),
    [
        (1, 64, 4, 4, False, "slow"),
        (2, 200, 2, 4, True, "slow"),
        (1, 321, 1, 4, True, "slow"),
        (2, 7, 2, 2, False, "slow"),
        (2, 130, 2, 4, False, "slow"),
        (2, 200, 2, 4, True, "fast"),
    ],
    ids=["one-chunk-no-state", "batch2-padded-gqa", "five-chunks-4-to-1", "short", "three-chunks", "fast-decay"],
)
def test_chunked_rule_equals_transformers_over_many_chunks(b, s, hk, hv, init, decay):
    """The scan over chunks (five batched ops a chunk) against transformers' loop: float32 outputs and final
    state within the recipe's bound, for one to six chunks, batches, head ratios, with and without a state,
    slow-decay gates (the state carried across chunks) and fast; the caller's initial state is left as it was."""
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import torch_chunk_gated_delta_rule as ref_rule

    g = torch.Generator().manual_seed(s)
    d = 16
    q, k = torch.randn(b, s, hk, d, generator=g), torch.randn(b, s, hk, d, generator=g)
    v = torch.randn(b, s, hv, d, generator=g)
    gate = -torch.rand(b, s, hv, generator=g) * GATE_SCALE[decay]
    beta = torch.rand(b, s, hv, generator=g)
    state0 = torch.randn(b, hv, d, d, generator=g) * 0.1 if init else None
    kept = state0.clone() if init else None
    ref, ref_state = ref_rule(
        q, k, v, g=gate, beta=beta, initial_state=state0, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    out, state = gd.chunk_gated_delta_rule(
        q, k, v, gate, beta, initial_state=state0, output_final_state=True, solve="triangular"
    )
    assert out.shape == ref.shape and state.shape == ref_state.shape
    assert relative_error(out, ref) <= FP32_TOL and relative_error(state, ref_state) <= FP32_TOL
    if init:
        assert torch.equal(state0, kept)


def test_scan_is_five_ops_per_chunk():
    """Structural: the scan dispatches five aten ops per 64-token chunk, whatever the number of chunks
    (transformers' loop: 37). Counted as the difference between 17 and 9 chunks of the whole rule."""
    g = torch.Generator().manual_seed(0)

    def ops(s):
        q, k, v = (torch.randn(1, s, 2, 16, generator=g) for _ in range(3))
        gate, beta = -torch.rand(1, s, 2, generator=g), torch.rand(1, s, 2, generator=g)
        with ModuleOps() as c:
            gd.chunk_gated_delta_rule(
                q, k, v, gate, beta, initial_state=None, output_final_state=True, solve="triangular"
            )
        return c.count

    assert ops(17 * 64) - ops(9 * 64) == 8 * 5


def test_prefill_in_fewer_ops_than_stock_and_equal():
    """Mac 2.15.0 decisions: a 512-token prompt's DeltaNet prefill in at most 60% of stock's aten ops, the
    logits within the float32 bound."""
    stock = _model(seed=21)
    patched = copy.deepcopy(stock)
    _patch(patched, Env.simulate("mps", "2.15.0"))
    ids = torch.randint(3, 128, (1, 512), generator=torch.Generator().manual_seed(2))
    counts = []
    for m in (stock, patched):
        counter = ModuleOps(_deltanets(m)[:1])
        try:
            with torch.no_grad(), counter:
                logits = m(ids, use_cache=True).logits
        finally:
            for h in counter.hooks:
                h.remove()
        counts.append((counter.count, logits))
    (n_stock, ref), (n_patched, got) = counts
    assert n_patched <= 0.6 * n_stock, (n_patched, n_stock)
    assert relative_error(got, ref) <= FP32_TOL


@pytest.mark.slow
def test_mac_compile_static_cache_generates_the_eager_tokens():
    """The opt-in compiled mode: transformers compiles the patched model's decode step (static cache) where
    it would not by itself (MPS; CPU here), in one graph, and the greedy tokens equal eager decoding."""
    torch._dynamo.reset()
    model = _model(seed=4)
    _patch(model, Env.simulate("mps", "2.15.0"))
    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(5))
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    eager = model.generate(ids, **kw)
    before = model.generation_config.compile_config
    undo = la.mac_compile(model, backend="eager", fullgraph=True)
    assert model.generation_config.compile_config._compile_all_devices is True
    torch._dynamo.utils.counters.clear()
    compiled = model.generate(ids, cache_implementation="static", **kw)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # it did compile
    assert torch.equal(eager, compiled)
    undo()
    assert model.generation_config.compile_config is before
    with pytest.raises(TypeError, match="generation_config"):
        la.mac_compile(torch.nn.Linear(2, 2))
    torch._dynamo.reset()


def test_weights_changed_after_patch_are_followed_or_left_to_stock():
    """A weight another recipe stores in its own format after patching (here: the Parameter leaves, a buffer
    takes its name, as fp8_weights does at commit) is used through the layer's own forward; a projection
    that stops being a bias-free linear sends the layer back to stock, its constants and buffers freed."""
    stock = _model(seed=16)
    patched = copy.deepcopy(stock)
    _patch(patched, Env.simulate("mps", "2.15.0"))
    layer = _deltanets(patched)[0]
    state = layer.__dict__[la._STATE]
    assert state.derived is not None
    w = layer.out_proj.weight.detach().clone()
    del layer.out_proj.weight
    layer.out_proj.register_buffer("weight", w)
    ids = torch.randint(3, 128, (1, 7), generator=torch.Generator().manual_seed(17))
    _assert_layers_match(stock, patched, ids, 5, "out_proj weight now a buffer")
    assert state.derived is not None and state.derived["out_w"] is None and state.work is not None
    for m in (stock, patched):  # a zero bias: stock's outputs unchanged, no bias-free linear any more
        _deltanets(m)[0].in_proj_z.bias = torch.nn.Parameter(torch.zeros(_deltanets(m)[0].in_proj_z.out_features))
    _assert_layers_match(stock, patched, ids, 5, "in_proj_z with a bias")
    assert state.derived is None and state.work is None


@pytest.mark.parametrize("env_name", ["mps-2.15.0", "mps-2.14.1"])
@pytest.mark.parametrize("ratio", RATIOS)
def test_composes_with_fp8_layers(env_name, ratio):
    """With ``patch(fp8="rowwise")`` the DeltaNet layers stay patched: each fp8 projection runs its own
    forward (its codes and scales where the fp8 recipe keeps them) and the rest of the step is the recipe's.
    Against the same model with fp8 layers alone: float32 layer outputs within FP32_TOL (the recipe adds
    no error to the fp8 layers'), and so no further from the float32 model than that model."""
    ref = _model("qwen3_5", ratio, seed=50)
    stock = copy.deepcopy(ref)
    patched = copy.deepcopy(ref)
    env = ENVS[env_name]()
    mpsboost.patch(stock, recipes=["fp8_weights"], fp8="rowwise", device=env)
    report = mpsboost.patch(patched, recipes=["fp8_weights", "linear_attention"], fp8="rowwise", device=env)
    assert [r.status for r in report.rows if r.recipe == "linear_attention"] == ["applied"]
    ids = torch.randint(3, 128, (2, 10), generator=torch.Generator().manual_seed(51))
    _assert_layers_match(stock, patched, ids, 7, f"fp8 rowwise r={ratio} {env_name}")
    layer = _deltanets(patched)[0]
    assert layer.in_proj_qkv.weight.dtype in (torch.float8_e4m3fn, torch.uint8)  # the fp8 layers are there
    assert layer.__dict__[la._STATE].derived["proj_mods"] is not None  # and the recipe's step used them
    r, s, p = [torch.cat([x.flatten() for x in _steps(m, ids, 7)]) for m in (ref, stock, patched)]
    assert relative_error(p, r) <= relative_error(s, r) + FP32_TOL


@pytest.mark.parametrize("env_name", ["mps-2.15.0", "mps-2.14.1"])
def test_applies_after_load_fp8_of_the_qwen36_fp8_layout(tmp_path, env_name):
    """After ``load_fp8`` of a folder in Qwen3.6-35B-A3B-FP8's layout (128x128 block scales; in_proj_qkv,
    in_proj_z and out_proj fp8, in_proj_b/a bf16) the DeltaNet layers are patched in the same transaction
    and keep the block-scaled layers' own forwards (dequantised per layer: the exact path). Against the
    file's exact dequantisation in float32, the bf16 layer outputs are no further than the fp8 layers alone
    give (BF16_FACTOR, as for bf16 models)."""
    from recipes.fp8.test_fp8_qwen36 import _meta_model, _reference, write_qwen36_fp8

    ref_state = write_qwen36_fp8(tmp_path / "qwen36")
    env = ENVS[env_name]()
    patched, stock = _meta_model(), _meta_model()
    report = mpsboost.load_fp8(patched, tmp_path / "qwen36", device=env)
    mpsboost.load_fp8(stock, tmp_path / "qwen36", device=env, lossless_recipes=False)
    rows = [r for r in report.rows if r.recipe == "linear_attention"]
    assert rows and all(r.status == "applied" for r in rows), [(r.target, r.status, r.reason) for r in rows]
    ref = _reference(ref_state).float()
    ids = torch.randint(0, 250, (2, 10), generator=torch.Generator().manual_seed(60))
    outs = []
    for m in (ref, stock, patched):
        outs.append([])
        _steps(m, ids, 7, outputs=outs[-1])
    flat = [torch.cat([t.flatten().float() for t in ts]) for ts in outs]
    e_stock, e_patched = relative_error(flat[1], flat[0]), relative_error(flat[2], flat[0])
    assert 0 < e_stock < 0.1
    assert e_patched <= BF16_FACTOR * e_stock, (e_patched, e_stock)
    assert all(m.__dict__[la._STATE].derived["proj_mods"] is not None for m in _deltanets(patched))
