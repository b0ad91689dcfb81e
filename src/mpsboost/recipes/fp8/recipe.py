"""fp8_weights: float8_e4m3fn weight storage with per-row or per-tensor float32 scales, fast on every device.

Opt-in and lossy: ``mpsboost.patch(model, fp8="rowwise" | "tensorwise")``. Converts, in place:

* every plain ``torch.nn.Linear`` (exact type: subclasses such as ``MultiheadAttention``'s
  ``out_proj`` read their weight directly and are left alone) of the denoiser/transformer and text
  encoders. Skipped, each with its reason in the report: layers inside diffusers VAEs, the modules a
  model keeps in high precision (``_keep_in_fp32_modules``, diffusers'
  ``_skip_layerwise_casting_patterns``: norms, embeddings, condition embedders), the output
  embedding (``lm_head``; ``include_lm_head=True`` converts it), MoE routers, tied or shared
  weights, and weights that are not plain floating tensors (already quantised);
* the stacked 3-D expert weights of transformers' experts modules (``gate_up_proj``/``up_proj`` and
  ``down_proj`` of every ``use_experts_implementation`` class: Qwen3-MoE, Qwen3.5/3.6-MoE, Mixtral,
  DeepSeek-V3, gpt-oss, ...), where most bytes of an MoE model sit.

After conversion a linear module holds ``weight`` (a buffer: e4m3fn codes, or their uint8 bytes
where float8 cannot live on the device) and ``weight_scale`` (float32, ``[N, 1]`` or ``[]``); an
experts module holds ``<name>`` and ``<name>_scale`` the same way; biases stay in the compute dtype.
Forward paths by device, torch build and the input's row count: see :mod:`mpsboost.ops.fp8` and
:mod:`mpsboost.ops.fp8_moe`; the report names the one each module takes.

Conversion and memory: ``apply`` only validates (shapes, dtypes, finite values, real device) and
binds the forward; nothing is converted while the ``patch()`` transaction can still roll back, so a
rollback restores the very same weights. The transaction's commit then converts layer by layer,
dropping each original weight as soon as its codes exist: the peak during conversion is the model
plus one layer's codes and a bounded scratch (quantisation works on 16M-element slices), never a
second copy of the model (measured on the H200 at the Qwen3-30B-A3B shape: the fp8 records' NOTES).

Options (``mpsboost.patch(m, fp8="rowwise", options={"fp8_weights": {...}})``):
``include`` / ``exclude``: glob patterns (``fnmatch``) on the module path in the report (e.g.
``"transformer.blocks.*.ffn.*"``); ``include_lm_head`` (bool); ``experts`` (bool, default True);
``gemv_max_m`` (CUDA: rows at or below which the fp8 GEMV runs; default from the tuning file
``fp8_gemv``: 16); ``moe_gather_max_pairs`` (routed pairs at or below which experts are gathered per
pair; default from ``fp8_gemv`` on the GPU it was measured on, else 16); ``moe_path`` ("auto",
"scaled_grouped_mm", "gather", "hit", "stack"); ``activations`` ("bf16", default: batches above
``gemv_max_m`` dequantise the layer and multiply in the activation dtype, the stored weights exactly;
"fp8": CUDA quantises activations rowwise for ``scaled_mm``, which is not the same math); ``mps_kernel``
("auto", default: decode on mpsboost's Metal fp8 GEMV, :mod:`mpsboost.ops.fp8_metal`, where the gate has
``torch.mps.compile_shader`` and, on a real Mac, the kernel's patch-time self-check passed; "metal": the same;
"scaled_mm": torch's own ``F.scaled_mm`` few-rows kernels, MPS 2.15+, dequantisation before).

Modes: every forward installed here compiles with ``torch.compile(fullgraph=True)``. The kernels are
registered operators, the ``scaled_mm`` bias probe and the GEMV's launch tuning run at patch time, and
the experts forward selects a traceable path with ``torch.compiler.is_compiling()`` (a trace-time
constant): where eager mode reads the hit experts on the host (``"hit"``), a compiled forward
dequantises the layer's stack instead (``"stack"``); the report row says so.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
import re
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterator, Literal, Optional

import torch

from ... import tuning
from ...gate import Env, Verdict, check
from ...ops import fp8 as fp8_ops
from . import paths as fp8_paths
from ...ops import fp8_moe
from ...errors import Fp8ConversionError, PatchError
from .layers import (  # noqa: F401  (FP8Linear re-exported: the class a converted nn.Linear prints as)
    RECIPE,
    FP8Linear,
    Fp8State,
    LoadedLayer,
    expert_weight_names as _expert_weight_names,
    fp8_class,
    weight_names,
    fp8_state,
    forward_for,
    is_hf_experts as _is_hf_experts,
    plain_linear,
)
from ...registry import Decision, Match, Recipe, join_path, register
from ...patching import Changes, Patch, at_commit, bind_forward, replace_at_commit, swap_class

NAME = RECIPE
log = logging.getLogger("mpsboost")

_VAE_PREFIX = "diffusers.models.autoencoders."
_ROUTER_NAMES = ("gate", "router")


# ------------------------------------------------------------------------------------------ finding


def _class_paths(mod: torch.nn.Module) -> list[str]:
    return [f"{c.__module__}.{c.__qualname__}" for c in type(mod).__mro__]


def _plain_float(t: Any) -> bool:
    return (
        isinstance(t, torch.Tensor)
        and type(t.data) is torch.Tensor
        and t.is_floating_point()
        and t.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2)
    )


class _Context:
    """Facts about the model tree that decide which layers stay in high precision (static)."""

    def __init__(self, root: torch.nn.Module):
        self.param_uses = Counter(id(p) for _, p in root.named_parameters(remove_duplicate=False))
        self.owners: list[tuple[str, torch.nn.Module]] = []
        self.vae: list[str] = []
        self.output_embeddings: set[int] = set()
        for name, mod in root.named_modules():
            if any(p.startswith(_VAE_PREFIX) for p in _class_paths(mod)):
                self.vae.append(name)
            if hasattr(mod, "_keep_in_fp32_modules") or hasattr(mod, "_skip_layerwise_casting_patterns"):
                self.owners.append((name, mod))
            get_out = getattr(mod, "get_output_embeddings", None)
            if callable(get_out):
                try:
                    oe = get_out()
                except Exception:  # models without an LM head raise NotImplementedError or similar
                    oe = None
                if isinstance(oe, torch.nn.Module):
                    self.output_embeddings.add(id(oe))

    @staticmethod
    def _under(name: str, prefix: str) -> bool:
        return prefix == "" or name == prefix or name.startswith(prefix + ".")

    def skip_reason(
        self, name: str, mod: torch.nn.Module, tensors: list[tuple[str, Any]], parent: torch.nn.Module | None
    ) -> str | None:
        for v in self.vae:
            if self._under(name, v):
                return "inside a VAE: kept in the compute dtype (image quality; its linear bytes are few)"
        for oname, owner in self.owners:
            if not self._under(name, oname):
                continue
            rel = name[len(oname) + 1 :] if oname else name
            parts = rel.split(".")
            for attr in ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict"):
                keep = getattr(owner, attr, None) or ()
                hit = next((k for k in keep if k in parts), None)
                if hit:
                    return f"{type(owner).__name__}.{attr} keeps {hit!r} in high precision"
            for pat in getattr(owner, "_skip_layerwise_casting_patterns", None) or ():
                if re.search(pat, rel):
                    return f"{type(owner).__name__}._skip_layerwise_casting_patterns keeps {pat!r} in high precision"
        # Tensor facts first: a tied lm_head stays skipped even with include_lm_head=True.
        for tname, t in tensors:
            if t is None:
                return f"{tname} is missing"
            if not _plain_float(t):
                kind = type(t.data).__name__ if isinstance(t, torch.Tensor) else type(t).__name__
                dt = getattr(t, "dtype", "?")
                return f"{tname} is not a plain floating tensor ({kind}, {dt}): already quantised or wrapped"
            if self.param_uses.get(id(t), 0) > 1:
                return f"{tname} is shared with another module (tied weights): converting it would change both"
        if id(mod) in self.output_embeddings:
            return "output embedding (lm_head): kept in the compute dtype; options include_lm_head=True converts it"
        last = name.rsplit(".", 1)[-1]
        if parent is not None and last in _ROUTER_NAMES and hasattr(parent, "experts"):
            return "MoE router: kept in the compute dtype (expert selection is sensitive to rounding)"
        if parent is not None and last == "shared_expert_gate" and hasattr(parent, "experts"):
            # [1, H]: no fp8 matmul takes one output row (scaled_mm needs N % 16 == 0), so in fp8 it would be
            # dequantised per call (2 more dispatches and 5 bytes per weight instead of 2 at decode) to save H bytes.
            return (
                "shared-expert gate (one output): kept in the compute dtype, as the published Qwen3.6-FP8 checkpoint "
                "keeps it (its bytes are few; in fp8 it would be dequantised at every call)"
            )
        return None


# ------------------------------------------------------------------------------------------ options


def _patterns(value: Any, key: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise ValueError(
        f"fp8_weights option {key}={value!r}: expected a glob pattern or a list of them, e.g. ['*.attn.*']"
    )


@dataclass(frozen=True)
class Fp8WeightsOptions:
    """``options={"fp8_weights": {...}}`` (see the module docstring). ``fp8``, the granularity
    ("rowwise" or "tensorwise"), is what the public ``fp8=`` keyword of patch() sets."""

    fp8: str | None = None
    include: str | tuple[str, ...] | list[str] | None = None
    exclude: str | tuple[str, ...] | list[str] | None = None
    include_lm_head: bool = False
    experts: bool = True
    gemv_max_m: int | None = None  # None: from the tuning file (see _thresholds)
    moe_gather_max_pairs: int | None = None
    moe_path: Literal["auto", "scaled_grouped_mm", "gather", "hit", "stack"] = "auto"
    activations: Literal["bf16", "fp8"] = "bf16"  # above the GEMV: "bf16" dequantises the layer (exact), "fp8"
    # quantises the activations for scaled_mm
    # MPS decode: "auto" (mpsboost's Metal kernel where the gate and its patch-time self-check allow it, else torch's
    # scaled_mm few-rows kernels where they exist; where both serve a linear, on a real Mac the faster at its shape,
    # timed at patch time), "metal" (the Metal kernel untimed: the static choice), "scaled_mm" (torch's kernels only)
    mps_kernel: Literal["auto", "metal", "scaled_mm"] = "auto"


def _parse(options: Fp8WeightsOptions) -> Fp8WeightsOptions:
    """The options with their values checked (ValueError) and normalised: a granularity, pattern tuples."""
    gran = options.fp8 or "rowwise"
    if gran not in fp8_ops.GRANULARITIES:
        raise ValueError(f"fp8 granularity must be one of {fp8_ops.GRANULARITIES}, got {gran!r}")
    for key in ("gemv_max_m", "moe_gather_max_pairs"):
        v = getattr(options, key)
        if v is not None and v < 0:
            raise ValueError(f"fp8_weights option {key}={v!r}: expected an int >= 0")
    if options.moe_path not in ("auto", *fp8_moe.PATHS):
        raise ValueError(
            f"fp8_weights option moe_path={options.moe_path!r}: expected 'auto' or one of {', '.join(fp8_moe.PATHS)}"
        )
    if options.activations not in fp8_paths.ACTIVATIONS:
        raise ValueError(
            f"fp8_weights option activations={options.activations!r}: expected 'bf16' (dequantise large "
            "batches, exact) or 'fp8' (quantise activations for scaled_mm)"
        )
    if options.mps_kernel not in fp8_paths.MPS_KERNELS:
        raise ValueError(
            f"fp8_weights option mps_kernel={options.mps_kernel!r}: expected one of {', '.join(fp8_paths.MPS_KERNELS)}"
        )
    return dataclasses.replace(
        options, fp8=gran, include=_patterns(options.include, "include"), exclude=_patterns(options.exclude, "exclude")
    )


# ------------------------------------------------------------------------------------------ conversion


def _all_finite(t: torch.Tensor) -> bool:
    """``torch.isfinite(t).all()``. A finite sum proves it (an inf or NaN term makes any sum inf or NaN, in any
    order): one reduction that allocates nothing, 40x faster than isfinite on a bf16 expert stack on the CPU.
    Only a sum that is not finite (such a term, or an overflow) is settled exactly, by isfinite in slices:
    isfinite materialises |t| and two masks (2.5x the layer)."""
    if bool(t.sum().isfinite()):
        return True
    per = max(1, (1 << 24) // max(1, t[0].numel()))
    flags = [torch.isfinite(t[i : i + per]).all() for i in range(0, t.shape[0], per)]
    return bool(torch.stack(flags).all())  # one host read for the whole tensor


def _tune_gemv(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Patch time: one decode-shaped call of the fp8 GEMV on a CUDA layer, so that its launch configuration
    is tuned and its kernel compiled now, outside any trace or CUDA-graph capture."""
    q = module.weight
    if not q.is_cuda or torch.cuda.is_current_stream_capturing():
        return
    with torch.no_grad():
        fp8_ops.fp8_gemv(torch.zeros(1, q.shape[1], device=q.device, dtype=dtype), q, module.weight_scale, module.bias)


