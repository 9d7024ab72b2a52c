"""The rating arithmetic on plain Decimals: a component amount at full precision and the
statement-line rounding (billing.rating's docstring states the rule). No models here, so the
models' own amounts (``StatementLine.input_amount``) and the rating share it."""

from __future__ import annotations

from decimal import ROUND_HALF_EVEN, Decimal

MILLION = Decimal(1_000_000)
COMPONENT_EXPONENT = Decimal("1e-12")  # exact: tokens x 6-decimal price / 10^6
MINOR_UNITS = {"USD": 2, "EUR": 2, "CNY": 2}


def minor_unit(currency: str) -> Decimal:
    return Decimal(1).scaleb(-MINOR_UNITS.get(currency, 2))


def round_amount(amount: Decimal, currency: str) -> Decimal:
    """The statement-line rounding: to the currency's minor unit, half to even."""
    return amount.quantize(minor_unit(currency), rounding=ROUND_HALF_EVEN)


def component(tokens: int, per_mtok: Decimal | None) -> Decimal:
    """One component amount at full precision (exact to 12 decimals); 0 when unpriced."""
    if per_mtok is None:
        return Decimal(0).quantize(COMPONENT_EXPONENT)
    return (Decimal(tokens) * per_mtok / MILLION).quantize(COMPONENT_EXPONENT)
