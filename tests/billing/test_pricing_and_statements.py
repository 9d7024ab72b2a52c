"""The price book, rating of the usage ledger, statements and their closing, tenant self-service.

Amounts in the expected values are worked out by hand in the comments next to them.
"""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

import pytest
from django.urls import include, path
from rest_framework.test import APIClient

from billing import pricing, services
from billing.models import ModelPrice, Tenant, UsageEntry
from fleet.models import ServedModel


@pytest.fixture
def tiny(db) -> ServedModel:
    return ServedModel.objects.create(
        name="baton-tiny", source="baton-tiny", num_layers=2, kv_bytes_per_token=1024
    )


@pytest.fixture
def big(db) -> ServedModel:
    return ServedModel.objects.create(
        name="baton-big", source="baton-tiny", num_layers=4, kv_bytes_per_token=2048
    )


@pytest.fixture
def acme(db) -> Tenant:
    return Tenant.objects.create(name="acme")


@pytest.fixture
def globex(db) -> Tenant:
    return Tenant.objects.create(name="globex")


def at(month: int, day: int, hour: int = 0, minute: int = 0, year: int = 2026) -> datetime:
    return datetime(year, month, day, hour, minute, tzinfo=UTC)


def price(model, *, inp, cached, out, start, end=None, tenant=None, currency="USD"):
    return pricing.model_price_save(
        price=ModelPrice(
            served_model=model,
            tenant=tenant,
            input_per_mtok=Decimal(inp),
            cached_input_per_mtok=Decimal(cached),
            output_per_mtok=Decimal(out),
            currency=currency,
            effective_from=start,
            effective_to=end,
        )
    )


def usage(request_id, tenant, model, when, *, prompt, cached, completion, key=None):
    """Write a ledger line as the gateway does, then date it (created_at is auto_now_add)."""
    entry, created = services.usage_record(
        request_id=request_id,
        tenant=tenant,
        api_key=key,
        model=model,
        prompt_tokens=prompt,
        cached_tokens=cached,
        completion_tokens=completion,
    )
    if created:
        UsageEntry.objects.filter(pk=entry.pk).update(created_at=when)
        entry.refresh_from_db()
    return entry, created


# --- the price book -------------------------------------------------------------------------


def _price_body(model, **kw):
    body = {
        "served_model": model.id,
        "input_per_mtok": "0.500000",
        "cached_input_per_mtok": "0.050000",
        "output_per_mtok": "1.500000",
        "currency": "USD",
        "effective_from": "2026-01-01T00:00:00Z",
    }
    body.update(kw)
    return body


def test_operator_writes_prices_and_viewer_reads_them(operator, viewer, tiny):
    created = operator.post("/api/v1/model-prices/", _price_body(tiny), format="json")
    assert created.status_code == 201, created.json()
    assert created.json()["model_name"] == "baton-tiny"
    assert created.json()["tenant"] is None
    listed = viewer.get("/api/v1/model-prices/")
    assert listed.status_code == 200
    assert [p["id"] for p in listed.json()["results"]] == [created.json()["id"]]


def test_viewer_cannot_write_prices(viewer, tiny):
    response = viewer.post("/api/v1/model-prices/", _price_body(tiny), format="json")
    assert response.status_code == 403
    assert not ModelPrice.objects.exists()


def test_overlapping_list_prices_are_refused_with_400(operator, tiny):
    first = operator.post(
        "/api/v1/model-prices/",
        _price_body(tiny, effective_to="2026-03-01T00:00:00Z"),
        format="json",
    )
    assert first.status_code == 201, first.json()
    clash = operator.post(
        "/api/v1/model-prices/",
        _price_body(tiny, effective_from="2026-02-01T00:00:00Z"),
        format="json",
    )
    assert clash.status_code == 400
    assert "effective_from" in clash.json()
    # Adjacent ([from, to) is exclusive at the end) is fine, and so is an open-ended successor.
    after = operator.post(
        "/api/v1/model-prices/",
        _price_body(tiny, effective_from="2026-03-01T00:00:00Z"),
        format="json",
    )
    assert after.status_code == 201, after.json()
    # Moving the first period's end into the second is refused too (update path).
    stretch = operator.patch(
        f"/api/v1/model-prices/{first.json()['id']}/",
        {"effective_to": "2026-03-15T00:00:00Z"},
        format="json",
    )
    assert stretch.status_code == 400
    assert "effective_from" in stretch.json()


