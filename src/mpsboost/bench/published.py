"""Writers of fp8 checkpoints in the published layouts, from a model with any weights.

The cookbook's ``recipes/fp8_checkpoint.py`` (offline mode) and ``benchmarks/fp8_load.py`` write files in the
layouts that published fp8 checkpoints use, then load them with ``mpsboost.load_fp8``; both need the same
writer, so it lives here and each imports it.

* ``transformers``: ``config.json`` ``quantization_config = {"quant_method": "fp8", "weight_block_size":
  [bn, bk]}``; ``<layer>.weight`` F8_E4M3 and ``<layer>.weight_scale_inv`` F32 per block; MoE experts as
  one Linear per expert (``mlp.experts.<e>.gate_proj.weight`` ...), as the Qwen3 FP8 releases store them.
* ``compressed-tensors``: ``quant_method = "compressed-tensors"``, ``format = "float-quantized"``, channel
  strategy: ``<layer>.weight`` F8_E4M3 and ``<layer>.weight_scale`` ``[N, 1]``.
* ``scaled_fp8``: one file, ``scaled_fp8`` marker, ``model.diffusion_model.<original Wan name>.weight``
  F8_E4M3 with ``.scale_weight`` (one float32); diffusers' single-file conversion maps the names.

Every writer also hands back the file's exact dequantisation (codes x scales in float32, rounded once),
the reference a loaded model is compared with.
"""

from __future__ import annotations

from dataclasses import dataclass

import json
import struct
from pathlib import Path
from typing import Iterator

import torch

__all__ = [
    "FORMATS",
    "FP8",
    "QWEN36_FP8",
    "Qwen36Fp8Layout",
    "StreamWriter",
    "dequant",
    "published_tensors",
    "quant_block",
    "quant_rows",
    "quant_tensor",
    "qwen36_fp8_layout",
    "wan_original_name",
    "write_published",
]

FP8 = torch.float8_e4m3fn
FORMATS = ("transformers", "compressed-tensors", "scaled_fp8")
_ST = {
    torch.float8_e4m3fn: "F8_E4M3",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.int64: "I64",
}


# ---------------------------------------------------------------------------------- quantisation by the formats' rules


def quant_block(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scale_inv [ceil(N/bn), ceil(K/bk)]): scale = amax of the block / 448; short last blocks allowed."""
    bn, bk = block
    n, k = w.shape
    nb, kb = -(-n // bn), -(-k // bk)
    pad = torch.zeros(nb * bn, kb * bk, dtype=torch.float32, device=w.device)
    pad[:n, :k] = w.float()
    amax = pad.view(nb, bn, kb, bk).abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    per = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (w.float() / per).clamp(-448, 448).to(FP8), scale


def quant_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    amax = w.float().abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    return (w.float() / scale).clamp(-448, 448).to(FP8), scale


def quant_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    amax = w.float().abs().amax()
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax)).reshape(1)
    return (w.float() / scale).clamp(-448, 448).to(FP8), scale


def dequant(
    codes: torch.Tensor, scale: torch.Tensor, shape_block: tuple[int, int] | None, dtype: torch.dtype
) -> torch.Tensor:
    """The file's exact dequantisation: code x its scale in float32, rounded once to ``dtype``."""
    c = codes.float()
    if shape_block is not None:
        bn, bk = shape_block
        n, k = c.shape
        s = scale.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    else:
        s = scale.float().reshape(-1, 1) if scale.numel() > 1 else scale.float().reshape(())
    return (c * s).to(dtype)


# ------------------------------------------------------------------------------------------ writing, tensor by tensor


