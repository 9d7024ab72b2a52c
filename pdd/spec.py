"""Validation helpers and the dict -> dataclass loading shared by the planner's specs.

Scenario files carry a ``"_source"`` (or any ``_``-prefixed) entry beside parameters to say
where each number comes from; loaders drop those keys before building dataclasses.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any, TypeVar

from pdd.checks import is_number

T = TypeVar("T")


def number(value: Any, where: str, positive: bool = False) -> float:
    """``value`` as a float if it is a finite number > 0 (``positive``) or >= 0; else a
    ValueError naming ``where``."""
    ok = is_number(value)
    if not ok or value < 0 or (positive and value == 0):
        need = "a positive number" if positive else "a number >= 0"
        raise ValueError(f"{where}: must be {need}, got {value!r}")
    return float(value)


def integer(value: Any, where: str, lo: int = 0, hi: int | None = None) -> int:
    """``value`` if it is a whole number (an int, not a bool, not 0.5) in [lo, hi]; else a
    ValueError naming ``where``. JSON has no int/float distinction a user sees, so ``2.0``
    counts as 2 while ``0.5`` is refused."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < lo
        or (hi is not None and value > hi)
    ):
        need = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]"
        raise ValueError(f"{where}: must be {need}, got {value!r}")
    return value


def check_int(obj: object, name: str, lo: int = 0, hi: int | None = None) -> None:
    """Check (and normalise ``2.0`` to ``2``) the integer field ``name`` of ``obj``."""
    setattr(obj, name, integer(getattr(obj, name), name, lo, hi))


def check_bool(obj: object, name: str) -> None:
    if not isinstance(getattr(obj, name), bool):
        raise ValueError(f"{name}: must be true or false, got {getattr(obj, name)!r}")


def check_positive(obj: object, name: str) -> None:
    number(getattr(obj, name), name, positive=True)


def check_non_negative(obj: object, name: str) -> None:
    number(getattr(obj, name), name)


def check_range(obj: object, name: str, lo: float, hi: float, open_lo: bool = False) -> None:
    """``lo <= value <= hi`` (``lo < value`` with ``open_lo``), else a ValueError naming it."""
    value = getattr(obj, name)
    ok = is_number(value) and lo <= value <= hi
    if not ok or (open_lo and value == lo):
        span = f"({lo}, {hi}]" if open_lo else f"[{lo}, {hi}]"
        raise ValueError(f"{name}: must be a number in {span}, got {value!r}")


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
