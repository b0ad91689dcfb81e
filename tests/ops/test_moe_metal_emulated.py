"""mpsboost.ops.moe_metal: the exact Metal source, compiled as C++20 and run on the CPU, against independent references.

As tests/ops/test_affine_metal_emulated.py does: ``SOURCE`` (verbatim) is compiled by g++ against
``tests/ops/metal_emu/metal_stdlib`` and launched by ``tests/ops/metal_emu/driver.cpp`` (its kernels named in a
``kernels_table.inc`` written here), through the real launchers :func:`moe_metal.route`, :func:`moe_metal.glu` and
:func:`moe_metal.combine` and the registered operators' MPS kernels: a fake of the compiled library takes the
arguments they pass and runs the driver on exactly those, every threadgroup of the grid. One build per module
(AddressSanitizer and UndefinedBehaviorSanitizer where they link; every buffer its own allocation of exactly its
size). Fresh float outputs start as NaN and integer ones as -7, so an output the kernel never writes fails.

The references are independent of the kernels: transformers' own router modules of each family (Qwen3-MoE,
Qwen2-MoE, OLMoE, Qwen3-Next with ``norm_topk_prob`` True and False, Qwen3.5-MoE, Mixtral), mlx-lm's
top-k-then-softmax convention (Mixtral's), and torch's stable sort for the pairs' order and the offsets. Float32
within 1e-5 relative (the kernels sum in another order, and their exp is the C library's here).
"""

from __future__ import annotations

import struct
import subprocess
from pathlib import Path

import metal_emulation
import pytest
import torch

from mpsboost.ops import moe_metal, moe_route

NAMES = [*moe_metal.ROUTE_KERNELS.values(), *moe_metal.GLU_KERNELS.values(), *moe_metal.COMBINE_KERNELS.values()]
OUTPUTS = {"route": (2, 3, 4, 5, 6), "glu": (2,), "combine": (5,)}  # the buffers each kernel writes
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@pytest.fixture(scope="module")
def driver(tmp_path_factory) -> Path:
    return metal_emulation.driver(moe_metal.SOURCE, NAMES, tmp_path_factory, what="moe_metal.SOURCE")


def _extent(t: torch.Tensor) -> torch.Tensor:
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) if t.numel() else 0
    return t.as_strided((extent,), (1,), t.storage_offset())


class _Library:
    """Stands in for ``torch.mps.compile_shader(SOURCE)``: a kernel call runs the emulation on what it is given
    (buffers, then int scalars, as torch binds them); the buffers the kernel writes are read back (filled with a
    marker first), and every other one must come back unchanged."""

    def __init__(self, exe: Path, tmp: Path):
        self.exe, self.tmp, self.calls, self.names = exe, tmp, 0, []

    def __getattr__(self, name: str):
        if name not in NAMES:
            raise AttributeError(name)
        kind = name.split("_")[2]

        def launch(*args, threads, group_size):
            nbuf = next(i for i, a in enumerate(args) if not isinstance(a, torch.Tensor))
            tensors, scalars = args[:nbuf], args[nbuf:]
            assert all(type(a) is int for a in scalars), args
            assert all(t.is_contiguous() for t in tensors), "only contiguous tensors reach the shader binding"
            self.calls += 1
            self.names.append(name)
            outs = OUTPUTS[kind]
            for i in outs:
                t = tensors[i]
                if t.is_floating_point():
                    t.fill_(float("nan"))
                elif t.dtype != torch.uint8:
                    t.fill_(-7)
                else:
                    t.fill_(0xFF)  # bytes of float weights: NaN in float32, float16 and bfloat16
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
            for i, (t, b) in enumerate(zip(tensors, bufs)):
                got = out[at : at + len(b)]
                if i in outs:
                    _extent(t).view(torch.uint8).copy_(torch.frombuffer(bytearray(got), dtype=torch.uint8))
                else:
                    assert got == b, f"{name} wrote into its input buffer {i}"
                at += len(b)

        return launch


@pytest.fixture
def emulated(driver, tmp_path, monkeypatch):
    lib = _Library(driver, tmp_path)
    monkeypatch.setattr(moe_metal, "_library", lambda: lib)
    return lib


def _id(d):
    return str(d).removeprefix("torch.")


# ------------------------------------------------------------------ independent references: transformers' routers