def test_a_contract_price_may_overlap_the_list_but_not_another_contract(operator, tiny, acme):
    assert (
        operator.post("/api/v1/model-prices/", _price_body(tiny), format="json").status_code == 201
    )
    contract = _price_body(tiny, tenant=acme.id, input_per_mtok="0.400000")
    assert operator.post("/api/v1/model-prices/", contract, format="json").status_code == 201
    again = operator.post("/api/v1/model-prices/", contract, format="json")
    assert again.status_code == 400
    assert "effective_from" in again.json()


@pytest.mark.parametrize(
    "field, value",
    [
        ("input_per_mtok", "-0.01"),
        ("output_per_mtok", "1e400"),
        ("cached_input_per_mtok", "0.0000001"),
        ("currency", "XYZ"),
        ("effective_to", "2025-12-01T00:00:00Z"),
        ("served_model", 999999),
    ],
)
def test_invalid_prices_are_400s_naming_the_field(operator, tiny, field, value):
    response = operator.post(
        "/api/v1/model-prices/", _price_body(tiny, **{field: value}), format="json"
    )
    assert response.status_code == 400
    assert field in response.json(), response.json()


def test_contract_price_overrides_the_list_price_where_in_force(tiny, acme, globex):
    listed = price(tiny, inp="0.50", cached="0.05", out="1.50", start=at(1, 1))
    contract = price(
        tiny, inp="0.40", cached="0.04", out="1.20", start=at(2, 1), end=at(3, 1), tenant=acme
    )
    assert pricing.price_in_force(tenant=acme, model="baton-tiny", when=at(1, 15)) == listed
    assert pricing.price_in_force(tenant=acme, model="baton-tiny", when=at(2, 15)) == contract
    assert pricing.price_in_force(tenant=acme, model="baton-tiny", when=at(3, 1)) == listed
    assert pricing.price_in_force(tenant=globex, model="baton-tiny", when=at(2, 15)) == listed
    assert pricing.price_in_force(tenant=acme, model="baton-tiny", when=at(1, 1, year=2025)) is None


# --- rating ---------------------------------------------------------------------------------


@pytest.fixture
def january(tiny, acme):
    """Acme's January on baton-tiny: a list-price change on the 16th, cached input at 1/10th.

    Until the 16th: 0.50 input, 0.05 cached input, 1.50 output per 1M tokens; from then on
    0.60 / 0.06 / 1.80.
    """
    price(tiny, inp="0.50", cached="0.05", out="1.50", start=at(1, 1), end=at(1, 16))
    price(tiny, inp="0.60", cached="0.06", out="1.80", start=at(1, 16))
    usage("r1", acme, "baton-tiny", at(1, 3), prompt=1_000_000, cached=400_000, completion=200_000)
    usage("r2", acme, "baton-tiny", at(1, 15, 23, 59), prompt=12_345, cached=10_000, completion=789)
    usage(
        "r3", acme, "baton-tiny", at(1, 16), prompt=2_000_000, cached=1_500_000, completion=500_000
    )
    usage("r4", acme, "baton-tiny", at(1, 31, 23, 59), prompt=25_000, cached=0, completion=0)


# Before the change (r1 + r2): 602,345 uncached input, 410,000 cached, 200,789 output tokens:
#   input  602,345 x 0.50 / 1M = 0.3011725
#   cached 410,000 x 0.05 / 1M = 0.0205
#   output 200,789 x 1.50 / 1M = 0.3011835
#   line   0.622856 -> 0.62
# After the change (r3 + r4): 525,000 uncached, 1,500,000 cached, 500,000 output tokens:
#   input  525,000 x 0.60 / 1M = 0.315
#   cached 1,500,000 x 0.06 / 1M = 0.09
#   output 500,000 x 1.80 / 1M = 0.90
#   line   1.305 -> 1.30 (half to even; half up would say 1.31)
# Total 0.62 + 1.30 = 1.92.
JANUARY_LINES = [
    {
        "requests": 2,
        "input_tokens": 602_345,
        "cached_tokens": 410_000,
        "output_tokens": 200_789,
        "input_amount": Decimal("0.3011725"),
        "cached_amount": Decimal("0.0205"),
        "output_amount": Decimal("0.3011835"),
        "amount": Decimal("0.62"),
    },
    {
        "requests": 2,
        "input_tokens": 525_000,
        "cached_tokens": 1_500_000,
        "output_tokens": 500_000,
        "input_amount": Decimal("0.315"),
        "cached_amount": Decimal("0.09"),
        "output_amount": Decimal("0.90"),
        "amount": Decimal("1.30"),
    },
]


