"""Statements: the ledger billed per tenant and calendar month, re-rated while open, frozen once
closed.

Which statement bills an entry is **not stored on the entry**: it follows from the entry's
tenant, ``created_at`` and id, and the tenant's chain of statements (ordered by period). A
closed statement records ``last_entry_id``, the highest ledger id when it closed (taken while
no insert into the ledger is in flight, see :func:`ledger_watermark`), so the set of entries
it bills is fixed forever. The rule, for an entry *e* of a tenant:

    e is billed by the first statement S of its tenant's chain (by period) with
    created_at(e) < S.period_end and (S is open or id(e) <= S.last_entry_id).

So an entry goes to its own month's statement, or, when that one closed before the entry
was written (late usage), to the next statement still open then: there it is an
*adjustment* (``created_at`` before the period). Statements are only ever created after the
tenant's last closed one and closed in period order, so the closed ones are a prefix of the
chain and their watermarks grow along it; the rule then reduces, for a statement S with
predecessor P, to two index ranges (:func:`membership`):

    created_at in [P.period_end, S.period_end)                      (its own period)
    created_at < P.period_end and id > P.last_entry_id  (P closed)  (late usage)

each capped at ``id <= S.last_entry_id`` once S is closed. Rating is one grouped query for
any number of statements (billing/rating.py, price buckets instead of a subquery per
entry); an open statement is re-rated only when its entry count or the price book changed
since its last rating. Statement creation, rating and closing lock the tenant row
(``SELECT ... FOR NO KEY UPDATE``, which does not block usage inserts), so they serialise
per tenant; closing an already closed statement is a no-op, which makes the close idempotent
and safe to retry, and (tenant, period_start) is unique.
"""

from __future__ import annotations

import operator
import re
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from functools import reduce

from django.db import connection, models, transaction
from django.db.models import Case, Count, Max, Q, Value, When
from django.db.models.functions import TruncMonth
from django.utils import timezone

from billing.models import (
    ModelPrice,
    Statement,
    StatementLine,
    StatementStatus,
    Tenant,
    UsageEntry,
)
from billing.rating import PriceBook, RatedLine, grouped_sums, lines_from_rows, rate

MONTH_RE = re.compile(r"^(?P<year>(19|2\d)\d\d)-(?P<month>0[1-9]|1[0-2])$")
BATCH = 64  # statements rated per query


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


def _line_row(statement: Statement | None, line: RatedLine) -> StatementLine:
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


# --- membership ------------------------------------------------------------------------------


def _is_closed(statement: Statement) -> bool:
    return statement.status == StatementStatus.CLOSED


def membership(statement: Statement, previous: Statement | None, *, cap: int | None = None) -> Q:
    """The entries `statement` bills, given the statement before it in its tenant's chain.

    `cap`: the highest entry id it may bill (its ``last_entry_id`` once closed; the watermark
    being set while it closes); None: no cap (open)."""
    if cap is None and _is_closed(statement):
        cap = statement.last_entry_id
    capped = Q(id__lte=cap) if cap is not None else Q()
    own = Q(tenant_id=statement.tenant_id, created_at__lt=statement.period_end) & capped
    if previous is None:
        return own
    parts = own & Q(created_at__gte=previous.period_end)
    if _is_closed(previous):
        late = Q(
            tenant_id=statement.tenant_id,
            created_at__lt=previous.period_end,
            id__gt=previous.last_entry_id,
        )
        parts |= late & capped
    return parts


def _chains(tenant_ids=None) -> dict[int, list[Statement]]:
    """Each tenant's statements in period order."""
    found = Statement.objects.order_by("tenant_id", "period_start")
    if tenant_ids is not None:
        found = found.filter(tenant_id__in=list(tenant_ids))
    chains: dict[int, list[Statement]] = defaultdict(list)
    for statement in found:
        chains[statement.tenant_id].append(statement)
    return chains


def _with_previous(chain: list[Statement]):
    return zip(chain, [None, *chain[:-1]], strict=True)


def _lock_tenants(tenant_ids) -> None:
    """Serialise statement creation, rating and closing per tenant (FOR NO KEY UPDATE does
    not conflict with the key-share lock a usage insert takes on its tenant)."""
    ids = sorted(set(tenant_ids))
    if ids:
        list(
            Tenant.objects.select_for_update(no_key=True)
            .filter(pk__in=ids)
            .order_by("pk")
            .values_list("pk", flat=True)
        )


def statement_of(entry: UsageEntry) -> Statement | None:
    """The statement that bills `entry` (the rule in the module docstring), or None."""
    return Statement.objects.billing(entry)


def entries_of(statement: Statement) -> models.QuerySet[UsageEntry]:
    """The ledger entries a stored statement bills."""
    previous = (
        Statement.objects.filter(
            tenant_id=statement.tenant_id, period_start__lt=statement.period_start
        )
        .order_by("-period_start")
        .first()
    )
    return UsageEntry.objects.filter(membership(statement, previous))


