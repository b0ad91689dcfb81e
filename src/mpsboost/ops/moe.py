"""Routed mixture-of-experts on the device: routing, grouped linear layers, the whole experts call.

Every function here is free of host synchronisation: no ``.item()``, ``.tolist()``, ``nonzero``,
``bincount`` (it syncs on CUDA) and no Python loop whose trip count depends on tensor values. Shapes
are the only host-side facts used to choose a path, so the same code runs under CUDA graphs and
``torch.compile(fullgraph=True)``. Two paths of ``grouped_linear`` are the exceptions, and the recipes choose
them only outside traced code: ``cpu_loop`` (host memory, nothing to wait for) and ``host_loop`` (eager
prefill on MPS before 2.15, which has no grouped kernel: one read of the offsets, then one matmul per expert
that has rows; stock transformers reads them on the host there too).

Vocabulary:

* ``N`` tokens, ``k`` experts per token (top-k), ``S = N * k`` routed (token, expert) pairs, ``E`` experts.
* Weight layouts follow transformers' ``use_experts_implementation``: ``transposed=False`` means
  ``weight[E, out, in]`` (Qwen3-MoE, Mixtral, DeepSeek-V3, ...); ``transposed=True`` means
  ``weight[E, in, out]`` (gpt-oss).

The public API, stable for other recipes (FP8 expert weights reuse it):

* :func:`route` -> :class:`Routing`: pairs sorted by expert, int32 offsets from a device-side histogram.
* :func:`grouped_linear`: ``x_sorted @ weight[e]`` for each row's expert, by one of :data:`PATHS`.
* :func:`unroute`: back to token order, weighted and summed over the top-k slots.
* :func:`routed_experts`: the whole experts call (up or gate/up, activation, down, routing weights).
* :func:`choose_path`: which path for a routed-pair count, given the thresholds (they arrive as arguments:
  the moe_experts recipe reads them from its tuning files) and whether the native kernel runs here.

This module never imports diffusers or transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

__all__ = [
    "PATHS",
    "BACKING",
    "Routing",
    "route",
    "expert_counts",
    "grouped_linear",
    "unroute",
    "routed_experts",
    "native_grouped_mm_ok",
    "combine_slots",
    "grouped_mm_widths_ok",
    "choose_path",
    "route_softmax_topk",
    "BlockWeights",
    "sparse_moe_block",
]

# The three ways to run routed experts, and the words the patch report uses for them.
PATHS = ("grouped_mm", "batched_mm", "fallback", "cpu_loop", "host_loop")
BACKING = {
    "grouped_mm": "grouped_mm, offsets on device",
    "batched_mm": "batched_mm",
    "fallback": "sync-free fallback",
    # CPU tensors only: reading offsets there is no device synchronisation, and one matmul per
    # expert beats the dense fallback by far (the moe-cpu records).
    "cpu_loop": "per-expert loop (CPU, offsets read on the host)",
    # A device without a grouped kernel (MPS before 2.15), many tokens, eager: one host read of the offsets
    # per projection, then one mm per expert that has rows. The dense fallback would do E/k times the routed
    # FLOPs (32x for 256 experts top-8: the prefill regression seen under Mac 2.14.1 decisions, experts
    # 35 -> 113 ms at 512 tokens on the GPU proxy); transformers' own grouped path on MPS <= 2.14 counts rows
    # with histc (about 0.17 ms per bin there, pytorch#198304) and loops over every group on the host too.
    "host_loop": "per-expert loop, offsets read on the host (no grouped kernel on this device)",
}

# Rows per chunk of the dense fallback: bounds its [E, rows, out] intermediate. A constant (not a
# function of the data), so the chunk loop is a fixed Python loop over the input's shape.
_FALLBACK_CHUNK_ROWS = 256


# ----------------------------------------------------------------------------------------- routing


@dataclass(frozen=True)
class Routing:
    """Routed pairs sorted by expert. All tensors live on the device of the routing input.

    ``perm[i]`` is the index, in the flattened ``(token, slot)`` order of ``top_k_index.reshape(-1)``,
    of the i-th sorted pair; ``sorted_token_idx = perm // top_k``. ``expert_of_sorted`` is ascending;
    ids ``>= num_experts`` (transformers' expert-parallel sentinels) sort last and are not counted,
    so rows past ``offsets[-1]`` belong to no expert. ``offsets`` are the int32 cumulative ends
    (``offsets[e]`` = pairs of experts ``0..e``), the format of
    ``torch.nn.functional.grouped_mm(..., offs=offsets)``; :attr:`counts` are the pairs per expert.
    """

    num_tokens: int
    top_k: int
    num_experts: int
    perm: torch.Tensor
    sorted_token_idx: torch.Tensor
    weights: torch.Tensor  # [N, k] routing weights in (token, slot) order
    expert_of_sorted: torch.Tensor
    offsets: torch.Tensor

    @property
    def sorted_weights(self) -> torch.Tensor:
        """Routing weights in sorted order ``[S]`` (a gather, computed on access)."""
        return self.weights.reshape(-1)[self.perm]

    @property
    def num_pairs(self) -> int:
        return self.num_tokens * self.top_k

    @property
    def counts(self) -> torch.Tensor:
        """Pairs per expert, int32 ``[num_experts]`` (computed on access, on the device)."""
        return torch.diff(self.offsets, prepend=self.offsets.new_zeros(1))


def expert_counts(
    expert_ids: torch.Tensor, num_experts: int, *, method: str = "scatter_add", histc_int: bool = False
) -> torch.Tensor:
    """Pairs per expert as int32 ``[num_experts]``, computed on the device; ids ``>= num_experts`` are dropped.

    ``method="scatter_add"`` (default) adds ones into ``num_experts + 1`` int32 bins, the last one
    collecting out-of-range ids: exact, deterministic, and available on CPU, CUDA and MPS.
    ``method="histc"`` uses ``torch.histc``; it takes integer input only where the gate's
    ``histc_int`` says so (not on MPS: ostris/ai-toolkit#858), float input otherwise. ``bincount``
    is not offered: it reads its maximum on the host (a sync on CUDA).
    """
    ids = expert_ids.reshape(-1)
    if method == "scatter_add":
        bins = ids.clamp(min=0, max=num_experts).to(torch.int64)
        counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=ids.device)
        counts.scatter_add_(0, bins, torch.ones_like(bins, dtype=torch.int32))
        return counts[:num_experts]
    if method == "histc":
        src = ids if histc_int else ids.float()
        return torch.histc(src, bins=num_experts, min=0, max=num_experts - 1).to(torch.int32)
    raise ValueError(f"expert_counts(method={method!r}): accepted methods are 'scatter_add' and 'histc'")


def route(
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    num_experts: int,
    *,
    counts_method: str = "searchsorted",
    histc_int: bool = False,
) -> Routing:
    """Sort the ``[N, k]`` routing by expert and compute the group offsets, all on the device.

    ``top_k_index`` ``[N, k]`` integer expert ids, ``top_k_weights`` ``[N, k]`` routing weights.
    The sort is stable, so pairs of one expert keep token order (reproducible results).
    ``counts_method``: ``"searchsorted"`` (default: the offsets are the positions in the sorted ids
    where each expert ends, two kernels) or a method of :func:`expert_counts` followed by a cumsum.
    """
    if top_k_index.dim() != 2 or top_k_weights.shape != top_k_index.shape:
        raise ValueError(
            f"route() needs top_k_index and top_k_weights of the same shape [num_tokens, top_k]; got "
            f"{tuple(top_k_index.shape)} and {tuple(top_k_weights.shape)}"
        )
    n, k = top_k_index.shape
    ids = top_k_index.reshape(-1)
    expert_of_sorted, perm = torch.sort(ids, stable=True)
    if counts_method == "searchsorted":
        bounds = torch.arange(num_experts, device=ids.device, dtype=expert_of_sorted.dtype)
        offsets = torch.searchsorted(expert_of_sorted, bounds, right=True, out_int32=True)
    else:
        counts = expert_counts(expert_of_sorted, num_experts, method=counts_method, histc_int=histc_int)
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    return Routing(
        num_tokens=n,
        top_k=k,
        num_experts=num_experts,
        perm=perm,
        sorted_token_idx=torch.div(perm, k, rounding_mode="floor"),
        weights=top_k_weights,
        expert_of_sorted=expert_of_sorted,
        offsets=offsets,
    )


def unroute(pair_out: torch.Tensor, routing: Routing, *, weighted: bool = True, sentinels: bool = True) -> torch.Tensor:
    """``[S, H]`` rows in sorted order -> ``[N, H]``: multiply by the routing weight, sum the k slots.

    Rows go back to (token, slot) order first (one scatter, ``index_copy_``, as ``perm`` is a
    permutation); then, where the routing weights have the rows' dtype, one batched ``[1, k] @ [k, H]``
    product per token weights and sums the k slots at once (fp32 accumulation inside the matmul,
    deterministic, no gather of sorted weights, no ``[S, H]`` product written and read back: two
    kernels fewer per call than multiply-then-sum). Otherwise (e.g. fp32 weights with bf16 rows) the
    product promotes as transformers' does and the sum runs over a ``[N, k, H]`` view.
    ``sentinels=True`` zeroes rows of pairs routed to ids >= num_experts (their rows past
    ``offsets[-1]`` are uninitialised by grouped_mm); pass False when no id can be out of range.
    """
    if sentinels:
        pair_out = pair_out.masked_fill((routing.expert_of_sorted >= routing.num_experts).unsqueeze(-1), 0)
    if torch.are_deterministic_algorithms_enabled():
        inv = torch.empty_like(routing.perm).scatter_(
            0, routing.perm, torch.arange(routing.perm.numel(), device=routing.perm.device)
        )
        flat = pair_out.index_select(0, inv)
    else:
        # perm is a permutation (unique indices): one scatter of rows back to (token, slot) order.
        flat = torch.empty_like(pair_out).index_copy_(0, routing.perm, pair_out)
    return combine_slots(flat, routing.weights if weighted else None, routing.num_tokens, routing.top_k)


def combine_slots(flat: torch.Tensor, weights: torch.Tensor | None, num_tokens: int, top_k: int) -> torch.Tensor:
    """``[N*k, H]`` rows in (token, slot) order -> ``[N, H]``: ``sum_j weights[n, j] * rows[n, j]``."""
    rows = flat.view(num_tokens, top_k, -1)
    if weights is None:
        return rows.sum(dim=1)
    if weights.dtype == flat.dtype:
        return torch.bmm(weights.reshape(num_tokens, 1, top_k), rows).squeeze(1)
    return (rows * weights.reshape(num_tokens, top_k, 1)).sum(dim=1)


# ----------------------------------------------------------------------------------------- grouped linear


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def native_grouped_mm_ok(x: torch.Tensor, weight_kn: torch.Tensor, *more_kn: torch.Tensor) -> bool:
    """Whether the native grouped matmul runs ``x @ weight_kn[e]`` here without a host sync or an error.

    ``more_kn``: the weights of the products that follow (a down projection ``[E, I, H]``), checked alike:
    their row stride is the width of their input rows too (the activation, contiguous ``[S, I]``).

    Static facts only (device, dtype, strides, alignment). The torch version and compute capability
    are the gate's business (feature ``grouped_mm``), decided before this is called:

    * CUDA: only bf16 reaches the CUTLASS kernel that reads offsets on the device; other dtypes go
      to ATen's fallback, which copies ``offs`` to the host.
    * CPU (torch >= 2.10) and MPS (torch >= 2.15): every non-unit stride must be a multiple of 16 bytes
      and the data 16-byte aligned, else ``grouped_mm`` raises "strides should be multiple of 16 bytes"
      (both kernels begin with ATen's ``_grouped_mm_validate_inputs``, GroupedMMUtils.h).
    * under ``torch.compile``: the meta kernel accepts bf16 only (any device).
    """
    if any(w.dtype != x.dtype for w in (weight_kn, *more_kn)):
        return False
    if _compiling():
        return x.dtype == torch.bfloat16
    dev = weight_kn.device.type
    if dev == "cuda":
        return x.dtype == torch.bfloat16
    if dev in ("cpu", "mps"):
        if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return False
        es = x.element_size()
        for t in (x, weight_kn, *more_kn):
            if t.data_ptr() % 16:
                return False
            for size, stride in zip(t.shape, t.stride()):
                if stride != 1 and size > 1 and (stride * es) % 16:
                    return False
        return True
    return False


def _grouped_mm_fn() -> Callable[..., torch.Tensor] | None:
    fn = getattr(torch.nn.functional, "grouped_mm", None)
    return fn if fn is not None else getattr(torch, "_grouped_mm", None)


def _as_kn(weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    """``weight`` as ``[E, in, out]`` (a view; no copy)."""
    return weight if transposed else weight.transpose(-2, -1)


BATCHED_FORMS = ("auto", "bmm", "fused")


def _batched_rows(
    x: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, transposed: bool, form: str = "auto"
) -> torch.Tensor:
    """``x[s] @ weight[ids[s]]`` for every row, by gathering one weight copy per row.

    ``form="bmm"``: one gather and one ``bmm`` (transformers' batched_mm). ``form="fused"``: the
    same product as multiply-and-sum over the gathered weights; under ``torch.compile`` inductor
    fuses the gather into the reduction, so no weight copy is materialised and each selected expert
    is read once (a matrix-vector product per row, the decode case); in eager mode it would
    materialise the product, so ``"auto"`` means fused while compiling and bmm otherwise. fp32
    accumulation either way, like ``bmm``.
    """
    if form not in BATCHED_FORMS:
        raise ValueError(f"batched form {form!r}: accepted {', '.join(BATCHED_FORMS)}")
    w = weight[ids]  # [S, out, in] or [S, in, out]
    if form == "fused" or (form == "auto" and _compiling()):
        if transposed:
            return (x.float().unsqueeze(-1) * w.float()).sum(dim=1).to(x.dtype)
        return (w.float() * x.float().unsqueeze(1)).sum(dim=-1).to(x.dtype)
    if transposed:
        return torch.bmm(x.unsqueeze(1), w).squeeze(1)
    return torch.bmm(w, x.unsqueeze(-1)).squeeze(-1)


def _dense_rows(x: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, transposed: bool) -> torch.Tensor:
    """``x[s] @ weight[ids[s]]`` by multiplying every row with every expert, then picking each row's.

    The fallback of :func:`grouped_linear` where no native grouped kernel exists: E times the FLOPs,
    but each expert's weight is read once per chunk and nothing leaves the device. Rows whose id is
    out of range get zeros.
    """
    e = weight.shape[0]
    w_kn = _as_kn(weight, transposed)  # [E, in, out]
    outs = []
    for start in range(0, x.shape[0], _FALLBACK_CHUNK_ROWS):  # static trip count: the input's shape
        xs = x[start : start + _FALLBACK_CHUNK_ROWS]
        idx = ids[start : start + _FALLBACK_CHUNK_ROWS]
        y = torch.matmul(xs.unsqueeze(0), w_kn)  # [E, rows, out]
        pick = idx.clamp(0, e - 1).view(1, -1, 1).expand(1, xs.shape[0], y.shape[-1])
        sel = y.gather(0, pick).squeeze(0)
        outs.append(torch.where((idx < e).unsqueeze(-1), sel, torch.zeros((), dtype=sel.dtype, device=sel.device)))
    if not outs:
        return x.new_zeros(0, w_kn.shape[-1])
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


def grouped_linear(
    x_sorted: torch.Tensor,
    weight: torch.Tensor,
    offsets: torch.Tensor | None = None,
    *,
    path: str = "grouped_mm",
    bias: torch.Tensor | None = None,
    expert_of_sorted: torch.Tensor | None = None,
    transposed: bool = False,
    batched_form: str = "auto",
    sentinels: bool = True,
) -> torch.Tensor:
    """Per-expert linear layer over rows grouped by expert: ``y[s] = x_sorted[s] @ W[e(s)] (+ b[e(s)])``.

    ``x_sorted`` ``[S, in]``; ``weight`` ``[E, out, in]`` (``transposed=True``: ``[E, in, out]``);
    ``bias`` ``[E, out]``. Paths:

    * ``"grouped_mm"``: one native grouped matmul reading ``offsets`` (int32 cumulative ends, from
      :func:`route`) on the device. Rows past ``offsets[-1]`` come back uninitialised. The caller
      checks :func:`native_grouped_mm_ok` (and the gate) first.
    * ``"batched_mm"``: gathers each row's expert weight (needs ``expert_of_sorted``); rows need not
      be sorted. Cheapest for a handful of rows (decoding).
    * ``"fallback"``: dense over all experts, then each row's pick (needs ``expert_of_sorted``).
    * ``"cpu_loop"``: CPU tensors only: one ``mm`` per expert, group bounds read from ``offsets``
      on the host (no device exists to synchronise with). Not traceable by ``torch.compile``.

    ``expert_of_sorted`` is also needed for ``bias``. ``batched_form`` picks the batched_mm
    formulation (see ``_batched_rows``). ``sentinels=False`` promises every id is < E and saves the
    clamps that keep out-of-range ids (expert-parallel sentinels) in bounds.
    """
    if weight.dim() != 3 or x_sorted.dim() != 2:
        raise ValueError(
            f"grouped_linear needs x_sorted [S, in] and weight [E, out, in] (or [E, in, out] with transposed=True); "
            f"got {tuple(x_sorted.shape)} and {tuple(weight.shape)}"
        )
    x = x_sorted.to(weight.dtype)
    if path == "grouped_mm":
        if offsets is None:
            raise ValueError("grouped_linear(path='grouped_mm') needs offsets (int32 cumulative ends, see route())")
        fn = _grouped_mm_fn()
        if fn is None:
            raise RuntimeError(
                f"torch {torch.__version__} has neither torch.nn.functional.grouped_mm nor torch._grouped_mm; "
                "use path='batched_mm' or 'fallback'"
            )
        out = fn(x, _as_kn(weight, transposed), offs=offsets)
    elif path in ("cpu_loop", "host_loop"):
        if offsets is None or (path == "cpu_loop" and (x.device.type != "cpu" or offsets.device.type != "cpu")):
            raise ValueError(
                "grouped_linear(path='cpu_loop') needs CPU tensors and offsets; on a device use 'fallback'"
            )
        w_kn = _as_kn(weight, transposed)
        pieces, start = [], 0
        # cpu_loop: host memory, no device to wait for; host_loop: one device sync (eager only, many rows)
        for e, end in enumerate(offsets.tolist()):
            if end > start:
                pieces.append(x[start:end] @ w_kn[e])
            start = end
        if start < x.shape[0]:  # rows of no expert (sentinels): zeros
            pieces.append(x.new_zeros(x.shape[0] - start, w_kn.shape[-1]))
        out = torch.cat(pieces) if pieces else x.new_zeros(0, w_kn.shape[-1])
    elif path in ("batched_mm", "fallback"):
        if expert_of_sorted is None:
            raise ValueError(f"grouped_linear(path={path!r}) needs expert_of_sorted (each row's expert id)")
        if path == "batched_mm":
            ids = expert_of_sorted.clamp(0, weight.shape[0] - 1) if sentinels else expert_of_sorted
            out = _batched_rows(x, weight, ids, transposed, batched_form)
        else:
            out = _dense_rows(x, weight, expert_of_sorted, transposed)
    else:
        raise ValueError(f"grouped_linear(path={path!r}): accepted paths are {', '.join(PATHS)}")
    if bias is not None:
        if expert_of_sorted is None:
            raise ValueError("grouped_linear(bias=...) needs expert_of_sorted to pick each row's bias")
        out = out + bias[expert_of_sorted.clamp(0, weight.shape[0] - 1) if sentinels else expert_of_sorted]
    return out


# ----------------------------------------------------------------------------------------- the experts call


def routed_experts(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *,
    up_weight: torch.Tensor | tuple[torch.Tensor, ...],
    down_weight: torch.Tensor,
    activation: Callable[..., torch.Tensor],
    up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    transposed: bool = False,
    down_transposed: bool | None = None,
    post: Callable[[torch.Tensor], torch.Tensor] | None = None,
    path: str = "grouped_mm",
    counts_method: str = "searchsorted",
    histc_int: bool = False,
    batched_form: str = "auto",
    sentinels: bool = True,
) -> torch.Tensor:
    """``sum_j w[n, j] * down(activation(up(x[n])))`` over each token's experts ``top_k_index[n, j]``.

    ``hidden_states`` ``[N, H]``; ``up_weight`` ``[E, U, H]`` (gate and up stacked as transformers
    stores them; ``activation`` maps ``[S, U] -> [S, I]``, e.g. transformers' ``_apply_gate``), or a
    tuple of such weights (DBRX's separate gate and up), whose outputs ``activation`` receives as
    separate arguments. ``down_weight`` ``[E, H, I]``. ``transposed=True``: weights are
    ``[E, in, out]``; ``down_transposed`` overrides it for the down projection. ``post`` is an
    optional per-pair function after the down projection (a post-expert norm). Returns ``[N, H]`` in
    ``hidden_states.dtype``.

    ``path`` as in :func:`grouped_linear`; ``"fallback"`` runs the dense form over tokens (E x N rows
    instead of E x S) and ``"batched_mm"`` skips the sort entirely. ``sentinels=True`` (default)
    lets ids >= E (transformers' expert-parallel sentinels) contribute nothing; False saves the
    masking kernels when every id is in range.
    """
    if path not in PATHS:
        raise ValueError(f"routed_experts(path={path!r}): accepted paths are {', '.join(PATHS)}")
    ups = up_weight if isinstance(up_weight, tuple) else (up_weight,)
    dt = transposed if down_transposed is None else down_transposed
    n, hdim = hidden_states.shape
    k = top_k_index.shape[-1]
    num_experts = ups[0].shape[0]
    if n == 0:
        return hidden_states.new_zeros(0, hdim)

    if path == "fallback" and post is None:
        return _dense_experts(
            hidden_states, top_k_index, top_k_weights, ups, down_weight, activation, up_bias, down_bias, transposed, dt
        )

    if path == "batched_mm":
        # Pairs stay in (token, slot) order: no sort, no histogram, no unsort.
        ids = top_k_index.reshape(-1)
        x = hidden_states.unsqueeze(1).expand(n, k, hdim).reshape(n * k, hdim)
        if sentinels:
            valid = ids < num_experts
            ids = ids.clamp(0, num_experts - 1)
        hs = [
            grouped_linear(
                x,
                w,
                path="batched_mm",
                bias=up_bias,
                expert_of_sorted=ids,
                transposed=transposed,
                batched_form=batched_form,
                sentinels=False,
            )
            for w in ups
        ]
        h = activation(*hs)
        y = grouped_linear(
            h,
            down_weight,
            path="batched_mm",
            bias=down_bias,
            expert_of_sorted=ids,
            transposed=dt,
            batched_form=batched_form,
            sentinels=False,
        )
        if post is not None:
            y = post(y)
        if sentinels:
            y = y.masked_fill(~valid.unsqueeze(-1), 0)
        return combine_slots(y, top_k_weights, n, k).to(hidden_states.dtype)

    routing = route(top_k_index, top_k_weights, num_experts, counts_method=counts_method, histc_int=histc_int)
    x = hidden_states.index_select(0, routing.sorted_token_idx)
    hs = [
        grouped_linear(
            x,
            w,
            routing.offsets,
            path=path,
            bias=up_bias,
            expert_of_sorted=routing.expert_of_sorted,
            transposed=transposed,
            sentinels=sentinels,
        )
        for w in ups
    ]
    h = activation(*hs)
    y = grouped_linear(
        h,
        down_weight,
        routing.offsets,
        path=path,
        bias=down_bias,
        expert_of_sorted=routing.expert_of_sorted,
        transposed=dt,
        sentinels=sentinels,
    )
    if post is not None:
        y = post(y)
    return unroute(y, routing, sentinels=sentinels).to(hidden_states.dtype)


def _dense_experts(
    hidden_states,
    top_k_index,
    top_k_weights,
    ups,
    down_weight,
    activation,
    up_bias,
    down_bias,
    transposed,
    down_transposed,
) -> torch.Tensor:
    """Every expert on every token, combined with a dense ``[N, E]`` weight matrix (zeros off the top-k).

    Used where no native grouped kernel exists (MPS before torch 2.15): static shapes, no host
    sync, each expert's weights read once per chunk of tokens; E/k times the FLOPs of routed work.
    """
    n, hdim = hidden_states.shape
    e = ups[0].shape[0]
    valid = top_k_index < e
    dense_w = torch.zeros(n, e + 1, dtype=top_k_weights.dtype, device=top_k_weights.device)
    dense_w.scatter_add_(
        1, top_k_index.clamp(0, e).to(torch.int64), torch.where(valid, top_k_weights, torch.zeros_like(top_k_weights))
    )
    dense_w = dense_w[:, :e]
    ups_kn = [_as_kn(w, transposed) for w in ups]
    down_kn = _as_kn(down_weight, down_transposed)
    outs = []
    for start in range(0, n, _FALLBACK_CHUNK_ROWS):  # static trip count: the input's shape
        xs = hidden_states[start : start + _FALLBACK_CHUNK_ROWS].to(ups_kn[0].dtype)
        rows = xs.shape[0]
        hs = []
        for w_kn in ups_kn:
            h = torch.matmul(xs.unsqueeze(0), w_kn)  # [E, rows, U]
            if up_bias is not None:
                h = h + up_bias.unsqueeze(1)
            hs.append(h.reshape(e * rows, -1))
        h = activation(*hs)
        y = torch.matmul(h.view(e, rows, -1).to(down_kn.dtype), down_kn)  # [E, rows, H]
        if down_bias is not None:
            y = y + down_bias.unsqueeze(1)
        w = dense_w[start : start + rows].transpose(0, 1).unsqueeze(-1)  # [E, rows, 1]
        outs.append((y * w).sum(dim=0))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
    return out.to(hidden_states.dtype)


# ----------------------------------------------------------------------------------------- choosing a path


def grouped_mm_widths_ok(widths, dtype: torch.dtype, device_type: str) -> tuple[bool, str]:
    """Whether the native grouped matmul takes operands whose row widths are ``widths`` (elements),
    in ``dtype`` on ``device_type``; (False, why) if not. Static facts, for patch time.

    Every operand of both projections counts: the input rows (hidden width), the up weight
    (hidden and up widths), the activation output and down weight (intermediate and hidden widths).
    On CPU (torch >= 2.10) and MPS (torch >= 2.15) each non-unit stride must be a multiple of 16 bytes,
    else grouped_mm raises "strides should be multiple of 16 bytes" (both kernels begin with ATen's
    ``_grouped_mm_validate_inputs``); CUDA's kernel reads offsets on the device for bf16 only (other
    dtypes copy them to the host).
    """
    es = torch.empty((), dtype=dtype).element_size()
    if device_type in ("cpu", "mps"):
        dev = device_type.upper()
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return False, f"{dev} grouped_mm has no {dtype} kernel"
        bad = sorted({w for w in widths if (w * es) % 16})
        if bad:
            return False, (
                f"{dev} grouped_mm needs row strides that are multiples of 16 bytes; widths {bad} x {es} bytes "
                f"({dtype}) are not"
            )
        return True, ""
    if device_type == "cuda" and dtype != torch.bfloat16:
        return False, f"CUDA's grouped_mm reads offsets on the device for bf16 only, these weights are {dtype}"
    return True, ""


# grouped_mm vs batched_mm at decode on MPS (torch >= 2.15; read in pytorch's source,
# aten/src/ATen/native/mps/operations/GroupedMM.mm and kernels/GroupedMM.metal, pytorch#194917/#194933):
# ``_grouped_mm_mps`` with a 2-D input and 3-D weights encodes ONE compute dispatch (``grouped_mm_rows`` or,
# with Metal Performance Primitives, ``grouped_mm_rows_mpp``), the offsets bound as a device buffer and never
# read on the host. Its grid is ceil(n / BN) x (ceil(m / BM) + groups) threadgroups; in each, one thread walks
# the offsets to find its (group, rows) and padding tiles return before loading anything, so an expert with no
# rows has no tile and its weights are never read; each routed expert's weights are read once per column tile
# (BM = 16 rows at decode: one useful row in 16, compute is not the bound there). batched_mm instead gathers
# one weight copy per (token, expert) pair (``weight[ids]``: read, write, then ``bmm`` reads the copy: three
# times the routed experts' bytes) and dispatches more ops (repeat_interleave, two gathers, two bmm, the
# weighting, the sum). So with the native kernel the decode path is grouped_mm from the first pair: the MPS
# tuning file's batched_max_tokens = 0, and transformers' decode-time switch to batched_mm is held off on MPS.
def choose_path(
    num_pairs: int,
    *,
    native: bool,
    batched_max_tokens: int,
    compiled_batched_max_tokens: int | None = None,
    compiling: bool | None = None,
    device_type: str = "",
) -> str:
    """The path for one experts call of ``num_pairs`` routed pairs.

    ``native``: the gate allows the native grouped matmul here and :func:`native_grouped_mm_ok`
    holds for these tensors. A static decision (shapes only), so no host sync. Without a native
    kernel, CPU tensors in eager mode take the per-expert loop (nothing to synchronise with on the
    host); everything else, and CPU under ``torch.compile``, takes the sync-free fallback.
    """
    if compiling is None:
        compiling = _compiling()
    bound = (
        compiled_batched_max_tokens if (compiling and compiled_batched_max_tokens is not None) else batched_max_tokens
    )
    if num_pairs <= bound:
        return "batched_mm"
    if native:
        return "grouped_mm"
    if not compiling and device_type in ("cpu", "mps"):
        return "cpu_loop" if device_type == "cpu" else "host_loop"
    return "fallback"


# ----------------------------------------------------------------------------------------- a whole sparse MoE block


def route_softmax_topk(logits: torch.Tensor, top_k: int, *, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' softmax top-k router on ``logits`` ``[N, E]``: (float32 weights ``[N, k]``, ids ``[N, k]``).

    ``norm=True`` (renormalised top-k): softmax is monotonic, so the top-k of the probabilities are the
    top-k of the logits, and the renormalised weights are the softmax over those k logits alone
    (``exp(l_i) / sum_topk exp(l_j)``): two kernels instead of softmax, top-k, sum and divide.
    """
    if norm:
        vals, ids = torch.topk(logits, top_k, dim=-1)
        return torch.softmax(vals, dim=-1, dtype=torch.float32), ids
    return torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), top_k, dim=-1)


@dataclass(frozen=True)
class BlockWeights:
    """What :func:`sparse_moe_block` reads, in the layouts it multiplies (views, but ``inputs_t``).

    ``router_t`` ``[H, E]``: the router's weight transposed; ``shared_t`` (with a shared expert): its gate's
    ``[H, 1]``, gate projection's and up projection's ``[H, I_s]``, transposed (each the model's own weight,
    in its own storage); any of them, and ``shared_down_t``, may instead be the layer itself (a callable:
    one another recipe stores in its own format, e.g. fp8, runs its own forward).
    ``gate_up_kn`` ``[E, H, 2I]`` and ``down_kn`` ``[E, I, H]``:
    the routed experts as ``[E, in, out]``. ``gate_up`` / ``down``: the same as stored (``[E, out, in]``),
    row-gathered by the path without a grouped kernel. ``bounds`` ``[1, E]``: ``arange(E)`` (searchsorted
    bounds of the offsets), ``zeros`` ``[k]``: the row index of the one token of a single-token step.
    ``inputs_t`` ``[H, E + 1 + 2 I_s]`` (optional, the one field that is a copy): the router's and the shared
    expert's input weights side by side, ``splits`` their widths: one matmul for all four.
    """

    router_t: torch.Tensor
    shared_t: tuple[Any, Any, Any] | None
    gate_up_kn: torch.Tensor | None
    down_kn: torch.Tensor | None
    gate_up: torch.Tensor | None
    down: torch.Tensor | None
    shared_down_t: Any
    bounds: torch.Tensor
    zeros: torch.Tensor
    inputs_t: torch.Tensor | None = None
    splits: tuple[int, ...] | None = None


# _ascending: the decode step orders its few routed ids with ``topk(largest=False)``, not ``sort``. On MPS both
# run the same one-dispatch block-sort body (aten/src/ATen/native/mps/kernels: ``sort_block_*`` and
# ``sort_block_topk_*``, both in the 2.15.0 macOS wheel, long included). On CUDA ``sort`` of a few elements
# goes through cub's segmented sort with three device-to-device copies, nearly twice ``topk``'s host time a
# call (stock's own calls, profiled: the profile_decode records). Not stable: ties (one
# expert routed by several tokens) keep no token order, which the steps do not need (rows are put back by
# the permutation itself).
def _lin(x: torch.Tensor, w: Any) -> torch.Tensor:
    """``x @ w`` for a transposed weight, else ``w(x)``: a layer another recipe stores in its own format
    (fp8 codes and scales) runs its own forward (a host-side type check, the same at every call)."""
    return torch.mm(x, w) if isinstance(w, torch.Tensor) else w(x)


def sparse_moe_block(
    x: torch.Tensor,
    w: BlockWeights,
    *,
    top_k: int,
    norm: bool,
    cast_weights: bool,
    act_fn: Callable[[torch.Tensor], torch.Tensor],
    shared_act: Callable[[torch.Tensor], torch.Tensor] | None,
    path: str,
    experts: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    routing: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One softmax-routed sparse MoE block on ``x`` ``[N, H]`` (few tokens: decode): ``[N, H]``.

    ``out = sum_j w_j * expert_{e_j}(x) (+ sigmoid(x . g) * shared(x))``, the math of transformers'
    Qwen2/3/3.5-MoE, Qwen3-Next, Mixtral and OLMoE blocks, in few kernels:

    * one matmul each for the router logits, the shared expert's gate and its gate/up projections;
    * routing by :func:`route_softmax_topk`; for one token the k ids are put in ascending order and the weights
      follow them (no unsort later);
    * the routed experts (``path``): ``"grouped_mm"``, two native grouped matmuls over the k rows sorted by
      expert, offsets by one ``searchsorted`` on the device: each routed expert's weights are read once, the
      others not at all (MPS's kernel, pytorch#194917/#194933, reads the offsets on the device and its row
      tiles of empty groups exit); ``"gather"``, where no grouped kernel exists: the routed experts' weights
      gathered, then ``bmm`` (one copy of each routed expert); ``"module"``: ``experts(x, ids, weights)``,
      the experts module's own call (fp8 experts, an implementation the user chose);
    * the weighted sum over the k slots and the shared expert's gated output in one ``addmm``/``baddbmm``.

    ``cast_weights``: the routing weights are cast to the model dtype before the sum (all but Mixtral,
    whose weights stay float32 and whose sum runs in float32 as transformers' does).

    ``routing``: ``(weights [N, k], ids [N, k])`` as the block's router module returned them (its caller ran
    it, e.g. for a hook that records the router's output): used as they are, no router matmul here.
    """
    if path not in ("grouped_mm", "gather", "module") or (path == "module" and experts is None):
        raise ValueError(f"sparse_moe_block(path={path!r}): accepted 'grouped_mm', 'gather', 'module' (with experts)")

    def glu(h: torch.Tensor, dim: int = -1) -> torch.Tensor:
        gate, up = h.chunk(2, dim=dim)
        return act_fn(gate) * up

    n, hdim = x.shape
    shared = None
    if w.inputs_t is not None and shared_act is not None and routing is None:  # option fused_inputs: one matmul
        logits, g, sg, su = torch.mm(x, w.inputs_t).split(w.splits, dim=-1)
    else:
        logits = torch.mm(x, w.router_t) if routing is None else None
        if shared_act is not None:
            g_t, sg_t, su_t = w.shared_t
            g, sg, su = _lin(x, g_t), _lin(x, sg_t), _lin(x, su_t)
    if shared_act is not None:
        shared = _lin(shared_act(sg) * su, w.shared_down_t) * torch.sigmoid(g)
    one = n == 1 and path != "module"  # one token: combine by one addmm, in the order of ``ids``
    if routing is not None:
        weights, ids = routing
        if one and path == "grouped_mm":  # its k ids sorted (grouped rows), its weights in that order
            ids, perm = torch.topk(ids, top_k, dim=-1, largest=False)  # ascending (distinct ids): see _ascending
            weights = weights.gather(-1, perm)
    elif one and path == "grouped_mm":  # its k ids sorted (grouped rows), its weights in that order
        if norm:
            vals, ids = torch.topk(logits, top_k, dim=-1)
        else:
            vals, ids = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), top_k, dim=-1)
        ids, perm = torch.topk(ids, top_k, dim=-1, largest=False)  # ascending (distinct ids): see _ascending
        vals = vals.gather(-1, perm)
        weights = torch.softmax(vals, dim=-1, dtype=torch.float32) if norm else vals
    else:
        weights, ids = route_softmax_topk(logits, top_k, norm=norm)
    wdt = x.dtype if cast_weights else torch.float32
    weights = weights.to(wdt)
    if path == "module":
        routed = experts(x, ids, weights)
        return routed if shared is None else routed + shared
    k = top_k
    if path == "grouped_mm":
        fn = _grouped_mm_fn()
        if one:
            offs = torch.searchsorted(ids, w.bounds, right=True, out_int32=True).view(-1)
            rows = x.index_select(0, w.zeros)
        else:
            sids, perm = torch.topk(ids.view(-1), n * k, largest=False)  # ascending: see _ascending
            offs = torch.searchsorted(sids, w.bounds.view(-1), right=True, out_int32=True)
            rows = x.index_select(0, torch.div(perm, k, rounding_mode="floor"))
        h = glu(fn(rows, w.gate_up_kn, offs=offs))
        pair = fn(h, w.down_kn, offs=offs)  # [S, H], sorted by expert
        if not one:
            pair = torch.empty_like(pair).index_copy_(0, perm, pair)  # back to (token, slot) order
    else:  # gather: one copy of each routed expert's weights, then bmm
        flat = ids.view(-1)
        if one:
            rows = x.view(1, hdim, 1).expand(k, hdim, 1)
        else:
            rows = x.view(n, 1, hdim, 1).expand(n, k, hdim, 1).reshape(n * k, hdim, 1)
        h = glu(torch.bmm(w.gate_up.index_select(0, flat), rows), dim=-2)
        pair = torch.bmm(w.down.index_select(0, flat), h).view(n * k, hdim)
    if one:
        if not cast_weights and x.dtype != torch.float32:
            out = torch.mm(weights, pair.float())
            return (out if shared is None else out + shared).to(x.dtype)
        return torch.mm(weights, pair) if shared is None else torch.addmm(shared, weights, pair)
    if not cast_weights and x.dtype != torch.float32:
        pair = pair.float()
        out = torch.bmm(weights.view(n, 1, k), pair.view(n, k, hdim)).view(n, hdim)
        return (out if shared is None else out + shared).to(x.dtype)
    if shared is None:
        return torch.bmm(weights.view(n, 1, k), pair.view(n, k, hdim)).view(n, hdim)
    return torch.baddbmm(shared.view(n, 1, hdim), weights.view(n, 1, k), pair.view(n, k, hdim)).view(n, hdim)
