"""Fleet business rules that span rows, and the writes that must respect them.

Views, serializers, admin and tasks call these; each takes keyword arguments and records a
FleetEvent for anything an operator would want in the history.
"""

from __future__ import annotations

import logging
from typing import Any

from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Count, Q

from fleet.choices import DesiredState, InstanceRole
from fleet.dispatch import enqueue_after_commit
from fleet.events import event_record
from fleet.models import (
    Datacenter,
    GPUType,
    Instance,
    Node,
    ServedModel,
    UnitPrice,
    WANLink,
)
from pdd import tokens

log = logging.getLogger(__name__)


# --- events ---------------------------------------------------------------------------------


# --- agent tokens ---------------------------------------------------------------------------


def node_token_generate() -> tuple[str, str, str]:
    """A fresh agent token as (token, public prefix, hash); only the hash is ever stored."""
    return tokens.new_token(Node.scheme, Node.separator, Node.prefix_bytes)


def node_authenticate_token(token: str) -> Node | None:
    """The node an agent token speaks for, or None for an unknown or malformed token."""
    # By its unique prefix: no ordering (the default one joins the datacenter), and without
    # the stored report, which no caller of an agent's request reads from this object.
    return Node.find(token, Node.objects.defer("last_report").order_by())


@transaction.atomic
def node_create(
    *,
    hostname: str,
    datacenter: Datacenter,
    gpu_type: GPUType,
    gpu_count: int,
    agent_endpoint: str = "",
    actor: str = "",
) -> tuple[Node, str]:
    """Create a node and return it with its agent token, which is not recoverable later."""
    node = Node(
        hostname=hostname,
        datacenter=datacenter,
        gpu_type=gpu_type,
        gpu_count=gpu_count,
        agent_endpoint=agent_endpoint,
    )
    token = node.new_secret()
    node.full_clean()
    node.save()
    event_record(
        kind="node.created",
        message=f"Node {hostname} created in {datacenter.name} with {gpu_count}x {gpu_type}.",
        node=node,
        actor=actor,
    )
    return node, token


@transaction.atomic
def node_rotate_token(*, node: Node, actor: str = "") -> str:
    """Replace a node's agent token; the old one stops working at once."""
    token = node.new_secret()
    node.save(update_fields=[Node.PREFIX_FIELD, Node.DIGEST_FIELD, "updated_at"])
    event_record(kind="node.token_rotated", message="Agent token rotated.", node=node, actor=actor)
    return token


@transaction.atomic
def node_update(*, node: Node, actor: str = "", **changes: Any) -> Node:
    locked = Node.objects.select_for_update().get(pk=node.pk)
    if "gpu_count" in changes:
        allocated = locked.gpus_allocated()
        if changes["gpu_count"] < allocated:
            raise ValidationError(
                {
                    "gpu_count": (
                        f"Instances on this node already use {allocated} GPUs; "
                        "remove or shrink them first."
                    )
                }
            )
    if (
        "datacenter" in changes
        and changes["datacenter"].pk != locked.datacenter_id
        and locked.instances.exists()
    ):
        raise ValidationError(
            {"datacenter": "A node with instances cannot move; delete its instances first."}
        )
    before = {field: getattr(locked, field) for field in changes}
    for field, value in changes.items():
        setattr(locked, field, value)
    locked.full_clean()
    locked.save()
    changed = {f: str(v) for f, v in before.items() if getattr(locked, f) != v}
    if changed:
        event_record(
            kind="node.updated",
            message=f"Node {locked.hostname} updated: {', '.join(sorted(changed))}.",
            node=locked,
            data={"previous": changed},
            actor=actor,
        )
    return locked


# --- instances ------------------------------------------------------------------------------


def instance_check_placement(
    *,
    role: str,
    node: Node,
    served_model: ServedModel,
    gpu_count: int,
    instance_id: int | None = None,
) -> None:
    """Raise ValidationError naming the field if an instance cannot go where it asks to (the
    rules live with the model: ``Instance.check_placement``)."""
    Instance.check_placement(
        role=role,
        node=node,
        served_model=served_model,
        gpu_count=gpu_count,
        instance_id=instance_id,
    )


def _check_relays_keep_prefill(*, instance: Instance, leaving: bool) -> None:
    """Refuse to remove the last prefill a datacenter's relays for this model depend on."""
    if instance.role != InstanceRole.PREFILL or not leaving:
        return
    dc_id = instance.node.datacenter_id
    others = Instance.objects.filter(
        role=InstanceRole.PREFILL,
        served_model_id=instance.served_model_id,
        node__datacenter_id=dc_id,
    ).exclude(pk=instance.pk)
    relays = Instance.objects.filter(
        role=InstanceRole.RELAY_DECODE,
        served_model_id=instance.served_model_id,
        node__datacenter_id=dc_id,
    )
    if not others.exists() and relays.exists():
        raise ValidationError(
            {
                "role": (
                    f"This is the last prefill instance of {instance.served_model.name} in "
                    f"{instance.node.datacenter.name}, and {relays.count()} relay_decode "
                    "instance(s) depend on it; remove those first."
                )
            }
        )


@transaction.atomic
def instance_create(
    *,
    role: str,
    node: Node,
    served_model: ServedModel,
    gpu_count: int,
    desired_state: str = DesiredState.RUNNING,
    actor: str = "",
) -> Instance:
    # Lock the node so two concurrent creates cannot both take its last free GPUs.
    node = Node.objects.select_for_update().get(pk=node.pk)
    instance = Instance(
        role=role,
        node=node,
        served_model=served_model,
        gpu_count=gpu_count,
        desired_state=desired_state,
    )
    instance.full_clean()
    instance.save()
    event_record(
        kind="instance.created",
        message=(
            f"{role} instance of {served_model.name} placed on {node.hostname} "
            f"with {gpu_count} GPU(s), desired {desired_state}."
        ),
        instance=instance,
        actor=actor,
    )
    enqueue_after_commit("fleet.instance_apply", node.pk, instance.pk)
    return instance


