"""moe_experts: routed experts by one grouped matmul, offsets on the device, the path chosen per call.

transformers 5.x picks its experts implementation statically (``eager``, ``batched_mm``,
``grouped_mm``), ``generate()`` switches ``grouped_mm`` to ``batched_mm`` for decoding on every
non-CPU device, MPS included (``_optimize_model_for_decode``), and ``_can_use_grouped_mm`` lets MPS
call ``grouped_mm`` on any torch that has the function, even where MPS has no kernel (before
pytorch#194917/#194933 in 2.15). This recipe binds its own forward on each experts instance: the
path is chosen per call from the number of routed (token, expert) pairs, the device, the torch build
and the dtype (:func:`mpsboost.ops.moe.choose_path`).

An explicit choice of the user outranks the recipe. transformers records the experts implementation
in ``config._experts_implementation`` (5.17 and 5.24 alike); its default is ``"grouped_mm"``. At
patch time the recipe replaces that default by an equal string of its own class (:data:`OWNED`;
transformers' dispatcher, comparisons and serialisation see ``"grouped_mm"``); its forward runs only
while that very object is in the config. Any later choice (``set_experts_implementation(...)``, an
assignment to the config) stores a plain string, and from then on the instance's forward hands every
call to transformers' dispatcher, which runs what the user chose. A value other than ``"grouped_mm"``
at patch time (``from_pretrained(..., experts_implementation="eager")``, a config that names one) is
an explicit choice too: the recipe steps aside and its report row says so. transformers' own
decode-time switch inside ``generate()`` (``_optimize_model_for_decode``: ``grouped_mm`` ->
``batched_mm`` on every non-CPU device) is no user choice: on the patched model (the object given to
``patch()``) it is bound per instance to leave configs the recipe owns alone, since the recipe already
chooses batched_mm for few tokens where its thresholds are measured; where they are not
(``follow_decode_switch``, the conservative choice), transformers' switch runs and the recipe steps
aside during decoding, exactly as stock.

Targets: every experts class built with transformers' ``use_experts_implementation`` in the
installed version (Qwen3-MoE, Qwen3.5-MoE, Qwen3-Next, Mixtral, DeepSeek-V3, gpt-oss with its bias
and transposed layout, and the rest), found by that decorator rather than by a list; and the MoE
blocks that still loop over experts in Python: DBRX (``DbrxExperts``), Step-3.7 (``Step3p7Experts``)
and JetMoE (``JetMoeMoE``/``JetMoeMoA``, whose router reads expert sizes on the host).

Experts whose stacks another mpsboost layer stores (the low-bit layers of ``mpsboost.from_pretrained``,
:mod:`mpsboost.recipes.low_bit.layers`: uint32 codes with group scales and biases; the fp8 layers of ``load_fp8``,
:mod:`mpsboost.recipes.fp8.layers`: fp8 codes with scales), or that are not floating tensors of at least 16 bits,
are no operands of this recipe's bf16/fp16/fp32 paths: the layer's own forward already routes its experts, and
binding the recipe's forward over it multiplied the codes as weights (a shape error on the first call). ``decide``
steps aside for them (:func:`_stored_by_layer`), and a later ``mpsboost.patch(model)`` of a loaded model reports
why instead of breaking it.

Options (``mpsboost.patch(m, options={"moe_experts": {...}})``):
``batched_max_tokens`` (int >= 0): routed pairs at or below which batched_mm runs in eager mode;
``compiled_batched_max_tokens`` (int >= 0): the same while ``torch.compile`` traces;
``compiled_batched_form`` ("fused", "bmm"): the batched_mm formulation while ``torch.compile`` traces;
``path`` ("auto", "grouped_mm", "batched_mm", "fallback", "cpu_loop", "host_loop"): force one path for every call
(a forced path that cannot run on these tensors falls back to one that can).
Defaults: the tuning files ``mpsboost/data/tuning/moe_thresholds_*.json`` (:func:`thresholds_for_env`).
"""

from __future__ import annotations

import dataclasses

import contextlib
import os
import types
from dataclasses import dataclass, field
from typing import Iterator, Literal

import torch

from .. import tuning
from ..errors import GateError
from ..gate import Env, check
from ..ops import moe as moe_ops
from ..registry import NOT_REPORTED, Decision, Match, Recipe, join_path, matches_class, register
from ..patching import Changes, Patch, bind_forward, held_by, hold_instance_attr, no_change, set_attr
from .fp8.layers import fp8_state
from .low_bit.layers import affine_state

