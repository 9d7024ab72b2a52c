"""agents/node/pipeline_common.py's keep-alive: a ``queued`` event every interval while a task
runs, closed with the task done; with a limit, a task not done by then is cancelled and the
wait ends in TimeoutError (a decoder's engine behind its model: MD's import and first token,
which at 1,024 streams on two cores went silent past the gateway's 60-s first-token timeout
and failed over, bench/gateway/SCALE.md)."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import pytest

from agents.node.pipeline_common import keep_alive


def test_keep_alives_until_the_task_is_done():
    async def go():
        task = asyncio.ensure_future(asyncio.sleep(0.2, result="ok"))
        async with aclosing(keep_alive(task, 0.03, "engine", limit_s=5.0)) as alive:
            events = [e async for e in alive]
        return events, task.result()

    events, result = asyncio.run(go())
    assert result == "ok" and len(events) >= 2
    assert all(e["type"] == "queued" and e["waiting_for"] == "engine" for e in events)
    assert [e["waited_s"] for e in events] == sorted(e["waited_s"] for e in events)


def test_a_task_past_the_limit_is_cancelled_and_the_wait_times_out():
    async def go():
        task = asyncio.ensure_future(asyncio.sleep(10))
        events = []
        with pytest.raises(TimeoutError):
            async with aclosing(keep_alive(task, 0.02, "engine", limit_s=0.1)) as alive:
                async for event in alive:
                    events.append(event)
        await asyncio.sleep(0)
        return events, task

    events, task = asyncio.run(go())
    assert events and task.cancelled()
    assert all(e["waited_s"] < 0.1 for e in events)  # none past the limit


def test_closing_early_cancels_the_task():
    async def go():
        task = asyncio.ensure_future(asyncio.sleep(10))
        async with aclosing(keep_alive(task, 0.01, "engine")) as alive:
            async for _ in alive:
                break
        return task

    assert asyncio.run(go()).cancelled()
