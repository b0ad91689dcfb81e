"""What one decode step of a Qwen3.5/3.6-MoE model costs, counted on the CPU: aten ops and bytes moved, per block.

On a Mac transformers runs eagerly: every aten op of a decode step is host time, and at real size the bytes it
moves are device time, so both counts are device-independent proxies of a Mac's decode (Mac decisions simulated
with ``Env.simulate``). The counting rules of the project's decode-ops tool (``shared/tools/decode_ops.py``), so
that tests and ``benchmarks/decode_cost.py`` report the same figures: every aten op dispatched counts one; an op
moves the bytes of its tensor inputs and of its outputs that are not views of an input (in-place and ``out=`` ops
write into an input); an op that launches nothing (below: views, aliases, bare allocations) moves nothing,
where the tool counted the bytes of an ``_unsafe_view``'s or an ``empty``'s output; row picking ops
(``index_select``, ``embedding``, ``index``, ``gather``) read what they pick; a grouped matmul (``_grouped_mm``,
and mpsboost's ``grouped_mm`` whose weights are fp8 codes, and ``affine_grouped_gemv`` whose are low-bit codes with
their scales and biases) reads the weights of the groups that have rows. ``tiny`` and ``medium`` are the tool's two
sizes (medium: the real model's widths, 4 layers, 32 experts top-8, a small vocabulary).

Dispatches beside ops (:func:`launches`, :func:`kind`): an aten op launches a kernel unless its schema says it
only relabels memory or allocates it:

* a view: a return aliases an input without writing it (the schema's alias annotation ``Tensor(a)``,
  ``OpOverload.is_view``: ``view``, ``t``, ``transpose``, ``select``, ``slice``, ``expand``, ``split``, ``alias``...);
* an ``inplace_view`` op (``torch.Tag.inplace_view``: ``squeeze_``, ``t_``, ``as_strided_``: metadata in place);
* a non-mutating op whose every tensor output shares storage with an input although its schema declares no alias
  (``_unsafe_view``, ``_reshape_alias``: checked on the call's tensors);
* an allocation that writes nothing (:data:`ALLOCATIONS`, the ``empty`` family, uninitialised by definition).

Every other op counts one dispatch (a multi-pass kernel such as ``topk``'s counts one: an undercount). Each
dispatch is then a Metal shader or an MPSGraph on a Mac, per torch release, from the wheel-read table
``mpsboost/data/mps_dispatch_kinds.json`` (``tools/mps_dispatch_kinds.py``): ``metal``, ``mpsgraph``, ``mixed``
(the release ships both paths and the binary does not say which a decode shape takes), ``unknown`` (neither
found); ops of the ``mpsboost`` namespace are mpsboost's own Metal kernels; an aten op with no row is
``unlisted`` (the tests keep that at zero). :func:`predict` turns the counts into a Mac's predicted step time.

Counted as a Mac dispatches, not as the CPU does (``as_on_mps``, on by default in :func:`decode_cost`): where
torch's MPS backend runs one kernel for a call that the CPU runs as a composite of several ops, the call counts
as that one op (:data:`MPS_ROUTES`). Two today. ``F.rms_norm`` with a weight of the input's dtype, which
``rms_norm_symint`` (``aten/src/ATen/native/layer_norm.cpp``) sends to ``_fused_rms_norm`` on MPS (a Metal
kernel: ``_fused_rms_norm_mps_dispatch.h`` in every macOS wheel since 2.12, ``data/mps_ops.json``) and to a
six-op composite (``pow``, ``mean``, ``add_``, ``rsqrt``, ``mul``, ``mul``) on the CPU; it reads the input and
the weight and writes the output (plus one ``clone`` for a non-contiguous input, its ``contiguous()``).
And ``F.linear`` of floating tensors: ``aten::linear`` has an MPS kernel of its own in every macOS wheel since 2.12
(``linear_mps_dispatch.h``, ``data/mps_ops.json``; ``_mps_linear`` in ``Linear.mm``: one
``MPSNDArrayMatrixMultiplication`` for contiguous operands on macOS 15+, an MPSGraph matmul otherwise, so its kind
is ``mixed``), where the CPU runs the composite ``t`` (a view) and ``mm``/``addmm`` (with ``view`` ops around a
3-D input): one op, the same bytes. Not modelled: an M1/M2 with K above 32768, where ``_mps_linear`` falls back
to ``mm`` and ``add_``. Anything that runs inside one recorded op (a registered operator's reference kernel)
is that op's, never recorded again. ``shared/tools/decode_ops.py`` counts the CPU's composites: its figures are
higher by five ops per RMS norm and one or more per linear.
"""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "ALLOCATIONS",
    "BLOCKS",
    "KINDS",
    "MPS_ROUTES",
    "ModuleOps",
    "OpRecorder",
    "build",
    "decode_cost",
    "kind",
    "launches",
]

