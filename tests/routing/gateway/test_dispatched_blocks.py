"""The gateway counts the prefix blocks it has sent to each MD as held there until MD's next
report, so a session's next turn, sent right after the previous answer, is seen as the hit MD
will serve it as, not as a miss on MD's last heartbeat."""

from __future__ import annotations

import os
import time
import uuid

import pytest

from pdd.policy import (
    ClusterSnapshot,
    InstanceState,
    Pipeline,
    PolicySettings,
    RequestInfo,
    Role,
    WanLinkState,
    decide,
)
from pdd.prefix import prefix_block_hashes
from routing.dispatches import DispatchedBlocks, with_dispatched_blocks
from routing.live import LiveView

BLOCK = 16
TURN_1 = list(range(1, 801))  # 50 blocks
TURN_2 = [*TURN_1, *range(5000, 5040)]  # the next turn: turn 1's context plus 40 new tokens


def view(report_at: float = 100.0, md_cached: frozenset[str] = frozenset()) -> LiveView:
    states = [
        InstanceState("p1", Role.PREFILL, "dc-a"),
        InstanceState("r1", Role.RELAY_DECODE, "dc-a"),
        InstanceState("m1", Role.MAIN_DECODE, "dc-b", cached_prefix_blocks=md_cached),
        InstanceState("m2", Role.MAIN_DECODE, "dc-b"),
    ]
    # 40 Mbit/s: 800 tokens of KV (3.5 MB) take 0.7 s, 40 tokens 35 ms.
    link = WanLinkState(bandwidth_gbps=0.04, rtt_ms=20.0)
    snapshot = ClusterSnapshot.from_instances(states, {"dc-b": link})
    reported = {s.id: (report_at, 32.0) for s in states}
    return LiveView(snapshot=snapshot, reported=reported)


def request(tokens: list[int]) -> RequestInfo:
    return RequestInfo(
        prompt_tokens=len(tokens),
        max_tokens=16,
        prefix_block_hashes=prefix_block_hashes(tokens, BLOCK),
        block_tokens=BLOCK,
    )


SETTINGS = PolicySettings(wan_time_threshold_s=0.5)


def test_a_dispatched_prompt_counts_as_held_on_its_md_until_the_next_report() -> None:
    ledger = DispatchedBlocks()
    v = view(report_at=100.0)
    first = request(TURN_1)
    snap, added = with_dispatched_blocks(v, v.snapshot, ledger, first.prefix_block_hashes)
    assert snap is v.snapshot and added == {}
    assert decide(first, snap, SETTINGS).pipeline == Pipeline.P_RLD_MD  # cold: relayed
    ledger.record("m1", first.prefix_block_hashes, now=time.time())

    second = request(TURN_2)
    snap, added = with_dispatched_blocks(v, v.snapshot, ledger, second.prefix_block_hashes)
    assert added == {"m1": 50}
    decision = decide(second, snap, SETTINGS)
    assert decision.pipeline == Pipeline.P_MD and decision.main_id == "m1"
    assert decision.cached_tokens == 800
    # The view's own snapshot is left as the heartbeats made it.
    assert v.snapshot.main_decode[0].cached_prefix_blocks == frozenset()
    # Only the MD it was sent to holds it.
    assert {s.id: len(s.cached_prefix_blocks) for s in snap.main_decode} == {"m1": 50, "m2": 0}


def test_the_next_report_takes_over_and_a_failed_dispatch_is_forgotten() -> None:
    ledger = DispatchedBlocks(grace_s=2.0)
    hashes = request(TURN_1).prefix_block_hashes
    ledger.record("m1", hashes, now=1_000.0)
    second = request(TURN_2).prefix_block_hashes
    # A report received within the grace may have been built before MD's reservation: still
    # counted. One received later holds the blocks (cache or KV in flight) or they failed.
    for report_at, counted in ((999.0, 50), (1_001.5, 50), (1_002.5, 0)):
        v = view(report_at=report_at)
        _, added = with_dispatched_blocks(v, v.snapshot, ledger, second, now=1_003.0)
        assert added.get("m1", 0) == counted, report_at
    # The report that took over shows the blocks as MD's own: nothing is added, the hit stays.
    v = view(report_at=1_002.5, md_cached=frozenset(hashes))
    snap, added = with_dispatched_blocks(v, v.snapshot, ledger, second, now=1_003.0)
    assert added == {} and snap is v.snapshot
    assert decide(request(TURN_2), snap, SETTINGS).cached_tokens == 800


