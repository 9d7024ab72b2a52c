"""What the control plane does with agents: registration, heartbeats, health, and bringing
what runs on a node in line with what operators asked for (one instance, or a full reconcile)."""

from __future__ import annotations

import hashlib
import json
import logging
import random
import secrets
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import httpx
from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from fleet import live
from fleet.agent_client import (
    AgentClient,
    AgentEndpointRefused,
    AgentError,
    AgentNotRegistered,
    health_answers,
)
from fleet.choices import ActualState, DesiredState, NodeStatus
from fleet.dispatch import enqueue_after_commit
from fleet.events import event_record
from fleet.models import Instance, Node, WANLink
from pdd.vocab import InstanceStatus

log = logging.getLogger(__name__)

# What an agent may report for an instance, mapped onto the control plane's states.
REPORTED_STATES = {status.value: ActualState(status.value) for status in InstanceStatus}
ACTIVE_STATES = {ActualState.STARTING, ActualState.RUNNING, ActualState.DRAINING}


def heartbeat_interval_s() -> float:
    return float(settings.BATON_HEARTBEAT_INTERVAL_S)


def link_settings_for(node: Node) -> dict[str, dict[str, Any]]:
    """WAN shaping an agent applies towards each peer datacenter, from the WANLink rows."""
    links: dict[str, dict[str, Any]] = {}
    touching = Q(from_datacenter_id=node.datacenter_id) | Q(to_datacenter_id=node.datacenter_id)
    for link in WANLink.objects.select_related("from_datacenter", "to_datacenter").filter(touching):
        peer = (
            link.to_datacenter
            if link.from_datacenter_id == node.datacenter_id
            else link.from_datacenter
        )
        links[peer.name] = {
            "bandwidth_gbps": link.bandwidth_gbps,
            "rtt_ms": link.rtt_ms,
            "pool_size": link.connection_pool_size,
            "status": link.status,
        }
    return links


def _set_actual(instance: Instance, state: str, *, reason: str, actor: str) -> bool:
    if instance.actual_state == state:
        return False
    previous = instance.actual_state
    instance.actual_state = state
    instance.state_changed_at = timezone.now()
    instance.save(update_fields=["actual_state", "state_changed_at", "last_report", "updated_at"])
    event_record(
        kind="instance.state",
        message=f"Instance {instance.pk} {previous} -> {state} ({reason}).",
        instance=instance,
        data={"previous": previous, "new": state},
        actor=actor,
    )
    return True


# savepoint=False: called inside the request's transaction (ATOMIC_REQUESTS), where a failure
# fails the whole request anyway; a savepoint would add two round trips to every beat.
@transaction.atomic(savepoint=False)
def node_register(*, node: Node, endpoint: str, report: dict[str, Any]) -> dict[str, Any]:
    """Record the endpoint the agent serves on and hand it a fresh command token."""
    node = Node.objects.select_for_update(of=("self",)).get(pk=node.pk)
    previous_endpoint = node.agent_endpoint
    node.agent_endpoint = endpoint
    node.command_token = secrets.token_urlsafe(32)
    node.registered_at = timezone.now()
    node.save(update_fields=["agent_endpoint", "command_token", "registered_at", "updated_at"])
    event_record(
        kind="node.registered",
        message=f"Agent registered at {endpoint}"
        + (
            f" (was {previous_endpoint})"
            if previous_endpoint and previous_endpoint != endpoint
            else ""
        )
        + ".",
        node=node,
        actor="agent",
    )
    node_heartbeat(node=node, report=report)
    return {
        "node_id": node.pk,
        "hostname": node.hostname,
        "datacenter": node.datacenter.name,
        "heartbeat_interval_s": heartbeat_interval_s(),
        "command_token": node.command_token,
        "links": link_settings_for(node),
    } | ({"data_token": settings.BATON_DATA_TOKEN} if settings.BATON_DATA_TOKEN else {})


# Left out of the node's stored report: the agent's account of its own heartbeats, new at
# every beat (answered count, round trips); the live view (fleet.live) keeps the whole document.
UNSTORED_REPORT_KEYS = frozenset({"control_plane"})


