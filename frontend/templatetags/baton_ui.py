"""Template filters of the operator UI: numbers shown with the precision they have."""

from __future__ import annotations

from decimal import Decimal, InvalidOperation

from django import template

register = template.Library()


@register.filter
def num(value, digits=None):
    """A number as stored, without invented or dropped digits: 0.06 -> "0.06", 20.0 -> "20",
    12.5 -> "12.5". ``digits`` caps the decimals (``|num:3``); trailing zeros are dropped."""
    if value is None or value == "":
        return "–"
    try:
        d = Decimal(format(value, ".12g")) if isinstance(value, float) else Decimal(str(value))
    except (InvalidOperation, ValueError):
        return str(value)
    if digits not in (None, ""):
        d = d.quantize(Decimal(1).scaleb(-int(digits)))
    text = format(d.normalize(), "f")
    return "0" if text in ("-0", "") else text


@register.filter
def pct(value) -> str:
    """A fraction as a percentage with one decimal, as the live pages write it: 0.234 ->
    "23.4%"; None -> "–"."""
    if value is None or value == "":
        return "–"
    try:
        return f"{float(value) * 100:.1f}%"
    except (TypeError, ValueError):
        return "–"


@register.filter
def tokens_by_p(record) -> int:
    """Output tokens P made: its first token (the prefill's), which the decoders' counts omit."""
    return max(0, record.completion_tokens - record.tokens_by_rld - record.tokens_by_md)
