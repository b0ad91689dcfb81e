"""moe_block: transformers' softmax-routed sparse MoE blocks in few ops per decode step.

A Qwen3.5/3.6-MoE block dispatches 45 aten ops for one token even with the experts recipe (router
linear, softmax, top-k, renormalisation, sort, offsets, index, two grouped matmuls, unsort, combine,
the shared expert's three linears, its gate): host time on a Mac, where eager decode pays per op.
For few tokens (``max_tokens``, default 4: decode) the recipe's forward runs the block in about 24
(:func:`mpsboost.ops.moe.sparse_moe_block`):

- the router, the shared expert's gate and its gate/up projections are one matmul each, on the
  model's own Parameters (each in its own storage). Their products are used apart (logits, gate,
  activation, up), so nothing gains from writing them side by side: four ``mm`` replace one fused
  ``mm`` and its ``split`` (24 ops instead of 22). Not a fused weight: making the Parameters views of
  one storage reads as a tie the model does not declare to everything that compares storages
  (transformers' tied-weight checks, ``save_pretrained``, accelerate, offload), and a fused copy held
  by the recipe doubles those weights (Qwen3.6-35B-A3B, bf16: 40 blocks x (256 + 1 + 2 x 512) x 2048
  x 2 B = 200 MiB) to save two host ops. The weights are read once either way;
- the renormalised top-k softmax is top-k then softmax over the k logits (softmax is monotonic);
- one token's k experts are put in ascending order (a second top-k: one kernel on MPS as ``sort`` is,
  without CUDA's segmented sort on the GPU proxy), the offsets come from one ``searchsorted`` on the device
  and two grouped matmuls read each routed expert once (MPS: torch >= 2.15, the gate's
  ``grouped_mm``); without a grouped kernel (MPS <= 2.14) the routed experts' weights are gathered
  (one copy each) and multiplied by ``bmm``;
- the weighted sum over the k experts and the shared expert's gated output are one ``addmm``.

Fused chains (option ``fused``, default "auto"): the router's softmax, top-k and renormalisation with the order and
int32 device offsets the grouped products need and the rows in that order (``mpsboost::moe_route``), the gated
activations (``mpsboost::moe_glu``) and the weighted combine with the shared expert's sigmoid gate
(``mpsboost::moe_combine``), :mod:`mpsboost.ops.moe_route`: one registered call each (their composed reference on
the CPU, mpsboost's Metal kernels on a Mac). One token of Qwen3.5-MoE then dispatches 12 aten ops (input reshape,
four ``mm``, ``moe_glu``, ``mm``, ``moe_route``, two grouped products around ``moe_glu``, ``moe_combine``), 7 in a
block without a shared expert, with bf16/fp32 stacks (``torch._grouped_mm``), fp8 codes (``mpsboost::grouped_mm``,
where the fp8 layer's decode path is that operator) and MLX affine low-bit stacks (``mpsboost::affine_grouped_gemv``,
where the low-bit layer decodes on the kernel) alike. Chosen at patch time by :func:`fusion_choice`
(:func:`mpsboost.ondevice.choose`): on a real Mac the kernels are self-checked, then timed against the composed chain
at the block's shapes and taken only if faster (the report row names the ratio); on the CPU, CUDA and a simulated
Mac nothing is timed and the static choice (fused: fewer dispatches at equal bytes) is taken; ``fused="static"``
keeps the static choice on a Mac too, ``fused="off"`` keeps the composed path. The router module's hooks (router
logits) take the composed path with the router's own call, as below.

Everything else runs the block's own forward, which calls the experts module (so the moe_experts
recipe's paths, fp8 experts and the user's ``set_experts_implementation`` apply): prefill (more than
``max_tokens`` tokens), autograd, ``torch.compile`` tracing (inductor fuses the small ops itself), and
a router another recipe converted. Experts that are not plain floating tensors (fp8 codes with scales,
from ``patch(fp8=...)`` or ``load_fp8``), or whose config names another implementation than
transformers' default (an explicit choice, or ``generate()``'s decode switch where it runs), are called
as a module with the recipe's routing, as the block's own forward calls them; shared-expert layers
stored in fp8 run their own forward inside the recipe's path (Qwen3.6 tiny, Mac 2.15.0, fp8 rowwise:
54 ops per block against the block's own 59 over the same fp8 layers; float32 within 1e-5 of fp8
without this recipe).

Router hooks: where something observes the router module (transformers' output capture while the forward
collects router logits, ``output_router_logits=True``; a user's forward hook; a hook on every module), the
recipe's path runs the router module as the block's own forward does and routes by what it returns (scores,
indices); the experts, the shared expert and the combine stay the recipe's. Decided at each call, host-side (no
hook: two empty-dict tests, not one op more); transformers' capture hooks, installed once and kept, count only
while the forward collects router logits. Under ``torch.compile`` the block's own forward runs anyway.

Widths: the grouped path needs every row of its operands (hidden, 2 x intermediate, intermediate, times the
element size) to be a multiple of 16 bytes (CPU and MPS kernels begin with ATen's ``_grouped_mm_validate_inputs``,
which raises "strides should be multiple of 16 bytes"); other widths take the gathered path, and the report says
which widths (also when option ``path="grouped_mm"`` asked for the grouped one).

Families (router class -> normalisation, dtype of the routing weights): Qwen3.5/3.6-MoE (always
renormalised), Qwen3-MoE, Qwen2-MoE, Qwen3-Next, OLMoE (``norm_topk_prob``), Mixtral (always
renormalised, weights kept in float32). Sigmoid-routed families with group-limited top-k and bias
correction (DeepSeek-V3, GLM-4-MoE, ERNIE-4.5) and gpt-oss (biased router, transposed experts) keep
their own blocks (the experts recipe still covers their experts).

Exactness: float32 within 1e-6 of stock (only the summation order differs); bfloat16 rounds the
combine once where stock rounds twice.

Options (``options={"moe_block": {...}}``): ``max_tokens`` (int >= 1): tokens per call at or below
which the recipe's path runs; ``path`` ("auto", "grouped_mm", "gather"): force the routed experts' path;
``fused`` ("auto", "static", "off"): the fused chains, see above;
``fused_inputs`` (bool, default False): blocks with a shared expert multiply their input by one copy of
the router's, the shared gate's and the shared gate/up weights side by side (one matmul and a split
instead of four matmuls), at the memory of that copy (named in the report; Qwen3.6-35B-A3B bf16: 40 x
5.0 MiB), rebuilt when those weights change; not on by default (no Mac measurement of the trade).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch.nn.modules import module as _nn_module

from .. import ondevice
from ..gate import Env, check
from ..ops import moe as moe_ops
from ..ops import moe_route
from ..registry import Decision, Match, Recipe, class_path, option_choices, register
from ..patching import Changes, Patch, bind_forward, call_original, set_instance_attr
from ._rows import CLASS_PATH, by_class, check_row
from ._watch import Watch
from .fp8.layers import decode_operand, fp8_state
from .low_bit.layers import affine_state
from .low_bit.layers import decode_operand as affine_operand

NAME = "moe_block"
_STATE = "_mpsboost_moe_block"
_TM = "transformers.models."
_DEFAULT_IMPL = "grouped_mm"


@dataclass(frozen=True)
class MoeFamily:
    """One softmax-routed sparse MoE block family: one row of :data:`FAMILIES`. Class names are dotted paths."""

    block: str = field(metadata=CLASS_PATH)  # the sparse MoE block class (a target of the recipe)
    router: str = field(metadata=CLASS_PATH)  # its router class (``block.gate``), checked exactly
    # Top-k weights renormalised: True always, "attr" as ``router.norm_topk_prob`` says (False: never).
    norm: bool | Literal["attr"]
    # The routing weights cast to the model dtype (transformers' ``.to(router_logits.dtype)``); False: kept float32.
    cast: bool
    # A shared expert (``block.shared_expert``, a gated MLP) with its sigmoid gate (``block.shared_expert_gate``).
    shared: bool

    def __post_init__(self) -> None:
        check_row(self)


#: Every block family the recipe serves (its targets, in this order). A new family is one row here, plus its tiny
#: config in ``_lm`` and ``FAMILIES`` of tests/recipes/moe/test_moe_block.py.
FAMILIES: tuple[MoeFamily, ...] = (
    MoeFamily(
        _TM + "qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeSparseMoeBlock",
        _TM + "qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeTopKRouter",
        norm=True,
        cast=True,
        shared=True,
    ),
    MoeFamily(
        _TM + "qwen3_next.modeling_qwen3_next.Qwen3NextSparseMoeBlock",
        _TM + "qwen3_next.modeling_qwen3_next.Qwen3NextTopKRouter",
        norm="attr",
        cast=True,
        shared=True,
    ),
    MoeFamily(
        _TM + "qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
        _TM + "qwen2_moe.modeling_qwen2_moe.Qwen2MoeTopKRouter",
        norm="attr",
        cast=True,
        shared=True,
    ),
    MoeFamily(
        _TM + "qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
        _TM + "qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter",
        norm="attr",
        cast=True,
        shared=False,
    ),
    MoeFamily(
        _TM + "olmoe.modeling_olmoe.OlmoeSparseMoeBlock",
        _TM + "olmoe.modeling_olmoe.OlmoeTopKRouter",
        norm="attr",
        cast=True,
        shared=False,
    ),
    MoeFamily(
        _TM + "mixtral.modeling_mixtral.MixtralSparseMoeBlock",
        _TM + "mixtral.modeling_mixtral.MixtralTopKRouter",
        norm=True,
        cast=False,
        shared=False,
    ),
)
_FAMILIES: dict[str, MoeFamily] = by_class(FAMILIES, "block")


@dataclass(frozen=True)
class MoeBlockOptions:
    """``options={"moe_block": {...}}`` (see the module docstring)."""

    max_tokens: int = 4
    path: Literal["auto", "grouped_mm", "gather"] = "auto"
    fused_inputs: bool = False
    fused: Literal["auto", "static", "off"] = "auto"


_PATHS = option_choices(MoeBlockOptions, "path")
_FUSED = option_choices(MoeBlockOptions, "fused")


@register
class MoeBlock(Recipe):
    name = NAME
    summary = (
        "softmax-routed sparse MoE blocks at decode: router and shared expert by plain matmuls, "
        "top-k and combine in few ops, routed experts read once"
    )
    targets = tuple(_FAMILIES)
    lossless = True
    reversible = True
    requires = ()
    order = 100
    Options = MoeBlockOptions

    def decide(self, match: Match, env: Env, options: MoeBlockOptions) -> Decision:
        if not isinstance(options.max_tokens, int) or options.max_tokens < 1:
            raise ValueError(f"{NAME} option max_tokens={options.max_tokens!r}: expected an int >= 1 (tokens per call)")
        if options.path not in _PATHS:
            raise ValueError(f"{NAME} option path={options.path!r}: expected one of {', '.join(_PATHS)}")
        if options.fused not in _FUSED:
            raise ValueError(f"{NAME} option fused={options.fused!r}: expected one of {', '.join(_FUSED)}")
        lay = _layout(match.module)
        if isinstance(lay, str):
            return Decision.skip(lay)
        if env.device_type == "cuda":
            return Decision.skip(
                "eager decode on CUDA: no measurement of the recipe's path against stock's kernels there "
                "(the Mac path is measured on a GPU under simulated Mac decisions)"
            )
        native = check("grouped_mm", env)
        dtype = match.module.experts.gate_up_proj.dtype
        if not dtype.is_floating_point or dtype.itemsize == 1:  # fp8 experts: the module runs them (path unused)
            dtype = match.module.gate.weight.dtype
        widths = {lay.hidden, 2 * lay.inter, lay.inter}
        fits, why_not = moe_ops.grouped_mm_widths_ok(widths, dtype, env.device_type)
        path = options.path
        if path == "auto":
            path = "grouped_mm" if native.ok and fits else "gather"
        if path == "grouped_mm" and not fits:
            # The kernel's own input check would raise (its widths, not the build): the path that works, and why.
            path, forced = "gather", f"option path='grouped_mm' not taken: {why_not}"
        else:
            forced = "forced by option path"
        if path == "grouped_mm":
            reason = (
                f"{native.reason}: two grouped matmuls read each routed expert once, offsets by searchsorted on the "
                "device"
            )
        else:
            reason = (
                (native.reason if not native.ok else why_not) if options.path == "auto" else forced
            ) + ": the routed experts' weights gathered (one copy each), then bmm"
        fused = options.fused_inputs and lay.shared_inter > 0
        inputs = (
            "router and shared expert in one matmul (fused copy)" if fused else "router and shared expert by matmuls"
        )
        if options.fused == "off":
            fuse, fusion = False, "option fused='off': router, activations and combine as composed aten ops"
        elif env.device_type == "mps" and not (gate := check("moe_metal_route", env)).ok:
            fuse, fusion = False, f"{gate.reason}: router, activations and combine as composed aten ops"
        else:
            choice = fusion_choice(lay, dtype, env, options.fused)
            fuse, fusion = choice.taken, choice.describe()
        backing = inputs + ", " + ("grouped_mm" if path == "grouped_mm" else "gathered bmm")
        if fuse:
            backing += ", router/activations/combine fused (mpsboost::moe_*)"
            # one token, counted on the CPU under Mac decisions (tests/recipes/moe/test_moe_block_fused.py)
            if path == "grouped_mm":
                n_ops = (11 if fused else 12) if lay.shared_inter else 7
            else:
                n_ops = (16 if fused else 17) if lay.shared_inter else 12
            ops = f"about {n_ops} aten ops per block (stock 46)"
        else:
            ops = "about 22 aten ops per block (stock 46)" if fused else "about 24 aten ops per block (stock 46)"
        if fused:
            rows = lay.experts + 1 + 2 * lay.shared_inter
            nbytes = rows * lay.hidden * match.module.gate.weight.element_size()
            ops += (
                f"; option fused_inputs: a copy of the router's and shared expert's input weights side by side "
                f"({rows} x {lay.hidden}, {_size(nbytes)} per block, held while the recipe is applied)"
            )
        return Decision.apply(
            backing + f" (<= {options.max_tokens} tokens)",
            f"decode in {ops}; {reason}; fusion: {fusion}; prefill: the block's own forward",
            plan=MoeBlockPlan(path=path, max_tokens=options.max_tokens, fused_inputs=fused, fused=fuse, fusion=fusion),
        )

    def apply(self, match: Match, decision: Decision, env: Env, options: MoeBlockOptions) -> Patch:
        mod = match.module
        lay = _layout(mod)
        if isinstance(lay, str):
            raise RuntimeError(f"{class_path(type(mod))} changed between plan and apply: {lay}")
        with Changes() as ch:
            state = _State(lay, decision.plan)
            ch.add(set_instance_attr(mod, NAME, _STATE, state))
            ch.add(bind_forward(mod, NAME, _forward))
            _eager_weights(mod, state)
        return ch.patch(description=f"{NAME}: restore forward")


@dataclass(frozen=True)
class _Layout:
    """What the block is made of (checked structurally at decide time and again before each fusion)."""

    family: str
    experts: int
    top_k: int
    hidden: int
    inter: int
    shared_inter: int  # 0: no shared expert
    norm: bool
    cast: bool


@dataclass(frozen=True)
class MoeBlockPlan:
    """The routed experts' path for few tokens (``"grouped_mm"`` or ``"gather"``) and the token bound."""

    path: str
    max_tokens: int
    fused_inputs: bool = False
    fused: bool = False  # the router, activations and combine on mpsboost::moe_* (mpsboost.ops.moe_route)
    fusion: str = ""  # how that was chosen (the static choice, or the ratio timed on this Mac)


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"