BLOCKS = ("linear_attn", "self_attn", "mlp")
_SELECT = {"embedding", "index_select", "index", "gather"}
ALLOCATIONS = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})
KINDS = ("metal", "mpsgraph", "mixed", "unknown", "unlisted")
RELEASE = "2.15.0"  # the release whose table decode_cost counts by default


def launches(func, args, kwargs, out) -> bool:
    """Whether the aten op ``func`` (an ``OpOverload``) called on ``args``/``kwargs`` with result ``out`` launches
    a kernel: the rules of the module docstring."""
    if func.is_view or torch.Tag.inplace_view in func.tags:
        return False
    name = func.overloadpacket.__name__
    if name in ALLOCATIONS:
        return False
    if not func._schema.is_mutable:
        leaves = torch.utils._pytree.tree_leaves
        ins = {a.untyped_storage().data_ptr() for a in leaves((args, kwargs)) if isinstance(a, torch.Tensor)}
        outs = [o for o in leaves(out) if isinstance(o, torch.Tensor)]
        if outs and all(o.untyped_storage().data_ptr() in ins and o.numel() for o in outs):
            return False
    return True


@lru_cache(maxsize=None)
def _table(release: str) -> dict[str, str]:
    text = resources.files("mpsboost.data").joinpath("mps_dispatch_kinds.json").read_text()
    for w in json.loads(text)["wheels"]:
        if w["version"] == release:
            return {op: row["kind"] for op, row in w["ops"].items()}
    raise ValueError(f"mps_dispatch_kinds.json has no torch {release!r} wheel (tools/mps_dispatch_kinds.py writes it)")


# Ops counted in place of a CPU composite (MPS_ROUTES) whose row the wheel-read table does not have yet: the
# kind their MPS source shows, until tools/mps_dispatch_kinds.py (which has their rule) is rerun on the wheels;
# a row read from a wheel takes precedence.
_SOURCE_KINDS = {
    "linear": (
        "mixed",
        "aten/src/ATen/native/mps/operations/Linear.mm: _mps_linear encodes one MPSNDArrayMatrixMultiplication for "
        "contiguous operands on macOS 15+, an MPSGraph matmul otherwise",
    ),
    "_fused_rms_norm": (
        "metal",
        "aten/src/ATen/native/mps/operations/RMSNorm.mm: one compute pipeline rms_norm_<dtype> (rms_norm_looped_ "
        "above 4096), no MPSGraph",
    ),
}


def kind(func, release: str = RELEASE) -> str:
    """What a dispatch of ``func`` runs on a Mac with torch ``release``: one of :data:`KINDS`."""
    ns = func.namespace
    if ns == "mpsboost":
        return "metal"
    if ns != "aten":
        return "unlisted"
    name = func.overloadpacket.__name__
    row = _table(release).get(name)
    if row is None and name in _SOURCE_KINDS:
        return _SOURCE_KINDS[name][0]
    return row or "unlisted"