def _line_dict(line) -> dict:
    return {key: getattr(line, key) for key in JANUARY_LINES[0]}


def test_rating_a_hand_computed_month_with_a_mid_period_price_change(january):
    from billing.rating import rate

    lines = rate(UsageEntry.objects.all())
    assert [_line_dict(line) for line in lines] == JANUARY_LINES
    assert [line.price.input_per_mtok for line in lines] == [Decimal("0.5"), Decimal("0.6")]
    assert sum(line.amount for line in lines) == Decimal("1.92")


def test_rating_again_gives_the_same_lines(january):
    from billing.rating import rate

    assert rate(UsageEntry.objects.all()) == rate(UsageEntry.objects.all())


def test_rating_uses_the_contract_price_first(tiny, acme, globex):
    from billing.rating import rate

    price(tiny, inp="1.00", cached="0.10", out="2.00", start=at(1, 1))
    price(tiny, inp="0.80", cached="0.08", out="1.60", start=at(1, 10), tenant=acme)
    for tenant in (acme, globex):
        for day in (5, 20):
            usage(
                f"{tenant.name}-{day}",
                tenant,
                "baton-tiny",
                at(1, day),
                prompt=1_000_000,
                cached=0,
                completion=1_000_000,
            )
    by_tenant = {}
    for line in rate(UsageEntry.objects.all()):
        by_tenant.setdefault(line.tenant_id, []).append((line.requests, line.amount))
    # acme: the 5th at list (1.00 + 2.00), the 20th under contract (0.80 + 1.60).
    assert by_tenant[acme.id] == [(1, Decimal("3.00")), (1, Decimal("2.40"))]
    # globex has no contract: both days at list, one line.
    assert by_tenant[globex.id] == [(2, Decimal("6.00"))]


def test_usage_without_a_price_is_rated_as_unpriced(acme):
    from billing.rating import rate

    usage("u1", acme, "no-such-model", at(1, 1), prompt=10, cached=0, completion=10)
    (line,) = rate(UsageEntry.objects.all())
    assert line.price is None and line.amount == Decimal("0") and line.requests == 1


def test_rating_is_one_aggregate_query_whatever_the_number_of_entries(
    tiny, acme, django_assert_max_num_queries
):
    from billing.rating import rate

    price(tiny, inp="1", cached="0.1", out="2", start=at(1, 1))
    for i in range(30):
        usage(f"n{i}", acme, "baton-tiny", at(1, 2), prompt=100, cached=10, completion=5)
    with django_assert_max_num_queries(2):  # the grouped sums, then the prices by id
        (line,) = rate(UsageEntry.objects.all())
    assert line.requests == 30


# --- statements -----------------------------------------------------------------------------


def _statement(tenant, start):
    from billing.models import Statement

    return Statement.objects.get(tenant=tenant, period_start=start)


def _snapshot(statement) -> list[tuple]:
    return list(
        statement.lines.order_by("id").values_list(
            "id",
            "model",
            "adjustment",
            "requests",
            "input_tokens",
            "cached_tokens",
            "output_tokens",
            "amount",
        )
    )


def test_closing_january_gives_the_hand_computed_statement(january, acme, viewer):
    from billing.statements import close_statements

    closed = close_statements(now=at(2, 1, 0, 5))
    january_statement = _statement(acme, at(1, 1))
    assert closed == [january_statement.id]
    assert january_statement.status == "closed"
    assert [_line_dict(line) for line in january_statement.lines.all()] == JANUARY_LINES

    body = viewer.get(f"/api/v1/statements/{january_statement.id}/").json()
    assert body["status"] == "closed"
    assert body["totals"] == [{"currency": "USD", "amount": "1.92"}]
    first, second = body["lines"]
    assert (first["kind"], first["contract"], first["currency"]) == ("usage", False, "USD")
    assert (first["input_per_mtok"], first["cached_input_per_mtok"]) == ("0.500000", "0.050000")
    assert (first["input_amount"], first["cached_amount"], first["output_amount"]) == (
        "0.301172500000",
        "0.020500000000",
        "0.301183500000",
    )
    assert (first["amount"], second["amount"]) == ("0.62", "1.30")
    assert second["output_per_mtok"] == "1.800000"


