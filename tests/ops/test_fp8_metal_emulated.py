"""mpsboost.ops.fp8_metal: the exact Metal source, compiled as C++20 and run on the CPU.

No Mac here, so ``SOURCE`` (verbatim) is compiled by g++ against ``tests/ops/metal_emu/metal_stdlib``, a small
emulation of the Metal built-ins it uses (address-space qualifiers, vector types, ``half``, ``as_type`` and a real
32-lane ``simd_sum`` over the threadgroup's threads, each its own fiber), and launched by
``tests/ops/metal_emu/driver.cpp``.
The launch itself is :func:`mpsboost.ops.fp8_metal.rows_gemv`'s: a fake of the compiled library takes the
arguments it passes (buffers, int64 scalars, ``threads=`` and ``group_size=``) and runs the driver on exactly
those, every threadgroup of the grid, so the argument order, the row stride, the scale strides and the grid are
the ones a Mac would get. Results are compared with :func:`mpsboost.ops.fp8_grouped.grouped_mm_reference`
(only the accumulation order differs) and the fp8 decode with torch's own for every finite code.

The driver is built with AddressSanitizer and UndefinedBehaviorSanitizer where the toolchain has them (each
buffer is its own allocation of exactly its size, so a read past a buffer fails, as does a misaligned 16-byte
load); outputs start as NaN, so one the kernel never writes fails too.
"""

from __future__ import annotations

import os
import struct
import subprocess
from pathlib import Path

import metal_emulation
import pytest
import torch

from mpsboost.ops import fp8_metal
from mpsboost.ops.fp8_grouped import grouped_mm_reference

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
DTYPES = list(TOL)


@pytest.fixture(scope="module")
def driver(tmp_path_factory) -> Path:
    return metal_emulation.driver(fp8_metal.SOURCE, (), tmp_path_factory, what="fp8_metal.SOURCE", table=False)


def _extent(t: torch.Tensor) -> torch.Tensor:
    """The 1-D view of ``t``'s storage that a Metal buffer bound to ``t`` exposes to the kernel: from its first
    element to its last reachable one (a row stride of 0 or larger than a row, a column slice)."""
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) if t.numel() else 0
    return t.as_strided((extent,), (1,), t.storage_offset())


class _Library:
    """Stands in for ``torch.mps.compile_shader(SOURCE)``: a kernel call runs the emulation on what it is given,
    buffers (every tensor argument, from its first element to its last reachable one) then int scalars, as
    torch binds them (``constant long&``); argument 4 is the output ``y``, set to NaN first when it is the whole
    output (``R * N`` elements; a strided ``out`` comes as its 1-D extent, other columns included: the test fills its
    own) and read back. ``launches`` records each call (name, scalars, grid, bytes of its buffers); ``tamper``, when
    set, rewrites the arguments first (a launch-side mutant); ``env`` goes to the driver (``MPSB_MUTANT``)."""

    def __init__(self, exe: Path, tmp: Path, env: dict | None = None):
        self.exe, self.tmp, self.calls, self.env = exe, tmp, 0, env
        self.launches: list[dict] = []
        self.tamper = None

    def __getattr__(self, name: str):
        if not name.startswith("mpsb_fp8_rows_"):
            raise AttributeError(name)

        def launch(*args, threads, group_size):
            nbuf = next(i for i, a in enumerate(args) if not isinstance(a, torch.Tensor))
            tensors, scalars = args[:nbuf], args[nbuf:]
            assert nbuf == 5 and all(type(a) is int for a in scalars), args  # (x, w, scale, offs, y), ints
            x, w, scale, offs, y = tensors
            assert w.dtype == torch.uint8 and w.is_contiguous() and scale.dtype == torch.float32
            assert y.dtype == x.dtype and y.stride(-1) == 1 and len(threads) == 2 and len(group_size) == 2
            self.calls += 1
            if y.numel() == scalars[0] * scalars[1]:  # the whole output: an element the kernel never writes stays NaN
                y.fill_(float("nan"))
            if self.tamper is not None:
                tensors, scalars, threads = self.tamper(tensors, list(scalars), tuple(threads))
            bufs = [_extent(t).contiguous().view(torch.uint8).numpy().tobytes() for t in tensors]
            self.launches.append(
                {"name": name, "scalars": tuple(scalars), "threads": tuple(threads), "bytes": sum(map(len, bufs))}
            )
            head = b"MPSBEMU2" + name.encode().ljust(64, b"\0")
            counts = (nbuf, len(scalars), *map(len, bufs), *scalars)
            head += struct.pack(f"<{4 + len(counts)}q", *threads, *group_size, *counts)
            src, dst = self.tmp / f"in{self.calls}.bin", self.tmp / f"out{self.calls}.bin"
            src.write_bytes(head + b"".join(bufs))
            env = None if self.env is None else {**os.environ, **self.env}
            proc = subprocess.run(
                [str(self.exe), str(src), str(dst)], capture_output=True, text=True, timeout=120, env=env
            )
            assert proc.returncode == 0, f"emulated {name} failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
            out = dst.read_bytes()
            assert len(out) == sum(map(len, bufs))
            at = sum(map(len, bufs[:4]))
            written = torch.frombuffer(bytearray(out[at : at + len(bufs[4])]), dtype=torch.uint8)
            _extent(y).view(torch.uint8).copy_(written)

        return launch