NAME = "moe_experts"

_DBRX = "transformers.models.dbrx.modeling_dbrx.DbrxExperts"
_STEP3P7 = "transformers.models.step3p7.modeling_step3p7.Step3p7Experts"
_JETMOE = (
    "transformers.models.jetmoe.modeling_jetmoe.JetMoeMoE",
    "transformers.models.jetmoe.modeling_jetmoe.JetMoeMoA",
)


@dataclass(frozen=True)
class MoeExpertsOptions:
    """``options={"moe_experts": {...}}`` (see the module docstring); None: from the tuning file."""

    batched_max_tokens: int | None = None
    compiled_batched_max_tokens: int | None = None
    compiled_batched_form: Literal["fused", "bmm"] | None = None
    path: Literal["auto", "grouped_mm", "batched_mm", "fallback", "cpu_loop", "host_loop"] = "auto"
    cuda_eager: bool = False


# Eager generate() on CUDA (H200, whole job, stock and patched alternated in one run) showed no gain from
# the recipe's own paths: decode per token no different (that run's time-to-first-token figures included
# the patch call and are void). There the eager forward runs transformers' own kernels (chosen per call
# size as generate() chooses them per phase), which measured no different from stock in a later run;
# compiled forwards, where the static-cache decode measured faster, keep the recipe's paths. (The e2e
# records of the figures page hold both runs.)


# ----------------------------------------------------------------------------------------- the recipe


@dataclass(frozen=True, eq=False)
class ExpertsTarget:
    """What ``find`` saw: the kind of experts module (``"hf"``: transformers' experts classes, ``"dbrx"``,
    ``"stacked"`` (Step3p7), ``"jetmoe"``) and, for ``"hf"``, the root module searched (the model whose
    ``generate()`` decode switch the recipe holds)."""

    kind: str
    root: torch.nn.Module | None = None


@dataclass(frozen=True)
class ExpertsPlan:
    """What ``apply`` binds: the path for many routed tokens and the batched_mm thresholds (reported), and
    the whole static choice the bound forward reads (not reported: it is what the fields above summarise)."""

    kind: str
    large_path: str
    batched_max_tokens: int
    compiled_batched_max_tokens: int
    choice: _Choice = field(metadata=NOT_REPORTED)