def build(size: str = "tiny", dtype: torch.dtype | None = None) -> torch.nn.Module:
    import transformers as t

    kw = dict(
        vocab_size=512,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        num_experts=8,
        num_experts_per_tok=2,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
    )
    if size == "medium":
        kw.update(
            hidden_size=2048,
            num_attention_heads=16,
            head_dim=256,
            moe_intermediate_size=512,
            shared_expert_intermediate_size=512,
            num_experts=32,
            num_experts_per_tok=8,
            linear_num_key_heads=16,
            linear_num_value_heads=32,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
        )
    if dtype is None:
        dtype = torch.bfloat16 if size == "medium" else torch.float32
    torch.manual_seed(0)
    # Made in its dtype (transformers' from-config path: the parameters initialised in it, the rotary tables in
    # float32): at the medium size a third of the time of a float32 model cast after.
    return t.Qwen3_5MoeForCausalLM._from_config(t.Qwen3_5MoeTextConfig(**kw), dtype=dtype).eval()


def _moved(func, args, kwargs, out) -> int:
    leaves = torch.utils._pytree.tree_leaves
    ins = [a for a in leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
    outs = [o for o in leaves(out) if isinstance(o, torch.Tensor)]
    seen = {a.untyped_storage().data_ptr() for a in ins}

    def nb(x):
        return x.numel() * x.element_size()

    name = func.overloadpacket.__name__
    if getattr(func, "is_view", False):
        return 0
    if name in _SELECT:
        read = sum(nb(a) for a in ins[1:]) + sum(nb(o) for o in outs)
    elif name in ("_grouped_mm", "grouped_mm") and len(ins) >= 3 and ins[1].dim() == 3:
        offs = ins[2].tolist()
        used = sum(1 for i, o in enumerate(offs) if o > (offs[i - 1] if i else 0))
        read = nb(ins[0]) + nb(ins[1]) * used // max(1, ins[1].shape[0]) + sum(nb(a) for a in ins[3:])
    elif name == "affine_grouped_gemv" and len(ins) == 5 and ins[1].dim() == 3:
        # x, the codes, scales and biases stacks [E, ...], offsets: the kernel reads the hit experts' rows only
        offs = ins[4].tolist()
        used = sum(1 for i, o in enumerate(offs) if o > (offs[i - 1] if i else 0))
        read = nb(ins[0]) + sum(nb(t) * used // max(1, t.shape[0]) for t in ins[1:4]) + nb(ins[4])
    else:
        read = sum(nb(a) for a in ins)
    mutates = func._schema.is_mutable
    return read + sum(nb(o) for o in outs if mutates or o.untyped_storage().data_ptr() not in seen)


def _rms_norm_route(args, kwargs):
    """The ops a Mac dispatches for ``F.rms_norm(*args, **kwargs)``, as ``[(op, args, out)]`` (``out`` None: the
    call's own result), or None where MPS runs
    the same composite as the CPU. The conditions of ``rms_norm_symint``'s MPS branch: a weight of the input's
    dtype, a real floating input not in a channels-last layout, and no autograd graph to record."""
    names = ("input", "normalized_shape", "weight", "eps")
    bound = dict(zip(names, args), **kwargs)
    x, w = bound.get("input"), bound.get("weight")
    if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor) or w.dtype != x.dtype:
        return None
    if x.is_complex() or not x.is_floating_point():
        return None
    if x.dim() in (4, 5) and not x.is_contiguous() and x.is_contiguous(memory_format=_CHANNELS_LAST[x.dim()]):
        return None
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return None
    ops = []
    if not x.is_contiguous():
        x = x.contiguous()
        ops.append((torch.ops.aten.clone.default, (bound["input"],), x))
    shape = list(bound["normalized_shape"])
    ops.append((torch.ops.aten._fused_rms_norm.default, (x, shape, w, bound.get("eps")), None))
    return ops


def _linear_route(args, kwargs):
    """The op a Mac dispatches for ``F.linear(input, weight, bias)``: its own ``aten::linear`` kernel (MPS's
    ``_mps_linear``), for plain floating tensors with no autograd graph to record; None (the composite, as the
    CPU) otherwise."""
    bound = dict(zip(("input", "weight", "bias"), args), **kwargs)
    x, w, b = bound.get("input"), bound.get("weight"), bound.get("bias")
    ts = [t for t in (x, w, b) if t is not None]
    if x is None or w is None or any(type(t) not in (torch.Tensor, torch.nn.Parameter) for t in ts):
        return None
    if any(not t.is_floating_point() for t in ts):
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in ts):
        return None
    return [(torch.ops.aten.linear.default, (x, w, b), None)]


