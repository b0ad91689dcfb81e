"""mpsboost.ops.affine_metal: the exact Metal source, compiled as C++20 and run on the CPU.

As tests/ops/test_fp8_metal_emulated.py does for the fp8 kernel: ``SOURCE`` (verbatim) is compiled by g++ against
``tests/ops/metal_emu/metal_stdlib`` and launched by ``tests/ops/metal_emu/driver.cpp`` (its kernels named in a
``kernels_table.inc`` written here), through the real launchers :func:`affine_metal.rows_gemv` and
:func:`affine_metal.embedding`: a fake of the compiled library takes the arguments they pass (buffers, int64
scalars, ``threads=`` and ``group_size=``) and runs the driver on exactly those, every threadgroup of the grid.
Built with AddressSanitizer and UndefinedBehaviorSanitizer where they link (every buffer its own allocation of
exactly its size: a read past one fails, as does a misaligned load); fresh outputs start as NaN, so one the kernel
never writes fails too.

The reference is independent of the kernel's factoring and order: each weight ``code * scale + bias`` in float64
from the stored codes, scales and biases (codes read by :func:`mpsboost.ops.affine.unpack_codes`, which
tests/ops/test_affine_ops.py checks against ``mx.dequantize``), the product in float64. The kernel sums
``scale * sum(x q) + bias * sum(x)`` in float32 and never rounds a weight, so the tolerance is the activation
dtype's (relative to the output's largest magnitude): 1e-5 float32, 2e-3 float16, 1e-2 bfloat16.
"""

from __future__ import annotations

import struct
import subprocess
from pathlib import Path

import metal_emulation
import pytest
import torch

from mpsboost.ops import affine_metal
from mpsboost.ops.affine import affine_dequantize, affine_quantize, pack_codes, unpack_codes

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
XDT = (torch.float32, torch.float16, torch.bfloat16)
SDT = (torch.bfloat16, torch.float16, torch.float32)
NAMES = [*affine_metal.KERNELS.values(), *affine_metal.EMBED_KERNELS.values()]


@pytest.fixture(scope="module")
def driver(tmp_path_factory) -> Path:
    return metal_emulation.driver(affine_metal.SOURCE, NAMES, tmp_path_factory, what="affine_metal.SOURCE")


def _extent(t: torch.Tensor) -> torch.Tensor:
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) if t.numel() else 0
    return t.as_strided((extent,), (1,), t.storage_offset())


class _Library:
    """Stands in for ``torch.mps.compile_shader(SOURCE)``: a kernel call runs the emulation on what it is given,
    buffers then int scalars, as torch binds them; the output (argument 5 of the GEMV, 4 of the gather) is read
    back, a fresh one (contiguous, 2 or more dims) set to NaN first."""

    def __init__(self, exe: Path, tmp: Path):
        self.exe, self.tmp, self.calls, self.names = exe, tmp, 0, []

    def __getattr__(self, name: str):
        if name not in NAMES:
            raise AttributeError(name)

        def launch(*args, threads, group_size):
            nbuf = next(i for i, a in enumerate(args) if not isinstance(a, torch.Tensor))
            tensors, scalars = args[:nbuf], args[nbuf:]
            rows = name.startswith("mpsb_affine_rows_")
            assert nbuf == (6 if rows else 5) and all(type(a) is int for a in scalars), args
            assert all(t.is_contiguous() for t in tensors), "only contiguous tensors reach the shader binding"
            yi = 5 if rows else 4
            y = tensors[yi]
            assert tensors[1].dtype == torch.uint8 and len(threads) == 2 and len(group_size) == 2
            self.calls += 1
            self.names.append(name)
            if y.dim() >= 2:
                y.fill_(float("nan"))
            bufs = [_extent(t).contiguous().view(torch.uint8).numpy().tobytes() for t in tensors]
            head = b"MPSBEMU2" + name.encode().ljust(64, b"\0")
            counts = (nbuf, len(scalars), *map(len, bufs), *scalars)
            head += struct.pack(f"<{4 + len(counts)}q", *threads, *group_size, *counts)
            src, dst = self.tmp / f"in{self.calls}.bin", self.tmp / f"out{self.calls}.bin"
            src.write_bytes(head + b"".join(bufs))
            proc = subprocess.run([str(self.exe), str(src), str(dst)], capture_output=True, text=True, timeout=300)
            assert proc.returncode == 0, f"emulated {name} failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
            out = dst.read_bytes()
            assert len(out) == sum(map(len, bufs))
            at = sum(map(len, bufs[:yi]))
            written = torch.frombuffer(bytearray(out[at : at + len(bufs[yi])]), dtype=torch.uint8)
            _extent(y).view(torch.uint8).copy_(written)
            # nothing else was written: the kernel's inputs come back as they went
            assert out[:at] == b"".join(bufs[:yi]) and out[at + len(bufs[yi]) :] == b"".join(bufs[yi + 1 :])

        return launch


