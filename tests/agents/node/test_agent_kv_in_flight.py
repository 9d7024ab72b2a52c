"""MD counts KV in flight to it in its prefix match (agents/node/inflight.py): the prompt
comparison, and the reservation / dependency / pin bookkeeping driven in process on a real
baton-tiny engine (no agent processes: the agent's fabrics are not started)."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
from agent_node_helpers import make_prompt

from agents.engine import Engine, EngineConfig, SamplingParams, build_baton_tiny
from agents.node.agent import Agent
from agents.node.inflight import as_tokens, block_prefix_len, common_prefix_len
from agents.node.pipelines import (
    DecodeRequest,
    cache_late_kv,
    cancel_local,
    release_main,
    reserve_prefix,
    run_main,
)
from agents.node.settings import AgentSettings
from agents.transfer.records import KVChunk, Transfer

BS = 16


# -- the prompt comparison -------------------------------------------------------------------


def _brute(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize(
    ("a", "b", "common"),
    [
        ([], [], 0),
        ([1, 2, 3], [], 0),
        ([1, 2, 3], [4, 2, 3], 0),
        ([1, 2, 3], [1, 2, 3], 3),
        ([1, 2, 3], [1, 2, 3, 4, 5], 3),
        ([1, 2, 3, 9], [1, 2, 3, 4, 5], 3),
    ],
)
def test_common_prefix_len_small_cases(a, b, common):
    assert common_prefix_len(as_tokens(a), as_tokens(b)) == common
    assert common_prefix_len(as_tokens(b), as_tokens(a)) == common


def test_common_prefix_len_finds_the_first_mismatch_in_any_window():
    rng = random.Random(5)
    base = [rng.randrange(50_000) for _ in range(120_000)]
    a = as_tokens(base)
    assert common_prefix_len(a, a) == len(base)
    # Mismatches at window edges (64, 64 + 256, ...) and inside them.
    for at in (0, 1, 63, 64, 65, 319, 320, 321, 5000, 21_823, 87_359, 87_360, 119_999):
        other = list(base)
        other[at] += 1
        assert common_prefix_len(a, as_tokens(other)) == at, at
        assert common_prefix_len(as_tokens(other), a) == at, at
    for _ in range(50):
        n = rng.randrange(0, 300)
        x = [rng.randrange(3) for _ in range(n)]
        y = x[: rng.randrange(0, n + 1)] + [rng.randrange(3) for _ in range(rng.randrange(40))]
        assert common_prefix_len(as_tokens(x), as_tokens(y)) == _brute(x, y)


def test_block_prefix_len_rounds_down_to_whole_blocks():
    turn1 = list(range(405))
    turn2 = turn1 + [7, 7, 7]
    assert block_prefix_len(as_tokens(turn1), as_tokens(turn2), 16) == 400
    assert block_prefix_len(as_tokens(turn2), as_tokens(turn1), 16) == 400
    assert block_prefix_len(as_tokens(turn1[:15]), as_tokens(turn2), 16) == 0
    assert block_prefix_len(as_tokens(turn1[:16]), as_tokens(turn2), 16) == 16
    assert block_prefix_len(as_tokens(turn1[:400]), as_tokens(turn1[:400]), 16) == 400
    diverged = turn1[:37] + [999] + turn1[38:]
    assert block_prefix_len(as_tokens(diverged), as_tokens(turn1), 16) == 32
    assert block_prefix_len(as_tokens(diverged), as_tokens(turn1), 1) == 37
    assert as_tokens(np.array([[1, 2], [3, 4]])).tolist() == [1, 2, 3, 4]
    with pytest.raises(ValueError):
        block_prefix_len(as_tokens(turn1), as_tokens(turn2), 0)


# -- the agent's bookkeeping, in process --------------------------------------------------------


@pytest.fixture(scope="module")
def prefill_engine() -> Engine:
    """P's engine: computes the KV payloads MD imports (same weights as MD's baton-tiny)."""
    return Engine(build_baton_tiny(0), EngineConfig(block_size=BS, num_blocks=256))


def kv_of(engine: Engine, rid: str, prompt: list[int], start: int) -> bytes:
    engine.prefill(rid, prompt)
    try:
        return engine.export_kv(rid, start, len(prompt))
    finally:
        engine.release(rid)


def transfer_of(rid: str, payload: bytes, length: int, start: int) -> Transfer:
    chunk = KVChunk(start // BS, -(-length // BS), start, length, payload)
    return Transfer(f"{rid}|0|kv", (chunk,), None, len(payload), len(payload), 1, 0.0, 0.0, 0.0)


def run(coro_fn, **settings):
    """Run coro_fn(agent, inst) against an MD agent with one baton-tiny instance "0"."""

    async def main():
        agent = Agent(AgentSettings(block_size=BS, num_blocks=256, **settings))
        try:
            inst = await agent.instances.put("0", "main_decode", "baton-tiny", "baton-tiny", 120)
            await asyncio.wait_for(inst.ready.wait(), 120)
            assert inst.worker is not None, inst.error
            return await asyncio.wait_for(coro_fn(agent, inst), 120)
        finally:
            await agent.close()

    return asyncio.run(main())


async def cache_state(inst, prompt: list[int]) -> dict:
    def read(engine):
        stats = engine.cache.stats()
        return {
            "root_locks": engine.cache.root.lock_ref,
            "pinned_blocks": stats.cached_blocks - engine.cache.evictable_blocks,
            "cached_prefix": engine.cached_prefix_len(prompt),
            "requests": len(engine.requests),
        }

    return await inst.worker.call(read)


def late(rid: str, prompt: list[int], start: int) -> DecodeRequest:
    return DecodeRequest(rid, prompt, 65, SamplingParams(max_tokens=4), start, True)


def assert_clean(agent: Agent) -> None:
    assert agent.kv_flight.incoming == {}
    assert agent.kv_flight.reservations == {}


def test_reserve_counts_kv_in_flight_and_pins_it_once_it_lands(prefill_engine):
    p1 = make_prompt(70, 1)
    p2 = p1 + make_prompt(20, 2)

    async def scenario(agent: Agent, inst):
        assert await reserve_prefix(agent, inst, "t1", p1) == 0
        assert "t1" in agent.kv_flight.incoming
        assert await reserve_prefix(agent, inst, "t2", p2) == 64  # 70 in flight -> 4 blocks
        assert await reserve_prefix(agent, inst, "t2", p2) == 64  # the same reservation
        assert agent.kv_flight.reservations["t2"].depends_on.request_id == "t1"
        assert agent.kv_flight.prefix_hits == 1
        # t1's KV lands first (RLD finished it alone): its import pins t2's 4 blocks.
        await cache_late_kv(
            agent, inst, late("t1", p1, 0), asyncio.Queue(), kv_of(prefill_engine, "t1", p1, 0)
        )
        assert "t1" not in agent.kv_flight.incoming and "t1" not in agent.kv_flight.reservations
        assert len(agent.kv_flight.reservations["t2"].nodes) == 2
        state = await cache_state(inst, p2)
        assert state["cached_prefix"] == 64 and state["pinned_blocks"] == 4
        # Then t2's delta: imported on top, and every pin released exactly once.
        payload = kv_of(prefill_engine, "t2", p2, 64)
        await cache_late_kv(agent, inst, late("t2", p2, 64), asyncio.Queue(), payload)
        assert agent.kv_flight.late_kv_cached == 2
        assert_clean(agent)
        state = await cache_state(inst, p2)
        assert state == {"root_locks": 1, "pinned_blocks": 0, "cached_prefix": 80, "requests": 0}

    run(scenario)


def test_import_waits_for_the_kv_it_counted_on(prefill_engine):
    p1 = make_prompt(100, 3)
    p2 = p1 + make_prompt(30, 4)
    p3 = p2 + make_prompt(10, 5)

    async def scenario(agent: Agent, inst):
        assert await reserve_prefix(agent, inst, "a", p1) == 0
        assert await reserve_prefix(agent, inst, "b", p2) == 96
        assert await reserve_prefix(agent, inst, "c", p3) == 128  # a chain: c counts on b
        assert agent.kv_flight.reservations["c"].depends_on.request_id == "b"
        # The deltas of b and c arrive before a's KV: they wait for it, bounded.
        waiting_c = asyncio.create_task(
            cache_late_kv(
                agent,
                inst,
                late("c", p3, 128),
                asyncio.Queue(),
                kv_of(prefill_engine, "c", p3, 128),
            )
        )
        queue = agent.inbox.queue("b", "0")
        queue.put_nowait(("kv", transfer_of("b", kv_of(prefill_engine, "b", p2, 96), len(p2), 96)))
        req = DecodeRequest("b", p2, 65, SamplingParams(max_tokens=3, ignore_eos=True), 96, False)
        events = []

        async def decode():
            async for event in run_main(agent, inst, req):
                events.append(event)

        waiting_b = asyncio.create_task(decode())
        await asyncio.sleep(0.5)
        assert not waiting_b.done() and not waiting_c.done()
        assert events == []
        await cache_late_kv(
            agent, inst, late("a", p1, 0), asyncio.Queue(), kv_of(prefill_engine, "a", p1, 0)
        )
        await asyncio.wait_for(waiting_b, 60)
        await asyncio.wait_for(waiting_c, 60)
        assert [e["type"] for e in events] == ["token", "token", "done"], events
        assert agent.kv_flight.late_kv_cached == 2
        assert_clean(agent)
        state = await cache_state(inst, p3)
        assert state == {"root_locks": 1, "pinned_blocks": 0, "cached_prefix": 128, "requests": 0}

    run(scenario)


def test_a_prompt_wholly_in_flight_imports_an_empty_delta(prefill_engine):
    p1 = make_prompt(64, 6)

    async def scenario(agent: Agent, inst):
        assert await reserve_prefix(agent, inst, "first", p1) == 0
        assert await reserve_prefix(agent, inst, "again", p1) == 64
        await cache_late_kv(
            agent,
            inst,
            late("first", p1, 0),
            asyncio.Queue(),
            kv_of(prefill_engine, "first", p1, 0),
        )
        queue = agent.inbox.queue("again", "0")
        queue.put_nowait(
            ("kv", transfer_of("again", kv_of(prefill_engine, "again", p1, 64), 64, 64))
        )
        req = DecodeRequest(
            "again", p1, 65, SamplingParams(max_tokens=3, ignore_eos=True), 64, False
        )
        events = [event async for event in run_main(agent, inst, req)]
        assert [e["type"] for e in events] == ["token", "token", "done"], events
        assert_clean(agent)
        assert (await cache_state(inst, p1))["pinned_blocks"] == 0

    run(scenario)


def _dependent_decode(agent, inst, prefill_engine, rid, p2, start):
    queue = agent.inbox.queue(rid, "0")
    queue.put_nowait(
        ("kv", transfer_of(rid, kv_of(prefill_engine, rid, p2, start), len(p2), start))
    )
    req = DecodeRequest(rid, p2, 65, SamplingParams(max_tokens=3, ignore_eos=True), start, False)
    events: list[dict] = []

    async def decode():
        async for event in run_main(agent, inst, req):
            events.append(event)

    return asyncio.create_task(decode()), events


def test_cancelled_kv_in_flight_is_recomputed_for_the_dependent(prefill_engine):
    p1 = make_prompt(80, 7)
    p2 = p1 + make_prompt(12, 8)

    async def scenario(agent: Agent, inst):
        assert await reserve_prefix(agent, inst, "ghost", p1) == 0
        assert await reserve_prefix(agent, inst, "dep", p2) == 80
        task, events = _dependent_decode(agent, inst, prefill_engine, "dep", p2, 80)
        await asyncio.sleep(0.3)
        assert not task.done()
        await cancel_local(agent, "ghost")  # its KV will never land: MD computes it itself
        await asyncio.wait_for(task, 30)
        assert [e["type"] for e in events] == ["token", "token", "done"], events
        assert (agent.kv_flight.recomputed_imports, agent.kv_flight.recomputed_tokens) == (1, 80)
        assert_clean(agent)
        state = await cache_state(inst, p2)
        assert state == {"root_locks": 1, "pinned_blocks": 0, "cached_prefix": 80, "requests": 0}

    run(scenario)


def test_kv_in_flight_that_never_lands_is_recomputed_after_the_timeout(prefill_engine):
    p1 = make_prompt(48, 9)
    p2 = p1 + make_prompt(20, 10)

    async def scenario(agent: Agent, inst):
        assert await reserve_prefix(agent, inst, "stuck", p1) == 0
        assert await reserve_prefix(agent, inst, "dep", p2) == 48
        task, events = _dependent_decode(agent, inst, prefill_engine, "dep", p2, 48)
        await asyncio.wait_for(task, 30)
        assert [e["type"] for e in events] == ["token", "token", "done"], events
        assert (agent.kv_flight.recomputed_imports, agent.kv_flight.recomputed_tokens) == (1, 48)
        assert set(agent.kv_flight.incoming) == {"stuck"}  # the stuck one is still reserved ...
        await cancel_local(agent, "stuck")  # ... until cancelled (or expired)
        assert_clean(agent)
        assert (await cache_state(inst, p2))["pinned_blocks"] == 0

    run(scenario, kv_timeout_s=1.0)


def test_a_dependent_cancelled_while_waiting_ends_at_once(prefill_engine):
    p1 = make_prompt(40, 11)
    p2 = p1 + make_prompt(9, 12)

    async def scenario(agent: Agent, inst):
        assert await reserve_prefix(agent, inst, "slow", p1) == 0
        assert await reserve_prefix(agent, inst, "dep", p2) == 32
        task, events = _dependent_decode(agent, inst, prefill_engine, "dep", p2, 32)
        await asyncio.sleep(0.3)
        await cancel_local(agent, "dep")
        await asyncio.wait_for(task, 30)
        assert events[-1]["type"] == "error" and "reservation dropped" in events[-1]["message"]
        assert set(agent.kv_flight.incoming) == {"slow"} and set(agent.kv_flight.reservations) == {
            "slow"
        }
        # The KV it counted on still lands; its pin for the dropped dependent is not taken.
        await cache_late_kv(
            agent, inst, late("slow", p1, 0), asyncio.Queue(), kv_of(prefill_engine, "slow", p1, 0)
        )
        assert_clean(agent)
        state = await cache_state(inst, p2)
        assert state == {"root_locks": 1, "pinned_blocks": 0, "cached_prefix": 32, "requests": 0}

    run(scenario)


def test_a_dependent_waiting_for_kv_in_flight_says_so_and_then_decodes(prefill_engine):
    """The stream of a request that counted on another request's KV still crossing carries
    keep-alives (``queued``, waiting for kv) every --queued-every-s while it waits: a gateway
    reading it directly sees a busy MD, not a frozen one. Then it decodes as before."""
    p1 = make_prompt(40, 13)
    p2 = p1 + make_prompt(9, 14)

    async def scenario(agent: Agent, inst):
        assert await reserve_prefix(agent, inst, "slow", p1) == 0
        assert await reserve_prefix(agent, inst, "dep", p2) == 32
        task, events = _dependent_decode(agent, inst, prefill_engine, "dep", p2, 32)
        await asyncio.sleep(0.4)
        assert events and {e["type"] for e in events} == {"queued"}
        assert all(e["waiting_for"] == "kv" for e in events)
        await cache_late_kv(
            agent, inst, late("slow", p1, 0), asyncio.Queue(), kv_of(prefill_engine, "slow", p1, 0)
        )
        await asyncio.wait_for(task, 30)
        kinds = [e["type"] for e in events if e["type"] != "queued"]
        assert kinds == ["token", "token", "done"], events
        assert_clean(agent)

    run(scenario, queued_every_s=0.05)


# -- a held decode whose caller leaves as its KV lands, and RLD's release -------------------


async def late_kv_cached(agent: Agent, n: int) -> None:
    """Wait (at most 10 s) until n late imports ran in the background, then check there were n."""
    for _ in range(200):
        if agent.kv_flight.late_kv_cached >= n:
            break
        await asyncio.sleep(0.05)
    assert agent.kv_flight.late_kv_cached == n


def test_a_held_decode_cancelled_as_its_kv_lands_stops_and_caches_the_kv(prefill_engine):
    """RLD closes MD's held stream in the loop turn P's KV lands. The cancellation must win:
    on Python 3.11 `asyncio.wait_for` returned the KV instead, so MD imported it, held the
    request for a handoff that never came (a decode slot and its blocks, for good) and the
    stream's handler never returned. Now the KV stays queued and is cached the late way."""
    prompt = make_prompt(70, 21)

    async def scenario(agent: Agent, inst):
        assert await reserve_prefix(agent, inst, "left", prompt) == 0
        queue = agent.inbox.queue("left", "0")
        events: list[dict] = []

        async def decode():
            async for event in run_main(agent, inst, late("left", prompt, 0)):
                events.append(event)

        task = asyncio.create_task(decode())
        await asyncio.sleep(0.2)  # run_main waits for the KV
        assert not task.done()
        queue.put_nowait(
            ("kv", transfer_of("left", kv_of(prefill_engine, "left", prompt, 0), 70, 0))
        )
        task.cancel()  # the same loop turn
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)
        assert events == []
        await late_kv_cached(agent, 1)
        assert_clean(agent)
        state = await cache_state(inst, prompt)
        assert state == {"root_locks": 1, "pinned_blocks": 0, "cached_prefix": 64, "requests": 0}

    run(scenario)


