"""mpsboost.ops.deltanet_metal: the exact Metal source of the fused Gated DeltaNet decode step, compiled as C++20 and
run on the CPU.

As tests/ops/test_affine_metal_emulated.py does for the low-bit kernels: ``SOURCE`` (verbatim) is compiled once for
this module by g++ against ``tests/ops/metal_emu/metal_stdlib`` and launched by ``tests/ops/metal_emu/driver.cpp``
(its kernels named in a ``kernels_table.inc`` written here), through the real launcher :func:`deltanet_metal.step`:
a fake of the compiled library takes the arguments it passes (buffers, int64 scalars, ``threads=`` and
``group_size=``) and runs the driver on exactly those, every threadgroup of the grid, every thread its own fiber
(``simd_sum`` and ``threadgroup_barrier`` really synchronise them; tests/ops/test_metal_emulation.py). Built with
AddressSanitizer and UndefinedBehaviorSanitizer where they link (every buffer its own allocation of exactly its
size); the output starts as NaN, so an element the kernel never writes fails; the buffers the kernel only reads must
come back unchanged.

The reference is independent of the kernel and of mpsboost's composed step: transformers' own
``causal_conv1d_update`` (float64), ``torch_recurrent_gated_delta_rule`` (it computes in float32 whatever it is
given) and the layer's ``Qwen3_5MoeRMSNormGated`` (float32), on the same (rounded) inputs. Tolerances, relative to
the largest magnitude: the float32 state and a float32 output 1e-5; a float16/bfloat16 output one rounding to its
dtype (the reference's output rounded to the dtype, then compared within 1e-5 plus one ulp at the largest value).
"""

from __future__ import annotations

import struct
import subprocess
from pathlib import Path

import metal_emulation
import pytest
import torch
import torch.nn.functional as F  # noqa: F401

from mpsboost.ops import deltanet_metal as dm
from deltanet_reference import compare, independent
from mpsboost.ops.deltanet_step import _deltanet_step_mps, random_inputs

NAMES = list(dm.KERNELS.values())
MUTATED = (1, 2, 8)  # conv_state, state, out


@pytest.fixture(scope="module")
def driver(tmp_path_factory) -> Path:
    return metal_emulation.driver(dm.SOURCE, NAMES, tmp_path_factory, what="deltanet_metal.SOURCE")


def _extent(t: torch.Tensor) -> torch.Tensor:
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) if t.numel() else 0
    return t.as_strided((extent,), (1,), t.storage_offset())


class _Library:
    """Stands in for ``torch.mps.compile_shader(SOURCE)``: a kernel call runs the emulation on what it is given
    (buffers, then int scalars); the conv state, the state and the output come back, the output set to NaN first;
    every other buffer must come back as it went."""

    def __init__(self, exe: Path, tmp: Path):
        self.exe, self.tmp, self.calls, self.launches = exe, tmp, 0, []

    def __getattr__(self, name: str):
        if name not in NAMES:
            raise AttributeError(name)

        def launch(*args, threads, group_size):
            nbuf = next(i for i, a in enumerate(args) if not isinstance(a, torch.Tensor))
            tensors, scalars = args[:nbuf], args[nbuf:]
            assert nbuf == 9 and all(type(a) is int for a in scalars), args
            assert all(t.is_contiguous() for t in tensors), "only contiguous tensors reach the shader binding"
            assert len(threads) == 2 and len(group_size) == 2
            self.calls += 1
            self.launches.append((name, tuple(threads), tuple(group_size)))
            tensors[8].fill_(float("nan"))
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
            at = 0
            for i, (t, raw) in enumerate(zip(tensors, bufs)):
                got = out[at : at + len(raw)]
                at += len(raw)
                if i in MUTATED:
                    _extent(t).view(torch.uint8).copy_(torch.frombuffer(bytearray(got), dtype=torch.uint8))
                else:
                    assert got == raw, f"the kernel wrote into its input buffer {i}"

        return launch


@pytest.fixture
def emulated(driver, tmp_path, monkeypatch):
    lib = _Library(driver, tmp_path)
    monkeypatch.setattr(dm, "_library", lambda: lib)
    return lib


def _steps(args, kw, n, mutate=None):
    """``n`` continued steps: the kernel and the reference each carry their own states from step to step."""
    ref = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    g = torch.Generator().manual_seed(int(args[0].double().abs().sum() * 1000) % 2**31)
    for i in range(n):
        if i:  # a new token: fresh projections for both
            fresh = torch.randn(args[0].shape, generator=g).to(args[0].dtype)
            args[0].copy_(fresh)
            ref[0] = args[0].clone()
        if mutate is not None:
            mutate(i, args, ref)
        want = independent(ref, kw)
        ref[1], ref[2] = want[1].clone(), want[2].clone()
        dm.step(*args, **kw)
        compare(args, want, f"step {i}")


def _id(d):
    return str(d).removeprefix("torch.")


