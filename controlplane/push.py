"""Server-side pushes to websocket groups, and what the apps' change signals push where.

Apps offer signals (``fleet.signals.fleet_changed``); the control plane, at the top, connects
them to the groups their pages listen on (``connect_pushes``, run by ``controlplane.apps``)."""

from __future__ import annotations

import logging
from typing import Any

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

from fleet.consumers import FLEET_GROUP
from fleet.signals import fleet_changed

log = logging.getLogger(__name__)


def emit(group: str, payload: dict[str, Any]) -> None:
    """Send ``payload`` to every socket in ``group``; a push failure never fails the caller."""
    layer = get_channel_layer()
    if layer is None:
        return
    try:
        async_to_sync(layer.group_send)(group, {"type": "push", "payload": payload})
    except Exception:  # the write already committed; a lost push is only a stale screen
        log.warning("push to group %s failed", group, exc_info=True)


def _fleet_changed(sender: Any, payload: dict[str, Any], **kwargs: Any) -> None:
    emit(FLEET_GROUP, payload)


def connect_pushes() -> None:
    """Every app's change signal to the group that shows it (idempotent)."""
    fleet_changed.connect(_fleet_changed, dispatch_uid="controlplane.push.fleet_changed")
