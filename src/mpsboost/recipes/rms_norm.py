"""Recipe ``rms_norm``: transformers' RMSNorm layers as one ``F.rms_norm`` call (one Metal kernel on MPS).

A Mac runs transformers eagerly, where every aten op costs host time (dispatch and command encoding).
An RMSNorm layer's forward dispatches eight to ten ops (casts, pow, mean, add, rsqrt, multiplies); on
MPS ``F.rms_norm`` with a weight is one Metal kernel (pytorch#145301, torch 2.7). A decoder layer has
two of them, attention layers with q/k norms two more: Qwen3.6-35B-A3B runs 101 per decoded token.

Which classes: every class whose ``forward`` is the very same code as one of three reference classes of
the installed transformers (compared as syntax trees, names included), each form checked numerically
against mpsboost's formula once per process (:mod:`mpsboost.ops.norm`): Llama's (``round_then_scale``,
about 140 classes), gpt-oss's and Helium's (``scale_in_fp32``), Gemma's and Qwen3.5's (``zero_centered``).
A class whose code differs in any way (a hub kernel bound by ``kernelize``, another formula) is left alone.

Where: on MPS (torch >= 2.7), and on CUDA in eager mode: there the whole eager ``generate()`` of the
Qwen3.6-35B-A3B shape on an H200 decoded faster with it (paired rounds, spreads apart: the figures page). While
``torch.compile`` traces a CUDA model the module's own code is traced instead (inductor fuses it; the
compiled mode was not measured with the recipe). On the CPU ``F.rms_norm`` is the same composite as the
module's code: nothing to gain, it steps aside. ``options={"rms_norm": {"devices": (...)}}`` chooses the
device types. The result equals the module's bit for bit on the CPU; on MPS and CUDA the fused kernel
sums the squares in its own order (float32 rounding of the mean: a few 1e-5 relative on the H200, the
sensitivity record).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from ..gate import Env, check
from ..ops.norm import FORMS, norm_weight, rms_norm
from ..registry import NOT_REPORTED, Decision, Match, Recipe, join_path, register
from ..patching import Changes, Patch, bind_forward, call_original, set_instance_attr
from ._watch import Watch

NAME = "rms_norm"

# The reference class of each form in transformers (module, class). The form's formula is mpsboost's own
# (ops.norm); the reference only says which code computes it, and is checked against it numerically.
REFERENCES: dict[str, tuple[tuple[str, str], ...]] = {
    "round_then_scale": (("transformers.models.llama.modeling_llama", "LlamaRMSNorm"),),
    "scale_in_fp32": (
        ("transformers.models.gpt_oss.modeling_gpt_oss", "GptOssRMSNorm"),
        ("transformers.models.helium.modeling_helium", "HeliumRMSNorm"),
    ),
    "zero_centered": (
        ("transformers.models.gemma.modeling_gemma", "GemmaRMSNorm"),
        ("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeRMSNorm"),
    ),
}
DEVICES = ("mps", "cuda", "cpu")


@dataclass(frozen=True)
class RmsNormOptions:
    """``options={"rms_norm": {...}}``: ``devices``, the device types it applies on (default: MPS and
    CUDA; CUDA in eager mode only, the compiled graph traces the module's own code)."""

    devices: tuple[str, ...] = ("mps", "cuda")


@dataclass(frozen=True)
class NormTarget:
    """What ``find`` saw: the form (:data:`mpsboost.ops.norm.FORMS`) the module's class computes."""

    form: str


@dataclass(frozen=True)
class RmsNormPlan:
    """The forward one norm gets: ``form`` with the module's ``eps`` (read once: transformers sets it at
    construction and never changes it); ``compiled_stock``: while torch.compile traces, the module's own
    code runs (CUDA). Nothing of it shows in the report (the backing path names the form)."""

    form: str = field(metadata=NOT_REPORTED)
    eps: float = field(metadata=NOT_REPORTED)
    compiled_stock: bool = field(metadata=NOT_REPORTED)


@register
class RmsNorm(Recipe):
    name = NAME
    summary = "transformers RMSNorm layers as one F.rms_norm call (one Metal kernel on MPS)"
    # The reference classes; find() matches every class whose forward is the same code as one of them.
    targets = tuple(f"{m}.{c}" for refs in REFERENCES.values() for m, c in refs)
    lossless = True
    reversible = True
    requires = ()
    default = True
    order = 100
    Options = RmsNormOptions

    def find(self, root: torch.nn.Module, prefix: str = "") -> Iterator[Match]:
        for name, mod in root.named_modules():
            if type(mod).__name__.endswith("RMSNorm") and type(mod).__module__.startswith("transformers."):
                form = form_of(mod)
                if form is not None:
                    yield Match(mod, join_path(prefix, name), NormTarget(form))

    def decide(self, match: Match, env: Env, options: RmsNormOptions) -> Decision:
        bad = [d for d in options.devices if d not in DEVICES]
        if bad:
            raise ValueError(
                f"rms_norm option devices={options.devices!r}: unknown {bad}; accepted: {', '.join(DEVICES)}"
            )
        mod = match.module
        eps = _eps(mod)
        if eps is None or not isinstance(getattr(mod, "weight", None), torch.Tensor) or mod.weight.dim() != 1:
            return Decision.skip("no float eps or 1-D weight on this instance")
        form = match.data.form
        plan = RmsNormPlan(form=form, eps=eps, compiled_stock=env.device_type == "cuda")
        if env.device_type not in options.devices:
            why = {
                "cpu": "on the CPU F.rms_norm is the same composite of ops as the module's code: nothing to gain",
                "cuda": "CUDA left out by options devices",
                "mps": "MPS left out by options devices",
            }[env.device_type]
            return Decision.skip(why)
        if env.device_type == "mps":
            v = check("rms_norm_fused", env)
            if not v.ok:
                return Decision.skip(v.reason)
            return Decision.apply(f"F.rms_norm, one Metal kernel ({form})", v.reason, plan=plan)
        if env.device_type == "cuda":
            return Decision.apply(
                f"F.rms_norm, fused kernel in eager mode ({form})",
                "eager generate() of the Qwen3.6 shape on an H200 decoded faster with it (docs/figures.md); "
                "under torch.compile the module's own code is traced",
                plan=plan,
            )
        return Decision.apply(f"F.rms_norm ({form})", f"asked for on {env.device_type} by options devices", plan=plan)

    def apply(self, match: Match, decision: Decision, env: Env, options: RmsNormOptions) -> Patch:
        plan: RmsNormPlan = decision.plan
        with Changes() as ch:
            ch.add(set_instance_attr(match.module, NAME, _STATE, _NormState()))
            ch.add(bind_forward(match.module, NAME, _forward(plan.form, plan.eps, plan.compiled_stock)))
        return ch.patch(description=f"{NAME}: restore forward")


def _code_key(fn: Any) -> str | None:
    """The syntax tree of a function without its name, decorators, docstring, annotations and comments."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError, IndentationError):
        return None
    node = tree.body[0] if tree.body else None
    if not isinstance(node, ast.FunctionDef):
        return None
    body = node.body
    if (
        body
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        body = body[1:]
    args = ast.arguments(
        posonlyargs=[],
        args=[ast.arg(a.arg) for a in node.args.args],
        vararg=None,
        kwonlyargs=[],
        kw_defaults=[],
        kwarg=None,
        defaults=[],
    )
    return ast.dump(
        ast.Module(body=[ast.FunctionDef("f", args, body, [], None, None)], type_ignores=[]), annotate_fields=False
    )


def _class_key(cls: type) -> tuple[str | None, str | None]:
    return _code_key(cls.forward), _code_key(getattr(cls, "_norm", None)) if hasattr(cls, "_norm") else None


def _eps(module: torch.nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps"):
        v = module.__dict__.get(name)
        if isinstance(v, float) and not isinstance(v, bool):
            return v
    return None


def _formula_holds(cls: type, form: str) -> bool:
    """The reference class computes ``form`` exactly on the CPU, in float32 and bfloat16 (fixed inputs)."""
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        try:
            mod = cls(16) if "eps" not in inspect.signature(cls.__init__).parameters else cls(16, eps=1e-6)
        except Exception:  # noqa: BLE001 - a reference that cannot be built at toy size proves nothing
            return False
        eps = _eps(mod)
        if eps is None or not isinstance(getattr(mod, "weight", None), torch.nn.Parameter):
            return False
        with torch.no_grad():
            mod.weight.copy_(torch.randn(16, generator=g) * 0.5)
            mod.to(dtype)
            x = (torch.randn(3, 16, generator=g) * 3).to(dtype)
            if not torch.equal(mod(x), rms_norm(x, mod.weight, eps, form)):
                return False
    return True


_LOCK = threading.Lock()
# form -> code keys of its reference classes whose formula was checked in this process (classes of the
# installed transformers only; never a model or a module instance).
_CHECKED: dict[str, set] = {}


def _known_keys() -> dict[tuple[str | None, str | None], str]:
    """{code key: form} of the reference classes whose formula holds, computed once per process."""
    import importlib

    with _LOCK:
        if not _CHECKED:
            for form, refs in REFERENCES.items():
                keys = set()
                for mod_name, cls_name in refs:
                    try:
                        cls = getattr(importlib.import_module(mod_name), cls_name)
                    except (ImportError, AttributeError):
                        continue
                    if _formula_holds(cls, form):
                        keys.add(_class_key(cls))
                _CHECKED[form] = keys
        return {key: form for form, keys in _CHECKED.items() for key in keys}


_FORM_OF_CLASS: dict[str, str | None] = {}  # "module.qualname" of a transformers class -> form or None


def form_of(module: torch.nn.Module) -> str | None:
    """The form ``module``'s class computes, or None when its code is not one mpsboost knows."""
    cls = type(module)
    if not cls.__name__.endswith("RMSNorm") or not cls.__module__.startswith("transformers."):
        return None
    path = f"{cls.__module__}.{cls.__qualname__}"
    if path not in _FORM_OF_CLASS:
        _FORM_OF_CLASS[path] = _known_keys().get(_class_key(cls))
    return _FORM_OF_CLASS[path]


_STATE = "_mpsboost_rms_norm"


class _NormState:
    """The float32 weight ``F.rms_norm`` takes (:func:`mpsboost.ops.norm.norm_weight`), kept on the instance
    in eager mode and rebuilt when the module's weight is replaced, moved or written to (a host-side check:
    :class:`~mpsboost.recipes._watch.Watch`), and at every call of more than one token where it is a copy of
    the weight (an edit through ``.data`` moves neither its version nor its pointer). It saves the weight's
    cast and ``1 + w`` on every call: two of the five ops one Qwen3.5/3.6 norm dispatches on MPS in bf16."""

    __slots__ = ("watch", "w32")

    def __init__(self) -> None:
        self.watch: Watch | None = None
        self.w32: torch.Tensor | None = None

    def __deepcopy__(self, memo: dict) -> _NormState:  # a copied model rebuilds it from its own weight
        return _NormState()

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.watch = self.w32 = None


def _forward(form: str, eps: float, compiled_stock: bool):
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if torch.compiler.is_compiling():
            if compiled_stock:
                return call_original(self, NAME, hidden_states)  # traced: inductor fuses the module's code
            return rms_norm(hidden_states, w, eps, form)  # no host-side cache inside traced code
        if torch.is_grad_enabled() and w.requires_grad:
            return rms_norm(hidden_states, w, eps, form)  # the weight's own ops, for autograd
        st = self.__dict__.get(_STATE)
        if st is None:
            return rms_norm(hidden_states, w, eps, form)
        if (
            st.w32 is None
            or not st.watch.fresh()
            or (
                hidden_states.dim() >= 3
                and hidden_states.shape[1] > 1
                and (form == "zero_centered" or (form == "scale_in_fp32" and w.dtype != torch.float32))
            )
        ):
            # Made again when the weight moved or was written to (the Watch), and at every call of more than
            # one token (a prompt) where it is a copy (1 + w, or a cast): an edit through .data leaves no trace.
            with torch.no_grad():
                st.w32 = norm_weight(w.detach(), form)
            st.watch = Watch(self, [("weight",)])
        return rms_norm(hidden_states, w, eps, form, st.w32)

    return forward


assert set(REFERENCES) == set(FORMS)