def test_only_the_request_s_leading_run_is_added_past_what_md_reports() -> None:
    ledger = DispatchedBlocks()
    hashes = request(TURN_1).prefix_block_hashes
    ledger.record("m1", hashes[10:30], now=time.time())  # a gap: blocks 0-9 not dispatched
    v = view(report_at=0.0, md_cached=frozenset(hashes[:5]))
    _, added = with_dispatched_blocks(v, v.snapshot, ledger, hashes)
    assert added == {}  # blocks 5-9 are missing, so nothing past them counts
    v = view(report_at=0.0, md_cached=frozenset(hashes[:10]))
    snap, added = with_dispatched_blocks(v, v.snapshot, ledger, hashes)
    assert added == {"m1": 20}
    assert snap.main_decode[0].cached_prefix_blocks == frozenset(hashes[:30])
    # Past the dispatched run the report's own blocks carry the run on.
    v = view(report_at=0.0, md_cached=frozenset((*hashes[:10], *hashes[30:35])))
    snap, added = with_dispatched_blocks(v, v.snapshot, ledger, hashes)
    assert added == {"m1": 25}
    assert decide(request(TURN_1), snap, SETTINGS).cached_tokens == 35 * BLOCK


def test_dispatches_older_than_the_horizon_are_dropped() -> None:
    ledger = DispatchedBlocks(horizon_s=30.0)
    hashes = request(TURN_1).prefix_block_hashes
    ledger.record("m1", hashes[:10], now=0.0)
    assert ledger.held("m1", hashes, after=-1.0, now=29.0) == 10
    assert ledger.held("m1", hashes, after=-1.0, now=31.0) == 0
    ledger.record("m1", hashes[10:], now=31.0)  # prunes the entries from t=0
    assert len(ledger._blocks["m1"]) == 40
    # Dispatched again: the newer time counts.
    ledger.record("m1", hashes[:1], now=40.0)
    assert ledger.held("m1", hashes, after=35.0, now=41.0) == 1


def test_each_md_keeps_at_most_cap_hashes_the_most_recently_dispatched() -> None:
    ledger = DispatchedBlocks(cap=64)
    old = prefix_block_hashes(list(range(10_000, 10_000 + 60 * BLOCK)), BLOCK)
    new = request(TURN_1).prefix_block_hashes
    ledger.record("m1", old, now=100.0)
    ledger.record("m1", new, now=101.0)
    assert len(ledger._blocks["m1"]) == 64
    assert ledger.held("m1", new, after=0.0, now=102.0) == 50
    # Of the older prompt its leading blocks stay (what a hit is made of).
    assert ledger.held("m1", old, after=0.0, now=102.0) == 14
    assert ledger.held("m1", old[14:], after=0.0, now=102.0) == 0
    ledger.clear()
    assert ledger.held("m1", new, after=0.0) == 0
    with pytest.raises(ValueError, match="cap"):
        DispatchedBlocks(cap=0)


def test_nothing_to_record_or_match_is_a_no_op() -> None:
    ledger = DispatchedBlocks()
    ledger.record(None, ("a",))
    ledger.record("m1", ())
    assert ledger._blocks == {}
    v = view()
    assert with_dispatched_blocks(v, v.snapshot, ledger, ()) == (v.snapshot, {})
    # A snapshot whose hits were measured elsewhere (the simulator) is left alone.
    measured = ClusterSnapshot(main_decode=v.snapshot.main_decode, prefix_hits={"m1": 0})
    ledger.record("m1", ("a",))
    assert with_dispatched_blocks(v, measured, ledger, ("a",)) == (measured, {})


