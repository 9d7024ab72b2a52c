"""Rating: the usage ledger priced with the price book, in SQL aggregates, in exact Decimals.

Each usage entry is priced with the price in force at its ``created_at``: the tenant's contract
price for the model if one is in force, else the list price (tenant empty), else none (the
entry is reported as unpriced, amount 0, so it is visible rather than silently dropped).
The database groups the entries by tenant, model and *price bucket* and sums their tokens (one
query, whatever the number of entries; no join or subquery per entry): the buckets are the
intervals between the instants where any price starts or ends, so one price is in force per
(tenant, model, bucket), looked up in memory (:class:`PriceBook`). Amounts are then worked
out per line:

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

from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal

from django.db import models
from django.db.models import Case, Count, OuterRef, Q, Subquery, Sum, Value, When
from django.db.models.functions import Coalesce

from billing.amounts import component, round_amount
from billing.models import ModelPrice, UsageEntry


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
        per_mtok = self.price.input_per_mtok if self.price else None
        return component(self.input_tokens, per_mtok)

    @property
    def cached_amount(self) -> Decimal:
        per_mtok = self.price.cached_input_per_mtok if self.price else None
        return component(self.cached_tokens, per_mtok)

    @property
    def output_amount(self) -> Decimal:
        per_mtok = self.price.output_per_mtok if self.price else None
        return component(self.output_tokens, per_mtok)

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
    """The entries annotated with ``price_ref``: the id of the price in force for each (two
    correlated subqueries per entry: for a few entries; bulk rating uses :class:`PriceBook`)."""
    return entries.annotate(
        price_ref=Coalesce(
            _in_force(contract=True),
            _in_force(contract=False),
            output_field=models.BigIntegerField(),
        )
    )


class PriceBook:
    """The price book in memory, cut into *buckets* for rating in bulk.

    Every instant where any price starts or ends (and any extra cut given, e.g. a statement's
    period start) is a cut; between two consecutive cuts no price starts or ends, so the
    price in force for a (tenant, model) is the same for every entry of the bucket. The
    database then only groups entries by bucket (a ``CASE`` over a handful of cuts: no join
    and no subquery per entry), and the price of each group is looked up here, with the
    same rule as :func:`with_price` (contract first, else list; the latest start wins).
    """

    def __init__(self, prices=None, *, cuts=()):
        if prices is None:
            prices = ModelPrice.objects.select_related("served_model")
        self.by_key: dict[tuple[str, int | None], list[ModelPrice]] = defaultdict(list)
        points = set(cuts)
        for p in prices:
            self.by_key[(p.served_model.name, p.tenant_id)].append(p)
            points.add(p.effective_from)
            if p.effective_to is not None:
                points.add(p.effective_to)
        self.cuts: list[datetime] = sorted(points)
        for found in self.by_key.values():
            found.sort(key=lambda p: (p.effective_from, p.pk), reverse=True)

    def bucket(self, field: str = "created_at") -> Case | Value:
        """SQL: the index of the bucket of `field` (0: before the first cut)."""
        if not self.cuts:
            return Value(0, output_field=models.IntegerField())
        return Case(
            *(When(**{f"{field}__lt": cut}, then=Value(i)) for i, cut in enumerate(self.cuts)),
            default=Value(len(self.cuts)),
            output_field=models.IntegerField(),
        )

    def bucket_start(self, index: int) -> datetime | None:
        return self.cuts[index - 1] if index > 0 else None

    def _at(self, model: str, tenant_id: int | None, when: datetime) -> ModelPrice | None:
        for p in self.by_key.get((model, tenant_id), ()):
            if p.effective_from <= when and (p.effective_to is None or p.effective_to > when):
                return p
        return None

    def price(self, tenant_id: int, model: str, index: int) -> ModelPrice | None:
        """The price in force in bucket `index` for the tenant and model, or None."""
        when = self.bucket_start(index)
        if when is None:  # before every cut: no price has started yet
            return None
        return self._at(model, tenant_id, when) or self._at(model, None, when)


def grouped_sums(rows: models.QuerySet) -> models.QuerySet:
    return rows.annotate(
        requests=Count("pk"),
        prompt=Sum("prompt_tokens"),
        cached=Sum("cached_tokens"),
        completion=Sum("completion_tokens"),
    )


def lines_from_rows(rows, book: PriceBook, *, late_before: datetime | None) -> list[RatedLine]:
    """Merge grouped rows (tenant_id, model, bucket, sums) into lines per price in force."""
    # Per key: the price in force (the same for the whole key) and the four sums.
    merged: dict[tuple, tuple[ModelPrice | None, list[int]]] = {}
    for r in rows:
        price = book.price(r["tenant_id"], r["model"], r["bucket"])
        start = book.bucket_start(r["bucket"])
        late = late_before is not None and (start is None or start < late_before)
        key = (r["tenant_id"], r["model"], price.pk if price else None, late)
        _, sums = merged.setdefault(key, (price, [0, 0, 0, 0]))
        sums[0] += r["requests"]
        sums[1] += r["prompt"]
        sums[2] += r["cached"]
        sums[3] += r["completion"]
    lines = [
        RatedLine(
            tenant_id=tenant_id,
            model=model,
            price=price,
            adjustment=late,
            requests=sums[0],
            input_tokens=sums[1] - sums[2],
            cached_tokens=sums[2],
            output_tokens=sums[3],
        )
        for (tenant_id, model, _, late), (price, sums) in merged.items()
    ]
    lines.sort(key=line_order)
    return lines


def line_order(line: RatedLine) -> tuple:
    return (
        line.tenant_id,
        line.adjustment,
        line.model,
        line.price is None,
        line.price.effective_from if line.price else None,
        line.price.pk if line.price else 0,
    )


def rate(
    entries: models.QuerySet[UsageEntry], *, adjustments_before: datetime | None = None
) -> list[RatedLine]:
    """Lines per tenant, model and price in force (and, when `adjustments_before` is given,
    whether the usage predates it: late usage carried into a later period).

    Two queries whatever the number of entries: the price book, then the entries grouped by
    tenant, model and bucket (:class:`PriceBook`)."""
    book = PriceBook(cuts=[adjustments_before] if adjustments_before is not None else ())
    rows = grouped_sums(
        entries.order_by().annotate(bucket=book.bucket()).values("tenant_id", "model", "bucket")
    )
    return lines_from_rows(rows, book, late_before=adjustments_before)
