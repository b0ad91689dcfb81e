"""Decode-step costs for the tests: ``mpsboost.bench.decode_cost`` of a patched model, the tiny model's counted in a
moment and the medium model's (Qwen3.6's widths) once per worker (:class:`MediumModel`, the ``medium`` fixture of
tests/conftest.py), and the targets the recipes' issues set on them, shared by each recipe's tiny tests and
tests/integration/test_medium_size.py."""

from __future__ import annotations

import copy

import torch

import mpsboost
from mpsboost.bench.decode_cost import build, decode_cost
from mpsboost.gate import Env

MAC = Env.simulate("mps", "2.15.0")


def _counted(m: torch.nn.Module, patches: tuple[dict, ...]) -> dict:
    report = None
    for kw in patches:
        report = mpsboost.patch(m, **kw)
    return dict(decode_cost(m), rows=[(r.recipe, r.status) for r in report.rows] if report else [])


def tiny_cost(*patches: dict) -> dict:
    """``decode_cost`` of the tiny model patched by ``mpsboost.patch(m, **kw)`` for each ``kw`` of ``patches`` in turn,
    with ``"rows"``: the ``(recipe, status)`` of each row of the last patch's report."""
    return _counted(build("tiny"), patches)


class MediumModel:
    """The decode-cost tool's ``medium`` model (Qwen3.6's widths in bf16: ``build("medium")``), built once, and the
    cost of one decode step of its patched copies, each counted once (about 6 s to build on the CPU).

    A copy shares the base's tensors (new module and parameter objects over the same storage): a patch replaces a
    copy's tensors and never writes into them, and :meth:`cost` checks that it didn't, by the version counters the
    copies share with the base (an in-place write bumps them). A deep copy would write 1.1 GB of fresh pages per
    copy, much of this file's system time on Linux."""

    def __init__(self) -> None:
        self._base = None
        self._costs: dict[str, dict] = {}

    def copy(self) -> torch.nn.Module:
        """A fresh copy of the unpatched model (``build`` seeds itself: the same weights every build) over the
        base's tensors; write into them and :meth:`cost` fails."""
        if self._base is None:
            self._base = build("medium")
        memo: dict = {}
        for t in [*self._base.parameters(), *self._base.buffers()]:
            # detach() shares the version counter (Parameter() of .data would not).
            shared = t.detach()
            memo[id(t)] = torch.nn.Parameter(shared, t.requires_grad) if isinstance(t, torch.nn.Parameter) else shared
        return copy.deepcopy(self._base, memo)

    def versions(self) -> list[int]:
        return [t._version for t in [*self._base.parameters(), *self._base.buffers()]]

    def cost(self, *patches: dict) -> dict:
        """As :func:`tiny_cost`, of a copy of the medium model."""
        key = repr(patches)
        if key not in self._costs:
            model = self.copy()
            before = self.versions()
            self._costs[key] = _counted(model, patches)
            assert self.versions() == before, f"{key}: a patch or the decode step wrote into the model's weights"
        return copy.deepcopy(self._costs[key])


# Low-bit weights (issue 36): ops at most 1.05x patched bf16's, bytes at most 0.33x at 4 bits and 0.6x at 8 bits.
LOW_BIT_BYTES = {4: 0.33, 8: 0.6}
LOW_BIT_OPS = 1.05


def _total(c: dict) -> tuple[int, int]:
    return sum(c["ops"].values()), sum(c["bytes"].values())


def low_bit_targets(size: str, tv: str, cost) -> None:
    """The low-bit step (low_bit_weights first, then the default patch, as a Mac user's load does) against the patched
    bf16 step under Mac ``tv`` decisions; the attention step applies over the low-bit projections. ``cost``:
    :func:`tiny_cost` or :meth:`MediumModel.cost`."""
    env = Env.simulate("mps", tv)
    ops_bf16, bytes_bf16 = _total(cost({"device": env}))
    group = 32 if size == "tiny" else 64
    for bits, share in LOW_BIT_BYTES.items():
        low_bit = {
            "device": env,
            "recipes": ["low_bit_weights"],
            "options": {"low_bit_weights": {"bits": bits, "group_size": group}},
        }
        c = cost(low_bit, {"device": env})
        rows = [status for recipe, status in c["rows"] if recipe == "attention_decode"]
        assert rows and all(status == "applied" for status in rows), c["rows"]
        ops, moved = _total(c)
        assert ops <= LOW_BIT_OPS * ops_bf16, (bits, ops, ops_bf16)
        assert moved <= share * bytes_bf16, (bits, moved / bytes_bf16)


def fp8_costs(cost, exclude=()) -> dict:
    """``{"bf16": ..., "fp8": ...}``: ``cost`` of the default patch under Mac 2.15.0 decisions, without and with
    ``fp8="rowwise"`` (``exclude``: recipes left out of both)."""
    skip = {"exclude": list(exclude)} if exclude else {}
    return {label: cost(dict(device=MAC, **skip, **kw)) for label, kw in (("bf16", {}), ("fp8", {"fp8": "rowwise"}))}


def fp8_ratio(c: dict, what: str, blocks=None) -> float:
    """fp8's ``what`` (``"ops"`` or ``"bytes"``) over bf16's, in ``blocks`` (default all) of :func:`fp8_costs`."""

    def total(x):
        return sum(v for b, v in x[what].items() if blocks is None or b in blocks)

    return total(c["fp8"]) / total(c["bf16"])
