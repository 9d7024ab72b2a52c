"""The fleet's event log: one row per thing that happened to a node or an instance (state
changes, provisioning steps, operator edits), shown in the UI and the API."""

from __future__ import annotations

from typing import Any

from fleet.models import FleetEvent, Instance, Node


def event_record(
    *,
    kind: str,
    message: str,
    node: Node | None = None,
    instance: Instance | None = None,
    data: dict[str, Any] | None = None,
    actor: str = "",
) -> FleetEvent:
    if instance is not None and node is None:
        node = instance.node
    return FleetEvent.objects.create(
        kind=kind,
        message=message,
        node=node,
        instance=instance,
        data=data or {},
        actor=actor,
    )
