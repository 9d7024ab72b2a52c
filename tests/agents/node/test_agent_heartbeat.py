"""Heartbeats and /state never wait for a busy engine: the prefix blocks a decode instance
reports are the copy its engine thread keeps (EngineWorker.snapshot), and the heartbeat loop
keeps its schedule and its registration through a slow control plane. In process, on a real
baton-tiny engine; no timing assertions (bounds only catch a hang)."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx

from agents.engine import SamplingParams
from agents.node import control as control_module
from agents.node.agent import Agent
from agents.node.control import ControlPlaneLink
from agents.node.http_api import build_app
from agents.node.settings import AgentSettings
from pdd.prefix import prefix_block_hashes

BS = 16
HANG_S = 60.0  # the engine thread is held at most this long; a report that waited would hang
PROMPT = [32 + (i * 7) % 90 for i in range(70)]


def run(coro_fn, **settings):
    async def main():
        agent = Agent(AgentSettings(block_size=BS, num_blocks=128, **settings))
        try:
            inst = await agent.instances.put("0", "main_decode", "baton-tiny", "baton-tiny", 120)
            await asyncio.wait_for(inst.ready.wait(), 120)
            assert inst.worker is not None, inst.error
            return await coro_fn(agent, inst)
        finally:
            await agent.close()

    return asyncio.run(main())


class CountingCalls:
    """Wraps worker.call: counts what the loop queues on the engine thread."""

    def __init__(self, worker) -> None:
        self.worker, self.inner, self.count = worker, worker.call, 0
        worker.call = self

    def __call__(self, fn):
        self.count += 1
        return self.inner(fn)

    def restore(self) -> None:
        self.worker.call = self.inner


async def hold_engine_thread(worker) -> tuple[threading.Event, asyncio.Future]:
    """Block the engine thread in a command until the returned event is set."""
    started, release = threading.Event(), threading.Event()

    def block(_engine):
        started.set()
        release.wait(HANG_S)

    held = worker.call(block)
    assert await asyncio.to_thread(started.wait, HANG_S)
    return release, held


def logged_blocks(inst) -> set[str]:
    """The hashes the instance's KV event log holds as stored (pending, not yet posted)."""
    held: set[str] = set()
    for batch in inst.kv_events.take(10**9):
        for event in batch["events"]:
            if event["type"] == "stored":
                held.update(event["blocks"])
            elif event["type"] == "removed":
                held.difference_update(event["blocks"])
    return held


def test_an_idle_engines_kv_events_are_complete():
    async def scenario(agent, inst):
        await inst.worker.call(lambda e: e.generate(PROMPT, SamplingParams(max_tokens=1)))
        assert set(prefix_block_hashes(PROMPT, BS)) <= logged_blocks(inst)
        summary = (await agent.reporting.report())["instances"][0]["kv_events"]
        assert summary["digest"]["blocks"] == inst.worker.stats.cached_blocks
        assert "cached_prefix_blocks" not in (await agent.reporting.report())["instances"][0]

    run(scenario)


def test_the_heartbeat_report_and_get_state_answer_while_the_engine_thread_is_blocked():
    async def scenario(agent, inst):
        await inst.worker.call(lambda e: e.generate(PROMPT, SamplingParams(max_tokens=1)))
        wanted = set(prefix_block_hashes(PROMPT, BS))
        release, held = await hold_engine_thread(inst.worker)
        calls = CountingCalls(inst.worker)
        try:
            # Both would wait for `release` if they queued on the engine thread.
            report = await asyncio.wait_for(agent.reporting.report(), HANG_S / 2)
            transport = httpx.ASGITransport(app=build_app(agent))
            async with httpx.AsyncClient(transport=transport, base_url="http://agent") as http:
                response = await asyncio.wait_for(http.get("/state"), HANG_S / 2)
            assert calls.count == 0
        finally:
            calls.restore()
            release.set()
            await held
        assert report["instances"][0]["kv_events"]["digest"]["blocks"] >= len(wanted)
        assert response.status_code == 200
        assert wanted <= logged_blocks(inst)
        assert "threads" in response.json()

    run(scenario)


def test_kv_events_are_recorded_on_the_engine_thread_before_the_loop_hears_of_a_change():
    async def scenario(agent, inst):
        worker = inst.worker
        threads: list[str] = []
        original = worker._snapshot_fn

        def snapshot(engine):
            threads.append(threading.current_thread().name)
            return original(engine)

        worker._snapshot_fn = snapshot
        # The command's future resolves after the snapshot of what it changed was taken.
        await worker.call(lambda e: e.generate(PROMPT, SamplingParams(max_tokens=2)))
        assert threads and set(threads) == {"engine-0"}
        assert set(prefix_block_hashes(PROMPT, BS)) <= logged_blocks(inst)

    run(scenario)


