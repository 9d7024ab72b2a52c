"""A node speaks only for its own instances: a heartbeat or registration that lists another
node's instance changes nothing for it, in the database or in the live routing view."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from fleet import agent_services, live, services
from fleet.choices import ActualState, InstanceRole
from fleet.models import FleetEvent, Instance
from routing.live import build_live_view

pytestmark = pytest.mark.django_db


def _agent(token: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"AgentToken {token}")
    return client


def _item(instance_id, role="prefill") -> dict:
    return {
        "instance_id": str(instance_id),
        "role": role,
        "model": "baton-tiny",
        "state": "running",
        "load": {"running": 0, "queued": 0, "max_running": 32},
    }


@pytest.fixture(autouse=True)
def _fresh_live_state():
    live._memory.clear()
    agent_services._foreign_recorded.clear()
    yield
    live._memory.clear()


@pytest.fixture
def fleet(node_a, node_b, tiny_model, django_capture_on_commit_callbacks):
    prefill = services.instance_create(
        role=InstanceRole.PREFILL, node=node_a, served_model=tiny_model, gpu_count=1
    )
    decode = services.instance_create(
        role=InstanceRole.MAIN_DECODE, node=node_b, served_model=tiny_model, gpu_count=1
    )
    tokens = {}
    for node, endpoint, own in (
        (node_a, "http://127.0.0.1:9101", prefill),
        (node_b, "http://127.0.0.1:9201", decode),
    ):
        token = services.node_rotate_token(node=node)
        with django_capture_on_commit_callbacks(execute=True):
            response = _agent(token).post(
                "/api/v1/agent/register",
                {
                    "endpoint": endpoint,
                    "instances": [_item(own.pk, own.role)],
                },
                format="json",
            )
        assert response.status_code == 200, response.content
        tokens[node.hostname] = token
    return prefill, decode, tokens


def _claim(token, *items, capture):
    with capture(execute=True):
        response = _agent(token).post(
            "/api/v1/agent/heartbeat", {"instances": list(items)}, format="json"
        )
    assert response.status_code == 200, response.content
    return response


def test_a_heartbeat_claiming_another_nodes_instance_is_ignored_for_routing(
    fleet, django_capture_on_commit_callbacks
):
    prefill, decode, tokens = fleet
    # b-1 claims a-1's prefill instance as running at b-1's own endpoint.
    _claim(
        tokens["b-1"],
        _item(decode.pk, decode.role),
        _item(prefill.pk),
        capture=django_capture_on_commit_callbacks,
    )
    view = build_live_view("baton-tiny")
    assert view.endpoints[str(prefill.pk)].http == "http://127.0.0.1:9101"
    assert view.endpoints[str(decode.pk)].http == "http://127.0.0.1:9201"
    # a-1 stops reporting: its prefill must now look unhealthy, not live at b-1.
    _claim(tokens["a-1"], capture=django_capture_on_commit_callbacks)
    _claim(
        tokens["b-1"],
        _item(decode.pk, decode.role),
        _item(prefill.pk),
        capture=django_capture_on_commit_callbacks,
    )
    view = build_live_view("baton-tiny")
    states = {s.id: s for s in (*view.snapshot.prefill, *view.snapshot.main_decode)}
    assert states[str(prefill.pk)].healthy is False
    assert view.endpoints[str(prefill.pk)].http == "http://127.0.0.1:9101"


def test_the_claim_is_dropped_from_the_database_and_recorded_as_an_event(
    fleet, django_capture_on_commit_callbacks
):
    prefill, decode, tokens = fleet
    _claim(
        tokens["b-1"],
        _item(decode.pk, decode.role),
        {**_item(prefill.pk), "state": "failed"},
        capture=django_capture_on_commit_callbacks,
    )
    prefill.refresh_from_db()
    assert prefill.actual_state == ActualState.RUNNING
    assert prefill.last_report["state"] == "running"
    decode.node.refresh_from_db()
    reported = [i["instance_id"] for i in decode.node.last_report["instances"]]
    assert reported == [str(decode.pk)]
    event = FleetEvent.objects.get(kind="node.foreign_report")
    assert event.node_id == decode.node_id
    assert event.data["instance_ids"] == [str(prefill.pk)]
    assert event.data["owners"] == {str(prefill.pk): "a-1"}
    # Claiming the same again within a minute records no second event.
    _claim(tokens["b-1"], _item(prefill.pk), capture=django_capture_on_commit_callbacks)
    assert FleetEvent.objects.filter(kind="node.foreign_report").count() == 1


def test_registration_claiming_another_nodes_instance_is_ignored(
    fleet, django_capture_on_commit_callbacks
):
    prefill, decode, tokens = fleet
    with django_capture_on_commit_callbacks(execute=True):
        response = _agent(tokens["b-1"]).post(
            "/api/v1/agent/register",
            {"endpoint": "http://127.0.0.1:9202", "instances": [_item(prefill.pk)]},
            format="json",
        )
    assert response.status_code == 200
    view = build_live_view("baton-tiny")
    assert view.endpoints[str(prefill.pk)].http == "http://127.0.0.1:9101"
    assert FleetEvent.objects.filter(kind="node.foreign_report", node=decode.node).exists()


def test_a_forged_published_report_does_not_steer_another_nodes_instance(fleet):
    """Defence in depth: even a report in the live store naming another node's instance is
    read only for the node that sent it."""
    prefill, decode, _ = fleet
    live.publish_report(
        node_id=decode.node_id,
        hostname="b-1",
        datacenter="dc-b",
        endpoint="http://127.0.0.1:9666",
        report={"instances": [_item(decode.pk, decode.role), _item(prefill.pk)]},
    )
    view = build_live_view("baton-tiny")
    assert view.endpoints[str(prefill.pk)].http == "http://127.0.0.1:9101"


def test_non_numeric_and_unknown_ids_are_dropped_too(fleet, django_capture_on_commit_callbacks):
    _, decode, tokens = fleet
    _claim(
        tokens["b-1"],
        _item(decode.pk, decode.role),
        _item("999999"),
        _item("not-an-id"),
        capture=django_capture_on_commit_callbacks,
    )
    decode.node.refresh_from_db()
    assert [i["instance_id"] for i in decode.node.last_report["instances"]] == [str(decode.pk)]
    assert Instance.objects.filter(pk=decode.pk, actual_state=ActualState.RUNNING).exists()
