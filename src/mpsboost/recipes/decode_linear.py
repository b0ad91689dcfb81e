"""decode_linear: one-token ``F.linear`` of transformers and diffusers models on the fast path of the env.

- MPS before torch 2.15: ``F.linear`` on ``[B, 1, K]`` ran 8.5x slower than on ``[B, K]`` (issue
  pytorch#189847); the patched forward folds the singleton row dim away (views, no copy).
- MPS from 2.15: the fix (pytorch#189855) and the GEMV kernels with bias epilogue (pytorch#186927,
  #189628) are native; the recipe skips, so stock code runs with zero added overhead.
- CUDA: a Triton GEMV with fused bias, only for the layer shapes where it measured faster than cuBLAS
  on the H200 (:data:`mpsboost.ops.gemv_triton.MEASURED`); every other layer skips, so nothing gets slower.
- CPU: the same kernel serves both layouts; skipped.

Options (``options={"decode_linear": {...}}``):
  ``path``: ``"fold"`` or ``"triton"`` forces that path on every Linear whatever the env (for measurement
  and tests); ``"auto"`` (default) decides per env and shape.
  ``cuda_eager``: ``True`` also uses the Triton kernel outside CUDA-graph capture (default ``False``).
"""
from __future__ import annotations

from typing import Any, Iterator, Mapping

import torch

from ..gate import Env, check
from ..ops import gemv_triton
from ..ops.linear import forward_fold_rows, forward_triton_gemv, forward_triton_gemv_graph
from ..registry import Decision, Match, Recipe, Undo, bind_forward, class_path, matches_class, register

_MODEL_ROOTS = (
    "transformers.modeling_utils.PreTrainedModel",
    "diffusers.models.modeling_utils.ModelMixin",
)
_LINEAR = "torch.nn.modules.linear.Linear"
_PATHS = ("auto", "fold", "triton")


@register
class DecodeLinear(Recipe):
    name = "decode_linear"
    summary = "one-token F.linear on the matrix-vector path of the env ([B,K] layout before MPS 2.15; measured Triton GEMV on CUDA)"
    targets = (_LINEAR,)
    lossless = True
    reversible = True
    requires = ()
    default = True
    order = 100

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

    def decide(self, match: Match, env: Env, options: Mapping[str, Any]) -> Decision:
        mod = match.module
        path = options.get("path", "auto")
        if path not in _PATHS:
            raise ValueError(f"decode_linear option 'path' must be one of {_PATHS}, got {path!r}")
        if type(mod).forward is not torch.nn.Linear.forward:
            return Decision.skip(f"{class_path(type(mod))} overrides forward (quantised or adapter layer); left alone")
        if "forward" in mod.__dict__:
            # accelerate's offload hooks (and other wrappers) live on the instance: keep their device handling.
            return Decision.skip("forward already wrapped on this instance (e.g. an accelerate offload hook); left alone")
        w = mod.weight
        if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point():
            return Decision.skip(f"weight is not a 2-D floating tensor ({getattr(w, 'dtype', type(w).__name__)})")
        n, k = w.shape
        has_bias = mod.bias is not None

        if path == "fold":
            return Decision.apply("[B,K] layout for one-token rows", "forced by options (path='fold')", n=n, k=k)
        if path == "triton":
            return Decision.apply("triton GEMV, fused bias", "forced by options (path='triton')", n=n, k=k,
                                  eager=bool(options.get("cuda_eager", False)))

        if env.device_type == "mps":
            v = check("linear_3d_fast", env)
            if v.ok:
                g = check("gemv_bias_epilogue", env)
                return Decision.skip(f"native path: {v.reason}; {g.reason}")
            return Decision.apply("[B,K] layout for one-token rows", v.reason, n=n, k=k)
        if env.device_type == "cpu":
            return Decision.skip("CPU F.linear runs the same kernel for [B,1,K] and [B,K]; nothing to gain")
        # CUDA
        return self._decide_cuda(env, n, k, has_bias, w.dtype, options)

    def _decide_cuda(self, env: Env, n: int, k: int, has_bias: bool, dtype: torch.dtype, options: Mapping[str, Any]) -> Decision:
        src = gemv_triton.MEASURED_SOURCE or "benchmarks/results/decode_linear-cuda-*.jsonl"
        if not gemv_triton.MEASURED:
            return Decision.skip(f"no layer shape measured faster than cuBLAS on the H200 ({src}); cuBLAS kept")
        cap = gemv_triton.MEASURED_CAPABILITY
        if env.capability != cap:
            have = f"sm_{env.capability[0]}{env.capability[1]}" if env.capability else "an unknown GPU"
            return Decision.skip(f"Triton GEMV measured on sm_{cap[0]}{cap[1]} (H200) only; {have} keeps cuBLAS")
        v = check("triton", env)
        if not v.ok:
            return Decision.skip(v.reason)
        speedup = gemv_triton.measured_speedup(n, k, has_bias, dtype)
        shape = f"{n}x{k}{' +bias' if has_bias else ''} {str(dtype).removeprefix('torch.')}"
        if speedup is None or speedup < gemv_triton.MIN_SPEEDUP:
            return Decision.skip(f"cuBLAS measured as fast or faster for {shape} on the H200 ({src}); kept")
        eager = bool(options.get("cuda_eager", False))
        when = "" if eager else "; inside CUDA graphs only (eager launches stay on cuBLAS)"
        return Decision.apply("triton GEMV, fused bias", f"{speedup:.2f}x over cuBLAS for {shape} on the H200 ({src}){when}",
                              n=n, k=k, speedup=speedup, eager=eager)

    def apply(self, match: Match, decision: Decision, env: Env, options: Mapping[str, Any]) -> Undo:
        if decision.backing.startswith("triton"):
            fwd = forward_triton_gemv if decision.details.get("eager", False) else forward_triton_gemv_graph
            w = match.module.weight
            if w.is_cuda and not torch.cuda.is_current_stream_capturing():
                # Compile and load the kernel now: a first launch inside CUDA-graph capture would have to
                # compile there. One launch per distinct (block, bias) configuration, cached by Triton.
                with torch.no_grad():
                    gemv_triton.gemv(torch.ones(1, w.shape[1], device=w.device, dtype=w.dtype), w, match.module.bias)
        else:
            fwd = forward_fold_rows
        return bind_forward(match.module, self.name, fwd)
