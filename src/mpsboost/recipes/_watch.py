"""Whether the tensors a recipe derived its eager constants from are still where and as they were.

The eager decode steps keep constants derived from a layer's weights (transposed views, side-by-side
products, norm weights). They must be rebuilt when a weight is replaced (a new Parameter or submodule),
moved (``model.to(...)`` swaps ``param.data``: a new data pointer) or written to in place
(``load_state_dict`` copies into it: its version counter moves). Building a tuple of that metadata through
``nn.Module.__getattr__`` on every call cost 20-45 us of host time per layer and step (measured on CPU,
``../shared/tools``-style host timing of a tiny Qwen3.5-MoE decode step): as much as 5-10 aten ops, on a
step the recipes bring to 24-31 ops.

A :class:`Watch` resolves the attribute paths once, when the constants are built, and remembers which
dictionary of which module held each hop. :meth:`Watch.fresh` then checks identity of every hop (a plain
``dict.get`` and ``is``) and the data pointer, version, dtype and device of every tensor: host-side
metadata only, no aten op, no device synchronisation. It never runs inside traced code.

What it cannot see: a write through ``.data`` (``weight.data += delta``, PEFT's default LoRA merge;
``weight.data.mul_(...)``, ``.copy_``). ``.data`` is an alias of the same memory with a version counter of its
own, so the Parameter's version and data pointer stay as they were, and nothing host-side records the write.
The recipes therefore derive no copy where a view of the weight works (an in-place edit is then read by the
next step); the few constants that must be copies (a negation, an exponential, ``1 + w``, a weight repeated per
head) are made again at every call of more than one token (each prompt). What remains is in
``docs/known-gaps.md``.

What it holds: the modules and tensors the constants were derived from, which the constants reference
anyway, on the layer's own state (an instance attribute): nothing outside the model's object graph.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch

_DICTS = ("_parameters", "_buffers", "_modules")


def _holder(obj: Any, name: str) -> tuple[dict | None, Any]:
    """The dictionary that holds ``obj.name`` and the value there; ``(None, None)`` where it is absent."""
    if isinstance(obj, torch.nn.Module):
        for attr in _DICTS:
            d = obj.__dict__.get(attr)
            if d is not None and name in d:
                return d, d[name]
    d = getattr(obj, "__dict__", None)
    if d is not None and name in d:
        return d, d[name]
    return None, None


class Watch:
    """Resolved attribute paths below one module, checked cheaply on every call (see the module docs)."""

    __slots__ = ("_hops", "_absent", "_tensors")

    def __init__(self, root: torch.nn.Module, paths: Iterable[Sequence[str]]):
        hops: list[tuple[dict, str, Any]] = []
        absent: list[tuple[Any, str]] = []
        tensors: list[tuple[torch.Tensor, int, int, torch.dtype, torch.device]] = []
        seen_hops: set[tuple[int, str]] = set()
        seen_t: set[int] = set()
        for path in paths:
            obj: Any = root
            for name in path:
                d, val = _holder(obj, name)
                if d is None:
                    absent.append((obj, name))
                    obj = None
                    break
                if (id(d), name) not in seen_hops:
                    seen_hops.add((id(d), name))
                    hops.append((d, name, val))
                obj = val
            if isinstance(obj, torch.Tensor) and id(obj) not in seen_t:
                seen_t.add(id(obj))
                tensors.append((obj, obj.data_ptr(), obj._version, obj.dtype, obj.device))
        self._hops = tuple(hops)
        self._absent = tuple(absent)
        self._tensors = tuple(tensors)

    def fresh(self) -> bool:
        """Every hop still holds the same object, every absent name is still absent, and every tensor has
        the data pointer, version, dtype and device it had."""
        for d, name, val in self._hops:
            if d.get(name, d) is not val:
                return False
        for obj, name in self._absent:
            if _holder(obj, name)[0] is not None:
                return False
        for t, ptr, ver, dtype, dev in self._tensors:
            if t.data_ptr() != ptr or t._version != ver or t.dtype is not dtype or t.device != dev:
                return False
        return True
