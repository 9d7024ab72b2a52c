"""The periodic reconcile asks only the agents whose last heartbeat differs from what operators
want, and every online node's agent once every BATON_RECONCILE_FULL_EVERY_S."""

from __future__ import annotations

import pytest

from fleet import agent_services, services, tasks
from fleet.choices import DesiredState

pytestmark = pytest.mark.django_db


def _item(instance, state="running") -> dict:
    return {"instance_id": str(instance.pk), "role": instance.role, "state": state}


@pytest.fixture
def two_nodes(node_a, node_b, tiny_model):
    a = services.instance_create(role="prefill", node=node_a, served_model=tiny_model, gpu_count=8)
    b = services.instance_create(
        role="main_decode", node=node_b, served_model=tiny_model, gpu_count=8
    )
    for node, inst in ((node_a, a), (node_b, b)):
        agent_services.node_register(
            node=node,
            endpoint=f"http://127.0.0.1:{9100 + node.pk}",
            report={"instances": [_item(inst)]},
        )
    return (node_a, a), (node_b, b)


def test_only_nodes_that_drift_need_a_reconcile(two_nodes):
    (node_a, a), (node_b, b) = two_nodes
    assert agent_services.nodes_with_drift() == []
    services.instance_set_desired_state(instance=a, desired_state=DesiredState.STOPPED)
    assert agent_services.nodes_with_drift() == [node_a.pk]
    # The agent says it stopped it: no drift left.
    agent_services.node_heartbeat(node=node_a, report={"instances": [_item(a, "stopped")]})
    assert agent_services.nodes_with_drift() == []
    # An instance the agent no longer reports, but operators want running.
    agent_services.node_heartbeat(node=node_b, report={"instances": []})
    assert agent_services.nodes_with_drift() == [node_b.pk]


def test_the_periodic_round_visits_drift_and_every_node_now_and_then(
    two_nodes, monkeypatch, settings
):
    (node_a, a), (node_b, _) = two_nodes
    sent: list[int] = []
    monkeypatch.setattr(tasks.reconcile_node, "delay", sent.append)
    monkeypatch.setattr(tasks, "_round", -1)
    settings.BATON_RECONCILE_INTERVAL_S = 5
    settings.BATON_RECONCILE_FULL_EVERY_S = 3600  # 720 shares: node ids 1..n fall in few
    assert tasks.reconcile_fleet() == 2  # the first round: every online node
    assert sorted(sent) == sorted([node_a.pk, node_b.pk])
    sent.clear()
    # Rounds whose share holds neither node, with nothing drifting: no agent is asked.
    monkeypatch.setattr(tasks, "_round", 700)
    assert tasks.reconcile_fleet() == 0
    services.instance_set_desired_state(instance=a, desired_state=DesiredState.DRAINED)
    assert tasks.reconcile_fleet() == 1 and sent == [node_a.pk]
    sent.clear()
    # One full sweep per BATON_RECONCILE_FULL_EVERY_S: over 2 rounds here, every node once.
    settings.BATON_RECONCILE_FULL_EVERY_S = 10
    services.instance_set_desired_state(instance=a, desired_state=DesiredState.RUNNING)
    tasks.reconcile_fleet()
    tasks.reconcile_fleet()
    assert sorted(sent) == sorted([node_a.pk, node_b.pk])
