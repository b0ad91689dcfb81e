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
second copy of the model. Measured on the H200 (benchmarks/results/fp8-cuda-2026-11-29-NOTES.md):
589 MB over an 11.7 GB Qwen3-30B-A3B-shaped model whose largest layer is 805 MB in bf16.

Options (``mpsboost.patch(m, fp8="rowwise", options={"fp8_weights": {...}})``):
``include`` / ``exclude``: glob patterns (``fnmatch``) on the module path in the report (e.g.
``"transformer.blocks.*.ffn.*"``); ``include_lm_head`` (bool); ``experts`` (bool, default True);
``gemv_max_m`` (CUDA: rows at or below which the fp8 GEMV runs; default from the tuning file
``fp8_gemv``: 16); ``moe_gather_max_pairs`` (routed pairs at or below which experts are gathered per
pair; default from ``fp8_gemv`` on the GPU it was measured on, else 16); ``moe_path`` ("auto",
"scaled_grouped_mm", "gather", "hit", "stack"); ``activations`` ("bf16", default: batches above
``gemv_max_m`` dequantise the layer and multiply in the activation dtype, the stored weights exactly;
"fp8": CUDA quantises activations rowwise for ``scaled_mm``, which is not the same math).

Modes: every forward installed here compiles with ``torch.compile(fullgraph=True)``. The kernels are
registered operators, the ``scaled_mm`` bias probe and the GEMV's launch tuning run at patch time, and
the experts forward selects a traceable path with ``torch.compiler.is_compiling()`` (a trace-time
constant): where eager mode reads the hit experts on the host (``"hit"``), a compiled forward
dequantises the layer's stack instead (``"stack"``); the report row says so.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import functools
import logging
import re
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from ... import tuning
from ...gate import Env, check
from ...ops import fp8 as fp8_ops
from ...ops import fp8_moe
from ...errors import Fp8ConversionError, Fp8StateError, PatchError
from .layers import FP8_BASE_ATTR, expert_weight_names as _expert_weight_names, is_hf_experts as _is_hf_experts, plain_linear
from ...registry import Decision, Match, Recipe, join_path, register
from ...patching import ATTR, Patch, at_commit, bind_forward, original_forward, replace_at_commit, swap_class

NAME = "fp8_weights"
log = logging.getLogger("mpsboost")

_VAE_PREFIX = "diffusers.models.autoencoders."
_ROUTER_NAMES = ("gate", "router")


# ------------------------------------------------------------------------------------------ finding

def _class_paths(mod: torch.nn.Module) -> list[str]:
    return [f"{c.__module__}.{c.__qualname__}" for c in type(mod).__mro__]


