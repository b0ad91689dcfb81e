"""decode_linear: one-token ``F.linear`` of transformers and diffusers models on the fast path of the env.

Decided per layer and per mode (eager, or compiled: the forward traced by ``torch.compile``, as
transformers' static cache does): the bound forward selects the compiled-mode path with
``torch.compiler.is_compiling()``, a trace-time constant, so the compiled graph holds no host query.

- MPS before torch 2.15: ``F.linear`` on ``[B, 1, K]`` ran 8.5x slower than on ``[B, K]`` (issue
  pytorch#189847); the patched forward folds the singleton row dim away (views, no copy), in both modes.
- MPS from 2.15: the fix (pytorch#189855) and the GEMV kernels with bias epilogue (pytorch#186927,
  #189628) are native; the recipe skips, so stock code runs with zero added overhead.
- CUDA: a Triton GEMV with fused bias (``torch.ops.mpsboost.gemv``), only for the layer shapes and the
  mode where the tuning file ``decode_linear_gemv`` shows it faster than cuBLAS on this kind of GPU:
  eager decoding replayed from CUDA graphs was measured; under torch.compile nothing was, so compiled
  forwards keep stock ``F.linear``. A GPU the file was not measured on keeps cuBLAS everywhere.
- CPU: the same kernel serves both layouts; skipped.

Options (``options={"decode_linear": {...}}``):
  ``path``: ``"fold"`` or ``"triton"`` forces that path on every Linear in both modes whatever the env
  (for measurement and tests; on CPU tensors ``"triton"`` runs the operator's reference kernel);
  ``"auto"`` (default) decides per env, mode and shape.
  ``cuda_graphs``: ``True`` binds the Triton kernel for CUDA graphs captured around eager code (the
  mode it was measured in); by default CUDA binds nothing unless a compiled measurement shows a gain,
  since eager launches and compiled forwards both keep cuBLAS.
  ``cuda_eager``: ``True`` also uses the Triton kernel outside CUDA-graph capture (default ``False``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Literal

import torch

from .. import tuning
from ..gate import Env, check
from ..ops import gemv_triton
from ..ops.linear import make_forward
from ..registry import Decision, Match, Recipe, class_path, matches_class, option_choices, recipe_names, register
from ..patching import Patch, bind_forward, saved_state

_MODEL_ROOTS = (
    "transformers.modeling_utils.PreTrainedModel",
    "diffusers.models.modeling_utils.ModelMixin",
)
_LINEAR = "torch.nn.modules.linear.Linear"
_NO_COMPILED_GAIN = "compiled: stock F.linear; no compiled end-to-end measurement shows a gain"

# The Triton GEMV is used only where measured faster: cuBLAS is already close to the bandwidth limit for
# large layers (one-token bf16 F.linear timed by CUDA-graph replay on an H200: 75-100% of the copy bandwidth
# from 4096x4096 up, 39-53% for the smallest layers), so the kernel can only win where cuBLAS leaves
# bandwidth unused. The tuning file (mpsboost/data/tuning/decode_linear_gemv.json): per mode, the layer
# shapes where the kernel measured at least MIN_SPEEDUP faster than cuBLAS, on the device it names.
TUNING = "decode_linear_gemv"
# Below this the difference was within the spread of repeated timings: not worth an extra kernel.
MIN_SPEEDUP = 1.05
# Programs per GEMV launch the kernel aims for (gemv_triton.block_n_for): two per SM on an H200 (132 SMs),
# enough bytes in flight per SM; the launch the tuning file was measured with.
GEMV_PROGRAMS = 264


@dataclass(frozen=True)
class DecodeLinearOptions:
    """``options={"decode_linear": {...}}``."""

    path: Literal["auto", "fold", "triton"] = "auto"
    cuda_eager: bool = False
    cuda_graphs: bool = False


_PATHS = option_choices(DecodeLinearOptions, "path")


@dataclass(frozen=True)
class DecodeLinearPlan:
    """The forward one Linear gets: its path in eager mode and under torch.compile (``"fold"``, ``"gemv"``,
    ``"gemv_graph"`` or ``"stock"``, see :func:`mpsboost.ops.linear.make_forward`), for its weight of
    ``n`` x ``k``; ``speedup``: the measured gain over cuBLAS that chose the Triton kernel (CUDA only)."""

    n: int
    k: int
    eager: str
    compiled: str
    speedup: float | None = None

    def report_details(self) -> dict:
        """The report's details as they always read: ``speedup`` only where one was measured."""
        gain = {} if self.speedup is None else {"speedup": self.speedup}
        return {"n": self.n, "k": self.k, **gain, "eager": self.eager, "compiled": self.compiled}


