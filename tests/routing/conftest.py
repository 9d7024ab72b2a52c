"""Fixtures shared by the routing tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from fleet import live as fleet_live
from fleet.choices import NodeStatus
from fleet.models import Datacenter, GPUType, Instance, Node, ServedModel


@pytest.fixture
def running_instance(settings) -> Callable[..., Instance]:
    """A factory: ``make(role, dc, gpu, model, **item)`` declares an online node of ``role`` in
    ``dc`` with one instance of ``model`` and publishes its running report (``item`` added to
    the instance's entry, such as ``kv``) to this process's live state (no Redis)."""
    settings.REDIS_URL = ""

    def make(role: str, dc: Datacenter, gpu: GPUType, model: ServedModel, **item: Any) -> Instance:
        node = Node.objects.create(
            hostname=f"{dc.name}-{role}",
            datacenter=dc,
            gpu_type=gpu,
            gpu_count=8,
            agent_endpoint=f"http://{dc.name}-{role}.agent",
            agent_token_prefix=f"t-{dc.pk}-{role[:6]}",  # at most 16 characters
            status=NodeStatus.ONLINE,
        )
        inst = Instance.objects.create(role=role, node=node, served_model=model, gpu_count=8)
        entry = {
            "instance_id": str(inst.pk),
            "role": role,
            "state": "running",
            "load": {"running": 0, "queued": 0, "max_running": 32},
            **item,
        }
        fleet_live.publish_report(
            node_id=node.pk,
            hostname=node.hostname,
            datacenter=dc.name,
            endpoint=node.agent_endpoint,
            report={"instances": [entry]},
        )
        return inst

    return make