FAMILY_ROUTERS = {
    # family -> (router class path, its config class, norm_topk_prob: None = the class always renormalises)
    "qwen3_moe": ("qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter", "Qwen3MoeConfig", True),
    "qwen3_moe_unnorm": ("qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter", "Qwen3MoeConfig", False),
    "qwen2_moe": ("qwen2_moe.modeling_qwen2_moe.Qwen2MoeTopKRouter", "Qwen2MoeConfig", False),
    "olmoe": ("olmoe.modeling_olmoe.OlmoeTopKRouter", "OlmoeConfig", False),
    "olmoe_norm": ("olmoe.modeling_olmoe.OlmoeTopKRouter", "OlmoeConfig", True),
    "qwen3_next": ("qwen3_next.modeling_qwen3_next.Qwen3NextTopKRouter", "Qwen3NextConfig", True),
    "qwen3_5_moe": ("qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeTopKRouter", "Qwen3_5MoeTextConfig", None),
    "mixtral": ("mixtral.modeling_mixtral.MixtralTopKRouter", "MixtralConfig", None),
}


def _router(family: str, experts: int, top_k: int, hidden: int, g: torch.Generator):
    import importlib

    import transformers as t

    path, cfg_name, norm = FAMILY_ROUTERS[family]
    mod, cls = path.rsplit(".", 1)
    kw = dict(hidden_size=hidden, num_experts_per_tok=top_k)
    kw["num_local_experts" if family == "mixtral" else "num_experts"] = experts
    if norm is not None:
        kw["norm_topk_prob"] = norm
    router = getattr(importlib.import_module("transformers.models." + mod), cls)(getattr(t, cfg_name)(**kw))
    with torch.no_grad():
        router.weight.copy_(torch.randn(experts, hidden, generator=g))
    return router, (True if norm is None else norm), family != "mixtral"


# every family's router at two shapes (batch 1-4, E 8-256, top-k 1-8), rotating through the four
_SHAPES = [(1, 8, 2), (2, 60, 4), (4, 256, 8), (3, 128, 1)]
ROUTER_CASES = [
    pytest.param(fam, *_SHAPES[(i + j) % 4], id=f"{fam}-{_SHAPES[(i + j) % 4]}")
    for i, fam in enumerate(FAMILY_ROUTERS)
    for j in (0, 2)
]


