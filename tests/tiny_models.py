"""Tiny real diffusers and transformers models with random weights, for the cross-recipe tests.

The models are rows of ``mpsboost.bench.models.MODELS`` (the one table the demo, the selftest, the support tables
and the benchmarks build from too); :data:`mpsboost.bench.models.ZOO` names the ones the tests use. This module
knows how to run each on fresh inputs drawn from a seed, by the row's kind (``vae``, ``dit``, ``lm``, ``encoder``,
``pipeline``) or, where two classes of a kind take different inputs, by its class. The cross-recipe tests
(compatibility, reliability, properties) never name a recipe's targets themselves: :func:`covering` asks each
registered recipe's own ``find`` which tiny models hold its targets, so a recipe that lands later is covered without
editing the tests, and :func:`uncovered_recipes` names a recipe whose targets no tiny model holds (that test fails,
pointing here). A new tiny model is a row and a ``ZOO`` entry in ``mpsboost.bench.models``.

Shapes: each model has a ``space`` (parameter -> allowed values) that the property tests draw from with
hypothesis, and a ``default`` shape for everything else; a row's ``shape`` fixes dimensions (images only:
``frames`` 1). Sizes are chosen so that one run takes well under a second on a 2-core CPU.
"""

from __future__ import annotations

import copy
import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch
from mpsboost.bench import ModuleOps, models

__all__ = [
    "Tiny",
    "TINY",
    "build",
    "run",
    "modules_of",
    "covering",
    "uncovered_recipes",
    "snapshot",
    "same_snapshot",
    "diff_snapshot",
]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Tiny:
    """One tiny model: its row of ``mpsboost.bench.models``, and how to run it on inputs drawn from a seed."""

    name: str
    row: str  # the row of mpsboost.bench.models.MODELS
    library: str  # "diffusers" or "transformers"
    kind: str  # "vae", "dit", "lm", "encoder", "pipeline"
    runner: Callable[..., torch.Tensor]  # runner(obj, seed, **shape) -> output tensor
    default: Mapping[str, Any] = field(default_factory=dict)
    space: Mapping[str, tuple] = field(default_factory=dict)  # for hypothesis: parameter -> values

    def make(self) -> Any:
        """A fresh fp32 instance on the CPU, weights from torch's global generator (:func:`build` seeds it);
        Gated DeltaNet layers get slow-decay gates (:func:`slow_decay_gates`)."""
        obj = models.build(self.row)
        return slow_decay_gates(obj) if self.kind == "lm" else obj


# ------------------------------------------------------------------------------------ diffusers VAEs


