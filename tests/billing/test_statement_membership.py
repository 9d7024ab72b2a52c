"""Statement membership by (tenant, created_at range, close watermark), rating by price buckets,
and re-rating only what changed (billing/statements.py, billing/rating.py)."""

from __future__ import annotations

import random
from datetime import timedelta
from decimal import Decimal

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from billing.models import Statement, UsageEntry
from tests.billing.test_pricing_and_statements import (  # noqa: F401 (fixtures)
    _snapshot,
    _statement,
    at,
    price,
    usage,
)


def _reference_lines(entries):
    """Rating the slow, obvious way: each entry with its own price in force (the correlated
    subqueries of rating.with_price), summed in Python."""
    from billing.models import ModelPrice
    from billing.rating import component, round_amount

    sums: dict[tuple, list[int]] = {}
    for e in __import__("billing.rating", fromlist=["with_price"]).with_price(entries):
        key = (e.tenant_id, e.model, e.price_ref)
        s = sums.setdefault(key, [0, 0, 0, 0])
        s[0] += 1
        s[1] += e.prompt_tokens - e.cached_tokens
        s[2] += e.cached_tokens
        s[3] += e.completion_tokens
    prices = ModelPrice.objects.in_bulk([k[2] for k in sums if k[2]])
    out = {}
    for (tenant_id, model, ref), (n, inp, cached, outp) in sums.items():
        p = prices.get(ref)
        full = (
            component(inp, p and p.input_per_mtok)
            + component(cached, p and p.cached_input_per_mtok)
            + component(outp, p and p.output_per_mtok)
        )
        out[(tenant_id, model, ref)] = (
            n,
            inp,
            cached,
            outp,
            round_amount(full, p.currency if p else ""),
        )
    return out


@pytest.fixture
def busy(tiny, big, acme, globex):
    """Three months of usage of two tenants on two models: list prices that change mid-month
    and end (a gap: unpriced), a contract price for acme starting mid-month."""
    price(tiny, inp="0.50", cached="0.05", out="1.50", start=at(1, 1), end=at(1, 16))
    price(tiny, inp="0.60", cached="0.06", out="1.80", start=at(1, 16), end=at(3, 10))
    price(tiny, inp="0.70", cached="0.07", out="2.10", start=at(3, 12))  # Mar 10-12 unpriced
    price(big, inp="3.00", cached="0.30", out="9.00", start=at(1, 1))
    price(big, inp="2.40", cached="0.24", out="7.20", start=at(2, 5, 12), tenant=acme)
    rng = random.Random(7)
    span = int((at(4, 1) - at(1, 1)).total_seconds())
    for i in range(240):
        tenant = acme if rng.random() < 0.6 else globex
        model = "baton-tiny" if rng.random() < 0.7 else "baton-big"
        when = at(1, 1) + timedelta(seconds=rng.randrange(span))
        prompt = rng.randint(1, 3_000_000)
        usage(
            f"b{i}",
            tenant,
            model,
            when,
            prompt=prompt,
            cached=rng.randint(0, prompt),
            completion=rng.randint(0, 1_000_000),
        )
    return rng


def test_bucket_rating_matches_rating_each_entry_with_its_price(busy):
    from billing.rating import rate

    lines = rate(UsageEntry.objects.all())
    got = {
        (line.tenant_id, line.model, line.price.pk if line.price else None): (
            line.requests,
            line.input_tokens,
            line.cached_tokens,
            line.output_tokens,
            line.amount,
        )
        for line in lines
    }
    assert len(got) == len(lines)  # one line per tenant, model and price
    assert got == _reference_lines(UsageEntry.objects.all())
    assert any(key[2] is None for key in got)  # the unpriced gap is a line of its own


def test_revenue_rows_match_rating_each_entry(busy):
    from billing.margin import revenue_rows

    rows = revenue_rows(at(1, 1), at(4, 1))
    assert sum(r["requests"] for r in rows) == UsageEntry.objects.count()
    by_price: dict = {}
    for r in rows:
        by_price[(r["model"], r["price_ref"])] = (
            by_price.get((r["model"], r["price_ref"]), 0) + (r["requests"])
        )
    reference: dict = {}
    for (_, model, ref), line in _reference_lines(UsageEntry.objects.all()).items():
        reference[(model, ref)] = reference.get((model, ref), 0) + line[0]
    assert by_price == reference


def _every_entry_billed_once():
    from billing.statements import entries_of, statement_of

    billed: dict[int, int] = {}
    for st in Statement.objects.all():
        members = set(entries_of(st).values_list("pk", flat=True))
        assert st.entry_count == len(members), st
        for pk in members:
            assert pk not in billed, f"entry {pk} on statements {billed[pk]} and {st.pk}"
            billed[pk] = st.pk
    for entry in UsageEntry.objects.all():
        found = statement_of(entry)
        assert billed.get(entry.pk) == (found.pk if found else None), entry
    return billed


