"""Celery tasks that drive agents. Each takes ids, calls one service, and is idempotent: it
compares what the agent reports with what is desired, so running it twice changes nothing."""

from __future__ import annotations

import logging
import time

from celery import shared_task
from django.conf import settings

from fleet import agent_services
from fleet.agent_client import AgentUnreachable
from fleet.choices import NodeStatus
from fleet.models import Instance, Node, WANLink

log = logging.getLogger(__name__)

RETRY = {
    "autoretry_for": (AgentUnreachable,),
    "retry_backoff": 1,
    "retry_backoff_max": 30,
    "retry_jitter": True,
    "max_retries": 5,
}


@shared_task(name="fleet.instance_apply", **RETRY)
def instance_apply(node_id: int, instance_id: int) -> list[str]:
    """Make one instance's actual state follow its desired state (or stop it if deleted)."""
    node = Node.objects.filter(pk=node_id).first()
    if node is None:
        return []
    actions = agent_services.node_reconcile(node=node, instance_ids={instance_id}, actor="apply")
    return [f"{a.verb} {a.instance_id}" for a in actions]


@shared_task(name="fleet.link_apply", **RETRY)
def link_apply(link_id: int) -> list[str]:
    """Push a WAN link's shaping settings to the agents at both ends."""
    link = (
        WANLink.objects.select_related("from_datacenter", "to_datacenter")
        .filter(pk=link_id)
        .first()
    )
    if link is None:
        return []
    return agent_services.link_push(link=link)


@shared_task(name="fleet.reconcile_node", **RETRY)
def reconcile_node(node_id: int) -> list[str]:
    node = Node.objects.filter(pk=node_id).first()
    if node is None:
        return []
    actions = agent_services.node_reconcile(node=node)
    return [f"{a.verb} {a.instance_id}" for a in actions]


@shared_task(name="fleet.reconcile_fleet")
def reconcile_fleet() -> int:
    """Periodic: fan out one reconcile per online node that needs one, so one slow agent
    delays no other. A node needs one when its last heartbeat's report differs from what
    operators want (agent_services.nodes_with_drift: no agent is asked for that); every
    ``BATON_RECONCILE_FULL_EVERY_S`` every online node does, whatever it reported."""
    global _last_full
    now = time.monotonic()
    if now - _last_full >= float(settings.BATON_RECONCILE_FULL_EVERY_S):
        _last_full = now
        node_ids = list(Node.objects.filter(status=NodeStatus.ONLINE).values_list("pk", flat=True))
    else:
        node_ids = agent_services.nodes_with_drift()
    for node_id in node_ids:
        reconcile_node.delay(node_id)
    return len(node_ids)


# When this worker last sent every online node a reconcile (its first round does).
_last_full = float("-inf")


@shared_task(name="fleet.health_check")
def health_check() -> list[int]:
    """Periodic: nodes that stopped heartbeating go offline, their instances unavailable."""
    return agent_services.nodes_mark_offline()


def enqueue_instance_apply(instance: Instance) -> None:
    instance_apply.delay(instance.node_id, instance.pk)