@dataclass(frozen=True, slots=True)
class _FullBeat:
    """What a node's last full heartbeat in this process took: enough to take the next ones
    that change nothing without reading or locking anything."""

    digest: bytes
    until: float  # time.monotonic() after which the next beat is taken whole again
    node_updated_at: Any  # the node row's updated_at then: any edit since ends the fast path
    hostname: str
    datacenter: str
    endpoint: str
    report: dict[str, Any]  # as published (this node's instances only)


# Per process: node id -> its last full heartbeat (fast-path heartbeats leave it as it is).
_full_beats: dict[int, _FullBeat] = {}
_full_beats_lock = threading.Lock()


def report_digest(report: Any) -> bytes | None:
    """A digest of what a heartbeat says, the agent's own heartbeat stats aside; None for a
    document that is not a JSON object."""
    if not isinstance(report, dict):
        return None
    try:
        text = json.dumps(
            {k: v for k, v in report.items() if k not in UNSTORED_REPORT_KEYS}, sort_keys=True
        )
    except (TypeError, ValueError):
        return None
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def without_cache_lists(report: dict[str, Any]) -> dict[str, Any]:
    """The report without the whole-cache block lists agents before KV cache events sent
    (``cached_prefix_blocks``): the prefix index comes from the events now, and the lists
    would only be stored and parsed again."""
    items = report.get("instances")
    if not isinstance(items, list) or not any(
        isinstance(i, dict) and "cached_prefix_blocks" in i for i in items
    ):
        return report
    return report | {
        "instances": [
            {k: v for k, v in i.items() if k != "cached_prefix_blocks"}
            if isinstance(i, dict)
            else i
            for i in items
        ]
    }


def full_beat_current(node_id: int, digest: bytes | None) -> bool:
    """Whether a beat with `digest` repeats the node's last full heartbeat in this process,
    taken at most BATON_HEARTBEAT_FULL_EVERY_S ago (fleet.beats: no database read to check the
    node's row; a change to the node or its instances in this process forgets the full beat)."""
    last = _repeated_full_beat(node_id, digest)
    return last is not None and time.monotonic() <= last.until


def validated_before(node_id: int, digest: bytes | None) -> bool:
    """Whether this node's last full heartbeat in this process said the same (its heartbeat
    stats aside), so the document was validated then: validation is a function of the
    document, and the stats it leaves out are not validated. A node's periodic full beat
    (every BATON_HEARTBEAT_FULL_EVERY_S) repeats its document: validating it again through
    DRF built ~300 objects held in reference cycles per beat, 20 beats a second at 1,000
    nodes, which only the garbage collector frees (bench/control_path/REPORT.md)."""
    return _repeated_full_beat(node_id, digest) is not None


def _repeated_full_beat(node_id: int, digest: bytes | None) -> _FullBeat | None:
    """The node's last full heartbeat in this process, if a beat with `digest` repeats it."""
    if digest is None:
        return None
    with _full_beats_lock:
        last = _full_beats.get(node_id)
    return last if last is not None and last.digest == digest else None


def forget_full_beat(node_id: int) -> None:
    """The next heartbeat of this node is taken whole (its instances changed here)."""
    with _full_beats_lock:
        _full_beats.pop(node_id, None)