@register
class MoeExperts(Recipe):
    name = NAME
    summary = (
        "routed experts by one grouped matmul with offsets on the device; "
        "grouped_mm / batched_mm / sync-free fallback (CPU: per-expert loop) chosen per call"
    )
    targets = (
        # Found by transformers' use_experts_implementation decorator (every such class), e.g.:
        "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts",
        "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeExperts",
        "transformers.models.qwen3_next.modeling_qwen3_next.Qwen3NextExperts",
        "transformers.models.mixtral.modeling_mixtral.MixtralExperts",
        "transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Experts",
        "transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts",
        # Blocks that loop over experts in Python:
        _DBRX,
        _STEP3P7,
        *_JETMOE,
    )
    lossless = True
    reversible = True
    requires = ()
    order = 100
    Options = MoeExpertsOptions

    def find(self, root: torch.nn.Module, prefix: str = "") -> Iterator[Match]:
        for name, mod in root.named_modules():
            if _is_hf_experts(mod):
                yield Match(mod, join_path(prefix, name), ExpertsTarget("hf", root))
            elif matches_class(mod, (_DBRX,)):
                yield Match(mod, join_path(prefix, name), ExpertsTarget("dbrx"))
            elif matches_class(mod, (_STEP3P7,)):
                yield Match(mod, join_path(prefix, name), ExpertsTarget("stacked"))
            elif matches_class(mod, _JETMOE):
                yield Match(mod, join_path(prefix, name), ExpertsTarget("jetmoe"))

    # ------------------------------------------------------------------ deciding
    def _choice(self, match: Match, env: Env, options: MoeExpertsOptions) -> tuple[_Choice, str, str]:
        """(the static choice for this module, why, why the native kernel is out for its dtype or "")."""
        native = check("grouped_mm", env)
        thr = thresholds_for_env(env, native.ok)
        forced = options.path
        if forced not in ("auto", *moe_ops.PATHS):
            raise ValueError(
                f"moe_experts option path={forced!r}: expected 'auto' or one of {', '.join(moe_ops.PATHS)}"
            )
        weights = self._weights(match)
        widths = {n for w in weights for n in w.shape[1:]}
        aligned = all(w.data_ptr() % 16 == 0 for w in weights)
        dtypes = (torch.float32, torch.bfloat16, torch.float16)
        # Every operand of both projections, decided here once: (device type, dtype) pairs that may
        # take the native kernel. A simulated env runs on CPU tensors: its rule and CPU's must both hold.
        native_pairs = {
            (env.device_type, dt)
            for dt in dtypes
            if native.ok and aligned and moe_ops.grouped_mm_widths_ok(widths, dt, env.device_type)[0]
        }
        if env.simulated and env.device_type != "cpu":
            native_pairs |= {
                ("cpu", dt) for d, dt in native_pairs if moe_ops.grouped_mm_widths_ok(widths, dt, "cpu")[0]
            }
            native_pairs |= self._stand_in_pairs(weights[0].device, env, native_pairs, widths)
        limit = ""
        dtype = weights[0].dtype
        if native.ok and (env.device_type, dtype) not in native_pairs:
            ok, limit = moe_ops.grouped_mm_widths_ok(widths, dtype, env.device_type)
            limit = "; " + (limit if not ok else "expert weights are not 16-byte aligned in memory")
        choice = _Choice(
            native=frozenset(native_pairs),
            batched_max_tokens=_int_option(options, "batched_max_tokens", thr.batched_max_tokens),
            compiled_batched_max_tokens=_int_option(
                options, "compiled_batched_max_tokens", thr.compiled_batched_max_tokens
            ),
            forced=None if forced == "auto" else forced,
            histc_int=check("histc_int", env).ok,
            compiled_form=options.compiled_batched_form
            if options.compiled_batched_form is not None
            else thr.compiled_batched_form,
            follow_decode_switch=thr.follow_decode_switch,
            eager_stock=(
                env.device_type == "cuda" and forced == "auto" and match.data.kind == "hf" and not options.cuda_eager
            ),
            sim_device=env.device_type if env.simulated else None,
        )
        if choice.compiled_form not in ("fused", "bmm"):
            raise ValueError(
                f"moe_experts option compiled_batched_form={choice.compiled_form!r}: expected 'fused' or 'bmm'"
            )
        return choice, f"{native.reason}; thresholds: {thr.source}", limit

    @staticmethod
    def _stand_in_pairs(device: torch.device, env: Env, native_pairs: set, widths: set) -> set:
        """Simulated decisions on another real GPU (the proxy: Mac 2.15 decisions computed on CUDA tensors):
        where the simulated device has the grouped kernel, the real device's own kernel stands in for it
        (when its gate and widths allow), so a Mac's grouped path is timed as a grouped path. Without
        this the CUDA tensors missed the (mps, dtype) pairs and every call ran the dense fallback (every
        expert on every token): experts 35 -> 115 ms at prefill 512 on the proxy, 31 -> 48 ms/token at
        decode. CPU tensors are covered above; a simulated device without the kernel adds nothing."""
        real = device.type
        if real in ("cpu", "meta", env.device_type) or not native_pairs:
            return set()
        try:
            real_native = check("grouped_mm", Env.detect(device)).ok
        except GateError:  # no such device in this process (a plan for another machine)
            return set()
        if not real_native:
            return set()
        return {
            (real, dt)
            for d, dt in native_pairs
            if d == env.device_type and moe_ops.grouped_mm_widths_ok(widths, dt, real)[0]
        }

    @staticmethod
    def _weights(match: Match) -> tuple[torch.Tensor, ...]:
        """Every weight a grouped matmul of this module reads, as stored (``[E, a, b]``), up first."""
        m, kind = match.module, match.data.kind
        if kind == "hf":
            return (m.gate_up_proj if m.has_gate else m.up_proj, m.down_proj)
        if kind == "dbrx":
            e, f, h = m.num_experts, m.ffn_hidden_size, m.hidden_size
            return (m.mlp.w1.view(e, f, h), m.mlp.v1.view(e, f, h), m.mlp.w2.view(e, f, h))
        if kind == "stacked":
            return (m.gate_up_proj, m.down_proj)
        return (m.input_linear.weight, m.output_linear.weight)

    @staticmethod
    def _user_choice(match: Match) -> str | None:
        """The experts implementation the user chose explicitly for this module's config, if any."""
        if match.data.kind != "hf":
            return None
        impl = getattr(match.module.config, "_experts_implementation", _DEFAULT_IMPL)
        return None if impl == _DEFAULT_IMPL else impl

    def decide(self, match: Match, env: Env, options: MoeExpertsOptions) -> Decision:
        stored = _stored_by_layer(match.module, self._weights(match))
        if stored is not None:
            return Decision.skip(stored, kind=match.data.kind, stored=type(match.module).__name__)
        chosen = self._user_choice(match)
        if chosen is not None:
            return Decision.skip(
                f"experts_implementation={chosen!r} was chosen explicitly "
                "(from_pretrained(experts_implementation=...), "
                "set_experts_implementation() or the config): "
                "the user's choice outranks the recipe, which steps aside; "
                f"to let it run, set_experts_implementation({_DEFAULT_IMPL!r}) before patching",
                kind=match.data.kind,
                user_choice=chosen,
            )
        choice, why, limit = self._choice(match, env, options)
        native = (env.device_type, self._weights(match)[0].dtype) in choice.native
        unforced = "grouped_mm" if native else {"cpu": "cpu_loop", "mps": "host_loop"}.get(env.device_type, "fallback")
        large = choice.forced or unforced
        if choice.forced == "grouped_mm" and not native:
            large = unforced
        if choice.forced == "cpu_loop" and env.device_type != "cpu":
            large = "fallback"
        backing = moe_ops.BACKING[large]
        if large == "host_loop":
            backing += "; the sync-free fallback while torch.compile traces"
        if choice.forced is None and choice.batched_max_tokens > 0:
            backing += f" (batched_mm at <= {choice.batched_max_tokens} routed tokens)"
        reason = ("forced by option path; " if choice.forced else "") + why + limit
        if choice.eager_stock:
            reason += (
                "; eager on CUDA: transformers' own batched_mm / grouped_mm kernels (the recipe's own eager paths "
                "showed no gain in a whole generate(), a record now in benchmarks/results/superseded; this "
                "default's run: docs/figures.md; "
                "options cuda_eager=True takes the recipe's paths); compiled forwards take the recipe's paths"
            )
        if match.data.kind == "hf":
            reason += (
                "; generate()'s decode switch to batched_mm kept (steps aside while decoding)"
                if choice.follow_decode_switch
                else "; a later set_experts_implementation() takes over from the recipe"
            )
        return Decision.apply(
            backing,
            reason,
            plan=ExpertsPlan(
                kind=match.data.kind,
                large_path=large,
                batched_max_tokens=choice.batched_max_tokens,
                compiled_batched_max_tokens=choice.compiled_batched_max_tokens,
                choice=choice,
            ),
        )

    # ------------------------------------------------------------------ applying
    def apply(self, match: Match, decision: Decision, env: Env, options: MoeExpertsOptions) -> Patch:
        plan: ExpertsPlan = decision.plan
        choice, m, kind = plan.choice, match.module, plan.kind
        if kind == "stacked":
            return bind_forward(m, NAME, _stacked_forward(choice))
        if kind == "dbrx":
            return bind_forward(m, NAME, _dbrx_forward(choice))
        with Changes() as ch:
            if kind == "hf":
                if choice.eager_stock:
                    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

                    choice = dataclasses.replace(
                        choice,
                        stock_functions=(ALL_EXPERTS_FUNCTIONS["batched_mm"], ALL_EXPERTS_FUNCTIONS["grouped_mm"]),
                    )
                ch.add(_own_config(m.config))
                ch.add(_hold_decode_switch(match.data.root, choice.follow_decode_switch))
                ch.add(bind_forward(m, NAME, _hf_forward(choice)))
                return ch.patch(description=f"{NAME}: restore experts forward, config and decode switch")
            # JetMoE: the router keeps sizes on the device, both parallel-expert layers take them as a tensor.
            ch.add(bind_forward(m.router, NAME, _jetmoe_router_forward))
            for lin in (m.input_linear, m.output_linear):
                ch.add(bind_forward(lin, NAME, _jetmoe_experts_forward(choice)))
        return ch.patch(description=f"{NAME}: restore JetMoE router and experts forwards")