def _run_vae(
    vae,
    seed: int,
    *,
    frames: int = 5,
    size: int = 32,
    tiled: bool = False,
    dtype: str = "float32",
    mode: str = "roundtrip",
) -> torch.Tensor:
    """Encode and decode a random video/image (``mode="roundtrip"``) or decode a random latent.

    ``tiled`` turns on the VAE's own tiling with tiles smaller than the input, so the tile loop and
    its blending run; tiling is switched back off afterwards.
    """
    g = torch.Generator().manual_seed(seed)
    dt = DTYPES[dtype]
    cfg = vae.config
    spatial = _spatial_factor(vae)
    if tiled:
        # Tiles of twice the compression factor in pixels with half-tile stride; the input
        # is grown to at least two tiles per side so that the tile loop and its blending really run.
        tile = 2 * spatial
        size = max(size, 2 * tile)
        vae.enable_tiling(
            tile_sample_min_height=tile,
            tile_sample_min_width=tile,
            tile_sample_stride_height=tile // 2,
            tile_sample_stride_width=tile // 2,
        )
    try:
        with torch.no_grad():
            if mode == "decode":
                lat_t = (frames - 1) // 4 + 1
                z = torch.randn(1, cfg.z_dim, lat_t, size // spatial, size // spatial, generator=g).to(dt)
                return vae.decode(z).sample.float()
            # Image channels: 3, or the VAE's own (RGBA for Qwen-Image-2.1), before Wan2.2's patchify.
            chans = getattr(cfg, "in_channels", 3) // (getattr(cfg, "patch_size", None) or 1) ** 2
            x = (torch.rand(1, chans, frames, size, size, generator=g) * 2 - 1).to(dt)
            return vae(x, sample_posterior=False).sample.float()
    finally:
        if tiled:
            vae.disable_tiling()


def _spatial_factor(vae) -> int:
    """Pixels per latent pixel: 8, times the patch size of the Wan2.2 VAE (2)."""
    return int(getattr(vae.config, "scale_factor_spatial", None) or 8 * (getattr(vae.config, "patch_size", None) or 1))


_VAE_SPACE = {
    "frames": (1, 5),
    "size": (32,),
    "tiled": (False, True),
    "dtype": ("float32", "bfloat16"),
    "mode": ("roundtrip", "decode"),
}

# ------------------------------------------------------------------------------------ diffusers DiTs


def _run_wan_transformer(
    tr, seed: int, *, batch: int = 1, frames: int = 2, size: int = 4, text: int = 7, dtype: str = "float32"
) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    dt = DTYPES[dtype]
    c = tr.config.in_channels
    hs = torch.randn(batch, c, frames, size, size, generator=g).to(dt)
    enc = torch.randn(batch, text, tr.config.text_dim, generator=g).to(dt)
    t = torch.randint(0, 1000, (batch,), generator=g)
    with torch.no_grad():
        return tr(hidden_states=hs, timestep=t, encoder_hidden_states=enc, return_dict=False)[0].float()


def _run_qwen_image_transformer(
    tr, seed: int, *, batch: int = 1, size: int = 4, text: int = 7, dtype: str = "float32"
) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    dt = DTYPES[dtype]
    hs = torch.randn(batch, size * size, tr.config.in_channels, generator=g).to(dt)
    enc = torch.randn(batch, text, tr.config.joint_attention_dim, generator=g).to(dt)
    mask = torch.ones(batch, text, dtype=torch.long)
    t = torch.rand(batch, generator=g).to(dt)
    with torch.no_grad():
        return tr(
            hidden_states=hs,
            encoder_hidden_states=enc,
            encoder_hidden_states_mask=mask,
            timestep=t,
            img_shapes=[[(1, size, size)]] * batch,
            return_dict=False,
        )[0].float()


# ------------------------------------------------------------------------------------ transformers LMs

# Slow-decay gates for the DeltaNet layers of test models. transformers initialises A_log = log U(0, 16) and
# dt_bias = 1: g = -exp(A_log) * softplus(a + dt_bias) is about -9.5 a token, so the recurrent state of one
# 64-token chunk decays to exp(-600) = 0 before the next chunk reads it, and a scan that carries state across
# chunks wrongly still matches stock. A_log = log U(0.002, 0.05), dt_bias = -1 (g of about -0.0006 to -0.016 a
# token where a = 0; softplus(-1) = 0.31) carry most of the state across a chunk: the scan's carry is tested (an
# off-by-one in it is 1e-3 off, the recipe 2e-7).
SLOW_A = (0.002, 0.05)
SLOW_DT_BIAS = -1.0


def slow_decay_gates(model: Any, generator: torch.Generator | None = None) -> Any:
    """Set every Gated DeltaNet layer's ``A_log`` to ``log U(SLOW_A)`` and ``dt_bias`` to ``SLOW_DT_BIAS``, in
    place (drawn from ``generator``, else torch's global generator); returns ``model``."""
    for m in model.modules():
        if type(m).__name__.endswith("GatedDeltaNet"):
            with torch.no_grad():
                lo, hi = SLOW_A
                a = torch.empty(m.A_log.shape, dtype=torch.float32).uniform_(lo, hi, generator=generator)
                m.A_log.copy_(a.log())
                m.dt_bias.fill_(SLOW_DT_BIAS)
    return model


def gated_deltanet_lm(family: str = "qwen3_5_moe", *, gates: str = "slow", **overrides: Any):
    """A tiny transformers LM with a Gated DeltaNet layer (row ``<family>:test`` of ``mpsboost.bench.models``):
    ``qwen3_5_moe`` (Qwen3.6-35B-A3B's classes), ``qwen3_5`` (dense), ``qwen3_next`` (fused qkvz/ba projections) or
    ``olmo_hybrid`` (separate projections, beta in [0, 2]). ``overrides`` replace config fields (e.g.
    ``linear_num_key_heads``). ``gates``: ``"slow"`` (default: :func:`slow_decay_gates`, state carried across
    chunks) or ``"stock"`` (transformers' initialisation: every chunk's state decays to 0)."""
    if gates not in ("slow", "stock"):
        raise ValueError(f"gates must be 'slow' or 'stock', got {gates!r}")
    model = models.build(f"{family}:test", **overrides)
    return slow_decay_gates(model) if gates == "slow" else model


def _run_lm(
    model, seed: int, *, batch: int = 2, prompt: int = 6, steps: int = 3, dtype: str = "float32"
) -> torch.Tensor:
    """Teacher-forced logits: a prefill of ``prompt`` tokens, then ``steps`` one-token decode steps.

    Teacher forcing (the next token is drawn in advance, not the argmax) keeps stock and patched runs
    on the same tokens even when a tiny rounding difference would flip a greedy choice, and it runs
    both phases: the many-token prefill and the one-token decode with a KV cache.
    """
    del dtype  # the model was cast by build(); ids are integers
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (batch, prompt + steps), generator=g)
    outs = []
    # transformers >= 5.2x names the cache argument `cache` (past_key_values is deprecated there).
    key = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    with torch.no_grad():
        out = model(input_ids=ids[:, :prompt], use_cache=True)
        outs.append(out.logits.float())
        past = getattr(out, key, None) if getattr(out, key, None) is not None else out.past_key_values
        for i in range(steps):
            out = model(input_ids=ids[:, prompt + i : prompt + i + 1], use_cache=True, **{key: past})
            past = getattr(out, key, None) if getattr(out, key, None) is not None else out.past_key_values
            outs.append(out.logits.float())
    return torch.cat(outs, dim=1)