def node_heartbeat_unchanged(*, node: Node, report: dict[str, Any], digest: bytes | None) -> bool:
    """The fast path of a heartbeat: when the document says what the node's last full heartbeat
    in this process said (its heartbeat stats aside), at most ``BATON_HEARTBEAT_FULL_EVERY_S``
    ago, and nothing changed the node's row since, the beat is one UPDATE of the node's last
    heartbeat (only while it is online) and the live view's liveness: no validation again, no
    lock, no instance read. Returns False when the beat must be taken whole (node_heartbeat).

    Bounded staleness: a change to the node's instances made in another process (a reconcile
    in a Celery worker) is compared with the agent's report at the next full heartbeat, at most
    ``BATON_HEARTBEAT_FULL_EVERY_S`` later; one made in this process ends the fast path at once.
    """
    if digest is None or node.status != NodeStatus.ONLINE:
        return False
    with _full_beats_lock:
        last = _full_beats.get(node.pk)
    if (
        last is None
        or last.digest != digest
        or last.node_updated_at != node.updated_at
        or time.monotonic() > last.until
    ):
        return False
    now = timezone.now()
    if not Node.objects.filter(pk=node.pk, status=NodeStatus.ONLINE).update(last_heartbeat_at=now):
        forget_full_beat(node.pk)  # it went offline meanwhile: the full path brings it back
        return False
    published = last.report | {k: report[k] for k in UNSTORED_REPORT_KEYS if k in report}
    transaction.on_commit(
        lambda: live.publish_report(
            node_id=node.pk,
            hostname=last.hostname,
            datacenter=last.datacenter,
            endpoint=last.endpoint,
            report=published,
        )
    )
    return True


@transaction.atomic(savepoint=False)
def node_heartbeat(*, node: Node, report: dict[str, Any], digest: bytes | None = None) -> None:
    """Take an agent's state document: the node is alive, and its instances are as reported.

    Locks this node's row, then its instances' rows in id order, and no other row: a lock two
    nodes' heartbeats share (their datacenter's row, which Instance's default ordering joins)
    serialised a whole datacenter's heartbeats and deadlocked them (tests/fleet/test_postgres.py).

    Writes only what changed: a beat that changes nothing the database holds (state, reports;
    the agent's heartbeat stats aside) is one UPDATE of the node's last_heartbeat_at. The live
    view gets every document whole.
    """
    now = timezone.now()
    node = Node.objects.select_for_update(of=("self",)).select_related("datacenter").get(pk=node.pk)
    fields: list[str] = []
    if node.status in (NodeStatus.PENDING, NodeStatus.OFFLINE):
        previous = node.status
        node.status = NodeStatus.ONLINE
        fields.append("status")
        event_record(
            kind="node.online",
            message=f"Node {node.hostname} is online (was {previous}).",
            node=node,
            actor="agent",
        )
    # Only this node's instances: a token never speaks for another node's, neither here nor
    # in the live view the gateways route on (which reads the report published below).
    instances = list(_own_instances_locked(node))
    # What the agent runs, by id, as it says: its own instances, and any it should not run
    # (the reconcile below stops those on this agent; it never touches another node's).
    claimed = _reported_states(report)
    report, foreign = own_instances_only(report, {i.pk for i in instances})
    if foreign:
        _record_foreign_claims(node, foreign)
        digest = None  # every beat taken whole, so that the claims keep being seen
    stored = {k: v for k, v in report.items() if k not in UNSTORED_REPORT_KEYS}
    if stored != node.last_report:
        node.last_report = stored
        fields.append("last_report")
    node.last_heartbeat_at = now
    if fields:
        node.save(update_fields=[*fields, "last_heartbeat_at", "updated_at"])
    else:
        # Nothing but the time: one column of one row, and no save signals (no page, cache or
        # websocket shows anything that changed).
        Node.objects.filter(pk=node.pk).update(last_heartbeat_at=now)
    hostname, datacenter, endpoint = node.hostname, node.datacenter.name, node.agent_endpoint
    transaction.on_commit(
        lambda: live.publish_report(
            node_id=node.pk,
            hostname=hostname,
            datacenter=datacenter,
            endpoint=endpoint,
            report=report,
        )
    )
    reported: dict[int, dict[str, Any]] = {}
    for item in report.get("instances", []):
        reported[int(item["instance_id"])] = item
    drift = plan_actions(desired=instances, reported=claimed, known_ids={i.pk for i in instances})
    if drift and node.registered_at is not None and _reconcile_due(node.pk):
        # Repair at once rather than at the next periodic round.
        enqueue_after_commit("fleet.reconcile_node", node.pk)
    if drift:
        digest = None  # what runs is not what operators want: look again at the next beat
    full = (
        _FullBeat(
            digest=digest,
            until=_full_beat_until(),
            node_updated_at=node.updated_at,
            hostname=hostname,
            datacenter=datacenter,
            endpoint=endpoint,
            report=report,
        )
        if digest is not None and node.status == NodeStatus.ONLINE
        else None
    )
    transaction.on_commit(lambda: _remember_full_beat(node.pk, full))
    for instance in instances:
        item = reported.get(instance.pk)
        if item is None:
            state = (
                ActualState.STOPPED
                if instance.actual_state != ActualState.PENDING
                else ActualState.PENDING
            )
            _take_report(instance, {}, state, reason="not running on the agent")
            continue
        _take_report(
            instance,
            {k: v for k, v in item.items() if k != "instance_id"},
            REPORTED_STATES.get(str(item.get("state")), ActualState.FAILED),
            reason="reported by the agent",
        )