def _is_hf_experts(module: torch.nn.Module) -> bool:
    """True for instances of a class decorated with transformers' ``use_experts_implementation``.

    The decorator replaces the class's ``forward`` with its dispatcher (``functools.wraps`` keeps
    the original's name and module, not its code), so the code object tells the two apart.
    """
    fwd = getattr(type(module), "forward", None)
    code = getattr(fwd, "__code__", None)
    if code is None:
        return False
    where = os.path.normpath(code.co_filename).split(os.sep)[-2:]
    if where != ["integrations", "moe.py"]:
        return False
    qual = getattr(code, "co_qualname", "use_experts_implementation.<locals>.wrapper.<locals>.forward")
    return "use_experts_implementation" in qual and hasattr(module, "down_proj")


def _stored_by_layer(module: torch.nn.Module, weights: tuple[torch.Tensor, ...]) -> str | None:
    """Why this experts module's stacks are no operands of the recipe's paths (stored by one of mpsboost's
    low-bit or fp8 layers, whose own forward routes the experts; or not floating tensors of 16 bits or more),
    else None. Patch time only: reads the layer's state and the stacks' dtypes."""
    st = affine_state(module)
    if st is not None:
        fmt = ", ".join(f"{n} {p.bits}-bit g{p.group_size}" for n, p in st.params.items())
        return (
            f"experts are mpsboost's low-bit layer {type(module).__name__} (low_bit_weights, from "
            f"mpsboost.from_pretrained: MLX affine codes, {fmt}), whose own forward routes the experts "
            f"({st.backing or 'dequantize then matmul'}); the recipe's paths cannot multiply the codes: "
            "moe_experts steps aside"
        )
    fst = fp8_state(module)
    if fst is not None:
        return (
            f"experts are mpsboost's fp8 layer {type(module).__name__} (fp8_weights, from patch(fp8=...) or "
            f"load_fp8: fp8 codes, {fst.granularity} scales), whose own forward routes the experts "
            f"({fst.backing or fst.large_path}); the recipe's paths cannot multiply the codes: moe_experts steps aside"
        )
    narrow = (w for w in weights if not w.is_floating_point() or w.element_size() < 2)
    odd = sorted({str(w.dtype).replace("torch.", "") for w in narrow})
    if odd:
        return (
            f"expert weights are stored as {', '.join(odd)}, not as float32/bfloat16/float16 tensors the recipe's "
            "grouped and batched paths multiply (another library's quantized storage): moe_experts steps aside"
        )
    return None