@pytest.mark.parametrize("family,n,e,k", ROUTER_CASES)
def test_route_equals_transformers_router(emulated, rng_seed, family, n, e, k):
    """The kernel on the router's logits gives the family router's ids (in its order) and weights (float32, 1e-5),
    the pairs' positions and offsets of a stable sort by expert, and the token rows in that order."""
    g = torch.Generator().manual_seed(rng_seed)
    hidden = 48
    router, norm, cast = _router(family, e, k, hidden, g)
    x = torch.randn(n, hidden, generator=g)
    with torch.no_grad():
        logits, scores, ids = router(x)
    wdt = x.dtype if cast else torch.float32
    weights, got_ids, pos, offs, rows = moe_metal.route(
        logits, x, top_k=k, norm=norm, weights_dtype=wdt, want_rows=True
    )
    assert emulated.names == [moe_metal.ROUTE_KERNELS[torch.float32]]
    assert torch.equal(got_ids, ids)
    torch.testing.assert_close(weights, scores, rtol=1e-5, atol=0)
    order = torch.sort(ids.reshape(-1), stable=True)
    want_pos = torch.empty(n * k, dtype=torch.int64).scatter_(0, order.indices, torch.arange(n * k))
    assert torch.equal(pos.reshape(-1).long(), want_pos)
    want_offs = torch.tensor([int((ids <= x_).sum()) for x_ in range(e)], dtype=torch.int32)
    assert torch.equal(offs, want_offs)
    assert torch.equal(rows, x[order.indices // k])


@pytest.mark.parametrize("n,e,k", [(1, 8, 2), (3, 64, 8)])
def test_route_equals_topk_then_softmax(emulated, rng_seed, n, e, k):
    """mlx-lm's Mixtral convention (top-k of the logits, then softmax over the k) gives the same weights."""
    g = torch.Generator().manual_seed(rng_seed)
    logits = torch.randn(n, e, generator=g) * 3
    vals, ids = torch.topk(logits, k, dim=-1)
    want = torch.softmax(vals, dim=-1)
    weights, got_ids, *_ = moe_metal.route(
        logits, logits, top_k=k, norm=True, weights_dtype=torch.float32, want_rows=False
    )
    assert torch.equal(got_ids, ids)
    torch.testing.assert_close(weights, want, rtol=1e-5, atol=0)


@pytest.mark.parametrize("dt", DTYPES, ids=_id)
@pytest.mark.parametrize("norm", [True, False])
def test_route_in_each_dtype_equals_reference(emulated, rng_seed, dt, norm):
    """bf16/fp16 logits as stored, softmax in float32 (transformers' ``dtype=torch.float``), weights in the dtype
    (rounded once) or float32; the registered operator's MPS kernel path, strided logits (a column slice)."""
    g = torch.Generator().manual_seed(rng_seed)
    n, e, k, h = 2, 40, 4, 300  # h: two column groups of the rows copy, the second partial
    # Ties among the k + 1 largest logits are redrawn: torch.topk (the reference) orders tied values as its sort
    # leaves them, the kernel lower expert first (the ties test below); bf16 logits tie often (seed 419368189).
    while True:
        wide = torch.randn(n, e + 8, generator=g).to(dt)
        logits = wide[:, 4 : 4 + e]
        top = logits.float().topk(k + 1, dim=-1).values
        if bool((top[:, :-1] > top[:, 1:]).all()):
            break
    x = torch.randn(n, h, generator=g).to(dt)
    for wdt in (dt, torch.float32):
        got = moe_route._route_mps(logits, x, k, norm, wdt, True)
        want = moe_route.route_reference(logits, x, k, norm, wdt, True)
        assert moe_route.route_mismatch(got, want, logits, TOL[dt]) is None


def test_route_ties_lower_expert_first_and_the_cpu_operator_is_torch_topk(emulated):
    """Tied logits: the kernel takes the larger logit first, then the lower expert id (the stable descending
    sort's order, moe_route.stable_topk); the CPU operator's ids are torch.topk's (stock's), ties included."""
    logits = torch.zeros(4, 16)
    logits[0, [3, 7, 11]] = 2.0  # three tied winners, then ties among the rest
    logits[1] = 1.0  # every logit tied
    logits[2, [15, 0]] = -1.0
    logits[3, :8] = 0.5
    for k in (1, 2, 8):
        _, ids, pos, offs, _ = moe_metal.route(
            logits, logits, top_k=k, norm=True, weights_dtype=torch.float32, want_rows=False
        )
        assert torch.equal(ids, moe_route.stable_topk(logits, k)[1]), (k, ids)
        assert torch.equal(offs, torch.tensor([int((ids <= e).sum()) for e in range(16)], dtype=torch.int32))
        cpu = torch.ops.mpsboost.moe_route(logits, logits, k, True, torch.float32, False)
        assert torch.equal(cpu[1], torch.topk(torch.softmax(logits, -1), k).indices)
    assert ids[0, :3].tolist() == [3, 7, 11] and ids[1].tolist() == list(range(8))
    # ties within one lane's logits (E=96: lane 5 holds experts 5, 37 and 69) and across lanes
    wide = torch.zeros(2, 96)
    wide[0, [69, 37, 5, 40]] = 3.0
    wide[1, 64:] = -1.0
    for k in (2, 4, 8):
        _, ids, *_ = moe_metal.route(wide, wide, top_k=k, norm=False, weights_dtype=torch.float32, want_rows=False)
        assert torch.equal(ids, moe_route.stable_topk(wide, k)[1]), (k, ids)
    assert ids[0, :4].tolist() == [5, 37, 40, 69]


@pytest.mark.parametrize("e,k", [(8, 1), (8, 8), (60, 2), (256, 1), (256, 8)])
def test_route_batch_1_to_4_every_shape(emulated, rng_seed, e, k):
    g = torch.Generator().manual_seed(rng_seed + e + k)
    for n in (1, 4):
        if n * k > moe_metal.MAX_PAIRS or k > e:
            continue
        logits = torch.randn(n, e, generator=g)
        x = torch.randn(n, 24, generator=g)
        for norm in (True, False):
            got = moe_metal.route(logits, x, top_k=k, norm=norm, weights_dtype=torch.float32, want_rows=True)
            want = moe_route.route_reference(logits, x, k, norm, torch.float32, True)
            assert moe_route.route_mismatch(got, want, logits, 1e-5) is None, (n, norm)


def test_route_supported_names_its_limits():
    x = torch.zeros(1, 8)
    assert "E <= 1024" in moe_metal.route_supported(torch.zeros(1, 2048), x, 2, torch.float32)
    assert "N * top_k <= 64" in moe_metal.route_supported(torch.zeros(9, 64), torch.zeros(9, 8), 8, torch.float32)
    assert "weights in torch.float16" in moe_metal.route_supported(torch.zeros(1, 8), x, 2, torch.float16)
    assert moe_metal.route_supported(torch.zeros(8, 64), torch.zeros(8, 8), 8, torch.float32) is None


@pytest.mark.parametrize("dt", DTYPES, ids=_id)
def test_glu_halves_and_two_tensors(emulated, rng_seed, dt):
    """silu(gate) * up: on the halves of [R, 2I] rows (I=300: a partial threadgroup) and on two [R, I] tensors;
    bf16/fp16 rounded as torch's two ops round them."""
    g = torch.Generator().manual_seed(rng_seed)
    h = (torch.randn(3, 600, generator=g) * 4).to(dt)
    got = moe_route._glu_mps(h, None)
    want = torch.nn.functional.silu(h[:, :300].float()).to(dt).float() * h[:, 300:].float()
    torch.testing.assert_close(got.float(), want.to(dt).float(), rtol=TOL[dt], atol=TOL[dt])
    a, b = torch.randn(1, 64, generator=g).to(dt), torch.randn(1, 64, generator=g).to(dt)
    torch.testing.assert_close(
        moe_metal.glu(a, b).float(), (torch.nn.functional.silu(a) * b).float(), rtol=TOL[dt], atol=TOL[dt]
    )


@pytest.mark.parametrize(
    "dt,shared,n",
    [
        (torch.float32, True, 1),
        (torch.float32, False, 4),
        (torch.float16, True, 4),
        (torch.bfloat16, True, 1),
        (torch.bfloat16, False, 4),
    ],
    ids=lambda v: _id(v) if isinstance(v, torch.dtype) else str(v),
)
def test_combine_equals_weighted_sum_and_gated_shared(emulated, rng_seed, dt, shared, n):
    """y[t] = sum_j w[t, j] * pair[pos[t, j]] + sigmoid(g[t]) * shared[t], against float64 of the same inputs;
    weights in the dtype and in float32 (Mixtral's), with positions and without (pairs in token order)."""
    g = torch.Generator().manual_seed(rng_seed)
    k, h = 8 if n == 1 else 2, 280
    pair = torch.randn(n * k, h, generator=g).to(dt)
    sh = torch.randn(n, h, generator=g).to(dt) if shared else None
    gate = torch.randn(n, 1, generator=g).to(dt) if shared else None
    for wdt, with_pos in ((dt, True), (torch.float32, False)):
        w = torch.softmax(torch.randn(n, k, generator=g), -1).to(wdt)
        pos = torch.randperm(n * k, generator=g).to(torch.int32).view(n, k) if with_pos else None
        got = moe_route._combine_mps(pair, w, pos, sh, gate, [n, 1, h])
        assert got.shape == (n, 1, h)
        rows = pair.double()[pos.reshape(-1).long()] if with_pos else pair.double()
        want = (rows.view(n, k, h) * w.double().view(n, k, 1)).sum(1)
        if shared:
            want = want + torch.sigmoid(gate.double()) * sh.double()
        err = float((got.view(n, h).double() - want).abs().max() / want.abs().max())
        assert err <= TOL[dt], err


def test_operators_on_cpu_are_one_call_and_trace_fullgraph():
    """The registered operators: one aten-level call each on the CPU (their reference inside), and a function of
    all three traces with torch.compile(fullgraph=True), equal to eager."""
    from mpsboost.bench import ModuleOps

    g = torch.Generator().manual_seed(0)
    logits, x = torch.randn(2, 16, generator=g), torch.randn(2, 32, generator=g)
    h = torch.randn(4, 64, generator=g)

    def step(logits, x, h):
        w, ids, pos, offs, rows = moe_route.moe_route(logits, x, 2, True, torch.float32, True)
        a = moe_route.moe_glu(h)
        return moe_route.moe_combine(a.repeat(1, 1), w, pos, None, None, [2, 32]), offs, rows

    with ModuleOps() as seen:
        step(logits, x, h)
    assert seen.names == ["mpsboost.moe_route", "mpsboost.moe_glu", "aten.repeat", "mpsboost.moe_combine"]
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="eager")
    for a, b in zip(compiled(logits, x, h), step(logits, x, h)):
        torch.testing.assert_close(a, b)


class _WrongTie:
    """The emulated library with the route kernel's ids reversed within each token (a wrong tie rule or a wrong
    selection round would look like this)."""

    def __init__(self, lib: _Library):
        self.lib = lib

    def __getattr__(self, name: str):
        launch = getattr(self.lib, name)
        if "_route_" not in name:
            return launch

        def broken(*args, threads, group_size):
            launch(*args, threads=threads, group_size=group_size)
            ids = args[3]
            ids.copy_(ids.flip(-1))

        return broken


def test_self_check_passes_on_the_source_and_fails_on_a_wrong_route(emulated, monkeypatch):
    assert moe_metal.self_check("cpu") is None
    assert set(emulated.names) == set(NAMES)
    monkeypatch.setattr(moe_metal, "_library", lambda: _WrongTie(emulated))
    why = moe_metal.self_check("cpu")
    assert why is not None and "MoE route kernel" in why, why
