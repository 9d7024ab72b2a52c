"""The radix cache's KV cache events: what entered and left, named by the gateway's chain
hashes, so a subscriber replaying them holds exactly the cache's blocks."""

from __future__ import annotations

import random

from agents.engine.radix_cache import RadixCache, RemovedEvent, StoredEvent
from pdd.prefix import chain_hashes, prefix_block_hashes

BS = 4


def held_by_replay(events, held: set[bytes] | None = None) -> set[bytes]:
    held = set() if held is None else held
    for event in events:
        if isinstance(event, StoredEvent):
            held.update(event.hashes)
        else:
            assert isinstance(event, RemovedEvent)
            held.difference_update(event.hashes)
    return held


def all_hashes(cache: RadixCache) -> set[bytes]:
    return {h for _, hashes in cache.held_hashes() for h in hashes}


def test_stored_blocks_are_named_as_the_gateway_names_the_prompt():
    cache = RadixCache(BS)
    cache.enable_events()
    prompt = list(range(1, 19))  # 4 whole blocks and 2 tokens
    cache.insert(prompt, [10, 11, 12, 13])
    (event,) = cache.drain_events()
    assert isinstance(event, StoredEvent) and event.parent == b""
    assert [h.hex() for h in event.hashes] == list(prefix_block_hashes(prompt, BS))
    # A follow-up turn stores only its new blocks, chained on the shared prefix's last one.
    follow = prompt[:16] + [50, 51, 52, 53, 54, 55, 56, 57]
    cache.insert(follow, [10, 11, 12, 13, 14, 15])
    (event,) = cache.drain_events()
    assert event.parent == bytes.fromhex(prefix_block_hashes(prompt, BS)[-1])
    assert [h.hex() for h in event.hashes] == list(prefix_block_hashes(follow, BS)[4:])
    assert cache.drain_events() == []


def test_a_split_edge_keeps_its_names_and_an_eviction_removes_them():
    cache = RadixCache(BS)
    cache.enable_events()
    a = list(range(100, 116))
    b = a[:8] + list(range(200, 208))  # diverges inside a's edge: the edge splits
    cache.insert(a, [1, 2, 3, 4])
    cache.insert(b, [1, 2, 5, 6])
    events = cache.drain_events()
    assert held_by_replay(events) == all_hashes(cache)
    assert {h.hex() for h in all_hashes(cache)} == set(prefix_block_hashes(a, BS)) | set(
        prefix_block_hashes(b, BS)
    )
    released = cache.evict(2)
    assert sorted(released) in ([3, 4], [5, 6])
    (removed,) = cache.drain_events()
    assert isinstance(removed, RemovedEvent) and len(removed.hashes) == 2
    assert held_by_replay(events + [removed]) == all_hashes(cache)


def test_replayed_events_equal_the_cache_through_random_inserts_and_evictions():
    rng = random.Random(7)
    cache = RadixCache(BS)
    cache.enable_events()
    held: set[bytes] = set()
    prompts: list[list[int]] = []
    next_block = 0
    for _ in range(300):
        if prompts and rng.random() < 0.6:
            base = rng.choice(prompts)
            cut = rng.randrange(0, len(base) + 1)
            prompt = base[:cut] + [rng.randrange(0, 5) for _ in range(rng.randrange(1, 20))]
        else:
            prompt = [rng.randrange(0, 5) for _ in range(rng.randrange(1, 30))]
        prompts.append(prompt)
        n = len(prompt) // BS
        blocks = list(range(next_block, next_block + n))
        next_block += n
        cache.insert(prompt, blocks)
        if rng.random() < 0.3:
            cache.evict(rng.randrange(1, 6))
        held_by_replay(cache.drain_events(), held)
        assert held == all_hashes(cache)
    assert len(held) == cache.stats().cached_blocks


def test_enabling_events_on_a_warm_cache_records_what_it_holds():
    cache = RadixCache(BS)
    cache.insert(list(range(12)), [1, 2, 3])
    cache.enable_events()
    assert held_by_replay(cache.drain_events()) == set(chain_hashes(b"", list(range(12)), BS))


def test_a_cache_without_events_records_nothing():
    cache = RadixCache(BS)
    cache.insert(list(range(12)), [1, 2, 3])
    cache.evict(3)
    assert cache.drain_events() == []
