"""rms_norm: transformers' RMSNorm layers as one F.rms_norm call, matched by their code, exact on the CPU."""

from __future__ import annotations

import gc
import weakref

import pytest
from mpsboost.bench import ModuleOps
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import mpsboost
from mpsboost import Env
from mpsboost.recipes import rms_norm as recipe

transformers = pytest.importorskip("transformers")

MAC = Env.simulate("mps", "2.15.0")

# (module, class, form): the references and classes copied from them in transformers
CLASSES = [
    ("transformers.models.llama.modeling_llama", "LlamaRMSNorm", "round_then_scale"),
    ("transformers.models.qwen3.modeling_qwen3", "Qwen3RMSNorm", "round_then_scale"),
    ("transformers.models.mixtral.modeling_mixtral", "MixtralRMSNorm", "round_then_scale"),
    ("transformers.models.gpt_oss.modeling_gpt_oss", "GptOssRMSNorm", "scale_in_fp32"),
    ("transformers.models.helium.modeling_helium", "HeliumRMSNorm", "scale_in_fp32"),
    ("transformers.models.gemma.modeling_gemma", "GemmaRMSNorm", "zero_centered"),
    ("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeRMSNorm", "zero_centered"),
    ("transformers.models.qwen3_next.modeling_qwen3_next", "Qwen3NextRMSNorm", "zero_centered"),
]


def _cls(mod: str, name: str):
    import importlib

    return getattr(importlib.import_module(mod), name)


def _norm(mod: str, name: str, width: int, dtype: torch.dtype) -> torch.nn.Module:
    cls = _cls(mod, name)
    m = cls(width, eps=1e-5) if "eps" in cls.__init__.__code__.co_varnames else cls(width)
    with torch.no_grad():
        m.weight.normal_(0.0, 0.5)
    return torch.nn.Sequential(m).to(dtype)  # a root, so that patch() finds the norm inside it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mod,name,form", CLASSES, ids=[c[1] for c in CLASSES])
def test_each_form_equals_the_module_bit_for_bit_on_cpu(mod, name, form, dtype, rng_seed):
    # On the CPU F.rms_norm is the composite the module's code computes, op for op: equality is exact.
    model = _norm(mod, name, 96, dtype)
    x = (torch.randn(2, 5, 96) * 4).to(dtype)
    ref = model(x)
    report = mpsboost.patch(model, device=MAC)
    [row] = [r for r in report.applied if r.recipe == "rms_norm"]
    assert form in row.backing and "Metal" in row.backing
    torch.testing.assert_close(model(x), ref, rtol=0, atol=0)
    mpsboost.unpatch(model)
    assert "forward" not in model[0].__dict__


def test_a_class_with_other_code_is_left_alone():
    base = _cls("transformers.models.llama.modeling_llama", "LlamaRMSNorm")

    class LlamaRMSNormScaled(base):  # same name pattern, different code: must not be matched
        def forward(self, hidden_states):
            return 2 * super().forward(hidden_states)

    LlamaRMSNormScaled.__module__ = "transformers.models.llama.modeling_llama"
    model = torch.nn.Sequential(LlamaRMSNormScaled(32))
    report = mpsboost.plan(model, env=MAC, recipes=["rms_norm"])
    assert not report.applied and report.rows[0].status == "not applicable"


def _qwen36(dtype=torch.float32):
    cfg = transformers.Qwen3_5MoeTextConfig(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
    )
    model = transformers.Qwen3_5MoeForCausalLM(cfg).eval().to(dtype)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") or n.endswith("layernorm.weight"):
                p.normal_(0.0, 0.3)  # zero-centered weights start at 0: give the (1 + w) form something to do
    return model


