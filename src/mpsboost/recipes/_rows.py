"""The checks of the decode recipes' family rows.

``moe_block``, ``linear_attention`` and ``attention_decode`` each keep one table of frozen dataclass rows, one
row per model family (:class:`~mpsboost.recipes.moe_block.MoeFamily`,
:class:`~mpsboost.recipes.linear_attention.DeltaNetFamily`,
:class:`~mpsboost.recipes.attention_decode.AttentionFamily`). Each row checks its own fields when it is made
(:func:`check_row`, from its ``__post_init__``), so a malformed row stops ``import mpsboost`` with a ValueError
naming the row and the field, and :func:`by_class` indexes a table by its target class, refusing a class given
twice. Nothing here imports transformers: class names are dotted paths, matched against each module's MRO.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, Iterable, Mapping, TypeVar

from ..registry import type_text, value_fits

__all__ = ["CLASS_PATH", "is_class_path", "check_row", "by_class"]

#: Field metadata of a row field that holds a dotted class path (or a tuple of them):
#: ``router: str = field(metadata=CLASS_PATH)``.
CLASS_PATH: Mapping[str, Any] = types.MappingProxyType({"class_path": True})

_Row = TypeVar("_Row")


def is_class_path(value: Any) -> bool:
    """``value`` is a dotted class path: a module path and a class name, every part an identifier, the class
    name capitalised (``transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock``)."""
    if not isinstance(value, str):
        return False
    parts = value.split(".")
    return len(parts) >= 2 and all(p.isidentifier() for p in parts) and parts[-1][:1].isupper()


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def check_row(row: Any) -> None:
    """Every field of ``row`` (a frozen dataclass instance) against its annotation (``bool``, ``str``,
    ``Literal[...]``, ``tuple[str, ...]``, unions), and every field declared with ``metadata=CLASS_PATH`` a
    dotted class path (each item of a tuple). Raises ValueError naming the row type, the row (its first
    field's value) and the field, with the value given and what it takes."""
    cls = type(row)
    hints = _hints(cls)
    fields = dataclasses.fields(row)
    key = getattr(row, fields[0].name)
    where = f"{cls.__name__} row {key!r}"
    for f in fields:
        value = getattr(row, f.name)
        tp = hints[f.name]
        if not value_fits(value, tp):
            raise ValueError(f"{where}: field {f.name}={value!r} is not {type_text(tp)}")
        if f.metadata.get("class_path"):
            paths = value if isinstance(value, tuple) else (value,)
            bad = [p for p in paths if not is_class_path(p)]
            if bad:
                raise ValueError(
                    f"{where}: field {f.name} holds {bad[0]!r}, not a dotted class path (module path and class "
                    "name, e.g. 'transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock')"
                )


def by_class(rows: Iterable[_Row], field: str) -> dict[str, _Row]:
    """{the value of ``field`` (the row's target class path): row}, in table order; a class path given by two
    rows raises ValueError naming both (the first would shadow the second)."""
    out: dict[str, _Row] = {}
    for row in rows:
        path = getattr(row, field)
        if path in out:
            raise ValueError(
                f"{type(row).__name__} rows {out[path]!r} and {row!r} both name {field}={path!r}; one row per class"
            )
        out[path] = row
    return out