def test_an_unhealthy_md_gets_nothing_added() -> None:
    ledger = DispatchedBlocks()
    hashes = request(TURN_1).prefix_block_hashes
    ledger.record("m1", hashes, now=time.time())
    v = view(report_at=0.0)
    sick = ClusterSnapshot(
        prefill=v.snapshot.prefill,
        main_decode=(InstanceState("m1", Role.MAIN_DECODE, "dc-b", healthy=False),),
        wan_links=v.snapshot.wan_links,
    )
    assert with_dispatched_blocks(v, sick, ledger, hashes) == (sick, {})


def test_a_ledger_whose_redis_is_unreachable_counts_its_own_dispatches(caplog) -> None:
    ledger = DispatchedBlocks(redis_url="redis://127.0.0.1:1/0")  # nothing listens on port 1
    assert ledger.shared
    hashes = request(TURN_1).prefix_block_hashes
    ledger.record("m1", hashes, now=time.time())
    v = view(report_at=0.0)
    _, added = with_dispatched_blocks(v, v.snapshot, ledger, request(TURN_2).prefix_block_hashes)
    assert added == {"m1": 50}
    assert "counting this process's dispatches only" in caplog.text
    assert not ledger._use_redis()


@pytest.mark.redis
def test_gateway_processes_share_the_dispatched_blocks_through_redis() -> None:
    # Two ledgers on one Redis stand for two gateway worker processes.
    prefix = f"baton:test-dispatched-blocks:{uuid.uuid4().hex}"
    url = os.environ["REDIS_URL"]
    first = DispatchedBlocks(redis_url=url, prefix=prefix)
    second = DispatchedBlocks(redis_url=url, prefix=prefix)
    now = time.time()
    hashes = request(TURN_1).prefix_block_hashes
    first.record("m1", hashes, now=now)
    assert first.flush()  # its writer thread has sent it (the request did not wait for it)
    # The other process sees the first one's dispatch and routes the next turn to MD.
    v = view(report_at=now - 5.0)
    snap, added = with_dispatched_blocks(v, v.snapshot, second, request(TURN_2).prefix_block_hashes)
    assert added == {"m1": 50}
    assert decide(request(TURN_2), snap, SETTINGS).pipeline == Pipeline.P_MD
    # MD's next report, after the grace, takes over.
    v = view(report_at=now + second.grace_s + 0.5)
    assert with_dispatched_blocks(v, v.snapshot, second, hashes)[1] == {}
    # Re-dispatching moves a hash forward in time, never back.
    second.record("m1", hashes[:1], now=now - 10.0)
    assert second.held("m1", hashes[:1], after=now - 1.0) == 1
    # Horizon and cap hold in Redis too.
    short = DispatchedBlocks(horizon_s=1.0, redis_url=url, prefix=prefix, cap=8)
    short.record("m1", hashes[:4], now=now + 5.0)
    assert short.held("m1", hashes, after=0.0, now=now + 5.5) == 4
    short.record("m1", hashes[4:20], now=now + 5.2)
    # The older prompt goes first, then the newer one's deepest blocks.
    assert short.held("m1", hashes, after=0.0, now=now + 5.5) == 0
    assert short.held("m1", hashes[4:], after=0.0, now=now + 5.5) == 8
    for ledger in (first, second, short):
        ledger.clear()
    assert first.held("m1", hashes, after=0.0) == 0