class StreamWriter:
    """A safetensors file written one tensor at a time (header first, from the announced shapes)."""

    def __init__(self, path: Path, specs: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict | None = None):
        self.path, self.order = path, [k for k, _, _ in specs]
        header: dict = {"__metadata__": metadata or {}}
        off = 0
        for key, dt, shape in specs:
            n = 1
            for s in shape:
                n *= s
            nb = n * torch.empty((), dtype=dt).element_size()
            header[key] = {"dtype": _ST[dt], "shape": list(shape), "data_offsets": [off, off + nb]}
            off += nb
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.header = header
        self.fh = open(path, "wb")
        self.fh.write(struct.pack("<Q", len(raw)) + raw)
        self.next = 0

    def write(self, key: str, t: torch.Tensor) -> None:
        if key != self.order[self.next]:
            raise RuntimeError(f"StreamWriter: expected {self.order[self.next]}, got {key}")
        info = self.header[key]
        if list(t.shape) != info["shape"] or _ST[t.dtype] != info["dtype"]:
            raise RuntimeError(f"StreamWriter: {key} is {t.dtype} {list(t.shape)}, announced {info}")
        cpu = t.detach().contiguous().cpu()
        if cpu.numel():
            self.fh.write(memoryview(cpu.reshape(-1).view(torch.uint8).numpy()))
        self.next += 1

    def close(self) -> None:
        self.fh.close()
        if self.next != len(self.order):
            raise RuntimeError(f"StreamWriter: {len(self.order) - self.next} tensors were never written")


_WAN_BACK = [  # diffusers' names -> the original Wan repository's (inverse of convert_wan_transformer_to_diffusers)
    ("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
    ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
    ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
    ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
    ("condition_embedder.time_proj", "time_projection.1"),
    ("attn2", "cross_attn"),
    ("attn1", "self_attn"),
    (".to_out.0.", ".o."),
    (".to_q.", ".q."),
    (".to_k.", ".k."),
    (".to_v.", ".v."),
    ("ffn.net.0.proj", "ffn.0"),
    ("ffn.net.2", "ffn.2"),
    ("norm2", "norm__x"),
    ("norm3", "norm2"),
    ("norm__x", "norm3"),
]


@dataclass(frozen=True)
class Qwen36Fp8Layout:
    """What ``write_published`` needs to write a text model in the layout of ``Qwen/Qwen3.6-35B-A3B-FP8``: the
    multimodal wrapper's config, its key prefix, the modules the file keeps in bf16, and the Linears kept whole."""

    config: dict
    modules_to_not_convert: list
    keep: tuple
    prefix: str = "model.language_model."

    def rename(self, key: str) -> str:
        return key if key.startswith("lm_head") else self.prefix + key[len("model.") :]


# The layers the published file stores in bf16 besides norms, convolutions and the router (one output each or tiny).
QWEN36_FP8 = ("mlp.shared_expert_gate", "linear_attn.in_proj_a", "linear_attn.in_proj_b")


def qwen36_fp8_layout(cfg) -> Qwen36Fp8Layout:
    """The published Qwen3.6-FP8 layout for a ``Qwen3_5MoeTextConfig`` ``cfg`` (its ``modules_to_not_convert`` per
    layer, the wrapper config with ``text_config``); one definition for the cookbook script, the benchmark and the
    tests."""
    prefix = Qwen36Fp8Layout.prefix
    bf16 = (
        "input_layernorm",
        "post_attention_layernorm",
        "mlp.gate",
        "self_attn.q_norm",
        "self_attn.k_norm",
        "linear_attn.A_log",
        "linear_attn.conv1d",
        "linear_attn.dt_bias",
        "linear_attn.norm",
        *QWEN36_FP8,
    )
    not_convert = ["lm_head", prefix + "embed_tokens"]
    for i in range(cfg.num_hidden_layers):
        not_convert += [f"{prefix}layers.{i}.{s}" for s in bf16]
    wrapper = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": cfg.to_dict(),
        "tie_word_embeddings": False,
    }
    return Qwen36Fp8Layout(config=wrapper, modules_to_not_convert=not_convert, keep=QWEN36_FP8)


def wan_original_name(key: str) -> str:
    if key == "scale_shift_table":
        return "head.modulation"
    if key.startswith("proj_out."):
        return "head.head." + key[len("proj_out.") :]
    out = key.replace("scale_shift_table", "modulation")
    for a, b in _WAN_BACK:
        out = out.replace(a, b)
    return out


