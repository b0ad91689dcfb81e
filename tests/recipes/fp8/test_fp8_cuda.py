"""fp8_weights on a real CUDA GPU (compute capability >= 8.9): the Triton kernels and the fused paths
against the dequantised reference, on fresh random inputs. Skipped where no CUDA device is present.

Tolerances: the GEMV keeps activations in bf16 and accumulates in fp32, so its only difference from
``F.linear(x, dequantize(q, s))`` in fp32 is the final rounding to bf16 (relative error < 1e-2). The
dequantisation of large batches is held to codes x scale in fp32, rounded once, bit for bit. Whole layers and
models, which include weight quantisation, are held to the issue's quality bound: SQNR >= 25 dB
against the bf16 layer.
"""

from __future__ import annotations

import pytest
import torch
from mpsboost.bench import relative_error
import torch.nn.functional as F

from mpsboost.ops import fp8 as fp8_ops

pytestmark = pytest.mark.cuda


def _cc_ok() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


needs_fp8 = pytest.mark.skipif(not _cc_ok(), reason="needs a CUDA device of compute capability >= 8.9")


@needs_fp8
@pytest.mark.parametrize("m", [1, 2, 3, 16, 4096])
@pytest.mark.parametrize("n,k", [(4096, 4096), (1537, 1001), (48, 5120), (2048, 2080)])
@pytest.mark.parametrize("granularity", ["rowwise", "tensorwise"])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_dequantised_reference(m, n, k, granularity, bias, rng_seed):
    from mpsboost.ops import fp8_triton

    dev = "cuda"
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.05
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, device=dev, dtype=torch.bfloat16) if bias else None
    q, s = fp8_ops.quantize(w, granularity, "float8")
    # Poison: the caching allocator hands this block to the kernel's output next, so an element the
    # kernel does not write stays NaN.
    poison = torch.full((m, n), float("nan"), device=dev, dtype=torch.bfloat16)
    del poison
    y = fp8_triton.fp8_gemv(x, q, s, b)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    assert not torch.isnan(y).any(), "every output element must be written"
    ref = F.linear(x.float(), fp8_ops.dequantize(q, s, torch.float32), None if b is None else b.float())
    assert relative_error(y, ref) < 1e-2, (m, n, k, granularity, bias, relative_error(y, ref))


