"""mpsboost.ops.fp8_metal: the exact Metal source, compiled as C++20 and run on the CPU.

No Mac here, so ``SOURCE`` (verbatim) is compiled by g++ against ``tests/ops/metal_emu/metal_stdlib``, a small
emulation of the Metal built-ins it uses (address-space qualifiers, vector types, ``half``, ``as_type`` and a real
32-lane ``simd_sum`` over concurrently running threads), and launched by ``tests/ops/metal_emu/driver.cpp``.
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

import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import torch

from mpsboost.ops import fp8_metal
from mpsboost.ops.fp8_grouped import grouped_mm_reference

EMU = Path(__file__).parent / "metal_emu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
DTYPES = list(TOL)
BASE_FLAGS = ["-std=c++20", "-O1", "-pthread", "-Wno-attributes", "-fno-strict-aliasing"]
SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all"]


def _compile(source: str, tmp: Path) -> Path:
    """SOURCE as ``kernels.metal``, included by the driver; with the sanitizers if they link, else without."""
    (tmp / "kernels.metal").write_text(source)
    exe = tmp / "driver"
    for extra in (SANITIZE, []):
        cmd = ["g++", *BASE_FLAGS, *extra, "-I", str(EMU), "-I", str(tmp), str(EMU / "driver.cpp"), "-o", str(exe)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode == 0:
            return exe
    pytest.fail(f"g++ could not compile fp8_metal.SOURCE against the Metal emulation:\n{proc.stderr[-6000:]}")


@pytest.fixture(scope="module")
def driver(tmp_path_factory) -> Path:
    if shutil.which("g++") is None:
        pytest.skip("g++ not found: the emulated Metal kernel test compiles SOURCE as C++20 with g++")
    return _compile(fp8_metal.SOURCE, tmp_path_factory.mktemp("fp8_metal_emu"))


def _extent(t: torch.Tensor) -> torch.Tensor:
    """The 1-D view of ``t``'s storage that a Metal buffer bound to ``t`` exposes to the kernel: from its first
    element to its last reachable one (a row stride of 0 or larger than a row, a column slice)."""
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) if t.numel() else 0
    return t.as_strided((extent,), (1,), t.storage_offset())


class _Library:
    """Stands in for ``torch.mps.compile_shader(SOURCE)``: a kernel call runs the emulation on what it is given,
    buffers (every tensor argument, from its first element to its last reachable one) then int scalars, as
    torch binds them (``constant long&``); argument 4 is the output ``y``, set to NaN first and read back."""

    def __init__(self, exe: Path, tmp: Path):
        self.exe, self.tmp, self.calls = exe, tmp, 0

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
            if y.dim() == 2:  # a fresh output: an element the kernel never writes stays NaN (a strided ``out`` comes
                y.fill_(float("nan"))  # as its 1-D extent, columns of others included: the test fills its own)
            bufs = [_extent(t).contiguous().view(torch.uint8).numpy().tobytes() for t in tensors]
            head = b"MPSBEMU2" + name.encode().ljust(64, b"\0")
            counts = (nbuf, len(scalars), *map(len, bufs), *scalars)
            head += struct.pack(f"<{4 + len(counts)}q", *threads, *group_size, *counts)
            src, dst = self.tmp / f"in{self.calls}.bin", self.tmp / f"out{self.calls}.bin"
            src.write_bytes(head + b"".join(bufs))
            proc = subprocess.run([str(self.exe), str(src), str(dst)], capture_output=True, text=True, timeout=120)
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


def test_self_check_passes_on_the_source_and_fails_on_a_broken_one(emulated, tmp_path, monkeypatch):
    # The gate's patch-time probe on a Mac (fp8_metal.self_check) run through the emulation: it accepts the
    # source, and it refuses one that flushes subnormal codes to zero (as a fast-math build could), which its random
    # cases alone could miss.
    assert fp8_metal.self_check("cpu") is None
    head = "inline float mpsb_fp8(uint b) {\n"
    broken = fp8_metal.SOURCE.replace(head, head + "  if ((b & 0x78u) == 0) { return 0.0f; }\n")
    assert broken != fp8_metal.SOURCE
    lib = _Library(_compile(broken, tmp_path), tmp_path)
    monkeypatch.setattr(fp8_metal, "_library", lambda: lib)
    why = fp8_metal.self_check("cpu")
    assert why is not None and "decodes" in why and "codes wrongly" in why, why
