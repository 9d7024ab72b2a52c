"""The agent's ledger of what each recent request streamed to its caller."""

from __future__ import annotations

import asyncio

import pytest

from agents.node.served import CLOSED, DONE, FAILED, ServedLedger


async def _events(*kinds: str):
    for i, kind in enumerate(kinds):
        if kind == "token":
            yield {"type": "token", "index": i, "token_id": 65}
        elif kind == "done":
            yield {"type": "done", "finish_reason": "length"}
        else:
            yield {"type": "error", "message": "boom"}


def _drain(ledger: ServedLedger, rid: str, events, take: int | None = None) -> None:
    async def go() -> None:
        stream = ledger.count(rid, events)
        n = 0
        async for _ in stream:
            n += 1
            if take is not None and n >= take:
                break
        await stream.aclose()

    asyncio.run(go())


def test_counts_tokens_and_how_the_stream_ended():
    ledger = ServedLedger()
    _drain(ledger, "a", _events("token", "token", "token", "done"))
    _drain(ledger, "b", _events("token", "error"))
    _drain(ledger, "c", _events("token", "token", "token", "done"), take=2)
    a, b, c = ledger.get("a"), ledger.get("b"), ledger.get("c")
    assert (a.tokens, a.state, a.finish_reason) == (3, DONE, "length")
    assert (b.tokens, b.state) == (1, FAILED)
    assert (c.tokens, c.state) == (2, CLOSED)  # the caller went away after two tokens
    assert c.ended_at is not None
    assert ledger.get("z") is None


def test_keeps_the_newest_requests_only():
    ledger = ServedLedger(capacity=2)
    for rid in ("a", "b", "c"):
        _drain(ledger, rid, _events("token", "done"))
    assert ledger.get("a") is None
    assert ledger.get("b") is not None and ledger.get("c") is not None
    assert len(ledger) == 2


def test_forgets_requests_that_ended_long_ago():
    ledger = ServedLedger(horizon_s=60)
    _drain(ledger, "old", _events("token", "done"))
    ledger.get("old").ended_at -= 61
    _drain(ledger, "new", _events("token", "done"))
    assert ledger.get("old") is None and ledger.get("new") is not None


def test_rejects_a_bad_size():
    with pytest.raises(ValueError):
        ServedLedger(capacity=0)
