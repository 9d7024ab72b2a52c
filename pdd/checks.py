"""Number checks shared by every part that takes numbers from outside (policy settings, the
gateway's request fields, agents' settings, link shaping, env variables): a real number is an
int or float, not a bool, and finite; errors name the field."""

from __future__ import annotations

import math
from typing import TypeGuard


def is_number(value: object) -> TypeGuard[int | float]:
    """An int or a float (not a bool), finite."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_number(
    value: object,
    name: str,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
) -> float:
    """`value` as a float; ValueError ``"<name>: must be ..., got <value>"`` otherwise."""
    bounds = [
        f"{op} {bound:g}" for op, bound in ((">=", ge), (">", gt), ("<=", le)) if bound is not None
    ]
    wanted = "a finite number" + (" " + " and ".join(bounds) if bounds else "")
    if not is_number(value):
        raise ValueError(f"{name}: must be {wanted}, got {value!r}")
    if (
        (ge is not None and value < ge)
        or (gt is not None and value <= gt)
        or (le is not None and value > le)
    ):
        raise ValueError(f"{name}: must be {wanted}, got {value!r}")
    return float(value)


def check_int(value: object, name: str, *, ge: int | None = None) -> int:
    """`value` as an int (not a bool); ValueError naming the field otherwise."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name}: must be an integer, got {value!r}")
    if ge is not None and value < ge:
        raise ValueError(f"{name}: must be an integer >= {ge}, got {value!r}")
    return value