def generate(
    model, seed: int, *, batch: int = 2, prompt: int = 5, new_tokens: int = 4, do_sample: bool = False
) -> torch.Tensor:
    """``model.generate`` on random prompt tokens (greedy by default); the generated ids."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (batch, prompt), generator=g)
    with torch.no_grad():
        return model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=do_sample,
            pad_token_id=0,
        )


_LM_SPACE = {"batch": (1, 2, 3), "prompt": (1, 5, 12), "steps": (0, 1, 3), "dtype": ("float32", "bfloat16")}


def _run_encoder(model, seed: int, *, batch: int = 2, tokens: int = 7, dtype: str = "float32") -> torch.Tensor:
    del dtype
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, model.config.vocab_size, (batch, tokens), generator=g)
    with torch.no_grad():
        return model(input_ids=ids).last_hidden_state.float()


# ------------------------------------------------------------------------------------ pipelines


def _text_dim(pipe) -> int:
    tr = pipe.transformer
    return tr.config.text_dim if hasattr(tr.config, "text_dim") else tr.config.joint_attention_dim


def _run_pipeline(
    pipe, seed: int, *, frames: int = 5, size: int = 32, steps: int = 2, dtype: str = "float32", output_type: str = "pt"
) -> torch.Tensor:
    """The whole pipeline from precomputed (random) prompt embeddings: no tokenizer, no network."""
    del dtype
    g = torch.Generator().manual_seed(seed)
    dim = _text_dim(pipe)
    # Embeddings go where the pipeline computes: under CPU offload that is the accelerator, not the
    # device the (offloaded) weights sit on; pipelines do not move precomputed embeddings themselves.
    dev = getattr(pipe, "_execution_device", torch.device("cpu"))
    emb = torch.randn(1, 8, dim, generator=g).to(dev)
    neg = torch.randn(1, 8, dim, generator=g).to(dev)
    kw: dict[str, Any] = dict(
        num_inference_steps=steps,
        height=size,
        width=size,
        output_type=output_type,
        generator=torch.Generator().manual_seed(seed),
    )
    if hasattr(pipe, "set_progress_bar_config"):
        pipe.set_progress_bar_config(disable=True)
    name = type(pipe).__name__
    with torch.no_grad():
        if name.startswith("QwenImage"):
            mask = torch.ones(1, 8, dtype=torch.long, device=dev)
            out = pipe(
                prompt_embeds=emb,
                prompt_embeds_mask=mask,
                negative_prompt_embeds=neg,
                negative_prompt_embeds_mask=mask,
                true_cfg_scale=2.0,
                **kw,
            )
            return torch.as_tensor(out.images).float()
        out = pipe(prompt_embeds=emb, negative_prompt_embeds=neg, num_frames=frames, guidance_scale=3.0, **kw)
        return torch.as_tensor(out.frames).float()


_PIPE_SPACE = {"frames": (1, 5), "size": (32,), "steps": (1, 2)}


def _run_video_vae(vae, seed: int, *, frames: int = 5, size: int = 32, dtype: str = "float32") -> torch.Tensor:
    """Encode and decode a random video with a VAE of another layout than Wan's (no ``z_dim``, no tiling options)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.rand(1, 3, frames, size, size, generator=g) * 2 - 1).to(DTYPES[dtype])
    with torch.no_grad():
        return vae(x, sample_posterior=False).sample.float()