def published_tensors(
    model: torch.nn.Module,
    fmt: str,
    *,
    block=(128, 128),
    tensors: Iterator | None = None,
    original_names=None,
    rename=None,
    keep: tuple[str, ...] = (),
    scale_dtype=torch.float32,
) -> tuple[list, Iterator]:
    """(specs, generator) of a published fp8 checkpoint of ``model`` in ``fmt``.

    ``tensors`` yields (model key, bf16 tensor) in state-dict order (default: the model's state); the
    generator yields (file key, tensor) in the order of ``specs``, quantising one weight at a time.
    It also yields (model key, ("ref", exact dequantisation)) items for the caller's reference.
    ``rename``: model key -> file key (transformers formats; e.g. Qwen3.6's ``model.language_model.``
    prefix); ``keep``: module-name suffixes left in bf16 besides ``lm_head`` and ``mlp.gate``;
    ``scale_dtype``: of ``weight_scale_inv`` (Qwen's FP8 releases store BF16 scales).
    """
    linears = {n for n, m in model.named_modules() if type(m) is torch.nn.Linear}
    state = model.state_dict(keep_vars=True)
    specs: list = []
    plan: list = []
    keep = ("mlp.gate", *keep)
    for key, t in state.items():
        mod = key.rsplit(".", 1)[0]
        quant = key.endswith(".weight") and mod in linears and not key.startswith("lm_head") and not mod.endswith(keep)
        fkey = rename(key) if rename is not None and fmt != "scaled_fp8" else key
        if fmt == "scaled_fp8":
            quant = quant and key.startswith(("blocks.", "transformer_blocks."))
            name = "model.diffusion_model." + ((original_names or (lambda k: k))(key))
            if quant:
                base = name[: -len("weight")]
                specs += [(name, FP8, tuple(t.shape)), (base + "scale_weight", torch.float32, ())]
            else:
                specs.append((name, t.dtype, tuple(t.shape)))
            plan.append((key, name, quant, None))
        elif key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            base = fkey.rsplit(".", 1)[0]
            e, n, k = t.shape
            subs = (
                (("gate_proj", 0, n // 2), ("up_proj", n // 2, n))
                if key.endswith("gate_up_proj")
                else (("down_proj", 0, n),)
            )
            sdt = scale_dtype if fmt == "transformers" else torch.float32
            for ex in range(e):
                for sub, r0, r1 in subs:
                    w = f"{base}.{ex}.{sub}.weight"
                    sshape = (-(-(r1 - r0) // block[0]), -(-k // block[1])) if fmt == "transformers" else (r1 - r0, 1)
                    specs += [
                        (w, FP8, (r1 - r0, k)),
                        (w + ("_scale_inv" if fmt == "transformers" else "_scale"), sdt, sshape),
                    ]
            plan.append((key, base, "experts", subs))
        elif quant:
            n, k = t.shape
            if fmt == "transformers":
                specs += [
                    (fkey, FP8, (n, k)),
                    (fkey + "_scale_inv", scale_dtype, (-(-n // block[0]), -(-k // block[1]))),
                ]
            else:
                specs += [(fkey, FP8, (n, k)), (fkey.rsplit(".", 1)[0] + ".weight_scale", torch.float32, (n, 1))]
            plan.append((key, fkey, True, None))
        else:
            specs.append((fkey, t.dtype, tuple(t.shape)))
            plan.append((key, fkey, False, None))

    def quantise(w):
        if fmt == "transformers":
            q, s = quant_block(w, block)
            if scale_dtype != torch.float32:  # the stored scale is what the file means: codes from it, exactly
                s = s.to(scale_dtype)
                per = (
                    s.float()
                    .repeat_interleave(block[0], 0)[: w.shape[0]]
                    .repeat_interleave(block[1], 1)[:, : w.shape[1]]
                )
                q = (w.float() / per).clamp(-448, 448).to(FP8)
            return q, s, dequant(q, s, block, w.dtype)
        if fmt == "compressed-tensors":
            q, s = quant_rows(w)
        else:
            q, s = quant_tensor(w)
            s = s.reshape(())
        return q, s, dequant(q, s, None, w.dtype)

    def gen():
        source = tensors if tensors is not None else ((k, v.detach()) for k, v in state.items())
        by_key = dict(plan_entry for plan_entry in ((p[0], p) for p in plan))
        for key, t in source:
            _, name, quant, subs = by_key[key]
            if quant == "experts":
                refs = torch.empty_like(t)
                for ex in range(t.shape[0]):
                    for sub, r0, r1 in subs:
                        q, s, ref = quantise(t[ex, r0:r1])
                        w = f"{name}.{ex}.{sub}.weight"
                        yield w, q
                        yield w + ("_scale_inv" if fmt == "transformers" else "_scale"), s
                        refs[ex, r0:r1] = ref
                yield key, ("ref", refs)
            elif quant:
                q, s, ref = quantise(t)
                yield name, q
                if fmt == "scaled_fp8":
                    yield name[: -len("weight")] + "scale_weight", s
                elif fmt == "transformers":
                    yield name + "_scale_inv", s
                else:
                    yield name.rsplit(".", 1)[0] + ".weight_scale", s
                yield key, ("ref", ref)
            else:
                yield name, t
                yield key, ("ref", t)

    if fmt == "scaled_fp8":
        specs.insert(0, ("scaled_fp8", FP8, (0,)))
    return specs, gen()


def write_published(
    model: torch.nn.Module,
    fmt: str,
    out: Path,
    *,
    block=(128, 128),
    tensors=None,
    config: dict | None = None,
    keep_reference: bool = True,
    rename=None,
    keep: tuple[str, ...] = (),
    scale_dtype=torch.float32,
    modules_to_not_convert: list | None = None,
) -> tuple[Path, dict]:
    """Write ``model`` as a published fp8 checkpoint in ``fmt`` under ``out``; returns (path, reference state).
    ``rename``, ``keep``, ``scale_dtype``: see :func:`published_tensors`; ``modules_to_not_convert``: the
    transformers quantization_config's list (default ``["lm_head"]``)."""
    orig = wan_original_name if fmt == "scaled_fp8" and type(model).__name__ == "WanTransformer3DModel" else None
    specs, gen = published_tensors(
        model, fmt, block=block, tensors=tensors, original_names=orig, rename=rename, keep=keep, scale_dtype=scale_dtype
    )
    if fmt == "scaled_fp8":
        path = out / f"{type(model).__name__}_fp8_scaled.safetensors"
    else:
        path = out / "model.safetensors"
    out.mkdir(parents=True, exist_ok=True)
    # Written in the order they are made (safetensors needs contiguous data, not sorted names): one layer in memory.
    w = StreamWriter(path, specs)
    ref: dict = {}
    if fmt == "scaled_fp8":
        w.write("scaled_fp8", torch.empty(0, dtype=FP8))
    for key, t in gen:
        if isinstance(t, tuple):
            if keep_reference:
                ref[key] = t[1]
            continue
        w.write(key, t)
    w.close()
    if fmt != "scaled_fp8" and config is not None:
        cfg = dict(config)
        if fmt == "transformers":
            cfg["quantization_config"] = {
                "quant_method": "fp8",
                "activation_scheme": "dynamic",
                "weight_block_size": list(block),
                "modules_to_not_convert": list(modules_to_not_convert or ["lm_head"]),
            }
        else:
            cfg["quantization_config"] = {
                "quant_method": "compressed-tensors",
                "format": "float-quantized",
                "ignore": ["lm_head"],
                "quantization_status": "compressed",
                "config_groups": {
                    "group_0": {
                        "targets": ["Linear"],
                        "weights": {
                            "num_bits": 8,
                            "type": "float",
                            "strategy": "channel",
                            "symmetric": True,
                            "dynamic": False,
                        },
                    }
                },
            }
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
        return out, ref
    return path, ref