def test_closing_twice_is_a_no_op(january, acme):
    from billing.statements import close_statements
    from billing.tasks import close_statements as task

    close_statements(now=at(2, 1, 0, 5))
    statement = _statement(acme, at(1, 1))
    before = (_snapshot(statement), statement.closed_at, statement.rated_at)
    assert close_statements(now=at(2, 1, 0, 10)) == []
    assert task.apply().get() == []  # the beat's task, now: nothing more to close
    statement.refresh_from_db()
    assert (_snapshot(statement), statement.closed_at, statement.rated_at) == before


def test_an_open_period_is_rated_but_not_closed(january, acme):
    from billing.statements import close_statements

    assert close_statements(now=at(1, 20)) == []
    statement = _statement(acme, at(1, 1))
    assert statement.status == "open"
    assert [_line_dict(line) for line in statement.lines.all()] == JANUARY_LINES


def test_replaying_a_day_of_usage_events_changes_nothing(january, acme):
    from billing.statements import close_statements, rate_pending

    rate_pending(now=at(1, 20))
    before = _snapshot(_statement(acme, at(1, 1)))
    ledger = list(UsageEntry.objects.order_by("pk").values())
    # The gateway replays every event of January 15th-16th (same request ids, other numbers).
    for request_id, when in [("r2", at(1, 15, 23, 59)), ("r3", at(1, 16))]:
        entry, created = usage(
            request_id, acme, "baton-tiny", when, prompt=9_999_999, cached=0, completion=9
        )
        assert not created
    assert list(UsageEntry.objects.order_by("pk").values()) == ledger
    assert rate_pending(now=at(1, 21)) == 0
    assert _snapshot(_statement(acme, at(1, 1))) == before
    close_statements(now=at(2, 1, 0, 5))
    statement = _statement(acme, at(1, 1))
    assert [_line_dict(line) for line in statement.lines.all()] == JANUARY_LINES


def test_late_usage_lands_in_the_next_open_period_as_an_adjustment(january, acme, viewer):
    from billing.statements import close_statements

    close_statements(now=at(2, 1, 0, 5))
    january_statement = _statement(acme, at(1, 1))
    frozen = _snapshot(january_statement)
    # Arrives after January closed, dated in January (at the 0.60/0.06/1.80 price) ...
    usage("late-1", acme, "baton-tiny", at(1, 31, 23, 59), prompt=100_000, cached=0, completion=0)
    # ... and one of February's own.
    usage("feb-1", acme, "baton-tiny", at(2, 2), prompt=0, cached=0, completion=1_000_000)
    assert close_statements(now=at(2, 10)) == []
    assert _snapshot(january_statement) == frozen
    february = _statement(acme, at(2, 1))
    lines = {line.adjustment: line for line in february.lines.all()}
    # late: 100,000 x 0.60 / 1M = 0.06; February: 1,000,000 x 1.80 / 1M = 1.80.
    assert (lines[True].requests, lines[True].amount) == (1, Decimal("0.06"))
    assert (lines[False].requests, lines[False].amount) == (1, Decimal("1.80"))
    body = viewer.get(f"/api/v1/statements/{february.id}/").json()
    assert [line["kind"] for line in body["lines"]] == ["usage", "adjustment"]
    assert body["totals"] == [{"currency": "USD", "amount": "1.86"}]
    # February closes with both lines; January still unchanged.
    assert close_statements(now=at(3, 1)) == [february.id]
    assert _snapshot(january_statement) == frozen
    assert UsageEntry.objects.get(request_id="late-1").statement_id == february.id


def test_late_usage_skips_every_closed_period(january, acme):
    from billing.statements import close_statements

    usage("feb-1", acme, "baton-tiny", at(2, 2), prompt=0, cached=0, completion=1)
    close_statements(now=at(3, 1, 0, 5))  # January and February both close
    usage("late", acme, "baton-tiny", at(1, 5), prompt=1_000_000, cached=0, completion=0)
    close_statements(now=at(3, 2))
    march = _statement(acme, at(3, 1))
    (line,) = march.lines.all()
    # Rated at the price in force on January 5th: 1,000,000 x 0.50 / 1M.
    assert (line.adjustment, line.amount) == (True, Decimal("0.50"))