class _Owned(str):
    """``"grouped_mm"``, as the recipe stores it in a config it owns (see the module docstring)."""

    __slots__ = ()


OWNED = _Owned("grouped_mm")
_DEFAULT_IMPL = "grouped_mm"


@dataclass(frozen=True)
class _Choice:
    """What the bound forward needs to choose a path per call: all decided at patch time."""

    native: frozenset  # (device type, weight dtype) pairs where the native grouped matmul runs on these widths
    batched_max_tokens: int
    compiled_batched_max_tokens: int
    forced: str | None  # a path the user forced, or None for auto
    histc_int: bool
    compiled_form: str  # batched_mm formulation under torch.compile: "fused" or "bmm"
    follow_decode_switch: bool = False
    # CUDA eager mode: transformers' own (batched_mm, grouped_mm) experts functions, bound at apply time.
    eager_stock: bool = False
    stock_functions: tuple | None = None
    # A simulated environment (tests, dry runs): choose paths as on this device type, whatever device
    # the tensors are on (CPU in tests).
    sim_device: str | None = None

    @property
    def batched_form(self) -> str:
        # "auto" is fused while compiling and bmm in eager mode (fused would materialise there).
        return "auto" if self.compiled_form == "fused" else "bmm"

    def path(self, num_pairs: int, weight: torch.Tensor) -> str:
        # Metadata only (shape, dtype, device, whether dynamo traces): constants under torch.compile,
        # no data pointer or host read. The meta kernel of grouped_mm takes bf16 only while tracing.
        compiling = moe_ops._compiling()
        dev = weight.device.type
        native = (dev, weight.dtype) in self.native and (not compiling or weight.dtype == torch.bfloat16)
        on_cpu = dev == "cpu"
        if self.forced is not None:
            if self.forced == "grouped_mm" and not native:
                # A forced native path that cannot run here must not crash.
                return "cpu_loop" if on_cpu and not compiling else "fallback"
            if (self.forced == "cpu_loop" and (not on_cpu or compiling)) or (self.forced == "host_loop" and compiling):
                return "fallback"
            return self.forced
        return moe_ops.choose_path(
            num_pairs,
            native=native,
            batched_max_tokens=self.batched_max_tokens,
            compiled_batched_max_tokens=self.compiled_batched_max_tokens,
            compiling=compiling,
            device_type=self.sim_device or dev,
        )


