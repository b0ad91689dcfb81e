"""mpsboost.ops.attn_metal: the exact Metal source, compiled as C++20 and run on the CPU, against transformers' own
``apply_rotary_pos_emb`` and the models' RMSNorm classes (an independent reference: not mpsboost.ops.attn_ref).

As tests/ops/test_moe_metal_emulated.py does: ``SOURCE`` is compiled by g++ against ``tests/ops/metal_emu`` and
launched by its driver (kernels named in a ``kernels_table.inc`` written here), through the real launcher
:func:`attn_metal.qk_rope` and the operator's MPS kernel: a fake of the compiled library runs the driver on exactly
the arguments they pass. One build per module. Fresh outputs start as NaN, so an element never written fails; the
caches keep their contents except the one position written. Float32 within 1e-5 relative; float16 4e-3, bfloat16
3e-2 (torch's composed ops round each product; the kernel rounds where they do, but sums in another order).
"""

from __future__ import annotations

import struct
import subprocess
from pathlib import Path

import metal_emulation
import pytest
import torch
from mpsboost.bench import max_relative_error

from mpsboost.ops import attn_metal, attn_step

NAMES = list(attn_metal.KERNELS.values())
FRESH = (5, 6)  # q and k outputs: filled with NaN first
INOUT = (8, 9)  # the caches: read back, their other positions must stay
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@pytest.fixture(scope="module")
def driver(tmp_path_factory) -> Path:
    return metal_emulation.driver(attn_metal.SOURCE, NAMES, tmp_path_factory, what="attn_metal.SOURCE")


def _extent(t: torch.Tensor) -> torch.Tensor:
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) if t.numel() else 0
    return t.as_strided((extent,), (1,), t.storage_offset())


class _Library:
    def __init__(self, exe: Path, tmp: Path):
        self.exe, self.tmp, self.calls = exe, tmp, 0

    def __getattr__(self, name: str):
        if name not in NAMES:
            raise AttributeError(name)

        def launch(*args, threads, group_size):
            nbuf = next(i for i, a in enumerate(args) if not isinstance(a, torch.Tensor))
            tensors, scalars = args[:nbuf], args[nbuf:]
            assert all(type(a) is int for a in scalars), args
            assert all(t.is_contiguous() for t in tensors), "only contiguous tensors reach the shader binding"
            self.calls += 1
            for i in FRESH:
                tensors[i].fill_(float("nan"))
            bufs = [_extent(t).contiguous().view(torch.uint8).numpy().tobytes() for t in tensors]
            head = b"MPSBEMU2" + name.encode().ljust(64, b"\0")
            counts = (nbuf, len(scalars), *map(len, bufs), *scalars)
            head += struct.pack(f"<{4 + len(counts)}q", *threads, *group_size, *counts)
            src, dst = self.tmp / f"in{self.calls}.bin", self.tmp / f"out{self.calls}.bin"
            src.write_bytes(head + b"".join(bufs))
            proc = subprocess.run([str(self.exe), str(src), str(dst)], capture_output=True, text=True, timeout=300)
            assert proc.returncode == 0, f"emulated {name} failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
            out = dst.read_bytes()
            at = 0
            written = set(FRESH + INOUT)
            for i, (t, b) in enumerate(zip(tensors, bufs)):
                got = out[at : at + len(b)]
                if i in written:
                    _extent(t).view(torch.uint8).copy_(torch.frombuffer(bytearray(got), dtype=torch.uint8))
                elif i not in written:
                    assert got == b, f"{name} wrote into its input buffer {i}"
                at += len(b)

        return launch


@pytest.fixture
def emulated(driver, tmp_path, monkeypatch):
    lib = _Library(driver, tmp_path)
    monkeypatch.setattr(attn_metal, "_library", lambda: lib)
    return lib


# ------------------------------------------------------------------ the independent reference: transformers' own


def _hf(family: str, d: int, eps: float):
    import transformers.models.qwen3.modeling_qwen3 as q3
    import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe as q35

    if family == "gated":
        return q35.Qwen3_5MoeRMSNorm(d, eps=eps), q35.Qwen3_5MoeRMSNorm(d, eps=eps), q35.apply_rotary_pos_emb
    return q3.Qwen3RMSNorm(d, eps=eps), q3.Qwen3RMSNorm(d, eps=eps), q35.apply_rotary_pos_emb


def _expected(family, y, nq, nk, cos, sin, hq, hkv, d, gated):
    """transformers' path: q_proj output split into query (and gate) per head, the norm modules, then
    apply_rotary_pos_emb on [B, H, 1, D] (partial rotary where cos is narrower than D)."""
    b = y.shape[0]
    qs = 2 * d if gated else d
    qpart = y[:, : hq * qs].view(b, 1, hq, qs)[..., :d]
    kpart = y[:, hq * qs : hq * qs + hkv * d].view(b, 1, hkv, d)
    if family != "plain":
        qpart, kpart = nq(qpart), nk(kpart)
    q, k = qpart.transpose(1, 2), kpart.transpose(1, 2)
    q, k = (t.contiguous() for t in _hf(family, d, 1e-6)[2](q, k, cos, sin))
    return q, k