def test_contract_lines_are_marked_and_priced_with_the_contract(tiny, acme):
    from billing.statements import close_statements

    price(tiny, inp="1.00", cached="0.10", out="2.00", start=at(1, 1))
    price(tiny, inp="0.80", cached="0.08", out="1.60", start=at(1, 1), tenant=acme)
    usage("c1", acme, "baton-tiny", at(1, 5), prompt=1_000_000, cached=500_000, completion=0)
    close_statements(now=at(2, 1))
    (line,) = _statement(acme, at(1, 1)).lines.all()
    # 500,000 x 0.80 / 1M + 500,000 x 0.08 / 1M = 0.40 + 0.04
    assert (line.contract, line.amount) == (True, Decimal("0.44"))


def test_csv_matches_json(january, acme, viewer):
    import csv
    import io

    from billing.statements import close_statements

    close_statements(now=at(2, 1, 0, 5))
    statement = _statement(acme, at(1, 1))
    body = viewer.get(f"/api/v1/statements/{statement.id}/").json()
    response = viewer.get(f"/api/v1/statements/{statement.id}/csv/")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(response.content.decode())))
    lines, totals = rows[:-1], rows[-1:]
    assert len(lines) == len(body["lines"]) == 2
    for row, line in zip(lines, body["lines"], strict=True):
        assert row["statement"] == str(body["id"])
        assert row["tenant"] == "acme"
        assert row["period_start"] == body["period_start"]
        assert row["status"] == "closed"
        for name, value in line.items():
            expected = "" if value is None else value
            if isinstance(value, bool):
                expected = "true" if value else "false"
            assert row[name] == str(expected), name
    assert [(t["kind"], t["currency"], t["amount"]) for t in totals] == [("total", "USD", "1.92")]


def test_statements_are_listed_and_filtered(january, tiny, globex, viewer):
    from billing.statements import close_statements

    usage("g1", globex, "baton-tiny", at(2, 3), prompt=10, cached=0, completion=1)
    close_statements(now=at(2, 5))
    all_ = viewer.get("/api/v1/statements/").json()["results"]
    assert sorted((r["tenant_name"], r["period_start"][:7], r["status"]) for r in all_) == [
        ("acme", "2026-01", "closed"),
        ("globex", "2026-02", "open"),
    ]
    assert "lines" not in all_[0]
    only = viewer.get("/api/v1/statements/", {"tenant": globex.id}).json()["results"]
    assert [r["tenant_name"] for r in only] == ["globex"]
    jan = viewer.get("/api/v1/statements/", {"period": "2026-01"}).json()["results"]
    assert [r["tenant_name"] for r in jan] == ["acme"]
    bad = viewer.get("/api/v1/statements/", {"period": "2026-13"})
    assert bad.status_code == 400 and "period" in bad.json()


def test_viewers_cannot_rate_or_write_statements(january, viewer, operator):
    assert viewer.post("/api/v1/statements/rate/").status_code == 403
    rated = operator.post("/api/v1/statements/rate/")
    assert rated.status_code == 200 and rated.json() == {"assigned": 4}
    assert operator.post("/api/v1/statements/", {}, format="json").status_code == 405


def test_the_close_task_is_on_the_beat_schedule():
    from django.conf import settings

    from controlplane.celery import app

    entries = [
        e for e in settings.CELERY_BEAT_SCHEDULE.values() if e["task"] == "billing.close_statements"
    ]
    assert len(entries) == 1
    assert "billing.close_statements" in app.tasks


def test_management_command_prints_a_month_and_a_range(january, acme):
    import json

    from django.core.management import call_command
    from django.core.management.base import CommandError

    from billing.statements import close_statements

    close_statements(now=at(2, 1, 0, 5))
    out = io_out()
    call_command("billing_statement", "acme", "--month", "2026-01", stdout=out)
    document = json.loads(out.getvalue())
    assert document["status"] == "closed"
    assert document["totals"] == [{"currency": "USD", "amount": "1.92"}]

    out = io_out()
    call_command("billing_statement", "acme", "--month", "2026-01", "--format", "csv", stdout=out)
    assert out.getvalue().splitlines()[-1].endswith(",closed,total,,,,,,,,USD,,,,,,,1.92")

    # Any [start, end): the 16th onwards is the second line alone.
    out = io_out()
    call_command(
        "billing_statement",
        "acme",
        "--start",
        "2026-01-16T00:00:00Z",
        "--end",
        "2026-02-01T00:00:00Z",
        stdout=out,
    )
    ranged = json.loads(out.getvalue())
    assert ranged["status"] == "preview" and ranged["id"] is None
    assert [line["amount"] for line in ranged["lines"]] == ["1.30"]

    with pytest.raises(CommandError):
        call_command("billing_statement", "acme", "--month", "2026-1")
    with pytest.raises(CommandError):
        call_command("billing_statement", "nobody")


