"""Dense low-bit linears on a Mac where both mpsboost's Metal affine GEMV and torch's own int4pack/int8pack serve
them: decided by timing the two at the layer's decode shape on the user's Mac at patch time
(``mpsboost.ondevice.choose``), the Metal GEMV taken only where faster (a tie, a slower GEMV or a timing error keeps
torch's kernel); a simulated Mac and option ``mps_kernel="metal"`` take the static choice (the Metal GEMV) and time
nothing; ``mps_kernel="torch"`` takes torch's kernel wherever it serves the layer. Without a Mac: the gate's probe
and the kernels' self-check stubbed, the contenders on the CPU, an injected timer; torch's int4pack/int8pack run
on the CPU (``_weight_int4pack_mm_for_cpu``, ``_weight_int8pack_mm``) against the layer's dequantise-then-linear.

The tiny Llama below has odd shapes where torch's kernels allow them: K = 96 (a multiple of 32, not of 64), N = 32,
96 and 160 (multiples of 16, not all of 32), and an output head of N = 120, which int4pack does not take (N not a
multiple of 16): it keeps the Metal GEMV with the reason.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import tiny_models as tm

import mpsboost
from mpsboost import gate, ondevice
from mpsboost.gate import Env
from mpsboost.ops import affine as A
from mpsboost.ops import affine_metal
from mpsboost.recipes.low_bit import paths
from mpsboost.recipes.low_bit.layers import AffineState, QParams, affine_state, build_layer, dequantize

GS = 32
SHAPES = {(96, 96), (32, 96), (160, 96), (96, 160)}  # the projections' [N, K]; the head [120, 96] is not int4pack's
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # of the output's largest magnitude (see the int4pack test)


def _llama(dtype=torch.float32, vocab=120, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=1,
        num_attention_heads=3,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg).to(dtype).eval()


@pytest.fixture
def stub_mac(monkeypatch, tmp_path):
    monkeypatch.setenv("MPSBOOST_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(affine_metal, "self_check", lambda device="mps": None)
    monkeypatch.setattr(paths, "_METAL_CHECKED", {})
    monkeypatch.setitem(gate._PROBE_CACHE, ("affine_metal_gemv", "mps", "2.15.0"), None)
    state = {"timer": tm.no_timing, "built": []}
    real = A.gemv_contenders

    def contenders(n, k, bits, group_size, dtype, **kw):
        state["built"].append((n, k, bits, group_size, dtype))
        return real(n, k, bits, group_size, dtype, device="cpu")

    monkeypatch.setattr(A, "gemv_contenders", contenders)
    monkeypatch.setattr(ondevice, "default_timer", lambda fn: state["timer"](fn))
    return state


def _rows(env, model=None, bits=4, **opts):
    m = model if model is not None else _llama()
    options = {"low_bit_weights": {"bits": bits, "group_size": GS, **opts}}
    report = mpsboost.plan(m, recipes=["low_bit_weights"], env=env, options=options)
    rows = {r.target: r for r in report.rows if r.recipe == "low_bit_weights" and r.target.endswith(("proj", "head"))}
    assert len(rows) == 8 and all(r.status == "would apply" for r in rows.values()), str(report)
    head = rows.pop("lm_head")
    return list(rows.values()), head


def _metal(r) -> bool:
    return r.backing == paths.METAL


def _torch(r, pack="int4pack") -> bool:
    return r.backing == paths.PACK[pack]


def test_the_contenders_compute_the_same_product(rng_seed):
    # float32: int4pack's repack is exact there and the reference rounds once per weight in float32
    for bits in (4, 8):
        stock, metal = A.gemv_contenders(96, 160, bits, GS, torch.float32, device="cpu")
        a, b = metal().double(), stock().double()
        assert a.shape == b.shape == (1, 96)
        assert (a - b).abs().max() <= 1e-5 * a.abs().max(), bits
    with pytest.raises(mpsboost.errors.UserInputError, match="bits=3"):
        A.gemv_contenders(96, 160, 3, GS, torch.float32, device="cpu")


def test_torch_pack_for_names_the_kernels_shape_rules():
    assert A.torch_pack_for(4, 48, 96, 32, torch.bfloat16) == ("int4pack", "")
    assert A.torch_pack_for(8, 64, 96, 32, torch.float16) == ("int8pack", "")
    for args, words in [
        ((4, 40, 96, 32, torch.bfloat16), "multiple of 16"),
        ((8, 48, 96, 32, torch.bfloat16), "multiples of 32"),
        ((3, 48, 96, 32, torch.bfloat16), "4 and 8 bits"),
        ((4, 48, 96, 32, torch.int8), "activations in torch.int8"),
    ]:
        pack, why = A.torch_pack_for(*args)
        assert pack is None and words in why, (args, why)


def test_simulated_mac_takes_the_metal_gemv_and_times_nothing(stub_mac):
    rows, head = _rows(Env.simulate("mps", "2.15.0"))  # the timer refuses any call
    assert all(_metal(r) and r.reason == f"4-bit affine, groups of {GS}" for r in rows), [r.reason for r in rows]
    assert _metal(head)


def test_real_mac_takes_the_metal_gemv_where_it_is_faster_and_caches_it(stub_mac):
    stub_mac["timer"] = tm.FakeTimer({"stock": 10e-6, "metal": 6e-6})
    rows, head = _rows(tm.real_mac())
    assert all(_metal(r) and "0.60x" in r.reason and "timed on this Mac" in r.reason for r in rows), [
        r.reason for r in rows
    ]
    # one timing per distinct shape (q and o, k and v, gate and up share theirs); the head has nothing to time
    assert stub_mac["timer"].calls.count("metal") == ondevice.ROUNDS * len(SHAPES)
    assert {(n, k) for n, k, *_ in stub_mac["built"]} == SHAPES
    assert _metal(head) and "0.60x" not in head.reason
    stub_mac["timer"] = tm.no_timing
    rows, _ = _rows(tm.real_mac())
    assert all(_metal(r) and "(cache)" in r.reason for r in rows)


@pytest.mark.parametrize("metal", [10e-6, 14e-6])
def test_real_mac_keeps_torchs_kernel_on_a_tie_or_slower(stub_mac, metal):
    stub_mac["timer"] = tm.FakeTimer({"stock": 10e-6, "metal": metal})
    rows, head = _rows(tm.real_mac())
    assert all(_torch(r) and "not faster on this Mac" in r.reason for r in rows), [r.backing for r in rows]
    assert f"{metal / 10e-6:.2f}x" in rows[0].reason
    assert _metal(head)


def test_real_mac_keeps_torchs_kernel_on_a_timing_error(stub_mac):
    stub_mac["timer"] = tm.FakeTimer({"stock": 10e-6, "metal": 1e-6}, error=RuntimeError("command buffer failed"))
    rows, _ = _rows(tm.real_mac())
    assert all(_torch(r) and "timing failed" in r.reason for r in rows), [r.reason for r in rows]


def test_a_failed_self_check_keeps_the_metal_kernels_off(stub_mac, monkeypatch):
    monkeypatch.setattr(affine_metal, "self_check", lambda device="mps": "row 3 differs")
    rows, head = _rows(tm.real_mac())  # nothing timed: the Metal GEMV is not a contender
    assert all(_torch(r) and "failed its self-check on this Mac: row 3 differs" in r.reason for r in rows), [
        r.reason for r in rows
    ]
    assert not head.backing.startswith("affine GEMV") and "failed its self-check" in head.backing
    assert paths.metal_verdict(tm.real_mac()).ok is False


def test_metal_verdict_follows_the_gate():
    assert paths.metal_verdict(Env.simulate("mps", "2.15.0")).ok
    assert paths.metal_verdict(Env.simulate("mps", "2.14.1")).ok
    v = paths.metal_verdict(Env.simulate("mps", "2.6.0"))
    assert not v.ok and "2.7" in v.reason
    assert not paths.metal_verdict(Env.simulate("cuda", "2.15.0")).ok


@pytest.mark.parametrize("env", ["real", "simulated"])
def test_the_option_forces_each_path_untimed(stub_mac, env):
    e = tm.real_mac() if env == "real" else Env.simulate("mps", "2.15.0")
    rows, head = _rows(e, mps_kernel="metal")
    assert all(_metal(r) for r in rows) and stub_mac["built"] == []
    rows, head = _rows(e, mps_kernel="torch")
    assert all(_torch(r) and "option mps_kernel='torch'" in r.reason for r in rows), [r.reason for r in rows]
    assert stub_mac["built"] == []
    assert _metal(head) and "do not serve it" in head.reason and "multiple of 16" in head.reason
    with pytest.raises(mpsboost.errors.RecipeOptionError, match="mps_kernel"):
        _rows(e, mps_kernel="int4")


def test_the_option_changes_nothing_off_a_mac(stub_mac):
    rows, head = _rows(Env.simulate("cpu", "2.15.0"), mps_kernel="torch")
    assert all(r.backing == paths.DEQUANT for r in [*rows, head])


def test_a_loaded_linear_takes_the_same_choice(stub_mac):
    from mpsboost.registry import get_recipe

    recipe = get_recipe("low_bit_weights")
    stub_mac["timer"] = tm.FakeTimer({"stock": 10e-6, "metal": 20e-6})
    args = ("linear", {"weight": QParams(4, 64)}, torch.bfloat16, tm.real_mac(), "folder")
    state, d = recipe.decide_loaded(*args, shape=(128, 256))
    assert state.pack == "int4pack" and not state.kernel and d.backing == paths.PACK["int4pack"]
    assert "2.00x" in d.reason
    state, d = recipe.decide_loaded(*args)  # no shape given: the static path
    assert state.kernel and state.pack == "" and d.backing == paths.METAL
    args = ("linear", {"weight": QParams(8, 64)}, torch.bfloat16, tm.real_mac(), "folder")
    state, d = recipe.decide_loaded(*args, shape=(128, 256), mps_kernel="torch")
    assert state.kernel and "codes are read after the plan" in d.reason


def test_from_pretrained_hands_each_loaded_linear_its_shape(tmp_path, monkeypatch):
    # The one-call load asks the recipe per layer with the linear's [out, in] (what the choice above needs); the
    # experts, embeddings and norms without one. The folder: a tiny Qwen3 quantised by mpsboost and saved as MLX.
    from conftest import hf_model

    from mpsboost.registry import get_recipe

    m = hf_model("qwen3")
    want = {(mod.out_features, mod.in_features) for mod in m.modules() if isinstance(mod, torch.nn.Linear)}
    mpsboost.patch(m, recipes=["low_bit_weights"], options={"low_bit_weights": {"bits": 4, "group_size": GS}})
    mpsboost.save_mlx(m, tmp_path / "mlx")
    recipe = type(get_recipe("low_bit_weights"))
    real = recipe.decide_loaded
    asked = []

    def spy(self, kind, params, compute, env, source, **kw):
        asked.append((kind, kw.get("shape")))
        return real(self, kind, params, compute, env, source, **kw)

    monkeypatch.setattr(recipe, "decide_loaded", spy)
    mpsboost.from_pretrained(tmp_path / "mlx", dtype=torch.float32, device="cpu")
    shapes = {shape for kind, shape in asked if kind == "linear"}
    assert shapes == want and len(want) >= 3
    assert all(shape is None for kind, shape in asked if kind != "linear")


def _patched(dtype, bits=4, model=None):
    m = model if model is not None else _llama(dtype)
    options = {"low_bit_weights": {"bits": bits, "group_size": GS, "mps_kernel": "torch"}}
    mpsboost.patch(m, recipes=["low_bit_weights"], device=Env.simulate("mps", "2.15.0"), options=options)
    return m


def _linears(m):
    return {n: mod for n, mod in m.named_modules() if (s := affine_state(mod)) is not None and s.kind == "linear"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_int4pack_path_computes_the_layers_dequantize_then_linear(dtype, rng_seed):
    """On the CPU (``_weight_int4pack_mm_for_cpu``): each projection's 1-4 rows by torch's int4pack on the layer's
    own packed copy equal its dequantise-then-linear within TOL of the output's largest magnitude (float32: the
    repack is exact and both sum in float32; bfloat16: both round the output once, the reference its weights too),
    on fresh random inputs of 1, 3 and 4 rows; more rows take the dequantise-then-linear path itself."""
    m = _patched(dtype)
    layers = _linears(m)
    packed = {n for n, mod in layers.items() if affine_state(mod).pack == "int4pack"}
    assert packed == {n for n in layers if n != "lm_head"}, packed
    g = torch.Generator().manual_seed(rng_seed)
    for name in sorted(packed):
        mod = layers[name]
        p = affine_state(mod).params["weight"]
        assert {"pack_weight", "pack_scales"}.isdisjoint(mod.state_dict()), "the packed copy is not saved"
        w = dequantize(mod.weight, mod.scales, mod.biases, p, torch.float32)
        for rows in (1, 3, 4, 5):
            x = torch.randn(rows, mod.in_features, generator=g).to(dtype)
            with torch.no_grad():
                y = mod(x)
            ref = F.linear(x.float(), w)
            err = float((y.float() - ref).abs().max() / ref.abs().max())
            assert err <= TOL[dtype], f"{name}, {rows} rows: {err:.2e}"
            if rows <= 4:  # the path is torch's kernel on the layer's packed copy
                assert torch.equal(y, A.int4pack_linear(x, mod.pack_weight, mod.pack_scales, GS)), name
            else:
                assert torch.equal(y, F.linear(x, dequantize(mod.weight, mod.scales, mod.biases, p, dtype))), name


def test_the_int4pack_forward_compiles(rng_seed):
    m = _patched(torch.float32)
    mod = _linears(m)["model.layers.0.mlp.down_proj"]
    x = torch.randn(1, 2, mod.in_features, generator=torch.Generator().manual_seed(rng_seed))
    with torch.no_grad():
        eager = mod(x)
        compiled = torch.compile(mod, fullgraph=True)(x)
    assert torch.equal(eager, compiled)


def _int8_representable(m, g):
    """Every projection's weight ``s_row * (c - 128)`` with codes c in [0, 255], each group holding 0 and 255: what
    ``mx.quantize`` turns into one scale a row and ``bias = -128 * scale``, int8pack's own format (s a power of 2,
    exact in every dtype)."""
    for mod in m.modules():
        if isinstance(mod, torch.nn.Linear):
            n, k = mod.weight.shape
            c = torch.randint(0, 256, (n, k), generator=g)
            c[:, 0::GS], c[:, 1::GS] = 0, 255
            s = 2.0 ** torch.randint(-12, -8, (n, 1), generator=g).float()
            mod.weight.data = (s * (c - 128)).to(mod.weight.dtype)
    return m


def test_8_bit_takes_int8pack_only_where_it_represents_the_codes(stub_mac, rng_seed):
    g = torch.Generator().manual_seed(rng_seed)
    # ordinary 8-bit groups (a scale and a bias each): int8pack cannot hold them; the static path, with the reason
    rows, _ = _rows(Env.simulate("mps", "2.15.0"), bits=8, mps_kernel="torch")
    assert all(_metal(r) and "one scale per output channel" in r.reason for r in rows), [r.reason for r in rows]
    stub_mac["timer"] = tm.FakeTimer({"stock": 10e-6, "metal": 6e-6})
    rows, _ = _rows(tm.real_mac(), bits=8)  # auto on a real Mac: nothing to time against
    assert all(_metal(r) and "timed" not in r.reason for r in rows) and stub_mac["built"] == []
    # codes in int8pack's format (vocab 128: the head's N a multiple of 32 too): torch's int8pack, same numbers
    model = _int8_representable(_llama(vocab=128), g)
    rows, head = _rows(Env.simulate("mps", "2.15.0"), model=model, bits=8, mps_kernel="torch")
    assert all(_torch(r, "int8pack") for r in [*rows, head]), [r.reason for r in rows]
    m = _patched(torch.float32, bits=8, model=model)
    for name, mod in _linears(m).items():
        assert affine_state(mod).pack == "int8pack", name
        p = affine_state(mod).params["weight"]
        x = torch.randn(3, mod.in_features, generator=g)
        with torch.no_grad():
            y = mod(x)
        ref = F.linear(x, dequantize(mod.weight, mod.scales, mod.biases, p, torch.float32))
        assert float((y - ref).abs().max() / ref.abs().max()) <= TOL[torch.float32], name
        assert torch.equal(y, A.int8pack_linear(x, mod.pack_weight, mod.pack_scales)), name


def test_an_inexact_4_bit_repack_falls_back_with_a_warning(rng_seed):
    """A 4-bit layer whose zero ``bias + 8 * scale`` does not round-trip in the compute dtype (codes that
    ``mx.quantize`` never writes, as a foreign checkpoint might) is not repacked: the static path, with a warning."""
    g = torch.Generator().manual_seed(rng_seed)
    n, k = 32, 64
    q = A.pack_codes(torch.randint(0, 16, (n, k), generator=g), 4)
    s = torch.full((n, k // GS), 2.0**-11, dtype=torch.bfloat16)
    b = torch.full((n, k // GS), 1.0 + 2.0**-7, dtype=torch.bfloat16)  # zero 1 + 2^-7 + 2^-8: 8 bits, bf16 keeps 7
    for static in (True, False):
        mod = torch.nn.Linear(k, n, bias=False).to(torch.bfloat16)
        state = AffineState("linear", {"weight": QParams(4, GS)}, torch.bfloat16, pack="int4pack")
        state.extra["static_kernel"] = static
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            build_layer(mod, state, {"weight": q, "scales": s, "biases": b}, "test")
        assert any("int4pack not taken" in str(w.message) for w in caught)
        got = affine_state(mod)
        assert got.pack == "" and got.kernel is static and "not representable in torch.bfloat16" in got.backing
        assert not hasattr(mod, "pack_weight")
