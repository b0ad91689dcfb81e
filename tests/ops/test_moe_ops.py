"""mpsboost.ops.moe: routing, offsets, grouped linear paths, the whole experts call, path choice."""

from __future__ import annotations

import pytest
import torch

from mpsboost.gate import Env, check
from mpsboost.ops import moe


def _ref_linear(x, w, ids, transposed):
    """Row by row, in float64: x[s] @ W[ids[s]]."""
    out = []
    for s in range(x.shape[0]):
        ws = w[ids[s]].double()
        out.append(x[s].double() @ (ws if transposed else ws.T))
    return torch.stack(out) if out else x.new_zeros(0, w.shape[-1] if transposed else w.shape[-2]).double()


def _routing(n, e, k):
    return torch.rand(n, e).argsort(-1)[:, :k], torch.rand(n, k).softmax(-1)


def test_route_sorts_pairs_and_counts_on_device(rng_seed):
    e, k = 7, 3
    idx, w = _routing(20, e, k)
    r = moe.route(idx, w, e)
    assert r.offsets.dtype == torch.int32 and r.counts.dtype == torch.int32
    ref_counts = torch.bincount(idx.reshape(-1), minlength=e)  # host-side reference only
    assert torch.equal(r.counts.long(), ref_counts)
    assert torch.equal(r.offsets.long(), ref_counts.cumsum(0))
    assert torch.equal(r.expert_of_sorted, idx.reshape(-1)[r.perm])
    assert bool((r.expert_of_sorted[1:] >= r.expert_of_sorted[:-1]).all())
    assert torch.equal(r.sorted_token_idx, r.perm // k)
    assert torch.equal(r.sorted_weights, w.reshape(-1)[r.perm])
    # Stable: pairs of one expert keep token order.
    for ex in range(e):
        toks = r.sorted_token_idx[r.expert_of_sorted == ex]
        assert bool((toks[1:] > toks[:-1]).all())


def test_counts_methods_agree_and_drop_sentinels(rng_seed):
    e = 9
    ids = torch.randint(0, e + 2, (200,))  # ids >= e are expert-parallel sentinels
    a = moe.expert_counts(ids, e, method="scatter_add")
    b = moe.expert_counts(ids, e, method="histc")
    ref = torch.bincount(ids[ids < e], minlength=e)
    assert torch.equal(a.long(), ref) and torch.equal(b.long(), ref)
    # Integer histc only where the gate says this device has it (not CPU, not MPS).
    if check("histc_int", Env.detect("cpu")).ok:
        assert torch.equal(moe.expert_counts(ids, e, method="histc", histc_int=True).long(), ref)
    else:
        with pytest.raises((RuntimeError, NotImplementedError)):
            moe.expert_counts(ids, e, method="histc", histc_int=True)
    with pytest.raises(ValueError, match="scatter_add"):
        moe.expert_counts(ids, e, method="bincount")


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("path", moe.PATHS)
def test_grouped_linear_paths_match_reference(path, transposed, rng_seed):
    e, din, dout, s = 5, 16, 24, 37
    w = torch.randn(e, din, dout) if transposed else torch.randn(e, dout, din)
    bias = torch.randn(e, dout)
    ids = torch.sort(torch.randint(0, e, (s,))).values
    offsets = moe.expert_counts(ids, e).cumsum(0, dtype=torch.int32)
    x = torch.randn(s, din)
    y = moe.grouped_linear(x, w, offsets, path=path, bias=bias, expert_of_sorted=ids, transposed=transposed)
    ref = _ref_linear(x, w, ids, transposed) + bias[ids].double()
    assert (y.double() - ref).norm() / ref.norm() < 1e-6


def test_grouped_linear_rejects_bad_input():
    w = torch.randn(3, 8, 4)
    with pytest.raises(ValueError, match="accepted paths"):
        moe.grouped_linear(torch.randn(2, 4), w, path="loop")
    with pytest.raises(ValueError, match="expert_of_sorted"):
        moe.grouped_linear(torch.randn(2, 4), w, path="batched_mm")
    with pytest.raises(ValueError, match="offsets"):
        moe.grouped_linear(torch.randn(2, 4), w, path="grouped_mm")
    with pytest.raises(ValueError, match=r"\[S, in\]"):
        moe.grouped_linear(torch.randn(2, 2, 4), w, path="grouped_mm")


@pytest.mark.parametrize("path", moe.PATHS)
def test_routed_experts_with_sentinels_and_more_rows_than_a_chunk(path, rng_seed):
    """Pairs routed to id >= E (transformers' expert-parallel sentinels) contribute nothing; the
    dense fallback's chunking (256 rows) is crossed."""
    e, h, i, n, k = 6, 16, 8, 300, 2
    up, down = torch.randn(e, 2 * i, h) * 0.2, torch.randn(e, h, i) * 0.2
    idx, w = _routing(n, e, k)
    idx[::5, 1] = e  # sentinel
    act = lambda t: torch.nn.functional.silu(t[..., :i]) * t[..., i:]  # noqa: E731
    x = torch.randn(n, h)
    y = moe.routed_experts(x, idx, w, up_weight=up, down_weight=down, activation=act, path=path)
    ref = torch.zeros(n, h, dtype=torch.float64)
    for t in range(n):
        for j in range(k):
            ex = int(idx[t, j])
            if ex >= e:
                continue
            hh = act(x[t].double() @ up[ex].double().T)
            ref[t] += w[t, j].double() * (hh @ down[ex].double().T)
    assert torch.isfinite(y).all()
    assert (y.double() - ref).norm() / ref.norm() < 1e-5


def test_routed_experts_compiles_fullgraph_without_host_sync(rng_seed):
    """fullgraph=True fails on any graph break: .item(), .tolist(), nonzero, data-dependent loops (backend
    ``aot_eager``: the capture and functionalisation; inductor's lowering is tests/recipes/moe/test_moe_modes.py's)."""
    e, h, i = 8, 16, 8
    up, down = torch.randn(e, 2 * i, h), torch.randn(e, h, i)
    act = lambda t: torch.nn.functional.silu(t[..., :i]) * t[..., i:]  # noqa: E731

    def f(x, idx, w, path):
        return moe.routed_experts(x, idx, w, up_weight=up, down_weight=down, activation=act, path=path)

    torch._dynamo.reset()
    for path in ("batched_mm", "fallback"):
        compiled = torch.compile(f, fullgraph=True, dynamic=False, backend="aot_eager")
        idx, w = _routing(6, e, 2)
        x = torch.randn(6, h)
        assert (compiled(x, idx, w, path) - f(x, idx, w, path)).norm() / f(x, idx, w, path).norm() < 1e-5
    # The native grouped path compiles in bf16 (its meta kernel takes bf16 only).
    upb, downb = up.bfloat16(), down.bfloat16()
    g = torch.compile(
        lambda x, idx, w: moe.routed_experts(
            x, idx, w, up_weight=upb, down_weight=downb, activation=act, path="grouped_mm"
        ),
        fullgraph=True,
        backend="aot_eager",
    )
    idx, w = _routing(40, e, 2)
    x = torch.randn(40, h).bfloat16()
    eager = moe.routed_experts(x, idx, w, up_weight=upb, down_weight=downb, activation=act, path="grouped_mm")
    assert (g(x, idx, w).float() - eager.float()).norm() / eager.float().norm() < 2e-2


def test_native_grouped_mm_ok_follows_the_16_byte_rule():
    ok = moe.native_grouped_mm_ok(torch.randn(4, 16).bfloat16(), torch.randn(3, 16, 24).bfloat16())
    odd = moe.native_grouped_mm_ok(torch.randn(4, 20).bfloat16(), torch.randn(3, 20, 24).bfloat16())
    assert ok and not odd
    # The rule's premise: the CPU kernel really refuses the odd width.
    if hasattr(torch.nn.functional, "grouped_mm"):
        with pytest.raises(RuntimeError, match="16 bytes"):
            torch.nn.functional.grouped_mm(
                torch.randn(4, 20).bfloat16(),
                torch.randn(3, 20, 24).bfloat16(),
                offs=torch.tensor([1, 2, 4], dtype=torch.int32),
            )
    assert not moe.native_grouped_mm_ok(torch.randn(4, 16), torch.randn(3, 16, 24).bfloat16())  # dtype mismatch


def test_choose_path_thresholds():
    assert moe.choose_path(8, native=True, batched_max_tokens=16, compiling=False) == "batched_mm"
    assert moe.choose_path(17, native=True, batched_max_tokens=16, compiling=False) == "grouped_mm"
    assert moe.choose_path(17, native=False, batched_max_tokens=16, compiling=False) == "fallback"
    assert moe.choose_path(17, native=False, batched_max_tokens=16, compiling=False, device_type="cpu") == "cpu_loop"
    assert moe.choose_path(17, native=False, batched_max_tokens=16, compiling=True, device_type="cpu") == "fallback"
    assert (
        moe.choose_path(40, native=True, batched_max_tokens=16, compiled_batched_max_tokens=64, compiling=True)
        == "batched_mm"
    )
    assert moe.choose_path(1, native=True, batched_max_tokens=0, compiling=False) == "grouped_mm"


@pytest.mark.parametrize(
    "dtype,wdtype,tol",
    [
        (torch.float32, torch.float32, 1e-6),
        (torch.bfloat16, torch.bfloat16, 1e-2),
        (torch.bfloat16, torch.float32, 1e-2),
    ],
)
def test_combine_slots_matches_weighted_sum(dtype, wdtype, tol, rng_seed):
    n, k, h = 7, 3, 24
    rows = torch.randn(n * k, h).to(dtype)
    w = torch.rand(n, k).to(wdtype)
    ref = (rows.double().view(n, k, h) * w.double().unsqueeze(-1)).sum(1)
    out = moe.combine_slots(rows, w, n, k)
    assert out.shape == (n, h)
    assert (out.double() - ref).norm() / ref.norm() < tol
    assert torch.equal(moe.combine_slots(rows, None, n, k), rows.view(n, k, h).sum(1))


def test_unroute_runs_fewer_kernels_than_multiply_then_sum(rng_seed):
    """The prefill trim: un-sorting and combining the top-k slots takes one scatter and one bmm
    (no gather of sorted weights, no [S, H] product), counted as aten calls."""
    from mpsboost.bench import ModuleOps

    n, k, e, h = 16, 4, 8, 32
    idx = torch.stack([torch.randperm(e)[:k] for _ in range(n)])
    w = torch.rand(n, k).softmax(-1)
    routing = moe.route(idx, w, e)
    rows = torch.randn(n * k, h)
    with ModuleOps() as c:
        out = moe.unroute(rows, routing, sentinels=False)
    heavy = [
        op
        for op in c.names
        if op
        not in (
            "aten.view",
            "aten.reshape",
            "aten._unsafe_view",
            "aten.squeeze",
            "aten.empty_like",
            "aten.unsqueeze",
            "aten.expand",
        )
    ]
    assert heavy == ["aten.index_copy_", "aten.bmm"], c.ops
    ref = (rows[torch.argsort(routing.perm)].view(n, k, h) * w.unsqueeze(-1)).sum(1)
    assert (out - ref).norm() / ref.norm() < 1e-6


def test_host_loop_for_many_tokens_without_a_grouped_kernel(rng_seed):
    """MPS before 2.15 (no grouped kernel), eager, many routed tokens: a per-expert loop with the offsets read on
    the host, not the dense fallback (E/k times the routed FLOPs); the same result as the dense path."""
    assert moe.choose_path(4096, native=False, batched_max_tokens=32, compiling=False, device_type="mps") == "host_loop"
    assert moe.choose_path(4096, native=False, batched_max_tokens=32, compiling=True, device_type="mps") == "fallback"
    assert moe.choose_path(8, native=False, batched_max_tokens=32, compiling=False, device_type="mps") == "batched_mm"
    e, h, i = 8, 16, 8
    up, down = torch.randn(e, 2 * i, h), torch.randn(e, h, i)
    act = lambda t: torch.nn.functional.silu(t[..., :i]) * t[..., i:]  # noqa: E731
    idx, w = _routing(37, e, 2)
    x = torch.randn(37, h)
    kw = dict(up_weight=up, down_weight=down, activation=act)
    ref = moe.routed_experts(x, idx, w, path="fallback", **kw)
    got = moe.routed_experts(x, idx, w, path="host_loop", **kw)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