def _int_option(options: MoeExpertsOptions, key: str, default: int) -> int:
    value = getattr(options, key)
    if value is None:
        return default
    if value < 0:
        raise ValueError(
            f"moe_experts option {key}={value!r}: expected an int >= 0 (routed token-expert pairs per call)"
        )
    return value


# ----------------------------------------------------------------------------------------- forwards


def _hf_forward(choice: _Choice):
    """The forward bound on a ``use_experts_implementation`` experts instance."""

    def forward(self, hidden_states, *args, **kwargs):
        if self.config._experts_implementation is not OWNED:
            # An explicit choice after patching (or transformers' decode switch where the recipe
            # follows it): transformers' dispatcher runs what the config names.
            return type(self).forward(self, hidden_states, *args, **kwargs)
        # gpt-oss names its arguments router_indices / routing_weights.
        top_k_index = args[0] if args else kwargs.get("top_k_index", kwargs.get("router_indices"))
        top_k_weights = args[1] if len(args) > 1 else kwargs.get("top_k_weights", kwargs.get("routing_weights"))
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        idx = top_k_index.reshape(x.shape[0], -1)
        wts = top_k_weights.reshape(x.shape[0], -1)
        if self.has_gate:
            up_w, up_b, act = self.gate_up_proj, getattr(self, "gate_up_proj_bias", None), self._apply_gate
        else:
            up_w, up_b, act = self.up_proj, getattr(self, "up_proj_bias", None), self.act_fn
        down_b = getattr(self, "down_proj_bias", None)
        if not self.has_bias:
            up_b = down_b = None
        # has_post_expert_norm is newer than transformers 5.17; absent means no post norm.
        post = self.post_expert_norm if getattr(self, "has_post_expert_norm", False) else None
        if choice.stock_functions is not None and not torch.compiler.is_compiling():
            small, large = choice.stock_functions
            fn = small if idx.numel() <= choice.batched_max_tokens else large
            return fn(self, hidden_states, top_k_index, top_k_weights)
        path = choice.path(idx.numel(), up_w)
        out = moe_ops.routed_experts(
            x,
            idx,
            wts,
            up_weight=up_w,
            down_weight=self.down_proj,
            activation=act,
            up_bias=up_b,
            down_bias=down_b,
            transposed=self.is_transposed,
            post=post,
            path=path,
            histc_int=choice.histc_int,
            batched_form=choice.batched_form,
            sentinels=getattr(self, "_is_expert_parallel", False),
        )
        return out.reshape(shape)

    return forward


def _stacked_forward(choice: _Choice):
    """Step-3.7's experts: transformers' standard layout and ``_apply_gate``, no decorator."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        path = choice.path(top_k_index.numel(), self.gate_up_proj)
        return moe_ops.routed_experts(
            hidden_states,
            top_k_index,
            top_k_weights,
            up_weight=self.gate_up_proj,
            down_weight=self.down_proj,
            activation=self._apply_gate,
            path=path,
            histc_int=choice.histc_int,
            batched_form=choice.batched_form,
            sentinels=False,
        )

    return forward


def _dbrx_forward(choice: _Choice):
    """DBRX keeps gate (w1), up (v1) and down (w2) as flat [E*F, H] parameters; w2 is used as [F, H]."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        batch = hidden_states.shape[0]
        x = hidden_states.reshape(-1, self.hidden_size)
        e, f, h = self.num_experts, self.ffn_hidden_size, self.hidden_size
        w1 = self.mlp.w1.view(e, f, h)
        v1 = self.mlp.v1.view(e, f, h)
        w2 = self.mlp.w2.view(e, f, h)  # [E, in=F, out=H]: the transposed layout
        act = self.mlp.activation_fn
        path = choice.path(top_k_index.numel(), w1)
        out = moe_ops.routed_experts(
            x,
            top_k_index,
            top_k_weights,
            up_weight=(w1, v1),
            down_weight=w2,
            down_transposed=True,
            activation=lambda g, u: act(g) * u,
            path=path,
            histc_int=choice.histc_int,
            batched_form=choice.batched_form,
            sentinels=False,
        )
        return out.view(batch, -1, h)

    return forward