def io_out():
    import io

    return io.StringIO()


# --- tenant self-service --------------------------------------------------------------------
# The tenant URLs are not in controlplane/urls.py yet: these tests mount them beside it.

urlpatterns = [
    path("", include("billing.tenant_urls")),
    path("", include("controlplane.urls")),
]
TENANT_URLS = pytest.mark.urls(__name__)


def _bearer(raw: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    return client


@pytest.fixture
def acme_key(acme):
    key, raw = services.api_key_create(tenant=acme, name="ci")
    return key, _bearer(raw)


@pytest.fixture
def globex_client(globex) -> APIClient:
    _, raw = services.api_key_create(tenant=globex)
    return _bearer(raw)


def _ts(when: datetime) -> int:
    return int(when.timestamp())


@TENANT_URLS
def test_a_tenant_reads_its_daily_usage_buckets(january, acme, acme_key, globex, globex_client):
    key, client = acme_key
    UsageEntry.objects.filter(request_id="r1").update(api_key=key)
    usage("g1", globex, "baton-tiny", at(1, 15, 12), prompt=777, cached=7, completion=77)
    response = client.get(
        "/v1/organization/usage/completions",
        {"start_time": _ts(at(1, 15)), "end_time": _ts(at(1, 17)), "bucket_width": "1d"},
    )
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["object"] == "page" and body["has_more"] is False
    assert [(b["start_time"], b["end_time"]) for b in body["data"]] == [
        (_ts(at(1, 15)), _ts(at(1, 16))),
        (_ts(at(1, 16)), _ts(at(1, 17))),
    ]
    # Only acme's r2 on the 15th (globex's g1 is not there) and r3 on the 16th.
    (day15,) = body["data"][0]["results"]
    assert (
        day15["input_tokens"],
        day15["input_cached_tokens"],
        day15["output_tokens"],
        day15["num_model_requests"],
    ) == (12_345, 10_000, 789, 1)
    (day16,) = body["data"][1]["results"]
    assert (day16["input_tokens"], day16["num_model_requests"]) == (2_000_000, 1)

    grouped = client.get(
        "/v1/organization/usage/completions",
        {
            "start_time": _ts(at(1, 1)),
            "end_time": _ts(at(2, 1)),
            "group_by": "model,api_key_id",
            "limit": 31,
        },
    ).json()
    results = [r for b in grouped["data"] for r in b["results"]]
    assert sum(r["num_model_requests"] for r in results) == 4
    assert {r["model"] for r in results} == {"baton-tiny"}
    assert {r["api_key_id"] for r in results} == {key.prefix, None}


@TENANT_URLS
def test_usage_buckets_page_by_day(january, acme_key):
    _, client = acme_key
    query = {"start_time": _ts(at(1, 1)), "end_time": _ts(at(2, 1)), "limit": 7}
    first = client.get("/v1/organization/usage/completions", query).json()
    assert len(first["data"]) == 7 and first["has_more"] is True
    assert first["next_page"] == str(_ts(at(1, 8)))
    days = len(first["data"])
    page = first
    while page["has_more"]:
        page = client.get(
            "/v1/organization/usage/completions", {**query, "page": page["next_page"]}
        ).json()
        days += len(page["data"])
    assert days == 31


@TENANT_URLS
@pytest.mark.parametrize(
    "query, param",
    [
        ({}, "start_time"),
        ({"start_time": "yesterday"}, "start_time"),
        ({"start_time": 10**30}, "start_time"),
        ({"start_time": 1767225600, "end_time": 1767225600}, "end_time"),
        ({"start_time": 1767225600, "bucket_width": "1h"}, "bucket_width"),
        ({"start_time": 1767225600, "group_by": "project_id"}, "group_by"),
        ({"start_time": 1767225600, "limit": 32}, "limit"),
    ],
)
def test_bad_usage_queries_are_400s_naming_the_parameter(acme_key, query, param):
    _, client = acme_key
    response = client.get("/v1/organization/usage/completions", query)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


@TENANT_URLS
def test_the_tenant_api_needs_a_valid_key(acme, operator):
    assert APIClient().get("/v1/organization/statements").status_code == 401
    assert _bearer("sk-baton-nope-nope").get("/v1/organization/statements").status_code == 401
    # An operator's control-plane token is not a tenant key.
    assert operator.get("/v1/organization/statements").status_code == 401


@TENANT_URLS
def test_a_tenant_reads_its_own_statements_and_nothing_of_another(
    january, acme, acme_key, globex, globex_client
):
    from billing.statements import close_statements

    usage("g1", globex, "baton-tiny", at(1, 15, 12), prompt=1_000_000, cached=0, completion=0)
    close_statements(now=at(2, 1, 0, 5))
    mine = _statement(acme, at(1, 1))
    theirs = _statement(globex, at(1, 1))
    _, client = acme_key

    listed = client.get("/v1/organization/statements").json()
    assert [s["id"] for s in listed["data"]] == [mine.id]
    assert listed["data"][0]["totals"] == [{"currency": "USD", "amount": "1.92"}]
    detail = client.get(f"/v1/organization/statements/{mine.id}")
    assert detail.status_code == 200
    assert [line["amount"] for line in detail.json()["lines"]] == ["0.62", "1.30"]
    csv_body = client.get(f"/v1/organization/statements/{mine.id}/csv")
    assert csv_body["Content-Type"].startswith("text/csv")
    assert csv_body.content.decode().splitlines()[-1].endswith(",USD,,,,,,,1.92")

    for path_ in (
        f"/v1/organization/statements/{theirs.id}",
        f"/v1/organization/statements/{theirs.id}/csv",
    ):
        assert client.get(path_).status_code == 404
    assert client.get("/v1/organization/statements/99999999999999999999999").status_code == 404
    other = globex_client.get("/v1/organization/statements").json()
    assert [s["id"] for s in other["data"]] == [theirs.id]
    assert globex_client.get(f"/v1/organization/statements/{mine.id}").status_code == 404
    assert client.post("/v1/organization/statements").status_code == 405


# --- real PostgreSQL: concurrent writers --------------------------------------------------


def _race(n: int, work) -> list:
    import threading

    from django.db import connections

    barrier = threading.Barrier(n)
    outcomes: list = []

    def worker():
        try:
            barrier.wait(timeout=10)
            outcomes.append(work())
        except Exception as exc:  # noqa: BLE001 - the test looks at what each got
            outcomes.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=worker) for _ in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return outcomes


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_concurrent_closes_close_each_statement_once(january, acme):
    from billing.statements import close_statements

    outcomes = _race(4, lambda: close_statements(now=at(2, 1, 0, 5)))
    assert not [o for o in outcomes if isinstance(o, Exception)], outcomes
    january_statement = _statement(acme, at(1, 1))
    assert sorted(pk for closed in outcomes for pk in closed) == [january_statement.id]
    assert [_line_dict(line) for line in january_statement.lines.all()] == JANUARY_LINES


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_concurrent_overlapping_prices_save_once(tiny):
    from django.core.exceptions import ValidationError

    outcomes = _race(
        4, lambda: price(tiny, inp="1", cached="0.1", out="2", start=at(1, 1)) and "saved"
    )
    assert outcomes.count("saved") == 1
    assert [type(o) for o in outcomes if o != "saved"] == [ValidationError] * 3
    assert ModelPrice.objects.count() == 1


def test_a_price_added_later_reprices_the_open_statement_but_not_a_closed_one(tiny, acme):
    from billing.statements import close_statements

    usage(
        "dec", acme, "baton-tiny", at(12, 20, year=2025), prompt=1_000_000, cached=0, completion=0
    )
    usage("jan", acme, "baton-tiny", at(1, 20), prompt=1_000_000, cached=0, completion=0)
    close_statements(now=at(1, 21))  # December closes unpriced; January is open
    december = _statement(acme, at(12, 1, year=2025))
    assert [(line.price_id, line.amount) for line in december.lines.all()] == [(None, 0)]
    price(tiny, inp="2.00", cached="0.20", out="4.00", start=at(1, 1, year=2025))
    close_statements(now=at(1, 21, 0, 5))
    (line,) = _statement(acme, at(1, 1)).lines.all()
    assert (line.input_per_mtok, line.amount) == (Decimal("2"), Decimal("2.00"))
    assert [(line.price_id, line.amount) for line in december.lines.all()] == [(None, 0)]