@pytest.fixture
def emulated(driver, tmp_path, monkeypatch):
    lib = _Library(driver, tmp_path)
    monkeypatch.setattr(affine_metal, "_library", lambda: lib)
    return lib


def _weights(g, e, n, k, bits, gs, sdt):
    w = (torch.randn(e, n, k, generator=g) * (torch.rand(e, n, 1, generator=g) + 0.25)).to(sdt)
    return affine_quantize(w, bits, gs)


def _reference(x, q, s, b, offs, bits, gs):
    """float64: row r times its expert's weight ``code * scale + bias`` computed exactly (the codes as
    :func:`unpack_codes` reads them, which ``affine_dequantize`` equal to ``mx.dequantize`` vouches for); rows past
    the last offset zero."""
    w = unpack_codes(q, bits).double()
    w = w * s.double().repeat_interleave(gs, -1) + b.double().repeat_interleave(gs, -1)
    y = torch.zeros(x.shape[0], q.shape[1], dtype=torch.float64)
    for row in range(x.shape[0]):
        grp = next((i for i, end in enumerate(offs) if row < end), None)
        if grp is not None:
            y[row] = w[grp] @ x[row].double()
    return y


def _close(got, ref, xdt, sdt):
    del sdt  # the kernel never rounds a weight: only the activations' dtype bounds the difference
    tol = TOL[xdt]
    assert not got.isnan().any(), "an output the kernel never wrote (or a NaN)"
    err = float((got.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-6))
    assert err <= tol, f"relative max error {err:.3e} > {tol:.0e}"


def _id(d):
    return str(d).removeprefix("torch.")


# every (bits, group) pair; over the three groups of one width, every (activation, scales) dtype pair; rows 1-4;
# N = 36 (not a multiple of the 8 features of a threadgroup); K = 3 groups (not a multiple of the 512-code step)
DENSE = [
    pytest.param(*(bits, gs, XDT[p], SDT[(p + gi) % 3], 1 + (gi + p) % 4), id=f"b{bits}-g{gs}-x{p}-s{(p + gi) % 3}")
    for bits in affine_metal.BITS
    for gi, gs in enumerate((32, 64, 128))
    for p in range(3)
]


@pytest.mark.parametrize("bits,gs,xdt,sdt,r", DENSE)
def test_dense_matches_reference(emulated, rng_seed, bits, gs, xdt, sdt, r):
    g = torch.Generator().manual_seed(rng_seed)
    n, k = 36, 3 * gs
    q, s, b = _weights(g, 1, n, k, bits, gs, sdt)
    x = torch.randn(r, k, generator=g).to(xdt)
    assert affine_metal.supported(x, q[0], s[0], b[0], bits, gs) is None
    got = affine_metal.rows_gemv(x, q[0], s[0], b[0], None, bits=bits, group_size=gs)
    assert got.shape == (r, n) and got.dtype == xdt
    _close(got, _reference(x, q, s, b, [r], bits, gs), xdt, sdt)
    assert emulated.names == [affine_metal.KERNELS[(bits, xdt)]]


@pytest.mark.parametrize("bits", [3, 4, 8])
@pytest.mark.parametrize("xdt", XDT, ids=_id)
def test_dense_more_rows_long_k_and_leading_dims(emulated, rng_seed, bits, xdt):
    """R=6 as [2, 3, K] (two row groups, the second partial), K=640 (a full 512-code step and a partial one)."""
    g = torch.Generator().manual_seed(rng_seed)
    n, k, gs = 20, 640, 64
    q, s, b = _weights(g, 1, n, k, bits, gs, torch.bfloat16)
    x = torch.randn(2, 3, k, generator=g).to(xdt)
    got = affine_metal.rows_gemv(x, q[0], s[0], b[0], None, bits=bits, group_size=gs)
    assert got.shape == (2, 3, n)
    _close(got.reshape(6, n), _reference(x.reshape(6, k), q, s, b, [6], bits, gs), xdt, torch.bfloat16)


