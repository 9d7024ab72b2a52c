"""Rating: the usage ledger priced with the price book, in SQL aggregates, in exact Decimals.

Each usage entry is priced with the price in force at its ``created_at``: the tenant's contract
price for the model if one is in force, else the list price (tenant empty), else none (the
entry is reported as unpriced, amount 0, so it is visible rather than silently dropped).
The database groups the entries by tenant, model and price and sums their tokens (one query,
whatever the number of entries); amounts are then worked out per group:

    input  = (prompt_tokens - cached_tokens) x input_per_mtok        / 1 000 000
    cached = cached_tokens                   x cached_input_per_mtok / 1 000 000
    output = completion_tokens               x output_per_mtok       / 1 000 000

**Rounding rule.** The three component amounts are kept at full precision (they are exact:
integer tokens times a price with 6 decimals over 10^6 needs at most 12 decimals). A line's
amount is the sum of its three components at full precision, rounded once to the currency's
minor unit (0.01 for USD, EUR and CNY) with ``ROUND_HALF_EVEN`` (banker's rounding). A
statement's total (per currency) is the sum of its rounded line amounts; nothing else is
rounded. Rounding per line, not per request, means a million tiny requests are not each
rounded to zero (or each rounded up).

Rating is a pure function of the entries given to it, and every entry is one request id
(``UsageEntry.request_id`` is unique; ``usage_record`` of an existing id is a no-op), so rating
the same entries again gives the same lines and a replayed request cannot count twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from decimal import ROUND_HALF_EVEN, Decimal

from django.db import models
from django.db.models import Case, Count, OuterRef, Q, Subquery, Sum, Value, When
from django.db.models.functions import Coalesce

from billing.models import ModelPrice, UsageEntry

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


@dataclass(frozen=True)
class RatedLine:
    tenant_id: int
    model: str
    price: ModelPrice | None
    adjustment: bool
    requests: int
    input_tokens: int  # uncached input: prompt minus cached
    cached_tokens: int
    output_tokens: int

    @property
    def currency(self) -> str:
        return self.price.currency if self.price else ""

    @property
    def input_amount(self) -> Decimal:
        return component(self.input_tokens, self.price and self.price.input_per_mtok)

    @property
    def cached_amount(self) -> Decimal:
        return component(self.cached_tokens, self.price and self.price.cached_input_per_mtok)

    @property
    def output_amount(self) -> Decimal:
        return component(self.output_tokens, self.price and self.price.output_per_mtok)

    @property
    def amount(self) -> Decimal:
        full = self.input_amount + self.cached_amount + self.output_amount
        return round_amount(full, self.currency)


def _in_force(*, contract: bool) -> Subquery:
    prices = ModelPrice.objects.filter(
        served_model__name=OuterRef("model"),
        effective_from__lte=OuterRef("created_at"),
    ).filter(Q(effective_to__isnull=True) | Q(effective_to__gt=OuterRef("created_at")))
    prices = (
        prices.filter(tenant=OuterRef("tenant")) if contract else prices.filter(tenant__isnull=True)
    )
    return Subquery(prices.order_by("-effective_from").values("pk")[:1])


def with_price(entries: models.QuerySet[UsageEntry]) -> models.QuerySet[UsageEntry]:
    """The entries annotated with ``price_ref``: the id of the price in force for each."""
    return entries.annotate(
        price_ref=Coalesce(
            _in_force(contract=True),
            _in_force(contract=False),
            output_field=models.BigIntegerField(),
        )
    )


def rate(
    entries: models.QuerySet[UsageEntry], *, adjustments_before: datetime | None = None
) -> list[RatedLine]:
    """Lines per tenant, model and price in force (and, when `adjustments_before` is given,
    whether the usage predates it: late usage carried into a later period)."""
    late = (
        Case(
            When(created_at__lt=adjustments_before, then=Value(True)),
            default=Value(False),
            output_field=models.BooleanField(),
        )
        if adjustments_before is not None
        else Value(False, output_field=models.BooleanField())
    )
    rows = (
        with_price(entries.order_by())
        .annotate(late=late)
        .values("tenant_id", "model", "price_ref", "late")
        .annotate(
            requests=Count("pk"),
            prompt=Sum("prompt_tokens"),
            cached=Sum("cached_tokens"),
            completion=Sum("completion_tokens"),
        )
    )
    rows = list(rows)
    prices = ModelPrice.objects.in_bulk({r["price_ref"] for r in rows if r["price_ref"]})
    lines = [
        RatedLine(
            tenant_id=r["tenant_id"],
            model=r["model"],
            price=prices.get(r["price_ref"]),
            adjustment=bool(r["late"]),
            requests=r["requests"],
            input_tokens=r["prompt"] - r["cached"],
            cached_tokens=r["cached"],
            output_tokens=r["completion"],
        )
        for r in rows
    ]
    lines.sort(
        key=lambda line: (
            line.tenant_id,
            line.adjustment,
            line.model,
            line.price is None,
            line.price.effective_from if line.price else None,
            line.price.pk if line.price else 0,
        )
    )
    return lines
