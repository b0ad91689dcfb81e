"""mpsboost.ops.affine: MLX's affine low-bit format against MLX itself, and the registered operators.

* :func:`affine_quantize` and :func:`affine_dequantize` equal ``mx.quantize`` / ``mx.dequantize`` bit for bit at every
  width, group size and dtype (edge groups included: constant, all-zero, tiny, one-signed);
* the operators' reference path equals ``mx.quantized_matmul`` / ``mx.gather_qmm`` in float32 (relative 1e-5 of the
  output's largest magnitude: both dequantise in float32 and sum in float32, in different orders);
* fakes and ``torch.compile(fullgraph=True)``; ``torch.library.opcheck``; bad input gets a specific error;
* torch's int4pack / int8pack fed from MLX's layout: numerics on the CPU (both ops run there), the MPS byte order.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mpsboost.bench import max_relative_error

from mpsboost.errors import UserInputError
from mpsboost.ops import affine as A

mx = pytest.importorskip("mlx.core", reason="mlx (mlx[cpu] on Linux) is the reference of MLX's format")

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def to_mx(t: torch.Tensor):
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return mx.array(t.view(torch.int16).numpy()).view(mx.bfloat16)
    if t.dtype == torch.uint32:
        return mx.array(t.view(torch.int32).numpy()).view(mx.uint32)
    return mx.array(t.numpy())


def to_t(a) -> torch.Tensor:
    if a.dtype == mx.bfloat16:
        return torch.from_numpy(np.array(a.view(mx.int16))).view(torch.bfloat16)
    if a.dtype == mx.uint32:
        return torch.from_numpy(np.array(a.view(mx.int32))).view(torch.uint32)
    return torch.from_numpy(np.array(a))


def _weight(g, *shape, dtype=torch.float32):
    w = torch.randn(*shape, generator=g) * (torch.rand(*shape[:-1], 1, generator=g) * 3 + 0.01)
    return w.to(dtype)


def _edge_groups(w: torch.Tensor, gs: int) -> torch.Tensor:
    """Rows whose first group is constant, zero, tiny (below the 1e-7 scale floor), all positive, all negative."""
    w = w.clone()
    w[0, :gs] = 0.5
    w[1, :gs] = 0
    w[2, :gs] = 1e-9
    w[3, :gs] = w[3, :gs].abs()
    w[4, :gs] = -w[4, :gs].abs()
    return w


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("gs", A.GROUP_SIZES)
@pytest.mark.parametrize("bits", A.BITS)
def test_quantize_and_dequantize_equal_mlx_bit_for_bit(rng_seed, bits, gs, dtype):
    g = torch.Generator().manual_seed(rng_seed)
    w = _edge_groups(_weight(g, 12, 2 * gs + 128, dtype=dtype), gs)
    q, s, b = A.affine_quantize(w, bits, gs)
    mq, ms, mb = mx.quantize(to_mx(w), group_size=gs, bits=bits)
    assert q.dtype == torch.uint32 and q.shape == (12, (2 * gs + 128) * bits // 32)
    assert s.dtype == dtype and b.dtype == dtype
    assert torch.equal(q.view(torch.int32), to_t(mq).view(torch.int32)), "codes differ from mx.quantize"
    assert torch.equal(s, to_t(ms)) and torch.equal(b, to_t(mb)), "scales or biases differ from mx.quantize"
    d = A.affine_dequantize(q, s, b, bits, gs)
    assert torch.equal(d, to_t(mx.dequantize(mq, ms, mb, group_size=gs, bits=bits))), "differs from mx.dequantize"
    assert torch.equal(A.affine_dequantize(q, s, b, bits, gs, torch.float32), d.float())


@pytest.mark.parametrize("bits", A.BITS)
def test_codes_roundtrip_and_stacks(rng_seed, bits):
    """pack/unpack are inverse; a 3-D expert stack quantises and dequantises as its experts one by one (and as MLX)."""
    g = torch.Generator().manual_seed(rng_seed)
    codes = torch.randint(0, 1 << bits, (3, 5, 96), generator=g, dtype=torch.uint8)
    assert torch.equal(A.unpack_codes(A.pack_codes(codes, bits), bits), codes)
    w = _weight(g, 3, 8, 64, dtype=torch.bfloat16)
    q, s, b = A.affine_quantize(w, bits, 32)
    mq, ms, mb = mx.quantize(to_mx(w), group_size=32, bits=bits)
    assert torch.equal(q.view(torch.int32), to_t(mq).view(torch.int32)) and torch.equal(s, to_t(ms))
    for e in range(3):
        qe, se, be = A.affine_quantize(w[e], bits, 32)
        assert torch.equal(qe.view(torch.int32), q[e].view(torch.int32)) and torch.equal(be, b[e])
    # int32 words hold the same bits as uint32 (how some loaders hand them over)
    assert torch.equal(A.affine_dequantize(q.view(torch.int32), s, b, bits, 32), A.affine_dequantize(q, s, b, bits, 32))


TOL32 = 1e-5


@pytest.mark.parametrize("gs", A.GROUP_SIZES)
@pytest.mark.parametrize("bits", A.BITS)
def test_gemv_reference_equals_mx_quantized_matmul(rng_seed, bits, gs):
    g = torch.Generator().manual_seed(rng_seed)
    n, k = 40, 3 * gs
    q, s, b = A.affine_quantize(_weight(g, n, k), bits, gs)
    for rows in (1, 3, 4, 7):
        x = torch.randn(rows, k, generator=g)
        got = A.affine_gemv(x, q, s, b, bits, gs)
        ref = to_t(
            mx.quantized_matmul(to_mx(x), to_mx(q), to_mx(s), to_mx(b), transpose=True, group_size=gs, bits=bits)
        )
        assert got.shape == (rows, n)
        assert max_relative_error(got, ref) <= TOL32, (rows, max_relative_error(got, ref))
    # leading dims are rows
    x3 = torch.randn(2, 1, k, generator=g)
    assert torch.equal(
        A.affine_gemv(x3, q, s, b, bits, gs), A.affine_gemv(x3.reshape(2, k), q, s, b, bits, gs).view(2, 1, n)
    )


@pytest.mark.parametrize("bits,gs", [(4, 64), (8, 32), (3, 128), (6, 64)])
def test_grouped_reference_equals_mx_gather_qmm(rng_seed, bits, gs):
    """Rows sorted by expert (E=6, experts 1 and 5 without rows), decode-sized (M <= E: gathered weights) and
    prefill-sized (M > E: torch._grouped_mm on the whole stack) against mx.gather_qmm; rows past the end zero."""
    g = torch.Generator().manual_seed(rng_seed)
    e, n, k = 6, 32, 2 * gs
    q, s, b = A.affine_quantize(_weight(g, e, n, k), bits, gs)
    for counts in ([1, 0, 2, 1, 1, 0], [3, 0, 4, 2, 5, 0]):
        m = sum(counts) + 2  # two rows past the last offset
        ends = torch.tensor(counts).cumsum(0).to(torch.int32)
        eid = torch.repeat_interleave(torch.arange(e), torch.tensor(counts))
        x = torch.randn(m, k, generator=g)
        got = A.affine_grouped_gemv(x, q, s, b, ends, bits, gs)
        ref = mx.gather_qmm(
            to_mx(x[: m - 2, None, :]),
            to_mx(q),
            to_mx(s),
            to_mx(b),
            rhs_indices=mx.array(eid.numpy().astype(np.uint32)),
            transpose=True,
            group_size=gs,
            bits=bits,
        )
        ref = to_t(ref)[:, 0]
        assert got.shape == (m, n)
        assert max_relative_error(got[: m - 2], ref) <= TOL32
        assert bool((got[m - 2 :] == 0).all())


def test_grouped_stride0_rows_and_both_branches_agree(rng_seed):
    g = torch.Generator().manual_seed(rng_seed)
    e, n, k, gs, bits = 3, 16, 64, 32, 4
    q, s, b = A.affine_quantize(_weight(g, e, n, k, dtype=torch.bfloat16), bits, gs)
    x = torch.randn(1, k, generator=g).to(torch.bfloat16).expand(8, k)
    ends = torch.tensor([3, 3, 7], dtype=torch.int32)
    y = A.affine_grouped_gemv(x, q, s, b, ends, bits, gs)  # M=8 > E=3: grouped_mm branch
    y2 = A.affine_grouped_gemv_reference(x[:3], q, s, b, torch.tensor([1, 1, 3], dtype=torch.int32), bits, gs)
    w = A.affine_dequantize(q, s, b, bits, gs, torch.float32)
    assert (
        max_relative_error(y[0], w[0] @ x[0].float()) <= 1e-2 and max_relative_error(y[4], w[2] @ x[0].float()) <= 1e-2
    )
    assert max_relative_error(y2[0], y[0]) <= 1e-2 and max_relative_error(y2[2], y[4]) <= 1e-2
    assert bool((y[7] == 0).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("bits", [4, 8, 5])
def test_embedding_equals_mx_dequantize_rows(rng_seed, bits, dtype):
    g = torch.Generator().manual_seed(rng_seed)
    q, s, b = A.affine_quantize(_weight(g, 50, 128, dtype=torch.bfloat16), bits, 64)
    ids = torch.tensor([[4, 49, 0], [4, 4, 17]])
    full = to_t(mx.dequantize(to_mx(q), to_mx(s), to_mx(b), group_size=64, bits=bits))
    got = A.affine_embedding(ids, q, s, b, bits, 64, dtype)
    assert got.shape == (2, 3, 128) and got.dtype == dtype
    assert torch.equal(got, full[ids].to(dtype))
    assert torch.equal(A.affine_embedding(ids.int(), q, s, b, bits, 64, dtype), got)


def test_gemv_out_writes_columns_of_a_wider_buffer(rng_seed):
    g = torch.Generator().manual_seed(rng_seed)
    q, s, b = A.affine_quantize(_weight(g, 24, 128), 4, 64)
    x = torch.randn(3, 128, generator=g)
    wide = torch.full((3, 40), 7.0)
    out = wide[:, 8:32]
    assert A.affine_gemv_out(x, q, s, b, 4, 64, out) is out
    assert torch.equal(out, A.affine_gemv(x, q, s, b, 4, 64))
    assert bool((wide[:, :8] == 7).all()) and bool((wide[:, 32:] == 7).all())


def _args(g):
    q, s, b = A.affine_quantize(_weight(g, 2, 16, 64, dtype=torch.bfloat16), 4, 32)
    x = torch.randn(3, 64, generator=g).to(torch.bfloat16)
    return x, q, s, b, torch.tensor([2, 3], dtype=torch.int32)


def test_opcheck_every_operator(rng_seed):
    g = torch.Generator().manual_seed(rng_seed)
    x, q, s, b, ends = _args(g)
    torch.library.opcheck(torch.ops.mpsboost.affine_gemv, (x[:2], q[0], s[0], b[0], 4, 32))
    torch.library.opcheck(torch.ops.mpsboost.affine_gemv_out, (x[:2], q[0], s[0], b[0], 4, 32, x.new_empty(2, 16)))
    torch.library.opcheck(torch.ops.mpsboost.affine_grouped_gemv, (x, q, s, b, ends, 4, 32))
    ids = torch.tensor([3, 0, 15])
    torch.library.opcheck(torch.ops.mpsboost.affine_embedding, (ids, q[0], s[0], b[0], 4, 32, torch.bfloat16))


def test_fullgraph_compile_equals_eager(rng_seed):
    g = torch.Generator().manual_seed(rng_seed)
    x, q, s, b, ends = _args(g)
    ids = torch.tensor([[3, 0, 15]])

    def step(x, ids):
        h = A.affine_embedding(ids, q[1], s[1], b[1], 4, 32, torch.bfloat16)[0]
        y = A.affine_gemv(x[:1] + h[:1, :64], q[0], s[0], b[0], 4, 32)
        buf = torch.zeros(3, 40, dtype=torch.bfloat16)
        A.affine_gemv_out(x, q[1], s[1], b[1], 4, 32, buf[:, 4:20])
        return y, A.affine_grouped_gemv(x, q, s, b, ends, 4, 32), buf

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for got, want in zip(compiled(x, ids), step(x, ids)):
        assert torch.equal(got, want)


def test_fakes_give_shapes_without_running():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(8, 100, 2048 * 4 // 32, dtype=torch.uint32)
        s = torch.empty(8, 100, 2048 // 64, dtype=torch.bfloat16)
        x = torch.empty(5, 2048, dtype=torch.bfloat16)
        assert A.affine_gemv(x[:2], q[0], s[0], s[0], 4, 64).shape == (2, 100)
        ends = torch.empty(8, dtype=torch.int32)
        assert A.affine_grouped_gemv(x, q, s, s, ends, 4, 64).shape == (5, 100)
        e = A.affine_embedding(torch.empty(1, 3, dtype=torch.int64), q[0], s[0], s[0], 4, 64, torch.float16)
        assert e.shape == (1, 3, 2048) and e.dtype == torch.float16


def test_bad_input_gets_a_clear_error(rng_seed):
    g = torch.Generator().manual_seed(rng_seed)
    x, q, s, b, ends = _args(g)
    cases = [
        (lambda: A.affine_gemv(x, q[0].float(), s[0], b[0], 4, 32), "codes in torch.float32"),
        (lambda: A.affine_gemv(x, q[0], s[0], b[0], 7, 32), "bits=7"),
        (lambda: A.affine_gemv(x, q[0], s[0], b[0], 4, 16), "group_size=16"),
        (lambda: A.affine_gemv(x, q[0], s[0], b[0], 8, 32), "expected both (16, 1)"),
        (lambda: A.affine_gemv(x, q[0], s[0, :, :1], b[0], 4, 32), "scales (16, 1)"),
        (lambda: A.affine_gemv(x, q[0], s[0], b[0].float(), 4, 32), "biases in torch.float32"),
        (lambda: A.affine_gemv(x[:, :32], q[0], s[0], b[0], 4, 32), "expected [..., 64]"),
        (lambda: A.affine_gemv(x.int(), q[0], s[0], b[0], 4, 32), "x in torch.int32"),
        (lambda: A.affine_gemv_out(x, q[0], s[0], b[0], 4, 32, x.new_empty(2, 16)), "out of shape (2, 16)"),
        (lambda: A.affine_gemv_out(x, q[0], s[0], b[0], 4, 32, x.new_empty(3, 16).float()), "out in torch.float32"),
        (lambda: A.affine_gemv_out(x, q[0], s[0], b[0], 4, 32, x.new_empty(16, 3).t()), "unit column stride"),
        (lambda: A.affine_grouped_gemv(x, q, s, b, ends.long(), 4, 32), "offsets torch.int64"),
        (lambda: A.affine_grouped_gemv(x, q, s, b, ends[:1], 4, 32), "expected int32 [2]"),
        (lambda: A.affine_grouped_gemv(x, q[0], s[0], b[0], ends, 4, 32), "expected 3 dims"),
        (
            lambda: A.affine_embedding(torch.tensor([1.0]), q[0], s[0], b[0], 4, 32, torch.float16),
            "ids in torch.float32",
        ),
        (lambda: A.affine_embedding(torch.tensor([1]), q[0], s[0], b[0], 4, 32, torch.int8), "dtype=torch.int8"),
        (lambda: A.affine_quantize(x[:, :48], 4, 32), "the last a multiple of 32"),
        (lambda: A.affine_quantize(x, 1, 32), "bits=1"),
    ]
    for fn, words in cases:
        with pytest.raises(UserInputError) as err:
            fn()
        assert words in str(err.value), (words, str(err.value))


def _exact(q, s, b, bits, gs):
    """The stored affine weight ``code * scale + bias`` in float64, exactly (no rounding in the scales' dtype)."""
    c = A.unpack_codes(q, bits).double()
    return c * s.double().repeat_interleave(gs, -1) + b.double().repeat_interleave(gs, -1)


def test_int4pack_conversion_numerics_on_cpu(rng_seed):
    """MLX 4-bit affine through torch's _weight_int4pack_mm_for_cpu: in float32 the conversion is exact (zero =
    bias + 8 scale representable), so the product is the stored weight's exact value (``code * scale + bias``) times
    x within float32 sums; a bf16 eye shows each decoded weight exactly."""
    g = torch.Generator().manual_seed(rng_seed)
    for gs in A.GROUP_SIZES:
        n, k = 48, 4 * gs
        q, s, b = A.affine_quantize(_weight(g, n, k, dtype=torch.bfloat16), 4, gs)
        packed, sz, inexact = A.to_int4pack(q, s, b, gs, dtype=torch.float32, device_type="cpu")
        assert inexact == 0 and sz.shape == (k // gs, n, 2)
        x = torch.randn(3, k, generator=g)
        ref = x.double() @ _exact(q, s, b, 4, gs).t()
        assert max_relative_error(A.int4pack_linear(x, packed, sz, gs), ref) <= TOL32
        eye = A.int4pack_linear(torch.eye(k), packed, sz, gs)
        assert torch.equal(eye.double().t(), _exact(q, s, b, 4, gs)), "a weight of the conversion is not exact"
        # in bfloat16 a zero may round (the function counts those), and the product stays within bf16's rounding
        packed, sz16, inexact16 = A.to_int4pack(q, s, b, gs, dtype=torch.bfloat16, device_type="cpu")
        zero = b.double() + 8 * s.double()
        assert inexact16 == int((zero.to(torch.bfloat16).double() != zero).sum())
        assert max_relative_error(A.int4pack_linear(x.bfloat16(), packed, sz16, gs), ref) <= 3e-2


def test_torch_packs_check_exactness_off_the_device_and_pack_where_the_kernel_reads(monkeypatch):
    """MPS has no float64: the packs' exactness checks run on the CPU, whatever device the codes are on; int4pack
    packs the codes where they are, and refuses codes on another device than the kernel it packs for."""
    g = torch.Generator().manual_seed(0)
    q, s, b = A.affine_quantize(_weight(g, 16, 64, dtype=torch.bfloat16), 4, 32)
    with pytest.raises(ValueError, match="the codes are on cpu"):
        A.to_int4pack(q, s, b, 32, dtype=torch.bfloat16, device_type="mps")
    real_to = torch.Tensor.to
    seen = []

    def to(self, *args, **kwargs):  # every float64 conversion must land on the CPU
        if torch.float64 in args or kwargs.get("dtype") is torch.float64:
            seen.append(args)
            assert "cpu" in args or torch.device("cpu") in args or self.device.type == "cpu"
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    A.to_int4pack(q, s, b, 32, dtype=torch.bfloat16, device_type="cpu")
    codes = torch.randint(0, 256, (16, 64), generator=g)
    s8 = torch.full((16, 2), 2.0**-8, dtype=torch.bfloat16)
    A.to_int8pack(A.pack_codes(codes, 8), s8, -128 * s8, 32, dtype=torch.bfloat16)
    assert all("cpu" in a for a in seen) and len(seen) >= 4


def test_int4pack_mps_byte_order_is_mlxs():
    """The bytes handed to MPS's _convert_weight_to_int4pack (even code in the high nibble) become, after its kernel's
    nibble swap (aten/src/ATen/native/mps/kernels/Quantized.metal weight_to_int4pack), MLX's own bytes, which its
    int4pack_mm reads low nibble first."""
    codes = torch.randint(0, 16, (8, 64), dtype=torch.uint8)
    q = A.pack_codes(codes, 4)
    by = (codes[:, 0::2] << 4) | codes[:, 1::2]
    swapped = ((by & 0xF) << 4) | (by >> 4)
    assert torch.equal(swapped, q.view(torch.uint8))


def test_int8pack_exact_where_representable_refused_otherwise(rng_seed):
    g = torch.Generator().manual_seed(rng_seed)
    n, k, gs = 16, 128, 32
    # one scale per row and bias = -128 scale: representable, the same numbers
    codes = torch.randint(0, 256, (n, k), generator=g)
    s = (torch.rand(n, 1, generator=g) + 0.1).expand(n, k // gs).contiguous()
    q = A.pack_codes(codes, 8)
    w8, sc = A.to_int8pack(q, s, -128 * s, gs, dtype=torch.float32)
    x = torch.randn(2, k, generator=g)
    ref = x.double() @ _exact(q, s, -128 * s, 8, gs).t()
    assert max_relative_error(A.int8pack_linear(x, w8, sc), ref) <= TOL32
    # an ordinary 8-bit checkpoint has a scale per group and a bias: refused, or requantised (lossy) on request
    q, s, b = A.affine_quantize(_weight(g, n, k), 8, gs)
    with pytest.raises(UserInputError, match="one scale per output channel"):
        A.to_int8pack(q, s, b, gs, dtype=torch.float32)
    w8, sc = A.to_int8pack(q, s, b, gs, dtype=torch.float32, exact=False)
    ref = x.double() @ _exact(q, s, b, 8, gs).t()
    assert max_relative_error(A.int8pack_linear(x, w8, sc), ref) <= 3e-2