def _full_beat_until() -> float:
    """When a full heartbeat taken now stops vouching for the beats that repeat it: after
    BATON_HEARTBEAT_FULL_EVERY_S, less a random part of up to a half, so that nodes that came up
    together (a thousand after a restart) do not all take their full beat in the same second."""
    every = float(settings.BATON_HEARTBEAT_FULL_EVERY_S)
    return time.monotonic() + every * random.uniform(0.5, 1.0)


def _remember_full_beat(node_id: int, full: _FullBeat | None) -> None:
    with _full_beats_lock:
        if full is None:
            _full_beats.pop(node_id, None)
        else:
            _full_beats[node_id] = full


def _take_report(instance: Instance, report: dict[str, Any], state: str, *, reason: str) -> None:
    """An instance's part of a heartbeat: saved when its state or its report changed, else
    nothing is written."""
    if report == instance.last_report and state == instance.actual_state:
        return
    instance.last_report = report
    if not _set_actual(instance, state, reason=reason, actor="agent"):
        instance.save(update_fields=["last_report"])


def _own_instances_locked(node: Node):
    """The node's instances, locked in id order; FOR UPDATE OF the instance table only (the
    default ordering's join would lock the datacenter's row as well)."""
    return node.instances.select_for_update(of=("self",)).order_by("pk")


def own_instances_only(
    report: dict[str, Any], own_ids: set[int]
) -> tuple[dict[str, Any], list[str]]:
    """The report with only the instances of `own_ids` (this node's), and the ids it claimed
    besides: unknown ones, other nodes' ones, or ids that are not instance ids at all."""
    kept: list[dict[str, Any]] = []
    foreign: list[str] = []
    for item in report.get("instances", []):
        raw = item.get("instance_id") if isinstance(item, dict) else None
        try:
            instance_id = int(str(raw))
        except (TypeError, ValueError):
            instance_id = None
        if instance_id is not None and instance_id in own_ids:
            kept.append(item | {"instance_id": str(instance_id)})
        else:
            foreign.append(str(raw)[:64])
    return report | {"instances": kept}, foreign


# Per process: the foreign ids last recorded per node, and when (a heartbeat every 2 s that
# keeps claiming the same ids records one event a minute, not thirty).
_foreign_recorded: dict[int, tuple[frozenset[str], float]] = {}
FOREIGN_EVENT_EVERY_S = 60.0


def _record_foreign_claims(node: Node, foreign: list[str]) -> None:
    claimed = frozenset(foreign)
    now = time.monotonic()
    last = _foreign_recorded.get(node.pk)
    log.warning("node %s reported instances it does not own: %s", node.hostname, sorted(claimed))
    if last is not None and last[0] == claimed and now - last[1] < FOREIGN_EVENT_EVERY_S:
        return
    _foreign_recorded[node.pk] = (claimed, now)
    owners = {
        str(pk): hostname
        for pk, hostname in Instance.objects.filter(
            pk__in=[int(i) for i in claimed if i.isdigit() and len(i) < 19]
        ).values_list("pk", "node__hostname")
    }
    event_record(
        kind="node.foreign_report",
        message=(
            f"Node {node.hostname} reported instances it does not own "
            f"({', '.join(sorted(claimed)[:10])}); ignored."
        ),
        node=node,
        data={"instance_ids": sorted(claimed)[:100], "owners": owners},
        actor="agent",
    )


_last_triggered: dict[int, float] = {}


