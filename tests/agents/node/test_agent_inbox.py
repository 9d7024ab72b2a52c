"""The agent's transfer inbox: transfers and failures for a request that has ended on this
instance (RLD's last handoff batch, cut or late) are dropped quietly, not queued or warned."""

from __future__ import annotations

import asyncio
import logging

from agents.node import inbox as inbox_module
from agents.node.agent import Agent
from agents.node.settings import AgentSettings
from agents.transfer import PartialTransferError
from agents.transfer.records import Transfer


def transfer(transfer_id: str) -> Transfer:
    return Transfer(
        request_id=transfer_id,
        chunks=(),
        tokens=None,
        payload_bytes=0,
        wire_bytes=0,
        frames=0,
        connected_at=0.0,
        first_frame_at=0.0,
        completed_at=0.0,
    )


def run(coro_fn):
    async def main():
        agent = Agent(AgentSettings())
        try:
            return await coro_fn(agent)
        finally:
            await agent.close()

    return asyncio.run(main())


def test_a_failure_for_a_live_or_unclaimed_request_is_queued_and_warned(caplog) -> None:
    async def scenario(agent: Agent):
        queue = agent.inbox.queue("r1", "3")
        cut = PartialTransferError("connection closed after 1 frames, before END")
        with caplog.at_level(logging.INFO, logger=inbox_module.__name__):
            await agent.inbox.on_transfer_error("r1|3|h0", cut)
            # Not claimed yet (KV may land before MD's consumer starts): kept for it.
            await agent.inbox.on_transfer_error("r2|3|kv", cut)
        assert queue.get_nowait() is cut
        assert agent.inbox.queue("r2", "3").get_nowait() is cut
        assert [r.levelno for r in caplog.records] == [logging.WARNING, logging.WARNING]

    run(scenario)


def test_after_the_request_ended_here_late_transfers_and_cuts_are_dropped(caplog) -> None:
    async def scenario(agent: Agent):
        agent.inbox.queue("r1", "3")
        agent.inbox.drop("r1", "3")
        cut = PartialTransferError("connection closed after 1 frames, before END")
        with caplog.at_level(logging.DEBUG, logger=inbox_module.__name__):
            await agent.inbox.on_transfer_error("r1|3|h0", cut)
            await agent.inbox.on_transfer(transfer("r1|3|h1.final"))
        assert ("r1", "3") not in agent.inbox._entries  # no orphan entry for the sweeper
        assert all(r.levelno < logging.WARNING for r in caplog.records)
        assert "ended here" in caplog.records[0].getMessage()
        # Another instance of the same request is unaffected.
        await agent.inbox.on_transfer(transfer("r1|4|kv"))
        assert agent.inbox.queue("r1", "4").qsize() == 1

    run(scenario)


def test_the_memory_of_ended_requests_is_bounded(monkeypatch) -> None:
    monkeypatch.setattr(inbox_module, "ENDED_REMEMBERED", 3)

    async def scenario(agent: Agent):
        for i in range(5):
            agent.inbox.drop(f"r{i}", "0")
        assert list(agent.inbox._ended) == [("r2", "0"), ("r3", "0"), ("r4", "0")]

    run(scenario)


def test_a_finished_relay_lets_handoff_sends_end_then_cuts_what_overstays() -> None:
    from agents.node.pipelines import _settle

    async def scenario():
        quick = asyncio.create_task(asyncio.sleep(0.01, result="sent"))
        stuck = asyncio.create_task(asyncio.sleep(60))
        await _settle([quick, stuck], grace_s=0.2)
        await asyncio.sleep(0)
        assert quick.result() == "sent"
        assert stuck.cancelled()

    asyncio.run(scenario())


def test_a_consumer_that_arrives_after_its_cancel_finds_the_cancel_waiting() -> None:
    """A decode call can reach an agent after the cancel for its request (two connections
    race): it must give up at once, not wait for KV whose sender is gone."""

    async def scenario(agent: Agent):
        live = agent.inbox.queue("r1", "3")
        agent.inbox.cancel("r1")
        assert str(live.get_nowait()) == "cancelled"  # a consumer already waiting is woken
        late = agent.inbox.queue("r1", "4")  # another instance's consumer, after the cancel
        assert str(late.get_nowait()) == "cancelled"
        # a transfer for it that lands first leaves the cancel ahead of it in the inbox
        await agent.inbox.on_transfer(transfer("r1|5|kv"))
        queue = agent.inbox.queue("r1", "5")
        assert str(queue.get_nowait()) == "cancelled"
        assert queue.get_nowait()[0] == "kv"
        assert agent.inbox.queue("r2", "3").empty()  # other requests are not affected
        agent.inbox.fail("r3", "send failed")  # a failed send is not a cancel: not remembered
        assert agent.inbox.queue("r3", "3").empty()

    run(scenario)


def test_a_decode_stream_closed_before_it_started_still_caches_the_kv(monkeypatch) -> None:
    """RLD can finish a short request and close MD's stream before MD's handler even starts:
    MD must still take the KV P sent into its prefix cache, as when the stream closes later."""
    from types import SimpleNamespace

    from agents.node import decode, pipelines

    cached: list[str] = []

    async def fake_cache(agent, inst, req, queue):
        cached.append(req.request_id)

    monkeypatch.setattr(decode, "cache_late_kv", fake_cache)
    inst = SimpleNamespace(instance_id="0")

    def req(rid: str):
        return pipelines.DecodeRequest(rid, [1, 2, 3], 4, None, 0, True)

    async def scenario(agent: Agent):
        await pipelines.main_stream_closed(agent, inst, req("never-started"))
        agent.inbox.queue("started", "0")  # run_main claims its inbox first thing
        await pipelines.main_stream_closed(agent, inst, req("started"))
        agent.inbox.queue("ended", "0")
        agent.inbox.drop("ended", "0")
        await pipelines.main_stream_closed(agent, inst, req("ended"))
        await asyncio.sleep(0)  # let the scheduled task run
        assert cached == ["never-started"]

    run(scenario)
