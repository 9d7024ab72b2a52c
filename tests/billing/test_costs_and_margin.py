"""Provider cost from GPU-hours, revenue and margin per model and day, their REST API.

The figures are worked out by hand in the comments. The fleet of the example:

- I1 serves baton-tiny on dc-a (gpu-a), 8 GPUs; running from Feb 10 06:00 on, never stopped.
  gpu-a @ dc-a costs 2.00/GPU-h until Feb 10 12:00, then 3.00 (a change mid-interval).
- I2 serves baton-big on dc-b (gpu-b), 4 GPUs at 2.4999/GPU-h; running since Feb 9 20:00
  (before the period) and drained at Feb 10 07:20 (stopped part-way).

The period is [Feb 10, Feb 12); "now" is Feb 11 18:00 unless said otherwise.
"""

from __future__ import annotations

from decimal import Decimal

import pytest
from django.test import Client

from billing.costs import fleet_cost
from billing.margin import margin
from fleet import services as fleet_services
from fleet.models import Datacenter, FleetEvent, GPUType, UnitPrice
from tests.billing.test_pricing_and_statements import (  # noqa: F401 (fixtures)
    acme,
    at,
    big,
    globex,
    price,
    tiny,
    usage,
)

D = Decimal
START, END = at(2, 10), at(2, 12)
NOW = at(2, 11, 18)


def _gpu(name: str) -> GPUType:
    return GPUType.objects.create(
        vendor="g",
        model=name,
        peak_bf16_tflops=900,
        memory_gib=80,
        memory_bandwidth_gbps=3000,
        interconnect_gbps=400,
    )


def _state(instance, when, previous, new, kind="instance.state"):
    event = FleetEvent.objects.create(
        instance=instance, kind=kind, message="test", data={"previous": previous, "new": new}
    )
    FleetEvent.objects.filter(pk=event.pk).update(created_at=when)


@pytest.fixture
def fleet(db, tiny, big):  # noqa: F811
    a = Datacenter.objects.create(name="dc-a", region="city-a")
    b = Datacenter.objects.create(name="dc-b", region="city-b")
    gpu_a, gpu_b = _gpu("gpu-a"), _gpu("gpu-b")
    UnitPrice.objects.create(
        gpu_type=gpu_a,
        datacenter=a,
        price_per_gpu_hour=D("2.00"),
        effective_from=at(1, 1),
        effective_to=at(2, 10, 12),
    )
    UnitPrice.objects.create(
        gpu_type=gpu_a, datacenter=a, price_per_gpu_hour=D("3.00"), effective_from=at(2, 10, 12)
    )
    UnitPrice.objects.create(
        gpu_type=gpu_b, datacenter=b, price_per_gpu_hour=D("2.4999"), effective_from=at(1, 1)
    )
    na, _ = fleet_services.node_create(hostname="a-1", datacenter=a, gpu_type=gpu_a, gpu_count=8)
    nb, _ = fleet_services.node_create(hostname="b-1", datacenter=b, gpu_type=gpu_b, gpu_count=8)
    i1 = fleet_services.instance_create(role="prefill", node=na, served_model=tiny, gpu_count=8)
    i2 = fleet_services.instance_create(role="main_decode", node=nb, served_model=big, gpu_count=4)
    FleetEvent.objects.filter(kind="instance.state").delete()
    _state(i1, at(2, 9, 12), "pending", "starting")
    _state(i1, at(2, 10, 6), "starting", "running")
    _state(i2, at(2, 9, 20), "starting", "running")
    _state(i2, at(2, 9, 21), "running", "running", kind="instance.desired")  # not a state change
    _state(i2, at(2, 10, 7, 20), "running", "draining")
    _state(i2, at(2, 10, 8), "draining", "drained")
    return {"i1": i1, "i2": i2}


def _lines(lines):
    return [line.as_dict() for line in lines]