def _reconcile_due(node_id: int, min_gap_s: float = 3.0) -> bool:
    """At most one heartbeat-triggered reconcile per node every few seconds, per process."""
    now = time.monotonic()
    if now - _last_triggered.get(node_id, 0.0) < min_gap_s:
        return False
    _last_triggered[node_id] = now
    return True


# At most this many late nodes' agents are probed per health check round (the rest go
# offline as before): a real outage of many nodes must not hold the check for long.
MAX_PROBED_PER_ROUND = 64


def _agents_answering(nodes: list[tuple[int, str]]) -> set[int]:
    """Of (node id, agent endpoint) pairs, the nodes whose agent answers ``GET /health`` within
    half a heartbeat interval (at most 1 s), probed concurrently: a refused connection (the
    agent is gone), a timeout (frozen, black-holed) or an endpoint the pinning policy refuses
    answers nothing. Only the endpoint the node registered is called (fleet.pinning)."""
    timeout_s = min(1.0, heartbeat_interval_s() / 2)
    found = health_answers([endpoint for _, endpoint in nodes], timeout_s)
    return {
        node_id
        for (node_id, _), answer in zip(nodes, found, strict=True)
        if isinstance(answer, httpx.Response) and answer.status_code < 500
    }


def nodes_mark_offline(*, now=None) -> list[int]:
    """Nodes silent for the configured number of heartbeat intervals go offline and their
    instances unavailable; they come back with their next heartbeat.

    Late beats are not silence while the agent answers: a node silent for less than the live
    TTL plus ``BATON_LIVE_LATE_S`` whose agent answers a probe stays online (a control plane
    too busy to take the beats in time, bench/gateway/SCALE.md, must not take a live fleet
    offline; its reports are "late" in the live view meanwhile). Past that, or when the agent
    does not answer, the node goes offline as before."""
    now = now or timezone.now()
    silence = timedelta(seconds=heartbeat_interval_s() * settings.BATON_HEARTBEAT_MISSES)
    late_limit = silence + timedelta(seconds=float(settings.BATON_LIVE_LATE_S))
    went_offline: list[int] = []
    stale = Node.objects.filter(status=NodeStatus.ONLINE, last_heartbeat_at__lt=now - silence)
    rows = list(stale.order_by("pk").values_list("pk", "last_heartbeat_at", "agent_endpoint"))
    late = [(pk, ep) for pk, at, ep in rows if ep and at >= now - late_limit]
    alive = _agents_answering(late[:MAX_PROBED_PER_ROUND])
    for node_id in alive:
        log.info("node %s: heartbeats late but its agent answers; left online", node_id)
    for node_id in [pk for pk, _, _ in rows if pk not in alive]:
        with transaction.atomic():
            node = Node.objects.select_for_update(of=("self",)).get(pk=node_id)
            if node.status != NodeStatus.ONLINE or node.last_heartbeat_at >= now - silence:
                continue  # a heartbeat raced in
            node.status = NodeStatus.OFFLINE
            node.save(update_fields=["status", "updated_at"])
            event_record(
                kind="node.offline",
                message=(
                    f"Node {node.hostname} missed {settings.BATON_HEARTBEAT_MISSES} heartbeats "
                    f"(last at {node.last_heartbeat_at:%H:%M:%S})."
                ),
                node=node,
                actor="health",
            )
            for instance in _own_instances_locked(node).exclude(
                actual_state__in=[ActualState.STOPPED, ActualState.PENDING]
            ):
                _set_actual(
                    instance, ActualState.UNAVAILABLE, reason="node offline", actor="health"
                )
            went_offline.append(node.pk)
    return went_offline


# --- desired vs actual ----------------------------------------------------------------------


@dataclass(slots=True)
class Action:
    instance_id: int
    verb: str  # "start", "drain", "stop"
    reason: str


