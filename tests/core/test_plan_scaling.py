"""``plan()``'s walk over a model grows with the model, not with its square: counted, not timed.

Every recipe's ``find`` walks the model's modules, and some walk below each match. A walk that, for every module,
walks a match again (attention_split once searched its covering model's modules for each module) grows with the
square of the model's size. The count here is of modules handed out by ``Module.named_modules`` (which ``modules()``
calls too) during one ``plan()`` of the tests' tiny Qwen3 at 4 and at 8 layers: twice the layers may cost twice the
visits plus a constant, not four times.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import mpsboost
from mpsboost.gate import Env

pytest.importorskip("transformers")


def _qwen3(layers: int) -> torch.nn.Module:
    from mpsboost.bench import models

    return models.build(models.ZOO["qwen3"], num_hidden_layers=layers).eval()  # the tests' tiny Qwen3


def _visits(model: torch.nn.Module, monkeypatch, env: Env) -> int:
    count = [0]
    real = torch.nn.Module.named_modules

    def counted(self, *args, **kwargs):
        for item in real(self, *args, **kwargs):
            count[0] += 1
            yield item

    with monkeypatch.context() as m:
        m.setattr(torch.nn.Module, "named_modules", counted)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = mpsboost.plan(model, env=env)
    assert report.recipes("would apply"), report  # a real plan, with matches below the model
    return count[0]


@pytest.mark.parametrize("env", ["mps-2.15.0", "cpu"])
def test_plan_visits_grow_linearly_with_the_layers(env, monkeypatch):
    sim = Env.simulate("mps", "2.15.0") if env.startswith("mps") else Env.simulate("cpu")
    small, large = (_visits(_qwen3(n), monkeypatch, sim) for n in (4, 8))
    modules = sum(1 for _ in _qwen3(4).modules())  # in the message: visits per module
    # Linear: each extra layer costs what a layer of the small model costs (seen: 1.95x). 2.2x leaves room for the
    # constant part; one more walk of the model per covered module (mutation attention-split-walk-per-module) 3.0x.
    assert large <= 2.2 * small, (small, large, modules)