def _plain_float(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and type(t.data) is torch.Tensor and t.is_floating_point() and t.dtype not in (
        torch.float8_e4m3fn, torch.float8_e5m2)


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

    def skip_reason(self, name: str, mod: torch.nn.Module, tensors: list[tuple[str, Any]], parent: torch.nn.Module | None) -> str | None:
        for v in self.vae:
            if self._under(name, v):
                return "inside a VAE: kept in the compute dtype (image quality; its linear bytes are few)"
        for oname, owner in self.owners:
            if not self._under(name, oname):
                continue
            rel = name[len(oname) + 1:] if oname else name
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
        return None


# ------------------------------------------------------------------------------------------ options

def _patterns(value: Any, key: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise ValueError(f"fp8_weights option {key}={value!r}: expected a glob pattern or a list of them, e.g. ['*.attn.*']")


@dataclass(frozen=True)
class Fp8WeightsOptions:
    """``options={"fp8_weights": {...}}`` (see the module docstring). ``fp8``, the granularity
    ("rowwise" or "tensorwise"), is what the public ``fp8=`` keyword of patch() sets; ``load`` is set by
    :func:`mpsboost.load_fp8`."""

    fp8: str | None = None
    include: str | tuple[str, ...] | list[str] | None = None
    exclude: str | tuple[str, ...] | list[str] | None = None
    include_lm_head: bool = False
    experts: bool = True
    gemv_max_m: int | None = None  # None: from the tuning file (see _thresholds)
    moe_gather_max_pairs: int | None = None
    moe_path: str = "auto"
    activations: str = "bf16"  # above the GEMV: "bf16" dequantises the layer (exact), "fp8" quantises activations
    load: Any = None


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
        raise ValueError(f"fp8_weights option moe_path={options.moe_path!r}: expected 'auto' or one of {', '.join(fp8_moe.PATHS)}")
    if options.activations not in fp8_ops.ACTIVATIONS:
        raise ValueError(f"fp8_weights option activations={options.activations!r}: expected 'bf16' (dequantise large "
                         "batches, exact) or 'fp8' (quantise activations for scaled_mm)")
    return dataclasses.replace(options, fp8=gran, include=_patterns(options.include, "include"),
                               exclude=_patterns(options.exclude, "exclude"))


# ------------------------------------------------------------------------------------------ forwards

class _State:
    """Per-module facts the bound forward needs; ``converted`` flips at the transaction's commit."""

    __slots__ = ("kind", "compute_dtype", "granularity", "gemv_max_m", "converted", "large_path", "compiled_path", "gather_max",
                 "large", "native_grouped", "histc_int", "bias_in_mm", "backing")

    def __init__(self, **kw: Any):
        self.converted = False
        self.large = "dequant"  # the exact large-batch path unless activations="fp8" was chosen
        for k, v in kw.items():
            setattr(self, k, v)

    def mark_converted(self) -> None:
        self.converted = True


# ------------------------------------------------------------------------------------------ the fp8 layer classes

def _fp8_repr(module: torch.nn.Module) -> str:
    """What ``print(model)`` shows of a converted layer: storage, granularity, scale shapes, backing path."""
    entry = module.__dict__.get(ATTR, {}).get(NAME) or {}
    state = entry.get("fp8")
    if state is None or not state.converted:
        return "fp8=pending (converted when the patch() transaction commits)"
    names = ("weight",) if isinstance(module, torch.nn.Linear) else _expert_weight_names(module)
    codes = getattr(module, names[0])
    dtype = "float8_e4m3fn" if codes.dtype == torch.float8_e4m3fn else f"float8_e4m3fn codes in {str(codes.dtype).replace('torch.', '')}"
    parts = [f"fp8={dtype}", f"granularity={state.granularity}"]
    if getattr(state, "block", None):
        parts.append(f"block={list(state.block)}")
    for n in names:
        if n != "weight":
            parts.append(f"{n}={list(getattr(module, n).shape)}")
        scale = getattr(module, n + "_scale", None)
        if scale is not None:
            parts.append(f"{n}_scale={list(scale.shape)}")
    parts.append(f"compute_dtype={str(state.compute_dtype).replace('torch.', '')}")
    parts.append(f"backing={getattr(state, 'backing', None) or state.kind}")
    return ", ".join(parts)


class FP8Linear(torch.nn.Linear):
    """A ``torch.nn.Linear`` whose weight fp8_weights stores as float8_e4m3fn codes with float32 scales.

    Never constructed: fp8_weights swaps it onto a converted instance (``patching.swap_class``), so that
    ``print(model)`` shows the layer for what it is. ``isinstance(m, torch.nn.Linear)`` still holds and
    the forward is the instance's own (bound by the recipe). The conversion cannot be undone.
    """

    _mpsboost_fp8_of = torch.nn.Linear

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {_fp8_repr(self)}"


def _experts_repr(self: torch.nn.Module) -> str:
    base = super(type(self), self).extra_repr()
    return f"{base}, {_fp8_repr(self)}" if base else _fp8_repr(self)


@functools.lru_cache(maxsize=None)
def _fp8_class(cls: type) -> type:
    """The fp8 layer class of ``cls``: :class:`FP8Linear` for ``torch.nn.Linear``, else one subclass per
    experts class (``FP8Qwen3MoeExperts``, ...), made once and cached."""
    if cls is torch.nn.Linear:
        return FP8Linear
    name = f"FP8{cls.__name__}"
    return type(name, (cls,), {"extra_repr": _experts_repr, FP8_BASE_ATTR: cls, "__module__": __name__, "__qualname__": name,
                               "__doc__": f"{cls.__name__} with its expert weights stored in fp8 by mpsboost's fp8_weights."})


def _cast_error(module: torch.nn.Module, name: str, t: torch.Tensor) -> Exception:
    return Fp8StateError(
        f"{type(module).__name__}.{name} was converted to fp8 by mpsboost but is now {t.dtype} (the model was cast "
        "with .to(dtype)/.half() after patching?). Cast the model before mpsboost.patch(..., fp8=...), or reload it."
    )


def _linear_forward(state: _State):
    def forward(self, input, *args, **kwargs):
        if not state.converted:
            return original_forward(self, NAME)(input, *args, **kwargs)
        w = self.weight
        if w.dtype not in (torch.float8_e4m3fn, torch.uint8):
            raise _cast_error(self, "weight", w)
        return fp8_ops.fp8_linear(input, w, self.weight_scale, self.bias, kind=state.kind,
                                  compute_dtype=state.compute_dtype, gemv_max_m=state.gemv_max_m, bias_in_mm=state.bias_in_mm,
                                  large=state.large)

    return forward


def _experts_forward(state: _State):
    def forward(self, hidden_states, *args, **kwargs):
        if not state.converted:
            return original_forward(self, NAME)(hidden_states, *args, **kwargs)
        # gpt-oss names its arguments router_indices / routing_weights.
        rest = list(args)
        top_k_index = rest.pop(0) if rest else kwargs.pop("top_k_index", kwargs.pop("router_indices", None))
        top_k_weights = rest.pop(0) if rest else kwargs.pop("top_k_weights", kwargs.pop("routing_weights", None))
        up_name, down_name = _expert_weight_names(self)
        up_q, down_q = getattr(self, up_name), getattr(self, down_name)
        for n_, t in ((up_name, up_q), (down_name, down_q)):
            if t.dtype not in (torch.float8_e4m3fn, torch.uint8):
                raise _cast_error(self, n_, t)
        tr = bool(getattr(self, "is_transposed", False))
        up = fp8_moe.Fp8Stack(up_q, getattr(self, up_name + "_scale"), tr)
        down = fp8_moe.Fp8Stack(down_q, getattr(self, down_name + "_scale"), tr)
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        idx = top_k_index.reshape(x.shape[0], -1)
        wts = top_k_weights.reshape(x.shape[0], -1)
        has_bias = bool(getattr(self, "has_bias", False))
        up_b = getattr(self, up_name + "_bias", None) if has_bias else None
        down_b = getattr(self, "down_proj_bias", None) if has_bias else None
        act = self._apply_gate if getattr(self, "has_gate", True) else self.act_fn
        post = self.post_expert_norm if getattr(self, "has_post_expert_norm", False) else None
        # torch.compiler.is_compiling() is a constant while dynamo traces: a compiled forward takes the
        # traceable path decided at patch time, with no host read of the expert counts.
        compiling = torch.compiler.is_compiling()
        large = state.compiled_path if compiling else state.large_path
        path = "gather" if idx.numel() <= state.gather_max else large
        if path == "scaled_grouped_mm" and not (x.is_cuda and fp8_moe.scaled_grouped_ok(up, state.compute_dtype)
                                                and fp8_moe.scaled_grouped_ok(down, state.compute_dtype)):
            # Static facts (device, dtype, layout): the same answer at every call of this module.
            path = "stack" if compiling else "hit"
        out = fp8_moe.fp8_routed_experts(
            x, idx, wts, up=up, down=down, activation=act, compute_dtype=state.compute_dtype, up_bias=up_b,
            down_bias=down_b, post=post, path=path, native_grouped=state.native_grouped, histc_int=state.histc_int,
        )
        return out.reshape(shape)

    return forward


# ------------------------------------------------------------------------------------------ conversion

def _all_finite(t: torch.Tensor) -> bool:
    """``torch.isfinite(t).all()`` in slices: isfinite materialises |t| and two masks (2.5x the layer)."""
    per = max(1, (1 << 24) // max(1, t[0].numel()))
    flags = [torch.isfinite(t[i:i + per]).all() for i in range(0, t.shape[0], per)]
    return bool(torch.stack(flags).all())  # one host read for the whole tensor


def _tune_gemv(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Patch time: one decode-shaped call of the fp8 GEMV on a CUDA layer, so that its launch configuration
    is tuned and its kernel compiled now, outside any trace or CUDA-graph capture."""
    q = module.weight
    if not q.is_cuda or torch.cuda.is_current_stream_capturing():
        return
    with torch.no_grad():
        fp8_ops.fp8_gemv(torch.zeros(1, q.shape[1], device=q.device, dtype=dtype), q, module.weight_scale, module.bias)


def _converter(granularity: str, storage: str, k_dims: dict[str, int], load: Any, path: str):
    """The conversion of one weight for :func:`patching.replace_at_commit`: its fp8 codes under its own
    name and its float32 scales as ``<name>_scale`` (quantised here, or read from the fp8 file)."""

    def convert(name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
        if load is not None:
            q, scale = load.tensors(path, name, storage=storage, device=w.device)
        else:
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
        return (gemv if gemv is not None else _DEFAULT_GEMV_MAX_M,
                gather if gather is not None else _DEFAULT_GATHER_MAX, "")
    t, why = tuning.for_env("fp8_gemv", env)
    if t is None:
        # Another GPU: the GEMV's one-tile limit still holds (it is the kernel's, not a timing), and its
        # launch configurations are tuned on this GPU at patch time; the gather threshold is unmeasured here.
        return (gemv if gemv is not None else _DEFAULT_GEMV_MAX_M,
                gather if gather is not None else _DEFAULT_GATHER_MAX, f"default thresholds ({why})")
    e = t.entries
    return (gemv if gemv is not None else int(e["gemv_max_m"]),
            gather if gather is not None else int(e["moe_gather_max_pairs"]), f"thresholds from fp8_gemv, {t.describe()}")


def _compiled_path(large: str) -> str:
    return large if large in fp8_moe.TRACEABLE else "stack"


# ------------------------------------------------------------------------------------------ the recipe

@register
class Fp8Weights(Recipe):
    name = NAME
    summary = "float8_e4m3fn weights with per-row or per-tensor fp32 scales; fused fp8 GEMV/scaled_mm on CUDA, per-layer dequantise elsewhere"
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
            yield Match(mod, join_path(prefix, name), {"kind": kind, "skip": skip,
                                                   "lm_head": skip is not None and skip.startswith("output embedding")})

    # ------------------------------------------------------------------ a module converted already
    def repeat_request(self, match: Match, options: Fp8WeightsOptions) -> str | None:
        """For a module this recipe converted by an earlier call (the API asks before reporting "already
        patched"): the same granularity again is a no-op (returns the row's reason); another one raises
        :class:`PatchError` naming both, since the codes cannot be re-quantised from themselves and
        silently keeping the first would report a request that was never carried out. Nothing has
        changed when it raises (planning precedes every change)."""
        entry = match.module.__dict__.get(ATTR, {}).get(NAME) or {}
        state = entry.get("fp8")
        have = getattr(state, "granularity", None)
        want = options.fp8
        if state is None or want is None or have is None:
            return None
        block = getattr(state, "block", None)
        have_text = f"{have} {block[0]}x{block[1]}" if have == "block" and block else have
        if want != have:
            raise PatchError(
                f"fp8_weights: {match.path} holds fp8 weights with {have_text} scales already (an earlier patch(fp8=...) "
                f"or load_fp8); this call asks for fp8={want!r}. fp8 codes are not re-quantised to another granularity: "
                f"call patch(model, fp8={have!r}) (a no-op), or reload the bf16 weights and patch(model, fp8={want!r}). "
                "Nothing was changed.", recipe=NAME, target=match.path)
        return f"converted already with {have_text} scales (the granularity asked for)"

    # ------------------------------------------------------------------ deciding
    def decide(self, match: Match, env: Env, options: Fp8WeightsOptions) -> Decision:
        opts = _parse(options)
        data, mod, path = match.data, match.module, match.path
        skip = data["skip"]
        if skip is not None and not (data["lm_head"] and opts.include_lm_head):
            return Decision.skip(skip)
        load = opts.load
        if load is not None and not load.has(path):
            return Decision.skip(f"not in the fp8 file {load.name}")
        if opts.include and not any(fnmatch.fnmatchcase(path, p) for p in opts.include):
            return Decision.skip(f"not matched by include patterns {list(opts.include)}")
        hit = next((p for p in opts.exclude if fnmatch.fnmatchcase(path, p)), None)
        if hit is not None:
            return Decision.skip(f"excluded by pattern {hit!r}")
        gran = load.granularity(path) if load is not None else opts.fp8
        storage = fp8_ops.storage_for(env)
        gemv_max, gather_max, where = _thresholds(env, opts)
        if data["kind"] == "linear":
            w = mod.weight
            n, k = w.shape
            lp = fp8_ops.choose_linear_path(env, n=n, k=k, dtype=w.dtype, gemv_max_m=gemv_max, activations=opts.activations)
            before = w.numel() * w.element_size()
            after = w.numel() + (4 * n if gran == "rowwise" else 4)
            extra = f"; {where}" if where and lp.kind == "fused" else ""
            comp = "compiled: the same path (registered operators)" if lp.kind == "fused" else "compiled: the same path"
            return Decision.apply(
                lp.backing, f"{gran} scales, {lp.storage} storage: {lp.reason}{extra}; {comp}",
                kind="linear", granularity=gran, storage=lp.storage, compute_dtype=str(w.dtype).replace("torch.", ""),
                bytes_before=before, bytes_after=after, path_kind=lp.kind, gemv_max_m=lp.gemv_max_m, large=lp.large,
            )
        if not opts.experts:
            return Decision.skip("expert weights excluded by option experts=False")
        names = _expert_weight_names(mod)
        ws = [getattr(mod, n) for n in names]
        tr = bool(getattr(mod, "is_transposed", False))
        large, why = self._experts_path(env, ws, tr, storage, opts)
        # Few routed pairs (decoding) gather their experts in fp8: on the H200 a Qwen3-30B-A3B-shaped decode
        # step took 15.1 ms this way vs 16.2 (scaled_grouped_mm) and 17.4 (hit experts); stock batched_mm
        # 51.8 ms (benchmarks/results/fp8-cuda-2026-11-29-run2.jsonl).
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
        before = sum(w.numel() * w.element_size() for w in ws)
        after = sum(w.numel() + 4 * (w.numel() // w.shape[2 if not tr else 1] if gran == "rowwise" else w.shape[0]) for w in ws)
        return Decision.apply(
            backing, f"{gran} scales per expert, {storage} storage: {why}",
            kind="experts", granularity=gran, storage=storage, compute_dtype=str(ws[0].dtype).replace("torch.", ""),
            bytes_before=before, bytes_after=after, large_path=large, compiled_path=comp, gather_max_pairs=gather,
        )

    @staticmethod
    def _experts_path(env: Env, ws: list[torch.Tensor], transposed: bool, storage: str, opts: Fp8WeightsOptions) -> tuple[str, str]:
        forced = opts.moe_path
        sg = check("scaled_grouped_mm", env)
        aligned = all(w.shape[1] % 16 == 0 and w.shape[2] % 16 == 0 for w in ws)
        sg_ok = sg.ok and storage == "float8" and not transposed and aligned and ws[0].dtype == torch.bfloat16
        if forced not in ("auto", "gather"):
            if forced == "scaled_grouped_mm" and not sg_ok:
                return "hit", f"moe_path=scaled_grouped_mm cannot run here ({sg.reason if not sg.ok else 'layout, alignment or dtype'}); hit experts instead"
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
        return "hit", f"no fp8 grouped kernel ({why}); hit experts then {'native grouped_mm' if gm.ok else 'one expert at a time'}"

    # ------------------------------------------------------------------ forwards for loaded checkpoints
    # mpsboost.fp8_io binds these on layers it loads already converted (published fp8 checkpoints); it
    # reaches them through the registry, so that neither module imports the other.
    @staticmethod
    def layer_class(cls: type) -> type:
        """The class a converted ``cls`` instance is swapped to (:func:`_fp8_class`; used by load_fp8 too)."""
        return _fp8_class(cls)

    @staticmethod
    def linear_forward(**fields: Any) -> tuple[_State, Any]:
        """A converted linear layer's state (``fields``: kind, compute_dtype, granularity, gemv_max_m,
        bias_in_mm, large) and the forward that reads it."""
        state = _State(**fields)
        return state, _linear_forward(state)

    @classmethod
    def experts_forward(cls, env: Env, ws: list[torch.Tensor], transposed: bool, storage: str, *,
                        compute_dtype: torch.dtype, granularity: str, gather_max: int) -> tuple[_State, Any, str, str]:
        """A converted experts module's state and forward, and the path it takes for many tokens with why."""
        large, why = cls._experts_path(env, ws, transposed, storage, Fp8WeightsOptions())
        state = _State(kind="experts", compute_dtype=compute_dtype, granularity=granularity, large_path=large,
                       compiled_path=_compiled_path(large), gather_max=gather_max,
                       native_grouped=check("grouped_mm", env).ok, histc_int=check("histc_int", env).ok)
        return state, _experts_forward(state), large, why

    # ------------------------------------------------------------------ applying
    def apply(self, match: Match, decision: Decision, env: Env, options: Fp8WeightsOptions) -> Patch:
        opts = _parse(options)
        mod, d = match.module, decision.details
        names = ("weight",) if d["kind"] == "linear" else _expert_weight_names(mod)
        tr = bool(getattr(mod, "is_transposed", False))
        k_dims = (1,) if d["kind"] == "linear" else ((1 if tr else 2),) * 2
        load = opts.load
        # Validate now, while the transaction can still roll back: after this, conversion at commit
        # cannot fail on the data.
        for n in names:
            t = getattr(mod, n)
            if t.device.type == "meta":
                raise Fp8ConversionError(f"{match.path}.{n} is on the meta device (no data); load the weights first")
            if load is None and not _all_finite(t):
                raise Fp8ConversionError(
                    f"{match.path}.{n} holds inf or NaN values; FP8 scales need finite weights. Fix the checkpoint, "
                    f"or exclude this module: options={{'fp8_weights': {{'exclude': [{match.path!r}]}}}}"
                )
        compute_dtype = getattr(mod, names[0]).dtype
        device = getattr(mod, names[0]).device
        if d["kind"] == "linear":
            # Patch-time probe (never in a forward): can _scaled_mm take the bias with rowwise scales here?
            bias_in_mm = d["path_kind"] in ("fused", "mps_scaled_mm") and d["storage"] == "float8" and \
                fp8_ops.scaled_mm_bias_supported(str(device))
            state = _State(kind=d["path_kind"], compute_dtype=compute_dtype, granularity=d["granularity"],
                           gemv_max_m=d["gemv_max_m"], bias_in_mm=bias_in_mm, large=d.get("large", "dequant"),
                           backing=decision.backing)
            fwd = _linear_forward(state)
        else:
            state = _State(kind="experts", compute_dtype=compute_dtype, granularity=d["granularity"], large_path=d["large_path"],
                           compiled_path=d["compiled_path"], gather_max=d["gather_max_pairs"],
                           native_grouped=check("grouped_mm", env).ok, histc_int=check("histc_int", env).ok,
                           backing=decision.backing)
            fwd = _experts_forward(state)

        def converted() -> None:
            state.mark_converted()
            if d["kind"] == "linear" and d["path_kind"] == "fused" and d["gemv_max_m"] > 0:
                _tune_gemv(mod, compute_dtype)

        def keep_original(exc: BaseException) -> None:  # out of memory at commit: this layer stays as it was
            warnings.warn(f"mpsboost: fp8_weights could not convert {match.path} ({type(exc).__name__}: {exc}); "
                          "it keeps its original weights and forward", stacklevel=5)

        # The state rides along in the module's mpsboost record, where save_fp8 finds it. Nothing is
        # converted before the transaction commits: a rollback leaves the very same weights.
        convert = _converter(d["granularity"], d["storage"], dict(zip(names, k_dims)), load, match.path)
        return Patch.chain(
            [bind_forward(mod, NAME, fwd, fp8=state),
             # print(model) shows an FP8Linear (FP8<Experts>): a per-instance class swap, kept with the conversion.
             swap_class(mod, NAME, _fp8_class(type(mod))),
             replace_at_commit(mod, names, convert, explanation=self.unpatch_hint(), description=f"{NAME}: convert {match.path}"),
             at_commit(converted, f"{NAME}: {match.path} converted")],
            on_commit_error=keep_original, description=f"{NAME}: {match.path}",
        )

    def unpatch_hint(self) -> str:
        return ("reload the model from its checkpoint (from_pretrained); to skip the conversion next time, save the "
                "converted weights once with mpsboost.save_fp8(model, path) and load them into a freshly loaded model "
                "with mpsboost.load_fp8(model, path)")