def test_whole_model_under_mac_decisions_equals_stock_and_unpatches(rng_seed):
    model = _qwen36(torch.bfloat16)
    ids = torch.randint(0, 128, (2, 9))
    with torch.no_grad():
        ref = model(ids).logits
    norms = [m for m in model.modules() if type(m).__name__ == "Qwen3_5MoeRMSNorm"]
    report = mpsboost.patch(model, device=MAC, recipes=["rms_norm"])
    # 2 per decoder layer, the final norm, and q/k norms of the one attention layer
    assert len(report.applied) == len(norms) == 2 * 4 + 1 + 2
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref, rtol=0, atol=0)
    mpsboost.unpatch(model)
    assert all("forward" not in m.__dict__ for m in norms)


@pytest.mark.parametrize(
    "env,why",
    [
        (Env.simulate("cpu", "2.15.0"), "composite"),
        (Env.simulate("mps", "2.6.0"), "needs torch 2.7"),
    ],
    ids=["on-cpu", "mac-2.6"],
)
def test_steps_aside_where_nothing_is_gained(env, why):
    report = mpsboost.plan(_qwen36(), env=env, recipes=["rms_norm"])
    assert not report.applied and report.skipped and all(why in r.reason for r in report.skipped)


def test_devices_option_and_bad_values():
    model = _qwen36()
    report = mpsboost.patch(model, recipes=["rms_norm"], options={"rms_norm": {"devices": ("cpu",)}}, device="cpu")
    assert report.applied and all("asked for on cpu" in r.reason for r in report.applied)
    mpsboost.unpatch(model)
    with pytest.raises(mpsboost.PatchError, match="unknown \\['tpu'\\]"):
        mpsboost.patch(model, recipes=["rms_norm"], options={"rms_norm": {"devices": ("tpu",)}})
    with pytest.raises(TypeError, match="devices"):
        mpsboost.patch(model, recipes=["rms_norm"], options={"rms_norm": {"devices": "mps"}})


