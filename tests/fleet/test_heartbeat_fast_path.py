"""The fast path of a heartbeat: a document that says what the node's last full heartbeat said
(the agent's heartbeat stats aside) is one UPDATE of the node's last heartbeat, with no
validation, lock or instance read; anything that could matter takes the full path again."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from rest_framework.test import APIClient

from fleet import agent_services, live, services
from fleet.choices import ActualState, DesiredState, NodeStatus
from fleet.models import FleetEvent, Instance, Node

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _fresh_memory():
    agent_services._full_beats.clear()
    yield
    agent_services._full_beats.clear()


@pytest.fixture(autouse=True)
def _commits(django_capture_on_commit_callbacks):
    """Each request's after-commit work runs when it ends, as in a server (the test's outer
    transaction would hold it back)."""
    global _capture
    _capture = django_capture_on_commit_callbacks
    yield
    _capture = None


_capture = None


@pytest.fixture
def agent(node_a) -> APIClient:
    node, token = services.node_create(
        hostname="fast-1", datacenter=node_a.datacenter, gpu_type=node_a.gpu_type, gpu_count=8
    )
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"AgentToken {token}")
    client.node = node
    return client


@pytest.fixture
def instance(agent, tiny_model) -> Instance:
    return services.instance_create(
        role="main_decode", node=agent.node, served_model=tiny_model, gpu_count=4
    )


def doc(instance: Instance, beat: int, *, state: str = "running", running: int = 0) -> dict:
    return {
        "protocol": 1,
        "instances": [
            {
                "instance_id": str(instance.pk),
                "role": instance.role,
                "state": state,
                "load": {"running": running, "queued": 0, "max_running": 32},
            }
        ],
        "control_plane": {"heartbeats_answered": beat},
    }


def beat(agent: APIClient, body, queries: list | None = None):
    with _capture(execute=True), CaptureQueriesContext(connection) as captured:
        response = agent.post("/api/v1/agent/heartbeat", body, format="json")
    if queries is not None:
        queries[:] = [q["sql"] for q in captured.captured_queries]
    return response


def _register(agent, instance):
    with _capture(execute=True):
        r = agent.post(
            "/api/v1/agent/register",
            doc(instance, 0) | {"endpoint": "http://127.0.0.1:9111"},
            format="json",
        )
    assert r.status_code == 200, r.content


def test_an_unchanged_beat_reads_and_writes_only_the_nodes_row(agent, instance, settings):
    settings.BATON_LIVE_REFRESH_S = 0.0  # the live view takes the heartbeat stats every beat
    _register(agent, instance)
    queries: list[str] = []
    assert beat(agent, doc(instance, 1), queries).status_code == 200  # full: remembered
    assert any("fleet_instance" in q for q in queries)
    before = Node.objects.get(pk=agent.node.pk).last_heartbeat_at

    assert beat(agent, doc(instance, 2), queries).status_code == 200
    statements = [q for q in queries if not q.startswith(("SAVEPOINT", "RELEASE"))]
    assert not any("fleet_instance" in q for q in statements), "\n".join(statements)
    assert not any("FOR UPDATE" in q for q in statements), statements
    writes = [q for q in statements if q.startswith(("UPDATE", "INSERT", "DELETE"))]
    assert len(writes) == 1 and writes[0].startswith('UPDATE "fleet_node"'), writes
    after = Node.objects.get(pk=agent.node.pk).last_heartbeat_at
    assert after > before
    # The live view has the agent's latest heartbeat stats and the instance as reported.
    entry = next(e for e in live.read_reports() if e["node_id"] == agent.node.pk)
    assert entry["report"]["control_plane"] == {"heartbeats_answered": 2}
    assert entry["report"]["instances"][0]["instance_id"] == str(instance.pk)


def test_a_changed_beat_takes_the_full_path(agent, instance):
    _register(agent, instance)
    beat(agent, doc(instance, 1))
    assert beat(agent, doc(instance, 2, state="draining")).status_code == 200
    instance.refresh_from_db()
    assert instance.actual_state == ActualState.DRAINING
    assert beat(agent, doc(instance, 3, state="draining", running=4)).status_code == 200
    instance.refresh_from_db()
    assert instance.last_report["load"]["running"] == 4


def test_a_node_marked_offline_comes_back_with_the_same_document(agent, instance):
    _register(agent, instance)
    beat(agent, doc(instance, 1))
    later = timezone.now() + timedelta(seconds=60)
    assert agent_services.nodes_mark_offline(now=later) == [agent.node.pk]
    assert beat(agent, doc(instance, 2)).status_code == 200
    node = Node.objects.get(pk=agent.node.pk)
    assert node.status == NodeStatus.ONLINE
    assert FleetEvent.objects.filter(node=node, kind="node.online").count() == 2
    instance.refresh_from_db()
    assert instance.actual_state == ActualState.RUNNING


def test_an_operator_change_to_an_instance_ends_the_fast_path(agent, instance, monkeypatch):
    _register(agent, instance)
    beat(agent, doc(instance, 1))
    enqueued: list[tuple] = []
    monkeypatch.setattr(agent_services, "enqueue_after_commit", lambda *a: enqueued.append(a))
    agent_services._last_triggered.pop(agent.node.pk, None)
    services.instance_set_desired_state(instance=instance, desired_state=DesiredState.STOPPED)
    queries: list[str] = []
    beat(agent, doc(instance, 2), queries)
    assert any("fleet_instance" in q for q in queries)  # compared again: drift seen
    assert ("fleet.reconcile_node", agent.node.pk) in enqueued


def test_an_edit_of_the_node_ends_the_fast_path(agent, instance):
    _register(agent, instance)
    beat(agent, doc(instance, 1))
    node = Node.objects.get(pk=agent.node.pk)
    node.gpu_count = 4
    node.save()
    queries: list[str] = []
    beat(agent, doc(instance, 2), queries)
    assert any("fleet_instance" in q for q in queries)


def test_a_full_beat_comes_again_after_the_configured_time(agent, instance, settings):
    settings.BATON_HEARTBEAT_FULL_EVERY_S = 0.0  # a full beat vouches for no later one
    _register(agent, instance)
    beat(agent, doc(instance, 1))
    queries: list[str] = []
    beat(agent, doc(instance, 2), queries)
    assert any("fleet_instance" in q for q in queries)


def test_claims_on_other_instances_are_never_fast(agent, instance, prefill_a):
    _register(agent, instance)
    foreign = doc(instance, 1)
    foreign["instances"].append({"instance_id": str(prefill_a.pk), "state": "running"})
    for n in range(3):
        foreign["control_plane"] = {"heartbeats_answered": n}
        queries: list[str] = []
        assert beat(agent, foreign, queries).status_code == 200
        assert any("fleet_instance" in q for q in queries)
    prefill_a.refresh_from_db()
    assert prefill_a.actual_state != ActualState.RUNNING


@pytest.mark.parametrize(
    "body", [["not", "an", "object"], {"instances": "nope"}, {"instances": [{"state": "x"}]}]
)
def test_bad_documents_are_still_400_after_a_fast_beat(agent, instance, body):
    _register(agent, instance)
    beat(agent, doc(instance, 1))
    beat(agent, doc(instance, 2))
    r = beat(agent, body)
    assert r.status_code == 400, r.content
    instance.refresh_from_db()
    assert instance.actual_state == ActualState.RUNNING


def test_a_periodic_full_beat_is_not_validated_again(agent, instance, settings, monkeypatch):
    """A full beat that repeats the document validated at the node's last one is taken whole
    (compared with the instances) without building the serializer again; a changed document
    is validated, and a bad one is still a 400."""
    from fleet.api import agent as agent_api

    settings.BATON_HEARTBEAT_FULL_EVERY_S = 0.0  # every beat is a full one
    built: list[int] = []
    real = agent_api.StateDocumentSerializer

    class Counting(real):
        def __init__(self, *args, **kwargs):
            built.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(agent_api, "StateDocumentSerializer", Counting)
    _register(agent, instance)
    assert beat(agent, doc(instance, 1)).status_code == 200
    assert len(built) == 1
    queries: list[str] = []
    assert beat(agent, doc(instance, 2), queries).status_code == 200  # same document
    assert any("fleet_instance" in q for q in queries)  # taken whole
    assert len(built) == 1  # not validated again
    assert beat(agent, doc(instance, 3, running=2)).status_code == 200  # changed: validated
    assert len(built) == 2
    bad = doc(instance, 4)
    bad["instances"][0]["load"] = "lots"
    assert beat(agent, bad).status_code == 400
    instance.refresh_from_db()
    assert instance.last_report["load"]["running"] == 2