def plan_actions(
    *, desired: list[Instance], reported: dict[int, str], known_ids: set[int]
) -> list[Action]:
    """The commands that bring reported states to desired ones. Pure: no I/O."""
    actions: list[Action] = []
    for instance in desired:
        state = reported.get(instance.pk)
        if instance.desired_state == DesiredState.RUNNING and state not in {"running", "starting"}:
            actions.append(
                Action(instance.pk, "start", f"desired running, agent reports {state or 'nothing'}")
            )
        elif instance.desired_state == DesiredState.DRAINED and state in {"running", "starting"}:
            actions.append(Action(instance.pk, "drain", f"desired drained, agent reports {state}"))
        elif instance.desired_state == DesiredState.STOPPED and state not in {None, "stopped"}:
            actions.append(Action(instance.pk, "stop", f"desired stopped, agent reports {state}"))
    for instance_id, state in reported.items():
        if instance_id not in known_ids and state != "stopped":
            actions.append(Action(instance_id, "stop", "runs on the agent but is not in the fleet"))
    return actions


def nodes_with_drift() -> list[int]:
    """Online, registered nodes whose last stored report (their last heartbeat) differs from
    what operators want of their instances (plan_actions): those a periodic reconcile must
    visit; the others' agents said at their last beat that they run what is wanted."""
    nodes = Node.objects.filter(status=NodeStatus.ONLINE, registered_at__isnull=False).order_by(
        "pk"
    )
    reports = dict(nodes.values_list("pk", "last_report"))
    desired: dict[int, list[Instance]] = {node_id: [] for node_id in reports}
    for instance in (
        Instance.objects.filter(node_id__in=reports)
        .order_by()
        .only("pk", "node_id", "desired_state")
    ):
        desired[instance.node_id].append(instance)
    drifting = []
    for node_id, report in reports.items():
        mine = desired[node_id]
        if plan_actions(
            desired=mine,
            reported=_reported_states(report if isinstance(report, dict) else {}),
            known_ids={i.pk for i in mine},
        ):
            drifting.append(node_id)
    return drifting


def _reported_states(state_doc: dict[str, Any]) -> dict[int, str]:
    states: dict[int, str] = {}
    for item in state_doc.get("instances", []):
        try:
            states[int(item["instance_id"])] = str(item.get("state"))
        except (KeyError, TypeError, ValueError):
            continue
    return states


def gpu_unit(instance: Instance) -> dict[str, Any]:
    """The GPU unit an instance runs on, as its start command carries it (agents/PROTOCOL.md):
    its node's GPU type's per-chip numbers and the instance's GPU count. The same four numbers
    the planner sizes with drive an emulated instance's step times."""
    gpu = instance.node.gpu_type
    return {
        "name": str(gpu),
        "count": instance.gpu_count,
        "peak_bf16_tflops": gpu.peak_bf16_tflops,
        "memory_gib": gpu.memory_gib,
        "memory_bandwidth_gbps": gpu.memory_bandwidth_gbps,
        "interconnect_gbps": gpu.interconnect_gbps,
    }


def _execute(client: AgentClient, node: Node, action: Action, *, actor: str) -> None:
    instance = (
        Instance.objects.select_related("served_model", "node__gpu_type")
        .filter(pk=action.instance_id)
        .first()
    )
    if action.verb == "start":
        if instance is None:
            return  # deleted since the plan was made: nothing to start
        client.start_instance(
            instance_id=action.instance_id,
            role=instance.role,
            model=instance.served_model.name,
            source=instance.served_model.source,
            dtype=instance.served_model.dtype,
            gpu=gpu_unit(instance),
        )
    elif action.verb == "drain":
        client.drain_instance(instance_id=action.instance_id)
    else:
        client.stop_instance(instance_id=action.instance_id)
    event_record(
        kind=f"{actor}.{action.verb}",
        message=f"{action.verb} instance {action.instance_id} on {node.hostname}: {action.reason}.",
        node=node,
        # A stop of an id that is not this node's (a stale or foreign one) is this node's event.
        instance=instance if instance is not None and instance.node_id == node.pk else None,
        data={"verb": action.verb, "reason": action.reason},
        actor=actor,
    )


ENDPOINT_REFUSED_EVENT_EVERY_S = 600


