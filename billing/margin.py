"""Revenue, provider cost and margin per served model and per day.

Revenue is the rated usage: the ledger entries made in [start, end), each priced with the
price in force when it was made (contract, else list), as on the statements
(billing.rating.PriceBook and billing.amounts.component). The database groups the entries by
tenant, model, UTC day and price bucket and sums their tokens (one query, whatever the number
of entries). Cost is billing.costs.fleet_cost over the same period, per model and day.

**Rounding rule.** Per (model, day, currency) and per (model, currency), revenue is the sum of
the component amounts at full precision rounded once to 0.01 half-even (like a statement
line); cost likewise (billing/costs.py). ``margin = revenue - cost`` of the rounded figures, so
it is exact to the cent. Totals add the rounded per-model lines. A month's revenue here can
differ by a cent or so from the sum of its statements, which round per tenant line, and it
counts usage by when it happened, not by which statement bills it (no adjustments).

``bcr`` is BCR in money terms: revenue / cost (4 decimals, half-even; null without cost). The
live BCR beside it is the dashboard's: goodput requests/s over the last hour per fleet cost
per hour now (frontend/telemetry).
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from decimal import ROUND_HALF_EVEN, Decimal
from typing import Any

from django.conf import settings
from django.core.cache import cache
from django.db.models.functions import TruncDate
from django.utils import timezone

from billing.amounts import component, round_amount
from billing.costs import FleetCost, fleet_cost
from billing.models import ModelPrice, UsageEntry
from billing.rating import PriceBook, grouped_sums

BCR_EXPONENT = Decimal("1e-4")


@dataclass
class Revenue:
    """Full-precision revenue of one (model, day or None, currency) bucket."""

    requests: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    full: Decimal = field(default_factory=lambda: Decimal(0))

    def add(self, row: dict, price: ModelPrice | None) -> None:
        uncached = row["prompt"] - row["cached"]
        self.requests += row["requests"]
        self.input_tokens += uncached
        self.cached_tokens += row["cached"]
        self.output_tokens += row["completion"]
        if price is not None:
            self.full += (
                component(uncached, price.input_per_mtok)
                + component(row["cached"], price.cached_input_per_mtok)
                + component(row["completion"], price.output_per_mtok)
            )

    @property
    def tokens(self) -> int:
        return self.input_tokens + self.cached_tokens + self.output_tokens


def revenue_rows(start: datetime, end: datetime, *, model: str | None = None) -> list[dict]:
    """The ledger of [start, end) grouped in SQL by tenant, model, UTC day and price bucket
    (billing.rating.PriceBook: no subquery per entry), then merged here per model, day and
    price in force. Two queries: the price book, then the grouped sums."""
    entries = UsageEntry.objects.filter(created_at__gte=start, created_at__lt=end)
    if model is not None:
        entries = entries.filter(model=model)
    book = PriceBook()
    grouped = grouped_sums(
        entries.order_by()
        .annotate(day=TruncDate("created_at", tzinfo=UTC), bucket=book.bucket())
        .values("tenant_id", "model", "day", "bucket")
    )
    merged: dict[tuple, dict] = {}
    for r in grouped:
        price = book.price(r["tenant_id"], r["model"], r["bucket"])
        key = (r["model"], _day(r["day"]), price.pk if price else None)
        row = merged.get(key)
        if row is None:
            row = merged[key] = {
                "model": key[0],
                "day": key[1],
                "price_ref": key[2],
                "requests": 0,
                "prompt": 0,
                "cached": 0,
                "completion": 0,
            }
        for name in ("requests", "prompt", "cached", "completion"):
            row[name] += r[name]
    return [merged[k] for k in sorted(merged, key=lambda k: (k[1], k[0], k[2] or 0))]


def bcr(revenue: Decimal, cost: Decimal) -> Decimal | None:
    if not cost:
        return None
    return (revenue / cost).quantize(BCR_EXPONENT, rounding=ROUND_HALF_EVEN)


def _day(value) -> date:
    return value if isinstance(value, date) else date.fromisoformat(str(value)[:10])


@dataclass
class MarginReport:
    start: datetime
    end: datetime
    cost: FleetCost
    per_model: list[dict]
    per_day: list[dict]  # per model and day
    totals: list[dict]
    unpriced_requests: int


CACHE_PREFIX = "billing:margin"
LIVE_SKEW = timedelta(seconds=5)  # a `now` this close to the clock is "now"


def cache_seconds() -> float:
    return float(getattr(settings, "BILLING_MARGIN_CACHE_SECONDS", 30))


def _cache_key(start: datetime, end: datetime, model: str | None) -> str:
    generation = cache.get_or_set(f"{CACHE_PREFIX}:generation", lambda: uuid.uuid4().hex)
    return f"{CACHE_PREFIX}:{generation}:{start.isoformat()}:{end.isoformat()}:{model or ''}"


def clear_cache() -> None:
    """Forget every cached report (a new generation: old keys are never read again)."""
    cache.set(f"{CACHE_PREFIX}:generation", uuid.uuid4().hex, None)


def margin(
    start: datetime, end: datetime, *, model: str | None = None, now: datetime | None = None
) -> MarginReport:
    """The margin report of [start, end). Reports "as of now" (`now` omitted or within a few
    seconds of the clock, as the Billing page and the API ask) are cached for
    ``BILLING_MARGIN_CACHE_SECONDS`` (default 30 s; 0: off) per (start, end, model), so
    reloading the page does not aggregate the ledger again; a report for an explicit past
    `now` is always worked out afresh."""
    clock = timezone.now()
    live = now is None or abs(now - clock) <= LIVE_SKEW
    ttl = cache_seconds()
    if not live or ttl <= 0:
        return _margin(start, end, model=model, now=now or clock)
    key = _cache_key(start, end, model)
    found = cache.get(key)
    if found is not None:
        return found
    report = _margin(start, end, model=model, now=now or clock)
    cache.set(key, report, ttl)
    return report


def _margin(start: datetime, end: datetime, *, model: str | None, now: datetime) -> MarginReport:
    rows = revenue_rows(start, end, model=model)
    prices = ModelPrice.objects.in_bulk({r["price_ref"] for r in rows if r["price_ref"]})
    by_day: dict[tuple[str, date, str], Revenue] = defaultdict(Revenue)
    by_model: dict[tuple[str, str], Revenue] = defaultdict(Revenue)
    unpriced = 0
    for r in rows:
        price = prices.get(r["price_ref"])
        currency = price.currency if price else ""
        if price is None:
            unpriced += r["requests"]
        by_day[(r["model"], _day(r["day"]), currency)].add(r, price)
        by_model[(r["model"], currency)].add(r, price)

    cost = fleet_cost(start, end, model=model, now=now)
    cost_day = {(c.key["model"], c.key["day"], c.currency): c for c in cost.by_model_day()}
    cost_model = {(c.key["model"], c.currency): c for c in cost.by_model()}

    def figures(rev: Revenue | None, cost_line, currency: str) -> dict:
        revenue = round_amount(rev.full, currency) if rev and currency else Decimal("0.00")
        spent = cost_line.amount if cost_line is not None else Decimal("0.00")
        return {
            "currency": currency,
            "requests": rev.requests if rev else 0,
            "tokens": rev.tokens if rev else 0,
            "revenue": revenue,
            "cost": spent,
            "gpu_hours": cost_line.gpu_hours if cost_line is not None else Decimal("0.000000"),
            "margin": revenue - spent,
            "bcr": bcr(revenue, spent),
        }

    per_day = [
        {"model": m, "day": d, **figures(by_day.get((m, d, c)), cost_day.get((m, d, c)), c)}
        for (m, d, c) in sorted(set(by_day) | set(cost_day), key=lambda k: (k[1], k[0], k[2]))
    ]
    per_model = [
        {"model": m, **figures(by_model.get((m, c)), cost_model.get((m, c)), c)}
        for (m, c) in sorted(set(by_model) | set(cost_model))
    ]
    sums: dict[str, dict] = {}
    for line in per_model:
        if not line["currency"]:
            continue
        total = sums.setdefault(
            line["currency"],
            {"currency": line["currency"], "revenue": Decimal("0.00"), "cost": Decimal("0.00")},
        )
        total["revenue"] += line["revenue"]
        total["cost"] += line["cost"]
    totals = []
    for currency in sorted(sums):
        t = sums[currency]
        totals.append(
            {**t, "margin": t["revenue"] - t["cost"], "bcr": bcr(t["revenue"], t["cost"])}
        )
    return MarginReport(
        start=start,
        end=end,
        cost=cost,
        per_model=per_model,
        per_day=per_day,
        totals=totals,
        unpriced_requests=unpriced,
    )


# The live telemetry's figures over the last hour, set by the app that aggregates it
# (frontend.apps): called with no argument, it returns goodput_rps, cost_per_hour, currency and
# bcr. Billing only reads it; without one (or when it fails) every live figure is null.
live_bcr_source: Callable[[], dict[str, Any]] | None = None


def live_bcr() -> dict:
    """The dashboard's BCR: goodput requests/s over the last hour per fleet cost per hour now.
    Every figure is null when the telemetry is not available in this process."""
    out = {"window": "1h", "goodput_rps": None, "cost_per_hour": None, "currency": "", "bcr": None}
    source = live_bcr_source
    if source is None:
        return out
    try:
        out.update(source())
    except Exception:  # telemetry is optional here: the money figures stand on their own
        pass
    return out