_CHANNELS_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}

# Python-level calls that MPS runs as fewer ops than the CPU: function -> the ops a Mac dispatches (None: the
# same as the CPU). See the module docstring for the evidence.
MPS_ROUTES = {F.rms_norm: _rms_norm_route, torch.rms_norm: _rms_norm_route, F.linear: _linear_route}


class _MpsRoutes(TorchFunctionMode):
    """Inside :class:`OpRecorder` with ``as_on_mps``: a call of :data:`MPS_ROUTES` runs as it does (its CPU
    composite unrecorded) and is recorded as the ops a Mac dispatches for it."""

    def __init__(self, recorder: OpRecorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        route = MPS_ROUTES.get(func)
        if route is None:
            return func(*args, **kwargs)
        rec = self.recorder
        rec.quiet += 1  # the route's own copies and the CPU composite go unrecorded
        try:
            ops = route(args, kwargs)
            out = func(*args, **kwargs) if ops is not None else None
        finally:
            rec.quiet -= 1
        if ops is None:
            return func(*args, **kwargs)
        for op, op_args, op_out in ops:
            rec.record(op, op_args, {}, (out,) if op_out is None else op_out)
        return out


class OpRecorder(TorchDispatchMode):
    """Calls ``record(func, args, kwargs, out)`` after every op dispatched inside it (``func``: the
    ``OpOverload``; ``func.name()`` is e.g. ``"aten::add.Tensor"``). The one op-recording mode of the decode
    cost, of the tests' op counts and of the MPS kernel check (``tests/integration/test_mps_kernels.py``).

    ``as_on_mps=True``: calls that MPS runs as one kernel where the CPU runs a composite (:data:`MPS_ROUTES`)
    are recorded as the op a Mac dispatches, their CPU ops not at all."""

    def __init__(self, record, *, as_on_mps: bool = False) -> None:
        super().__init__()
        self.record = record
        self.quiet = 0
        self._routes = _MpsRoutes(self) if as_on_mps else None

    def __enter__(self):
        out = super().__enter__()
        if self._routes is not None:
            self._routes.__enter__()
        return out

    def __exit__(self, *exc):
        if self._routes is not None:
            self._routes.__exit__(*exc)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.quiet += 1  # what runs inside this op (a registered operator's reference kernel) is this op's
        try:
            out = func(*args, **kwargs)
        finally:
            self.quiet -= 1
        if not self.quiet:
            self.record(func, args, kwargs, out)
        return out


class ModuleOps(OpRecorder):
    """The aten ops dispatched inside ``modules`` (between each module's pre- and post-forward hooks; with no
    modules, every op while the mode is active): ``count``, and their ``names`` (``aten.mm``, ``mpsboost.*``). The
    tests' one op counter; a decode step's whole cost, ops and bytes, is :func:`decode_cost`'s. The hooks are
    removed by :meth:`remove` (or on leaving a ``with``)."""

    def __init__(self, modules: Iterable[torch.nn.Module] = ()) -> None:
        super().__init__(self._note)
        modules = list(modules)
        self.names: list[str] = []
        self.inside = not modules
        self.hooks: list[Any] = []
        for m in modules:
            self.hooks.append(m.register_forward_pre_hook(lambda *_: setattr(self, "inside", True)))
            self.hooks.append(m.register_forward_hook(lambda *_: setattr(self, "inside", False)))

    def _note(self, func, args, kwargs, out) -> None:
        if self.inside:
            self.names.append(str(func.overloadpacket))

    @property
    def count(self) -> int:
        return len(self.names)

    @property
    def bare(self) -> list[str]:
        """The names without their namespace (``mm``, ``_scaled_mm_v2``, ``fp8_gemv``)."""
        return [n.split(".", 1)[-1] for n in self.names]

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self.remove()


def decode_cost(
    model: torch.nn.Module, vocab: int = 512, release: str = RELEASE, *, as_on_mps: bool = True
) -> dict[str, dict]:
    """``{"ops": {block: n}, "bytes": {block: n}, "dispatches": {block: {kind: n}}, "names": {kind: {op: n}},
    "pointwise": {block: n}}`` of one decode step after a 40-token prefill; blocks are ``linear_attn``,
    ``self_attn``, ``mlp`` and ``rest``; dispatch kinds (:func:`kind`) are those of torch ``release``'s macOS
    wheel; ``pointwise`` counts the dispatches of ops tagged ``torch.Tag.pointwise`` (what a compiler's fusion can
    remove). ``as_on_mps``: calls MPS runs as one kernel count as that kernel (:data:`MPS_ROUTES`); False counts
    the CPU's ops, as ``shared/tools/decode_ops.py`` does."""
    cur = ["rest"]
    ops: dict[str, int] = {}
    moved: dict[str, int] = {}
    disp: dict[str, dict[str, int]] = {}
    names: dict[str, dict[str, int]] = {}
    fusible: dict[str, int] = {}
    hooks = []
    for name, mod in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        if last in BLOCKS and name.count(".") == 3:
            hooks.append(mod.register_forward_pre_hook(lambda m, a, label=last: cur.__setitem__(0, label)))
            hooks.append(mod.register_forward_hook(lambda m, a, o: cur.__setitem__(0, "rest")))

    def count(func, args, kwargs, out) -> None:
        ops[cur[0]] = ops.get(cur[0], 0) + 1
        moved.setdefault(cur[0], 0)
        if launches(func, args, kwargs, out):  # an op that launches nothing moves no bytes (a view, an alias)
            moved[cur[0]] = moved.get(cur[0], 0) + _moved(func, args, kwargs, out)
            k = kind(func, release)
            block = disp.setdefault(cur[0], dict.fromkeys(KINDS, 0))
            block[k] += 1
            per = names.setdefault(k, {})
            per[func.name()] = per.get(func.name(), 0) + 1
            if torch.Tag.pointwise in func.tags:
                fusible[cur[0]] = fusible.get(cur[0], 0) + 1

    ids = torch.randint(0, vocab, (1, 40), generator=torch.Generator().manual_seed(1))
    try:
        with torch.no_grad():
            out = model(ids, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
            with OpRecorder(count, as_on_mps=as_on_mps):
                model(nxt, past_key_values=out.past_key_values, use_cache=True)
    finally:
        for h in hooks:
            h.remove()
    return {"ops": ops, "bytes": moved, "dispatches": disp, "names": names, "pointwise": fusible}


# ----------------------------------------------------------------------------- a Mac's predicted decode step

# Each constant: (value, source). A prediction, never a measurement: `mpsboost selftest` measures c and eta on
# the user's Mac (probe dispatch_cost) so that a report calibrates these.
CONSTANTS = {
    "c_metal_us": (
        2.05,
        "GPU time per dispatch in a serial compute encoder, M1 Max (qwisp#143; +5.2 us on an M2 Pro, ferrox#149); "
        "above the 1.2-1.4 us host encode of a Metal-shader op (pytorch#148219, M1 Pro): shared/FACTS.md, "
        "'What a dispatch costs on a Mac'",
    ),
    "c_graph_us": (
        20.0,
        "an MPSGraph op: 19.6-21 us, nearly all host (pytorch#148219, M1 Pro): shared/FACTS.md, "
        "'What a dispatch costs on a Mac'",
    ),
    "eta_max": (
        0.80,
        "achieved share of peak bandwidth on Pro/Max chips, 75-85% (shared/FACTS.md, 'Achieved bandwidth'; "
        "MLX bf16 decode about 76% of peak, mlxcel#358, M5 Max)",
    ),
    "eta_ultra": (0.625, "Ultra chips reach about 60-65% (shared/FACTS.md, 'Achieved bandwidth')"),
}
# name: (peak GB/s, eta key, source). M5 Max is left out: no Apple figure was at hand (third-party pages
# disagree: 600 and 614 GB/s).
CHIPS = {
    "M1 Max": (400.0, "eta_max", "Apple newsroom, 'Introducing M1 Pro and M1 Max' (2021-10-18): 400GB/s"),
    "M2 Max": (400.0, "eta_max", "Apple newsroom, 'Apple unveils M2 Pro and M2 Max' (2023-01-17): 400GB/s"),
    "M3 Max": (400.0, "eta_max", "Apple, MacBook Pro (Nov 2023) tech specs: 400GB/s (16-core CPU, 40-core GPU)"),
    "M3 Max 14-core": (300.0, "eta_max", "Apple, MacBook Pro (Nov 2023) tech specs: 300GB/s (14-core CPU)"),
    "M3 Ultra": (819.0, "eta_ultra", "Apple, Mac Studio (2025) tech specs: 819GB/s"),
    "M4 Max": (546.0, "eta_max", "Apple, MacBook Pro (2024) tech specs: 546GB/s (16-core CPU, 40-core GPU)"),
}
# The real Qwen3.6-35B-A3B (shared/FACTS.md): how many of each block a decode step runs.
REAL_BLOCKS = {"linear_attn": 30, "self_attn": 10, "mlp": 40}


def blocks_of(model: torch.nn.Module) -> dict[str, int]:
    """How many of each block of :data:`BLOCKS` a model's decoder layers have."""
    n = dict.fromkeys(BLOCKS, 0)
    for name, _ in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        if last in BLOCKS and name.count(".") == 3:
            n[last] += 1
    return n


def scale(cost: dict, blocks: dict[str, int], real: dict[str, int] | None = None, extra_bytes: int = 0) -> dict:
    """One decode step of the real model from a small one's :func:`decode_cost`: each block's counts per block
    times the real number of blocks (the counts per block do not depend on the number of layers: the step runs
    the same code per layer), ``rest`` as counted, plus ``extra_bytes`` (what the small model's widths leave
    out: its vocabulary, its router). ``{"bytes", "ops", "pointwise", kind: n for kind in KINDS}``."""
    real = real or REAL_BLOCKS
    out = dict.fromkeys(("bytes", "ops", "pointwise", *KINDS), 0.0)

    def add(block: str, factor: float) -> None:
        out["bytes"] += cost["bytes"].get(block, 0) * factor
        out["ops"] += cost["ops"].get(block, 0) * factor
        out["pointwise"] += cost.get("pointwise", {}).get(block, 0) * factor
        for k, n in cost.get("dispatches", {}).get(block, {}).items():
            out[k] += n * factor

    for block, n in real.items():
        if blocks.get(block):
            add(block, n / blocks[block])
    add("rest", 1.0)
    out["bytes"] += extra_bytes
    return out


def predict(
    step: dict,
    bandwidth_gbs: float,
    eta: float,
    c_metal_us: float,
    c_graph_us: float,
    mixed: str = "metal",
    fused: bool = False,
) -> float:
    """Predicted ms per decode step = bytes / (eta * bandwidth) + Metal dispatches * c_metal + MPSGraph
    dispatches * c_graph. ``mixed`` (``"metal"`` or ``"mpsgraph"``): how ``mixed``, ``unknown`` and ``unlisted``
    dispatches are priced. ``fused``: dispatches of pointwise ops cost nothing (the bound of a compiler that fuses
    every pointwise op into a neighbour; they are priced as Metal otherwise: every pointwise op of the table is)."""
    if not 0 < eta <= 1:
        raise ValueError(f"eta must be in (0, 1], got {eta}")
    if mixed not in ("metal", "mpsgraph"):
        raise ValueError(f"mixed must be 'metal' or 'mpsgraph', got {mixed!r}")
    other = step["mixed"] + step["unknown"] + step["unlisted"]
    metal = step["metal"] + (other if mixed == "metal" else 0)
    graph = step["mpsgraph"] + (other if mixed == "mpsgraph" else 0)
    if fused:
        metal = max(0.0, metal - step["pointwise"])
    seconds = step["bytes"] / (eta * bandwidth_gbs * 1e9) + metal * c_metal_us * 1e-6 + graph * c_graph_us * 1e-6
    return seconds * 1e3