def test_cost_hand_computed_with_a_price_change_and_a_stop(fleet):
    cost = fleet_cost(START, END, now=NOW)
    assert cost.until == NOW
    # I1, Feb 10: 06-12 at 2.00: 6 h x 8 GPUs x 2.00 = 96.00; 12-24 at 3.00: 12 x 8 x 3 = 288.00.
    #     Feb 11: 00-18 (now) at 3.00: 18 x 8 x 3 = 432.00. 48 + 96 + 144 = 288 GPU-hours.
    # I2, Feb 10: 00:00-07:20 (running since before the period, drained at 07:20):
    #     7 h 20 min x 4 GPUs = 29.333333 GPU-h; 26,400 s x 4 x 2.4999 / 3600 = 73.3304 -> 73.33.
    assert _lines(cost.by_pool()) == [
        {
            "datacenter": "dc-a",
            "gpu_type": "gpu-a",
            "currency": "USD",
            "gpu_hours": D("288.000000"),
            "amount": D("816.00"),
        },
        {
            "datacenter": "dc-b",
            "gpu_type": "gpu-b",
            "currency": "USD",
            "gpu_hours": D("29.333333"),
            "amount": D("73.33"),
        },
    ]
    assert cost.totals(cost.by_pool()) == [{"currency": "USD", "amount": D("889.33")}]
    assert [(c.key["model"], c.key["day"].isoformat(), c.amount) for c in cost.by_model_day()] == [
        ("baton-big", "2026-02-10", D("73.33")),
        ("baton-tiny", "2026-02-10", D("384.00")),
        ("baton-tiny", "2026-02-11", D("432.00")),
    ]
    assert cost.unpriced_gpu_hours == D("0.000000")
    # Only baton-big's instances.
    only_big = fleet_cost(START, END, model="baton-big", now=NOW)
    assert [c.amount for c in only_big.by_model()] == [D("73.33")]


def test_cost_counts_to_end_when_now_is_later_and_nothing_before_start(fleet):
    # Now after the period: I1 runs to Feb 12 00:00: Feb 11 is 24 x 8 x 3.00 = 576.00.
    cost = fleet_cost(START, END, now=at(3, 1))
    assert [(c.key["model"], c.amount) for c in cost.by_model()] == [
        ("baton-big", D("73.33")),
        ("baton-tiny", D("960.00")),
    ]
    # Before anything ran: nothing.
    assert fleet_cost(at(2, 1), at(2, 9), now=NOW).pieces == []
    # A period in the future is not costed yet.
    assert fleet_cost(at(3, 1), at(3, 2), now=NOW).pieces == []


def test_time_without_a_unit_price_is_unpriced_not_dropped(fleet):
    UnitPrice.objects.filter(price_per_gpu_hour=D("2.4999")).delete()
    cost = fleet_cost(START, END, now=NOW)
    unpriced = [c for c in cost.by_pool() if not c.currency]
    assert [(c.key["datacenter"], c.gpu_hours, c.amount) for c in unpriced] == [
        ("dc-b", D("29.333333"), D("0.00"))
    ]
    assert cost.unpriced_gpu_hours == D("29.333333")


@pytest.fixture
def ledger(fleet, tiny, big, acme, globex):  # noqa: F811
    price(tiny, inp="0.50", cached="0.05", out="1.50", start=at(1, 1))
    price(big, inp="2.00", cached="0.20", out="4.00", start=at(1, 1))
    price(big, inp="1.00", cached="0.10", out="2.00", start=at(2, 1), tenant=globex)
    # Feb 10, tiny (list): 800k x 0.50 + 200k x 0.05 + 100k x 1.50 per 1M = 0.40 + 0.01 + 0.15
    # = 0.56, and 10k x 0.50 + 5k x 1.50 = 0.005 + 0.0075 = 0.0125: 0.5725 -> 0.57 (half-even).
    usage("r1", acme, "baton-tiny", at(2, 10, 9), prompt=1_000_000, cached=200_000,
          completion=100_000)  # fmt: skip
    usage("r2", acme, "baton-tiny", at(2, 10, 23, 59), prompt=10_000, cached=0, completion=5_000)
    # Feb 11, tiny: 400M x 0.50 + 100M x 1.50 = 200.00 + 150.00 = 350.00.
    usage("r3", globex, "baton-tiny", at(2, 11, 1), prompt=400_000_000, cached=0,
          completion=100_000_000)  # fmt: skip
    # Feb 10, big, globex's contract: 5M x 1.00 + 5M x 0.10 + 30M x 2.00 = 5.00 + 0.50 + 60.00.
    usage("r4", globex, "baton-big", at(2, 10, 12), prompt=10_000_000, cached=5_000_000,
          completion=30_000_000)  # fmt: skip
    # Outside the period: not counted.
    usage("r5", acme, "baton-tiny", at(2, 12), prompt=1_000_000, cached=0, completion=0)
    usage("r6", acme, "baton-tiny", at(2, 9, 23, 59), prompt=1_000_000, cached=0, completion=0)