def _is_plain_linear(m: Any, n_in: int, n_out: int) -> bool:
    return (
        isinstance(m, torch.nn.Linear)
        and type(m).forward is torch.nn.Linear.forward
        and m.bias is None
        and isinstance(m.weight, torch.nn.Parameter)
        and m.weight.is_floating_point()
        and tuple(m.weight.shape) == (n_out, n_in)
    )


def _is_stored_linear(m: Any, n_in: int, n_out: int) -> bool:
    """A bias-free ``nn.Linear`` whose weight another recipe stores in its own format (mpsboost's fp8 layers:
    codes and scales as buffers, the layer's own forward bound on the instance): the block calls that forward."""
    w = getattr(m, "weight", None)
    if not isinstance(m, torch.nn.Linear) or getattr(m, "bias", None) is not None or not isinstance(w, torch.Tensor):
        return False
    if isinstance(w, torch.nn.Parameter):
        return False
    st = affine_state(m)  # a low-bit layer: its codes are [N, K * bits / 32]
    if st is not None:
        return st.kind == "linear" and (m.in_features, m.out_features) == (n_in, n_out)
    return tuple(w.shape) == (n_out, n_in)


def _usable_linear(m: Any, n_in: int, n_out: int) -> bool:
    return _is_plain_linear(m, n_in, n_out) or _is_stored_linear(m, n_in, n_out)


