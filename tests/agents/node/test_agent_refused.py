"""An agent the control plane refuses (400: a field it will not take; 413: a body over its
limit) says why in one line per try, backs off exponentially instead of sending the same body
every interval, shortens its block lists after a 413, and beats on schedule again once
accepted. In process, against a mock control plane; time bounds are lower bounds only."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import httpx
import pytest

from agents.node import control as control_module
from agents.node.agent import Agent
from agents.node.control import BACKOFF_CAP_S, ControlPlaneLink, longest_block_list, shortened
from agents.node.settings import AgentSettings

HANG_S = 30.0
INTERVAL_S = 0.01
KV_REFUSAL = {
    "instances": [{"kv_endpoint": {"host": ["Address 10.9.9.9 is outside the agent networks."]}}]
}


def test_the_back_off_doubles_from_twice_the_interval_up_to_the_cap():
    link = ControlPlaneLink(Agent(AgentSettings(control_plane="http://cp", token="t")), "x")
    link.interval_s = 2.0
    waits = []
    for refusals in (0, 1, 2, 3, 4, 5, 6, 1000):
        link.refusals = refusals
        waits.append(link.backoff_s())
    assert waits == [0.0, 4.0, 8.0, 16.0, 32.0, BACKOFF_CAP_S, BACKOFF_CAP_S, BACKOFF_CAP_S]
    link.refusals = 0
    assert link.after_beat(10.0, 10.5) == 12.0  # accepted: the fixed schedule
    link.refusals = 2
    assert link.after_beat(10.0, 10.5) == 18.5  # refused: the back-off from now


def test_block_lists_are_cut_to_the_start_of_their_chains():
    report = {
        "node": "n",
        "instances": [
            {"instance_id": "1", "incoming_prefix_blocks": [f"h{k}" for k in range(10)]},
            {"instance_id": "2", "state": "running"},
        ],
    }
    assert longest_block_list(report) == 10
    assert shortened(report, None) is report
    assert shortened(report, 10) is report
    cut = shortened(report, 3)
    assert cut["instances"][0]["incoming_prefix_blocks"] == ["h0", "h1", "h2"]
    assert cut["instances"][1] == {"instance_id": "2", "state": "running"}
    assert len(report["instances"][0]["incoming_prefix_blocks"]) == 10  # not changed in place


class MockControlPlane:
    """Registers every agent (heartbeats every INTERVAL_S); answers heartbeats with `answer`
    (a function of the body and how many heartbeats came before), recording when each came."""

    def __init__(self, answer, register_answer=None) -> None:
        self.answer = answer
        self.register_answer = register_answer or (lambda n: (200, None))
        self.beats: list[tuple[float, dict]] = []
        self.registrations: list[float] = []

    def handler(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if request.url.path.endswith("/register"):
            self.registrations.append(time.monotonic())
            status, detail = self.register_answer(len(self.registrations) - 1)
            if status != 200:
                return httpx.Response(status, json=detail)
            answer = {"command_token": "c1", "heartbeat_interval_s": INTERVAL_S, "links": {}}
            return httpx.Response(200, json=answer)
        self.beats.append((time.monotonic(), body))
        status, detail = self.answer(body, len(self.beats) - 1)
        return httpx.Response(status, json=detail if detail is not None else {"ok": True})


def run_link(monkeypatch, cp: MockControlPlane, until, report=None) -> ControlPlaneLink:
    real_client = httpx.AsyncClient

    def client(**kwargs):
        return real_client(transport=httpx.MockTransport(cp.handler), **kwargs)

    monkeypatch.setattr(control_module.httpx, "AsyncClient", client)

    async def main():
        # The interval before a registration's answer too (a refused registration's back-off).
        agent = Agent(
            AgentSettings(control_plane="http://cp", token="t", heartbeat_interval_s=INTERVAL_S)
        )
        if report is not None:

            async def fixed_report():
                return json.loads(json.dumps(report))

            agent.reporting.report = fixed_report
        link = ControlPlaneLink(agent, "http://127.0.0.1:1")
        task = asyncio.create_task(link.run())
        try:
            deadline = time.monotonic() + HANG_S
            while not until(link) and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await agent.close()
        return link

    return asyncio.run(main())


def test_a_refused_heartbeat_backs_off_says_why_and_recovers(monkeypatch, caplog):
    refusals = 4
    cp = MockControlPlane(lambda body, n: (400, KV_REFUSAL) if n < refusals else (200, None))
    with caplog.at_level(logging.WARNING, logger="agents.node.control"):
        link = run_link(monkeypatch, cp, until=lambda link: link.heartbeats >= 3)

    assert link.heartbeats >= 3 and link.refusals == 0
    times = [t for t, _ in cp.beats]
    # After the k-th refusal in a row the next try waited at least interval x 2^k.
    for k in range(1, refusals + 1):
        assert times[k] - times[k - 1] >= INTERVAL_S * 2**k * 0.95, (k, times)
    stats = link.agent.reporting.state()["control_plane"]
    assert stats["heartbeats_refused"] == refusals
    assert stats["heartbeats_refused_by_status"] == {"400": refusals}
    assert stats["last_refusal"]["status"] == 400
    assert "kv_endpoint" in stats["last_refusal"]["detail"]
    assert stats["backoff_s"] == 0.0  # accepted again
    lines = [r.getMessage() for r in caplog.records]
    refused = [line for line in lines if line.startswith("control plane refused the heartbeat")]
    assert len(refused) == refusals
    assert "HTTP 400" in refused[0] and "outside the agent networks" in refused[0]
    assert "next try in" in refused[0] and "(1 refused in a row)" in refused[0]
    assert f"accepted the heartbeat again after {refusals} refusals" in "\n".join(lines)


def test_an_agent_refused_for_good_tries_far_less_often_than_every_interval(monkeypatch):
    cp = MockControlPlane(lambda body, n: (400, KV_REFUSAL))
    start = time.monotonic()
    run_link(monkeypatch, cp, until=lambda link: time.monotonic() - start > 0.6)
    # Every interval would be ~60 tries in 0.6 s; backing off from 0.02 s: at most 6.
    assert 2 <= len(cp.beats) <= 6, len(cp.beats)


def test_a_413_halves_the_block_lists_until_the_report_fits(monkeypatch, caplog):
    hashes = [f"{k:064x}" for k in range(64)]
    report = {
        "node": "n",
        "instances": [
            {"instance_id": "7", "state": "running", "incoming_prefix_blocks": hashes},
        ],
    }

    def answer(body, n):
        blocks = body["instances"][0]["incoming_prefix_blocks"]
        if len(blocks) > 10:
            return 413, {"detail": "Request body too large: at most 4 KiB on this path."}
        return 200, None

    with caplog.at_level(logging.WARNING, logger="agents.node.control"):
        link = run_link(
            monkeypatch, cp := MockControlPlane(answer), lambda link: link.heartbeats >= 2, report
        )

    sent = [len(body["instances"][0]["incoming_prefix_blocks"]) for _, body in cp.beats]
    assert sent[:5] == [64, 32, 16, 8, 8]
    assert cp.beats[-1][1]["instances"][0]["incoming_prefix_blocks"] == hashes[:8]
    stats = link.agent.reporting.state()["control_plane"]
    assert stats["heartbeats_refused_by_status"] == {"413": 3}
    assert stats["report_block_cap"] == 8 and link.block_cap == 8
    refused = [r.getMessage() for r in caplog.records if "refused the heartbeat" in r.getMessage()]
    assert "HTTP 413" in refused[0] and "block lists cut to 32 hashes" in refused[0]


def test_a_413_with_nothing_to_shorten_only_backs_off(monkeypatch, caplog):
    cp = MockControlPlane(lambda body, n: (413, {"detail": "too large"}) if n < 2 else (200, None))
    with caplog.at_level(logging.WARNING, logger="agents.node.control"):
        link = run_link(monkeypatch, cp, until=lambda link: link.heartbeats >= 1)
    assert link.block_cap is None
    assert cp.beats[1][0] - cp.beats[0][0] >= INTERVAL_S * 2 * 0.95
    assert any("no block list to shorten" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("status", [400, 413])
def test_a_refused_registration_backs_off_too(monkeypatch, status):
    cp = MockControlPlane(
        lambda body, n: (200, None),
        register_answer=lambda n: (status, {"endpoint": ["refused"]}) if n < 3 else (200, None),
    )
    link = run_link(monkeypatch, cp, until=lambda link: link.heartbeats >= 1)
    assert link.registrations == 1 and link.refusals == 0
    tries = cp.registrations
    for k in range(1, 4):
        assert tries[k] - tries[k - 1] >= INTERVAL_S * 2**k * 0.95, (k, tries)
    stats = link.agent.reporting.state()["control_plane"]
    assert stats["registrations_refused"] == 3
    assert stats["last_refusal"]["status"] == status
