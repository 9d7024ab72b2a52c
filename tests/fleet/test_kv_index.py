"""KV cache events end to end: a radix cache's changes, through the agent's event log and the
agent API, into the prefix index the gateway routes on; gaps, drift and lost state resync."""

from __future__ import annotations

import os
import random

import pytest
from rest_framework.test import APIClient

from agents.engine.radix_cache import RadixCache
from agents.node import kv_events
from agents.node.kv_events import KVEventLog
from fleet import kv_index, services
from fleet.choices import InstanceRole
from fleet.kv_index import HeldBlocks, IndexError_, MemoryIndex, PrefixIndex, parse_batch
from pdd.prefix import prefix_block_hashes

BS = 4


def cache_and_log(iid: str = "7") -> tuple[RadixCache, KVEventLog]:
    cache = RadixCache(BS)
    cache.enable_events()
    return cache, KVEventLog(iid)


def flush(cache: RadixCache, log: KVEventLog) -> None:
    log.record(cache.drain_events())


def deliver(index: PrefixIndex, log: KVEventLog, budget: int = 10**9) -> dict:
    batches = log.take(budget)
    answer = index.apply(
        log.instance_id,
        log.epoch,
        log.summary()["seq"],
        [parse_batch(b, f"batches[{i}]") for i, b in enumerate(batches)],
    )
    if "acked" in answer:
        log.ack(answer["acked"])
    if answer.get("resync"):
        log.resync_wanted = True
    return answer


def cache_hex(cache: RadixCache) -> set[str]:
    return {h.hex() for _, hashes in cache.held_hashes() for h in hashes}


def indexed(index: PrefixIndex, iid: str) -> set[str]:
    return set(index.held(iid))


