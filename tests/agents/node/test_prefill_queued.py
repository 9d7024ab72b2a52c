"""P's stream while its engine holds a request in the queue: the stream starts once the engine
has taken the request (a full engine is still a status code), says ``queued`` until the first
token so a busy P is told from a frozen one, names P when the queued prefill fails, and drops
the request from the engine when the caller leaves. In process, with fakes for the engine."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from agents.engine import SamplingParams
from agents.engine.errors import EngineFull
from agents.node.prefill import PddRequest, admit_prefill
from agents.node.prefill_stream import run_prefill
from agents.node.wire import HandoffPlan
from pdd.events import PREFILL_FAILED, ErrorEvent, QueuedEvent, parse_event
from pdd.vocab import Pipeline


def _agent(every: float = 0.05) -> SimpleNamespace:
    return SimpleNamespace(settings=SimpleNamespace(queued_every_s=every, kv_stream_tokens=0))


def _request(rid: str = "r1") -> PddRequest:
    return PddRequest(
        rid, [1, 2, 3], SamplingParams(max_tokens=4), Pipeline.RLD_ONLY, HandoffPlan(), None, None
    )


async def _collect(events, limit: int = 100) -> list:
    out = []
    async for event in events:
        out.append(parse_event(event))
        if len(out) >= limit:
            break
    return out


def test_a_queued_prefill_says_so_until_it_ends_and_a_failure_names_p():
    async def main():
        async def prefill():
            await asyncio.sleep(0.4)
            raise RuntimeError("engine step failed")

        task = asyncio.create_task(prefill())
        return await _collect(run_prefill(_agent(), None, _request(), task))

    events = asyncio.run(main())
    queued, last = events[:-1], events[-1]
    assert len(queued) >= 3 and all(isinstance(e, QueuedEvent) for e in queued)
    waited = [e.waited_s for e in queued]
    assert waited == sorted(waited) and waited[-1] > waited[0]
    assert isinstance(last, ErrorEvent) and last.role == PREFILL_FAILED
    assert "engine step failed" in last.message


def test_a_caller_that_leaves_while_queued_drops_the_prefill():
    async def main():
        dropped = asyncio.Event()

        async def prefill():
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                dropped.set()
                raise

        task = asyncio.create_task(prefill())
        events = run_prefill(_agent(), None, _request(), task)
        first = parse_event(await events.__anext__())
        await events.aclose()
        return first, task, dropped.is_set()

    first, task, dropped = asyncio.run(main())
    assert isinstance(first, QueuedEvent)
    assert task.cancelled() and dropped


class _Worker:
    """An engine worker whose engine refuses (EngineFull) or queues the submission."""

    def __init__(self, refuse: bool) -> None:
        self.refuse = refuse
        self.aborted: list[str] = []
        self.sinks: dict = {}

    def add_sink(self, rid, sink):
        self.sinks[rid] = sink

    def remove_sink(self, rid):
        self.sinks.pop(rid, None)

    async def call(self, fn):
        return fn(self)

    def submit_prefill(self, rid, prompt, sampling):
        if self.refuse:
            raise EngineFull(f"{rid}: queue full")

    def abort(self, rid):
        self.aborted.append(rid)


def test_a_full_engine_refuses_before_the_stream_and_a_queued_one_returns_at_once():
    async def main():
        full = _Worker(refuse=True)
        with pytest.raises(EngineFull):
            await admit_prefill(_agent(), SimpleNamespace(running_worker=full), _request())
        assert full.aborted == ["r1"]  # nothing of it stays in the engine
        queued = _Worker(refuse=False)
        inst = SimpleNamespace(running_worker=queued)
        task = await asyncio.wait_for(admit_prefill(_agent(), inst, _request("r2")), 5)
        # Admitted: the engine holds it, its first token still to come.
        assert not task.done() and "r2" in queued.sinks
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert queued.aborted == ["r2"]

    asyncio.run(main())
