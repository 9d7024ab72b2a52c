"""The price book, rating of the usage ledger, statements and their closing, tenant self-service.

Amounts in the expected values are worked out by hand in the comments next to them.
"""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

import pytest
from django.contrib.auth.models import Group, User
from rest_framework.test import APIClient

from billing import pricing, services
from billing.models import ModelPrice, Tenant, UsageEntry
from controlplane.models import ApiToken
from fleet.models import ServedModel


def _client_for(username: str, group: str) -> APIClient:
    user = User.objects.create_user(username=username)
    user.groups.add(Group.objects.get(name=group))
    _, key = ApiToken.objects.issue(user=user, name="test")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {key}")
    return client


@pytest.fixture
def operator(db) -> APIClient:
    return _client_for("olivia", "operator")


@pytest.fixture
def viewer(db) -> APIClient:
    return _client_for("victor", "viewer")


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
