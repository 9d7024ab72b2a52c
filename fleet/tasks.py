"""Celery tasks that drive agents. Each takes ids, calls one service, and is idempotent: it
compares what the agent reports with what is desired, so running it twice changes nothing."""

from __future__ import annotations

import logging

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
    operators want (agent_services.nodes_with_drift: no agent is asked for that); every online
    node once every ``BATON_RECONCILE_FULL_EVERY_S`` as well, whatever it reported (a share of
    the nodes at each round), and every one at the worker's first round."""
    global _round
    online = Node.objects.filter(status=NodeStatus.ONLINE)
    if _round < 0:  # this worker's first round: every online node
        node_ids = list(online.values_list("pk", flat=True))
    else:
        # The full sweep spread over the rounds of BATON_RECONCILE_FULL_EVERY_S: each round
        # also visits the nodes whose id falls in its share (at 1,000 nodes, 1,000 tasks at
        # once every minute queued up to 2,989 tasks in the control-path benchmark).
        every = float(settings.BATON_RECONCILE_FULL_EVERY_S)
        shares = max(1, round(every / max(float(settings.BATON_RECONCILE_INTERVAL_S), 0.001)))
        ids = online.values_list("pk", flat=True)
        share = {pk for pk in ids if pk % shares == _round % shares}
        node_ids = sorted(share | set(agent_services.nodes_with_drift()))
    _round += 1
    for node_id in node_ids:
        reconcile_node.delay(node_id)
    return len(node_ids)


# This worker's rounds so far (-1: none yet; its first round visits every online node).
_round = -1


@shared_task(name="fleet.health_check")
def health_check() -> list[int]:
    """Periodic: nodes that stopped heartbeating go offline, their instances unavailable."""
    return agent_services.nodes_mark_offline()


def enqueue_instance_apply(instance: Instance) -> None:
    instance_apply.delay(instance.node_id, instance.pk)
