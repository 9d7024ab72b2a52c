"""Agents join the fleet for real: registration, heartbeats, provisioning by tasks, reconcile,
health, idempotent tasks, link edits reaching agents, and token scope."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.slow


def test_declared_instances_reach_running_and_report_load(cluster):
    assert cluster.instance_states() == {
        "prefill": "running",
        "relay_decode": "running",
        "main_decode": "running",
    }
    with cluster.api() as api:
        nodes = api.get("/api/v1/nodes/").json()["results"]
        events = api.get("/api/v1/events/", params={"kind": "node.registered"}).json()["results"]
    assert {n["hostname"]: n["status"] for n in nodes} == {
        "a-p": "online",
        "a-rld": "online",
        "b-md": "online",
    }
    assert {e["node"] for e in events} == {n["id"] for n in nodes}


def test_reconcile_repairs_an_instance_stopped_behind_the_control_planes_back(cluster):
    md_id = cluster.setup["instances"]["main_decode"]
    token = cluster.command_token("b-md")
    response = httpx.delete(
        f"{cluster.agents['b-md'].http}/instances/{md_id}",
        headers={"Authorization": f"Bearer {token}"},
        timeout=30,
    )
    assert response.status_code == 200

    def repaired():
        state = cluster.agent_state("b-md")
        running = [
            i
            for i in state["instances"]
            if i["instance_id"] == str(md_id) and i["state"] == "running"
        ]
        return bool(running)

    cluster.wait_for(repaired, 90, "reconcile to start the instance again")
    with cluster.api() as api:
        events = api.get("/api/v1/events/", params={"instance": md_id}).json()["results"]
    assert any(e["kind"].endswith(".start") for e in events), [e["kind"] for e in events]


def test_a_task_run_twice_changes_nothing_the_second_time(cluster):
    p_id = cluster.setup["instances"]["prefill"]
    node_id = cluster.setup["nodes"]["a-p"]["id"]
    code = (
        "from fleet.tasks import instance_apply; "
        f"print(instance_apply.apply(args=[{node_id}, {p_id}]).get()); "
        f"print(instance_apply.apply(args=[{node_id}, {p_id}]).get())"
    )
    first, second = cluster.shell(code).strip().splitlines()[-2:]
    assert second == "[]"
    assert first == "[]"  # it already runs: the first run found nothing to do either


def test_draining_an_instance_reaches_the_agent_and_start_brings_it_back(cluster):
    rld_id = cluster.setup["instances"]["relay_decode"]
    with cluster.api() as api:
        assert api.post(f"/api/v1/instances/{rld_id}/drain/").status_code == 200
    cluster.wait_for(lambda: cluster.instance_states()["relay_decode"] == "drained", 60, "drained")
    with cluster.api() as api:
        assert api.post(f"/api/v1/instances/{rld_id}/start/").status_code == 200
    cluster.wait_for(
        lambda: cluster.instance_states()["relay_decode"] == "running", 90, "running again"
    )


def test_a_wan_link_edit_reaches_the_agents(cluster):
    with cluster.api() as api:
        response = api.patch(
            f"/api/v1/wan-links/{cluster.setup['link']}/", json={"bandwidth_gbps": 2.5, "rtt_ms": 7}
        )
        assert response.status_code == 200

    def applied():
        link = cluster.agent_state("a-p")["links"].get("dc-b", {})
        return link if link.get("bandwidth_gbps") == 2.5 and link.get("rtt_ms") == 7 else None

    cluster.wait_for(applied, 60, "the link settings on the prefill agent")
    md_link = cluster.agent_state("b-md")["links"].get("dc-a", {})
    assert md_link.get("bandwidth_gbps") == 2.5
    with cluster.api() as api:
        api.patch(
            f"/api/v1/wan-links/{cluster.setup['link']}/", json={"bandwidth_gbps": 1, "rtt_ms": 5}
        )


def test_an_agent_token_cannot_use_the_operator_api_or_speak_for_another_node(cluster):
    token = cluster.setup["nodes"]["a-p"]["token"]
    headers = {"Authorization": f"AgentToken {token}"}
    assert httpx.get(f"{cluster.url}/api/v1/nodes/", headers=headers, timeout=10).status_code == 401
    assert (
        httpx.get(
            f"{cluster.url}/api/v1/nodes/", headers={"Authorization": f"Token {token}"}, timeout=10
        ).status_code
        == 401
    )
    md_id = cluster.setup["instances"]["main_decode"]
    fake = {"instances": [{"instance_id": str(md_id), "state": "failed"}]}
    assert (
        httpx.post(
            f"{cluster.url}/api/v1/agent/heartbeat", json=fake, headers=headers, timeout=10
        ).status_code
        == 200
    )
    assert cluster.instance_states()["main_decode"] == "running"


def test_an_agent_commands_need_the_command_token(cluster):
    response = httpx.put(
        f"{cluster.agents['a-p'].http}/instances/999",
        json={"role": "prefill", "model": "baton-tiny", "source": "baton-tiny"},
        timeout=10,
    )
    assert response.status_code == 401


def test_a_killed_agent_goes_offline_and_comes_back_after_restart(cluster):
    cluster.agents["b-md"].kill()
    cluster.wait_for(lambda: cluster.node_status("b-md") == "offline", 60, "b-md offline")
    assert cluster.instance_states()["main_decode"] == "unavailable"
    cluster.start_agent("b-md")
    cluster.wait_for(lambda: cluster.node_status("b-md") == "online", 60, "b-md online")
    cluster.wait_for(
        lambda: cluster.instance_states()["main_decode"] == "running", 120, "MD running again"
    )