# ------------------------------------------------------------------------------------ the table

# How the tests run a model: by its class where two classes of a kind take different inputs, else by its kind.
# (runner, default shape, value space)
_RUNS: dict[str, tuple[Callable[..., torch.Tensor], dict, dict]] = {
    "vae": (_run_vae, {"frames": 5, "size": 32}, _VAE_SPACE),
    "AutoencoderKLHunyuanVideo": (
        _run_video_vae,
        {"frames": 5, "size": 32},
        {"frames": (1, 5), "size": (32,), "dtype": ("float32", "bfloat16")},
    ),
    "WanTransformer3DModel": (
        _run_wan_transformer,
        {},
        {"batch": (1, 2), "frames": (1, 2, 3), "size": (2, 4), "text": (1, 7), "dtype": ("float32", "bfloat16")},
    ),
    "QwenImageTransformer2DModel": (
        _run_qwen_image_transformer,
        {},
        {"batch": (1, 2), "size": (2, 4), "text": (1, 7), "dtype": ("float32", "bfloat16")},
    ),
    "lm": (_run_lm, {}, _LM_SPACE),
    "encoder": (_run_encoder, {}, {"batch": (1, 2), "tokens": (1, 7, 16), "dtype": ("float32", "bfloat16")}),
    "pipeline": (_run_pipeline, {"frames": 5}, _PIPE_SPACE),
}


def _tiny(name: str, row: str) -> Tiny:
    spec = models.MODELS[row]
    runner, default, space = _RUNS.get(spec.model_class) or _RUNS[spec.kind]
    default = {**default, **spec.shape}
    space = {k: ((spec.shape[k],) if k in spec.shape else v) for k, v in space.items()}
    return Tiny(name, row, spec.library, spec.kind, runner, default, space)


TINY: dict[str, Tiny] = {name: _tiny(name, row) for name, row in models.ZOO.items()}


def build(name: str, dtype: str = "float32", seed: int = 0) -> Any:
    """A fresh instance of ``TINY[name]`` (weights from ``seed``), cast to ``dtype``, in eval mode."""
    spec = TINY[name]
    torch.manual_seed(seed)
    obj = spec.make()
    cast = dtype != "float32"  # built in fp32 already; casting to it only prints diffusers' warnings
    if isinstance(obj, torch.nn.Module):
        obj = (obj.to(DTYPES[dtype]) if cast else obj).eval()
    else:  # a pipeline: cast its module components
        if cast:
            obj.to(dtype=DTYPES[dtype])
        for comp in obj.components.values():
            if isinstance(comp, torch.nn.Module):
                comp.eval()
    return obj


