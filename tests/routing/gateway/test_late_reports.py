"""A report past the live TTL but within BATON_LIVE_LATE_S more is late, not lost, while its
node is online: the live view keeps the instance unhealthy but names it, and a request that
has no path only because of late reports waits in the overload queue and is routed again
instead of a 503 (the gateway benchmark at 256-1,024 streams refused requests this way while
every agent was up and beating: the busy control plane took their beats late)."""

from __future__ import annotations

import json

import pytest

from fleet import live as fleet_live
from fleet.choices import InstanceRole, NodeStatus
from routing import live
from routing.gateway import routes
from routing.gateway import run as gw_run
from routing.gateway.overload import overload
from routing.models import RequestRecord
from tests.routing.gateway.test_route_around_the_dead import (
    _one_dc_fleet,
    _publish,
    _send,
    _tenant_client,
)


def _age(node, seconds: float) -> None:
    """Make the node's last report ``seconds`` old (memory mode: no REDIS_URL)."""
    key = str(node.pk)
    entry = json.loads(fleet_live._memory[key])
    entry["received_at"] -= seconds
    fleet_live._memory[key] = json.dumps(entry)
    routes.live_views.clear()


@pytest.fixture
def fleet(transactional_db, settings, monkeypatch):
    settings.REDIS_URL = ""
    settings.BATON_LIVE_LATE_S = 6.0
    made = _one_dc_fleet(("p", InstanceRole.PREFILL), ("md", InstanceRole.MAIN_DECODE))

    async def events(url, plan):
        for i, token in enumerate(b"ok!"):
            yield {"type": "token", "index": i, "token_id": token, "role": "md"}
        yield {"type": "done", "finish_reason": "length", "stats": {}}

    monkeypatch.setattr(gw_run, "run_events", events)
    routes.live_views.clear()
    yield made
    fleet_live._memory.clear()
    routes.live_views.clear()


def test_a_late_report_leaves_its_instance_unhealthy_but_named(fleet):
    node, inst = fleet["p"]
    ttl = fleet_live.live_ttl_s()
    _age(node, ttl + 1.0)
    view = live.build_live_view("baton-tiny")
    p = next(s for s in view.snapshot.prefill if s.id == str(inst.pk))
    assert not p.healthy
    assert set(view.late) == {str(inst.pk)} and ttl + 0.9 < view.late[str(inst.pk)] < ttl + 2
    # Past the late window it is simply gone; so is an instance whose node went offline.
    _age(node, 6.0)
    assert live.build_live_view("baton-tiny").late == {}
    _publish(node, inst)
    _age(node, ttl + 1.0)
    node.status = NodeStatus.OFFLINE
    node.save()
    assert live.build_live_view("baton-tiny").late == {}


def test_a_request_with_no_path_but_late_reports_waits_and_is_routed_again(fleet, monkeypatch):
    node, inst = fleet["p"]
    _age(node, fleet_live.live_ttl_s() + 1.0)
    waits = []

    async def beat_arrives(tenant, since, tries):
        waits.append(tries)
        _publish(node, inst)  # the late beat is taken meanwhile
        routes.live_views.clear()

    monkeypatch.setattr(overload, "wait", beat_arrives)
    response = _send(_tenant_client())
    assert response.status_code == 200, response.content
    assert response.json()["choices"][0]["text"] == "ok!"
    assert waits == [0]
    record = RequestRecord.objects.get()
    assert record.status == "ok" and record.prefill_instance == str(inst.pk)


def test_reports_that_stay_late_end_in_the_queues_503_with_a_rejected_record(fleet, settings):
    node, _ = fleet["p"]
    settings.BATON_GATEWAY_QUEUE_TIMEOUT_S = 0.3
    _age(node, fleet_live.live_ttl_s() + 1.0)
    response = _send(_tenant_client())
    assert response.status_code == 503, response.content
    assert response.json()["error"]["code"] == "overloaded"
    record = RequestRecord.objects.get()
    assert record.status == "rejected" and "report late" in record.error


def test_a_report_past_the_late_window_is_refused_at_once(fleet, monkeypatch):
    node, _ = fleet["p"]
    _age(node, fleet_live.late_age_s() + 1.0)

    async def no_wait(*args):
        raise AssertionError("a lost report is not waited for")

    monkeypatch.setattr(overload, "wait", no_wait)
    response = _send(_tenant_client())
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "no_healthy_path"
    assert "late" not in RequestRecord.objects.get().error