@pytest.fixture
def emulated(driver, tmp_path, monkeypatch):
    """:func:`fp8_metal.rows_gemv` running the compiled SOURCE on the CPU."""
    lib = _Library(driver, tmp_path)
    monkeypatch.setattr(fp8_metal, "_library", lambda: lib)
    return lib


def _codes(g: torch.Generator, *shape: int) -> torch.Tensor:
    c = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    c[(c & 0x7F) == 0x7F] = 0  # NaN codes removed
    return c.view(torch.float8_e4m3fn)


def _run(x, codes, scale, offs, bn, bk, dense):
    """rows_gemv (emulated) and the reference; codes [E, N, K], scale [E, sn, sk]."""
    assert fp8_metal.supported(x, codes, bk=bk) is None
    if dense:
        got = fp8_metal.rows_gemv(x, codes[0], scale[0], None, bn=bn, bk=bk)
        offs = torch.tensor([x.shape[0]], dtype=torch.int32)
    else:
        got = fp8_metal.rows_gemv(x, codes, scale, offs, bn=bn, bk=bk)
    ref = grouped_mm_reference(x, codes, offs, scale, bn, bk)
    assert got.dtype == x.dtype and got.shape == ref.shape
    assert not got.isnan().any(), "an output the kernel never wrote (or a NaN)"
    return got, ref


def _close(got, ref, dtype):
    err = float((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6))
    assert err <= TOL[dtype], f"relative max error {err:.3e} > {TOL[dtype]:.0e}"