def run(name: str, obj: Any, seed: int, **shape: Any) -> torch.Tensor:
    """Run ``obj`` (built from ``TINY[name]``) on inputs drawn from ``seed``; shape defaults filled in."""
    spec = TINY[name]
    kw = dict(spec.default)
    kw.update(shape)
    return spec.runner(obj, seed, **kw)


def modules_of(obj: Any) -> list[tuple[str, torch.nn.Module]]:
    """(prefix, root module) pairs, as mpsboost sees them: one for a model, one per pipeline component."""
    if isinstance(obj, torch.nn.Module):
        return [("", obj)]
    return [(n, c) for n, c in obj.components.items() if isinstance(c, torch.nn.Module)]


@functools.lru_cache(maxsize=None)
def _probe(name: str) -> Any:
    # Built once and only searched (recipe.find), never patched or run.
    return build(name)


def covering(recipe: Any, names: Iterable[str] | None = None, *, kinds: Iterable[str] | None = None) -> list[str]:
    """Names of the tiny models in which ``recipe.find`` finds at least one target."""
    wanted = set(kinds) if kinds is not None else None
    out = []
    for name in names if names is not None else TINY:
        if wanted is not None and TINY[name].kind not in wanted:
            continue
        obj = _probe(name)
        if any(True for prefix, root in modules_of(obj) for _ in recipe.find(root, prefix)):
            out.append(name)
    return out


def uncovered_recipes(recipes: Iterable[Any]) -> list[str]:
    return [r.name for r in recipes if not covering(r)]


# ------------------------------------------------------------------------------------ state snapshots

_MISSING = object()


def snapshot(obj: Any) -> dict:
    """Everything a patch may change, for exact before/after comparison.

    Per module: the identity, dtype, device, shape and value (cloned) of every parameter and buffer,
    the keys of the instance ``__dict__`` and the identity of an instance ``forward`` (or its absence).
    """
    mods: dict[str, Any] = {}
    tensors: dict[str, tuple] = {}
    for prefix, root in modules_of(obj):
        for mname, mod in root.named_modules():
            key = f"{prefix}.{mname}" if mname else (prefix or "<root>")
            fwd = mod.__dict__.get("forward", _MISSING)
            # The forward object itself: compared with `is`, since bound methods compare equal by value.
            mods[key] = (
                (
                    type(mod),
                    sorted(mod.__dict__),
                    sorted(mod._parameters),
                    sorted(mod._buffers),
                    sorted(mod._modules),
                    sorted(mod._forward_hooks),
                    sorted(mod._forward_pre_hooks),
                ),
                fwd,
            )
            for pname, p in list(mod._parameters.items()) + list(mod._buffers.items()):
                if p is None:
                    tensors[f"{key}:{pname}"] = (None,)
                    continue
                value = None if p.device.type == "meta" else p.detach().clone()  # meta tensors have no values
                tensors[f"{key}:{pname}"] = (id(p), p.dtype, p.device, tuple(p.shape), type(p), value)
    return {"modules": mods, "tensors": tensors}


def diff_snapshot(a: dict, b: dict) -> list[str]:
    """What differs between two snapshots (empty when they are the same)."""
    out = []
    for k in sorted(set(a["modules"]) | set(b["modules"])):
        x, y = a["modules"].get(k), b["modules"].get(k)
        if x is None or y is None:
            out.append(f"module {k}: present in only one snapshot")
        elif x[0] != y[0]:
            out.append(f"module {k}: {x[0]} != {y[0]}")
        elif x[1] is not y[1]:
            out.append(f"module {k}: instance forward {x[1]!r} is not {y[1]!r}")
    for k in sorted(set(a["tensors"]) | set(b["tensors"])):
        x, y = a["tensors"].get(k), b["tensors"].get(k)
        if x is None or y is None or x[:-1] != y[:-1]:
            out.append(f"tensor {k}: {x and x[:-1]} != {y and y[:-1]}")
        elif len(x) > 1 and x[-1] is not None and not torch.equal(x[-1], y[-1]):
            out.append(f"tensor {k}: values differ")
    return out


