"""Registration with the control plane and the heartbeat loop (agents/PROTOCOL.md, "Agent ->
control plane"). The agent keeps serving while the control plane is down, and registers again
after a 401 / 404 or once the control plane is reachable again.

Heartbeats keep their period whatever the engines are doing: the report reads copies the engine
threads keep (Reporting.report never waits for an engine), beats are sent on a fixed schedule (a
slow answer does not push the next beat back by its own duration), and a beat that times out
is only logged: the agent stays registered and the next one goes out on time.

A refusal that sending the same body again cannot fix (400: a field the control plane refused;
413: a body over its size limit) is logged once per try with the control plane's reason, and
the agent backs off (twice the interval, doubling up to BACKOFF_CAP_S) until a registration or
heartbeat is accepted again; after a 413 the prefix-block lists of its reports are halved."""

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

# Answers that the same body would get again: back off instead of sending it every interval.
REFUSED = (400, 413)
BACKOFF_CAP_S = 60.0
# The per-instance lists a report can be shortened by (prefix-block chain hashes, in order).
BLOCK_LISTS = ("incoming_prefix_blocks",)


class HeartbeatStats:
    """How this agent's heartbeats fared: answered, refused, timed out, unreachable, and the
    round trip of the last WINDOW answered ones (the state document's ``control_plane``)."""

    WINDOW = 256

    def __init__(self) -> None:
        self.answered = 0
        self.refused = 0  # answered with a status other than 200
        self.refused_by_status: dict[int, int] = {}
        self.registrations_refused = 0  # 400 or 413 to a registration
        self.last_refusal: dict[str, Any] | None = None  # the latest 400 / 413, and why
        self.backoff_s = 0.0  # the wait before the next try, while refused
        self.report_block_cap: int | None = None  # after a 413: hashes per block list
        self.timeouts = 0
        self.unreachable = 0
        self._rtts: deque[float] = deque(maxlen=self.WINDOW)

    def answered_in(self, seconds: float) -> None:
        self.answered += 1
        self._rtts.append(seconds)

    def heartbeat_refused(self, status: int) -> None:
        self.refused += 1
        self.refused_by_status[status] = self.refused_by_status.get(status, 0) + 1

    def to_json(self) -> dict[str, Any]:
        rtts = sorted(self._rtts)

        def pct(q: float) -> float | None:
            return round(rtts[min(len(rtts) - 1, int(q * len(rtts)))], 6) if rtts else None

        return {
            "heartbeats_answered": self.answered,
            "heartbeats_refused": self.refused,
            "heartbeats_refused_by_status": {
                str(status): n for status, n in sorted(self.refused_by_status.items())
            },
            "registrations_refused": self.registrations_refused,
            "last_refusal": self.last_refusal,
            "backoff_s": self.backoff_s,
            "report_block_cap": self.report_block_cap,
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
        self.stats = agent.reporting.heartbeat_stats = HeartbeatStats()
        # 400 / 413 answers in a row (registrations and heartbeats): the back-off's exponent.
        self.refusals = 0
        # After a 413: at most this many hashes in each block list of a report (halved at each
        # 413; kept until the agent restarts).
        self.block_cap: int | None = None

    async def report(self) -> dict[str, Any]:
        """The state document, its block lists cut to `block_cap` after a 413."""
        return shortened(await self.agent.reporting.report(), self.block_cap)

    async def register(self, http: httpx.AsyncClient) -> bool:
        body = {**(await self.report()), "endpoint": self.endpoint}
        response = await http.post(
            f"{self.base}/api/v1/agent/register", json=body, headers=self.headers
        )
        if response.status_code in REFUSED:
            self.stats.registrations_refused += 1
            self.refused("registration", response, body)
            return False
        if response.status_code != 200:
            log.warning(
                "registration refused: HTTP %s %s", response.status_code, response.text[:300]
            )
            return False
        self.apply(response.json())
        self.registrations += 1
        self.accepted("registration")
        log.info("registered with %s as %s", self.base, self.agent.settings.node)
        return True

    def backoff_s(self) -> float:
        """The wait before the next try: none while accepted; after n refusals in a row, the
        interval x 2^n, at most BACKOFF_CAP_S."""
        if not self.refusals:
            return 0.0
        return min(BACKOFF_CAP_S, self.interval_s * 2.0 ** min(self.refusals, 32))

    def refused(self, what: str, response: httpx.Response, body: dict[str, Any]) -> None:
        """A 400 or 413: the same body would be refused again. One line with the control
        plane's reason; the next try backs off, and after a 413 comes with shorter lists."""
        status = response.status_code
        detail = " ".join(response.text.split())[:300]
        self.refusals += 1
        shrink = ""
        if status == 413:
            longest = longest_block_list(body)
            if longest:
                self.block_cap = longest // 2
                shrink = f"; block lists cut to {self.block_cap} hashes from the next report"
            else:
                shrink = "; no block list to shorten"
        wait = self.backoff_s()
        self.stats.last_refusal = {"status": status, "detail": detail, "at": round(time.time(), 3)}
        self.stats.backoff_s = wait
        self.stats.report_block_cap = self.block_cap
        log.warning(
            "control plane refused the %s: HTTP %s: %s%s; next try in %.0f s (%d refused in a row)",
            what,
            status,
            detail,
            shrink,
            wait,
            self.refusals,
        )

    def accepted(self, what: str) -> None:
        if self.refusals:
            log.warning(
                "control plane accepted the %s again after %d refusals", what, self.refusals
            )
        self.refusals = 0
        self.stats.backoff_s = 0.0

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
                self.agent.links.set(peer, link_from_json(body))
            except ValueError as exc:
                log.warning("ignoring link to %s from the control plane: %s", peer, exc)

    def next_beat(self, due: float, now: float) -> float:
        """When the beat after the one due at `due` is due: one interval later, or one interval
        from `now` if the agent fell a whole interval behind (no burst of catch-up beats)."""
        due += self.interval_s
        return due if due > now else now + self.interval_s

    def after_beat(self, due: float, now: float) -> float:
        """When the next try goes out: on schedule (next_beat), or after the back-off while the
        control plane refuses this agent's bodies."""
        if self.refusals:
            return now + self.backoff_s()
        return self.next_beat(due, now)

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
                        body = await self.report()
                        sent = time.monotonic()
                        response = await http.post(
                            f"{self.base}/api/v1/agent/heartbeat", json=body, headers=self.headers
                        )
                        rtt = time.monotonic() - sent
                        if response.status_code != 200:
                            self.stats.heartbeat_refused(response.status_code)
                        if response.status_code in (401, 404):
                            log.warning(
                                "heartbeat answered %s: registering again", response.status_code
                            )
                            registered = await self.register(http)
                        elif response.status_code in REFUSED:
                            # The reason matters: a 400 names the field the control plane
                            # refused (say, a KV endpoint outside the allowed networks).
                            self.refused("heartbeat", response, body)
                        elif response.status_code != 200:
                            log.warning(
                                "heartbeat answered HTTP %s: %s",
                                response.status_code,
                                response.text[:300],
                            )
                        else:
                            self.heartbeats += 1
                            self.stats.answered_in(rtt)
                            self.accepted("heartbeat")
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
                due = self.after_beat(due, time.monotonic())
                await asyncio.sleep(max(0.0, due - time.monotonic()))


def longest_block_list(report: dict[str, Any]) -> int:
    """The most hashes any instance of `report` lists in one of its BLOCK_LISTS."""
    longest = 0
    for item in report.get("instances") or ():
        if isinstance(item, dict):
            for key in BLOCK_LISTS:
                blocks = item.get(key)
                if isinstance(blocks, list):
                    longest = max(longest, len(blocks))
    return longest


def shortened(report: dict[str, Any], cap: int | None) -> dict[str, Any]:
    """`report` with each instance's BLOCK_LISTS cut to their first `cap` hashes (the start of
    a chain is what prefix matching uses); `report` itself when there is no cap."""
    if cap is None or longest_block_list(report) <= cap:
        return report
    instances = []
    for item in report.get("instances") or ():
        if isinstance(item, dict):
            item = {
                k: (v[:cap] if k in BLOCK_LISTS and isinstance(v, list) else v)
                for k, v in item.items()
            }
        instances.append(item)
    return report | {"instances": instances}