def _jetmoe_router_forward(self, hidden_states):
    """JetMoE's top-k gating without ``expert_size.tolist()``: sizes stay an int32 tensor on the device."""
    logits = self.layer(hidden_states).float()
    top_k_logits, top_k_indices = logits.topk(self.top_k, dim=1)
    top_k_gates = torch.softmax(top_k_logits, dim=1).type_as(hidden_states)
    top_k_experts = top_k_indices.flatten()
    expert_size = moe_ops.expert_counts(top_k_experts, self.num_experts)
    _, index_sorted_experts = top_k_experts.sort(dim=0, stable=True)
    batch_index = index_sorted_experts.div(self.top_k, rounding_mode="trunc")
    batch_gates = top_k_gates.flatten()[index_sorted_experts]
    return index_sorted_experts, batch_index, batch_gates, expert_size, logits


def _jetmoe_experts_forward(choice: _Choice):
    """JetMoE's parallel experts on rows already sorted by expert, sizes as a device tensor."""

    def forward(self, inputs, expert_size):
        if not isinstance(expert_size, torch.Tensor):  # a caller outside the patched router
            expert_size = torch.as_tensor(expert_size, dtype=torch.int32, device=inputs.device)
        offsets = torch.cumsum(expert_size.to(torch.int32), dim=0, dtype=torch.int32)
        path = choice.path(inputs.shape[0], self.weight)
        ids = None
        if path != "grouped_mm":
            rows = torch.arange(inputs.shape[0], device=inputs.device, dtype=torch.int32)
            ids = torch.searchsorted(offsets, rows, right=True)
        return moe_ops.grouped_linear(
            inputs,
            self.weight,
            offsets,
            path=path,
            expert_of_sorted=ids,
            batched_form=choice.batched_form,
            sentinels=False,
        )

    return forward


# ----------------------------------------------------------------------------------------- generate()'s decode switch

# One vote per patched experts module of a model, held with the bound switch (patching.hold_instance_attr):
# True where that module follows transformers' decode switch (no measured thresholds here).
_DECODE_ATTR = "_optimize_model_for_decode"


@contextlib.contextmanager
def _decode_switch(model):
    """``generate()``'s decode-time switch, bound on a patched model instance.

    transformers (5.17 and 5.24) wraps the decoding loop in ``self._optimize_model_for_decode()``,
    which sets every ``"grouped_mm"`` config to ``"batched_mm"`` off CPU and back afterwards. Configs
    the recipe owns (``OWNED``) already get batched_mm for few tokens from the recipe's measured
    thresholds, and a switched config would make their forwards step aside; so the switch is left out
    while it would touch only those. Where a patched module follows the switch (no measurement for
    this device), or a config the recipe does not own names grouped_mm, transformers' switch runs.
    """
    votes = held_by(model, _DECODE_ATTR) or ()
    impls = model.get_experts_implementation() if hasattr(model, "get_experts_implementation") else {}
    unowned = any(v == _DEFAULT_IMPL and v is not OWNED for v in impls.values())
    if any(votes) or unowned:
        with type(model)._optimize_model_for_decode(model):
            yield
    else:
        yield


def _hold_decode_switch(root: torch.nn.Module, follow: bool) -> Patch:
    """Bind :func:`_decode_switch` on ``root`` (once for all its experts modules); undone by the last holder."""
    if not callable(getattr(type(root), _DECODE_ATTR, None)):
        return no_change(f"{NAME}: no generate() decode switch on {type(root).__name__}")
    # Someone else bound it on this instance: hold_instance_attr leaves theirs in place and we follow it.
    return hold_instance_attr(
        root,
        _DECODE_ATTR,
        lambda: types.MethodType(_decode_switch, root),
        follow,
        description=f"{NAME}: restore generate()'s decode switch",
    )


