"""Registration with the control plane and the heartbeat loop (agents/PROTOCOL.md, "Agent ->
control plane"). The agent keeps serving while the control plane is down, and registers again
after a 401 / 404 or once the control plane is reachable again."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx

from agents.dataplane import check_data_token
from agents.node.agent import Agent
from agents.node.settings import link_from_json

log = logging.getLogger(__name__)


class ControlPlaneLink:
    def __init__(self, agent: Agent, endpoint: str) -> None:
        assert agent.settings.control_plane and agent.settings.token, "needs URL and token"
        self.agent = agent
        self.endpoint = endpoint
        self.base = agent.settings.control_plane.rstrip("/")
        self.interval_s = agent.settings.heartbeat_interval_s
        self.headers = {"Authorization": f"AgentToken {agent.settings.token}"}
        self.registrations = 0
        self.heartbeats = 0

    async def register(self, http: httpx.AsyncClient) -> bool:
        body = {**(await self.agent.report()), "endpoint": self.endpoint}
        response = await http.post(
            f"{self.base}/api/v1/agent/register", json=body, headers=self.headers
        )
        if response.status_code != 200:
            log.warning(
                "registration refused: HTTP %s %s", response.status_code, response.text[:300]
            )
            return False
        self.apply(response.json())
        self.registrations += 1
        log.info("registered with %s as %s", self.base, self.agent.settings.node)
        return True

    def apply(self, answer: dict[str, Any]) -> None:
        self.agent.command_token = str(answer["command_token"])
        data_token = answer.get("data_token")
        if data_token:
            try:
                token = check_data_token(data_token, "data_token")
            except ValueError as exc:
                log.warning("ignoring the control plane's data-plane token: %s", exc)
            else:
                if self.agent.data_token not in (None, token):
                    log.warning("the control plane's data-plane token replaces this agent's")
                self.agent.set_data_token(token)
        self.agent.registered = True
        interval = answer.get("heartbeat_interval_s")
        if isinstance(interval, (int, float)) and interval > 0:
            self.interval_s = float(interval)
        for peer, body in (answer.get("links") or {}).items():
            try:
                self.agent.set_link(peer, link_from_json(body))
            except ValueError as exc:
                log.warning("ignoring link to %s from the control plane: %s", peer, exc)

    async def run(self) -> None:
        registered = False
        async with httpx.AsyncClient(timeout=10.0) as http:
            while True:
                try:
                    if not registered:
                        registered = await self.register(http)
                    else:
                        response = await http.post(
                            f"{self.base}/api/v1/agent/heartbeat",
                            json=await self.agent.report(),
                            headers=self.headers,
                        )
                        if response.status_code in (401, 404):
                            log.warning(
                                "heartbeat answered %s: registering again", response.status_code
                            )
                            registered = await self.register(http)
                        elif response.status_code != 200:
                            log.warning("heartbeat answered HTTP %s", response.status_code)
                        else:
                            self.heartbeats += 1
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - keep serving; register once reachable
                    log.warning("control plane unreachable: %r", exc)
                    registered = False
                await asyncio.sleep(self.interval_s)