CASES = [
    # family, batch, hq, hkv, d, rotary, cos batch (1: shared), dtype
    ("gated", 1, 4, 2, 64, 16, 1, torch.float32),
    ("gated", 3, 8, 2, 64, 32, 3, torch.float32),
    ("gated", 2, 4, 1, 128, 32, 2, torch.bfloat16),
    ("qk_norm", 4, 8, 2, 64, 64, 4, torch.float32),
    ("qk_norm", 2, 4, 4, 128, 128, 2, torch.float16),
    ("qk_norm", 1, 8, 1, 32, 32, 1, torch.bfloat16),
    ("plain", 2, 4, 2, 64, 64, 2, torch.float32),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-b{c[1]}-{c[2]}x{c[3]}-d{c[4]}-r{c[5]}-{c[7]}")
def test_kernel_equals_transformers(emulated, case):
    family, b, hq, hkv, d, r, cb, dt = case
    g = torch.Generator().manual_seed(hash(case) % 1000)
    gated = family == "gated"
    qs = 2 * d if gated else d
    nq, nk, _ = _hf(family, d, 1e-6)
    with torch.no_grad():
        for n in (nq, nk):
            n.weight.copy_(torch.randn(d, generator=g) * 0.3 + (0.0 if gated else 1.0))
    nq, nk = nq.to(dt), nk.to(dt)
    # a wider row (a buffer's column range: row stride > N) and left-padded positions (cos rows differ per sequence)
    width = hq * qs + hkv * d
    y = (torch.randn(b, width + 24, generator=g) * 3).to(dt)[:, 5 : 5 + width]
    pos_ids = torch.tensor([[7 - 2 * i] for i in range(cb)]).clamp_min(0).float()
    inv = 1.0 / (10000 ** (torch.arange(0, r, 2).float() / r))
    ang = torch.cat((pos_ids[..., None] * inv, pos_ids[..., None] * inv), -1)  # [cb, 1, r]
    cos, sin = ang.cos().to(dt), ang.sin().to(dt)
    mode = attn_step.MODES[family]
    if family == "gated":
        wq, wk = 1.0 + nq.weight.float(), 1.0 + nk.weight.float()
    elif family == "qk_norm":
        wq, wk = nq.weight.float(), nk.weight.float()
    else:
        wq = wk = None
    v = torch.randn(b, hkv * d, generator=g).to(dt)
    kc = torch.randn(b, hkv, 6, d, generator=g).to(dt)
    vc = torch.randn(b, hkv, 6, d, generator=g).to(dt)
    kc0, vc0 = kc.clone(), vc.clone()
    pos = torch.tensor([4])
    with torch.no_grad():
        want_q, want_k = _expected(family, y, nq, nk, cos, sin, hq, hkv, d, gated)
        got_q, got_k = attn_step._op_mps(y, wq, wk, cos, sin, v, kc, vc, pos, hq, hkv, d, qs, 1e-6, mode)
    assert emulated.calls == 1, "the MPS implementation must launch the kernel, not its reference"
    assert got_q.is_contiguous() and got_k.is_contiguous()
    assert max_relative_error(got_q, want_q) <= TOL[dt], max_relative_error(got_q, want_q)
    assert max_relative_error(got_k, want_k) <= TOL[dt], max_relative_error(got_k, want_k)
    assert max_relative_error(kc[:, :, 4:5], want_k) <= TOL[dt]
    assert torch.equal(vc[:, :, 4], v.view(b, hkv, d))
    keep = [i for i in range(6) if i != 4]
    assert torch.equal(kc[:, :, keep], kc0[:, :, keep]) and torch.equal(vc[:, :, keep], vc0[:, :, keep])


def test_position_outside_the_cache_writes_nothing(emulated):
    b, hq, hkv, d = 1, 2, 1, 32
    y = torch.randn(b, hq * d + hkv * d)
    w = torch.ones(d)
    cos, sin = torch.ones(1, 1, d), torch.zeros(1, 1, d)
    kc, vc = torch.randn(b, hkv, 3, d), torch.randn(b, hkv, 3, d)
    kc0, vc0 = kc.clone(), vc.clone()
    attn_metal.qk_rope(y, w, w, cos, sin, hq, hkv, d, d, 1e-6, 2, torch.randn(b, hkv * d), kc, vc, torch.tensor([3]))
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0)


def test_self_check_passes_on_the_emulation(emulated):
    assert attn_metal.self_check("cpu") is None
    assert emulated.calls == 9  # 3 dtypes x 3 shapes


def test_without_a_cache_through_the_operator_on_cpu_reference(emulated):
    """No cache: q/k from the kernel equal the registered operator's CPU implementation (the reference)."""
    g = torch.Generator().manual_seed(3)
    b, hq, hkv, d, r = 2, 4, 2, 64, 32
    y = torch.randn(b, hq * 2 * d + hkv * d, generator=g)
    w = torch.rand(d, generator=g) + 0.5
    ang = torch.rand(b, 1, r, generator=g) * 6
    cos, sin = ang.cos(), ang.sin()
    got = attn_metal.qk_rope(y, w, w, cos, sin, hq, hkv, d, 2 * d, 1e-6, 1)
    want = attn_step.qk_rope_cache(y, w, w, cos, sin, hq=hq, hkv=hkv, d=d, q_stride=2 * d, eps=1e-6, mode=1)
    assert emulated.calls == 1
    for a, e in zip(got, want):
        assert max_relative_error(a, e) <= 1e-5