@register
class DecodeLinear(Recipe):
    name = "decode_linear"
    summary = (
        "one-token F.linear on the matrix-vector path of the env "
        "([B,K] layout before MPS 2.15; measured Triton GEMV on CUDA)"
    )
    targets = (_LINEAR,)
    lossless = True
    reversible = True
    requires = ()
    default = True
    order = 100
    Options = DecodeLinearOptions

    # Only the nn.Linear layers of transformers and diffusers models: a user's own modules keep theirs.
    def find(self, root: torch.nn.Module, prefix: str = "") -> Iterator[Match]:
        seen: set[int] = set()
        for name, mod in root.named_modules():
            if not matches_class(mod, _MODEL_ROOTS):
                continue
            for sub_name, sub in mod.named_modules():
                if id(sub) in seen or not matches_class(sub, self.targets):
                    continue
                seen.add(id(sub))
                full = ".".join(p for p in (prefix, name, sub_name) if p) or "<root>"
                yield Match(sub, full)

    def decide(self, match: Match, env: Env, options: DecodeLinearOptions) -> Decision:
        mod = match.module
        path = options.path
        if path not in _PATHS:
            raise ValueError(f"decode_linear option 'path' must be one of {_PATHS}, got {path!r}")
        if type(mod).forward is not torch.nn.Linear.forward:
            return Decision.skip(f"{class_path(type(mod))} overrides forward (quantised or adapter layer); left alone")
        if "forward" in mod.__dict__:
            owner = _bound_by(mod)
            if owner is not None:  # e.g. fp8_weights after load_fp8 or patch(fp8=...): fp8 codes, its own decode
                return Decision.skip(
                    f"its forward is mpsboost's {owner} (which runs this layer's decode on its own path); left alone"
                )
            # accelerate's offload hooks (and other wrappers) live on the instance: keep their device handling.
            return Decision.skip(
                "forward already wrapped on this instance by another library (e.g. an accelerate offload hook); "
                "left alone"
            )
        w = mod.weight
        if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point():
            return Decision.skip(f"weight is not a 2-D floating tensor ({getattr(w, 'dtype', type(w).__name__)})")
        n, k = w.shape
        has_bias = mod.bias is not None

        if path == "fold":
            return Decision.apply(
                "[B,K] layout for one-token rows",
                "forced by options (path='fold'); compiled: the same fold",
                plan=DecodeLinearPlan(n, k, eager="fold", compiled="fold"),
            )
        if path == "triton":
            eager = "gemv" if options.cuda_eager else "gemv_graph"
            return Decision.apply(
                "triton GEMV, fused bias",
                "forced by options (path='triton'); compiled: the same operator",
                plan=DecodeLinearPlan(n, k, eager=eager, compiled="gemv"),
            )

        if env.device_type == "mps":
            v = check("linear_3d_fast", env)
            if v.ok:
                g = check("gemv_bias_epilogue", env)
                return Decision.skip(f"native path: {v.reason}; {g.reason}")
            return Decision.apply(
                "[B,K] layout for one-token rows",
                f"{v.reason}; compiled: the same fold (views, traceable)",
                plan=DecodeLinearPlan(n, k, eager="fold", compiled="fold"),
            )
        if env.device_type == "cpu":
            return Decision.skip("CPU F.linear runs the same kernel for [B,1,K] and [B,K]; nothing to gain")
        # CUDA
        return self._decide_cuda(env, n, k, has_bias, w.dtype, options)

    def _decide_cuda(
        self, env: Env, n: int, k: int, has_bias: bool, dtype: torch.dtype, options: DecodeLinearOptions
    ) -> Decision:
        graph, where = measured(env, "cuda_graph")
        if graph is None:
            return Decision.skip(f"cuBLAS kept: {where}")
        compiled, _ = measured(env, "compiled")
        v = check("triton", env)
        if not v.ok:
            return Decision.skip(v.reason)
        shape = f"{n}x{k}{' +bias' if has_bias else ''} {str(dtype).removeprefix('torch.')}"
        key = (n, k, has_bias, str(dtype).removeprefix("torch."))
        fast = MIN_SPEEDUP
        s_graph, s_comp = graph.get(key), (compiled or {}).get(key)
        use_graph = s_graph is not None and s_graph >= fast
        use_comp = s_comp is not None and s_comp >= fast
        src = f"{TUNING}: {where}"
        if not (use_graph or use_comp):
            return Decision.skip(f"cuBLAS measured as fast or faster for {shape} ({src}); kept")
        eager_opt = bool(options.cuda_eager)
        if not (use_comp or eager_opt or options.cuda_graphs):
            # The measured win is inside CUDA graphs captured around eager code. Neither mode users run
            # gets it: eager launches stay on cuBLAS, compiled forwards keep F.linear (no compiled gain
            # measured). Binding a forward that runs stock F.linear in both is overhead with no return.
            return Decision.skip(
                f"{s_graph:.2f}x over cuBLAS for {shape} only inside CUDA graphs you capture yourself ({src}); "
                "eager launches and compiled forwards keep cuBLAS, so nothing is bound; "
                "options={'decode_linear': {'cuda_graphs': True}} binds it for manual graph capture"
                if use_graph
                else f"cuBLAS kept for {shape} ({src})"
            )
        if use_graph:
            eager = "gemv" if eager_opt else "gemv_graph"
            when = "" if eager_opt else "; inside CUDA graphs only (eager launches stay on cuBLAS)"
            why = f"{s_graph:.2f}x over cuBLAS for {shape} in CUDA-graph replay ({src}){when}"
        else:
            eager, why = "stock", "eager: stock F.linear (no eager measurement shows a gain)"
        if use_comp:
            comp, why = "gemv", f"{why}; compiled: {s_comp:.2f}x over cuBLAS measured under torch.compile"
        else:
            comp, why = "stock", f"{why}; {_NO_COMPILED_GAIN} ({TUNING})"
        return Decision.apply(
            "triton GEMV, fused bias",
            why,
            plan=DecodeLinearPlan(n, k, eager=eager, compiled=comp, speedup=s_graph or s_comp),
        )

    def apply(self, match: Match, decision: Decision, env: Env, options: DecodeLinearOptions) -> Patch:
        plan: DecodeLinearPlan = decision.plan
        w = match.module.weight
        gemv = plan.eager in ("gemv", "gemv_graph") or plan.compiled == "gemv"
        block_n = gemv_triton.block_n_for(w.shape[0], GEMV_PROGRAMS) if gemv else None
        fwd = make_forward(plan.eager, plan.compiled, gemv_block_n=block_n)
        if gemv:
            if w.is_cuda and not torch.cuda.is_current_stream_capturing():
                # Compile and load the kernel now (patch time): a first launch inside CUDA-graph capture
                # would have to compile there. One launch per distinct (block, bias) configuration.
                with torch.no_grad():
                    gemv_triton.gemv(
                        torch.ones(1, w.shape[1], device=w.device, dtype=w.dtype), w, match.module.bias, block_n
                    )
        return bind_forward(match.module, self.name, fwd)


def measured(env: Env, mode: str) -> tuple[dict[tuple[int, int, bool, str], float] | None, str]:
    """``({(N, K, has_bias, dtype name): speedup}, "")`` measured in ``mode`` for this kind of GPU.

    ``mode`` is ``"cuda_graph"`` (eager decode replayed as CUDA graphs) or ``"compiled"`` (the forward
    under ``torch.compile``). ``(None, why)`` where the file speaks for another device. Patch time only.
    """
    t, why = tuning.for_env(TUNING, env)
    if t is None:
        return None, why
    rows = t.entries.get(mode, [])
    table = {(int(r["n"]), int(r["k"]), bool(r["bias"]), str(r["dtype"])): float(r["speedup"]) for r in rows}
    return table, t.describe()


def _bound_by(mod: torch.nn.Module) -> str | None:
    """The mpsboost recipe whose forward this instance carries (bound through ``patching.bind_forward``), or None
    when its instance forward is another library's."""
    fwd = mod.__dict__.get("forward")
    for name in recipe_names():
        state = saved_state(mod, name)
        if state is not None and state.get("bound") is fwd:
            return name
    return None