def ledger_watermark() -> int:
    """The ledger's highest entry id, such that no entry with a lower id can still appear.

    On PostgreSQL ids are handed out at insert but commit in any order, so the table is
    locked in SHARE mode for the instant of the read: that waits for the inserts in flight
    and holds new ones back until it commits (milliseconds). SQLite has one writer at a time,
    so a plain read is enough there."""
    with transaction.atomic():
        if connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                cursor.execute("SET LOCAL lock_timeout = '10s'")
                cursor.execute(f'LOCK TABLE "{UsageEntry._meta.db_table}" IN SHARE MODE')
        return UsageEntry.objects.aggregate(top=Max("id"))["top"] or 0


def price_book_version() -> str:
    """Changes whenever a price is added, changed or removed, or a priced served model is
    changed (prices match usage by its name): open statements are re-rated then."""
    found = ModelPrice.objects.aggregate(
        n=Count("id"),
        top=Max("id"),
        changed=Max("updated_at"),
        renamed=Max("served_model__updated_at"),
    )
    stamps = [found[k].isoformat() if found[k] else "" for k in ("changed", "renamed")]
    return f"{found['n']}:{found['top'] or 0}:{':'.join(stamps)}"


# --- rating statements -----------------------------------------------------------------------


def _rate_many(
    items: list[tuple[Statement, Q]], book: PriceBook | None = None
) -> dict[int, list[RatedLine]]:
    """Lines per statement for (statement, membership) pairs: one grouped query a batch."""
    out: dict[int, list[RatedLine]] = {statement.pk: [] for statement, _ in items}
    if book is None:
        book = PriceBook(cuts={statement.period_start for statement, _ in items})
    for i in range(0, len(items), BATCH):
        batch = items[i : i + BATCH]
        which = Case(
            *(When(q, then=Value(statement.pk)) for statement, q in batch),
            output_field=models.BigIntegerField(),
        )
        entries = UsageEntry.objects.filter(reduce(operator.or_, (q for _, q in batch)))
        rows = grouped_sums(
            entries.order_by()
            .annotate(stmt=which, bucket=book.bucket())
            .values("stmt", "tenant_id", "model", "bucket")
        )
        by_statement: dict[int, list[dict]] = defaultdict(list)
        for row in rows:
            by_statement[row["stmt"]].append(row)
        for statement, _ in batch:
            out[statement.pk] = lines_from_rows(
                by_statement.get(statement.pk, ()), book, late_before=statement.period_start
            )
    return out


def _store_lines(statement: Statement, lines: list[RatedLine], now: datetime, version: str):
    assert statement.status == StatementStatus.OPEN, "a closed statement never changes"
    statement.lines.all().delete()
    StatementLine.objects.bulk_create([_line_row(statement, line) for line in lines])
    statement.rated_at = now
    statement.entry_count = sum(line.requests for line in lines)
    statement.price_book = version


def _create_statements(now: datetime) -> list[int]:
    """Create the statements that usage not billed by any statement yet needs; returns the
    ids created. Only ever after a tenant's last closed statement."""
    chains = _chains()
    want: dict[int, set[datetime]] = defaultdict(set)
    needs_open: set[int] = set()
    unseen = list(Tenant.objects.filter(statements__isnull=True).values_list("pk", flat=True))
    beyond: dict[datetime, list[int]] = defaultdict(list)  # chain end -> tenants
    late = []
    for tenant_id, chain in chains.items():
        last = chain[-1]
        beyond[last.period_end].append(tenant_id)
        if _is_closed(last):
            late.append(
                Q(tenant_id=tenant_id, created_at__lt=last.period_end, id__gt=last.last_entry_id)
            )
    ranges = [Q(tenant_id__in=ids, created_at__gte=end) for end, ids in beyond.items()]
    if unseen:
        ranges.append(Q(tenant_id__in=unseen))
    if ranges:
        months = (
            UsageEntry.objects.filter(reduce(operator.or_, ranges))
            .annotate(month=TruncMonth("created_at", tzinfo=UTC))
            .order_by()
            .values_list("tenant_id", "month")
            .distinct()
        )
        for tenant_id, month in months:
            want[tenant_id].add(month_start(month))
    if late:
        found = UsageEntry.objects.filter(reduce(operator.or_, late)).order_by()
        needs_open.update(found.values_list("tenant_id", flat=True).distinct())
    created = []
    for tenant_id in sorted(set(want) | needs_open):
        with transaction.atomic():
            _lock_tenants([tenant_id])
            chain = _chains([tenant_id]).get(tenant_id, [])
            closed = [st.period_start for st in chain if _is_closed(st)]
            after = max(closed) if closed else None
            months = {m for m in want.get(tenant_id, ()) if after is None or m > after}
            if tenant_id in needs_open and not any(
                st.status == StatementStatus.OPEN and (after is None or st.period_start > after)
                for st in chain
            ):
                # Late usage and every statement closed: the tenant's next open period.
                target = month_start(now)
                months.add(target if after is None or target > after else next_month(after))
            for month in sorted(months):
                statement, was_created = Statement.objects.get_or_create(
                    tenant_id=tenant_id,
                    period_start=month,
                    defaults={"period_end": next_month(month)},
                )
                if was_created:
                    created.append(statement.pk)
    return created


