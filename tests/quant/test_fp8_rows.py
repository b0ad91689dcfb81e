"""The fp8 formats are rows of the quantized-weights package, read through its one file reader.

Each row's file is written here with ``safetensors`` itself from a tiny ``nn.Linear``, following the format's own
key and scale layout; the row must recognise it (and only the rows the order puts after it may also claim it), name
its scale key, read its scale layout, ignore what the format says a weight-only forward does not use, and load it:
the loaded layer's output against ``F.linear`` on the weight dequantised by hand (code x scale in float32).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import mpsboost
from mpsboost.errors import Fp8FileError, QuantFileError
from mpsboost.quant import fp8_formats as rows
from mpsboost.quant import io
from mpsboost.quant.fp8_plan import plan_load

FP8 = torch.float8_e4m3fn
N, K, BLOCK = 32, 48, (16, 16)
SRC = Path(mpsboost.__file__).parent
# Stock F.linear on the hand-dequantised weight vs the fp8 layer's forward: the same float32 products.
RTOL = ATOL = 1e-5


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(K, N)

    def forward(self, x):
        return self.l(x)


def _save(path: Path, tensors: dict, *, config: dict | None = None, metadata: dict | None = None) -> Path:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    if config is not None:
        (path.parent / "config.json").write_text(json.dumps(config))
    return path


def _rowwise(w):
    s = (w.abs().amax(dim=1, keepdim=True) / 448.0).clamp_min(1e-12)
    return (w / s).clamp(-448, 448).to(FP8), s


def _tensorwise(w):
    s = (w.abs().max() / 448.0).clamp_min(1e-12)
    return (w / s).clamp(-448, 448).to(FP8), s


def _blockwise(w):
    bn, bk = BLOCK
    s = torch.empty(-(-N // bn), -(-K // bk))
    per = torch.empty_like(w)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk]
            s[i, j] = max(blk.abs().max().item(), 1e-12) / 448.0
            per[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = s[i, j]
    return (w / per).clamp(-448, 448).to(FP8), s, per


# Each writer: (path, weight dequantised by hand, scale key, scale scheme, tensors the row ignores).
def _write_mpsboost(folder: Path, w, b):
    q, s = _rowwise(w)
    meta = {
        "format": "mpsboost.fp8",
        "format_version": "2",
        "modules": json.dumps({"l": {"kind": "linear", "granularity": "rowwise"}}),
    }
    path = _save(folder / "model.fp8.safetensors", {"l.weight": q, "l.weight_scale": s, "l.bias": b}, metadata=meta)
    return path, q.float() * s, "l.weight_scale", "rowwise", ()


def _write_transformers_fp8(folder: Path, w, b):
    q, s, per = _blockwise(w)
    cfg = {"quantization_config": {"quant_method": "fp8", "weight_block_size": list(BLOCK)}}
    tensors = {"l.weight": q, "l.weight_scale_inv": s, "l.bias": b, "l.input_scale": torch.ones(())}
    path = _save(folder / "model.safetensors", tensors, config=cfg)
    return path.parent, q.float() * per, "l.weight_scale_inv", "block", ("l.input_scale",)


def _write_compressed_tensors(folder: Path, w, b):
    q, s = _rowwise(w)
    weights = {"type": "float", "num_bits": 8, "strategy": "channel"}
    cfg = {
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {"group_0": {"weights": weights}},
        }
    }
    tensors = {"l.weight": q, "l.weight_scale": s, "l.bias": b, "l.input_scale": torch.ones(1)}
    path = _save(folder / "model.safetensors", tensors, config=cfg)
    return path.parent, q.float() * s, "l.weight_scale", "rowwise", ("l.input_scale",)


def _write_scaled_fp8(folder: Path, w, b):
    q, s = _tensorwise(w)
    tensors = {
        "scaled_fp8": torch.empty(0, dtype=FP8),
        "l.weight": q,
        "l.scale_weight": s,
        "l.bias": b,
        "l.scale_input": torch.ones(()),
    }
    path = _save(folder / "tiny_fp8_scaled.safetensors", tensors)
    return path, q.float() * s, "l.scale_weight", "tensorwise", ("l.scale_input",)


WRITERS = {
    "mpsboost": _write_mpsboost,
    "transformers-fp8": _write_transformers_fp8,
    "compressed-tensors": _write_compressed_tensors,
    "scaled_fp8": _write_scaled_fp8,
}
# Which rows recognise each row's file, in FP8_FORMATS' order: detection takes the first. mpsboost's own files
# carry '*.weight_scale' tensors too (compressed-tensors' names): their metadata, asked first, decides.
CLAIMED = {
    "mpsboost": ["mpsboost", "compressed-tensors"],
    "transformers-fp8": ["transformers-fp8"],
    "compressed-tensors": ["compressed-tensors"],
    "scaled_fp8": ["scaled_fp8"],
}


def _weights():
    ref = Tiny()
    return ref.l.weight.detach().float().clone(), ref.l.bias.detach().float().clone()


# ------------------------------------------------------------------------------------------ one table


def test_every_fp8_format_is_a_row_of_the_quant_package():
    from mpsboost.quant.formats import FORMATS as LOW_BIT, MLX_AFFINE, ROWS
    from mpsboost.recipes.fp8 import formats as fp8_formats

    assert rows.FP8_FORMATS == (rows.MPSBOOST, rows.TRANSFORMERS_FP8, rows.COMPRESSED_TENSORS, rows.SCALED_FP8)
    assert [r.name for r in ROWS] == ["mlx-affine", "mpsboost", "transformers-fp8", "compressed-tensors", "scaled_fp8"]
    assert ROWS[0] is MLX_AFFINE and ROWS == LOW_BIT + rows.FP8_FORMATS
    assert all(isinstance(r, rows.Fp8Format) for r in ROWS[1:])
    # The names the fp8 code has always exported are the rows' names, in detection order.
    assert fp8_formats.FORMATS == rows.FORMATS == tuple(WRITERS) == tuple(r.name for r in rows.FP8_FORMATS)
    assert all(rows.row(name).name == name for name in rows.FORMATS)
    with pytest.raises(ValueError, match="no fp8 format 'gguf'; the formats are mpsboost, transformers-fp8"):
        rows.row("gguf")
    with pytest.raises(dataclasses.FrozenInstanceError):
        rows.SCALED_FP8.scale_suffix = "_scale"


def test_each_row_names_its_scale_key():
    assert rows.MPSBOOST.scale_key("a.weight") == "a.weight_scale"
    assert rows.MPSBOOST.scale_key("e.gate_up_proj") == "e.gate_up_proj_scale"
    assert rows.TRANSFORMERS_FP8.scale_key("a.weight") == "a.weight_scale_inv"
    assert rows.COMPRESSED_TENSORS.scale_key("a.weight") == "a.weight_scale"
    assert rows.SCALED_FP8.scale_key("blocks.0.ffn.0.weight") == "blocks.0.ffn.0.scale_weight"
    assert rows.SCALED_FP8.scale_key("e.gate_up_proj") == "e.gate_up_proj_scale_weight"


# ------------------------------------------------------------------------------------------ one reader


def test_fp8_reads_through_the_one_file_reader():
    from mpsboost.recipes.fp8 import formats as fp8_formats

    assert fp8_formats.read_tensor is io.read_tensor
    assert fp8_formats.TensorEntry is io.TensorEntry
    assert fp8_formats.ST_DTYPES is io.ST_DTYPES and fp8_formats.TORCH_TO_ST is io.TORCH_TO_ST
    for name in fp8_formats.__all__:
        assert getattr(fp8_formats, name) is not None, name
    # The old fp8 module only re-exports: it defines no function or class of its own.
    tree = ast.parse((SRC / "recipes" / "fp8" / "formats.py").read_text())
    defined = [n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    assert defined == []
    # A safetensors header's 8-byte length is unpacked in one file of the package: quant/io.py.
    unpacking = sorted(
        str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if 'struct.unpack("<Q"' in p.read_text(encoding="utf-8")
    )
    assert unpacking == ["quant/io.py"]


def test_fp8_file_errors_are_quant_file_errors(tmp_path):
    assert issubclass(Fp8FileError, QuantFileError) and issubclass(QuantFileError, ValueError)
    w, b = _weights()
    path, *_ = _write_scaled_fp8(tmp_path / "ok", w, b)
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(path.read_bytes()[:-7])
    # Read as an fp8 checkpoint: the fp8 error (both except clauses catch it).
    with pytest.raises(Fp8FileError, match="cut.safetensors: the header describes .* bytes but the file has"):
        rows.open_checkpoint(cut)
    # Read as any checkpoint (the low-bit loader's layout): a QuantFileError that is not the fp8 one.
    with pytest.raises(QuantFileError, match="truncated or padded") as info:
        io.open_folder(cut)
    assert not isinstance(info.value, Fp8FileError)
    with pytest.raises(FileNotFoundError, match="fp8 checkpoint .*nope.safetensors.* does not exist"):
        rows.open_checkpoint(tmp_path / "nope.safetensors")


# ------------------------------------------------------------------------------------------ detection and loading


@pytest.mark.parametrize("name", list(WRITERS))
def test_each_row_detects_plans_and_loads_its_file(tmp_path, name, rng_seed):
    w, b = _weights()
    path, deq, scale_key, scheme, ignored = WRITERS[name](tmp_path / name, w, b)
    ckpt = rows.open_checkpoint(path)
    assert ckpt.row is rows.row(name) and ckpt.format == name
    assert [r.name for r in rows.FP8_FORMATS if r.detect(ckpt)] == CLAIMED[name]
    with torch.device("meta"):
        model = Tiny()
    plan = plan_load(model, ckpt)
    assert plan.problems == []
    (qt,) = plan.quant
    assert [(p.codes, p.scale) for p in qt.parts] == [("l.weight", scale_key)]
    assert qt.scheme == scheme and qt.block == (BLOCK if scheme == "block" else None)
    assert [g.source for g in plan.plain] == ["l.bias"]
    # What the row ignores (activation scales, the marker) is neither loaded nor a problem.
    assert set(ckpt.entries) - {"l.weight", scale_key, "l.bias"} == set(ignored) | set(ckpt.row.markers)
    mpsboost.load_fp8(model, path, device="cpu")
    x = torch.randn(5, K)
    torch.testing.assert_close(model(x), F.linear(x, deq, b), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", ["transformers-fp8", "compressed-tensors"])
def test_rows_detect_from_tensor_names_without_a_config(tmp_path, name):
    w, b = _weights()
    folder, *_ = WRITERS[name](tmp_path / name, w, b)
    (folder / "config.json").unlink()
    ckpt = rows.open_checkpoint(folder)
    assert ckpt.format == name
    # transformers-fp8 without a config: block scales of transformers' default size, checked against each shape.
    assert ckpt.info["block"] == ("infer" if name == "transformers-fp8" else None)


def _bad_files(tmp: Path, w, b):
    q, s = _rowwise(w)
    yield (
        "fp8 without a scale layout",
        _save(tmp / "a.safetensors", {"l.weight": q, "l.scales": s}),
        "holds 1 float8 tensor(s) (e.g. 'l.weight') but none of the scale layouts mpsboost reads",
    )
    yield (
        "no fp8 at all",
        _save(tmp / "b.safetensors", {"l.weight": w, "l.bias": b}),
        "is not an fp8 checkpoint: no float8 tensors and none of the markers of mpsboost, transformers-fp8, "
        "compressed-tensors, scaled_fp8",
    )
    meta = {"format": "mpsboost.fp8", "format_version": "1"}
    yield (
        "mpsboost version 1",
        _save(tmp / "c.safetensors", {"l.weight": q, "l.weight_scale": s}, metadata=meta),
        "has mpsboost fp8 format version '1'; this mpsboost reads '2'",
    )
    cfg = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [0, 16]}}
    yield (
        "transformers-fp8 block",
        _save(tmp / "d" / "model.safetensors", {"l.weight": q, "l.weight_scale_inv": s}, config=cfg).parent,
        "weight_block_size=[0, 16]; expected two positive ints",
    )
    cfg = {"quantization_config": {"quant_method": "fp8"}}
    yield (
        "transformers-fp8 without scales",
        _save(tmp / "e" / "model.safetensors", {"l.weight": q, "l.weight_scale": s}, config=cfg).parent,
        "transformers-fp8 checkpoint (quant_method 'fp8') without any '*.weight_scale_inv' tensor",
    )
    cfg = {"quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized"}}
    yield (
        "compressed-tensors int4",
        _save(tmp / "f" / "model.safetensors", {"l.weight": q, "l.weight_scale": s}, config=cfg).parent,
        "compressed-tensors format 'pack-quantized'; mpsboost reads 'float-quantized'",
    )
    yield (
        "scaled_fp8 without scales",
        _save(tmp / "g.safetensors", {"scaled_fp8": torch.empty(0, dtype=FP8), "l.weight": q}),
        "scaled_fp8 marker present but no '*.scale_weight' tensor: partial file",
    )


def test_what_no_row_reads_is_an_fp8_file_error(tmp_path):
    w, b = _weights()
    cases = list(_bad_files(tmp_path, w, b))
    assert len(cases) == 7
    for what, path, message in cases:
        with pytest.raises(Fp8FileError) as info:
            rows.open_checkpoint(path)
        assert message in str(info.value), (what, str(info.value))
        assert isinstance(info.value, QuantFileError), what


# ------------------------------------------------------------------------------------------ scale decoding


def test_ue8m0_scales_decode_exactly(tmp_path):
    raw = torch.tensor([0, 1, 100, 126, 127, 128, 200, 254, 255], dtype=torch.uint8)
    path = _save(tmp_path / "s.safetensors", {"s": raw.view(torch.float8_e8m0fnu)})
    entry = io.open_folder(path).entries["s"]
    assert entry.dtype == "F8_E8M0"
    got = rows.scale_to_float32(entry)
    want = torch.tensor([math.ldexp(1.0, int(e) - 127) for e in raw[:-1]], dtype=torch.float64).float()
    assert got.dtype == torch.float32 and torch.equal(got[:-1], want) and torch.isnan(got[-1])


def test_scale_layouts_per_tensor_row_and_block():
    assert rows.entry_scheme((N, K), (), None) == "tensorwise"
    assert rows.entry_scheme((N, K), (1,), None) == "tensorwise"
    assert rows.entry_scheme((N, K), (N, 1), None) == "rowwise"
    assert rows.entry_scheme((N, K), (N,), None) == "rowwise"
    assert rows.entry_scheme((N, K), (2, 3), BLOCK) == "block"
    assert rows.entry_scheme((N, K), (2, 3), None) is None
    assert rows.entry_scheme((4, N, K), (4, 1, 1), None) == "tensorwise"
    assert rows.entry_scheme((4, N, K), (4, N, 1), None) == "rowwise"
    with pytest.raises(Fp8FileError, match="a scale tensor has dtype I32"):
        rows.scale_to_float32(io.TensorEntry("s", Path("x.safetensors"), "I32", (1,), 0, 4))