def random_traffic(index, cache, log, *, seed: int, steps: int, delivered=lambda: None) -> None:
    """Prompts inserted and blocks evicted at random, their events delivered every so often;
    no delivery may need a resync. ``delivered`` runs after each delivery."""
    rng = random.Random(seed)
    for step in range(steps):
        prompt = [rng.randrange(0, 4) for _ in range(rng.randrange(4, 40))]
        cache.insert(prompt, list(range(step * 100, step * 100 + len(prompt) // BS)))
        if rng.random() < 0.4:
            cache.evict(rng.randrange(1, 8))
        flush(cache, log)
        if rng.random() < 0.5:  # the publisher posts every so often, several batches at once
            answer = deliver(index, log)
            assert "resync" not in answer, answer
            delivered()


def test_the_index_holds_exactly_what_the_cache_holds_through_random_traffic():
    cache, log = cache_and_log()
    index = PrefixIndex()

    def same() -> None:
        assert indexed(index, "7") == cache_hex(cache)

    random_traffic(index, cache, log, seed=3, steps=200, delivered=same)
    deliver(index, log)
    assert indexed(index, "7") == cache_hex(cache)
    assert log.summary()["digest"]["blocks"] == len(cache_hex(cache))


def test_the_policy_sees_a_prompts_blocks_in_the_index():
    cache, log = cache_and_log()
    index = PrefixIndex()
    prompt = list(range(1, 41))
    cache.insert(prompt, list(range(10)))
    flush(cache, log)
    deliver(index, log)
    held = index.held("7", extra=["ffffffffffffffff"])
    assert all(h in held for h in prefix_block_hashes(prompt, BS))
    assert "ffffffffffffffff" in held and "0000000000000000" not in held and "xyz" not in held
    assert isinstance(held.union(["0000000000000000"]), HeldBlocks)
    assert "0000000000000000" in held.union(["0000000000000000"])


def test_a_gap_asks_for_a_snapshot_and_the_snapshot_repairs_the_index():
    cache, log = cache_and_log()
    index = PrefixIndex()
    cache.insert(list(range(16)), [1, 2, 3, 4])
    flush(cache, log)
    deliver(index, log)
    cache.insert(list(range(100, 116)), [5, 6, 7, 8])
    flush(cache, log)
    lost = log.take(10**9)
    log.ack(lost[-1]["seq"])  # as if acknowledged, but the index never saw it
    cache.insert(list(range(200, 216)), [9, 10, 11, 12])
    flush(cache, log)
    answer = deliver(index, log)
    assert answer["resync"] and "does not follow" in answer["reason"]
    log.reset(cache.held_hashes())
    answer = deliver(index, log)
    assert "resync" not in answer
    assert indexed(index, "7") == cache_hex(cache)


def test_a_retried_batch_is_applied_once_and_an_index_that_lost_its_state_resyncs():
    cache, log = cache_and_log()
    index = PrefixIndex()
    cache.insert(list(range(16)), [1, 2, 3, 4])
    flush(cache, log)
    batches = log.take(10**9)
    parsed = [parse_batch(b, "b") for b in batches]
    assert "resync" not in index.apply("7", log.epoch, log.seq, parsed)
    assert "resync" not in index.apply("7", log.epoch, log.seq, parsed)  # the answer was lost
    assert indexed(index, "7") == cache_hex(cache)
    fresh = PrefixIndex()  # a restarted control plane: the keep-alive finds nothing
    answer = fresh.apply("7", log.epoch, log.seq, [])
    assert answer["resync"] and answer["acked"] == 0


def test_drift_between_agent_and_index_is_detected_by_the_digest():
    cache, log = cache_and_log()
    index = PrefixIndex()
    cache.insert(list(range(16)), [1, 2, 3, 4])
    flush(cache, log)
    deliver(index, log)
    index.local.entries["7"].blocks.add(12345)  # the index went wrong somehow
    cache.insert(list(range(50, 58)), [5, 6])
    flush(cache, log)
    answer = deliver(index, log)
    assert answer["resync"] and "digest" in answer["reason"]


def test_a_big_cache_goes_in_batches_under_the_post_budget(monkeypatch):
    monkeypatch.setattr(kv_events, "MAX_BLOCKS_PER_BATCH", 100)
    cache, log = cache_and_log()
    index = PrefixIndex()
    for i in range(30):
        cache.insert([i] + list(range(1000, 1000 + 4 * 40 - 1)), list(range(i * 40, i * 40 + 40)))
    flush(cache, log)
    rounds = 0
    while log.summary()["acked"] < log.summary()["seq"] or log.take(1):
        answer = deliver(index, log, budget=250)
        assert "resync" not in answer
        rounds += 1
        if log.summary()["acked"] == log.seq:
            break
    assert rounds > 3
    assert indexed(index, "7") == cache_hex(cache) and len(cache_hex(cache)) == 1200


def test_an_index_away_too_long_gets_a_snapshot_instead_of_a_backlog(monkeypatch):
    monkeypatch.setattr(kv_events, "MAX_PENDING_BLOCKS", 10)
    cache, log = cache_and_log()
    cache.insert(list(range(64)), list(range(16)))
    flush(cache, log)
    assert log.resync_wanted and log.take(10**9) == []


@pytest.mark.parametrize(
    "batch, field",
    [
        ({"seq": 0, "events": []}, "b.seq"),
        ({"seq": 1, "events": {}}, "b.events"),
        ({"seq": 1, "events": [{"type": "x"}]}, "b.events[0].type"),
        ({"seq": 1, "events": [{"type": "stored", "blocks": ["zz"]}]}, "b.events[0].blocks"),
        ({"seq": 1, "events": [{"type": "stored", "blocks": "a"}]}, "b.events[0].blocks"),
        (
            {"seq": 1, "events": [{"type": "removed", "blocks": []}, {"type": "cleared"}]},
            "b.events[1]",
        ),
        ({"seq": 1, "events": [], "digest": {"blocks": -1}}, "b.digest.blocks"),
    ],
)
def test_a_malformed_batch_names_its_field(batch, field):
    with pytest.raises(IndexError_) as err:
        parse_batch(batch, "b")
    assert str(err.value).startswith(field + ":")


def test_memory_index_forgets():
    index = MemoryIndex()
    index.replace("1", "e", 3, {1, 2})
    assert index.state("1") == ("e", 3) and set(index.held("1")) == {1, 2}
    index.forget("1")
    assert index.state("1") is None and not index.held("1")


# -- the agent API -------------------------------------------------------------------------


@pytest.fixture
def md_b(node_b, tiny_model):
    return services.instance_create(
        role=InstanceRole.MAIN_DECODE, node=node_b, served_model=tiny_model, gpu_count=8
    )


@pytest.fixture
def agent_b(node_b):
    token = services.node_rotate_token(node=node_b)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"AgentToken {token}")
    body = {"instances": [], "endpoint": "http://127.0.0.1:9102"}
    assert client.post("/api/v1/agent/register", body, format="json").status_code == 200
    return client


@pytest.fixture
def fresh_index(monkeypatch, settings):
    settings.REDIS_URL = ""
    monkeypatch.setattr(kv_index, "_index", None)
    yield kv_index.prefix_index()
    monkeypatch.setattr(kv_index, "_index", None)


@pytest.mark.django_db
def test_the_api_takes_an_agents_batches_and_answers_per_instance(agent_b, md_b, fresh_index):
    cache, log = cache_and_log(str(md_b.pk))
    prompt = list(range(64))
    cache.insert(prompt, list(range(16)))
    flush(cache, log)
    batches = log.take(10**9)  # closes the open events into a batch: then the summary
    item = {"instance_id": str(md_b.pk), **log.summary(), "batches": batches}
    foreign = {"instance_id": "999999", "epoch": "e", "seq": 0, "batches": []}
    response = agent_b.post(
        "/api/v1/agent/kv-events", {"instances": [item, foreign]}, format="json"
    )
    assert response.status_code == 200, response.content
    answers = response.json()["instances"]
    assert answers[str(md_b.pk)] == {"acked": log.seq}
    assert answers["999999"]["error"] == "not an instance of this node"
    assert set(fresh_index.held(str(md_b.pk))) == set(prefix_block_hashes(prompt, BS))


@pytest.mark.django_db
def test_a_malformed_batch_is_400_naming_the_field_and_the_index_is_untouched(
    agent_b, md_b, fresh_index
):
    bad = {
        "instance_id": str(md_b.pk),
        "epoch": "e1",
        "seq": 1,
        "batches": [{"seq": 1, "events": [{"type": "stored", "blocks": ["nothex!!nothex!!"]}]}],
    }
    response = agent_b.post("/api/v1/agent/kv-events", {"instances": [bad]}, format="json")
    assert response.status_code == 400
    assert "instances[0].batches[0].events[0].blocks" in response.json()
    assert fresh_index.local.state(str(md_b.pk)) is None
    response = agent_b.post("/api/v1/agent/kv-events", {"instances": "x"}, format="json")
    assert response.status_code == 400 and "instances" in response.json()


@pytest.mark.django_db
def test_an_unregistered_node_is_told_to_register(node_b, md_b, fresh_index):
    token = services.node_rotate_token(node=node_b)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"AgentToken {token}")
    response = client.post("/api/v1/agent/kv-events", {"instances": []}, format="json")
    assert response.status_code == 404


@pytest.mark.redis
def test_through_redis_every_process_mirror_reads_only_new_events(settings):
    settings.REDIS_URL = os.environ["REDIS_URL"]
    prefix = f"test-kv-{random.randrange(10**9)}"
    writer = PrefixIndex(settings.REDIS_URL, prefix)
    reader = PrefixIndex(settings.REDIS_URL, prefix)  # another gateway process
    cache, log = cache_and_log("41")
    try:
        cache.insert(list(range(64)), list(range(16)))
        flush(cache, log)
        assert "resync" not in deliver(writer, log)
        reader.sync()
        assert indexed(reader, "41") == cache_hex(cache)
        cache.insert(list(range(1000, 1032)), list(range(16, 24)))
        cache.evict(4)
        flush(cache, log)
        assert "resync" not in deliver(writer, log)
        reader.sync()
        assert indexed(reader, "41") == cache_hex(cache)
        late = PrefixIndex(settings.REDIS_URL, prefix)  # a process started later reloads
        late.sync()
        assert indexed(late, "41") == cache_hex(cache)
        # A gap seen through Redis resyncs as in memory.
        answer = writer.apply("41", log.epoch, log.seq + 5, [parse_batch(
            {"seq": log.seq + 5, "events": []}, "b")])  # fmt: skip
        assert answer["resync"]
    finally:
        writer.forget("41")
        r = writer._redis()
        r.delete(f"{prefix}:kv:stream")


@pytest.mark.redis
def test_through_redis_random_traffic_keeps_set_and_digest_exact(settings):
    """The Redis apply (one script per batch: presence flags, then the adds or removes) keeps
    the set and its digest where the agent's are: a wrong flag would answer "resync"."""
    settings.REDIS_URL = os.environ["REDIS_URL"]
    prefix = f"test-kv-{random.randrange(10**9)}"
    index = PrefixIndex(settings.REDIS_URL, prefix)
    cache, log = cache_and_log("43")
    try:
        random_traffic(index, cache, log, seed=5, steps=120)
        assert "resync" not in deliver(index, log)
        index.sync()
        assert indexed(index, "43") == cache_hex(cache)
        held = index._redis().scard(index._key("43", "blocks"))
        assert held == len(cache_hex(cache)) == log.summary()["digest"]["blocks"]
        # A digest that no longer matches the set is drift: the answer asks for a resync.
        bad = {"seq": log.seq + 1, "events": [], "digest": {"blocks": held + 1, "xor": "0" * 16}}
        assert deliver_raw(index, log, bad)["resync"]
    finally:
        index.forget("43")
        index._redis().delete(f"{prefix}:kv:stream")


def deliver_raw(index: PrefixIndex, log: KVEventLog, batch: dict) -> dict:
    return index.apply(log.instance_id, log.epoch, batch["seq"], [parse_batch(batch, "b")])


def test_a_stream_entry_round_trips_and_an_older_entry_still_reads():
    hashes = (0, 1, 2**64 - 1, 0x0123456789ABCDEF)
    batch = kv_index.Batch(7, True, ((1, hashes), (-1, (5,))), 3, 0xFF)
    assert kv_index.Batch.from_json(batch.to_json()) == batch
    older = '{"seq": 7, "cleared": true, "changes": [[1, [0, 1]], [-1, [5]]], "digest": [3, 255]}'
    assert kv_index.Batch.from_json(older).changes == ((1, (0, 1)), (-1, (5,)))
