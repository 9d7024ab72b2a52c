"""Radix prefix cache at block granularity (block size 2 keeps the token lists short)."""

from __future__ import annotations

from agents.engine import RadixCache


def test_empty_cache_matches_nothing() -> None:
    cache = RadixCache(block_size=2)
    match = cache.match_prefix([1, 2, 3])
    assert (match.blocks, match.matched_tokens, match.node) == ([], 0, cache.root)


def test_insert_caches_whole_blocks_only_and_match_returns_them() -> None:
    cache = RadixCache(block_size=2)
    result = cache.insert([1, 2, 3, 4, 5], [10, 11, 12])  # 5 tokens: the 3rd block is partial
    assert (result.duplicates, result.new_blocks) == ([], 2)
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).blocks == [10, 11]
    assert cache.match_prefix([1, 2, 3, 9]).blocks == [10]
    assert cache.match_prefix([1, 2, 3]).matched_tokens == 2
    assert cache.stats().cached_blocks == 2


def test_match_prefix_does_not_mutate() -> None:
    cache = RadixCache(block_size=2)
    cache.insert([1, 2, 3, 4], [10, 11])
    cache.insert([5, 6], [12])
    before = cache.stats()
    cache.match_prefix([1, 2, 3, 4])  # would make [1..4] most recent if it touched LRU
    assert cache.stats() == before
    assert cache.evict(1) == [10, 11]  # still the least recently inserted


def test_insert_returns_duplicates_for_already_cached_blocks() -> None:
    cache = RadixCache(block_size=2)
    cache.insert([1, 2, 3, 4], [10, 11])
    result = cache.insert([1, 2, 3, 4, 5, 6], [20, 21, 22])
    assert (result.duplicates, result.new_blocks) == ([20, 21], 1)
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).blocks == [10, 11, 22]
    # Re-inserting the cache's own blocks is not a duplicate.
    assert cache.insert([1, 2, 3, 4], [10, 11]).duplicates == []


def test_divergent_sequences_split_the_shared_edge() -> None:
    cache = RadixCache(block_size=2)
    cache.insert([1, 2, 3, 4, 5, 6], [10, 11, 12])
    cache.insert([1, 2, 7, 8], [10, 13])
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).blocks == [10, 11, 12]
    assert cache.match_prefix([1, 2, 7, 8]).blocks == [10, 13]
    assert cache.stats().cached_blocks == 4


def test_locked_path_survives_eviction_under_pressure() -> None:
    cache = RadixCache(block_size=2)
    cache.insert([1, 2, 3, 4], [10, 11])
    cache.insert([5, 6, 7, 8], [12, 13])
    match = cache.match_prefix([1, 2, 3, 4])
    cache.lock(match.node)
    assert cache.evict(100) == [12, 13]  # asks for more than exists: only unlocked leaves go
    assert cache.match_prefix([1, 2, 3, 4]).blocks == [10, 11]
    assert cache.stats().locked_blocks == 2
    cache.unlock(match.node)
    assert cache.evict(1) == [10, 11]
    assert cache.stats().cached_blocks == 0


def test_lock_on_a_partial_match_protects_the_matched_blocks_after_a_split() -> None:
    cache = RadixCache(block_size=2)
    cache.insert([1, 2, 3, 4], [10, 11])
    match = cache.match_prefix([1, 2, 9, 9])
    assert match.blocks == [10]
    cache.lock(match.node)
    cache.insert([1, 2, 5, 6], [10, 14])  # splits [1..4] after its first block
    assert cache.evict(100) == [14]  # [1, 2] and [3, 4] are on the locked path
    cache.unlock(match.node)
    assert sorted(cache.evict(100)) == [10, 11]


def test_eviction_is_least_recently_used_first_and_lock_refreshes() -> None:
    cache = RadixCache(block_size=2)
    cache.insert([1, 2], [10])
    cache.insert([3, 4], [11])
    cache.insert([5, 6], [12])
    node = cache.match_prefix([1, 2]).node
    cache.lock(node)  # using [1, 2] makes it the most recent
    cache.unlock(node)
    assert cache.evict(1) == [11]
    assert cache.evict(1) == [12]
    assert cache.evict(1) == [10]


def test_evicting_a_leaf_exposes_its_parent() -> None:
    cache = RadixCache(block_size=2)
    cache.insert([1, 2, 3, 4], [10, 11])
    cache.insert([1, 2, 5, 6], [10, 12])
    assert sorted(cache.evict(3)) == [10, 11, 12]


def test_stats_count_recorded_lookups() -> None:
    cache = RadixCache(block_size=2)
    cache.record_lookup(queried_tokens=10, matched_tokens=0)
    cache.record_lookup(queried_tokens=10, matched_tokens=8)
    stats = cache.stats()
    assert (stats.lookups, stats.hits, stats.queried_tokens, stats.matched_tokens) == (2, 1, 20, 8)
    assert stats.hit_rate == 0.4