@pytest.mark.redis
def test_hashes_of_unequal_width_are_recorded_through_redis_too() -> None:
    # Prompts' hashes are one width (one script call); any others take the plain commands.
    url = os.environ["REDIS_URL"]
    ledger = DispatchedBlocks(redis_url=url, prefix=f"baton:test-db-width:{uuid.uuid4().hex}")
    now = time.time()
    try:
        ledger.record("m1", ["a", "bb", "ccc"], now=now)
        ledger.record("m2", ["0123456789abcdef", "fedcba9876543210"], now=now)
        assert ledger.held("m1", ["a", "bb", "ccc", "d"], after=now - 1.0, now=now) == 3
        assert ledger.held("m2", ["0123456789abcdef", "fedcba9876543210"], after=now - 1.0) == 2
        ledger._blocks.clear()  # the answers above came from Redis, not this process's copy
        assert ledger.held("m2", ["0123456789abcdef"], after=now - 1.0) == 1
    finally:
        ledger._redis.delete(f"{ledger.prefix}:m1", f"{ledger.prefix}:m2")


def test_a_shared_ledger_keeps_its_own_dispatches_for_when_redis_fails() -> None:
    # Shared, this process logs its dispatches by prompt; Redis failing later (here: down
    # from the start, so nothing reaches it) turns the log into the per-block counts, with
    # the same horizon, cap and forward-only times as the in-memory ledger.
    now = time.time()
    hashes = [f"{i:016x}" for i in range(40)]
    ledger = DispatchedBlocks(redis_url="redis://127.0.0.1:1/0", cap=16, horizon_s=30.0)
    ledger.record("m1", hashes[:8], now=now - 60.0)  # past the horizon by the next record
    ledger.record("m1", hashes[8:20], now=now)
    ledger.record("m1", hashes[20:30], now=now + 1.0)
    ledger.record("m1", hashes[8:10], now=now - 5.0)  # re-dispatched: never back in time
    assert len(ledger._log["m1"]) <= 3
    assert ledger.held("m1", hashes[:8], after=0.0, now=now + 1.0) == 0
    assert ledger.held("m1", hashes[8:10], after=now - 1.0, now=now + 1.0) == 2
    assert ledger.held("m1", hashes[20:30], after=0.0, now=now + 1.0) == 10
    # The cap keeps the newest prompt whole and drops the older one's deepest blocks first.
    assert ledger.held("m1", hashes[8:20], after=0.0, now=now + 1.0) == 6
    assert not ledger._log  # replayed into the per-block map
    ledger.clear()
    assert ledger.held("m1", hashes, after=0.0) == 0


@pytest.mark.redis
def test_a_lookup_reads_this_processs_own_write_even_before_it_is_sent() -> None:
    """record() leaves the Redis write to a writer thread; a lookup of the same process on the
    same MD waits for it, so the next turn sees the last one's dispatch at once."""
    url = os.environ["REDIS_URL"]
    ledger = DispatchedBlocks(redis_url=url, prefix=f"baton:test-db-own:{uuid.uuid4().hex}")
    now = time.time()
    hashes = [f"{i:016x}" for i in range(4096)]
    try:
        for turn in range(5):
            ledger.record(f"m{turn}", hashes, now=now)
            assert ledger.held(f"m{turn}", hashes, after=now - 1.0, now=now) == 4096
        assert ledger.flush()
        assert not ledger._pending and ledger.dropped == 0
    finally:
        ledger.clear()
        assert ledger.held("m0", hashes, after=0.0) == 0


def test_writes_past_the_pending_limit_are_dropped_counted_and_said(monkeypatch, caplog):
    # Redis not keeping up: the dispatch stays in this process's log, is not shared, and the
    # operator is told (once a minute).
    from routing import dispatches

    monkeypatch.setattr(dispatches, "WRITES_PENDING_MAX", 0)
    ledger = DispatchedBlocks(redis_url="redis://127.0.0.1:1/0")
    hashes = [f"{i:016x}" for i in range(8)]
    now = time.time()
    ledger.record("m1", hashes, now=now)
    ledger.record("m1", hashes, now=now)
    assert ledger.dropped == 2 and not ledger._pending
    assert "dispatches not shared so far" in caplog.text
    assert ledger.held("m1", hashes, after=now - 1.0, now=now) == 8  # from the log