def test_revenue_cost_and_margin_per_model_and_day(ledger):
    report = margin(START, END, now=NOW)
    days = [
        (d["model"], d["day"].isoformat(), d["revenue"], d["cost"], d["margin"], d["requests"])
        for d in report.per_day
    ]
    assert days == [
        ("baton-big", "2026-02-10", D("65.50"), D("73.33"), D("-7.83"), 1),
        ("baton-tiny", "2026-02-10", D("0.57"), D("384.00"), D("-383.43"), 2),
        ("baton-tiny", "2026-02-11", D("350.00"), D("432.00"), D("-82.00"), 1),
    ]
    per_model = {m["model"]: m for m in report.per_model}
    # tiny: 0.5725 + 350 = 350.5725 -> 350.57; cost 384 + 432 = 816.00; BCR 350.57/816 = 0.4296.
    assert per_model["baton-tiny"]["revenue"] == D("350.57")
    assert per_model["baton-tiny"]["cost"] == D("816.00")
    assert per_model["baton-tiny"]["margin"] == D("-465.43")
    assert per_model["baton-tiny"]["bcr"] == D("0.4296")
    assert per_model["baton-tiny"]["tokens"] == 1_000_000 + 100_000 + 15_000 + 500_000_000
    # big: 65.50 / 73.33 = 0.8932.
    assert (per_model["baton-big"]["margin"], per_model["baton-big"]["bcr"]) == (
        D("-7.83"),
        D("0.8932"),
    )
    # Totals add the rounded model lines: 416.07 - 889.33 = -473.26; 416.07 / 889.33 = 0.4678.
    assert report.totals == [
        {
            "currency": "USD",
            "revenue": D("416.07"),
            "cost": D("889.33"),
            "margin": D("-473.26"),
            "bcr": D("0.4678"),
        }
    ]
    assert report.unpriced_requests == 0
    only = margin(START, END, model="baton-big", now=NOW)
    assert [m["model"] for m in only.per_model] == ["baton-big"]


def test_revenue_is_one_grouped_query_whatever_the_number_of_entries(
    ledger, django_assert_max_num_queries
):
    from billing.margin import revenue_rows

    with django_assert_max_num_queries(2):  # the price book, then the grouped sums
        rows = revenue_rows(START, END)
    assert len(rows) == 3  # (tiny, Feb 10), (tiny, Feb 11), (big, Feb 10): one price each


# --- REST ---------------------------------------------------------------------------------


def test_margin_api_for_a_viewer(ledger, viewer):  # noqa: F811
    response = viewer.get(
        "/api/v1/billing/margin/", {"start": "2026-02-10", "end": "2026-02-12T00:00:00Z"}
    )
    assert response.status_code == 200, response.json()
    body = response.json()
    # Now is later than the period: I1 counts to Feb 12: tiny cost 960.00; total 1033.33.
    assert body["totals"] == [
        {
            "currency": "USD",
            "revenue": "416.07",
            "cost": "1033.33",
            "margin": "-617.26",
            "bcr": "0.4026",
        }
    ]
    assert {d["day"] for d in body["per_day"]} == {"2026-02-10", "2026-02-11"}
    assert set(body["live"]) == {"window", "goodput_rps", "cost_per_hour", "currency", "bcr"}
    one = viewer.get("/api/v1/billing/margin/?start=2026-02-10&end=2026-02-12&model=baton-big")
    assert [m["model"] for m in one.json()["per_model"]] == ["baton-big"]