def _lock_instance(pk: int, *also: Node) -> Instance:
    """Lock an instance's node (and any other nodes named), then the instance: nodes first and
    in key order, as heartbeats and offline marking take them. Taking the instance first lets
    PostgreSQL find a deadlock with a heartbeat and fail one side. Call inside a transaction."""
    while True:
        node_id = Instance.objects.filter(pk=pk).values_list("node_id", flat=True).get()
        node_ids = sorted({node_id, *(node.pk for node in also)})
        list(Node.objects.select_for_update().filter(pk__in=node_ids).order_by("pk"))
        locked = Instance.objects.select_for_update().get(pk=pk)
        if locked.node_id == node_id:
            return locked
        # Moved to another node between the two reads: lock that one as well.


@transaction.atomic
def instance_update(*, instance: Instance, actor: str = "", **changes: Any) -> Instance:
    target_node = changes.get("node")
    locked = _lock_instance(instance.pk, *([target_node] if target_node is not None else []))
    leaves_prefill_pool = locked.role == InstanceRole.PREFILL and (
        changes.get("role", locked.role) != InstanceRole.PREFILL
        or changes.get("node", locked.node).datacenter_id != locked.node.datacenter_id
        or changes.get("served_model", locked.served_model).pk != locked.served_model_id
    )
    _check_relays_keep_prefill(instance=locked, leaving=leaves_prefill_pool)
    before = {field: getattr(locked, field) for field in changes}
    for field, value in changes.items():
        setattr(locked, field, value)
    locked.full_clean()
    locked.save()
    changed = {f: str(v) for f, v in before.items() if getattr(locked, f) != v}
    if changed:
        event_record(
            kind="instance.updated",
            message=f"Instance {locked.pk} updated: {', '.join(sorted(changed))}.",
            instance=locked,
            data={"previous": changed},
            actor=actor,
        )
        enqueue_after_commit("fleet.instance_apply", locked.node_id, locked.pk)
        if "node" in changed:
            # Moved: the old node must stop it too.
            enqueue_after_commit("fleet.instance_apply", instance.node_id, locked.pk)
    return locked


def instance_set_desired_state(
    *, instance: Instance, desired_state: str, actor: str = ""
) -> Instance:
    if desired_state not in DesiredState.values:
        raise ValidationError({"desired_state": f"Unknown desired state {desired_state!r}."})
    return instance_update(instance=instance, actor=actor, desired_state=desired_state)


@transaction.atomic
def instance_delete(*, instance: Instance, actor: str = "") -> None:
    locked = _lock_instance(instance.pk)
    _check_relays_keep_prefill(instance=locked, leaving=True)
    event_record(
        kind="instance.deleted",
        message=f"Instance {locked.pk} ({locked.role} on {locked.node.hostname}) deleted.",
        node=locked.node,
        data={"instance_id": locked.pk, "role": locked.role},
        actor=actor,
    )
    enqueue_after_commit("fleet.instance_apply", locked.node_id, locked.pk)
    locked.delete()


# --- prices ---------------------------------------------------------------------------------


@transaction.atomic
def unit_price_save(*, price: UnitPrice) -> UnitPrice:
    """Save a price after the overlap check, serialised per GPU type so two writers can't race."""
    GPUType.objects.select_for_update().filter(pk=price.gpu_type_id).first()
    price.full_clean()
    price.save()
    return price


# --- topology -------------------------------------------------------------------------------


def topology_snapshot() -> dict[str, Any]:
    """Datacenters with node and per-role instance counts, and the WAN links, in one structure."""
    roles = list(InstanceRole.values)
    role_counts = {
        role: Count("nodes__instances", filter=Q(nodes__instances__role=role), distinct=True)
        for role in roles
    }
    running_counts = {
        f"running_{role}": Count(
            "nodes__instances",
            filter=Q(nodes__instances__role=role, nodes__instances__actual_state="running"),
            distinct=True,
        )
        for role in roles
    }
    # node_count in a call of its own, so the type checker sees it on every row (the
    # per-role counts are read by name); the SQL is the same as with one annotate().
    datacenters = (
        Datacenter.objects.annotate(node_count=Count("nodes", distinct=True))
        .annotate(**role_counts, **running_counts)
        .order_by("name")
    )
    gpus_by_dc: dict[int, int] = {}
    for node in Node.objects.only("datacenter_id", "gpu_count"):
        gpus_by_dc[node.datacenter_id] = gpus_by_dc.get(node.datacenter_id, 0) + node.gpu_count
    return {
        "datacenters": [
            {
                "id": dc.id,
                "name": dc.name,
                "region": dc.region,
                "rdma_domain": dc.rdma_domain,
                "nodes": dc.node_count,
                "gpus": gpus_by_dc.get(dc.id, 0),
                "instances": {role: getattr(dc, role) for role in roles},
                "running_instances": {role: getattr(dc, f"running_{role}") for role in roles},
            }
            for dc in datacenters
        ],
        "links": [
            {
                "id": link.id,
                "from": link.from_datacenter.name,
                "to": link.to_datacenter.name,
                "bandwidth_gbps": link.bandwidth_gbps,
                "rtt_ms": link.rtt_ms,
                "connection_pool_size": link.connection_pool_size,
                "status": link.status,
            }
            for link in WANLink.objects.select_related("from_datacenter", "to_datacenter")
        ],
    }