def _is_plain_mlp(m: Any, hidden: int) -> int:
    """The intermediate width of a gated MLP of bias-free nn.Linear layers (plain or stored by another
    recipe, e.g. fp8), or 0."""
    gp, up, dp = (getattr(m, n, None) for n in ("gate_proj", "up_proj", "down_proj"))
    if not isinstance(gp, torch.nn.Linear) or not hasattr(m, "act_fn"):
        return 0
    inter = gp.out_features
    ok = _usable_linear(gp, hidden, inter) and _usable_linear(up, hidden, inter)
    return inter if ok and _usable_linear(dp, inter, hidden) else 0


def _affine_experts(experts: Any, gu: torch.Tensor) -> bool:
    """Experts stored as MLX affine low-bit stacks (mpsboost's low-bit layers: uint32 codes with scales and biases)."""
    st = affine_state(experts)
    return gu.dtype in (torch.uint32, torch.int32) and st is not None and st.kind == "experts"


def _fp8_experts(experts: Any, gu: torch.Tensor) -> bool:
    """Experts another recipe stores as fp8 codes with scales (mpsboost's fp8 layers): the block calls the
    module with the recipe's routing, as the block's own forward does."""
    return gu.dtype in (torch.float8_e4m3fn, torch.uint8) and isinstance(
        getattr(experts, "gate_up_proj_scale", None), torch.Tensor
    )