# value heads per key head 1, 2, 4 (and 3, Qwen3.5 dense's); batch 1-4; each activation dtype; a conv bias; beta 2
CASES = [
    pytest.param(1, 2, 1, 32, 32, torch.float32, False, 1.0, id="b1-r1-f32"),
    pytest.param(2, 2, 2, 32, 32, torch.bfloat16, False, 1.0, id="b2-r2-bf16"),
    pytest.param(4, 1, 4, 32, 32, torch.float16, True, 1.0, id="b4-r4-f16-bias"),
    pytest.param(3, 2, 4, 32, 16, torch.float32, False, 2.0, id="b3-r4-f32-beta2"),
    pytest.param(1, 2, 3, 64, 32, torch.bfloat16, True, 1.0, id="b1-r3-bf16-dk64"),
    pytest.param(2, 1, 2, 32, 64, torch.float32, True, 1.0, id="b2-r2-f32-dv64"),
]


@pytest.mark.parametrize("b,hk,r,dk,dv,dt,bias,beta_scale", CASES)
def test_kernel_matches_transformers_over_continued_steps(emulated, rng_seed, b, hk, r, dk, dv, dt, bias, beta_scale):
    """Three continued steps (each from the state the kernel left), slow-decay and fast heads side by side."""
    g = torch.Generator().manual_seed(rng_seed)
    args, kw = random_inputs(g, b=b, hk=hk, r=r, dk=dk, dv=dv, dtype=dt, bias=bias)
    kw["beta_scale"] = beta_scale
    decay = torch.exp(-args[6].exp() * F.softplus(args[0][:, -hk * r :].float() + args[5]))
    assert bool((decay[:, ::2] > 0.999).all()) and bool((decay[:, 1::2] < 0.999).any())  # slow and fast heads
    assert dm.supported(*args, kw["hk"], kw["dk"]) is None
    _steps(args, kw, 3)
    nt = dm.threads_for(r * dv)
    assert emulated.launches == [(dm.KERNELS[dt], (hk * nt, b), (nt, 1))] * 3  # one dispatch a step


def test_left_padded_rows_and_a_masked_token(emulated, rng_seed):
    """Batch 4 as left padding leaves it: row 0 all padding so far (zero conv state and zero state), row 1 padding
    in the older half of its conv window, row 2 a masked token now (its projections zero: the layer multiplies the
    hidden states by the mask), row 3 plain."""
    g = torch.Generator().manual_seed(rng_seed)
    args, kw = random_inputs(g, b=4, hk=2, r=2, dk=32, dv=32, dtype=torch.bfloat16, bias=False)

    def pad(i, a, ref):
        for t in (a, ref):
            if i == 0:
                t[1][0].zero_()
                t[2][0].zero_()
                t[1][1, :, :2].zero_()
            t[0][2].zero_()

    _steps(args, kw, 2, mutate=pad)
    assert bool(args[8][2].isfinite().all())


def test_more_value_columns_than_threads_loop(emulated, rng_seed):
    """r * dv = 1152 > 1024 threads: every thread takes two columns, every simdgroup more than one head's norm."""
    g = torch.Generator().manual_seed(rng_seed)
    args, kw = random_inputs(g, b=1, hk=1, r=9, dk=32, dv=128, dtype=torch.float32)
    assert dm.threads_for(9 * 128) == 1024
    _steps(args, kw, 1)


def test_y_as_columns_of_a_wider_buffer_through_the_operator(emulated, rng_seed):
    """y a view with row stride N + 24 (the projections' buffer with more columns), B=2, through the operator's
    MPS implementation (its supported() check, then the launch)."""
    g = torch.Generator().manual_seed(rng_seed)
    args, kw = random_inputs(g, b=2, hk=2, r=2, dk=32, dv=32, dtype=torch.float16, extra_cols=24)
    n = args[0].shape[1] - 24
    args[0] = args[0][:, 5 : 5 + n]
    assert args[0].stride(0) == n + 24 and not args[0].is_contiguous()
    want = independent([a.clone() if isinstance(a, torch.Tensor) else a for a in args], kw)
    _deltanet_step_mps(*args, kw["hk"], kw["dk"], kw["norm_eps"], kw["beta_scale"])
    assert emulated.calls == 1
    compare(args, want)


class _WrongDecay:
    """The emulated library whose kernel forgets the decay of one head (a wrong head index on the GPU would look
    like this): the state of head 0 of every sequence moved by what decaying it would have taken away."""

    def __init__(self, lib: _Library):
        self.lib = lib

    def __getattr__(self, name: str):
        launch = getattr(self.lib, name)

        def broken(*args, threads, group_size):
            before = args[2][:, 0].clone()
            launch(*args, threads=threads, group_size=group_size)
            args[2][:, 0].add_(before * 1e-3)

        return broken


def test_self_check_passes_on_the_source_and_fails_on_a_wrong_kernel(emulated, monkeypatch):
    # The patch-time check on a Mac (deltanet_metal.self_check) through the emulation: it accepts the source (every
    # case it runs), and it names what a kernel that gets one head's state wrong breaks.
    assert dm.self_check("cpu") is None
    assert {n for n, _, _ in emulated.launches} == set(dm.KERNELS.values())
    monkeypatch.setattr(dm, "_library", lambda: _WrongDecay(emulated))
    why = dm.self_check("cpu")
    assert why is not None and "state differs" in why, why
