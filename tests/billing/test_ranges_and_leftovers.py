"""Statements for any range (operator and tenant API, JSON and CSV), strict boolean filters,
the margin report's short cache, and the provider cost of deleted instances."""

from __future__ import annotations

import csv
import io
from decimal import Decimal

import pytest

from billing.costs import fleet_cost
from tests.billing.test_costs_and_margin import END, NOW, START
from tests.billing.test_pricing_and_statements import (  # noqa: F401 (fixtures)
    TENANT_URLS,
    _ts,
    at,
    urlpatterns,
    usage,
)

D = Decimal


def test_a_custom_range_is_a_statement_in_json_and_csv(january, acme, viewer):
    # The 16th onwards is January's second line alone: 1.30 (hand-computed in JANUARY_LINES).
    query = {"tenant": acme.id, "start": "2026-01-16", "end": "2026-02-01T00:00:00Z"}
    response = viewer.get("/api/v1/statements/range/", query)
    assert response.status_code == 200, response.content
    body = response.json()
    assert (body["id"], body["status"], body["tenant_name"]) == (None, "preview", "acme")
    assert body["period_start"].startswith("2026-01-16T00:00:00")
    assert [line["amount"] for line in body["lines"]] == ["1.30"]
    assert body["totals"] == [{"currency": "USD", "amount": "1.30"}]
    download = viewer.get("/api/v1/statements/range/csv/", query)
    assert download.status_code == 200
    assert download["Content-Type"].startswith("text/csv")
    assert "attachment" in download["Content-Disposition"]
    rows = list(csv.DictReader(io.StringIO(download.content.decode())))
    assert [(r["kind"], r["amount"]) for r in rows] == [("usage", "1.30"), ("total", "1.30")]
    # Default: the calendar month of `start` (all of January: 1.92).
    month = viewer.get("/api/v1/statements/range/", {"tenant": acme.id, "start": "2026-01-01"})
    assert month.json()["totals"] == [{"currency": "USD", "amount": "1.92"}]


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ({}, "tenant"),
        ({"tenant": "nope"}, "tenant"),
        ({"tenant": "999999999"}, "tenant"),
        ({"start": "yesterday"}, "start"),
        ({"start": "2026-02-01", "end": "2026-01-01"}, "end"),
        ({"start": "2026-01-01", "end": "2027-06-01"}, "end"),
    ],
)
def test_bad_range_queries_are_400s_naming_the_parameter(acme, viewer, query, field):
    if field != "tenant":
        query = {"tenant": acme.id, **query}
    for url in ("/api/v1/statements/range/", "/api/v1/statements/range/csv/"):
        response = viewer.get(url, query)
        assert response.status_code == 400, (url, response.content)
        assert field in response.json()


@TENANT_URLS
def test_a_tenant_reads_a_statement_of_any_range(january, acme, acme_key, globex):
    usage("g1", globex, "baton-tiny", at(1, 20), prompt=1_000_000, cached=0, completion=0)
    _, client = acme_key
    query = {"start_time": _ts(at(1, 16)), "end_time": _ts(at(2, 1))}
    body = client.get("/v1/organization/statements/range", query).json()
    assert body["tenant_name"] == "acme"  # only its own usage, not globex's
    assert [line["amount"] for line in body["lines"]] == ["1.30"]
    text = client.get("/v1/organization/statements/range/csv", query)
    assert text["Content-Type"].startswith("text/csv")
    assert text.content.decode().splitlines()[-1].endswith(",USD,,,,,,,1.30")
    bad = client.get("/v1/organization/statements/range", {"start_time": "x"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "start_time"
    backwards = client.get(
        "/v1/organization/statements/range", {"start_time": _ts(at(2, 1)), "end_time": 0}
    )
    assert backwards.status_code == 400 and backwards.json()["error"]["param"] == "end_time"


def test_list_prices_takes_only_a_boolean(january, viewer, acme, tiny):
    from tests.billing.test_pricing_and_statements import price

    price(tiny, inp="0.40", cached="0.04", out="1.20", start=at(1, 1), tenant=acme)
    for value, count in (("true", 2), ("True", 2), ("1", 2), ("false", 1), ("0", 1), ("", 3)):
        response = viewer.get("/api/v1/model-prices/", {"list_prices": value})
        assert response.status_code == 200, (value, response.content)
        assert response.json()["count"] == count, value
    for value in ("maybe", "yes please", "2"):
        response = viewer.get("/api/v1/model-prices/", {"list_prices": value})
        assert response.status_code == 400, value
        assert "list_prices" in response.json()


def test_the_live_margin_report_is_cached_briefly(january, django_assert_max_num_queries):
    from django.test import override_settings
    from django.utils import timezone

    from billing.margin import clear_cache, margin

    first = margin(at(1, 1), at(2, 1))
    with django_assert_max_num_queries(1):  # the cache generation only
        again = margin(at(1, 1), at(2, 1), now=timezone.now())
    assert again.totals == first.totals
    # An explicit past `now` is never served from the cache.
    with django_assert_max_num_queries(50):
        assert margin(at(1, 1), at(2, 1), now=at(2, 2)).totals == first.totals
    clear_cache()
    with override_settings(BILLING_MARGIN_CACHE_SECONDS=0):
        assert margin(at(1, 1), at(2, 1)).totals == first.totals


def test_the_cost_of_a_deleted_instance_is_kept(fleet):
    from billing.models import DeletedInstanceRun

    before = fleet_cost(START, END, now=NOW)
    fleet["i2"].delete()  # drained on Feb 10 at 07:20: its one running interval is kept
    (run,) = DeletedInstanceRun.objects.all()
    assert (run.model, run.datacenter, run.gpu_type, run.gpu_count) == (
        "baton-big",
        "dc-b",
        "gpu-b",
        4,
    )
    assert (run.started_at, run.ended_at) == (at(2, 9, 20), at(2, 10, 7, 20))
    fleet["i1"].delete()  # still running: kept up to the deletion
    after = fleet_cost(START, END, now=NOW)
    assert [line.as_dict() for line in after.by_pool()] == [
        line.as_dict() for line in before.by_pool()
    ]
    assert after.totals(after.by_pool()) == [{"currency": "USD", "amount": D("889.33")}]
    only_big = fleet_cost(START, END, model="baton-big", now=NOW)
    assert [c.amount for c in only_big.by_model()] == [D("73.33")]


def test_the_billing_admin_pages_load(january, admin_client):
    from billing.models import Statement
    from billing.statements import close_statements

    close_statements(now=at(2, 1, 0, 5))
    statement = Statement.objects.get()
    for url in (
        "/admin/billing/deletedinstancerun/",
        "/admin/billing/statement/",
        f"/admin/billing/statement/{statement.pk}/change/",
        "/admin/billing/usageentry/",
    ):
        assert admin_client.get(url).status_code == 200, url
