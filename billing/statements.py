"""Statements: usage assigned to monthly statements, re-rated while open, frozen once closed.

Every ledger entry is assigned to exactly one statement (``UsageEntry.statement``), in one
``UPDATE`` per tenant and month: that is what makes rating idempotent per request id. An entry
goes to its own month's statement while that is open; once that one is closed it goes to the
tenant's next open statement, where it is an adjustment line. A statement row is locked
(``select_for_update``) while entries are assigned to it, its lines are rebuilt, or it is closed,
so no entry can be added to a statement that is closing or closed. Closing is idempotent: an
already closed statement is skipped, and (tenant, period_start) is unique.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal

from django.db import transaction
from django.db.models.functions import TruncMonth
from django.utils import timezone

from billing.models import Statement, StatementLine, StatementStatus, Tenant, UsageEntry
from billing.rating import RatedLine, rate

MONTH_RE = re.compile(r"^(?P<year>(19|2\d)\d\d)-(?P<month>0[1-9]|1[0-2])$")


def month_start(when: datetime) -> datetime:
    when = when.astimezone(UTC)
    return datetime(when.year, when.month, 1, tzinfo=UTC)


def next_month(start: datetime) -> datetime:
    if start.month == 12:
        return datetime(start.year + 1, 1, 1, tzinfo=UTC)
    return datetime(start.year, start.month + 1, 1, tzinfo=UTC)


def parse_month(text: str) -> tuple[datetime, datetime]:
    """'YYYY-MM' to the month's [start, end) in UTC; ValueError otherwise."""
    match = MONTH_RE.match(text or "")
    if match is None:
        raise ValueError("Use YYYY-MM, e.g. 2026-01.")
    start = datetime(int(match["year"]), int(match["month"]), 1, tzinfo=UTC)
    return start, next_month(start)


def _line_row(statement: Statement, line: RatedLine) -> StatementLine:
    price = line.price
    return StatementLine(
        statement=statement,
        model=line.model,
        price=price,
        contract=bool(price and price.tenant_id),
        adjustment=line.adjustment,
        requests=line.requests,
        input_tokens=line.input_tokens,
        cached_tokens=line.cached_tokens,
        output_tokens=line.output_tokens,
        currency=line.currency,
        input_per_mtok=price.input_per_mtok if price else None,
        cached_input_per_mtok=price.cached_input_per_mtok if price else None,
        output_per_mtok=price.output_per_mtok if price else None,
        amount=line.amount,
    )


def _refresh_locked(statement: Statement, now: datetime) -> None:
    """Rebuild an open, locked statement's lines from the entries assigned to it."""
    assert statement.status == StatementStatus.OPEN, "a closed statement never changes"
    lines = rate(statement.entries.all(), adjustments_before=statement.period_start)
    statement.lines.all().delete()
    StatementLine.objects.bulk_create([_line_row(statement, line) for line in lines])
    statement.rated_at = now
    statement.save(update_fields=["rated_at"])


def _open_statement_locked(tenant_id: int, start: datetime) -> Statement:
    """The tenant's first open statement from the month at `start` on, locked; created as
    needed (the current month's is always open: only ended periods are closed)."""
    while True:
        Statement.objects.get_or_create(
            tenant_id=tenant_id,
            period_start=start,
            defaults={"period_end": next_month(start)},
        )
        statement = Statement.objects.select_for_update().get(
            tenant_id=tenant_id, period_start=start
        )
        if statement.status == StatementStatus.OPEN:
            return statement
        start = statement.period_end


def rate_pending(*, now: datetime | None = None) -> int:
    """Assign every entry not yet on a statement to one and rebuild the statements touched.

    Returns how many entries were assigned. Running it again assigns nothing new.
    """
    now = now or timezone.now()
    groups = (
        UsageEntry.objects.filter(statement__isnull=True)
        .annotate(month=TruncMonth("created_at", tzinfo=UTC))
        .values_list("tenant_id", "month")
        .order_by("tenant_id", "month")
        .distinct()
    )
    assigned = 0
    for tenant_id, month in list(groups):
        start = month_start(month)
        with transaction.atomic():
            statement = _open_statement_locked(tenant_id, start)
            count = UsageEntry.objects.filter(
                statement__isnull=True,
                tenant_id=tenant_id,
                created_at__gte=start,
                created_at__lt=next_month(start),
            ).update(statement=statement)
            if count:
                _refresh_locked(statement, now)
            assigned += count
    return assigned


def refresh_open(*, now: datetime | None = None, tenant: Tenant | None = None) -> int:
    """Rebuild every open statement's lines (so a price added or corrected since shows up);
    returns how many were rebuilt."""
    now = now or timezone.now()
    found = Statement.objects.filter(status=StatementStatus.OPEN)
    if tenant is not None:
        found = found.filter(tenant=tenant)
    count = 0
    for pk in list(found.values_list("pk", flat=True)):
        with transaction.atomic():
            statement = Statement.objects.select_for_update().get(pk=pk)
            if statement.status == StatementStatus.OPEN:
                _refresh_locked(statement, now)
                count += 1
    return count


def close_statements(*, now: datetime | None = None) -> list[int]:
    """Rate what is pending and rebuild the open statements, then close every open statement
    whose period has ended.

    Returns the ids closed by this call; a second call (or a retry) closes nothing more.
    """
    now = now or timezone.now()
    rate_pending(now=now)
    refresh_open(now=now)
    closed = []
    due = Statement.objects.filter(status=StatementStatus.OPEN, period_end__lte=now)
    for pk in list(due.values_list("pk", flat=True)):
        with transaction.atomic():
            statement = Statement.objects.select_for_update().get(pk=pk)
            if statement.status != StatementStatus.OPEN:
                continue  # a concurrent run closed it first
            UsageEntry.objects.filter(
                statement__isnull=True,
                tenant_id=statement.tenant_id,
                created_at__gte=statement.period_start,
                created_at__lt=statement.period_end,
            ).update(statement=statement)
            _refresh_locked(statement, now)
            statement.status = StatementStatus.CLOSED
            statement.closed_at = now
            statement.save(update_fields=["status", "closed_at"])
            closed.append(pk)
    return closed


@dataclass
class Preview:
    """A statement for any [start, end) worked out from the ledger, not stored or closed."""

    tenant: Tenant
    period_start: datetime
    period_end: datetime
    line_list: list[StatementLine] = field(default_factory=list)
    id: None = None
    status: str = "preview"
    rated_at: datetime | None = None
    closed_at: None = None

    @property
    def tenant_id(self) -> int:
        return self.tenant.pk


def preview(*, tenant: Tenant, start: datetime, end: datetime) -> Preview:
    if end <= start:
        raise ValueError("end must be later than start.")
    result = Preview(tenant=tenant, period_start=start, period_end=end, rated_at=timezone.now())
    entries = UsageEntry.objects.filter(tenant=tenant, created_at__gte=start, created_at__lt=end)
    result.line_list = [_line_row(None, line) for line in rate(entries)]
    return result


def lines_of(statement: Statement | Preview) -> list[StatementLine]:
    if isinstance(statement, Preview):
        return statement.line_list
    return list(statement.lines.all())


def totals(lines: list[StatementLine]) -> list[dict]:
    """The sum of the rounded line amounts per currency (unpriced lines carry none)."""
    sums: dict[str, Decimal] = defaultdict(lambda: Decimal("0.00"))
    for line in lines:
        if line.currency:
            sums[line.currency] += line.amount
    return [{"currency": currency, "amount": sums[currency]} for currency in sorted(sums)]
