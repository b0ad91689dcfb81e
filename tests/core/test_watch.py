"""Watch: the host-side check the eager decode recipes make before reusing constants derived from weights.

Each case changes a model the way users and libraries do, and the watch must see it; a whole patched
Qwen3.5-MoE given new weights after patch() must then decode what stock decodes with them."""

from __future__ import annotations

import copy

import pytest
import torch

import mpsboost
from mpsboost.gate import Env
from mpsboost.recipes._watch import Watch
from tiny_models import gated_deltanet_lm


def _layer():
    m = torch.nn.Module()
    m.proj = torch.nn.Linear(8, 4, bias=False)
    m.register_buffer("scale", torch.ones(4))
    m.A_log = torch.nn.Parameter(torch.zeros(4))
    return m


PATHS = [("proj", "weight"), ("proj", "bias"), ("scale",), ("A_log",), ("missing",)]


def _changes():
    def write(m):
        with torch.no_grad():
            m.proj.weight.add_(1.0)  # in place: the version counter moves

    def load(m):
        m.load_state_dict({k: torch.randn_like(v) for k, v in m.state_dict().items()})

    def new_param(m):
        m.A_log = torch.nn.Parameter(torch.zeros(4))

    def new_module(m):
        m.proj = torch.nn.Linear(8, 4, bias=False)

    def add_bias(m):
        m.proj.bias = torch.nn.Parameter(torch.zeros(4))

    def add_missing(m):
        m.missing = torch.zeros(1)

    def move(m):
        m.double()

    def new_buffer(m):
        m.scale = torch.zeros(4)

    return [write, load, new_param, new_module, add_bias, add_missing, move, new_buffer]


def test_fresh_until_something_changes():
    m = _layer()
    w = Watch(m, PATHS)
    assert w.fresh()
    m.proj(torch.randn(2, 8))  # reading is no change
    assert w.fresh()


@pytest.mark.parametrize("change", _changes(), ids=lambda f: f.__name__)
def test_sees_every_kind_of_change(change):
    m = _layer()
    w = Watch(m, PATHS)
    change(m)
    assert not w.fresh()


def test_a_deep_copy_is_not_fresh_for_the_copy():
    m = _layer()
    m.__dict__["_w"] = Watch(m, PATHS)  # as a recipe keeps it: on the instance
    c = copy.deepcopy(m)
    assert m.__dict__["_w"].fresh() and not c.__dict__["_w"].fresh()


@pytest.mark.parametrize("env", ["2.15.0", "2.14.1"])
def test_new_weights_after_patch_decode_as_stock(env):
    # load_state_dict after patch(): every decode recipe (linear_attention, attention_decode, moe_block,
    # rms_norm) rebuilds what it derived, and the decode logits equal stock's with the new weights.
    stock, patched = gated_deltanet_lm("qwen3_5_moe"), gated_deltanet_lm("qwen3_5_moe")
    patched.load_state_dict(stock.state_dict())
    report = mpsboost.patch(patched, device=Env.simulate("mps", env))
    applied = {r.recipe for r in report.applied}
    assert {"linear_attention", "attention_decode", "moe_block", "rms_norm"} <= applied
    ids = torch.randint(3, stock.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(5))

    def decode(m):
        with torch.no_grad():
            out = m(ids, use_cache=True)
            past, nxt, logits = out.past_key_values, out.logits[:, -1:].argmax(-1), []
            for _ in range(3):
                out = m(nxt, past_key_values=past, use_cache=True)
                past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
                logits.append(out.logits)
        return torch.cat(logits, 1)

    decode(patched)  # the derived constants exist now
    g = torch.Generator().manual_seed(9)
    new = {k: torch.randn(v.shape, generator=g) * 0.2 for k, v in stock.state_dict().items()}
    stock.load_state_dict(new)
    patched.load_state_dict(new)
    torch.testing.assert_close(decode(patched), decode(stock), rtol=1e-5, atol=1e-5)
