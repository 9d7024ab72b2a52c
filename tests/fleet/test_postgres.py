"""Behaviour that only a real PostgreSQL server can show: row locks under concurrency."""

from __future__ import annotations

import re
import threading
import time
from datetime import timedelta

import pytest
from django.core.exceptions import ValidationError
from django.db import connection, connections, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from fleet import agent_services, services
from fleet.models import Datacenter, GPUType, Instance, Node, ServedModel

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def test_suite_runs_on_postgresql():
    assert connection.vendor == "postgresql"


def _fleet_of_one_node():
    dc = Datacenter.objects.create(name="dc-a", region="r")
    gpu = GPUType.objects.create(
        vendor="v",
        model="m",
        peak_bf16_tflops=1,
        memory_gib=1,
        memory_bandwidth_gbps=1,
        interconnect_gbps=1,
    )
    model = ServedModel.objects.create(name="m", source="m", num_layers=1, kv_bytes_per_token=1)
    node, _ = services.node_create(hostname="n", datacenter=dc, gpu_type=gpu, gpu_count=8)
    return node, model


def test_concurrent_instance_creates_cannot_overbook_a_node():
    node, model = _fleet_of_one_node()
    barrier = threading.Barrier(4)
    outcomes: list[str] = []

    def worker():
        try:
            barrier.wait(timeout=10)
            services.instance_create(role="prefill", node=node, served_model=model, gpu_count=5)
            outcomes.append("created")
        except ValidationError:
            outcomes.append("refused")
        finally:
            connections.close_all()

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sorted(outcomes) == ["created", "refused", "refused", "refused"]
    assert Instance.objects.filter(node=node).count() == 1


def _wait_until_a_backend_waits_on_a_lock(timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    with connections["default"].cursor() as cursor:
        while time.monotonic() < deadline:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
            if cursor.fetchone()[0]:
                return
            time.sleep(0.05)
    raise AssertionError("no backend ever waited on a row lock")


@pytest.mark.parametrize("operator_call", ["drain", "delete"])
def test_an_operator_call_and_a_heartbeat_at_once_both_succeed(operator_call):
    """A heartbeat locks the node, then its instances; a drain or delete that took the instance
    first and then the node deadlocked with it (PostgreSQL failed one side: HTTP 500 in CI)."""
    node, model = _fleet_of_one_node()
    instance = services.instance_create(role="prefill", node=node, served_model=model, gpu_count=1)
    node_locked, operator_waits = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def heartbeat():
        try:
            with transaction.atomic():
                Node.objects.select_for_update().get(pk=node.pk)
                node_locked.set()
                assert operator_waits.wait(timeout=20)
                report = {"instances": [{"instance_id": str(instance.pk), "state": "running"}]}
                agent_services.node_heartbeat(node=node, report=report)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            errors.append(exc)
        finally:
            connections.close_all()

    def operator():
        try:
            assert node_locked.wait(timeout=20)
            if operator_call == "drain":
                services.instance_set_desired_state(instance=instance, desired_state="drained")
            else:
                services.instance_delete(instance=instance)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=heartbeat), threading.Thread(target=operator)]
    for t in threads:
        t.start()
    try:
        _wait_until_a_backend_waits_on_a_lock()
    finally:
        operator_waits.set()
        for t in threads:
            t.join(timeout=60)
    assert not errors, errors
    remaining = Instance.objects.filter(pk=instance.pk).values_list("desired_state", flat=True)
    assert list(remaining) == (["drained"] if operator_call == "drain" else [])


# --- heartbeats lock their own node's rows, never a row two nodes share --------------------