@needs_fp8
@pytest.mark.parametrize("cfg", [(16, 512, 4), (32, 256, 2), (64, 256, 1), (128, 128, 8)])
def test_gemv_every_config_and_split_k(cfg, rng_seed):
    from mpsboost.ops import fp8_triton

    n, k = 1000, 3000  # odd tiles in N and K for every config
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(3, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    q, s = fp8_ops.quantize(w, "rowwise", "float8")
    y = fp8_triton.fp8_gemv(x, q, s, b, config=fp8_triton.GemvConfig(*cfg))
    ref = F.linear(x.float(), fp8_ops.dequantize(q, s, torch.float32), b.float())
    assert relative_error(y, ref) < 1e-2


@needs_fp8
@pytest.mark.parametrize("cfg", [(8, 512, 1), (16, 512, 2), (16, 1024, 1), (32, 512, 4)])
@pytest.mark.parametrize("granularity", ["rowwise", "tensorwise"])
def test_single_row_kernel_every_config(cfg, granularity, rng_seed):
    """The CUDA-core kernel for one activation row: odd N and K, split K, bias; it computes the weight
    as dequantize() does (codes x scale in fp32, one rounding), so it agrees with F.linear on that weight."""
    from mpsboost.ops import fp8_triton

    bn, bk, sk = cfg
    n, k = 1001, 3000
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    q, s = fp8_ops.quantize(w, granularity, "float8")
    y = fp8_triton.fp8_gemv(x, q, s, b, config=fp8_triton.GemvConfig(bn, bk, sk, 4, 1, "row"))
    same = F.linear(x, fp8_ops.dequantize(q, s, torch.bfloat16), b)
    assert relative_error(y, same) < 2e-3  # summation order only
    with pytest.raises(ValueError, match="one activation row"):
        fp8_triton.fp8_gemv(
            torch.randn(2, k, device="cuda", dtype=torch.bfloat16),
            q,
            s,
            b,
            config=fp8_triton.GemvConfig(bn, bk, sk, 4, 1, "row"),
        )


@needs_fp8
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gemv_other_activation_dtypes(dtype, rng_seed):
    from mpsboost.ops import fp8_triton

    w = torch.randn(777, 1024, device="cuda", dtype=dtype)
    x = torch.randn(2, 1024, device="cuda", dtype=dtype)
    q, s = fp8_ops.quantize(w, "rowwise", "float8")
    y = fp8_triton.fp8_gemv(x, q, s, None)
    ref = F.linear(x.float(), fp8_ops.dequantize(q, s, torch.float32))
    # fp32 activations go through tf32 tensor cores in tl.dot: about 1e-3.
    assert y.dtype == dtype and relative_error(y, ref) < (1e-2 if dtype == torch.float16 else 5e-3)


@needs_fp8
@pytest.mark.parametrize("m,k", [(1, 4096), (7, 1001), (4096, 5120)])
def test_quantize_rows_kernel_matches_torch(m, k, rng_seed):
    from mpsboost.ops import fp8_triton

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 3
    x[0, :] = 0  # an all-zero row: scale 1, codes 0
    q, s = fp8_triton.quantize_rows(x)
    q2, s2 = fp8_ops.quantize_rows(x)
    torch.testing.assert_close(s, s2, rtol=1e-6, atol=0)
    same = (q.view(torch.uint8) == q2.view(torch.uint8)).float().mean().item()
    assert same > 0.999, same  # division by the scale may round differently in the last ulp
    assert s[0].item() == 1.0 and (q[0].view(torch.uint8) == 0).all()


@needs_fp8
@pytest.mark.parametrize("n,k", [(3072, 3072), (1537, 1001), (1, 5)])
@pytest.mark.parametrize("granularity", ["rowwise", "tensorwise"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dequantize_rounds_the_fp32_product_once_on_cuda(n, k, granularity, dtype, rng_seed):
    w = torch.randn(n, k, device="cuda") * torch.rand(n, 1, device="cuda") * 5
    q, s = fp8_ops.quantize(w, granularity, "float8")
    want = (q.float() * s).to(dtype)
    assert torch.equal(fp8_ops.dequantize(q, s, dtype).view(torch.int16), want.view(torch.int16))


@needs_fp8
def test_eager_calls_skip_the_dispatcher_traced_and_autograd_calls_do_not(rng_seed):
    from unittest import mock

    q, s = fp8_ops.quantize(torch.randn(256, 512, device="cuda"), "rowwise", "float8")
    x = torch.randn(1, 512, device="cuda", dtype=torch.bfloat16)
    with mock.patch.object(fp8_ops, "_fp8_gemv_cuda", wraps=fp8_ops._fp8_gemv_cuda) as direct:
        y = fp8_ops.fp8_gemv(x, q, s)
        assert direct.call_count == 1
        xg = x.clone().requires_grad_()
        yg = fp8_ops.fp8_gemv(xg, q, s)
        assert direct.call_count == 1  # through the registered operator, which has no backward
        torch.testing.assert_close(yg.detach(), y, rtol=0, atol=0)
        with pytest.raises(RuntimeError):
            yg.sum().backward()
        compiled = torch.compile(lambda a: fp8_ops.fp8_gemv(a, q, s), fullgraph=True)
        torch.testing.assert_close(compiled(x), y, rtol=0, atol=0)
        assert direct.call_count == 1  # the traced call is the operator


@needs_fp8
@pytest.mark.parametrize("m", [1, 3, 16, 17, 4096])
@pytest.mark.parametrize("n,k", [(3072, 3072), (1537, 1001)])
@pytest.mark.parametrize("granularity", ["rowwise", "tensorwise"])
def test_fused_linear_every_m_within_the_quality_bound(m, n, k, granularity, rng_seed):
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, m, k, device="cuda", dtype=torch.bfloat16)
    q, s = fp8_ops.quantize(w, granularity, "float8")
    y = fp8_ops.fp8_linear(x, q, s, b, kind="fused", compute_dtype=torch.bfloat16)
    assert y.shape == (1, m, n)
    ref = F.linear(x.float(), w.float(), b.float())
    assert fp8_ops.sqnr_db(y, ref) >= 25.0


@needs_fp8
def test_decode_step_is_sync_free_and_graph_capturable(rng_seed):
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    q, s = fp8_ops.quantize(w, "rowwise", "float8")
    x = torch.randn(1, 1, 4096, device="cuda", dtype=torch.bfloat16)
    eager = fp8_ops.fp8_linear(x, q, s, None, kind="fused", compute_dtype=torch.bfloat16)  # tunes once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = fp8_ops.fp8_linear(x, q, s, None, kind="fused", compute_dtype=torch.bfloat16)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(again, eager, rtol=0, atol=0)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = fp8_ops.fp8_linear(x, q, s, None, kind="fused", compute_dtype=torch.bfloat16)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(
        captured, fp8_ops.fp8_linear(x, q, s, None, kind="fused", compute_dtype=torch.bfloat16), rtol=0, atol=0
    )


def _tiny_qwen3_moe_cuda():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_experts=16,
        num_experts_per_tok=4,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(cfg).to("cuda", torch.bfloat16).eval()


@needs_fp8
@pytest.mark.parametrize("moe_path", ["auto", "scaled_grouped_mm", "gather", "hit"])
def test_patched_moe_model_on_cuda_within_the_quality_bound(moe_path, rng_seed):
    import mpsboost

    ref_model, model = _tiny_qwen3_moe_cuda(), _tiny_qwen3_moe_cuda()
    ids = torch.randint(0, 256, (2, 24), device="cuda")
    with torch.no_grad():
        ref = ref_model(ids).logits.float()
        report = mpsboost.patch(
            model, recipes=["fp8_weights"], fp8="rowwise", options={"fp8_weights": {"moe_path": moe_path}}
        )
        out = model(ids).logits.float()
        one = model(ids[:, :1]).logits.float()  # 4 routed pairs: the gather path in auto mode
    rows = [r for r in report.rows_for("fp8_weights") if r.status == "applied"]
    assert rows and any("experts" in r.target for r in rows)
    if moe_path in ("auto", "scaled_grouped_mm"):
        assert any("scaled_grouped_mm" in r.backing for r in rows if "experts" in r.target)
    assert fp8_ops.sqnr_db(out, ref) >= 20.0
    assert torch.isfinite(one).all()


@needs_fp8
def test_real_env_plan_names_the_fused_paths():
    import mpsboost

    model = _tiny_qwen3_moe_cuda()
    rows = mpsboost.plan(model, recipes=["fp8_weights"], fp8="rowwise").rows_for("fp8_weights")
    linear = [r for r in rows if r.target.endswith("q_proj")]
    assert linear and all(r.backing.startswith("fp8 GEMV (triton)") for r in linear)


@needs_fp8
@pytest.mark.parametrize("m", [1, 32])
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_fused_linear_compiles_fullgraph_with_inductor(m, mode, rng_seed):
    """The fused forward under torch.compile(fullgraph=True): the Triton kernels are registered operators
    (no tracing into a launch), CUDA graphs included; equal to the eager fused forward up to rounding."""
    w = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16) * 0.05
    b = torch.randn(2048, device="cuda", dtype=torch.bfloat16)
    q, s = fp8_ops.quantize(w, "rowwise", "float8")
    bias_in_mm = fp8_ops.scaled_mm_bias_supported("cuda:0")

    def f(x):
        return fp8_ops.fp8_linear(x, q, s, b, kind="fused", compute_dtype=torch.bfloat16, bias_in_mm=bias_in_mm)

    x = torch.randn(1, m, 1024, device="cuda", dtype=torch.bfloat16)
    eager = f(x)
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, mode=mode)
    for _ in range(3):  # reduce-overhead records its CUDA graph on a later call
        got = compiled(x)
    torch.cuda.synchronize()
    torch._dynamo.reset()
    assert relative_error(got, eager) < 1e-2, relative_error(got, eager)