@pytest.mark.parametrize("xdt", XDT, ids=_id)
def test_strided_rows_and_out_with_row_stride(emulated, rng_seed, xdt):
    """x a column slice of a wider tensor (row stride K + 32); out the columns of a wider buffer (others kept)."""
    g = torch.Generator().manual_seed(rng_seed)
    r, n, k, gs, bits = 3, 28, 128, 32, 4
    q, s, b = _weights(g, 1, n, k, bits, gs, torch.float16)
    wide_x = torch.randn(r, k + 32, generator=g).to(xdt)
    x = wide_x[:, 16 : 16 + k]
    wide = torch.full((r, n + 24), 7.0, dtype=xdt)
    out = wide[:, 8 : 8 + n]
    assert affine_metal.supported(x, q[0], s[0], b[0], bits, gs, out=out) is None
    y = affine_metal.rows_gemv(x, q[0], s[0], b[0], None, bits=bits, group_size=gs, out=out)
    assert y is out
    _close(out, _reference(x, q, s, b, [r], bits, gs), xdt, torch.float16)
    assert bool((wide[:, :8] == 7).all()) and bool((wide[:, 8 + n :] == 7).all())


@pytest.mark.parametrize("bits", [4, 8, 5])
@pytest.mark.parametrize("xdt,sdt", list(zip(XDT, SDT)), ids=lambda d: _id(d))
def test_grouped_empty_experts_and_rows_past_last_offset(emulated, rng_seed, bits, xdt, sdt):
    """E=5, offs [2, 2, 5, 6, 6], R=8: experts 1 and 4 have no rows (their codes are NaN-scaled: a read of them
    would show), rows 6 and 7 are past the last offset and must be exactly 0."""
    g = torch.Generator().manual_seed(rng_seed)
    r, n, k, e, gs = 8, 20, 192, 5, 64
    offs = [2, 2, 5, 6, 6]
    q, s, b = _weights(g, e, n, k, bits, gs, sdt)
    s[1] = float("nan")
    s[4] = float("nan")
    x = torch.randn(r, k, generator=g).to(xdt)
    got = affine_metal.rows_gemv(x, q, s, b, torch.tensor(offs, dtype=torch.int32), bits=bits, group_size=gs)
    keep = [0, 2, 3]
    ref = _reference(x, q[keep], s[keep], b[keep], [2, 5, 6], bits, gs)
    _close(got, ref, xdt, sdt)
    assert bool((got[6:] == 0).all())
    assert bool((got[:6].float().abs().amax(dim=1) > 0).all())


@pytest.mark.parametrize("bits", [2, 4, 6, 8])
@pytest.mark.parametrize("xdt", XDT, ids=_id)
def test_grouped_shared_row_stride0(emulated, rng_seed, bits, xdt):
    """One token's row expanded to its 9 expert rows (stride 0), E=3, offs [3, 3, 8], one row past the end."""
    g = torch.Generator().manual_seed(rng_seed)
    r, n, k, e, gs = 9, 36, 96, 3, 32
    q, s, b = _weights(g, e, n, k, bits, gs, torch.bfloat16)
    x = torch.randn(1, k, generator=g).to(xdt).expand(r, k)
    assert x.stride(0) == 0
    offs = [3, 3, 8]
    got = affine_metal.rows_gemv(x, q, s, b, torch.tensor(offs, dtype=torch.int32), bits=bits, group_size=gs)
    _close(got, _reference(x, q, s, b, offs, bits, gs), xdt, torch.bfloat16)
    assert bool((got[8] == 0).all())