def test_costs_api_for_a_viewer(ledger, viewer):  # noqa: F811
    body = viewer.get("/api/v1/billing/costs/?start=2026-02-10&end=2026-02-12").json()
    assert [(p["datacenter"], p["gpu_hours"], p["amount"]) for p in body["by_pool"]] == [
        ("dc-a", "336.000000", "960.00"),
        ("dc-b", "29.333333", "73.33"),
    ]
    assert body["totals"] == [{"currency": "USD", "amount": "1033.33"}]


def test_default_period_is_the_current_month(db, viewer):  # noqa: F811
    from billing.statements import month_start, next_month

    body = viewer.get("/api/v1/billing/costs/").json()
    from django.utils import timezone
    from django.utils.dateparse import parse_datetime

    start = month_start(timezone.now())
    assert parse_datetime(body["start"]) == start
    assert parse_datetime(body["end"]) == next_month(start)


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ("start=yesterday", "start"),
        ("start=2026-02-30", "start"),
        ("end=2026-13-01", "end"),
        ("start=2026-02-10&end=2026-02-10", "end"),
        ("start=2026-02-10&end=2026-01-01", "end"),
        ("start=2020-01-01&end=2026-01-01", "end"),
    ],
)
@pytest.mark.parametrize("url", ["/api/v1/billing/costs/", "/api/v1/billing/margin/"])
def test_bad_dates_are_400_naming_the_parameter(viewer, url, query, field):  # noqa: F811
    response = viewer.get(f"{url}?{query}")
    assert response.status_code == 400
    assert list(response.json()) == [field]


def test_anonymous_gets_401_and_the_page_redirects(db):
    from rest_framework.test import APIClient

    assert APIClient().get("/api/v1/billing/margin/").status_code in (401, 403)
    assert APIClient().get("/api/v1/billing/costs/").status_code in (401, 403)
    page = Client().get("/billing/")
    assert page.status_code == 302 and "/login/" in page["Location"]


def test_schema_documents_both_views_with_their_400(db):
    from drf_spectacular.generators import SchemaGenerator

    schema = SchemaGenerator().get_schema(request=None, public=True)
    for path in ("/api/v1/billing/costs/", "/api/v1/billing/margin/"):
        get = schema["paths"][path]["get"]
        assert {"200", "400"} <= set(get["responses"])
        assert {"start", "end"} <= {p["name"] for p in get["parameters"]}


# --- the page -----------------------------------------------------------------------------


def test_billing_page_for_a_viewer_shows_statements_margin_and_links(ledger):
    from django.contrib.auth.models import Group, User

    from billing.statements import rate_pending

    rate_pending(now=NOW)
    user = User.objects.create_user(username="vera", password="pw-vera-123")
    user.groups.add(Group.objects.get(name="viewer"))
    client = Client()
    client.force_login(user)
    page = client.get("/billing/?period=2026-02")
    assert page.status_code == 200
    html = page.content.decode()
    # All of February: revenue 416.07 + r5 and r6 (0.50 each).
    assert 'id="billing-daily"' in html and "baton-tiny" in html and "417.07" in html
    assert "<script>" not in html  # CSP: no inline script (the data block is JSON)
    detail = client.get("/billing/usage/r4/")
    assert detail.status_code == 200
    assert "65.500000000000" in detail.content.decode()  # full precision, one request
    assert client.get("/billing/usage/nope/").status_code == 404


def test_the_request_log_links_each_request_to_its_usage(fleet, client, django_user_model):
    from frontend.synthetic import synthetic_records_create
    from routing.models import RequestRecord

    synthetic_records_create(count=3, seed=1)
    client.force_login(django_user_model.objects.create_user(username="val", password="x-pw-123"))
    html = client.get("/requests/").content.decode()
    for record in RequestRecord.objects.all():
        assert f'href="/billing/usage/{record.request_id}/"' in html