def _nodes_of_one_datacenter(count: int = 2) -> list[Node]:
    """`count` registered, online nodes of one datacenter, each with one prefill instance."""
    first, model = _fleet_of_one_node()
    nodes = [first] + [
        services.node_create(
            hostname=f"n{k}", datacenter=first.datacenter, gpu_type=first.gpu_type, gpu_count=8
        )[0]
        for k in range(1, count)
    ]
    for k, node in enumerate(nodes):
        services.instance_create(role="prefill", node=node, served_model=model, gpu_count=1)
        Node.objects.filter(pk=node.pk).update(
            status="online",
            registered_at=timezone.now(),
            last_heartbeat_at=timezone.now(),
            agent_endpoint=f"http://127.0.0.1:{9100 + k}",
        )
    return [Node.objects.get(pk=node.pk) for node in nodes]


def _running_report(node: Node) -> dict:
    return {
        "instances": [
            {"instance_id": str(pk), "state": "running"}
            for pk in node.instances.values_list("pk", flat=True)
        ]
    }


def _locked_tables(call) -> list[set[str]]:
    """For each locking statement `call` runs (in a transaction), the tables it locks."""
    with CaptureQueriesContext(connection) as queries, transaction.atomic():
        call()
    locked = []
    for query in queries.captured_queries:
        sql = query["sql"]
        if " FOR " not in sql:
            continue
        match = re.search(r" FOR (?:NO KEY )?UPDATE OF (.+?)(?: NOWAIT| SKIP LOCKED)?$", sql)
        # FOR UPDATE without OF locks a row of every table in the FROM clause.
        assert match, f"a locking statement that does not name its tables: {sql}"
        locked.append({name.strip().strip('"') for name in match.group(1).split(",")})
    return locked


def test_a_heartbeat_locks_only_its_node_and_its_instances():
    """Instance's default ordering joins fleet_datacenter: a plain FOR UPDATE of a node's
    instances locked its datacenter's row too, one lock shared by every node of a datacenter
    (160 deadlocks at 200 nodes). The locking statements name their own tables only."""
    node = _nodes_of_one_datacenter(1)[0]
    locked = _locked_tables(
        lambda: agent_services.node_heartbeat(node=node, report=_running_report(node))
    )
    assert locked == [{"fleet_node"}, {"fleet_instance"}]

    locked = _locked_tables(
        lambda: agent_services.node_register(
            node=node, endpoint="http://127.0.0.1:9100", report=_running_report(node)
        )
    )
    assert locked and all(tables <= {"fleet_node", "fleet_instance"} for tables in locked)

    Node.objects.filter(pk=node.pk).update(last_heartbeat_at=timezone.now() - timedelta(hours=1))
    locked = _locked_tables(agent_services.nodes_mark_offline)
    assert locked == [{"fleet_node"}, {"fleet_instance"}]
    assert Node.objects.get(pk=node.pk).status == "offline"


def test_heartbeats_of_one_datacenter_do_not_wait_for_each_other():
    """While one node's heartbeat transaction is open, another node of the same datacenter
    heartbeats, goes offline, and an operator edits the datacenter, none of them waiting."""
    first, second = _nodes_of_one_datacenter(2)
    held, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def hold_first_heartbeat():
        try:
            with transaction.atomic():
                agent_services.node_heartbeat(node=first, report=_running_report(first))
                held.set()
                assert release.wait(timeout=30)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            errors.append(exc)
        finally:
            connections.close_all()

    thread = threading.Thread(target=hold_first_heartbeat)
    thread.start()
    try:
        assert held.wait(timeout=20)
        start = time.monotonic()
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("SET LOCAL lock_timeout = '3s'")
            agent_services.node_heartbeat(node=second, report=_running_report(second))
            Datacenter.objects.filter(pk=first.datacenter_id).update(description="edited")
            Node.objects.filter(pk=second.pk).update(
                last_heartbeat_at=timezone.now() - timedelta(hours=1)
            )
            assert agent_services.nodes_mark_offline() == [second.pk]
        elapsed = time.monotonic() - start
    finally:
        release.set()
        thread.join(timeout=30)
    assert not errors, errors
    assert elapsed < 2.0
    assert Instance.objects.get(node=second).actual_state == "unavailable"
    assert Instance.objects.get(node=first).actual_state == "running"
