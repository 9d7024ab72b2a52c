"""One helper for every server-side push to websocket groups."""

from __future__ import annotations

import logging
from typing import Any

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

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
