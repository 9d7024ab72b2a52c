"""Behaviour that only a real PostgreSQL server can show: row locks under concurrency."""

from __future__ import annotations

import threading
import time

import pytest
from django.core.exceptions import ValidationError
from django.db import connection, connections, transaction

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
