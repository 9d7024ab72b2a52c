"""The agent-facing API and the control plane's bookkeeping of agents: registration,
heartbeats, health, and the plan that brings reported states to desired ones."""

from __future__ import annotations

import json
import socket
import threading
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from fleet import agent_services, services
from fleet.agent_client import AgentClient
from fleet.choices import ActualState, NodeStatus
from fleet.models import FleetEvent, Instance, Node, ServedModel

pytestmark = pytest.mark.django_db


def agent_client(token: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"AgentToken {token}")
    return client


def state_doc(*instances: dict) -> dict:
    return {"node": "x", "datacenter": "dc-a", "protocol": 1, "instances": list(instances)}


def report(instance: Instance, state: str = "running", running: int = 1) -> dict:
    return {
        "instance_id": str(instance.pk),
        "role": instance.role,
        "model": "baton-tiny",
        "state": state,
        "load": {"running": running, "queued": 0, "max_running": 32},
        "kv": {"used_blocks": 3, "total_blocks": 64, "block_size": 16},
    }


@pytest.fixture
def token_a(node_a) -> str:
    return services.node_rotate_token(node=node_a)


def register(token: str, endpoint: str = "http://127.0.0.1:9101", *instances: dict):
    return agent_client(token).post(
        "/api/v1/agent/register", {**state_doc(*instances), "endpoint": endpoint}, format="json"
    )


def test_registration_records_endpoint_and_returns_command_token_and_links(
    node_a, token_a, link_ab
):
    response = register(token_a)
    assert response.status_code == 200, response.json()
    body = response.json()
    node_a.refresh_from_db()
    assert body["node_id"] == node_a.pk
    assert body["hostname"] == "a-1"
    assert body["datacenter"] == "dc-a"
    assert body["heartbeat_interval_s"] == 2.0
    assert body["command_token"] == node_a.command_token and len(body["command_token"]) > 20
    assert body["links"] == {
        "dc-b": {"bandwidth_gbps": 20.0, "rtt_ms": 30.0, "pool_size": 16, "status": "up"}
    }
    assert node_a.agent_endpoint == "http://127.0.0.1:9101"
    assert node_a.status == NodeStatus.ONLINE


def test_registration_hands_out_the_data_plane_token_only_when_one_is_set(
    node_a, token_a, settings
):
    assert "data_token" not in register(token_a).json()
    settings.BATON_DATA_TOKEN = "fleet-data-token-0123456789"
    assert register(token_a).json()["data_token"] == "fleet-data-token-0123456789"


def test_each_registration_issues_a_new_command_token(node_a, token_a):
    first = register(token_a).json()["command_token"]
    second = register(token_a).json()["command_token"]
    assert first != second


def test_heartbeat_updates_instance_states_and_load(node_a, token_a, prefill_a):
    register(token_a)
    response = agent_client(token_a).post(
        "/api/v1/agent/heartbeat", state_doc(report(prefill_a, "running", running=3)), format="json"
    )
    assert response.status_code == 200
    prefill_a.refresh_from_db()
    assert prefill_a.actual_state == ActualState.RUNNING
    assert prefill_a.last_report["load"] == {"running": 3, "queued": 0, "max_running": 32}
    assert FleetEvent.objects.filter(instance=prefill_a, kind="instance.state").exists()


def test_heartbeat_before_registration_is_404(token_a):
    response = agent_client(token_a).post("/api/v1/agent/heartbeat", state_doc(), format="json")
    assert response.status_code == 404


def test_an_instance_missing_from_the_report_is_stopped(node_a, token_a, prefill_a):
    register(token_a, "http://127.0.0.1:9101", report(prefill_a))
    agent_client(token_a).post("/api/v1/agent/heartbeat", state_doc(), format="json")
    prefill_a.refresh_from_db()
    assert prefill_a.actual_state == ActualState.STOPPED


def test_a_token_cannot_report_for_another_nodes_instance(node_a, node_b, token_a, tiny_model):
    md = services.instance_create(
        role="main_decode", node=node_b, served_model=tiny_model, gpu_count=1
    )
    register(token_a)
    agent_client(token_a).post("/api/v1/agent/heartbeat", state_doc(report(md)), format="json")
    md.refresh_from_db()
    assert md.actual_state == ActualState.PENDING
    node_b.refresh_from_db()
    assert node_b.last_heartbeat_at is None


def test_bad_agent_token_is_401(db):
    response = agent_client("bnt_000000000000_nope").post(
        "/api/v1/agent/heartbeat", state_doc(), format="json"
    )
    assert response.status_code == 401


def test_operator_token_cannot_use_the_agent_api(operator):
    response = operator.post("/api/v1/agent/heartbeat", state_doc(), format="json")
    assert response.status_code in (401, 403)