def _layout(mod: torch.nn.Module) -> _Layout | str:
    """The block's layout, or why the recipe's path does not fit it."""
    fam = next((class_path(c) for c in type(mod).__mro__ if class_path(c) in _FAMILIES), None)
    if fam is None:
        return f"{type(mod).__name__} is not a known sparse MoE block"
    row = _FAMILIES[fam]
    router_path = row.router
    router, experts = getattr(mod, "gate", None), getattr(mod, "experts", None)
    if router is None or class_path(type(router)) != router_path:
        return f"router {type(router).__name__} is not {router_path.rsplit('.', 1)[-1]}"
    if type(mod).forward is not _class_forward(fam, mod):
        return "the block's forward was changed"
    w = getattr(router, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point():
        return "router weight is not a floating [experts, hidden] tensor"
    e, hidden = w.shape
    gu = getattr(experts, "gate_up_proj", None)
    if (
        not isinstance(gu, torch.Tensor)
        or not getattr(experts, "has_gate", False)
        or getattr(experts, "is_transposed", True)
        or getattr(experts, "has_bias", True)
        or getattr(experts, "has_post_expert_norm", False)
        or gu.dim() != 3
        or gu.shape[0] != e
        or (gu.shape[2] != hidden and not _affine_experts(experts, gu))
    ):
        return "experts are not transformers' fused [experts, 2*inter, hidden] gate/up layout without bias"
    plain = gu.dtype in (torch.float32, torch.bfloat16, torch.float16)
    if not plain and not _fp8_experts(experts, gu) and not _affine_experts(experts, gu):
        return f"experts are stored in {gu.dtype} (e.g. fp8): the block's own forward runs their module"
    from transformers.integrations.moe import _default_apply_gate

    if getattr(type(experts), "_apply_gate", None) is not _default_apply_gate:
        return "experts use their own gate function"
    shared_inter = 0
    if row.shared:
        shared_inter = _is_plain_mlp(getattr(mod, "shared_expert", None), hidden)
        if not shared_inter or not _usable_linear(getattr(mod, "shared_expert_gate", None), hidden, 1):
            return "shared expert or its gate is not plain nn.Linear layers without bias"
    return _Layout(
        family=fam,
        experts=e,
        top_k=int(router.top_k),
        hidden=hidden,
        inter=gu.shape[1] // 2,
        shared_inter=shared_inter,
        norm=bool(router.norm_topk_prob) if row.norm == "attr" else bool(row.norm),
        cast=row.cast,
    )


def _class_forward(fam: str, mod: torch.nn.Module):
    cls = next(c for c in type(mod).__mro__ if class_path(c) == fam)
    return cls.forward


def _shared_linears(mod: torch.nn.Module) -> list[torch.nn.Linear]:
    """The shared expert's gate, gate projection, up projection and down projection, in that order."""
    s = mod.shared_expert
    return [mod.shared_expert_gate, s.gate_proj, s.up_proj, s.down_proj]


def _input_params(mod: torch.nn.Module, lay: _Layout) -> list[torch.nn.Parameter]:
    """The weights that multiply the block's input (router, shared gate, shared gate/up), in that order."""
    ps = [mod.gate.weight]
    if lay.shared_inter:
        s = mod.shared_expert
        ps += [mod.shared_expert_gate.weight, s.gate_proj.weight, s.up_proj.weight]
    return ps


class _State:
    """The per-device constants of the eager path (views of the weights, rebuilt when weights move)."""

    def __init__(self, layout: _Layout, plan: MoeBlockPlan):
        self.layout, self.plan = layout, plan
        self.watch: Watch | None = None
        self.weights: moe_ops.BlockWeights | None = None
        self.experts_ok = False
        self.grouped_ok = False  # the native grouped matmul takes these weights (their widths, dtype, alignment)
        self.stacks: moe_route.ExpertStacks | None = None  # the routed experts' grouped products on the fused path
        self.silu = self.shared_silu = False  # the activations are SiLU (the gated products on mpsboost::moe_glu)


def _watch(mod: torch.nn.Module, lay: _Layout) -> Watch:
    """Where and at which version every tensor the eager constants come from is (host-side metadata only)."""
    paths = [("gate", "weight"), ("experts", "gate_up_proj"), ("experts", "down_proj")]
    if lay.shared_inter:
        paths += [("shared_expert_gate", "weight")]
        # weight_scale: an fp8 layer's (its few-rows operand reads it)
        paths += [
            ("shared_expert", n, a) for n in ("gate_proj", "up_proj", "down_proj") for a in ("weight", "weight_scale")
        ]
    return Watch(mod, paths)


def _plain_now(mod: torch.nn.Module, lay: _Layout) -> bool:
    """The input Parameters are still plain floating tensors of one dtype and device (no other recipe
    converted them)."""
    if not isinstance(mod.gate.weight, torch.nn.Parameter) or not mod.gate.weight.is_floating_point():
        return False
    if lay.shared_inter and (
        _is_plain_mlp(mod.shared_expert, lay.hidden) != lay.shared_inter
        or not _usable_linear(mod.shared_expert_gate, lay.hidden, 1)
    ):
        return False
    ps = _input_params(mod, lay)
    if lay.shared_inter:
        ps = [*ps, mod.shared_expert.down_proj.weight]
    plain = [p for p in ps if isinstance(p, torch.nn.Parameter)]  # the others: stored (fp8) layers' codes
    return len({(p.dtype, p.device) for p in plain}) == 1 and len({p.device for p in ps}) == 1


def _eager_weights(mod: torch.nn.Module, state: _State) -> moe_ops.BlockWeights | None:
    lay = state.layout
    if state.weights is not None and state.watch is not None and state.watch.fresh():
        return state.weights
    if not _plain_now(mod, lay):
        state.weights = state.watch = None
        return None
    params = [p.detach() for p in _input_params(mod, lay)]
    ex = mod.experts
    gu, dn = getattr(ex, "gate_up_proj", None), getattr(ex, "down_proj", None)
    dt, dev = params[0].dtype, params[0].device
    state.experts_ok = (
        isinstance(gu, torch.Tensor)
        and isinstance(dn, torch.Tensor)
        and gu.dtype == dt
        and dn.dtype == dt
        and gu.device == dev
        and tuple(gu.shape) == (lay.experts, 2 * lay.inter, lay.hidden)
        and tuple(dn.shape) == (lay.experts, lay.hidden, lay.inter)
    )
    w = lay.shared_inter
    shared_mods = _shared_linears(mod) if w else []

    def lhs(m: torch.nn.Linear) -> Any:  # the transposed weight, or what runs a stored (fp8, low-bit) layer
        if not _is_stored_linear(m, m.in_features, m.out_features):
            return m.weight.detach().t()
        op = decode_operand(m)
        return affine_operand(m) if op is m else op

    inputs_t, splits = None, None
    if state.plan.fused_inputs and w and all(isinstance(p, torch.nn.Parameter) for p in _input_params(mod, lay)):
        # One copy of the router's, the shared gate's and the shared gate/up projections' weights side by side
        # (option fused_inputs): one matmul for the block's input instead of four; rebuilt with the others.
        with torch.no_grad():
            inputs_t = torch.cat(params, dim=0).t()
        splits = tuple(p.shape[0] for p in params)
    with torch.no_grad():
        state.weights = moe_ops.BlockWeights(
            router_t=params[0].t(),
            shared_t=tuple(lhs(m) for m in shared_mods[:3]) if w else None,
            gate_up_kn=gu.detach().transpose(-2, -1) if state.experts_ok else None,
            down_kn=dn.detach().transpose(-2, -1) if state.experts_ok else None,
            gate_up=gu.detach() if state.experts_ok else None,
            down=dn.detach() if state.experts_ok else None,
            shared_down_t=lhs(shared_mods[3]) if w else None,
            bounds=torch.arange(lay.experts, device=dev).view(1, -1),
            zeros=torch.zeros(lay.top_k, dtype=torch.long, device=dev),
            inputs_t=inputs_t,
            splits=splits,
        )
    # Each call's grouped operands are fresh contiguous rows (x gathered [S, H], the activation [S, I]) and these
    # weights: the kernel's stride and alignment check depends on the weights alone, read once per build (a
    # simulated Mac on CPU tensors, a dtype change after patch() that leaves the down weights' rows short).
    state.grouped_ok = state.experts_ok and moe_ops.native_grouped_mm_ok(
        gu.new_empty((1, lay.hidden)), state.weights.gate_up_kn, state.weights.down_kn
    )
    state.stacks = _stacks(mod, state)
    state.silu = _is_silu(ex.act_fn)
    state.shared_silu = bool(w) and _is_silu(mod.shared_expert.act_fn)
    state.watch = _watch(mod, lay)
    return state.weights


def _is_silu(fn: Any) -> bool:
    """transformers' SiLU activation (``ACT2FN["silu"]``) or torch's: the gated products may run on moe_glu."""
    return type(fn) is torch.nn.SiLU or (
        type(fn).__name__ == "SiLUActivation" and type(fn).__module__.startswith("transformers.")
    )


def _stacks(mod: torch.nn.Module, state: _State) -> moe_route.ExpertStacks | None:
    """How the fused path runs the routed experts' two grouped products, or None (then it is not taken): the native
    grouped matmul on plain stacks where it takes them; ``mpsboost::grouped_mm`` on fp8 codes where the fp8 layer's
    own decode path is that operator (its plan's ``few_rows == "grouped"``, or a file's block scales with the few-rows
    path); ``mpsboost::affine_grouped_gemv`` on low-bit stacks where the low-bit layer decodes on the kernel."""
    lay, ex = state.layout, mod.experts
    if state.experts_ok:
        if not state.grouped_ok:
            return None
        return moe_route.ExpertStacks("dense", (state.weights.gate_up_kn,), (state.weights.down_kn,))
    gu, dn = getattr(ex, "gate_up_proj", None), getattr(ex, "down_proj", None)
    if not isinstance(gu, torch.Tensor) or not isinstance(dn, torch.Tensor):
        return None
    dt = state.weights.router_t.dtype
    fst = fp8_state(ex)
    if fst is not None and fst.converted and _fp8_experts(ex, gu):
        if fst.compute_dtype != dt or getattr(ex, "has_bias", False):
            return None
        gs, ds = getattr(ex, "gate_up_proj_scale", None), getattr(ex, "down_proj_scale", None)
        if not isinstance(gs, torch.Tensor) or not isinstance(ds, torch.Tensor):
            return None
        if fst.block is not None:
            if not fst.few_rows:
                return None
            ub = db = fst.block
        elif fst.few_rows == "grouped":
            from ..ops.fp8_grouped import scale_blocks

            ub, db = scale_blocks(gu, gs), scale_blocks(dn, ds)
        else:
            return None
        return moe_route.ExpertStacks("fp8", (gu, gs, *ub), (dn, ds, *db))
    ast = affine_state(ex)
    if ast is not None and _affine_experts(ex, gu) and ast.kernel and ast.compute_dtype == dt:
        pu, pd = ast.params.get("gate_up_proj"), ast.params.get("down_proj")
        if pu is None or pd is None or gu.shape[1] != 2 * lay.inter:
            return None
        return moe_route.ExpertStacks(
            "affine",
            (gu, ex.gate_up_proj_scales, ex.gate_up_proj_biases, pu.bits, pu.group_size),
            (dn, ex.down_proj_scales, ex.down_proj_biases, pd.bits, pd.group_size),
        )
    return None


# transformers' output capture (``output_router_logits=True``): forward hooks on the router module, installed
# once and kept, that record its output only while the model's forward collects "router_logits" (a context
# variable set by ``capture_outputs`` for that forward). Looked up once, where the hooks are seen.
_CAPTURE_MODULES = ("transformers.utils.output_capturing", "transformers.utils.generic")
_CAPTURE_HOOK = "output_capturing_hook"
_UNSET = object()
_capture: Any = _UNSET  # (module name, its collector variable), or None: this transformers has none we know
_GLOBAL_HOOKS = tuple(
    getattr(_nn_module, n, {}) for n in ("_global_forward_pre_hooks", "_global_forward_hooks")
)  # torch's dicts of hooks on every module, mutated in place by register_module_forward_(pre_)hook


def _collector() -> Any:
    global _capture
    if _capture is _UNSET:
        _capture = None
        for name in _CAPTURE_MODULES:
            try:
                var = getattr(importlib.import_module(name), "_active_collector", None)
            except ImportError:
                continue
            if callable(getattr(var, "get", None)):
                _capture = (name, var)
                break
    return _capture


def _router_observed(router: torch.nn.Module) -> bool:
    """Whether a call of the router module would be seen: a hook on it (transformers' output capture while it
    records router logits, a user's hook) or on every module. Host-side dict lookups, the same at every call;
    with no hook (the normal decode step) two attribute reads and two empty-dict tests."""
    pre, post = router._forward_pre_hooks, router._forward_hooks
    if not (pre or post or any(_GLOBAL_HOOKS)):
        return False
    cap = _collector()
    if cap is None or pre or any(_GLOBAL_HOOKS):
        return True
    for h in post.values():
        if getattr(h, "__module__", None) != cap[0] or getattr(h, "__name__", None) != _CAPTURE_HOOK:
            return True  # a hook of the user's: it sees the call stock makes, and what the router returns routes
    wanted = cap[1].get()
    return wanted is not None and "router_logits" in wanted


def _forward(self: torch.nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    state: _State = self.__dict__[_STATE]
    lay, plan = state.layout, state.plan
    shape = hidden_states.shape
    n = hidden_states.numel() // shape[-1] if hidden_states.dim() else 0
    if (
        args
        or kwargs
        or torch.compiler.is_compiling()  # a trace-time constant: inductor fuses the block's own small ops
        or n == 0
        or n > plan.max_tokens
        or (self.training and getattr(self, "jitter_noise", 0) > 0)
        or (torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters()))
    ):
        if n > plan.max_tokens and not args and not kwargs and not torch.compiler.is_compiling():
            # A prefill: the decode constants are brought up to date here (host-side key check; rebuilt only
            # when a weight moved or another recipe converted it since, e.g. fp8 at patch() commit), so
            # that the first decode step runs as every later one does.
            _eager_weights(self, state)
        return call_original(self, NAME, hidden_states, *args, **kwargs)
    w = _eager_weights(self, state)
    if w is None or hidden_states.dtype != w.router_t.dtype or hidden_states.device != w.router_t.device:
        return call_original(self, NAME, hidden_states, *args, **kwargs)
    ex = self.experts
    impl = getattr(getattr(ex, "config", None), "_experts_implementation", _DEFAULT_IMPL)
    path = plan.path
    if not state.experts_ok or impl != _DEFAULT_IMPL:
        # fp8 (or otherwise converted) experts, or an implementation chosen explicitly: the module runs them.
        path = "module"
    elif path == "grouped_mm" and not state.grouped_ok:
        path = "gather"  # e.g. a simulated environment on a device whose kernel does not take this dtype
    observed = _router_observed(self.gate)
    x = hidden_states if hidden_states.dim() == 2 else hidden_states.reshape(n, shape[-1])
    if plan.fused and impl == _DEFAULT_IMPL and not observed:
        # The router's chains, the gated activations and the combine on mpsboost's fused operators (chosen at
        # patch time: the static choice, or timed on this Mac); the projections as the composed path runs them.
        fpath = None
        if state.stacks is not None and (path == "grouped_mm" or (path == "module" and state.stacks.kind != "dense")):
            fpath = "grouped"
        elif path == "gather" and state.experts_ok:
            fpath = "gather"
        if fpath is not None:
            return moe_route.fused_sparse_moe_block(
                x,
                w,
                top_k=lay.top_k,
                norm=lay.norm,
                cast_weights=lay.cast,
                path=fpath,
                stacks=state.stacks,
                act_fn=ex.act_fn,
                shared_act=self.shared_expert.act_fn if lay.shared_inter else None,
                silu=state.silu,
                shared_silu=state.shared_silu,
                shape=list(shape),
            )
    routing = None
    if observed:
        # The router module runs, as in the block's own forward: its hooks see its call (transformers records
        # the router logits for the aux loss) and the block routes by what it returns (scores, indices).
        _, scores, ids = self.gate(x)
        routing = (scores, ids)
    out = moe_ops.sparse_moe_block(
        x,
        w,
        top_k=lay.top_k,
        norm=lay.norm,
        cast_weights=lay.cast,
        act_fn=ex.act_fn,
        shared_act=self.shared_expert.act_fn if lay.shared_inter else None,
        path=path,
        experts=ex if path == "module" else None,
        routing=routing,
    )
    return out.view(shape)


KERNEL = "moe_block_fused"
_METAL_CHECKED: dict[str, str | None] = {}  # torch build -> None (the kernels passed their self-check here) or why


def _metal_check() -> str | None:
    """The Metal kernels' self-check on this Mac (compiled, compared with the composed reference), once per process."""
    key = torch.__version__
    if key not in _METAL_CHECKED:
        from ..ops import moe_metal

        _METAL_CHECKED[key] = moe_metal.self_check("mps")
    return _METAL_CHECKED[key]


def fusion_choice(
    lay: _Layout,
    dtype: torch.dtype,
    env: Env,
    mode: str,
    *,
    device: str = "mps",
    timer: Any = None,
    cache: Any = None,
    chip: str | None = None,
    check_fn: Any = None,
) -> ondevice.Choice:
    """Fused (mpsboost::moe_route / moe_glu / moe_combine) or composed for a block of layout ``lay``: on a real Mac
    the fused chain is self-checked, then timed against the composed one at the block's shapes
    (:func:`mpsboost.ops.moe_route.timing_pair`, one token) and taken only if faster; elsewhere (CPU, CUDA, a simulated
    Mac) or with ``mode="static"`` nothing is timed and the static choice is taken: fused, the cost model's (fewer
    dispatches at equal bytes: the same weights and activations are read). Tests inject ``timer``, ``cache``,
    ``chip``, ``check_fn`` and ``device``."""
    pair: list = []

    def prepared():
        if not pair:
            pair.extend(
                moe_route.timing_pair(
                    experts=lay.experts,
                    top_k=lay.top_k,
                    hidden=lay.hidden,
                    inter=lay.inter,
                    shared_inter=lay.shared_inter,
                    dtype=dtype,
                    norm=lay.norm,
                    cast_weights=lay.cast,
                    device=device,
                )
            )
        return pair

    def composed():
        return prepared()[0]()

    def fused():
        return prepared()[1]()

    shape = (
        f"E={lay.experts} k={lay.top_k} H={lay.hidden} I={lay.inter} shared={lay.shared_inter} {dtype} "
        f"norm={lay.norm} cast={lay.cast}"
    )
    try:
        return ondevice.choose(
            KERNEL,
            shape,
            env=env,
            stock=ondevice.Contender("composed aten ops", composed),
            candidate=ondevice.Contender("mpsboost::moe_route/moe_glu/moe_combine", fused),
            static=True,
            check=check_fn if check_fn is not None else _metal_check,
            mode="static" if mode == "static" else "auto",
            timer=timer,
            cache=cache,
            chip=chip,
        )
    finally:
        pair.clear()  # nothing made for the timing outlives the choice
