"""Registration with the control plane and the heartbeat loop (agents/PROTOCOL.md, "Agent ->
control plane"). The agent keeps serving while the control plane is down, and registers again
after a 401 / 404 or once the control plane is reachable again.

Heartbeats keep their period whatever the engines are doing: the report reads copies the engine
threads keep (Agent.report never waits for an engine), beats are sent on a fixed schedule (a
slow answer does not push the next beat back by its own duration), and a beat that times out
is only logged: the agent stays registered and the next one goes out on time."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any

import httpx

from agents.node.agent import Agent
from agents.node.settings import link_from_json
from pdd.dataplane import check_data_token

log = logging.getLogger(__name__)


class HeartbeatStats:
    """How this agent's heartbeats fared: answered, refused, timed out, unreachable, and the
    round trip of the last WINDOW answered ones (the state document's ``control_plane``)."""

    WINDOW = 256

    def __init__(self) -> None:
        self.answered = 0
        self.refused = 0  # answered with a status other than 200
        self.timeouts = 0
        self.unreachable = 0
        self._rtts: deque[float] = deque(maxlen=self.WINDOW)

    def answered_in(self, seconds: float) -> None:
        self.answered += 1
        self._rtts.append(seconds)

    def to_json(self) -> dict[str, Any]:
        rtts = sorted(self._rtts)

        def pct(q: float) -> float | None:
            return round(rtts[min(len(rtts) - 1, int(q * len(rtts)))], 6) if rtts else None

        return {
            "heartbeats_answered": self.answered,
            "heartbeats_refused": self.refused,
            "heartbeat_timeouts": self.timeouts,
            "unreachable": self.unreachable,
            "rtt_p50_s": pct(0.5),
            "rtt_p99_s": pct(0.99),
            "rtt_max_s": round(rtts[-1], 6) if rtts else None,
            "window": len(rtts),
        }


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
        self.stats = agent.heartbeat_stats = HeartbeatStats()

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

    def next_beat(self, due: float, now: float) -> float:
        """When the beat after the one due at `due` is due: one interval later, or one interval
        from `now` if the agent fell a whole interval behind (no burst of catch-up beats)."""
        due += self.interval_s
        return due if due > now else now + self.interval_s

    async def run(self) -> None:
        registered = False
        due = time.monotonic()
        # An answer may take a while on a loaded control plane; the next beat is not held up by
        # it beyond this, and a timeout does not count as the control plane being gone.
        timeout = httpx.Timeout(10.0, connect=5.0)
        async with httpx.AsyncClient(timeout=timeout) as http:
            while True:
                try:
                    if not registered:
                        registered = await self.register(http)
                    else:
                        body = await self.agent.report()
                        sent = time.monotonic()
                        response = await http.post(
                            f"{self.base}/api/v1/agent/heartbeat", json=body, headers=self.headers
                        )
                        rtt = time.monotonic() - sent
                        if response.status_code != 200:
                            self.stats.refused += 1
                        if response.status_code in (401, 404):
                            log.warning(
                                "heartbeat answered %s: registering again", response.status_code
                            )
                            registered = await self.register(http)
                        elif response.status_code != 200:
                            # The reason matters: a 400 names the field the control plane
                            # refused (say, a KV endpoint outside the allowed networks).
                            log.warning(
                                "heartbeat answered HTTP %s: %s",
                                response.status_code,
                                response.text[:300],
                            )
                        else:
                            self.heartbeats += 1
                            self.stats.answered_in(rtt)
                except asyncio.CancelledError:
                    raise
                except httpx.TimeoutException as exc:
                    # Slow, not gone: a registered agent stays registered (registering again
                    # would change the command token under the control plane's feet).
                    self.stats.timeouts += 1
                    log.warning("control plane slow to answer: %r", exc)
                except Exception as exc:  # noqa: BLE001 - keep serving; register once reachable
                    self.stats.unreachable += 1
                    log.warning("control plane unreachable: %r", exc)
                    registered = False
                due = self.next_beat(due, time.monotonic())
                await asyncio.sleep(max(0.0, due - time.monotonic()))