def same_snapshot(a: dict, b: dict) -> bool:
    return not diff_snapshot(a, b)


def clone(obj: Any) -> Any:
    """A deep copy (the stock twin of a model that a test patches)."""
    return copy.deepcopy(obj)


# ------------------------------------------------------------------------------------ environments


def candidate_envs(*, runnable_on_cpu: bool) -> list[tuple[str, Any]]:
    """Environments to patch a CPU model for, real first, then simulated ones (label, env).

    A simulated env makes a recipe take the path it would take there (e.g. the MPS 2.14 layout
    fix); with ``runnable_on_cpu`` only envs whose paths run on CPU tensors are listed (a simulated
    CUDA env may pick a Triton kernel, which needs a GPU).
    """
    from mpsboost.gate import Env

    envs: list[tuple[str, Any]] = [
        ("cpu (real)", Env.detect("cpu")),
        ("mps 2.14.1 (simulated)", Env.simulate("mps", "2.14.1")),
        ("mps 2.15.0 (simulated)", Env.simulate("mps", "2.15.0")),
        ("mps 2.16 nightly (simulated)", Env.simulate("mps", "2.16.0.dev20271231")),
    ]
    if not runnable_on_cpu:
        envs += [
            ("cuda sm90 (simulated)", Env.simulate("cuda:9.0")),
            ("cuda sm89 (simulated)", Env.simulate("cuda:8.9")),
        ]
    return envs


def fp8_for(recipe: Any) -> str | None:
    """The ``fp8=`` argument a recipe needs to be selected (FP8 recipes are opt-in by granularity)."""
    return "rowwise" if getattr(recipe, "keyword", None) == "fp8" else None


def applying_env(
    recipe: Any, obj: Any, *, runnable_on_cpu: bool, options: Mapping | None = None
) -> tuple[str, Any, int] | None:
    """The first candidate env in which ``recipe`` would apply to ``obj``: (label, env, how many targets)."""
    import mpsboost

    for label, env in candidate_envs(runnable_on_cpu=runnable_on_cpu):
        report = mpsboost.plan(obj, recipes=[recipe.name], env=env, fp8=fp8_for(recipe), options=options)
        n = sum(1 for r in report.rows if r.recipe == recipe.name and r.status == "would apply")
        if n:
            return label, env, n
    return None


# ------------------------------------------------------------------------------------ other video VAEs
# diffusers' video VAEs besides Wan / Qwen-Image (video_vae_pad): rows of mpsboost.bench.models (VIDEO_VAES), each
# with an input that runs every padding module.

VIDEO_VAE_NAMES = tuple(models.VIDEO_VAES)


def build_video_vae(name: str, seed: int = 0) -> Any:
    torch.manual_seed(seed)
    return models.build(models.VIDEO_VAES[name][0]).eval()


