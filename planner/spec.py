"""Validation helpers and the dict -> dataclass loading shared by the planner's specs.

Scenario files carry a ``"_source"`` (or any ``_``-prefixed) entry beside parameters to say
where each number comes from; loaders drop those keys before building dataclasses.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import fields
from typing import Any, TypeVar

T = TypeVar("T")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def number(value: Any, where: str, positive: bool = False) -> float:
    """``value`` as a float if it is a finite number > 0 (``positive``) or >= 0; else a
    ValueError naming ``where``."""
    ok = _is_number(value) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):
        need = "a positive number" if positive else "a number >= 0"
        raise ValueError(f"{where}: must be {need}, got {value!r}")
    return float(value)


def check_positive(obj: object, name: str) -> None:
    number(getattr(obj, name), name, positive=True)


def check_non_negative(obj: object, name: str) -> None:
    number(getattr(obj, name), name)


def check_range(obj: object, name: str, lo: float, hi: float) -> None:
    value = getattr(obj, name)
    if not _is_number(value) or not (lo <= value <= hi):
        raise ValueError(f"{name}: must be a number in [{lo}, {hi}], got {value!r}")


def strip_comments(data: Any) -> Any:
    """Drop ``_``-prefixed keys (sources, notes) recursively."""
    if isinstance(data, Mapping):
        return {k: strip_comments(v) for k, v in data.items() if not str(k).startswith("_")}
    if isinstance(data, list):
        return [strip_comments(v) for v in data]
    return data


def build(cls: type[T], data: Any, where: str) -> T:
    """Build dataclass ``cls`` from a mapping; errors name the path of the bad field."""
    if isinstance(data, cls):
        return data
    if not isinstance(data, Mapping):
        raise ValueError(f"{where}: must be an object")
    data = strip_comments(data)
    known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    for key in data:
        if key not in known:
            raise ValueError(f"{where}.{key}: unknown field")
    try:
        return cls(**data)
    except ValueError as exc:
        raise ValueError(f"{where}.{exc}") from exc
    except TypeError as exc:
        raise ValueError(f"{where}: {exc}") from exc