def test_agent_token_cannot_read_or_write_operator_resources(token_a):
    client = agent_client(token_a)
    assert client.get("/api/v1/nodes/").status_code == 401
    assert client.post("/api/v1/datacenters/", {"name": "x", "region": "y"}).status_code == 401


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"instances": [{"instance_id": "1", "state": "exploded"}]}, "instances"),
        ({"instances": "all of them"}, "instances"),
        ({}, "instances"),
    ],
)
def test_malformed_heartbeat_is_400_and_changes_nothing(node_a, token_a, body, field):
    register(token_a)
    node_a.refresh_from_db()
    before = node_a.last_heartbeat_at
    response = agent_client(token_a).post("/api/v1/agent/heartbeat", body, format="json")
    assert response.status_code == 400
    assert field in response.json()
    node_a.refresh_from_db()
    assert node_a.last_heartbeat_at == before


def test_registration_needs_an_endpoint_url(token_a):
    response = agent_client(token_a).post(
        "/api/v1/agent/register", {**state_doc(), "endpoint": "not a url"}, format="json"
    )
    assert response.status_code == 400
    assert "endpoint" in response.json()


def test_silent_node_goes_offline_and_instances_unavailable_then_returns(
    node_a, token_a, prefill_a
):
    register(token_a, "http://127.0.0.1:9101", report(prefill_a))
    Node.objects.filter(pk=node_a.pk).update(
        last_heartbeat_at=timezone.now() - timedelta(seconds=7)
    )
    assert agent_services.nodes_mark_offline() == [node_a.pk]
    node_a.refresh_from_db()
    prefill_a.refresh_from_db()
    assert node_a.status == NodeStatus.OFFLINE
    assert prefill_a.actual_state == ActualState.UNAVAILABLE
    agent_client(token_a).post(
        "/api/v1/agent/heartbeat", state_doc(report(prefill_a)), format="json"
    )
    node_a.refresh_from_db()
    prefill_a.refresh_from_db()
    assert node_a.status == NodeStatus.ONLINE
    assert prefill_a.actual_state == ActualState.RUNNING


def test_a_node_within_its_grace_stays_online(node_a, token_a):
    register(token_a)
    Node.objects.filter(pk=node_a.pk).update(
        last_heartbeat_at=timezone.now() - timedelta(seconds=5)
    )
    assert agent_services.nodes_mark_offline() == []


def _inst(pk: int, desired: str) -> Instance:
    instance = Instance(desired_state=desired)
    instance.pk = pk
    return instance


@pytest.mark.parametrize(
    ("desired", "reported", "expected"),
    [
        ("running", None, ["start"]),
        ("running", "stopped", ["start"]),
        ("running", "failed", ["start"]),
        ("running", "running", []),
        ("running", "starting", []),
        ("drained", "running", ["drain"]),
        ("drained", "draining", []),
        ("drained", "drained", []),
        ("stopped", "running", ["stop"]),
        ("stopped", "drained", ["stop"]),
        ("stopped", None, []),
        ("stopped", "stopped", []),
    ],
)
def test_plan_actions(desired, reported, expected):
    actions = agent_services.plan_actions(
        desired=[_inst(1, desired)],
        reported={} if reported is None else {1: reported},
        known_ids={1},
    )
    assert [a.verb for a in actions] == expected


def test_plan_stops_instances_the_fleet_does_not_know():
    actions = agent_services.plan_actions(desired=[], reported={7: "running"}, known_ids=set())
    assert [(a.verb, a.instance_id) for a in actions] == [("stop", 7)]


def _recording_agent(monkeypatch) -> list[httpx.Request]:
    """Every AgentClient the services make talks to a fake agent that runs nothing."""
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.method == "GET":
            return httpx.Response(200, json=state_doc())
        return httpx.Response(200, json={"state": "starting"})

    transport = httpx.MockTransport(handler)
    real = agent_services.AgentClient
    monkeypatch.setattr(agent_services, "AgentClient", lambda node: real(node, transport=transport))
    return seen


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_reconcile_starts_an_instance_in_its_served_models_dtype(
    node_a, token_a, prefill_a, monkeypatch, dtype
):
    ServedModel.objects.filter(pk=prefill_a.served_model_id).update(dtype=dtype)
    register(token_a)
    node_a.refresh_from_db()
    seen = _recording_agent(monkeypatch)
    actions = agent_services.node_reconcile(node=node_a)
    assert [(a.verb, a.instance_id) for a in actions] == [("start", prefill_a.pk)]
    (put,) = [r for r in seen if r.method == "PUT"]
    assert put.url.path == f"/instances/{prefill_a.pk}"
    assert json.loads(put.content) == {
        "role": "prefill",
        "model": "baton-tiny",
        "source": "baton-tiny",
        "dtype": dtype,
        "gpu": {
            "name": "generic gpu-a",
            "count": prefill_a.gpu_count,
            "peak_bf16_tflops": 989.0,
            "memory_gib": 80.0,
            "memory_bandwidth_gbps": 3350.0,
            "interconnect_gbps": 400.0,
        },
    }