def _stale(now: datetime, *, tenant: Tenant | None, force: bool, version: str) -> list[int]:
    """Ids of the open statements whose lines are out of date: never rated, the price book
    changed, or the number of entries they bill is not the number their lines count."""
    chains = _chains([tenant.pk] if tenant is not None else None)
    stale = []
    for chain in chains.values():
        for statement, previous in _with_previous(chain):
            if statement.status != StatementStatus.OPEN:
                continue
            if force or statement.rated_at is None or statement.price_book != version:
                stale.append(statement.pk)
                continue
            count = UsageEntry.objects.filter(membership(statement, previous)).count()
            if count != statement.entry_count:
                stale.append(statement.pk)
    return stale


def rebuild_statements(ids: list[int], now: datetime, version: str) -> tuple[int, int]:
    """Re-rate the open statements `ids` (under their tenants' locks); returns how many were
    rebuilt and how many entries joined them (new count minus old)."""
    rebuilt = joined = 0
    tenants = sorted(set(Statement.objects.filter(pk__in=ids).values_list("tenant_id", flat=True)))
    wanted = set(ids)
    for i in range(0, len(tenants), BATCH):
        group = tenants[i : i + BATCH]
        with transaction.atomic():
            _lock_tenants(group)
            items = []
            for chain in _chains(group).values():
                for statement, previous in _with_previous(chain):
                    if statement.pk in wanted and statement.status == StatementStatus.OPEN:
                        items.append((statement, membership(statement, previous)))
            lines = _rate_many(items)
            for statement, _ in items:
                before = statement.entry_count
                _store_lines(statement, lines[statement.pk], now, version)
                statement.save(update_fields=["rated_at", "entry_count", "price_book"])
                rebuilt += 1
                joined += statement.entry_count - before
    return rebuilt, joined


def rate_pending(*, now: datetime | None = None) -> int:
    """Create the statements new usage needs and re-rate the open statements it joined.

    Returns how many entries joined statements (0 when nothing new arrived: a replayed
    request id is not a new entry, so it changes nothing)."""
    now = now or timezone.now()
    _create_statements(now)
    version = price_book_version()
    _, joined = rebuild_statements(
        _stale(now, tenant=None, force=False, version=version), now, version
    )
    return joined


def refresh_open(
    *, now: datetime | None = None, tenant: Tenant | None = None, force: bool = False
) -> int:
    """Re-rate the open statements that are out of date (all of them with `force`), e.g.
    after a price was added or corrected; returns how many were rebuilt."""
    now = now or timezone.now()
    version = price_book_version()
    rebuilt, _ = rebuild_statements(
        _stale(now, tenant=tenant, force=force, version=version), now, version
    )
    return rebuilt


def close_statements(*, now: datetime | None = None) -> list[int]:
    """Rate what is pending, then close every open statement whose period has ended, in
    period order per tenant, each with its final lines and the ledger watermark.

    Returns the ids closed by this call; a second call (or a retry) closes nothing more."""
    now = now or timezone.now()
    rate_pending(now=now)
    due = (
        Statement.objects.filter(status=StatementStatus.OPEN, period_end__lte=now)
        .values_list("tenant_id", flat=True)
        .distinct()
    )
    tenants = sorted(set(due))
    if not tenants:
        return []
    watermark = ledger_watermark()
    version = price_book_version()
    closed = []
    successors = []
    for tenant_id in tenants:
        with transaction.atomic():
            _lock_tenants([tenant_id])
            chain = _chains([tenant_id]).get(tenant_id, [])
            for statement, previous in _with_previous(chain):
                if statement.status != StatementStatus.OPEN:
                    continue  # closed before (or by a concurrent run first)
                if statement.period_end > now:
                    break  # later ones are not due either
                # Watermarks grow along the chain (a concurrent run may have used a later one).
                cap = max(watermark, (previous.last_entry_id or 0) if previous else 0)
                lines = _rate_many([(statement, membership(statement, previous, cap=cap))])
                _store_lines(statement, lines[statement.pk], now, version)
                statement.status = StatementStatus.CLOSED
                statement.closed_at = now
                statement.last_entry_id = cap
                statement.save(
                    update_fields=[
                        "rated_at",
                        "entry_count",
                        "price_book",
                        "status",
                        "closed_at",
                        "last_entry_id",
                    ]
                )
                closed.append(statement.pk)
            later = [st for st in chain if st.period_start > statement.period_start]
            if closed and later and later[0].status == StatementStatus.OPEN:
                successors.append(later[0].pk)  # late usage of the closed one moves there
    if successors:
        rebuild_statements(successors, now, version)
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
