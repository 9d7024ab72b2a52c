"""Tokens that arrive from P in one read leave the gateway in one write: each still its own
server-sent event, in order, with its own logprobs; a failure in the middle of such a burst
does not lose the tokens before it."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from routing.gateway import run as gw_run
from routing.gateway import runner, views
from tests.routing.gateway.test_exactly_once_records import prepared  # noqa: F401 - fixture

pytestmark = pytest.mark.django_db(transaction=True)


def _events(chunk: bytes) -> list[dict]:
    lines = chunk.decode().split("\n\n")
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


def _token(i: int, token: int) -> dict:
    return {"type": "token", "index": i, "token_id": token, "role": "md"}


DONE = {"type": "done", "finish_reason": "length", "stats": {"cached_tokens": 0}}


def test_run_events_yields_each_reads_events_together(monkeypatch):
    lines = [json.dumps(_token(i, t)).encode() + b"\n" for i, t in enumerate(b"hello")]
    done = json.dumps(DONE).encode() + b"\n"
    reads = [
        b"".join(lines[:3]),  # three tokens in one read
        lines[3][:10],  # a line cut by the network...
        lines[3][10:] + lines[4],  # ...completed in the next read, with one more
        done,
    ]

    async def body():
        for data in reads:
            yield data

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body())

    monkeypatch.setattr(runner, "_client", httpx.AsyncClient(transport=httpx.MockTransport(answer)))

    async def collect() -> list[list[dict]]:
        return [batch async for batch in runner.run_events("http://agent/v1/pdd/generate", {})]

    batches = asyncio.run(collect())
    assert [[e.get("index") for e in b] for b in batches] == [[0, 1, 2], [3, 4], [None]]
    assert batches[-1][0]["type"] == "done"


def test_a_burst_of_tokens_is_one_write_of_one_event_per_token(prepared, monkeypatch):  # noqa: F811
    async def events(url, plan):
        yield [_token(i, t) for i, t in enumerate(b"hel")]  # one read: three tokens
        yield [_token(3, ord("l")), _token(4, ord("o")), DONE]

    monkeypatch.setattr(gw_run, "run_events", events)

    async def client() -> list[bytes]:
        chunks = [chunk async for chunk in views.stream_body(prepared("cmpl-burst"))]
        await views.drain_pending_records()
        return chunks

    chunks = asyncio.run(client())
    first, second = _events(chunks[0]), _events(chunks[1])
    assert [e["choices"][0]["text"] for e in first] == ["h", "e", "l"]
    assert [e["choices"][0]["text"] for e in second] == ["l", "o"]
    texts = [e["choices"][0]["text"] for c in chunks for e in _events(c) if e["choices"]]
    assert "".join(texts) == "hello"
    assert chunks[-1].endswith(b"data: [DONE]\n\n")


def test_one_event_at_a_time_still_streams_one_write_each(prepared):  # noqa: F811
    # The fixture's agent yields single events (a batch of one each).
    async def client() -> list[bytes]:
        chunks = [chunk async for chunk in views.stream_body(prepared("cmpl-single"))]
        await views.drain_pending_records()
        return chunks

    chunks = asyncio.run(client())
    assert [len(_events(c)) for c in chunks[:5]] == [1, 1, 1, 1, 1]


def test_tokens_before_a_failure_in_the_same_burst_reach_the_client(prepared, monkeypatch):  # noqa: F811
    async def events(url, plan):
        yield [_token(0, ord("o")), _token(1, ord("k")), {"type": "error", "message": "MD died"}]

    monkeypatch.setattr(gw_run, "run_events", events)
    delivered: list[list[int]] = []

    async def client() -> list[bytes]:
        p = prepared("cmpl-fail")
        run = gw_run.Run(p)

        async def recover(exc, tokens, remaining):
            delivered.append(tokens)
            return False  # no other path: the error reaches the caller

        pieces: list[str] = []
        with pytest.raises(runner.AgentRunError, match="MD died"):
            async for batch in run.deltas(recover):
                pieces.extend(piece for piece, _ in batch)
        return pieces

    assert asyncio.run(client()) == ["o", "k"]
    assert delivered == [[ord("o"), ord("k")]]


def _texts(chunks: list[bytes]) -> list[list[str]]:
    return [[e["choices"][0]["text"] for e in _events(c) if e["choices"]] for c in chunks]


def _paced(word: bytes, gap_s: float, closed: list | None = None):
    async def events(url, plan, source="prefill"):
        try:
            for i, t in enumerate(word):
                await asyncio.sleep(gap_s)
                yield [_token(i, t)]
            yield [DONE]
        finally:
            if closed is not None:
                closed.append(True)

    return events


def test_under_load_chunks_wait_for_the_interval_and_carry_several_tokens(
    prepared,  # noqa: F811
    monkeypatch,
    settings,
):
    settings.BATON_GATEWAY_COALESCE_FROM = 0  # every stream counts as "under load"
    settings.BATON_GATEWAY_STREAM_INTERVAL_S = 0.05
    monkeypatch.setattr(gw_run, "run_events", _paced(b"coalesced!", 0.01))

    async def client() -> list[bytes]:
        chunks = [chunk async for chunk in views.stream_body(prepared("cmpl-load"))]
        await views.drain_pending_records()
        return chunks

    from routing.gateway import coalesce

    writes = coalesce.stats.writes_total
    texts = _texts(asyncio.run(client()))
    token_chunks = [t for t in texts if t and any(t)]
    assert "".join("".join(t) for t in texts) == "coalesced!"
    # Ten tokens 10 ms apart, chunks held 50 ms: several tokens per write, in order.
    assert len(token_chunks) < 10
    assert max(len(t) for t in token_chunks) >= 2
    assert coalesce.stats.writes_total - writes == len(token_chunks) - 1  # the first: with P's
    assert coalesce.stats.open == 0


def test_at_low_load_every_read_is_its_own_write(prepared, monkeypatch, settings):  # noqa: F811
    settings.BATON_GATEWAY_COALESCE_FROM = 10_000
    settings.BATON_GATEWAY_STREAM_INTERVAL_S = 0.05
    monkeypatch.setattr(gw_run, "run_events", _paced(b"per-token", 0.005))

    async def client() -> list[bytes]:
        chunks = [chunk async for chunk in views.stream_body(prepared("cmpl-low"))]
        await views.drain_pending_records()
        return chunks

    texts = _texts(asyncio.run(client()))
    assert [t for t in texts if t and any(t)][:9] == [[c] for c in "per-token"]


def test_a_client_leaving_under_load_closes_the_agents_stream(prepared, monkeypatch, settings):  # noqa: F811
    settings.BATON_GATEWAY_COALESCE_FROM = 0
    settings.BATON_GATEWAY_STREAM_INTERVAL_S = 0.02
    closed: list = []
    monkeypatch.setattr(gw_run, "run_events", _paced(b"x" * 200, 0.005, closed))

    async def client() -> None:
        body = views.stream_body(prepared("cmpl-leave"))
        got = 0
        async for _ in body:
            got += 1
            if got == 3:
                break
        await body.aclose()
        await views.drain_pending_records()

    asyncio.run(client())
    assert closed == [True]
    from routing.gateway import coalesce

    assert coalesce.stats.open == 0