def video_vae_input(name: str, seed: int) -> torch.Tensor:
    shape = models.VIDEO_VAES[name][1]
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def video_vae_roundtrip(vae: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode, then decode the mode of the posterior (or the latent a non-KL VAE returns)."""
    with torch.no_grad():
        post = vae.encode(x)
        dist = getattr(post, "latent_dist", None)
        z = dist.mode() if dist is not None else (post if torch.is_tensor(post) else post[0])
        y = vae.decode(z)
        return z, (y if torch.is_tensor(y) else y[0])


class Pad5dCounter:
    """A ``TorchDispatchMode`` (built on first use) that records every pad of a rank-5 tensor at the aten
    level: ``constant_pad_nd``, ``replication_pad3d``, ``reflection_pad3d``, ``pad``. ``calls`` holds
    ``(op name, input shape)`` pairs."""

    def __new__(cls):
        from torch.utils._python_dispatch import TorchDispatchMode

        aten = torch.ops.aten
        ops = {
            aten.constant_pad_nd.default: "constant_pad_nd",
            aten.replication_pad3d.default: "replication_pad3d",
            aten.reflection_pad3d.default: "reflection_pad3d",
            aten.pad.default: "pad",
        }

        class _Counter(TorchDispatchMode):
            def __init__(self):
                super().__init__()
                self.calls: list[tuple[str, tuple]] = []
                self.conv_inputs: list[tuple] = []

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func in ops and args[0].dim() == 5:
                    self.calls.append((ops[func], tuple(args[0].shape)))
                if func is aten.convolution.default:
                    self.conv_inputs.append(tuple(args[0].shape))
                return func(*args, **(kwargs or {}))

        return _Counter()


def fake_versions(monkeypatch: Any, **installed: str | None) -> None:
    """``importlib.metadata.version`` answers ``installed`` (None: not installed) for the named distributions and
    the truth for every other (what ``mpsboost doctor`` reads to say whether transformers' kernels would load)."""
    import importlib.metadata as md

    real = md.version

    def version(dist: str) -> str:
        if dist in installed:
            if installed[dist] is None:
                raise md.PackageNotFoundError(dist)
            return installed[dist]
        return real(dist)

    monkeypatch.setattr(md, "version", version)


def pin_kernels_bounds(monkeypatch: Any, lo: str = "0.18.2", hi: str = "0.19.0") -> None:
    """transformers' own bounds on the ``kernels`` package (``import_utils.KERNELS_MIN_VERSION`` / ``_MAX_``), which
    ``mpsboost doctor`` reads, set to ``lo``/``hi`` (default: transformers 5.24's), so that a test's expected words
    do not move with the installed transformers (5.25 asks for >=0.19.1,<0.20.0)."""
    from transformers.utils import import_utils

    monkeypatch.setattr(import_utils, "KERNELS_MIN_VERSION", lo)
    monkeypatch.setattr(import_utils, "KERNELS_MAX_VERSION", hi)


def decode_step_ops(model: Any, modules: Iterable[torch.nn.Module], batch: int, *, cache: Any = None) -> list[str]:
    """The names of the aten ops ``modules`` dispatch in one decode step after a prefill of 8 tokens (fixed ids;
    ``cache``: a cache object for the prefill, e.g. a StaticCache; default transformers' own)."""
    ids = torch.randint(3, 128, (batch, 9), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        kw = {"past_key_values": cache} if cache is not None else {}
        past = model(ids[:, :8], use_cache=True, **kw).past_key_values
        with ModuleOps(modules) as counter:
            model(ids[:, 8:], past_key_values=past, use_cache=True)
    return counter.names


# ------------------------------------------------------------------------------------------ patch-time timing


def real_mac(torch_version: str = "2.15.0", macos=(26, 1)):
    """A real (not simulated) Mac environment, for the patch-time choice (``mpsboost.ondevice.choose``) without a
    Mac: the recipe's contenders and the timer are stubbed by the test."""
    from mpsboost.gate import Env, parse_torch_version

    return Env(torch_version=parse_torch_version(torch_version), device_type="mps", simulated=False, macos=macos)


class FakeTimer:
    """An injected ``ondevice`` timer: seconds per call by the contender function's ``__name__`` (one value, or a
    list taken in turn), every call's name in ``calls``; ``error``: raised at every call instead."""

    def __init__(self, times: Mapping[str, Any], error: Exception | None = None):
        self.times = {k: (list(v) if isinstance(v, (list, tuple)) else [v]) for k, v in times.items()}
        self.error = error
        self.calls: list[str] = []

    def __call__(self, fn):
        name = fn.__name__
        self.calls.append(name)
        if self.error is not None:
            raise self.error
        seq = self.times[name]
        return seq[(self.calls.count(name) - 1) % len(seq)]


def no_timing(fn):
    """A timer that fails the test: nothing may be timed here."""
    raise AssertionError("nothing may be timed here")