def test_a_prefill_instance_publishes_its_cache_too():
    """P's prefix cache is in the index as well: the gateway sends a session's turn back to
    the P that holds its context."""

    async def main():
        agent = Agent(AgentSettings(block_size=BS, num_blocks=64))
        try:
            inst = await agent.instances.put("0", "prefill", "baton-tiny", "baton-tiny", 120)
            await asyncio.wait_for(inst.ready.wait(), 120)
            await inst.worker.call(lambda e: e.generate(PROMPT, SamplingParams(max_tokens=1)))
            assert set(prefix_block_hashes(PROMPT, BS)) <= logged_blocks(inst)
            assert "kv_events" in (await agent.reporting.report())["instances"][0]
        finally:
            await agent.close()

    asyncio.run(main())


# -- the heartbeat loop ----------------------------------------------------------------------


def link_for(agent: Agent) -> ControlPlaneLink:
    return ControlPlaneLink(agent, "http://127.0.0.1:1")


def test_beats_keep_a_fixed_schedule_and_do_not_burst_after_a_stall():
    link = link_for(Agent(AgentSettings(control_plane="http://cp", token="t")))
    link.interval_s = 2.0
    # A beat that took 0.5 s: the next is due 2 s after the last was due, not 2.5 s.
    assert link.next_beat(10.0, 10.5) == 12.0
    # Fell more than an interval behind (a 7 s answer): one beat now + 2 s, no catch-up burst.
    assert link.next_beat(10.0, 17.0) == 19.0


def test_a_slow_control_plane_keeps_the_agent_registered(monkeypatch):
    """A heartbeat that times out is logged; the agent neither registers again (a new command
    token) nor stops beating."""
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        seen.append(path)
        if path.endswith("/register"):
            body = {"command_token": "c1", "heartbeat_interval_s": 0.01, "links": {}}
            return httpx.Response(200, json=body)
        if seen.count(path) == 1:
            raise httpx.ReadTimeout("the control plane is busy", request=request)
        json.loads(request.content)  # a full state document
        return httpx.Response(200, json={"ok": True})

    real_client = httpx.AsyncClient

    def client(**kwargs):
        return real_client(transport=httpx.MockTransport(handler), **kwargs)

    monkeypatch.setattr(control_module.httpx, "AsyncClient", client)

    async def main():
        agent = Agent(AgentSettings(control_plane="http://cp", token="t"))
        link = link_for(agent)
        task = asyncio.create_task(link.run())
        try:
            for _ in range(int(HANG_S / 0.01)):
                if link.heartbeats >= 2:
                    break
                await asyncio.sleep(0.01)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await agent.close()
        return link

    link = asyncio.run(main())
    assert link.heartbeats >= 2
    assert link.registrations == 1
    assert seen.count("/api/v1/agent/register") == 1
    # The state document counts how the beats fared (the first timed out).
    stats = link.agent.reporting.state()["control_plane"]
    assert stats["heartbeat_timeouts"] == 1
    assert stats["heartbeats_answered"] == link.heartbeats
    assert stats["window"] == link.heartbeats and stats["rtt_p50_s"] >= 0


def test_heartbeat_stats_summarise_the_round_trips():
    from agents.node.control import HeartbeatStats

    stats = HeartbeatStats()
    assert stats.to_json()["rtt_p50_s"] is None
    for ms in range(1, 101):
        stats.answered_in(ms / 1000)
    stats.refused += 2
    doc = stats.to_json()
    assert doc["heartbeats_answered"] == 100 and doc["heartbeats_refused"] == 2
    assert doc["rtt_p50_s"] == 0.051 and doc["rtt_p99_s"] == 0.1 and doc["rtt_max_s"] == 0.1


def test_the_engine_threads_busy_time_counts_its_commands_and_steps():
    """EngineWorker.busy_s grows by the time the engine thread spends in a command (here one
    held for a while) and in engine steps, and not while it waits for work."""

    async def scenario(agent, inst):
        worker = inst.worker
        idle = worker.busy_s
        await asyncio.sleep(0.3)
        assert worker.busy_s == idle  # waiting for a command is not engine work
        await worker.call(lambda _e: threading.Event().wait(0.2))
        assert worker.busy_s - idle >= 0.2
        before = worker.busy_s
        await worker.call(lambda e: e.generate(PROMPT, SamplingParams(max_tokens=2)))
        assert worker.busy_s > before
        doc = await agent.reporting.report()
        assert doc["instances"][0]["engine"]["busy_s"] == round(worker.busy_s, 6)

    run(scenario)
