"""MD's stream after the handoff as a tail (agents/node/tail.py): its decoding outlives the
stream that started it, a reader attaches from a token index, and the request is let go when
nobody reads it for the grace period, when it is cancelled, or kept cached when it finished."""

from __future__ import annotations

import asyncio

from agents.node.tail import Tail, Tails


def _token(index: int) -> dict:
    return {"type": "token", "index": index, "token_id": 60 + index, "role": "md"}


class Decoder:
    """MD's decode loop, fed by hand: tokens from index 5 on, then done."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.closed = False

    async def events(self):
        try:
            while True:
                event = await self.queue.get()
                yield event
                if event["type"] == "done":
                    return
        finally:
            self.closed = True


def _run(coro):
    return asyncio.run(coro)


def _started(request_id: str, grace_s: float):
    """A tail started under a Tails on a hand-fed decoder: (tails, tail, decoder, ended), where
    `ended` gets the cleanup's `finished` flag."""
    tails, decoder, ended = Tails(), Decoder(), []

    async def cleanup(finished: bool) -> None:
        ended.append(finished)

    tail = Tail(request_id, "md-0", grace_s=grace_s)
    tails.start(tail, decoder.events(), cleanup)
    return tails, tail, decoder, ended


async def _collect(stream, n: int | None = None) -> list[dict]:
    out = []
    async for event in stream:
        out.append(event)
        if n is not None and len(out) >= n:
            break
    await stream.aclose()
    return out


def test_a_reader_that_attaches_later_gets_the_tokens_from_its_index_and_done():
    async def go():
        tails, tail, decoder, ended = _started("r1", 5.0)
        for index in (5, 6, 7):
            decoder.queue.put_nowait(_token(index))
        first = await _collect(tail.read(5), 2)  # RLD's stream: token 5, then it lets go
        assert [e["index"] for e in first] == [5, 6]
        decoder.queue.put_nowait(_token(8))
        decoder.queue.put_nowait({"type": "done", "finish_reason": "length"})
        attached = await _collect(tails.get("r1", "md-0").read(6, attach=True))
        assert [e.get("index") for e in attached] == [6, 7, 8, None]
        assert attached[-1]["type"] == "done"
        assert ended == [True] and decoder.closed  # finished: cleanup keeps it cached
        assert tail.attached == 1
        assert tails.to_json() == {"running": 0, "handed_over": 1, "attached": 1, "unread": 0}

    _run(go())


def test_nobody_reads_within_the_grace_period_lets_the_request_go():
    async def go():
        tails, tail, decoder, ended = _started("r2", 0.05)
        decoder.queue.put_nowait(_token(3))
        assert [e["index"] for e in await _collect(tail.read(3), 1)] == [3]
        # The reader left and nobody attached: after the grace period the tail is cancelled.
        for _ in range(100):
            if ended:
                break
            await asyncio.sleep(0.01)
        assert ended == [False] and decoder.closed
        assert tails.counts["unread"] == 1
        # A late reader gets what there was and the error that ended it.
        late = await _collect(tail.read(3))
        assert late[0]["index"] == 3
        assert late[-1]["type"] == "error" and "no reader" in late[-1]["message"]
        # The ended tail is forgotten after another grace period.
        for _ in range(100):
            if tails.get("r2", "md-0") is None:
                break
            await asyncio.sleep(0.01)
        assert tails.get("r2", "md-0") is None and len(tails) == 0

    _run(go())


def test_a_reader_arriving_within_the_grace_period_keeps_it_going():
    async def go():
        tails, tail, decoder, ended = _started("r3", 0.2)
        decoder.queue.put_nowait(_token(2))
        await _collect(tail.read(2), 1)
        await asyncio.sleep(0.05)  # less than the grace period
        reader = tail.read(3, attach=True)
        pending = asyncio.ensure_future(_collect(reader))
        await asyncio.sleep(0.3)  # past the first grace period: a reader is there
        assert not ended
        decoder.queue.put_nowait(_token(3))
        decoder.queue.put_nowait({"type": "done", "finish_reason": "stop"})
        events = await pending
        assert [e.get("index") for e in events] == [3, None]
        assert ended == [True]

    _run(go())


def test_closing_the_tails_cancels_a_running_request():
    async def go():
        tails, tail, decoder, ended = _started("r4", 60.0)
        decoder.queue.put_nowait(_token(1))
        await asyncio.sleep(0.01)
        await tails.close()
        assert ended == [False] and decoder.closed
        # The reader is told why: the agent stops, not that nobody read it.
        events = await _collect(tail.read(0))
        assert events[-1]["type"] == "error"
        assert "agent is stopping" in events[-1]["message"]
        assert "no reader" not in events[-1]["message"]

    _run(go())