def test_every_entry_is_billed_once_through_closes_and_late_usage(busy):
    from billing.statements import close_statements

    rng = busy
    frozen = {}
    n = 0
    for now in (at(2, 1, 0, 5), at(2, 20), at(3, 1, 0, 5), at(3, 15), at(4, 1, 0, 5), at(4, 2)):
        close_statements(now=now)
        _every_entry_billed_once()
        for st in Statement.objects.filter(status="closed"):
            snap = (_snapshot(st), st.last_entry_id, st.closed_at)
            assert frozen.setdefault(st.pk, snap) == snap  # a closed statement never changes
        # Late usage: dated in any month so far, some of them closed.
        for _ in range(5):
            n += 1
            when = at(1, 1) + timedelta(
                seconds=rng.randrange(int((now - at(1, 1)).total_seconds()))
            )
            usage(
                f"late{n}", busy_tenant(n), "baton-tiny", when, prompt=1000, cached=0, completion=1
            )
    close_statements(now=at(4, 3))
    billed = _every_entry_billed_once()
    assert len(billed) == UsageEntry.objects.count()
    adjustments = [
        line for st in Statement.objects.all() for line in st.lines.all() if line.adjustment
    ]
    assert adjustments and all(line.statement.period_start > at(1, 1) for line in adjustments)


def busy_tenant(n):
    from billing.models import Tenant

    return Tenant.objects.get(name="acme" if n % 2 else "globex")


def test_building_statements_writes_no_ledger_row(january, acme):
    from billing.statements import close_statements, rate_pending

    with CaptureQueriesContext(connection) as queries:
        assert rate_pending(now=at(1, 20)) == 4
        close_statements(now=at(2, 1, 0, 5))
    writes = [
        q["sql"]
        for q in queries.captured_queries
        if q["sql"].lstrip().upper().startswith(("UPDATE", "INSERT", "DELETE"))
        and "billing_usageentry" in q["sql"].split("WHERE")[0]
    ]
    assert writes == []


def test_only_changed_open_statements_are_re_rated(january, tiny, acme, globex):
    from billing.statements import rate_pending, refresh_open

    usage("g1", globex, "baton-tiny", at(1, 5), prompt=1_000_000, cached=0, completion=0)
    assert rate_pending(now=at(1, 20)) == 5
    acme_jan, globex_jan = _statement(acme, at(1, 1)), _statement(globex, at(1, 1))
    rated = {st.pk: st.rated_at for st in (acme_jan, globex_jan)}
    assert refresh_open(now=at(1, 21)) == 0  # nothing changed: nothing re-rated
    # A new entry of globex's: only globex's statement is re-rated.
    usage("g2", globex, "baton-tiny", at(1, 6), prompt=1_000_000, cached=0, completion=0)
    assert rate_pending(now=at(1, 22)) == 1
    acme_jan.refresh_from_db()
    globex_jan.refresh_from_db()
    assert acme_jan.rated_at == rated[acme_jan.pk]
    assert globex_jan.rated_at == at(1, 22) and globex_jan.entry_count == 2
    # A price correction re-rates every open statement.
    from billing.models import ModelPrice

    p = ModelPrice.objects.get(effective_from=at(1, 16))
    p.output_per_mtok = Decimal("2.00")
    p.save()
    assert refresh_open(now=at(1, 23)) == 2
    assert refresh_open(now=at(1, 23)) == 0
    # force re-rates all of them anyway.
    assert refresh_open(now=at(1, 24), force=True) == 2


def test_a_late_entry_knows_its_statement(january, acme):
    from billing.statements import close_statements

    close_statements(now=at(2, 1, 0, 5))
    january_statement = _statement(acme, at(1, 1))
    late, _ = usage("late", acme, "baton-tiny", at(1, 20), prompt=10, cached=0, completion=0)
    assert late.statement is None  # no open statement yet
    close_statements(now=at(2, 2))
    february = _statement(acme, at(2, 1))
    entry = UsageEntry.objects.select_related("tenant", "statement").get(request_id="late")
    assert entry.statement_id == february.id and entry.statement.status == "open"
    assert UsageEntry.objects.get(request_id="r1").statement_id == january_statement.id
    assert january_statement.last_entry_id == UsageEntry.objects.get(request_id="r4").pk


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_an_insert_in_flight_at_the_close_is_billed_once(january, acme):
    """An entry written in a transaction that commits while January closes: the close waits
    for it (the watermark's SHARE lock), so it is on January or, if written later, late."""
    import threading
    import time

    from django.db import connections, transaction

    from billing.models import Tenant
    from billing.statements import close_statements

    inserted = threading.Event()

    def writer():
        try:
            with transaction.atomic():
                entry = UsageEntry.objects.create(
                    request_id="inflight",
                    tenant=Tenant.objects.get(pk=acme.pk),
                    model="baton-tiny",
                    prompt_tokens=1_000_000,
                    cached_tokens=0,
                    completion_tokens=0,
                )
                UsageEntry.objects.filter(pk=entry.pk).update(created_at=at(1, 31, 23, 59, 59))
                inserted.set()
                time.sleep(1.0)  # the close starts meanwhile
        finally:
            connections.close_all()

    thread = threading.Thread(target=writer)
    thread.start()
    assert inserted.wait(10)
    closed = close_statements(now=at(2, 1, 0, 5))
    thread.join(10)
    january_statement = _statement(acme, at(1, 1))
    assert closed == [january_statement.id]
    assert january_statement.entry_count == 5  # r1-r4 and the one in flight
    assert UsageEntry.objects.get(request_id="inflight").statement_id == january_statement.id


def test_renaming_a_priced_model_re_rates_the_open_statements(january, tiny, acme):
    from billing.statements import rate_pending, refresh_open

    rate_pending(now=at(1, 20))
    assert refresh_open(now=at(1, 21)) == 0
    tiny.name = "baton-tiny-v2"  # usage is matched to prices by the model's name
    tiny.save()
    assert refresh_open(now=at(1, 22)) == 1
    (line,) = _statement(acme, at(1, 1)).lines.all()
    assert (line.price_id, line.requests, line.amount) == (None, 4, Decimal("0"))
