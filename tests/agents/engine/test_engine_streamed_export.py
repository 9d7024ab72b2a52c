"""The engine worker's streamed export (agents/node/worker.py ``watch_export``): a request's
KV handed over in whole-block pieces as its chunked prefill computes it; the pieces and the
rest taken at the end join into exactly the KV of one export of the same range."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from agents.engine import Engine, SamplingParams
from agents.engine.kv_codec import join_payloads
from agents.node.worker import EngineWorker


def _on_worker(engine, scenario):
    """Run ``scenario(worker, first)`` on a worker over ``engine``; ``first`` resolves with
    request "r"'s first output. The worker is stopped after."""

    async def main():
        loop = asyncio.get_running_loop()
        worker = EngineWorker(engine, loop, "p")
        first = loop.create_future()
        worker.add_sink("r", lambda out: first.done() or first.set_result(out))
        try:
            return await scenario(worker, first)
        finally:
            worker.stop()
            worker.join(5)

    return asyncio.run(main())


def test_pieces_come_as_prefill_computes_them_and_join_into_the_whole(tiny, engine_config):
    config = replace(engine_config, max_batch_tokens=16)  # one block a forward
    prompt = tiny.tokenizer.encode("streamed export " * 12)[:70]  # 4 whole blocks + 6 tokens

    pieces: list[tuple[int, int, bytes]] = []

    async def scenario(worker, first):
        # Registered right after the submission (as P's reservation answers while the
        # prefill is queued): every piece comes from the steps.
        submitted = worker.call(
            lambda e: e.submit_prefill("r", prompt, SamplingParams(max_tokens=4))
        )
        on = worker.watch_export("r", 16, 32, lambda a, b, p: pieces.append((a, b, p)))
        await submitted
        assert await on == 16
        await first
        await asyncio.sleep(0.05)  # the last piece's call_soon_threadsafe

        def rest(engine):
            start = worker.take_export_watch("r")
            return (
                start,
                engine.export_kv("r", start, len(prompt)),
                engine.export_kv("r", 16, len(prompt)),
            )

        start, tail, whole = await worker.call(rest)
        await worker.call(lambda e: e.release("r"))
        return start, tail, whole

    start, tail, whole = _on_worker(Engine(tiny, config), scenario)
    ranges = [(a, b) for a, b, _ in pieces]
    # From token 16 (MD's cached prefix), at least 32 tokens a piece, whole blocks only.
    # 16-token forwards: 16..48 after the second forward past 16 (32 tokens), 48..? needs 32
    # more, and the prompt (70) ends first: the rest goes at the end.
    assert ranges == [(16, 48)], ranges
    assert start == 48
    assert all(b % 16 == 0 for _, b in ranges)
    assert join_payloads([p for _, _, p in pieces] + [tail]) == whole


def test_a_watch_registered_after_prefill_sends_what_is_computed_at_once(tiny, engine_config):
    prompt = tiny.tokenizer.encode("late reservation " * 10)[:50]

    pieces: list[tuple[int, int]] = []

    async def scenario(worker, first):
        await worker.call(lambda e: e.submit_prefill("r", prompt, SamplingParams(max_tokens=4)))
        await first
        nxt = await worker.watch_export("r", 0, 16, lambda a, b, p: pieces.append((a, b)))
        await asyncio.sleep(0.05)
        taken = await worker.call(lambda e: worker.take_export_watch("r"))
        none = await worker.call(lambda e: worker.take_export_watch("r"))
        await worker.call(lambda e: e.release("r"))
        return nxt, taken, none

    nxt, taken, none = _on_worker(Engine(tiny, engine_config), scenario)
    assert pieces == [(0, 48)] and nxt == taken == 48
    assert none is None  # taken once
