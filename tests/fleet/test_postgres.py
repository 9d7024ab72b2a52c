"""Behaviour that only a real PostgreSQL server can show: row locks under concurrency."""

from __future__ import annotations

import threading

import pytest
from django.core.exceptions import ValidationError
from django.db import connection, connections

from fleet import services
from fleet.models import Datacenter, GPUType, Instance, ServedModel

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def test_suite_runs_on_postgresql():
    assert connection.vendor == "postgresql"


def test_concurrent_instance_creates_cannot_overbook_a_node():
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
