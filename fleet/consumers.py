"""Websocket consumer that pushes fleet changes (instance state, link status) to operators."""

from __future__ import annotations

from channels.generic.websocket import AsyncJsonWebsocketConsumer

FLEET_GROUP = "fleet"


class FleetConsumer(AsyncJsonWebsocketConsumer):
    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            # 4401: the socket's own "unauthorised", so the page can send the user to log in.
            await self.close(code=4401)
            return
        await self.channel_layer.group_add(FLEET_GROUP, self.channel_name)
        await self.accept()
        await self.send_json({"type": "hello", "group": FLEET_GROUP})

    async def disconnect(self, code: int) -> None:
        await self.channel_layer.group_discard(FLEET_GROUP, self.channel_name)

    async def push(self, event: dict) -> None:
        await self.send_json(event["payload"])