@needs_fp8
def test_patch_tunes_the_gemv_before_the_first_forward():
    """Autotuning happens at patch time (the transaction's commit), never inside a traced forward."""
    import mpsboost
    from mpsboost.ops import fp8_triton

    fp8_triton.clear_tuning_cache()
    model = _tiny_qwen3_moe_cuda()
    mpsboost.patch(model, recipes=["fp8_weights"], fp8="rowwise")
    q = model.model.layers[0].self_attn.q_proj.weight
    n, k = q.shape
    assert any(key[:3] == (n, k, 1) for key in fp8_triton._TUNED), list(fp8_triton._TUNED)[:5]


@needs_fp8
@pytest.mark.parametrize("scales", ["rowwise", "per_expert", "block"])
@pytest.mark.parametrize("r,e,n,k", [(8, 32, 1024, 2048), (8, 32, 2048, 512), (5, 7, 300, 208), (1, 4, 48, 64)])
def test_grouped_gemv_matches_the_reference(scales, r, e, n, k, rng_seed):
    # mpsboost::grouped_mm's CUDA kernel (Triton) against its plain-torch reference: rows sorted by expert with
    # offsets on the device, an empty expert, rows past the last offset (zeros), a stride-0 shared row.
    from mpsboost.ops import fp8_triton
    from mpsboost.ops.fp8_grouped import grouped_mm_reference

    dev = "cuda"
    codes = torch.randint(0, 256, (e, n, k), device=dev, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0
    q = codes.view(torch.float8_e4m3fn)
    bn, bk = {"rowwise": (1, k), "per_expert": (n, k), "block": (128, 128)}[scales]
    scale = torch.rand(e, -(-n // bn), -(-k // bk), device=dev) * 1e-2 + 1e-3
    counts = torch.zeros(e, dtype=torch.int64)
    counts[torch.randint(0, e, (max(r - 1, 1),))] += 1
    counts[0] = 0  # one expert without rows
    offs = torch.cumsum(counts, 0).to(torch.int32).to(dev)
    for shared in (False, True):
        x = torch.randn(1 if shared else r, k, device=dev, dtype=torch.bfloat16)
        x = x.expand(r, k) if shared else x
        y = fp8_triton.grouped_gemv(x, q, offs, scale, bn, bk)
        ref = grouped_mm_reference(x, q, offs, scale, bn, bk)
        assert not torch.isnan(y).any()
        assert relative_error(y, ref) < 1e-2, (scales, r, e, n, k, shared, relative_error(y, ref))
        past = int(offs[-1])
        assert torch.equal(y[past:], torch.zeros_like(y[past:]))
