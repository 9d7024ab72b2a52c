"""Fleet changes, told once the write has committed: ``fleet_changed`` carries one small
payload per saved or deleted instance, node or WAN link. The fleet only offers the signal; the
control plane connects it to the dashboards' websocket group (controlplane/push.py)."""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.db.models.signals import post_delete, post_save
from django.dispatch import Signal, receiver

from fleet import beats
from fleet.agent_services import forget_full_beat
from fleet.dispatch import enqueue_after_commit
from fleet.models import Instance, Node, WANLink

# Sent with payload=dict (JSON-ready: type, event, id and the changed fields) after commit.
fleet_changed = Signal()


def _push_after_commit(payload: dict[str, Any]) -> None:
    transaction.on_commit(lambda: fleet_changed.send(sender=None, payload=payload))


# Fields a heartbeat writes that no payload carries (an agent's reports, the time of its last
# beat): a save of only these changes nothing a push would tell, so none is sent. Under traffic
# every beat changes an instance's load; each such save pushed to every dashboard.
_REPORT_FIELDS = {
    Instance: frozenset({"last_report", "updated_at"}),
    Node: frozenset({"last_report", "last_heartbeat_at", "updated_at"}),
}


def _reports_only(model, update_fields) -> bool:
    return update_fields is not None and frozenset(update_fields) <= _REPORT_FIELDS[model]


@receiver(post_save, sender=Instance)
def instance_saved(sender, instance: Instance, created: bool, update_fields=None, **kwargs) -> None:
    # The node's next heartbeat is compared with its instances again (no fast path).
    forget_full_beat(instance.node_id)
    if not created and _reports_only(Instance, update_fields):
        return
    _push_after_commit(
        {
            "type": "instance",
            "event": "created" if created else "updated",
            "id": instance.pk,
            "role": instance.role,
            "node": instance.node_id,
            "desired_state": instance.desired_state,
            "actual_state": instance.actual_state,
        }
    )


@receiver(post_delete, sender=Instance)
def instance_deleted(sender, instance: Instance, **kwargs) -> None:
    forget_full_beat(instance.node_id)
    _push_after_commit({"type": "instance", "event": "deleted", "id": instance.pk})


@receiver(post_delete, sender=Node)
def node_deleted(sender, instance: Node, **kwargs) -> None:
    beats.forget_node(instance.pk)


@receiver(post_save, sender=WANLink)
def link_saved(sender, instance: WANLink, created: bool, **kwargs) -> None:
    # Editing a link reaches the agents at both ends (bandwidth, RTT, pool size).
    enqueue_after_commit("fleet.link_apply", instance.pk)
    _push_after_commit(
        {
            "type": "wan_link",
            "event": "created" if created else "updated",
            "id": instance.pk,
            "status": instance.status,
            "bandwidth_gbps": instance.bandwidth_gbps,
            "rtt_ms": instance.rtt_ms,
        }
    )


@receiver(post_save, sender=Node)
def node_saved(sender, instance: Node, created: bool, update_fields=None, **kwargs) -> None:
    if not created and _reports_only(Node, update_fields):
        return
    # A changed node (its token, status, endpoint...) takes its next heartbeat whole.
    beats.forget_node(instance.pk)
    _push_after_commit(
        {
            "type": "node",
            "event": "created" if created else "updated",
            "id": instance.pk,
            "status": instance.status,
        }
    )