def test_an_emulated_instances_start_command_names_its_gpu_unit(
    node_a, token_a, prefill_a, monkeypatch
):
    ServedModel.objects.filter(pk=prefill_a.served_model_id).update(
        source="profile:paper-dsv4", kv_bytes_per_token=4400
    )
    register(token_a)
    node_a.refresh_from_db()
    seen = _recording_agent(monkeypatch)
    agent_services.node_reconcile(node=node_a)
    (put,) = [r for r in seen if r.method == "PUT"]
    body = json.loads(put.content)
    assert body["source"] == "profile:paper-dsv4"
    # The agent turns these into the unit the planner uses (pdd.hardware.unit_from_json).
    from pdd.hardware import unit_from_json

    unit = unit_from_json(body["gpu"])
    assert unit.peak_tflops == 989 * prefill_a.gpu_count
    assert unit.interconnect_gbps == 400 * 8 * prefill_a.gpu_count


def test_a_start_without_a_dtype_leaves_it_to_the_agent(node_a, token_a):
    register(token_a)
    node_a.refresh_from_db()
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={})

    with AgentClient(node_a, transport=httpx.MockTransport(handler)) as client:
        client.start_instance(instance_id=4, role="prefill", model="m", source="m")
    assert json.loads(seen[0].content) == {"role": "prefill", "model": "m", "source": "m"}


def test_agent_command_prints_a_serve_line_with_a_working_token(node_a, capsys):
    from django.core.management import call_command

    call_command("agent_command", "a-1", "--control-plane", "http://cp.example:8000")
    line = capsys.readouterr().out.strip()
    # The token rides in the agent's environment, never in its arguments (`ps` shows those).
    assignment, _, command = line.partition(" ")
    assert command.startswith(
        "python -m agents serve --node a-1 --datacenter dc-a --listen 0.0.0.0:9000 "
    )
    assert "--control-plane http://cp.example:8000" in command
    assert "--token" not in command
    name, _, token = assignment.partition("=")
    assert name == "BATON_AGENT_TOKEN"
    assert services.node_authenticate_token(token) == node_a


def test_agent_command_can_write_the_token_to_a_private_file(node_a, capsys, tmp_path):
    from django.core.management import call_command

    path = tmp_path / "a-1.token"
    call_command("agent_command", "a-1", "--token-file", str(path))
    line = capsys.readouterr().out.strip()
    assert line.endswith(f"--token-file {path}")
    assert path.stat().st_mode & 0o777 == 0o600
    assert services.node_authenticate_token(path.read_text().strip()) == node_a


def test_agent_command_for_an_unknown_node_is_a_one_line_error():
    from django.core.management import call_command
    from django.core.management.base import CommandError

    with pytest.raises(CommandError, match="no node with hostname or id 'ghost'"):
        call_command("agent_command", "ghost")


@pytest.mark.django_db(transaction=True)
def test_an_unreachable_agent_is_one_warning_line_and_an_unexpected_error_a_traceback(
    monkeypatch, caplog
):
    from fleet import tasks
    from fleet.agent_client import AgentUnreachable

    def unreachable(*args):
        raise AgentUnreachable("a-1: PUT /links/dc-b: connection refused")

    def broken(*args):
        raise RuntimeError("bug")

    monkeypatch.setattr(tasks.link_apply, "delay", unreachable)
    with caplog.at_level("WARNING", logger="fleet.dispatch"):
        services.enqueue_after_commit("fleet.link_apply", 1)
    (record,) = caplog.records
    assert "reconcile will retry" in record.getMessage() and "connection refused" in (
        record.getMessage()
    )
    assert record.exc_info is None
    caplog.clear()
    monkeypatch.setattr(tasks.link_apply, "delay", broken)
    with caplog.at_level("WARNING", logger="fleet.dispatch"):
        services.enqueue_after_commit("fleet.link_apply", 1)
    (record,) = caplog.records
    assert record.exc_info is not None


class _Health(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - the http.server hook
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass


def test_late_beats_from_an_agent_that_answers_its_probe_keep_the_node_online(
    node_a, token_a, settings
):
    """A control plane too busy to take the beats in time (heartbeat round trips of 7-13 s
    at 256 streams on four busy web processes) took a live P offline and every request got
    503: a node silent past the TTL but within BATON_LIVE_LATE_S more stays online while its
    agent answers; past that window, or with its agent gone, it goes offline."""
    settings.BATON_LIVE_LATE_S = 6.0
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        register(token_a, f"http://127.0.0.1:{server.server_address[1]}")
        Node.objects.filter(pk=node_a.pk).update(
            last_heartbeat_at=timezone.now() - timedelta(seconds=8)
        )
        assert agent_services.nodes_mark_offline() == []
        assert Node.objects.get(pk=node_a.pk).status == NodeStatus.ONLINE
        # Past the late window the agent's answer does not matter.
        Node.objects.filter(pk=node_a.pk).update(
            last_heartbeat_at=timezone.now() - timedelta(seconds=13)
        )
        assert agent_services.nodes_mark_offline() == [node_a.pk]
    finally:
        server.shutdown()
        server.server_close()


def test_late_beats_from_an_agent_that_is_gone_take_the_node_offline(node_a, token_a):
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    port = dead.getsockname()[1]
    dead.close()  # nothing listens there
    register(token_a, f"http://127.0.0.1:{port}")
    Node.objects.filter(pk=node_a.pk).update(
        last_heartbeat_at=timezone.now() - timedelta(seconds=7)
    )
    assert agent_services.nodes_mark_offline() == [node_a.pk]