def _own_config(config) -> Patch:
    """Store :data:`OWNED` as the config's experts implementation; undo puts the plain default back
    if nobody chose another implementation in between."""
    return set_attr(
        config,
        "_experts_implementation_internal",
        OWNED,
        restore=_DEFAULT_IMPL,
        description=f"{NAME}: restore config._experts_implementation",
    )


# ----------------------------------------------------------------------------------------- thresholds
# Which tuning file speaks for which device, and what holds where none does: the recipe's policy; the
# numbers reach mpsboost.ops.moe.choose_path as arguments.


@dataclass(frozen=True)
class Thresholds:
    """When to leave the grouped path for batched_mm: at or below ``batched_max_tokens`` routed pairs
    (tokens x top-k) per experts call. ``compiled_batched_max_tokens`` is the same bound while
    ``torch.compile`` traces (the batched form becomes a fused gather + matrix-vector reduction
    there). ``source`` says where the numbers come from; ``compiled_batched_form`` which batched
    formulation runs while compiling."""

    batched_max_tokens: int
    compiled_batched_max_tokens: int
    source: str
    # The batched_mm formulation while torch.compile traces: "fused" (gather fused into a
    # matrix-vector reduction) or "bmm" (gathered weights, then bmm).
    compiled_batched_form: str = "fused"
    # Leave transformers' own decode-time switch (grouped_mm -> batched_mm inside generate()) in
    # place and step aside while it is active: the choice where no measurement speaks for this device.
    follow_decode_switch: bool = False


# Measured thresholds live in data files with their provenance (mpsboost/data/tuning/moe_thresholds_*.json,
# read by mpsboost.tuning), one file per measurement: which file speaks for which device type. A file
# applies only to the kind of device it was measured on (tuning.for_env: device type and, for CUDA,
# compute capability); any other environment gets CONSERVATIVE.
TUNING_FILES: dict[str, tuple[str, ...]] = {
    "cuda": ("moe_thresholds_cuda_h200",),
    "cpu": ("moe_thresholds_cpu",),
    "mps": ("moe_thresholds_mps_defaults",),
}

# No measurement for this device: grouped (or the sync-free fallback) for every call in the recipe's
# own forward, and transformers' own decode-time switch to batched_mm left in place (the recipe steps
# aside while it is active), so decoding runs as stock transformers would.
CONSERVATIVE = Thresholds(0, 0, "no measured MoE thresholds for this device", "bmm", follow_decode_switch=True)


def _thresholds_from(entry: dict, source: str) -> Thresholds:
    return Thresholds(
        batched_max_tokens=int(entry["batched_max_tokens"]),
        compiled_batched_max_tokens=int(entry["compiled_batched_max_tokens"]),
        source=source,
        compiled_batched_form=entry.get("compiled_batched_form", "fused"),
        follow_decode_switch=bool(entry.get("follow_decode_switch", False)),
    )


def thresholds_for_env(env: Env, native: bool) -> Thresholds:
    """The thresholds for ``env`` (a :class:`mpsboost.gate.Env`) from the tuning files, or
    :data:`CONSERVATIVE` with the reason naming the data that does not apply. Patch time only."""
    key = "native" if native else "no_native"
    whys = []
    for name in TUNING_FILES.get(env.device_type, ()):
        t, why = tuning.for_env(name, env)
        if t is None:
            whys.append(why)
            continue
        if t.extra.get("measured", True):
            src = f"{name}.json: {t.describe()}"
        else:
            src = f"{name}.json: unmeasured default ({t.notes.split('. ')[0]})"
        return _thresholds_from(t.entries[key], src)
    why = "; ".join(whys) or f"no MoE tuning file for device type {env.device_type!r}"
    return dataclasses.replace(CONSERVATIVE, source=f"{why}: grouped path, transformers' decode switch kept")


def thresholds_for(device_type: str, native: bool) -> Thresholds:
    """The thresholds of the tuning file for ``device_type``, whatever machine it was measured on
    (benchmarks use this; decisions use :func:`thresholds_for_env`)."""
    names = TUNING_FILES.get(device_type)
    if not names:
        raise ValueError(f"no MoE thresholds for device type {device_type!r}; known: {sorted(TUNING_FILES)}")
    t = tuning.load(names[0])
    return _thresholds_from(t.entries["native" if native else "no_native"], f"{names[0]}.json: {t.describe()}")
