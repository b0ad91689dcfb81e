"""No recipe makes two of the model's tensors share a storage the model does not declare tied.

transformers (and accelerate, safetensors) dedup a model's tensors by storage: ``save_pretrained`` groups
the state_dict by :func:`transformers.pytorch_utils.id_tensor_storage` and checks every group of more than
one name against the model's tie configuration (``_tied_weights_keys``, expanded in
``all_tied_weights_keys``). A recipe that fused projections by making the Parameters views of one new
storage showed up there as a tie that is not in the model. This test uses transformers' own helpers, on the
families whose layers the decode recipes patch, under Mac decisions (2.15 and 2.14) and natively.
"""

from __future__ import annotations

import collections

import pytest
import torch

import mpsboost
from mpsboost.gate import Env

import tiny_models as tm

pytest.importorskip("transformers")

ENVS = {"mps-2.15.0": Env.simulate("mps", "2.15.0"), "mps-2.14.1": Env.simulate("mps", "2.14.1"), "native": None}
MODELS = ["qwen3_5_moe", "qwen3_5", "qwen3_next", "olmo_hybrid", "qwen3_moe", "llama"]


def _build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    m = tm.gated_deltanet_lm(name) if name in ("qwen3_5_moe", "qwen3_5", "qwen3_next", "olmo_hybrid") else None
    if m is None:
        return tm.build(name)
    return m.eval()


def _storage_groups(model: torch.nn.Module) -> list[list[str]]:
    """The state_dict's names grouped by storage, as ``remove_tied_weights_from_state_dict`` (what
    ``save_pretrained`` calls) groups them; only groups of more than one name."""
    from transformers.pytorch_utils import id_tensor_storage

    ptrs = collections.defaultdict(list)
    for name, t in model.state_dict().items():
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            ptrs[id_tensor_storage(t)].append(name)
    return [sorted(names) for names in ptrs.values() if len(names) > 1]


def _undeclared(model: torch.nn.Module) -> list[list[str]]:
    """Storage groups the tie configuration does not name: a declared group is one source and targets that
    ``all_tied_weights_keys`` maps to that source."""
    tied = dict(getattr(model, "all_tied_weights_keys", None) or model.get_expanded_tied_weights_keys())
    bad = []
    for names in _storage_groups(model):
        sources = {tied.get(n, n) for n in names}
        if len(sources) != 1 or next(iter(sources)) not in names:
            bad.append(names)
    return bad


@pytest.mark.parametrize("env", list(ENVS))
@pytest.mark.parametrize("name", MODELS)
def test_patched_model_shows_no_tie_it_does_not_declare(name, env, tmp_path):
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    model = _build(name)
    assert _undeclared(model) == [], "the stock model already shares storage it does not declare"
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    report = mpsboost.patch(model, device=ENVS[env]) if ENVS[env] is not None else mpsboost.patch(model)
    assert report.applied, f"nothing applied on {name} ({env}): the test would not test a recipe"
    assert _undeclared(model) == []
    # transformers' own save-time check agrees (it raises on shared tensors it cannot place)
    remove_tied_weights_from_state_dict(dict(model.state_dict()), model)

    model.save_pretrained(tmp_path)
    back = type(model).from_pretrained(tmp_path).eval()
    got, now = back.state_dict(), model.state_dict()
    assert got.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=0, atol=0, msg=f"{k} after the round trip")
        torch.testing.assert_close(now[k], ref[k], rtol=0, atol=0, msg=f"{k} of the patched model")
    assert _undeclared(back) == []
    mpsboost.unpatch(model)
    assert _undeclared(model) == []
