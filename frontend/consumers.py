"""The dashboard websocket and the per-process loop that pushes it a snapshot every second.

The loop computes one snapshot per tick for the whole process and sends it to this process's
own dashboard group. The group is per process on purpose: with the Redis channel layer a single
shared "dashboard" group would deliver every process's snapshot to every socket, N copies a
second. Fleet changes (instance state, link status) reach the same sockets through the existing
fleet-wide "fleet" group that fleet/signals.py emits to.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid

from asgiref.sync import sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from channels.layers import get_channel_layer

from fleet.consumers import FLEET_GROUP
from frontend import conf
from frontend.telemetry.snapshot import build_history, build_snapshot

log = logging.getLogger(__name__)

PROCESS_TAG = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
DASHBOARD_GROUP = f"dashboard.{PROCESS_TAG}"


class SnapshotBroadcaster:
    """One loop per process: runs while at least one dashboard socket of this process is open."""

    def __init__(self, group: str = DASHBOARD_GROUP) -> None:
        self.group = group
        self.sockets = 0
        self.ticks = 0
        self._task: asyncio.Task | None = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def attach(self) -> None:
        self.sockets += 1
        if not self.running:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def detach(self) -> None:
        self.sockets = max(0, self.sockets - 1)
        if self.sockets == 0:
            await self.stop()

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is None or task.done():
            return
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass

    async def _run(self) -> None:
        layer = get_channel_layer()
        interval = conf.dashboard_interval_s()
        loop = asyncio.get_running_loop()
        next_tick = loop.time()
        while True:
            try:
                snapshot = await sync_to_async(build_snapshot)()
                await layer.group_send(self.group, {"type": "push", "payload": snapshot})
                self.ticks += 1
            except asyncio.CancelledError:
                raise
            except Exception:  # a failed tick is a stale screen, not a dead loop
                log.warning("dashboard snapshot failed", exc_info=True)
            next_tick += interval
            await asyncio.sleep(max(0.0, next_tick - loop.time()))


broadcaster = SnapshotBroadcaster()


class DashboardConsumer(AsyncJsonWebsocketConsumer):
    """Authenticated socket: history on connect, then snapshots and fleet changes."""

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=4401)
            return
        await self.channel_layer.group_add(broadcaster.group, self.channel_name)
        await self.channel_layer.group_add(FLEET_GROUP, self.channel_name)
        await self.accept()
        broadcaster.attach()
        await self._send({"type": "hello", "interval_s": conf.dashboard_interval_s()})
        await self._send(await sync_to_async(build_history)())

    async def _send(self, payload: dict) -> None:
        # The browser may leave while a push is on its way; the disconnect that follows cleans up.
        try:
            await self.send_json(payload)
        except (RuntimeError, OSError):
            log.debug("dashboard socket went away before a push", exc_info=True)

    async def disconnect(self, code: int) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            return
        await self.channel_layer.group_discard(broadcaster.group, self.channel_name)
        await self.channel_layer.group_discard(FLEET_GROUP, self.channel_name)
        await broadcaster.detach()

    async def push(self, event: dict) -> None:
        payload = event["payload"]
        if payload.get("type") != "snapshot":
            payload = {"type": "fleet_change", "change": payload}
        await self._send(payload)