class _Calls(TorchFunctionMode):
    """Calls at the torch-function level: F.rms_norm is one call here, whatever it decomposes into below."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name not in ("__get__", "__set__", "dtype", "shape", "device"):
            self.names.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mod,name,form", [CLASSES[0], CLASSES[3], CLASSES[6]], ids=lambda c: str(c))
def test_one_fused_call_per_norm(mod, name, form):
    # On MPS F.rms_norm with a weight is one Metal kernel (pytorch#145301): the patched forward makes one
    # such call and at most 5 torch-level calls where the module's code makes 8 or more.
    model = _norm(mod, name, 64, torch.bfloat16)
    x = torch.randn(1, 1, 64).to(torch.bfloat16)
    with _Calls() as stock:
        model(x)
    mpsboost.patch(model, device=MAC)
    with _Calls() as patched:
        model(x)
    assert patched.names.count("rms_norm") == 1 and "rms_norm" not in stock.names
    assert len(patched.names) <= 5 < 8 <= len(stock.names), (stock.names, patched.names)


@pytest.mark.parametrize("mod,name,form", CLASSES[:3], ids=[c[1] for c in CLASSES[:3]])
def test_float32_round_then_scale_dispatches_no_more_aten_ops_than_the_module(mod, name, form, rng_seed):
    # In float32 the module's rounding is the identity, so the weight goes into F.rms_norm itself: on the CPU
    # (where F.rms_norm is the module's composite) no more aten ops than the module, on MPS one kernel.

    model = _norm(mod, name, 64, torch.float32)
    x = torch.randn(2, 5, 64)
    with ModuleOps() as stock:
        ref = model(x)
    mpsboost.patch(model, device=MAC)
    with ModuleOps() as patched, _Calls() as calls:
        out = model(x)
    assert patched.count <= stock.count and calls.names.count("rms_norm") == 1, (patched.names, stock.names)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_compiles_fullgraph():
    model = _norm(*CLASSES[6][:2], 64, torch.float32)
    mpsboost.patch(model, device=MAC)
    x = torch.randn(3, 64)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=0)


def test_a_dropped_patched_model_is_freed():
    model = _qwen36()
    mpsboost.patch(model, device=MAC, recipes=["rms_norm"])
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def test_references_hold_in_this_transformers():
    # every form has at least one reference whose formula was checked numerically in this process
    known = recipe._known_keys()
    assert set(known.values()) == set(recipe.FORMS)
    assert F.rms_norm is torch.nn.functional.rms_norm  # nothing reassigned


def _graph_calls(model, x) -> list[str]:
    """The call targets of the graph torch.compile traces for ``model`` (fullgraph)."""
    seen: list[str] = []

    def backend(gm, example_inputs):
        seen.extend(
            str(getattr(n.target, "__name__", n.target))
            for n in gm.graph.nodes
            if n.op in ("call_function", "call_method")
        )
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, fullgraph=True, backend=backend)(x)
    return seen


def test_on_cuda_eager_only_the_compiled_graph_traces_the_module_code():
    # Measured on CUDA in eager generate() only: there the compiled graph is the module's own code
    # (inductor fuses it), on MPS it is F.rms_norm.
    nvidia = Env.simulate("cuda:9.0", "2.11.0")
    model = _norm(*CLASSES[6][:2], 64, torch.float32)
    x = torch.randn(2, 64)
    ref = model(x)
    report = mpsboost.patch(model, device=nvidia)
    [row] = report.applied
    assert "eager" in row.backing and "torch.compile" in row.reason
    with _Calls() as eager:
        out = model(x)
    assert eager.names.count("rms_norm") == 1
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert "rms_norm" not in _graph_calls(model, x)
    mpsboost.unpatch(model)
    mpsboost.patch(model, device=MAC)
    assert "rms_norm" in _graph_calls(model, x)


@pytest.mark.parametrize("mod,name,form", [CLASSES[0], CLASSES[3], CLASSES[6]], ids=["llama", "gpt_oss", "qwen3_5_moe"])
def test_the_kept_float32_weight_follows_the_module_weight(mod, name, form, rng_seed):
    # The float32 weight F.rms_norm takes is kept between eager calls; writing into the weight
    # (load_state_dict), replacing it, or moving the module must give what stock gives with the new weight.
    model = _norm(mod, name, 64, torch.float32)
    stock = _norm(mod, name, 64, torch.float32)
    mpsboost.patch(model, device=MAC)
    x = torch.randn(3, 64)
    with torch.no_grad():
        model(x)  # the kept weight is built here
        stock.load_state_dict({"0.weight": torch.randn(64)})
        model.load_state_dict(stock.state_dict())  # an in-place copy: same tensor, new version
        torch.testing.assert_close(model(x), stock(x), rtol=0, atol=0)
        new = torch.nn.Parameter(torch.randn(64))
        model[0].weight = new  # another Parameter object
        stock[0].weight = torch.nn.Parameter(new.detach().clone())
        torch.testing.assert_close(model(x), stock(x), rtol=0, atol=0)
        kept = model[0].__dict__[recipe._STATE].w32
        model.double()
        stock.double()  # param.data swapped: another data pointer and dtype (the values stay)
        torch.testing.assert_close(model(x.double()), stock(x.double()), rtol=1e-6, atol=1e-6)
        assert model[0].__dict__[recipe._STATE].w32 is not kept  # rebuilt from the moved weight


def test_the_kept_weight_stays_out_of_autograd(rng_seed):
    # With grad enabled and a weight that requires it, the weight's own ops run: its gradient is stock's.
    mod, name, _ = CLASSES[6]
    model, stock = _norm(mod, name, 32, torch.float32), _norm(mod, name, 32, torch.float32)
    stock.load_state_dict(model.state_dict())
    mpsboost.patch(model, device=MAC)
    x = torch.randn(2, 32)
    with torch.no_grad():
        model(x)
    model(x).square().sum().backward()
    stock(x).square().sum().backward()
    torch.testing.assert_close(model[0].weight.grad, stock[0].weight.grad)