def _converter(granularity: str, storage: str, k_dims: dict[str, int]):
    """The conversion of one weight for :func:`patching.replace_at_commit`: its fp8 codes under its own
    name and its float32 scales as ``<name>_scale``."""

    def convert(name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
        q, scale = fp8_ops.quantize(w.detach(), granularity, storage, k_dim=k_dims[name])
        return {name: q, name + "_scale": scale}

    return convert


# ------------------------------------------------------------------------------------------ thresholds

_DEFAULT_GEMV_MAX_M = 16
_DEFAULT_GATHER_MAX = 16


def _thresholds(env: Env, opts: Fp8WeightsOptions) -> tuple[int, int, str]:
    """(gemv_max_m, moe_gather_max_pairs, where they come from) for ``env``: options first, then the
    tuning file ``fp8_gemv`` where it was measured on this kind of device, else the defaults."""
    gemv, gather = opts.gemv_max_m, opts.moe_gather_max_pairs
    if gemv is not None and gather is not None:
        return gemv, gather, "thresholds set by options"
    if env.device_type != "cuda":
        return (
            gemv if gemv is not None else _DEFAULT_GEMV_MAX_M,
            gather if gather is not None else _DEFAULT_GATHER_MAX,
            "",
        )
    t, why = tuning.for_env("fp8_gemv", env)
    if t is None:
        # Another GPU: the GEMV's one-tile limit still holds (it is the kernel's, not a timing), and its
        # launch configurations are tuned on this GPU at patch time; the gather threshold is unmeasured here.
        return (
            gemv if gemv is not None else _DEFAULT_GEMV_MAX_M,
            gather if gather is not None else _DEFAULT_GATHER_MAX,
            f"default thresholds ({why})",
        )
    e = t.entries
    return (
        gemv if gemv is not None else int(e["gemv_max_m"]),
        gather if gather is not None else int(e["moe_gather_max_pairs"]),
        f"thresholds from fp8_gemv, {t.describe()}",
    )


def _metal_decode(env: Env, ws: list[torch.Tensor], transposed: bool, opts: Fp8WeightsOptions) -> Optional[Verdict]:
    """Whether a module with fp8 weights ``ws`` (a linear's ``[N, K]``, an experts module's stacks) decodes on
    mpsboost's Metal GEMV in ``env``: None where that is not a question (not MPS, option ``mps_kernel='scaled_mm'``
    or a ``moe_path`` forced), else the verdict. Reads only shapes and dtypes."""
    if env.device_type != "mps" or opts.mps_kernel == "scaled_mm" or opts.moe_path != "auto":
        return None
    v = fp8_paths.metal_verdict(env)
    if not v.ok:
        return v
    if transposed:
        return Verdict(False, "its stacks are stored [E, in, out] (transposed): the kernel reads [E, out, in]")
    if not all(fp8_ops.metal_ok(w.shape[-1], ws[0].dtype) for w in ws):
        return Verdict(False, f"K {[w.shape[-1] for w in ws]} not multiples of 16, or {ws[0].dtype} activations")
    return v


def _metal_or_scaled_mm(env: Env, metal: Any, n: int, k: int, dtype: torch.dtype) -> Any:
    """Where both mpsboost's Metal fp8 GEMV (``metal``, the path :func:`fp8_paths.choose_linear_path` chose) and
    torch's own few-rows fp8 kernels serve an ``[n, k]`` layer on MPS: the faster one at this shape on the user's
    Mac (:func:`mpsboost.ondevice.choose`, cached per chip, macOS, torch and shape). The static choice, taken where
    nothing is timed (a simulated Mac, option ``mps_kernel="metal"``), is the Metal GEMV: one dispatch reading the
    codes as stored, where torch's path quantises the activation first (five dispatches, then ``F.scaled_mm``)."""
    from ... import ondevice

    alt = fp8_paths.mps_path_without_metal(env, n=n, k=k, dtype=dtype)
    if alt.kind != "mps_scaled_mm":  # nothing to time against: torch has no few-rows fp8 kernel for it here
        return metal
    stock, candidate = fp8_ops.gemv_contenders(n, k, dtype)
    choice = ondevice.choose(
        "fp8_gemv",
        f"M1 N{n} K{k} {str(dtype).removeprefix('torch.')}",
        env=env,
        stock=ondevice.Contender("torch's scaled_mm few-rows kernels", stock),
        candidate=ondevice.Contender("mpsboost's Metal fp8 GEMV", candidate),
        static=True,
    )
    if choice.taken:
        return dataclasses.replace(metal, reason=f"{metal.reason}; {choice.describe()}")
    return dataclasses.replace(alt, reason=f"{alt.reason}; {choice.describe()}")


def _torch_few_rows(env: Env, ws: list[torch.Tensor], tr: bool, storage: str, opts: Fp8WeightsOptions) -> bool:
    """Whether torch's own few-rows fp8 kernels (MPS 2.15's ``scaled_mm_few_rows_*`` behind ``F.scaled_mm``) serve
    an experts module's decode here: float8 codes in the [E, out, in] layout, 16-aligned, ``moe_path='auto'``."""
    return (
        env.device_type == "mps"
        and opts.moe_path == "auto"
        and storage == "float8"
        and not tr
        and check("fp8_gemv", env).ok
        and check("scaled_mm", env).ok
        and all(fp8_ops.few_rows_ok(w.shape[1], w.shape[2], ws[0].dtype) for w in ws)
    )


# Routed experts a decode token reads, for the timing of an experts module's two decode paths: the module does not
# know its router's top-k; 8 is Qwen3.5/3.6-MoE's, Qwen3-MoE's, OLMoE's and Qwen2-MoE's top-k is 8 or less.
_TIMED_TOP_K = 8


def _grouped_or_scaled_mm(env: Env, ws: list[torch.Tensor]) -> tuple[str, str]:
    """Where both mpsboost's Metal grouped GEMV and torch's few-rows fp8 kernels serve an experts module's decode on
    MPS: the faster at its shape on the user's Mac (:func:`mpsboost.ondevice.choose`, cached per chip, macOS, torch
    and shape), as ``(few_rows, what was decided)``. The static choice (a simulated Mac; nothing timed) is the Metal
    grouped GEMV: one dispatch per projection reading the routed experts in place, where torch's path gathers their
    codes first (a copy of each routed expert) and quantises the activations."""
    from ... import ondevice

    up, down = ws[0], ws[-1]
    e, n_up, h = up.shape
    inter = down.shape[2]
    k = min(_TIMED_TOP_K, e)
    if n_up != 2 * inter:  # not a fused gate-up stack: nothing this timing models
        return "grouped", "not timed: the up stack is not gate and up fused"
    stock, candidate = fp8_moe.experts_contenders(e, n_up, h, inter, k, ws[0].dtype)
    choice = ondevice.choose(
        "fp8_grouped_gemv",
        f"T1 E{e} top{k} up{n_up}x{h} down{h}x{inter} {str(ws[0].dtype).removeprefix('torch.')}",
        env=env,
        stock=ondevice.Contender("torch's scaled_mm few-rows kernels (routed experts gathered)", stock),
        candidate=ondevice.Contender("mpsboost's Metal fp8 grouped GEMV", candidate),
        static=True,
    )
    return ("grouped" if choice.taken else "scaled_mm"), choice.describe()


def _compiled_path(large: str) -> str:
    return large if large in fp8_moe.TRACEABLE else "stack"


# ------------------------------------------------------------------------------------------ the plan


@dataclass(frozen=True)
class Fp8Plan:
    """What :meth:`Fp8Weights.decide` (a module of the model) or :meth:`Fp8Weights.decide_loaded` (a module
    filled from a file) chose: ``Decision.plan``. :func:`_state` turns it into the layer's :class:`Fp8State`,
    the same for both, so that a quantised and a loaded layer run the same forward by the same path."""

    kind: str  # "linear" or "experts"
    granularity: str
    storage: str  # "float8" or "uint8"
    path: str  # linear: "fused", "mps_scaled_mm", "dequant" or "block"; experts: the path for many pairs
    compute_dtype: torch.dtype  # the weights' dtype, or the dtype a loaded layer computes in
    gemv_max_m: int = 16
    large: str = "dequant"
    compiled_path: str = "stack"
    gather_max: int = 0
    native_grouped: bool = False
    histc_int: bool = False
    block: tuple[int, int] | None = None  # loaded block scales, applied as they are
    few_rows: str = ""  # experts: decode on the gathered fp8 codes by this kernel ("scaled_mm" MPS, "gemv" CUDA)

    def report_details(self) -> dict:
        """Nothing of the plan itself: each decision names what its report row shows (sizes before and after,
        the file a layer came from), which the plan does not hold."""
        return {}


def _state(plan: Fp8Plan, device: torch.device, backing: str) -> Fp8State:
    """The layer state of ``plan`` for codes on ``device``."""
    compute_dtype = plan.compute_dtype
    if plan.kind == "linear":
        # Patch-time probe (never in a forward): can the fp8 matmul this path calls take the bias with rowwise
        # scales here? The MPS path calls F.scaled_mm (aten::_scaled_mm_v2), CUDA's torch._scaled_mm.
        bias_in_mm = (
            plan.path in ("fused", "mps_scaled_mm")
            and plan.storage == "float8"
            and fp8_ops.scaled_mm_bias_supported(str(device), "v2" if plan.path == "mps_scaled_mm" else "v1")
        )
        return Fp8State(
            kind=plan.path,
            compute_dtype=compute_dtype,
            granularity=plan.granularity,
            block=plan.block,
            gemv_max_m=plan.gemv_max_m,
            bias_in_mm=bias_in_mm,
            large=plan.large,
            few_rows=plan.few_rows,
            backing=backing,
        )
    return Fp8State(
        kind="experts",
        compute_dtype=compute_dtype,
        granularity=plan.granularity,
        block=plan.block,
        large_path=plan.path,
        compiled_path=plan.compiled_path,
        gather_max=plan.gather_max,
        native_grouped=plan.native_grouped,
        histc_int=plan.histc_int,
        few_rows=plan.few_rows,
        backing=backing,
    )


def _layer(module: torch.nn.Module, state: Fp8State) -> list[Patch]:
    """The fp8 layer itself: its forward bound on the instance (the state rides along in the module's
    mpsboost record, where save_fp8 finds it) and its class swapped, so that ``print(model)`` shows an
    FP8Linear (FP8<Experts>). For quantised and loaded layers alike; if the second change fails, the first
    is undone before the error propagates."""
    with Changes() as ch:
        ch.add(bind_forward(module, NAME, forward_for(state), fp8=state))
        ch.add(swap_class(module, NAME, fp8_class(type(module))))
    return ch.parts


# ------------------------------------------------------------------------------------------ the recipe


@register
class Fp8Weights(Recipe):
    name = NAME
    summary = (
        "float8_e4m3fn weights with per-row or per-tensor fp32 scales; "
        "fused fp8 GEMV/scaled_mm on CUDA, mpsboost's Metal fp8 GEMV at decode on MPS, per-layer dequantise elsewhere"
    )
    targets = (
        "torch.nn.modules.linear.Linear",
        # Experts modules are found by transformers' use_experts_implementation decorator, e.g.:
        "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts",
        "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeExperts",
        "transformers.models.mixtral.modeling_mixtral.MixtralExperts",
        "transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts",
    )
    lossless = False
    reversible = False
    default = False
    keyword = "fp8"  # patch(..., fp8="rowwise" | "tensorwise") selects it and sets its option fp8
    keyword_field = "fp8"
    keyword_values = fp8_ops.GRANULARITIES  # what the keyword accepts (patch() checks it before anything else)
    Options = Fp8WeightsOptions
    requires = ()
    order = 200

    def find(self, root: torch.nn.Module, prefix: str = "") -> Iterator[Match]:
        ctx = None
        modules = dict(root.named_modules())
        for name, mod in modules.items():
            if plain_linear(mod):
                kind, tensors = "linear", [("weight", mod.weight)]
            elif _is_hf_experts(mod):
                kind = "experts"
                tensors = [(n, getattr(mod, n, None)) for n in _expert_weight_names(mod)]
            else:
                continue
            if ctx is None:
                ctx = _Context(root)
            parent = modules.get(name.rsplit(".", 1)[0] if "." in name else "") if name else None
            skip = ctx.skip_reason(name, mod, tensors, parent)
            if skip is None and kind == "experts" and getattr(mod, "_is_expert_parallel", False):
                skip = "expert-parallel experts (sentinel routing across ranks) are not converted"
            if skip is None and kind == "experts" and any(t.dim() != 3 for _, t in tensors):
                skip = "expert weights are not 3-D [E, out, in] stacks"
            yield Match(
                mod,
                join_path(prefix, name),
                {"kind": kind, "skip": skip, "lm_head": skip is not None and skip.startswith("output embedding")},
            )

    # ------------------------------------------------------------------ a module converted already
    def repeat_request(self, match: Match, options: Fp8WeightsOptions) -> str | None:
        """For a module this recipe converted by an earlier call (the API asks before reporting "already
        patched"): the same granularity again is a no-op (returns the row's reason); another one raises
        :class:`PatchError` naming both, since the codes cannot be re-quantised from themselves and
        silently keeping the first would report a request that was never carried out. Nothing has
        changed when it raises (planning precedes every change)."""
        state = fp8_state(match.module)
        want = options.fp8
        if state is None or want is None:
            return None
        have, block = state.granularity, state.block
        have_text = f"{have} {block[0]}x{block[1]}" if have == "block" and block else have
        if want != have:
            raise PatchError(
                f"fp8_weights: {match.path} holds fp8 weights with {have_text} scales already "
                "(an earlier patch(fp8=...) "
                f"or load_fp8); this call asks for fp8={want!r}. "
                "fp8 codes are not re-quantised to another granularity: "
                f"call patch(model, fp8={have!r}) (a no-op), "
                f"or reload the bf16 weights and patch(model, fp8={want!r}). "
                "Nothing was changed.",
                recipe=NAME,
                target=match.path,
            )
        return f"converted already with {have_text} scales (the granularity asked for)"

    # ------------------------------------------------------------------ deciding

    # ------------------------------------------------------------------ deciding
    def decide(self, match: Match, env: Env, options: Fp8WeightsOptions) -> Decision:
        opts = _parse(options)
        data, mod, path = match.data, match.module, match.path
        skip = data["skip"]
        if skip is not None and not (data["lm_head"] and opts.include_lm_head):
            return Decision.skip(skip)
        if opts.include and not any(fnmatch.fnmatchcase(path, p) for p in opts.include):
            return Decision.skip(f"not matched by include patterns {list(opts.include)}")
        hit = next((p for p in opts.exclude if fnmatch.fnmatchcase(path, p)), None)
        if hit is not None:
            return Decision.skip(f"excluded by pattern {hit!r}")
        gran = opts.fp8
        storage = fp8_paths.storage_for(env)
        if data["kind"] == "linear":
            w = mod.weight
            n, k = w.shape
            plan, backing, why = self._linear_plan(env, (n, k), w.dtype, gran, storage, opts)
            before = w.numel() * w.element_size()
            after = w.numel() + (4 * n if gran == "rowwise" else 4)
            return Decision.apply(
                backing,
                f"{gran} scales, {plan.storage} storage: {why}",
                plan=plan,
                kind="linear",
                granularity=gran,
                storage=plan.storage,
                compute_dtype=str(w.dtype).replace("torch.", ""),
                bytes_before=before,
                bytes_after=after,
                path_kind=plan.path,
                gemv_max_m=plan.gemv_max_m,
                large=plan.large,
            )
        if not opts.experts:
            return Decision.skip("expert weights excluded by option experts=False")
        ws = [getattr(mod, n) for n in _expert_weight_names(mod)]
        tr = bool(getattr(mod, "is_transposed", False))
        plan, backing, why = self._experts_plan(env, ws, tr, gran, storage, opts)
        before = sum(w.numel() * w.element_size() for w in ws)
        after = sum(
            w.numel() + 4 * (w.numel() // w.shape[2 if not tr else 1] if gran == "rowwise" else w.shape[0]) for w in ws
        )
        return Decision.apply(
            backing,
            f"{gran} scales per expert, {storage} storage: {why}",
            plan=plan,
            kind="experts",
            granularity=gran,
            storage=storage,
            compute_dtype=str(ws[0].dtype).replace("torch.", ""),
            bytes_before=before,
            bytes_after=after,
            large_path=plan.path,
            compiled_path=plan.compiled_path,
            gather_max_pairs=plan.gather_max,
        )

    def decide_loaded(self, module: torch.nn.Module, path: str, env: Env, layer: LoadedLayer) -> Decision:
        """The decision for a module that :func:`mpsboost.load_fp8` fills with a file's codes and scales:
        the path :meth:`decide` takes for the same shapes, dtype and device (default options), or, for
        block scales, the block-scaled forward that applies them as they are. Reads no data."""
        storage = fp8_paths.storage_for(env)
        opts = _parse(Fp8WeightsOptions())
        details: dict[str, Any] = {
            "kind": layer.kind,
            "granularity": layer.granularity,
            "storage": storage,
            "compute_dtype": str(layer.compute_dtype).replace("torch.", ""),
            "bytes_after": layer.nbytes,
            "loaded_from": layer.loaded_from,
            "format": layer.format,
        }
        if layer.block is not None:
            bn, bk = layer.block
            details["block"] = [bn, bk]
            linear = layer.kind == "linear"
            head = f"block-scaled fp8 {bn}x{bk}"
            rest = "dequantise then linear" if linear else "dequantise only the hit experts, one at a time"
            backing = f"{head}, {rest}" if linear else f"{head}: {rest}"
            why = f"{storage} storage, scales kept exactly as in {layer.source}"
            # Decode on mpsboost's Metal kernel, which applies the block scales as they are inside its product.
            ws = [torch.empty(sh, dtype=layer.compute_dtype, device="meta") for sh in layer.shapes]
            metal = _metal_decode(env, ws, False, opts)
            few_rows = ""
            if metal is not None and metal.ok and bk % 16 == 0:
                few_rows = "grouped"
                rows = f"<= {fp8_ops.FEW_ROWS_MAX} " + ("rows" if linear else "tokens")
                kernel = "GEMV" if linear else "grouped GEMV (routed experts read in place)"
                backing = (
                    f"{head}: decode ({rows}) on mpsboost's Metal fp8 {kernel}, the block scales applied in it "
                    f"(1 byte per weight); {rest} above"
                )
                why = f"{why}; decode: {metal.reason}"
            elif metal is not None:
                why = f"{why}; decode not on mpsboost's Metal kernel: " + (
                    metal.reason if not metal.ok else f"block {bk} along K is not a multiple of 16"
                )
            plan = Fp8Plan(
                kind=layer.kind,
                granularity="block",
                storage=storage,
                path="block",
                compute_dtype=layer.compute_dtype,
                block=layer.block,
                few_rows=few_rows,
                gemv_max_m=fp8_ops.FEW_ROWS_MAX if few_rows else 16,
            )
            return Decision.apply(backing, why, plan=plan, **details)
        gran, dtype = layer.granularity, layer.compute_dtype
        source = layer.source
        if layer.requantized_from is not None:
            bn, bk = layer.requantized_from
            details["requantized_from"] = f"block {bn}x{bk}"
            source = (
                f"{source}, requantised at load from {bn}x{bk} block scales to rowwise "
                "(lossy: each weight within half an e4m3 step)"
            )
        layer = dataclasses.replace(layer, source=source)
        if layer.kind == "linear":
            plan, backing, why = self._linear_plan(env, layer.shapes[0], dtype, gran, storage, opts)
            return Decision.apply(
                backing, f"{gran} scales from {layer.source}, {plan.storage} storage: {why}", plan=plan, **details
            )
        ws = [torch.empty(s, dtype=dtype, device="meta") for s in layer.shapes]
        tr = bool(getattr(module, "is_transposed", False))
        plan, backing, why = self._experts_plan(env, ws, tr, gran, storage, opts)
        return Decision.apply(
            backing, f"{gran} scales per expert from {layer.source}, {storage} storage: {why}", plan=plan, **details
        )

    @staticmethod
    def _linear_plan(
        env: Env, shape: tuple[int, ...], dtype: torch.dtype, gran: str, storage: str, opts: Fp8WeightsOptions
    ) -> tuple[Fp8Plan, str, str]:
        """(plan, backing, why) of a linear layer ``[N, K]`` computing in ``dtype``."""
        n, k = shape
        gemv_max, _, where = _thresholds(env, opts)
        lp = fp8_paths.choose_linear_path(
            env, n=n, k=k, dtype=dtype, gemv_max_m=gemv_max, activations=opts.activations, mps_kernel=opts.mps_kernel
        )
        if lp.kind == "fused" and env.device_type == "mps" and opts.mps_kernel == "auto":
            lp = _metal_or_scaled_mm(env, lp, n, k, dtype)
        extra = f"; {where}" if where and lp.kind == "fused" else ""
        comp = "compiled: the same path (registered operators)" if lp.kind == "fused" else "compiled: the same path"
        plan = Fp8Plan(
            kind="linear",
            granularity=gran,
            storage=lp.storage,
            path=lp.kind,
            compute_dtype=dtype,
            gemv_max_m=lp.gemv_max_m,
            large=lp.large,
        )
        return plan, lp.backing, f"{lp.reason}{extra}; {comp}"

    def _experts_plan(
        self, env: Env, ws: list[torch.Tensor], tr: bool, gran: str, storage: str, opts: Fp8WeightsOptions
    ) -> tuple[Fp8Plan, str, str]:
        """(plan, backing, why) of an experts module with stacks ``ws`` (only shapes and dtype are read)."""
        _, gather_max, where = _thresholds(env, opts)
        large, why = self._experts_path(env, ws, tr, storage, opts)
        # Few routed pairs (decoding) gather their experts in fp8: on the H200 the fastest of the three at the
        # Qwen3-30B-A3B shape's decode step (the fp8 records).
        gather = gather_max if opts.moe_path == "auto" else (1 << 62 if opts.moe_path == "gather" else 0)
        backing = fp8_moe.BACKING[large]
        if large != "gather" and gather > 0:
            backing += f" (gather at <= {gather} routed pairs)"
        comp = _compiled_path(large)
        if comp != large:
            why += f"; compiled: {fp8_moe.BACKING[comp]} ('{large}' reads expert counts on the host)"
        else:
            why += "; compiled: the same path"
        if where and env.device_type == "cuda":
            why += f"; {where}"
        few_rows = ""
        metal = _metal_decode(env, ws, tr, opts)
        torch_few_rows = _torch_few_rows(env, ws, tr, storage, opts)
        if metal is not None and metal.ok:
            few_rows = "grouped"  # mpsboost's Metal grouped GEMV: routed experts read in place, 1 byte per weight
            if torch_few_rows and opts.mps_kernel == "auto":
                few_rows, timed = _grouped_or_scaled_mm(env, ws)
                metal = dataclasses.replace(metal, reason=f"{metal.reason}; {timed}")
        elif torch_few_rows and opts.mps_kernel != "metal":
            few_rows = "scaled_mm"
        elif opts.moe_path == "auto" and storage == "float8" and not tr:
            if env.device_type == "cuda" and check("fp8_gemv", env).ok and check("scaled_mm", env).ok:
                few_rows = "gemv"  # mpsboost's Triton fp8 GEMV: the weights read once as fp8, activations untouched
        if few_rows:
            backing = f"{fp8_moe.FEW_ROWS_BACKING[few_rows]}; {backing} above"
        if few_rows == "grouped":
            why = f"{why}; decode: {metal.reason}"
        elif few_rows == "scaled_mm" and metal is not None and metal.ok:
            why = f"{why}; decode on torch's few-rows kernels, not mpsboost's Metal grouped GEMV: {metal.reason}"
        elif metal is not None:
            why = f"{why}; decode not on mpsboost's Metal kernel: {metal.reason}"
        plan = Fp8Plan(
            kind="experts",
            granularity=gran,
            storage=storage,
            path=large,
            compute_dtype=ws[0].dtype,
            compiled_path=comp,
            gather_max=gather,
            native_grouped=check("grouped_mm", env).ok,
            histc_int=check("histc_int", env).ok,
            few_rows=few_rows,
        )
        return plan, backing, why

    @staticmethod
    def _experts_path(
        env: Env, ws: list[torch.Tensor], transposed: bool, storage: str, opts: Fp8WeightsOptions
    ) -> tuple[str, str]:
        forced = opts.moe_path
        sg = check("scaled_grouped_mm", env)
        aligned = all(w.shape[1] % 16 == 0 and w.shape[2] % 16 == 0 for w in ws)
        sg_ok = sg.ok and storage == "float8" and not transposed and aligned and ws[0].dtype == torch.bfloat16
        if forced not in ("auto", "gather"):
            if forced == "scaled_grouped_mm" and not sg_ok:
                return (
                    "hit",
                    "moe_path=scaled_grouped_mm cannot run here "
                    f"({sg.reason if not sg.ok else 'layout, alignment or dtype'}); hit experts instead",
                )
            return forced, "forced by option moe_path"
        if sg_ok:
            return "scaled_grouped_mm", sg.reason
        if not sg.ok:
            why = sg.reason
        elif transposed:
            why = "transposed [E, in, out] layout: scaled_grouped_mm needs [E, out, in]"
        elif not aligned:
            why = "expert dims are not multiples of 16"
        else:
            why = f"{ws[0].dtype} weights: scaled_grouped_mm gives bf16 only"
        gm = check("grouped_mm", env)
        return (
            "hit",
            f"no fp8 grouped kernel ({why}); "
            f"hit experts then {'native grouped_mm' if gm.ok else 'one expert at a time'}",
        )

    # ------------------------------------------------------------------ applying
    def apply(self, match: Match, decision: Decision, env: Env, options: Fp8WeightsOptions) -> Patch:
        mod, plan = match.module, decision.plan
        names = ("weight",) if plan.kind == "linear" else _expert_weight_names(mod)
        tr = bool(getattr(mod, "is_transposed", False))
        k_dims = (1,) if plan.kind == "linear" else ((1 if tr else 2),) * 2
        # Validate now, while the transaction can still roll back: after this, conversion at commit
        # cannot fail on the data.
        for n in names:
            t = getattr(mod, n)
            if t.device.type == "meta":
                raise Fp8ConversionError(f"{match.path}.{n} is on the meta device (no data); load the weights first")
            if not _all_finite(t):
                raise Fp8ConversionError(
                    f"{match.path}.{n} holds inf or NaN values; FP8 scales need finite weights. Fix the checkpoint, "
                    f"or exclude this module: options={{'fp8_weights': {{'exclude': [{match.path!r}]}}}}"
                )
        compute_dtype = plan.compute_dtype
        state = _state(plan, getattr(mod, names[0]).device, decision.backing)

        def converted() -> None:
            state.mark_converted()
            if plan.kind == "linear" and plan.path == "fused" and plan.gemv_max_m > 0:
                _tune_gemv(mod, compute_dtype)

        def keep_original(exc: BaseException) -> None:  # out of memory at commit: this layer stays as it was
            warnings.warn(
                f"mpsboost: fp8_weights could not convert {match.path} ({type(exc).__name__}: {exc}); "
                "it keeps its original weights and forward",
                stacklevel=5,
            )

        # Nothing is converted before the transaction commits: a rollback leaves the very same weights.
        convert = _converter(plan.granularity, plan.storage, dict(zip(names, k_dims)))
        return Patch.chain(
            [
                *_layer(mod, state),
                replace_at_commit(
                    mod, names, convert, explanation=self.unpatch_hint(), description=f"{NAME}: convert {match.path}"
                ),
                at_commit(converted, f"{NAME}: {match.path} converted"),
            ],
            on_commit_error=keep_original,
            description=f"{NAME}: {match.path}",
        )

    def loaded_layer(self, module: torch.nn.Module, path: str, decision: Decision) -> Patch:
        """The fp8 layer of a module whose codes and scales :func:`mpsboost.load_fp8` has put in place:
        the state of ``decision`` (from :meth:`decide_loaded`), the same forward and class as :meth:`apply`
        gives; converted from the start. Irreversible once committed, like a conversion."""
        plan = decision.plan
        device = getattr(module, weight_names(module)[0]).device  # where the codes are now
        state = _state(plan, device, decision.backing)
        state.mark_converted()
        return Patch.chain(
            _layer(module, state),
            reversible=False,
            explanation=self.unpatch_hint(),
            description=f"{NAME}: {path} (loaded)",
        )

    def unpatch_hint(self) -> str:
        return (
            "reload the model from its checkpoint (from_pretrained); to skip the conversion next time, save the "
            "converted weights once with mpsboost.save_fp8(model, path) and load them into a freshly loaded model "
            "with mpsboost.load_fp8(model, path)"
        )
