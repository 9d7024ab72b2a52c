"""A heartbeat writes only what changed: an agent that reports the same thing again costs one
UPDATE of its node's last_heartbeat_at. State changes and their events, a node's return from
offline, reconciles on drift and the live view the gateways read are as before."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.db.models.signals import post_save
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from fleet import agent_services, live, services
from fleet.choices import ActualState, NodeStatus
from fleet.models import FleetEvent, Instance, Node
from fleet.signals import fleet_changed

pytestmark = pytest.mark.django_db

ENDPOINT = "http://127.0.0.1:9101"


def doc(node: Node, *items: dict, beat: int = 0) -> dict:
    """A state document; `control_plane` (the agent's heartbeat stats) moves at every beat."""
    return {
        "node": node.hostname,
        "datacenter": "dc-a",
        "protocol": 1,
        "instances": list(items),
        "engine_options": {"device": "cpu"},
        "control_plane": {"heartbeats_answered": beat, "rtt_p50_s": 0.004 + beat / 1e6},
    }


def item(instance: Instance, state: str = "running", running: int = 0) -> dict:
    return {
        "instance_id": str(instance.pk),
        "role": instance.role,
        "state": state,
        "load": {"running": running, "queued": 0, "max_running": 32},
        "kv": {"used_blocks": 3, "total_blocks": 64, "block_size": 16},
        "engine": {"busy_s": 41.2},
    }


@pytest.fixture
def decode_a(node_a, tiny_model) -> Instance:
    return services.instance_create(
        role="main_decode", node=node_a, served_model=tiny_model, gpu_count=4
    )


@pytest.fixture
def saves():
    """(model name, pk, update_fields) of every save, and every fleet change pushed."""
    seen: list[tuple] = []

    def saved(sender, instance, update_fields=None, **kwargs):
        seen.append((sender.__name__, instance.pk, frozenset(update_fields or ())))

    def pushed(sender, payload, **kwargs):
        seen.append(("push", payload.get("type"), payload.get("id")))

    post_save.connect(saved, dispatch_uid="test-heartbeat-saves")
    fleet_changed.connect(pushed, dispatch_uid="test-heartbeat-pushes")
    yield seen
    post_save.disconnect(dispatch_uid="test-heartbeat-saves")
    fleet_changed.disconnect(dispatch_uid="test-heartbeat-pushes")


def _writes(queries: CaptureQueriesContext) -> list[str]:
    return [
        q["sql"]
        for q in queries.captured_queries
        if q["sql"].lstrip().startswith(("UPDATE", "INSERT", "DELETE"))
    ]


def test_a_heartbeat_that_changes_nothing_writes_one_column_of_one_row(
    node_a, prefill_a, decode_a, saves, django_capture_on_commit_callbacks
):
    agent_services.node_register(
        node=node_a, endpoint=ENDPOINT, report=doc(node_a, item(prefill_a), item(decode_a), beat=1)
    )
    node_a.refresh_from_db()
    first_beat, updated_at = node_a.last_heartbeat_at, node_a.updated_at
    events = FleetEvent.objects.count()
    saves.clear()

    with (
        CaptureQueriesContext(connection) as queries,
        django_capture_on_commit_callbacks(execute=True),
    ):
        agent_services.node_heartbeat(
            node=node_a, report=doc(node_a, item(prefill_a), item(decode_a), beat=2)
        )

    writes = _writes(queries)
    assert len(writes) == 1, writes
    assert writes[0].startswith('UPDATE "fleet_node" SET "last_heartbeat_at" = ')
    assert "last_report" not in writes[0] and "updated_at" not in writes[0]
    assert saves == []  # no save signal: no websocket push, no cache invalidation
    assert FleetEvent.objects.count() == events
    node_a.refresh_from_db()
    assert node_a.last_heartbeat_at > first_beat
    assert node_a.updated_at == updated_at
    # The stored report leaves out the agent's heartbeat stats; the live view has them.
    assert "control_plane" not in node_a.last_report
    assert [i["instance_id"] for i in node_a.last_report["instances"]] == [
        str(prefill_a.pk),
        str(decode_a.pk),
    ]
    entry = next(e for e in live.read_reports() if e["node_id"] == node_a.pk)
    assert entry["report"]["control_plane"]["heartbeats_answered"] == 2


def test_only_what_changed_is_saved(
    node_a, prefill_a, decode_a, saves, django_capture_on_commit_callbacks
):
    agent_services.node_register(
        node=node_a, endpoint=ENDPOINT, report=doc(node_a, item(prefill_a), item(decode_a))
    )
    saves.clear()
    with django_capture_on_commit_callbacks(execute=True):
        agent_services.node_heartbeat(
            node=node_a, report=doc(node_a, item(prefill_a), item(decode_a, running=5), beat=1)
        )
    assert sorted(s for s in saves if s[0] != "push") == [
        ("Instance", decode_a.pk, frozenset({"last_report"})),
        ("Node", node_a.pk, frozenset({"last_report", "last_heartbeat_at", "updated_at"})),
    ]
    # Nothing a websocket push carries changed (state, desired state, status): none is sent.
    assert [s for s in saves if s[0] == "push"] == []
    decode_a.refresh_from_db()
    assert decode_a.last_report["load"]["running"] == 5

    # A state change is saved with its event and pushed, once: the same report again writes
    # nothing.
    draining = doc(node_a, item(prefill_a), item(decode_a, "draining", running=5))
    saves.clear()
    with django_capture_on_commit_callbacks(execute=True):
        agent_services.node_heartbeat(node=node_a, report=draining)
    assert [s for s in saves if s[0] == "push"] == [("push", "instance", decode_a.pk)]
    decode_a.refresh_from_db()
    assert decode_a.actual_state == ActualState.DRAINING
    changes = FleetEvent.objects.filter(instance=decode_a, kind="instance.state")
    assert changes.filter(data__new="draining").count() == 1
    saves.clear()
    agent_services.node_heartbeat(node=node_a, report=draining)
    assert saves == []
    assert changes.filter(data__new="draining").count() == 1


def test_a_node_back_from_offline_with_the_same_report_comes_back_whole(
    node_a, prefill_a, decode_a, settings
):
    report = doc(node_a, item(prefill_a), item(decode_a))
    agent_services.node_register(node=node_a, endpoint=ENDPOINT, report=report)
    later = timezone.now() + timedelta(seconds=60)
    assert agent_services.nodes_mark_offline(now=later) == [node_a.pk]
    assert set(Instance.objects.values_list("actual_state", flat=True)) == {"unavailable"}

    agent_services.node_heartbeat(node=node_a, report=report)  # the very same document

    node_a.refresh_from_db()
    assert node_a.status == NodeStatus.ONLINE
    assert FleetEvent.objects.filter(node=node_a, kind="node.online").count() == 2
    assert set(Instance.objects.values_list("actual_state", flat=True)) == {"running"}


def test_an_instance_the_agent_stops_reporting_is_stopped_once(node_a, prefill_a, decode_a):
    agent_services.node_register(
        node=node_a, endpoint=ENDPOINT, report=doc(node_a, item(prefill_a), item(decode_a))
    )
    for _ in range(2):
        agent_services.node_heartbeat(node=node_a, report=doc(node_a, item(prefill_a)))
    decode_a.refresh_from_db()
    assert decode_a.actual_state == ActualState.STOPPED and decode_a.last_report == {}
    stopped = FleetEvent.objects.filter(
        instance=decode_a, kind="instance.state", data__new="stopped"
    )
    assert stopped.count() == 1


def test_drift_is_reconciled_whether_or_not_the_report_changed(
    node_a, prefill_a, decode_a, monkeypatch
):
    report = doc(node_a, item(prefill_a), item(decode_a))
    agent_services.node_register(node=node_a, endpoint=ENDPOINT, report=report)
    Instance.objects.filter(pk=decode_a.pk).update(desired_state="stopped")
    enqueued: list[tuple] = []
    monkeypatch.setattr(agent_services, "enqueue_after_commit", lambda *a: enqueued.append(a))
    for _ in range(2):
        agent_services._last_triggered.pop(node_a.pk, None)  # past the per-node gap
        agent_services.node_heartbeat(node=node_a, report=report)
    assert enqueued == [("fleet.reconcile_node", node_a.pk)] * 2
