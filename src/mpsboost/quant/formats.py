"""Weight formats as rows: each row says how to recognise a folder, which transformers model it holds, and, for
every tensor of that model, which file tensors fill it and how they are decoded (:class:`Source`).

The load plan (:mod:`mpsboost.quant.plan`) is generic over the row: it builds the model the row names on the meta
device, asks the row for a :class:`Source` per model tensor, checks that every tensor of the model has one and that
every file tensor is used (or named as not part of the model), and builds the layers. Adding a format is a row, its
decoders and its tests.

Rows: ``mlx-affine`` (what mlx-lm's converter writes: ``mlx-community/...-4bit`` / ``-8bit`` folders), in
:data:`FORMATS`. The fp8 formats (``mpsboost``, ``transformers-fp8``, ``compressed-tensors``, ``scaled_fp8``) are rows
of the same package, :class:`~mpsboost.quant.fp8_formats.Fp8Format` rows of
:data:`~mpsboost.quant.fp8_formats.FP8_FORMATS` with their own plan (:mod:`mpsboost.quant.fp8_plan`: fp8 layers are
the ``fp8_weights`` recipe's); :data:`ROWS` lists every row of both kinds, each read through :mod:`mpsboost.quant.io`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from . import codec
from .errors import QuantFileError, QuantMismatchError
from .families import Family, family_for
from .fp8_formats import FP8_FORMATS, Fp8Format
from .io import Folder, TensorEntry, read_tensor
from ..recipes.low_bit.layers import QParams

__all__ = ["Format", "Source", "ModelView", "FORMATS", "ROWS", "detect", "MLX_AFFINE"]


@dataclass(frozen=True)
class ModelView:
    """What a row sees of the model it fills: ``{state-dict key: (shape, dtype)}`` (tied keys included)."""

    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]


@dataclass(frozen=True)
class Source:
    """The file tensors that fill one model tensor (``weight`` of a module, a stack, a norm) and how to decode them.

    ``read(device, dtype)`` gives ``{name: tensor}`` for the module: ``{"weight": codes, "scales": s, "biases": b}``
    for a tensor kept quantized (``quant`` set), ``{name: tensor}`` for a plain one (``dtype`` is the model's)."""

    keys: tuple[str, ...]
    shape: tuple[int, ...]  # the model tensor's (dense) shape
    read: Callable[[torch.device, torch.dtype], dict[str, torch.Tensor]]
    quant: Optional[QParams] = None
    nbytes: int = 0
    note: str = ""  # a rewrite undone (for the plan's description)


@dataclass(frozen=True)
class Format:
    """One weight format: detection, the model it holds, the key map and tensor decoders (``sources``), checks."""

    name: str
    summary: str
    detect: Callable[[Folder], bool]
    model_config: Callable[[Folder], tuple[Any, dict]]  # (transformers config of the model built, row's info)
    sources: Callable[[Folder, ModelView, dict], tuple[dict[str, Source], list[str]]]  # (model key -> Source, ignored)
    extra: dict = field(default_factory=dict)


# ------------------------------------------------------------------------------------------ MLX affine


def _quantization(cfg: dict) -> Optional[dict]:
    q = cfg.get("quantization")
    if q is None and isinstance(cfg.get("text_config"), dict):
        q = cfg["text_config"].get("quantization")
    return q if isinstance(q, dict) else None


def _mlx_detect(folder: Folder) -> bool:
    cfg = folder.config or {}
    q = _quantization(cfg)
    if q is not None:
        return True
    # An unquantized MLX folder (mlx_lm.convert without -q): safetensors metadata {"format": "mlx"}.
    return folder.metadata.get("format") == "mlx"


_GLOBAL = ("group_size", "bits", "mode")


def _check_quantization(q: dict) -> QParams:
    mode = q.get("mode", "affine")
    if mode != "affine":
        raise QuantMismatchError(
            f"config.json field quantization.mode={mode!r}: mpsboost reads MLX's 'affine' mode "
            "(mxfp4, mxfp8 and nvfp4 are not supported yet)"
        )
    for k in ("group_size", "bits"):
        if k not in q:
            raise QuantMismatchError(f"config.json field quantization.{k} is missing (MLX writes bits and group_size)")
    try:
        default = QParams(int(q["bits"]), int(q["group_size"]))
    except ValueError as exc:
        raise QuantMismatchError(f"config.json field quantization: {exc}") from None
    for k, v in q.items():
        if k in _GLOBAL:
            continue
        if isinstance(v, bool):
            continue
        if not isinstance(v, dict):
            raise QuantMismatchError(
                f"config.json field quantization[{k!r}]={v!r}: expected a module's {{'bits', 'group_size'}} or a bool"
            )
        unknown = sorted(set(v) - set(_GLOBAL))
        if unknown:
            raise QuantMismatchError(
                f"config.json field quantization[{k!r}] has unknown key(s) {unknown}; MLX writes bits, group_size, mode"
            )
        if v.get("mode", "affine") != "affine":
            raise QuantMismatchError(f"config.json field quantization[{k!r}].mode={v['mode']!r}: only 'affine' is read")
    return default


def _mlx_model_config(folder: Folder) -> tuple[Any, dict]:
    import transformers

    cfg = dict(folder.config or {})
    if not cfg:
        raise QuantFileError(f"{folder.path}: no config.json; an MLX folder holds the model's config.json")
    if "model_type" not in cfg:
        raise QuantMismatchError(f"{folder.path}/config.json has no field model_type")
    fam = family_for(cfg["model_type"])
    q = _quantization(cfg)
    default = _check_quantization(q) if q is not None else None
    clean = {k: v for k, v in cfg.items() if k not in ("quantization", "quantization_config", "model_type")}
    if isinstance(clean.get("text_config"), dict):
        clean["text_config"] = {
            k: v for k, v in clean["text_config"].items() if k not in ("quantization", "quantization_config")
        }
    clean.pop("vision_config", None)
    try:
        hf = transformers.AutoConfig.for_model(cfg["model_type"], **clean)
    except Exception as exc:  # transformers' config validators raise their own classes
        raise QuantMismatchError(
            f"config.json (model_type={cfg['model_type']!r}) is not a config transformers reads: {exc}"
        ) from None
    text = hf.get_text_config()
    return text, {"family": fam, "quantization": q or {}, "default": default}


def _infer(key: str, k: int, words: int, groups: int, given: Optional[QParams], field_name: str) -> QParams:
    """The (bits, group size) of a quantized tensor: the config's entry where there is one (checked against the
    shapes), else what its shapes say (as mlx-lm's ``infer_quant_config``)."""
    if words * 32 % k or k % groups:
        raise QuantMismatchError(
            f"{key}: {words} words and {groups} groups a row do not fit {k} weights a row (the model's in_features)"
        )
    inferred = (words * 32 // k, k // groups)
    if given is not None and (given.bits, given.group_size) != inferred:
        raise QuantMismatchError(
            f"{key}: config.json field {field_name} says bits={given.bits}, group_size={given.group_size}, but the "
            f"tensor's shapes ({words} words, {groups} groups for {k} weights a row) say bits={inferred[0]}, "
            f"group_size={inferred[1]}"
        )
    try:
        return QParams(*inferred)
    except ValueError as exc:
        raise QuantMismatchError(f"{key}: {exc}") from None


def _entry(folder: Folder, key: str) -> TensorEntry:
    e = folder.entries.get(key)
    if e is None:
        raise QuantMismatchError(f"{folder.name}: tensor {key!r} is missing")
    return e


def _read_q(entries: list[tuple[TensorEntry, TensorEntry, TensorEntry]], dim: int):
    """Codes, scales and biases of one or more file modules, concatenated along ``dim`` (gate rows then up rows)."""

    def read(device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        del dtype  # scales and biases stay in the file's dtype
        out = []
        for part in zip(*entries):
            ts = [read_tensor(e) for e in part]
            t = ts[0] if len(ts) == 1 else torch.cat(ts, dim=dim)
            out.append(t.to(device))
            del ts
        q, s, b = out
        if q.dtype != torch.uint32:
            q = q.view(torch.uint32)
        return {"weight": q, "scales": s, "biases": b}

    return read


@dataclass
class _MlxRead:
    """One MLX folder being mapped onto a model: what every step of :func:`_mlx_sources` shares."""

    folder: Folder
    view: ModelView
    info: dict
    used: set = field(default_factory=set)  # file keys placed (or deliberately ignored)
    ignored: list = field(default_factory=list)

    @property
    def fam(self) -> Family:
        return self.info["family"]

    @property
    def ents(self) -> dict:
        return self.folder.entries

    def params_for(self, file_module: str) -> tuple[Optional[QParams], str]:
        """The config's (bits, group size) for a file module where it names one (else None: inferred from the
        shapes), and the config field it came from (for errors)."""
        entry = self.info["quantization"].get(file_module)
        if isinstance(entry, dict):
            default: QParams = self.info["default"]
            given = QParams(int(entry.get("bits", default.bits)), int(entry.get("group_size", default.group_size)))
            return given, f"quantization[{file_module!r}]"
        return None, "quantization.bits/group_size"

    def infer(self, file_module: str, k: int, w: TensorEntry, s: TensorEntry) -> QParams:
        given, fname = self.params_for(file_module)
        return _infer(f"{file_module}.weight", k, w.shape[-1], s.shape[-1], given, fname)

    def triple(self, fm: str) -> tuple[TensorEntry, ...]:
        """``(weight, scales, biases)`` of a quantized file module, or ``(weight,)`` of a plain one."""
        if f"{fm}.scales" in self.ents:
            return (
                _entry(self.folder, f"{fm}.weight"),
                _entry(self.folder, f"{fm}.scales"),
                _entry(self.folder, f"{fm}.biases"),
            )
        self.used.add(f"{fm}.weight")
        return (_entry(self.folder, f"{fm}.weight"),)


def _mlx_sources(folder: Folder, view: ModelView, info: dict) -> tuple[dict[str, Source], list[str]]:
    """Every model tensor's source in an MLX folder: the quantized modules, the experts' stacks, the plain tensors
    (with the converter's rewrites undone), in that order; and the file keys the family ignores."""
    r = _MlxRead(folder, view, info)
    r.ignored = [k for k in r.ents if any(k.startswith(p) or f".{p}" in k for p in r.fam.ignored)]
    r.used.update(r.ignored)
    sources: dict[str, Source] = {}
    _mlx_quantized_modules(r, sources)
    for pre in sorted({k.split(".switch_mlp.")[0] for k in r.ents if ".switch_mlp." in k and k not in r.ignored}):
        _mlx_expert_stacks(r, pre, sources)
    for key, e in r.ents.items():
        if key not in r.used:
            mk, src = _mlx_plain(r, key, e)
            sources[mk] = src
    return sources, r.ignored


def _mlx_quantized_modules(r: _MlxRead, sources: dict[str, Source]) -> None:
    """Quantized modules: ``<module>.weight`` (uint32) with ``<module>.scales`` and ``<module>.biases``. The experts'
    stacks are checked here and placed by :func:`_mlx_expert_stacks`."""
    ents = r.ents
    ignored_mods = {k[: -len(".scales")] for k in r.ignored if k.endswith(".scales")}
    for fm in sorted(k[: -len(".scales")] for k in ents if k.endswith(".scales")):
        wk, sk, bk = f"{fm}.weight", f"{fm}.scales", f"{fm}.biases"
        if fm in ignored_mods:
            continue
        w, s, b = _entry(r.folder, wk), _entry(r.folder, sk), _entry(r.folder, bk)
        if w.dtype != "U32":
            raise QuantMismatchError(f"{wk}: dtype {w.dtype}; MLX affine codes are U32 words")
        if s.shape != b.shape or s.shape[:-1] != w.shape[:-1]:
            raise QuantMismatchError(f"{sk} {list(s.shape)} and {bk} {list(b.shape)} do not fit {wk} {list(w.shape)}")
        r.used.update((wk, sk, bk))
        if ".switch_mlp." in fm:
            continue
        mk = r.fam.to_model_key(wk)
        if mk not in r.view.shapes:
            raise QuantMismatchError(
                f"{wk}: the quantized module {fm!r} is {mk!r} in this {r.info['model_class']}, which has no such tensor"
            )
        shape = r.view.shapes[mk][0]
        p = r.infer(fm, shape[-1], w, s)
        if tuple(w.shape[:-1]) != tuple(shape[:-1]):
            raise QuantMismatchError(f"{wk} {list(w.shape)}: the model's {mk} is {list(shape)}")
        sources[mk] = Source((wk, sk, bk), tuple(shape), _read_q([(w, s, b)], 0), p, w.nbytes + s.nbytes + b.nbytes)


def _mlx_expert_stacks(r: _MlxRead, pre: str, sources: dict[str, Source]) -> None:
    """The experts' stacks of one block: ``switch_mlp.{gate,up,down}_proj`` -> ``experts.gate_up_proj`` (gate rows
    then up rows) / ``experts.down_proj``."""
    mpre = r.fam.to_model_key(pre + ".")[:-1]
    up_key, down_key = f"{mpre}.experts.gate_up_proj", f"{mpre}.experts.down_proj"
    if up_key not in r.view.shapes or down_key not in r.view.shapes:
        raise QuantMismatchError(
            f"{pre}.switch_mlp.*: this {r.info['model_class']} has no fused experts {up_key} / {down_key}"
        )
    parts = {proj: r.triple(f"{pre}.switch_mlp.{proj}") for proj in ("gate_proj", "up_proj", "down_proj")}
    quantized = {p: len(v) == 3 for p, v in parts.items()}
    if quantized["gate_proj"] != quantized["up_proj"]:
        raise QuantMismatchError(
            f"{pre}.switch_mlp: gate_proj and up_proj are stored differently (one quantized, one not); "
            "transformers fuses them into one gate_up_proj stack"
        )
    for name, projs, mkey in (
        ("gate_up_proj", ("gate_proj", "up_proj"), up_key),
        ("down_proj", ("down_proj",), down_key),
    ):
        shape = tuple(r.view.shapes[mkey][0])
        if quantized[projs[0]]:
            sources[mkey] = _mlx_quantized_stack(r, pre, projs, mkey, shape, parts)
        else:
            ws = [parts[p][0] for p in projs]

            def read_plain(device, dtype, ws=ws, name=name):
                t = torch.cat([read_tensor(w) for w in ws], dim=1)
                return {name: t.to(dtype).to(device)}

            sources[mkey] = Source(tuple(w.key for w in ws), shape, read_plain, None, sum(w.nbytes for w in ws))


def _mlx_quantized_stack(r: _MlxRead, pre: str, projs: tuple, mkey: str, shape: tuple, parts: dict) -> Source:
    """One quantized experts' stack from its file projections (one, or gate and up fused along the rows)."""
    e_, n_, k_ = shape
    ps = []
    for proj in projs:
        w, s, _ = parts[proj]
        fm = f"{pre}.switch_mlp.{proj}"
        ps.append(r.infer(fm, k_, w, s))
        if w.shape[0] != e_:
            raise QuantMismatchError(f"{fm}.weight {list(w.shape)}: the model has {e_} experts ({mkey})")
    if len(set(ps)) > 1:
        raise QuantMismatchError(
            f"{pre}.switch_mlp: gate_proj {ps[0]} and up_proj {ps[1]} differ; transformers fuses them "
            "into one gate_up_proj stack, which takes one bits/group size"
        )
    rows = sum(parts[p][0].shape[1] for p in projs)
    if rows != n_:
        raise QuantMismatchError(f"{pre}.switch_mlp.{'+'.join(projs)}: {rows} rows, the model's {mkey} has {n_}")
    return Source(
        tuple(e.key for p in projs for e in parts[p]),
        shape,
        _read_q([parts[p] for p in projs], 1),
        ps[0],
        sum(e.nbytes for p in projs for e in parts[p]),
        note="switch_mlp stacks fused" if len(projs) > 1 else "",
    )


def _mlx_plain(r: _MlxRead, key: str, e: TensorEntry) -> tuple[str, Source]:
    """A plain (unquantized) tensor, with mlx-lm's rewrites undone: conv1d ``[C, K, 1]`` back to ``[C, 1, K]``,
    a zero-centred norm stored ``1 + w`` back to ``w``, float32 kept where the family keeps it."""
    fam = r.fam
    mk = fam.to_model_key(key)
    if mk not in r.view.shapes:
        raise QuantMismatchError(
            f"{r.folder.name}: tensor {key!r} (as {mk!r}) has no place in this {r.info['model_class']}; "
            "the checkpoint and its config.json disagree"
        )
    shape, _ = r.view.shapes[mk]
    rewrite = ""
    if fam.conv1d and key.endswith("conv1d.weight") and e.shape[-1] == 1 and len(shape) == 3 and shape[1] == 1:
        rewrite = "conv1d [C, K, 1] -> [C, 1, K]"
    elif fam.zero_centred and any(key.endswith(s) for s in fam.zero_centred) and len(e.shape) == 1:
        rewrite = "norm stored +1 -> -1"
    keep32 = any(key.endswith(s) for s in fam.keep_float32)
    want = (shape[0], shape[2], 1) if rewrite.startswith("conv1d") else shape
    if tuple(e.shape) != tuple(want):
        raise QuantMismatchError(f"{key} {list(e.shape)}: the model's {mk} is {list(shape)}")

    def read_plain(device, dtype, e=e, rewrite=rewrite, keep32=keep32, leaf=mk.rsplit(".", 1)[-1]):
        t = read_tensor(e)
        if rewrite.startswith("conv1d"):
            t = t.permute(0, 2, 1).contiguous()
        elif rewrite.startswith("norm"):
            t = t.float() - 1.0  # transformers computes x * (1 + w): mlx-lm stored 1 + w
        if t.is_floating_point():
            t = t.to(torch.float32 if keep32 else dtype)
        return {leaf: t.to(device)}

    return mk, Source((key,), tuple(shape), read_plain, None, e.nbytes, note=rewrite)


MLX_AFFINE = Format(
    name="mlx-affine",
    summary="MLX affine low-bit (mlx-lm's converter: mlx-community -4bit/-8bit folders)",
    detect=_mlx_detect,
    model_config=_mlx_model_config,
    sources=_mlx_sources,
)

FORMATS: tuple[Format, ...] = (MLX_AFFINE,)
# Every weight format mpsboost reads, one row each: the low-bit rows above (from_pretrained) and the fp8 rows
# (load_fp8). Their names are unique across both.
ROWS: tuple[Format | Fp8Format, ...] = FORMATS + FP8_FORMATS


def detect(folder: Folder) -> Format:
    """The row that recognises ``folder``; a :class:`QuantFileError` listing the rows otherwise."""
    for row in FORMATS:
        if row.detect(folder):
            return row
    raise QuantFileError(
        f"{folder.path}: no known low-bit format (known: {', '.join(f.name for f in FORMATS)}); an MLX folder has "
        "config.json with a 'quantization' field. For fp8 checkpoints use mpsboost.load_fp8"
    )


def dense_nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def quantized_nbytes(shape: tuple[int, ...], p: QParams, scale_dtype: torch.dtype) -> int:
    *lead, k = shape
    rows = math.prod(lead)
    return (
        rows * codec.packed_width(k, p.bits) * 4
        + 2 * rows * (k // p.group_size) * torch.empty((), dtype=scale_dtype).element_size()
    )
