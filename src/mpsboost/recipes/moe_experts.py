"""moe_experts: routed experts by one grouped matmul, offsets on the device, the path chosen per call.

transformers 5.x picks its experts implementation statically (``eager``, ``batched_mm``,
``grouped_mm``), ``generate()`` switches ``grouped_mm`` to ``batched_mm`` for decoding on every
non-CPU device, MPS included (``_optimize_model_for_decode``), and ``_can_use_grouped_mm`` lets MPS
call ``grouped_mm`` on any torch that has the function, even where MPS has no kernel (before
pytorch#194917/#194933 in 2.15). This recipe binds its own forward on each experts instance: the
path is chosen per call from the number of routed (token, expert) pairs, the device, the torch build
and the dtype (:func:`mpsboost.ops.moe.choose_path`), and ``config._experts_implementation`` is not
read, so the decode-time switch cannot undo the choice.

Targets: every experts class built with transformers' ``use_experts_implementation`` in the
installed version (Qwen3-MoE, Qwen3.5-MoE, Qwen3-Next, Mixtral, DeepSeek-V3, gpt-oss with its bias
and transposed layout, and the rest), found by that decorator rather than by a list; and the MoE
blocks that still loop over experts in Python: DBRX (``DbrxExperts``), Step-3.7 (``Step3p7Experts``)
and JetMoE (``JetMoeMoE``/``JetMoeMoA``, whose router reads expert sizes on the host).

Options (``mpsboost.patch(m, options={"moe_experts": {...}})``):
``batched_max_tokens`` (int >= 0): routed pairs at or below which batched_mm runs in eager mode;
``compiled_batched_max_tokens`` (int >= 0): the same while ``torch.compile`` traces;
``compiled_batched_form`` ("fused", "bmm"): the batched_mm formulation while ``torch.compile`` traces;
``path`` ("auto", "grouped_mm", "batched_mm", "fallback", "cpu_loop"): force one path for every call
(a forced path that cannot run on these tensors falls back to one that can).
Defaults: :data:`mpsboost.ops.moe.THRESHOLDS`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch

from ..gate import Env, check
from ..ops import moe as moe_ops
from ..registry import Decision, Match, Recipe, Undo, join_path, bind_forward, matches_class, register

NAME = "moe_experts"

_DBRX = "transformers.models.dbrx.modeling_dbrx.DbrxExperts"
_STEP3P7 = "transformers.models.step3p7.modeling_step3p7.Step3p7Experts"
_JETMOE = (
    "transformers.models.jetmoe.modeling_jetmoe.JetMoeMoE",
    "transformers.models.jetmoe.modeling_jetmoe.JetMoeMoA",
)
_OPTION_KEYS = ("fp8", "batched_max_tokens", "compiled_batched_max_tokens", "compiled_batched_form", "path")


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


@dataclass(frozen=True)
class _Choice:
    """What the bound forward needs to choose a path per call (all static)."""

    native: bool  # the gate allows the native grouped matmul in this env
    batched_max_tokens: int
    compiled_batched_max_tokens: int
    forced: str | None  # a path the user forced, or None for auto
    histc_int: bool
    compiled_form: str  # batched_mm formulation under torch.compile: "fused" or "bmm"

    @property
    def batched_form(self) -> str:
        # "auto" is fused while compiling and bmm in eager mode (fused would materialise there).
        return "auto" if self.compiled_form == "fused" else "bmm"

    def path(self, num_pairs: int, x: torch.Tensor, weight_kn: torch.Tensor) -> str:
        # Static facts only: shapes, dtype, strides, whether dynamo is tracing.
        native = self.native and moe_ops.native_grouped_mm_ok(x.to(weight_kn.dtype), weight_kn)
        on_cpu = x.device.type == "cpu"
        if self.forced is not None:
            if self.forced == "grouped_mm" and not native:
                # A forced native path that cannot run here must not crash.
                return "cpu_loop" if on_cpu and not moe_ops._compiling() else "fallback"
            if self.forced == "cpu_loop" and (not on_cpu or moe_ops._compiling()):
                return "fallback"
            return self.forced
        return moe_ops.choose_path(num_pairs, native=native, batched_max_tokens=self.batched_max_tokens,
                                   compiled_batched_max_tokens=self.compiled_batched_max_tokens,
                                   device_type=x.device.type)


def _int_option(options: Mapping[str, Any], key: str, default: int) -> int:
    value = options.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"moe_experts option {key}={value!r}: expected an int >= 0 (routed token-expert pairs per call)")
    return value


# ----------------------------------------------------------------------------------------- forwards

def _hf_forward(choice: _Choice):
    """The forward bound on a ``use_experts_implementation`` experts instance."""

    def forward(self, hidden_states, top_k_index=None, top_k_weights=None, **kwargs):
        # gpt-oss names its arguments router_indices / routing_weights.
        if top_k_index is None:
            top_k_index = kwargs.pop("router_indices")
        if top_k_weights is None:
            top_k_weights = kwargs.pop("routing_weights")
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
        path = choice.path(idx.numel(), x, moe_ops._as_kn(up_w, self.is_transposed))
        out = moe_ops.routed_experts(
            x, idx, wts, up_weight=up_w, down_weight=self.down_proj, activation=act, up_bias=up_b,
            down_bias=down_b, transposed=self.is_transposed, post=post, path=path, histc_int=choice.histc_int,
            batched_form=choice.batched_form, sentinels=getattr(self, "_is_expert_parallel", False),
        )
        return out.reshape(shape)

    return forward


def _stacked_forward(choice: _Choice):
    """Step-3.7's experts: transformers' standard layout and ``_apply_gate``, no decorator."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        path = choice.path(top_k_index.numel(), hidden_states, moe_ops._as_kn(self.gate_up_proj, False))
        return moe_ops.routed_experts(
            hidden_states, top_k_index, top_k_weights, up_weight=self.gate_up_proj, down_weight=self.down_proj,
            activation=self._apply_gate, path=path, histc_int=choice.histc_int,
            batched_form=choice.batched_form, sentinels=False,
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
        path = choice.path(top_k_index.numel(), x, moe_ops._as_kn(w1, False))
        out = moe_ops.routed_experts(
            x, top_k_index, top_k_weights, up_weight=(w1, v1), down_weight=w2, down_transposed=True,
            activation=lambda g, u: act(g) * u, path=path, histc_int=choice.histc_int,
            batched_form=choice.batched_form, sentinels=False,
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
        path = choice.path(inputs.shape[0], inputs, moe_ops._as_kn(self.weight, False))
        ids = None
        if path != "grouped_mm":
            rows = torch.arange(inputs.shape[0], device=inputs.device, dtype=torch.int32)
            ids = torch.searchsorted(offsets, rows, right=True)
        return moe_ops.grouped_linear(inputs, self.weight, offsets, path=path, expert_of_sorted=ids,
                                      batched_form=choice.batched_form, sentinels=False)

    return forward


# ----------------------------------------------------------------------------------------- the recipe

@register
class MoeExperts(Recipe):
    name = NAME
    summary = "routed experts by one grouped matmul with offsets on the device; grouped_mm / batched_mm / sync-free fallback (CPU: per-expert loop) chosen per call"
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

    def find(self, root: torch.nn.Module, prefix: str = "") -> Iterator[Match]:
        for name, mod in root.named_modules():
            if _is_hf_experts(mod):
                yield Match(mod, join_path(prefix, name), {"kind": "hf"})
            elif matches_class(mod, (_DBRX,)):
                yield Match(mod, join_path(prefix, name), {"kind": "dbrx"})
            elif matches_class(mod, (_STEP3P7,)):
                yield Match(mod, join_path(prefix, name), {"kind": "stacked"})
            elif matches_class(mod, _JETMOE):
                yield Match(mod, join_path(prefix, name), {"kind": "jetmoe"})

    # ------------------------------------------------------------------ deciding
    def _choice(self, env: Env, options: Mapping[str, Any]) -> tuple[_Choice, str]:
        unknown = sorted(set(options) - set(_OPTION_KEYS))
        if unknown:
            raise ValueError(f"unknown moe_experts option(s) {unknown}; accepted: {', '.join(_OPTION_KEYS[1:])}")
        native = check("grouped_mm", env)
        thr = moe_ops.thresholds_for(env.device_type, native.ok)
        forced = options.get("path", "auto")
        if forced not in ("auto", *moe_ops.PATHS):
            raise ValueError(f"moe_experts option path={forced!r}: expected 'auto' or one of {', '.join(moe_ops.PATHS)}")
        choice = _Choice(
            native=native.ok,
            batched_max_tokens=_int_option(options, "batched_max_tokens", thr.batched_max_tokens),
            compiled_batched_max_tokens=_int_option(options, "compiled_batched_max_tokens", thr.compiled_batched_max_tokens),
            forced=None if forced == "auto" else forced,
            histc_int=check("histc_int", env).ok,
            compiled_form=options.get("compiled_batched_form", thr.compiled_batched_form),
        )
        if choice.compiled_form not in ("fused", "bmm"):
            raise ValueError(f"moe_experts option compiled_batched_form={choice.compiled_form!r}: expected 'fused' or 'bmm'")
        return choice, f"{native.reason}; thresholds: {thr.source}"

    @staticmethod
    def _weight_and_input(match: Match) -> tuple[torch.Tensor, int]:
        """The up-projection weight as [E, in, out] and the input width, for the static stride/dtype rules."""
        m, kind = match.module, match.data["kind"]
        if kind == "hf":
            w = m.gate_up_proj if m.has_gate else m.up_proj
            return moe_ops._as_kn(w, m.is_transposed), w.shape[-2] if m.is_transposed else w.shape[-1]
        if kind == "dbrx":
            w = m.mlp.w1.view(m.num_experts, m.ffn_hidden_size, m.hidden_size)
            return w.transpose(-2, -1), m.hidden_size
        if kind == "stacked":
            return m.gate_up_proj.transpose(-2, -1), m.gate_up_proj.shape[-1]
        return m.input_linear.weight.transpose(-2, -1), m.input_linear.weight.shape[-1]

    def decide(self, match: Match, env: Env, options: Mapping[str, Any]) -> Decision:
        choice, why = self._choice(env, options)
        w_kn, width = self._weight_and_input(match)
        native = choice.native
        limit = ""
        if native:
            # The dtype and stride rules of the native kernel, on a stand-in input of the real width.
            probe_env = env.device_type
            if probe_env == "cuda" and w_kn.dtype != torch.bfloat16:
                native, limit = False, f"; CUDA's grouped_mm reads offsets on the device for bf16 only, these weights are {w_kn.dtype}"
            elif probe_env == "cpu":
                es = w_kn.element_size()
                bad = [n for n in (width, w_kn.shape[-1]) if (n * es) % 16]
                if bad or w_kn.stride(-2) * es % 16 and w_kn.stride(-1) * es % 16:
                    native, limit = False, f"; CPU grouped_mm needs row strides that are multiples of 16 bytes, widths {sorted(set(bad))} x {es} bytes are not"
        unforced = "grouped_mm" if native else ("cpu_loop" if env.device_type == "cpu" else "fallback")
        large = choice.forced or unforced
        if choice.forced == "grouped_mm" and not native:
            large = unforced
        if choice.forced == "cpu_loop" and env.device_type != "cpu":
            large = "fallback"
        backing = moe_ops.BACKING[large]
        if choice.forced is None and choice.batched_max_tokens > 0:
            backing += f" (batched_mm at <= {choice.batched_max_tokens} routed tokens)"
        reason = ("forced by option path; " if choice.forced else "") + why + limit
        return Decision.apply(
            backing,
            reason,
            kind=match.data["kind"],
            large_path=large,
            batched_max_tokens=choice.batched_max_tokens,
            compiled_batched_max_tokens=choice.compiled_batched_max_tokens,
        )

    # ------------------------------------------------------------------ applying
    def apply(self, match: Match, decision: Decision, env: Env, options: Mapping[str, Any]) -> Undo:
        choice, _ = self._choice(env, options)
        m, kind = match.module, match.data["kind"]
        if kind == "hf":
            return bind_forward(m, NAME, _hf_forward(choice))
        if kind == "stacked":
            return bind_forward(m, NAME, _stacked_forward(choice))
        if kind == "dbrx":
            return bind_forward(m, NAME, _dbrx_forward(choice))
        # JetMoE: the router keeps sizes on the device, both parallel-expert layers take them as a tensor.
        undos = [bind_forward(m.router, NAME, _jetmoe_router_forward)]
        try:
            for lin in (m.input_linear, m.output_linear):
                undos.append(bind_forward(lin, NAME, _jetmoe_experts_forward(choice)))
        except BaseException:
            Undo.chain(undos)()
            raise
        return Undo.chain(undos, description=f"{NAME}: restore JetMoE router and experts forwards")