def endpoint_refused(node: Node, exc: AgentEndpointRefused, *, actor: str) -> None:
    """A call the endpoint policy stopped: a ``node.endpoint_refused`` event (at most one with
    the same message per node every ENDPOINT_REFUSED_EVENT_EVERY_S, since the periodic
    reconcile meets it every round) and a warning; nothing is retried."""
    from fleet.models import FleetEvent

    message = f"Agent endpoint refused, command not sent: {exc}"
    recent = FleetEvent.objects.filter(
        node=node,
        kind="node.endpoint_refused",
        message=message,
        created_at__gte=timezone.now() - timedelta(seconds=ENDPOINT_REFUSED_EVENT_EVERY_S),
    )
    if recent.exists():
        log.debug("%s", message)
        return
    log.warning("%s", message)
    event_record(
        kind="node.endpoint_refused",
        message=message,
        node=node,
        data={"endpoint": node.agent_endpoint, "error": str(exc)},
        actor=actor,
    )


def node_reconcile(
    *, node: Node, instance_ids: set[int] | None = None, actor: str = "reconcile"
) -> list[Action]:
    """Ask the agent what runs, and command it until that matches the desired states.

    Idempotent: when the node already matches, nothing is sent but the state query. An
    endpoint the policy refuses is an event, not an error: nothing to retry.
    """
    if node.status != NodeStatus.ONLINE:
        return []
    try:
        client = AgentClient(node)
    except AgentNotRegistered:
        return []
    try:
        return _reconcile_with(client, node, instance_ids=instance_ids, actor=actor)
    except AgentEndpointRefused as exc:
        endpoint_refused(node, exc, actor=actor)
        return []


def _reconcile_with(
    client: AgentClient, node: Node, *, instance_ids: set[int] | None, actor: str
) -> list[Action]:
    with client:
        state_doc = client.state()
        reported = _reported_states(state_doc)
        desired = list(node.instances.select_related("served_model"))
        known = {instance.pk for instance in desired}
        if instance_ids is not None:
            # One instance's apply: leave the node's other instances to the periodic reconcile.
            desired = [i for i in desired if i.pk in instance_ids]
            reported = {k: v for k, v in reported.items() if k in instance_ids}
        actions = plan_actions(desired=desired, reported=reported, known_ids=known)
        for action in actions:
            try:
                _execute(client, node, action, actor=actor)
            except AgentEndpointRefused:
                raise
            except AgentError as exc:
                event_record(
                    kind=f"{actor}.error",
                    message=f"{action.verb} instance {action.instance_id} failed: {exc}",
                    node=node,
                    data={"verb": action.verb, "error": str(exc)},
                    actor=actor,
                )
                raise
    return actions


def link_push(*, link: WANLink) -> list[str]:
    """Send a link's bandwidth, RTT and pool size to the online agents at both of its ends."""
    reached: list[str] = []
    nodes = Node.objects.select_related("datacenter").filter(
        status=NodeStatus.ONLINE,
        datacenter_id__in=[link.from_datacenter_id, link.to_datacenter_id],
    )
    for node in nodes:
        peer = (
            link.to_datacenter
            if node.datacenter_id == link.from_datacenter_id
            else link.from_datacenter
        )
        try:
            client = AgentClient(node)
        except AgentNotRegistered:
            continue
        with client:
            # A down link is still shaped as configured; routing stops using it, agents need not.
            try:
                client.set_link(
                    peer_datacenter=peer.name,
                    bandwidth_gbps=link.bandwidth_gbps,
                    rtt_ms=link.rtt_ms,
                    pool_size=link.connection_pool_size,
                )
            except AgentEndpointRefused as exc:
                endpoint_refused(node, exc, actor="link")  # the other nodes still get it
                continue
        reached.append(node.hostname)
    if reached:
        event_record(
            kind="link.applied",
            message=(
                f"Link {link.from_datacenter.name}->{link.to_datacenter.name} "
                f"({link.bandwidth_gbps:g} Gbit/s, {link.rtt_ms:g} ms, status {link.status}) "
                f"applied on {', '.join(reached)}."
            ),
            data={"link_id": link.pk, "nodes": reached, "status": link.status},
            actor="link",
        )
    return reached
