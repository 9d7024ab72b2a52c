"""Admission and routing on the event loop (routing/gateway/workers.py `in_order`, as
views.py `_admit` runs steps 1-3): with warm caches and no Redis, a request takes no worker
hop; a cold read moves the rest to a worker without counting the request twice; with Redis,
or switched off, the worker does it."""

from __future__ import annotations

import asyncio

import pytest
from rest_framework.test import APIClient

from billing import services as billing
from billing.models import Tenant
from fleet import live as fleet_live
from fleet.choices import InstanceRole
from routing.gateway import admission, views
from routing.gateway import run as gw_run
from routing.models import Admission, RequestRecord

from .test_route_around_the_dead import _one_dc_fleet

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def fleet(transactional_db, settings, monkeypatch):
    settings.REDIS_URL = ""
    settings.BATON_GATEWAY_INLINE = True
    _one_dc_fleet(("p", InstanceRole.PREFILL), ("md", InstanceRole.MAIN_DECODE))

    async def events(url, plan):
        for i in range(plan["sampling"]["max_tokens"]):
            yield {"type": "token", "index": i, "token_id": ord("a") + i, "role": "md"}
        yield {"type": "done", "finish_reason": "length", "stats": {}}

    monkeypatch.setattr(gw_run, "run_events", events)
    # Where the limiter ran: on the event loop (inline) or on a worker thread.
    where: list[str] = []
    real = admission.check_limits

    def check_limits(p):
        try:
            asyncio.get_running_loop()
            where.append("loop")
        except RuntimeError:
            where.append("worker")
        return real(p)

    monkeypatch.setattr(admission, "check_limits", check_limits)
    yield where
    fleet_live._memory.clear()


def _client(rpm: int = 100) -> APIClient:
    tenant = Tenant.objects.create(name="acme", requests_per_minute=rpm, tokens_per_minute=10**6)
    _, raw = billing.api_key_create(tenant=tenant)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    return client


def _send(client):
    return client.post(
        "/v1/completions",
        {"model": "baton-tiny", "prompt": "hello", "max_tokens": 3},
        format="json",
    )


def _stages(response) -> list[str]:
    return [part.split(";")[0] for part in response["Server-Timing"].split(", ")]


def test_a_warm_request_is_admitted_and_routed_on_the_event_loop(fleet):
    client = _client()
    first = _send(client)  # cold: the key, the model and the fleet's rows are read
    assert first.status_code == 200
    assert "inline" in _stages(first) and "resume" in _stages(first)
    second = _send(client)
    assert second.status_code == 200, second.content
    assert second.json()["choices"][0]["text"] == "abc"
    assert "inline" not in _stages(second) and "resume" not in _stages(second)
    assert fleet == ["worker", "loop"]
    # The same records as the worker path: one each, the admission gone.
    assert RequestRecord.objects.filter(status="ok").count() == 2
    assert not Admission.objects.exists()


def test_a_cold_read_falls_back_without_counting_the_request_twice(fleet):
    client = _client(rpm=2)
    assert _send(client).status_code == 200  # cold: inline gave up before the limiter
    assert _send(client).status_code == 200  # warm: inline
    third = _send(client)
    assert third.status_code == 429  # two requests counted, not three
    assert fleet == ["worker", "loop", "loop"]
    # The refused request has its record, written before the 429 went out, and no usage.
    refused = RequestRecord.objects.get(request_id=third["X-Request-Id"])
    assert refused.status == "rejected"
    assert refused.error == "rate limited: the tenant's requests per minute"
    assert refused.prompt_tokens > 0 and refused.pipeline == ""
    assert RequestRecord.objects.count() == 3


def test_a_rate_limited_request_on_a_worker_is_recorded_too(fleet, settings):
    settings.BATON_GATEWAY_INLINE = False
    client = _client(rpm=1)
    assert _send(client).status_code == 200
    refused = _send(client)
    assert refused.status_code == 429 and refused["Retry-After"]
    record = RequestRecord.objects.get(request_id=refused["X-Request-Id"])
    assert (record.status, record.completion_tokens) == ("rejected", 0)
    assert "rate limited" in record.error


def test_with_redis_or_switched_off_the_worker_admits(fleet, settings):
    settings.BATON_GATEWAY_INLINE = False
    client = _client()
    _send(client)
    _send(client)
    assert fleet == ["worker", "worker"]
    settings.BATON_GATEWAY_INLINE = True
    settings.REDIS_URL = "redis://127.0.0.1:1/0"
    assert views._inline_ok() is False


def test_a_rejected_request_is_recorded_before_its_503(fleet, settings):
    client = _client()
    assert _send(client).status_code == 200  # warm the caches
    from pdd.policy import NoHealthyPath
    from routing.gateway import routes

    def no_path(p, view=None):
        raise NoHealthyPath("every decoder is gone")

    import unittest.mock

    with unittest.mock.patch.object(routes, "route", no_path):
        response = _send(client)
    assert response.status_code == 503
    assert RequestRecord.objects.filter(status="rejected").count() == 1


def test_a_cold_read_in_routing_moves_only_routing_on_to_the_worker(fleet):
    from routing.gateway import routes

    client = _client(rpm=2)
    assert _send(client).status_code == 200  # cold: all of it on a worker
    routes.policies.clear()  # the key and the model stay cached; the routing policy does not
    second = _send(client)
    assert second.status_code == 200, second.content
    stages = _stages(second)
    assert "inline" in stages and "resume" in stages
    # Admission counted the request on the loop; routing's read moved the rest to a worker.
    assert fleet == ["worker", "loop"]
    assert _send(client).status_code == 429  # two requests counted, not three
    assert RequestRecord.objects.filter(status="ok").count() == 2
    assert not Admission.objects.exists()
