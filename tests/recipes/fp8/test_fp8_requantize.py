"""``load_fp8(..., requantize="rowwise")``: a block-scaled file (Qwen3.6-FP8's 128x128 ``weight_scale_inv``)
requantised to one scale per output row while it is read. Lossy, within its stated bound against the file's exact
dequantisation; it unlocks the rowwise decode paths (MPS 2.15's few-rows scaled_mm)."""

from __future__ import annotations

import pytest
import torch

import mpsboost
from mpsboost.gate import Env
from mpsboost.ops import fp8 as fp8_ops
from test_fp8_qwen36 import BLOCK, PREFIX, _logits, _meta_model, _reference, dequant_block, write_qwen36_fp8

MAC = Env.simulate("mps", "2.15.0")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    f = tmp_path_factory.mktemp("qwen36rq") / "Qwen3.6-FP8-tiny"
    return f, write_qwen36_fp8(f)


@pytest.mark.parametrize(
    "bad, exc", [(1, TypeError), (True, TypeError), ("block", ValueError), ("Rowwise", ValueError)]
)
def test_bad_requantize_values_are_refused_before_anything_is_read(bad, exc, tmp_path):
    with pytest.raises(exc, match="requantize"):
        mpsboost.load_fp8(_meta_model(), tmp_path / "absent", requantize=bad)


def _file_exact(folder, key):
    """The file's exact dequantisation (code x block scale in float32) of one fp8 weight."""
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return dequant_block(f.get_tensor(key), f.get_tensor(key + "_scale_inv"))


def _within_half_a_step(got: torch.Tensor, exact: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
    # Normal range: half an e4m3 step is 2^-4 of the magnitude; subnormal: row_scale * 2^-10. (Plus float32 slack.)
    bound = exact.abs() * 2.0**-4 + row_scale * 2.0**-10 + 1e-12
    return ((got - exact).abs() <= bound).all()


def test_requantised_layers_are_rowwise_within_half_an_e4m3_step_of_the_file(folder):
    path, ref_state = folder
    model = _meta_model()
    report = mpsboost.load_fp8(model, path, device=MAC, requantize="rowwise")
    rows = {r.target: r for r in report.rows if r.recipe == "fp8_weights" and r.status == "applied"}
    assert rows and {r.details["granularity"] for r in rows.values()} == {"rowwise"}
    assert {r.details["requantized_from"] for r in rows.values()} == {f"block {BLOCK[0]}x{BLOCK[1]}"}
    assert all("requantised at load from 128x128 block scales" in r.reason for r in rows.values())
    qkv = rows["model.layers.0.linear_attn.in_proj_qkv"]
    assert qkv.backing.startswith("fp8 GEMV (mpsboost's Metal kernel")
    assert "Metal fp8 grouped GEMV" in rows["model.layers.0.mlp.experts"].backing
    # Dense layer: codes and scales against the file's exact values.
    lin = model.model.layers[0].linear_attn.in_proj_qkv
    assert lin.weight_scale.shape == (lin.weight.shape[0], 1)
    exact = _file_exact(path, PREFIX + "layers.0.linear_attn.in_proj_qkv.weight")
    got = fp8_ops.dequantize(lin.weight, lin.weight_scale, torch.float32)
    assert _within_half_a_step(got, exact, lin.weight_scale)
    assert not torch.equal(got, exact)  # lossy: the 128x128 scales are gone
    # Experts: every expert's gate and up rows, and the down projection.
    ex = model.model.layers[0].mlp.experts
    inter = ex.down_proj.shape[-1]
    for e in range(ex.gate_up_proj.shape[0]):
        base = PREFIX + f"layers.0.mlp.experts.{e}."
        want_up = torch.cat([_file_exact(path, base + "gate_proj.weight"), _file_exact(path, base + "up_proj.weight")])
        got_up = fp8_ops.dequantize(ex.gate_up_proj[e], ex.gate_up_proj_scale[e], torch.float32)
        assert got_up.shape == (2 * inter, want_up.shape[1])
        assert _within_half_a_step(got_up, want_up, ex.gate_up_proj_scale[e])
        got_down = fp8_ops.dequantize(ex.down_proj[e], ex.down_proj_scale[e], torch.float32)
        assert _within_half_a_step(got_down, _file_exact(path, base + "down_proj.weight"), ex.down_proj_scale[e])
    # Logits against the stock model holding the file's exact dequantisation (prefill rows: the layers
    # dequantise, so this is the requantisation alone): no worse than quantising those exact weights afresh
    # with patch(fp8="rowwise"), the bound docs/fp8-checkpoints.md states (20.6 vs 18.0 dB on this random
    # 4-layer model, whose untrained layers amplify every rounding).
    want = _logits(_reference(ref_state))
    fresh = _reference(ref_state)
    mpsboost.patch(fresh, fp8="rowwise", device=MAC)
    got_db, fresh_db = fp8_ops.sqnr_db(_logits(model), want), fp8_ops.sqnr_db(_logits(fresh), want)
    assert got_db >= fresh_db, (got_db, fresh_db)


def test_without_requantize_block_scales_stay_exact(folder):
    path, _ = folder
    model = _meta_model()
    report = mpsboost.load_fp8(model, path, device=MAC)
    rows = [r for r in report.rows if r.recipe == "fp8_weights" and r.status == "applied"]
    assert rows and {r.details["granularity"] for r in rows} == {"block"}
    assert all("requantized_from" not in r.details for r in rows)