@pytest.mark.parametrize("bits", affine_metal.BITS)
def test_every_code_decodes_exactly(emulated, bits):
    """x = the 32x32 identity, so y[r, n] = code(n, r) * scale + bias: every code value at every position of a
    16-code run (straddling words at 3, 5, 6 bits), bit for bit the float64 value (exact in float32 here)."""
    n = max(32, 1 << bits)
    codes = (torch.arange(n)[:, None] + 7 * torch.arange(32)) % (1 << bits)  # column r: every value
    assert all(len(codes[:, r].unique()) == 1 << bits for r in range(32))
    q = pack_codes(codes, bits)
    s = torch.full((n, 1), 0.375, dtype=torch.bfloat16)
    b = torch.full((n, 1), -2.5, dtype=torch.bfloat16)
    y = affine_metal.rows_gemv(torch.eye(32), q, s, b, None, bits=bits, group_size=32)
    want = codes.double().t() * 0.375 - 2.5
    bad = y.double() != want
    assert not bad.any(), f"{int(bad.sum())} codes wrong, e.g. {y[bad][:4].tolist()} for {want[bad][:4].tolist()}"


EMBED = [
    pytest.param(bits, SDT[p], XDT[(p + bits) % 3], id=f"b{bits}-s{_id(SDT[p])}-{_id(XDT[(p + bits) % 3])}")
    for bits in affine_metal.BITS
    for p in range(3)
]


@pytest.mark.parametrize("bits,sdt,dt", EMBED)
def test_embedding_is_affine_dequantize_bit_for_bit(emulated, rng_seed, bits, sdt, dt):
    """ids [2, 3] (a repeat, the first and last rows), K=160 (a partial 32-chunk threadgroup), int64 and int32."""
    g = torch.Generator().manual_seed(rng_seed)
    v, k, gs = 13, 160, 32
    q, s, b = _weights(g, 1, v, k, bits, gs, sdt)
    q, s, b = q[0], s[0], b[0]
    ids = torch.tensor([[3, 0, 12], [3, 7, 1]])
    want = affine_dequantize(q, s, b, bits, gs, dt)[ids]
    for idt in (torch.int64, torch.int32):
        assert affine_metal.embedding_supported(ids.to(idt), q, s, b, bits, gs, dt) is None
        got = affine_metal.embedding(ids.to(idt), q, s, b, bits=bits, group_size=gs, dtype=dt)
        assert got.shape == (2, 3, k) and got.dtype == dt
        assert torch.equal(got, want), f"{int((got != want).sum())} elements differ"


def test_embedding_out_of_range_ids_give_zero_rows(emulated, rng_seed):
    g = torch.Generator().manual_seed(rng_seed)
    q, s, b = _weights(g, 1, 5, 64, 4, 32, torch.bfloat16)
    ids = torch.tensor([1, -1, 5, 4])
    got = affine_metal.embedding(ids, q[0], s[0], b[0], bits=4, group_size=32, dtype=torch.bfloat16)
    want = affine_dequantize(q[0], s[0], b[0], 4, 32)
    assert torch.equal(got[0], want[1]) and torch.equal(got[3], want[4])
    assert bool((got[1:3] == 0).all())


class _OffByOne:
    """The emulated library with one code value of the 3-bit kernels decoded one higher (a wrong mask or shift on
    the GPU would look like this): the output of each launch moved by one scale where a row meets that code."""

    def __init__(self, lib: _Library):
        self.lib = lib

    def __getattr__(self, name: str):
        launch = getattr(self.lib, name)
        if "_rows_3_" not in name:
            return launch

        def broken(*args, threads, group_size):
            launch(*args, threads=threads, group_size=group_size)
            y = args[5]
            y.add_(torch.where(y == -1.0 + 0.5 * 5, 0.5, 0.0).to(y.dtype))  # code 5 reads as 6

        return broken


def test_self_check_passes_on_the_source_and_fails_on_a_wrong_decode(emulated, monkeypatch):
    # The patch-time probe on a Mac (affine_metal.self_check) through the emulation: it accepts the source (every
    # kernel, every branch it runs), and it names a kernel that decodes one code value wrongly.
    assert affine_metal.self_check("cpu") is None
    assert {n for n in emulated.names} >= set(affine_metal.KERNELS.values()) | set(affine_metal.EMBED_KERNELS.values())
    monkeypatch.setattr(affine_metal, "_library", lambda: _OffByOne(emulated))
    why = affine_metal.self_check("cpu")
    assert why is not None and "3-bit codes wrongly" in why, why