def test_a_release_caches_the_kv_when_the_decode_call_never_came(prefill_engine):
    """RLD answered alone and its decode call to MD was cut before MD read it: the release
    (POST /v1/pdd/release) caches P's KV from the prompt MD's reservation recorded, and a
    decode call that turns up afterwards ends at once."""
    prompt = make_prompt(50, 22)

    async def scenario(agent: Agent, inst):
        assert await reserve_prefix(agent, inst, "solo", prompt) == 0
        assert release_main(agent, inst, "solo", 0) is True
        assert release_main(agent, inst, "solo", 0) is False  # already released
        await agent.inbox.on_transfer(
            transfer_of("solo", kv_of(prefill_engine, "solo", prompt, 0), 50, 0)
        )
        await late_kv_cached(agent, 1)
        assert_clean(agent)
        assert (await cache_state(inst, prompt))["cached_prefix"] == 48
        events = [e async for e in run_main(agent, inst, late("solo", prompt, 0))]
        assert [e["type"] for e in events] == ["error"]
        assert "already answered by the relay" in events[0]["message"]
        # Nothing reserved for it, or a decode call already has it: nothing to do.
        assert release_main(agent, inst, "unknown", 0) is False
        assert await reserve_prefix(agent, inst, "decoding", prompt) == 48
        agent.inbox.queue("decoding", "0")  # run_main claims its inbox first thing
        assert release_main(agent, inst, "decoding", 0) is False
        with pytest.raises(ValueError, match="beyond the reserved prompt"):
            release_main(agent, inst, "decoding", 64)
        await cancel_local(agent, "decoding")

    run(scenario)