# R, N, K, (bn, bk) with None meaning K (rowwise / tensorwise)
DENSE = [
    pytest.param(1, 40, 48, (1, None), id="R1-N40-K48-rowwise"),
    pytest.param(2, 24, 64, (24, None), id="R2-N24-K64-tensorwise"),
    pytest.param(3, 36, 64, (1, None), id="R3-N36-K64-rowwise"),
    pytest.param(4, 40, 560, (1, None), id="R4-N40-K560-rowwise"),
    pytest.param(5, 36, 560, (36, None), id="R5-N36-K560-tensorwise"),
    pytest.param(5, 40, 48, (16, 16), id="R5-N40-K48-block16"),
    pytest.param(3, 36, 560, (16, 16), id="R3-N36-K560-block16"),
    pytest.param(4, 40, 560, (32, 32), id="R4-N40-K560-block32"),
    pytest.param(2, 24, 80, (32, 32), id="R2-N24-K80-block32"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("r,n,k,blocks", DENSE)
def test_dense_matches_reference(emulated, rng_seed, dtype, r, n, k, blocks):
    g = torch.Generator().manual_seed(rng_seed)
    bn, bk = blocks[0], blocks[1] or k
    codes = _codes(g, 1, n, k)
    scale = torch.rand(1, -(-n // bn), -(-k // bk), generator=g) + 0.5
    x = torch.randn(r, k, generator=g).to(dtype)
    got, ref = _run(x, codes, scale, None, bn, bk, dense=True)
    _close(got, ref, dtype)
    assert emulated.calls == 1


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_dense_strided_rows(emulated, rng_seed, dtype):
    """x a column slice of a wider tensor: row stride K + 32, storage offset 16."""
    g = torch.Generator().manual_seed(rng_seed)
    r, n, k = 6, 24, 64
    wide = torch.randn(r, k + 32, generator=g).to(dtype)
    x = wide[:, 16 : 16 + k]
    assert x.stride(0) == k + 32
    codes = _codes(g, 1, n, k)
    scale = torch.rand(1, n, 1, generator=g) + 0.5
    got, ref = _run(x, codes, scale, None, 1, k, dense=True)
    _close(got, ref, dtype)


@pytest.mark.parametrize("r", [1, 5])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_out_with_row_stride(emulated, rng_seed, dtype, r):
    """``out=`` a column slice of a wider buffer (row stride N + 24): written in place, the other columns kept."""
    g = torch.Generator().manual_seed(rng_seed)
    n, k = 36, 64
    codes = _codes(g, 1, n, k)
    scale = torch.rand(1, n, 1, generator=g) + 0.5
    x = torch.randn(r, k, generator=g).to(dtype)
    wide = torch.full((r, n + 24), 7.0, dtype=dtype)
    out = wide[:, 8 : 8 + n]
    y = fp8_metal.rows_gemv(x, codes[0], scale[0], None, bn=1, bk=k, out=out)
    assert y is out
    ref = grouped_mm_reference(x, codes, torch.tensor([r], dtype=torch.int32), scale, 1, k)
    _close(out, ref, dtype)
    assert bool((wide[:, :8] == 7).all()) and bool((wide[:, 8 + n :] == 7).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_grouped_empty_expert_and_rows_past_last_offset(emulated, rng_seed, dtype):
    """E=4, offs [2, 2, 5, 6], R=7: expert 1 has no rows; row 6 is past the last offset and must be exactly 0."""
    g = torch.Generator().manual_seed(rng_seed)
    r, n, k, e = 7, 36, 560, 4
    codes = _codes(g, e, n, k)
    scale = torch.rand(e, n, 1, generator=g) + 0.5  # rowwise per expert
    x = torch.randn(r, k, generator=g).to(dtype)
    offs = torch.tensor([2, 2, 5, 6], dtype=torch.int32)
    got, ref = _run(x, codes, scale, offs, 1, k, dense=False)
    _close(got, ref, dtype)
    assert bool((got[6] == 0).all())
    assert bool((got[:6].float().abs().amax(dim=1) > 0).all())
    # each row used its own expert: expert 2's rows against a dense product with expert 2 alone
    dense = grouped_mm_reference(x[2:5], codes[2:3], torch.tensor([3], dtype=torch.int32), scale[2:3], 1, k)
    _close(got[2:5], dense, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_grouped_shared_row_stride0_blocks(emulated, rng_seed, dtype):
    """E=3, one x row expanded to R=9 rows (stride 0), 16x32 scale blocks, N and K not multiples of them."""
    g = torch.Generator().manual_seed(rng_seed)
    r, n, k, e, bn, bk = 9, 40, 80, 3, 16, 32
    codes = _codes(g, e, n, k)
    scale = torch.rand(e, -(-n // bn), -(-k // bk), generator=g) + 0.5
    x = torch.randn(1, k, generator=g).to(dtype).expand(r, k)
    assert x.stride(0) == 0
    offs = torch.tensor([3, 3, 8], dtype=torch.int32)
    got, ref = _run(x, codes, scale, offs, bn, bk, dense=False)
    _close(got, ref, dtype)
    assert bool((got[8] == 0).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_grouped_per_expert_scale(emulated, rng_seed, dtype):
    """E=4 with one scale per expert (bn=N, bk=K), every row in range, two row groups of 4."""
    g = torch.Generator().manual_seed(rng_seed)
    r, n, k, e = 8, 24, 48, 4
    codes = _codes(g, e, n, k)
    scale = torch.rand(e, 1, 1, generator=g) * 4 + 0.1
    x = torch.randn(r, k, generator=g).to(dtype)
    offs = torch.tensor([1, 4, 4, 8], dtype=torch.int32)
    got, ref = _run(x, codes, scale, offs, n, k, dense=False)
    _close(got, ref, dtype)


# scales that make exact ties when code * scale is rounded to the dtype, so rounding must be to even:
# bf16 (7 fraction bits) 1 + 2^-8 and fp16 (10) 1 + 2^-11, ties for the codes of mantissa 000; fp32 (the product
# itself, 23 bits) 1 + 2^-23, ties for mantissa 100
TIE = {torch.float32: 1 + 2.0**-23, torch.float16: 1 + 2.0**-11, torch.bfloat16: 1 + 2.0**-8}


@pytest.mark.parametrize("tie", [False, True], ids=["scale1", "scale-tie"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_fp8_decode_is_exact(emulated, dtype, tie):
    """Every finite e4m3fn code through the kernel: codes [16, 16] = 0..255, x = the 16x16 identity, one scale,
    so y[r, n] is code 16 n + r decoded, times the scale, rounded to the dtype: bit for bit torch's
    ``(code.float() * scale).to(dtype)`` (scale 1: the decode itself, exact in each dtype)."""
    allc = torch.arange(256, dtype=torch.uint8)
    nan = (allc & 0x7F) == 0x7F
    codes = torch.where(nan, torch.zeros_like(allc), allc).view(1, 16, 16).view(torch.float8_e4m3fn)
    s = TIE[dtype] if tie else 1.0
    x = torch.eye(16, dtype=dtype)
    y = fp8_metal.rows_gemv(x, codes[0], torch.full((1, 1), s), None, bn=16, bk=16)
    got = y.T.reshape(256)  # got[16 n + r] = y[r, n]
    want = (allc.view(torch.float8_e4m3fn).float() * torch.tensor(s, dtype=torch.float32)).to(dtype)
    assert int((~nan).sum()) == 254
    if tie:  # some exact products (float64 holds them) are midway between two neighbours in the dtype
        exact = allc.view(torch.float8_e4m3fn).double() * s
        other = 2 * exact - want.double()  # the neighbour on the other side, if exact is midway
        ties = (other != want.double()) & (other.to(dtype).double() == other) & ~nan
        assert int(ties.sum()) >= 8, int(ties.sum())
    bad = (got != want) & ~nan
    assert not bad.any(), f"codes {allc[bad].tolist()[:8]}: got {got[bad].tolist()[:8]}, want {want[bad].tolist()[:8]}"
    assert emulated.calls == 1


# ------------------------------------------------------------------------------------------ NaN codes (item 5)


def _with_nan_codes(
    g: torch.Generator, e: int, n: int, k: int, experts: tuple[int, ...] | None = None
) -> tuple[torch.Tensor, list]:
    """Codes [e, n, k] with no NaN code, then 0x7F and 0xFF at a few random places (expert among ``experts``, all by
    default; feature; k)."""
    c = _codes(g, e, n, k).view(torch.uint8).clone()
    experts = tuple(range(e)) if experts is None else experts
    where = []
    for i in range(4):
        ex = experts[int(torch.randint(0, len(experts), (1,), generator=g))]
        at = (ex, int(torch.randint(0, n, (1,), generator=g)))
        kk = int(torch.randint(0, k, (1,), generator=g))
        c[at[0], at[1], kk] = 0x7F if i % 2 else 0xFF
        where.append((*at, kk))
    return c.view(torch.float8_e4m3fn), where


def _same_nans_and_close(got, ref, dtype):
    assert torch.equal(got.isnan(), ref.isnan()), (got.isnan().nonzero().tolist(), ref.isnan().nonzero().tolist())
    fin = ~ref.isnan()
    assert bool(fin.any()) and bool((~fin).any())
    _close(got[fin], ref[fin], dtype)


@pytest.mark.parametrize("mode", ["dense", "grouped", "block"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_nan_codes_give_nan(emulated, rng_seed, dtype, mode):
    """e4m3fn 0x7F and 0xFF are NaN: the kernel's outputs that read one are NaN, as ``dequantize`` then a matmul gives
    (the operators' MPS kernels run the emulated launch; their CPU reference is the expectation). Before the fix the
    kernel decoded them as +-480 x scale."""
    from mpsboost.ops import fp8 as fp8_ops
    from mpsboost.ops import fp8_grouped

    g = torch.Generator().manual_seed(rng_seed)
    r, n, k = 3, 36, 560
    x = (torch.rand(r, k, generator=g) + 0.5).to(dtype)  # no zero activation: NaN * x is NaN for any BLAS
    if mode == "dense":
        codes, where = _with_nan_codes(g, 1, n, k)
        scale = torch.rand(n, 1, generator=g) + 0.5
        got = fp8_ops._fp8_gemv_mps(x, codes[0], scale, None)
        ref = fp8_ops.fp8_gemv_reference(x, codes[0], scale, None)
        assert ref[:, [f for _, f, _ in where]].isnan().all()
    elif mode == "block":
        codes, where = _with_nan_codes(g, 1, n, k)
        scale = torch.rand(-(-n // 16), -(-k // 32), generator=g) + 0.5
        got = fp8_grouped._block_gemv_mps(x, codes[0], scale, 16, 32)
        ref = fp8_grouped._block_gemv_reference(x, codes[0], scale, 16, 32)
    else:
        e = 4
        # on experts with rows (not expert 1): four NaN codes all on expert 1 would reach no output (seed 1365527213)
        codes, where = _with_nan_codes(g, e, n, k, experts=(0, 2, 3))
        codes.view(torch.uint8)[1, 3, 17] = 0x7F  # expert 1 has no rows: its NaN code must reach no output
        offs = torch.tensor([1, 1, 2, 3], dtype=torch.int32)
        scale = torch.rand(e, n, 1, generator=g) + 0.5
        got = fp8_grouped._grouped_mm_mps(x, codes, offs, scale, 1, k)
        ref = grouped_mm_reference(x, codes, offs, scale, 1, k)
    assert emulated.calls == 1  # the Metal kernel ran, not the operator's reference
    _same_nans_and_close(got, ref, dtype)


# ------------------------------------------------------------------------------------------ launch checks (item 7)


def test_an_out_with_too_few_rows_is_refused_before_the_launch(emulated):
    """A short ``out`` would be written past its end by the kernel (the CPU operator refuses it): every MPS entry
    raises ValueError and launches nothing; ``out=`` of the right size is written."""
    from mpsboost.ops import fp8 as fp8_ops
    from mpsboost.ops import fp8_grouped

    g = torch.Generator().manual_seed(0)
    r, n, k = 3, 36, 64
    x = torch.randn(r, k, generator=g).to(torch.bfloat16)
    codes = _codes(g, 1, n, k)[0]
    scale = torch.rand(n, 1, generator=g) + 0.5
    bscale = torch.rand(-(-n // 16), -(-k // 32), generator=g) + 0.5
    for short in (torch.empty(r - 1, n, dtype=x.dtype), torch.empty(1, r - 1, n, dtype=x.dtype)):
        with pytest.raises(ValueError, match=r"out \[.*\] has \d+ elements; x \[3, 64\] times 36 outputs"):
            fp8_ops._fp8_gemv_out_mps(x, codes, scale, short)
        with pytest.raises(ValueError, match="fp8_block_gemv_out: out"):
            fp8_grouped._block_gemv_out_mps(x, codes, bscale, 16, 32, short)
        with pytest.raises(ValueError, match=r"fp8 Metal GEMV: out \[.*\] with strides .* for a \[3, 36\] product"):
            fp8_metal.dense(x, codes, scale, 1, k, out=short)
        with pytest.raises(ValueError, match="for a \\[3, 36\\] product"):
            fp8_metal.rows_gemv(x, codes, scale, None, bn=1, bk=k, out=short)
    assert emulated.calls == 0
    out = torch.empty(r, n, dtype=x.dtype)
    fp8_ops._fp8_gemv_out_mps(x, codes, scale, out)
    torch.testing.assert_close(out, fp8_ops.fp8_gemv_reference(x, codes, scale, None), rtol=1e-2, atol=1e-2)
    assert emulated.calls == 1


def test_out_layouts_the_kernel_cannot_take_are_refused_at_the_launch_and_copied_by_the_operators(emulated):
    """rows_gemv (the launch) raises for an ``out`` in another dtype (TypeError), with overlapping rows, a column
    stride or on another device; the operators' MPS kernels take those through their reference (a copy), as the CPU
    operator does, and launch nothing."""
    from mpsboost.ops import fp8 as fp8_ops

    g = torch.Generator().manual_seed(1)
    r, n, k = 3, 36, 64
    x = torch.randn(r, k, generator=g).to(torch.bfloat16)
    codes = _codes(g, 1, n, k)[0]
    scale = torch.rand(n, 1, generator=g) + 0.5
    want = fp8_ops.fp8_gemv_reference(x, codes, scale, None)
    with pytest.raises(TypeError, match="out in torch.float32; the product is torch.bfloat16"):
        fp8_metal.rows_gemv(x, codes, scale, None, bn=1, bk=k, out=torch.empty(r, n))
    overlapping = torch.empty(r * n, dtype=x.dtype).as_strided((r, n), (n // 2, 1))
    column_strided = torch.empty(n, r, dtype=x.dtype).t()
    for bad in (overlapping, column_strided):
        with pytest.raises(ValueError, match="expected \\[3, 36\\] with unit column stride and rows at least 36"):
            fp8_metal.rows_gemv(x, codes, scale, None, bn=1, bk=k, out=bad)
        assert fp8_metal.dense(x, codes, scale, 1, k, out=bad) is None
    assert emulated.calls == 0
    for out in (torch.empty(r, n), column_strided):
        fp8_ops._fp8_gemv_out_mps(x, codes, scale, out)
        torch.testing.assert_close(out, want.to(out.dtype), rtol=0, atol=0)
    assert emulated.calls == 0


def test_scale_and_offs_are_checked_at_the_launch_and_grouped_mm_takes_any_float_scale(emulated, rng_seed):
    """The kernel reads float32 scales of exactly [E, ceil(N/bn), ceil(K/bk)] and int32 offs [E]: anything else raises
    at the launch (a bf16 scale read as float32 bits, a short scale read past its end). ``mpsboost::grouped_mm``'s
    MPS kernel converts a bf16 or fp16 scale first (before the fix it passed it as it was) and matches the
    reference, which takes any float scale."""
    from mpsboost.ops import fp8_grouped

    g = torch.Generator().manual_seed(rng_seed)
    r, n, k, e = 5, 36, 64, 3
    x = torch.randn(r, k, generator=g).to(torch.bfloat16)
    codes = _codes(g, e, n, k)
    offs = torch.tensor([2, 2, 5], dtype=torch.int32)
    scale = torch.rand(e, n, 1, generator=g) + 0.5
    with pytest.raises(TypeError, match="scale in torch.bfloat16; the kernel reads float32"):
        fp8_metal.rows_gemv(x, codes, scale.bfloat16(), offs, bn=1, bk=k)
    for bad in (scale[:, :-1], scale[:2], torch.rand(e, n, 2)[:, :, :1]):
        with pytest.raises(ValueError, match="fp8 Metal GEMV: scale .* expected contiguous \\[3, 36, 1\\]"):
            fp8_metal.rows_gemv(x, codes, bad, offs, bn=1, bk=k)
    for bad in (offs[:2], offs.long(), torch.tensor([2, 2, 2, 5, 5, 5], dtype=torch.int32)[::2]):
        with pytest.raises(ValueError, match="offs .* expected contiguous int32 \\[3\\]"):
            fp8_metal.rows_gemv(x, codes, scale, bad, bn=1, bk=k)
    with pytest.raises(ValueError, match="expected \\[E, N, K\\] with offs, K = 64"):
        fp8_metal.rows_gemv(x, codes[0], scale, offs, bn=1, bk=k)
    assert emulated.calls == 0
    for sdt in (torch.bfloat16, torch.float16):
        got = fp8_grouped._grouped_mm_mps(x, codes, offs, scale.to(sdt), 1, k)
        _close(got, grouped_mm_reference(x, codes, offs, scale.to(sdt), 1, k), torch.bfloat16)
    assert emulated.calls == 2


# ------------------------------------------------------------------------------------------ the self-check (item 6)


def test_self_check_passes_and_runs_every_branch_it_names_within_its_budget(emulated):
    """fp8_metal.self_check, the patch-time probe on a Mac, through the emulation: it accepts the source, and the
    launches it makes are those its docstring names, in each activation dtype. Its cost is bounded by what it
    launches, not by a clock: at most 32 launches (one read back each) and under 1 MiB bound to the kernel in all."""
    assert fp8_metal.self_check("cpu") is None
    launches = emulated.launches
    assert len(launches) <= 32 and sum(x["bytes"] for x in launches) < 1 << 20, (len(launches), launches)
    for name in fp8_metal.KERNELS.values():
        seen = [x["scalars"] for x in launches if x["name"] == name]
        rows = {s[0] for s in seen}
        assert {1, 2, 3, 4} <= rows and any(r > 4 and r % 4 for r in rows), rows  # 1-4 rows; partial row groups
        assert {2, 4, 5, 6} <= {s[1] % 8 for s in seen}  # partial feature groups, a simdgroup with none
        assert any(s[2] > 512 and s[2] % 512 for s in seen)  # a second, partial step of the lanes
        dense = [s for s in seen if s[3] == 0]
        assert any(s[5] == 1 and s[6] == s[2] for s in dense)  # rowwise
        assert any(s[5] == s[1] and s[6] == s[2] and s[0] > 1 for s in dense)  # tensorwise
        assert any(s[5] == s[6] == 128 and s[1] % 128 and s[2] % 128 for s in dense)  # 128x128, partial edges
        assert any(s[3] > 0 and (s[5], s[6]) == (16, 32) for s in seen)  # 16x32 blocks, grouped
        assert any(s[3] > 0 and s[4] == 0 and s[0] > 1 for s in seen)  # one row of stride 0 for every row
        assert any(s[0] > 1 and s[9] > s[1] for s in seen)  # out= with a row stride wider than N
        assert len([s for s in seen if s[0] == s[2] == 16 and s[3] == 0]) == 2  # exact decode at 2 scales


# A source whose branches can be broken one at a time at run time (MPSB_MUTANT=i; 0: the source as it is), so that
# one compile serves every mutant. Each breaks one branch the self-check names and nothing else.
_MUTANT_HEAD = (
    "#include <cstdlib>\n"
    "static int mpsb_mutant() {\n"
    '  static const int m = [] { const char* v = std::getenv("MPSB_MUTANT"); return v ? std::atoi(v) : 0; }();\n'
    "  return m;\n"
    "}\n"
)
KERNEL_MUTANTS = {  # name: (number, old text, new text, what the self-check's answer names)
    "nan-codes-read-as-480": (
        1,
        "seed = mpsb_nan_seed(c.x, c.y, c.z, c.w);",
        "seed = mpsb_mutant() == 1 ? 0.0f : mpsb_nan_seed(c.x, c.y, c.z, c.w);",
        "decodes e4m3fn codes wrongly (torch.float32, scale 1.0): NaN",
    ),
    "subnormal-codes-flushed": (
        2,
        "inline float mpsb_fp8(uint b) {\n",
        "inline float mpsb_fp8(uint b) {\n  if (mpsb_mutant() == 2 && (b & 0x78u) == 0) { return 0.0f; }\n",
        "decodes e4m3fn codes wrongly (torch.float32, scale 1.0)",
    ),
    "bf16-output-truncated": (
        3,
        "inline ushort mpsb_bf16_store(float v) {\n",
        "inline ushort mpsb_bf16_store(float v) {\n"
        "  if (mpsb_mutant() == 3) { return ushort(as_type<uint>(v) >> 16); }\n",
        "decodes e4m3fn codes wrongly (torch.bfloat16, scale 1.00390625)",
    ),
    "fp16-weights-rounded-to-bf16": (
        4,
        "inline float mpsb_half(float v) { return float(half(v)); }",
        "inline float mpsb_half(float v) { return mpsb_mutant() == 4 ? mpsb_bf16(v) : float(half(v)); }",
        "decodes e4m3fn codes wrongly (torch.float16, scale 1.00048828125)",
    ),
    "partial-simdgroup-skipped": (
        5,
        "      if (n >= N) {\n        break;",
        "      if (n >= N || (mpsb_mutant() == 5 && n0 + MPSB_NPS > N)) {\n        break;",
        "decodes e4m3fn codes wrongly (torch.float32, scale 1.0)",  # N = 18 there: features 16 and 17
    ),
    "partial-row-group-not-stored": (
        6,
        "if (lane == 0 && n < N && r < R) {",
        "if (lane == 0 && n < N && r < R && !(mpsb_mutant() == 6 && r0 + MPSB_ROWS > R)) {",
        "(torch.float32, R=1, N=45",
    ),
    "rows-past-the-last-offset-read-the-last-expert": (
        7,
        "return lo < groups ? lo : -1;",
        "return lo < groups ? lo : (mpsb_mutant() == 7 ? groups - 1 : -1);",
        "experts=4",
    ),
    "shared-row-read-once": (
        8,
        "        float d = seed;\n",
        "        float d = seed;\n"
        "        if (mpsb_mutant() == 8 && xs == 0 && r0 + i > 0) {\n          continue;\n        }\n",
        "x shared",
    ),
    "block-of-the-steps-first-lane": (
        9,
        "const uint kb = uint(k) / uint(bk);",
        "const uint kb = uint(mpsb_mutant() == 9 ? k - long(lane) * 16 : k) / uint(bk);",
        "blocks=(128, 128)",
    ),
}


def _tamper_out_stride(tensors, scalars, threads):  # the launch ignores out's row stride
    scalars[9] = scalars[1]
    return tensors, scalars, threads


def _tamper_3d_rows(tensors, scalars, threads):  # the launch takes a 3-dim x's first dim as its rows
    if tensors[0].dim() > 2:
        scalars[0] = tensors[0].shape[0]
    return tensors, scalars, threads


def _tamper_grid(tensors, scalars, threads):  # the grid rounds the feature groups down: a partial one never runs
    return tensors, scalars, ((scalars[1] // fp8_metal.FEATURES_PER_GROUP) * fp8_metal.THREADS, threads[1])


LAUNCH_MUTANTS = {
    "out-row-stride-ignored": (_tamper_out_stride, "out strided"),
    "3-dim-x-rows-from-its-first-dim": (_tamper_3d_rows, "x 3d"),
    "partial-feature-group-not-launched": (_tamper_grid, "decodes e4m3fn codes wrongly (torch.float32, scale 1.0)"),
}


@pytest.fixture(scope="module")
def mutant_driver(tmp_path_factory) -> Path:
    src = fp8_metal.SOURCE
    for _, old, new, _ in KERNEL_MUTANTS.values():
        assert old in src, old
        src = src.replace(old, new)
    what = "fp8_metal.SOURCE with its mutants"
    return metal_emulation.driver(_MUTANT_HEAD + src, (), tmp_path_factory, what=what, sanitize=False, table=False)


@pytest.mark.parametrize("mutant", [*KERNEL_MUTANTS, *LAUNCH_MUTANTS])
def test_self_check_refuses_a_kernel_broken_in_one_branch(mutant_driver, tmp_path, monkeypatch, mutant):
    """Each branch the self-check names, broken alone (in the kernel, or in the launch's arguments), is refused, by
    the case that runs that branch: the answer names it (with no mutant chosen the source is unchanged; were it not,
    every mutant would be refused by the first case, not by its own)."""
    if mutant in KERNEL_MUTANTS:
        number, _, _, names = KERNEL_MUTANTS[mutant]
        lib = _Library(mutant_driver, tmp_path, env={"MPSB_MUTANT": str(number)})
    else:
        tamper, names = LAUNCH_MUTANTS[mutant]
        lib = _Library(mutant_driver, tmp_path, env={"MPSB_MUTANT": "0"})
        lib.tamper = tamper
    monkeypatch.setattr(fp8_metal, "_library", lambda: lib)
    why = fp8_metal.self_check("cpu")
    assert why is not None and names in why, why
