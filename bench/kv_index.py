"""The prefix index at a real main decoder's size: 1.5M cached blocks (an H200's ~100 GB of KV
at ~4 KB per token, blocks of 16 tokens), published as KV cache events and routed on.

The scenario, fixed before the first run: one MD instance whose radix cache receives
sessions of 64K-token contexts (4,096 blocks each) until it holds 1.5M blocks; its events go
through the agent's event log (agents/node/kv_events.py) and the batch parser of the API into
the index, in memory and (when --redis URL is given) in Redis with a second process-like
mirror reading the stream. Then the policy's lookup (pdd.policy.prefix_hit_tokens on the
index's view) for 64K-token prompts that hit 0%, 50% and 100% of a cached session, timed over
2,000 lookups each (median and p99), and the bytes per block of the in-memory index.

    python -m bench.kv_index [--blocks 1500000] [--redis redis://127.0.0.1:6379/0]

Writes bench/kv_index_summary.json (raw timings under var/bench-kv-index/).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

import django  # noqa: E402

django.setup()

from agents.engine.radix_cache import RadixCache  # noqa: E402
from agents.node.kv_events import KVEventLog  # noqa: E402
from fleet.kv_index import PrefixIndex, parse_batch  # noqa: E402
from pdd.policy import InstanceState, RequestInfo, prefix_hit_tokens  # noqa: E402
from pdd.prefix import prefix_block_hashes  # noqa: E402

HERE = Path(__file__).resolve().parent
BS = 16
SESSION_TOKENS = 65_536
LOOKUPS = 2_000


def say(message: str) -> None:
    print(f"[kv-index] {message}", file=sys.stderr, flush=True)


def fill(cache: RadixCache, log: KVEventLog, blocks: int, rng: random.Random) -> list[list[int]]:
    """Sessions of SESSION_TOKENS tokens into the cache until it holds `blocks` blocks."""
    sessions = []
    next_block = 0
    while cache.stats().cached_blocks < blocks:
        n = min(SESSION_TOKENS, (blocks - cache.stats().cached_blocks) * BS)
        tokens = [rng.randrange(0, 150_000) for _ in range(n)]
        cache.insert(tokens, list(range(next_block, next_block + n // BS)))
        next_block += n // BS
        log.record(cache.drain_events())
        sessions.append(tokens)
    return sessions


def publish(index: PrefixIndex, log: KVEventLog) -> tuple[int, float]:
    """Every pending batch into the index as the API would (parse, then apply)."""
    posts, began = 0, time.perf_counter()
    while True:
        batches = log.take(65_536)
        if not batches:
            break
        parsed = [parse_batch(b, f"batches[{i}]") for i, b in enumerate(batches)]
        answer = index.apply(log.instance_id, log.epoch, log.seq, parsed)
        if answer.get("resync"):
            raise SystemExit(f"index asked for a resync: {answer}")
        log.ack(answer["acked"])
        posts += 1
        if answer["acked"] >= log.seq:
            break
    return posts, time.perf_counter() - began


def lookups(held, prompts: dict[str, list[int]]) -> dict[str, dict]:
    out = {}
    for name, prompt in prompts.items():
        hashes = prefix_block_hashes(prompt, BS)
        info = RequestInfo(
            prompt_tokens=len(prompt), max_tokens=100, prefix_block_hashes=hashes, block_tokens=BS
        )
        md = InstanceState("md", "main_decode", "B", cached_prefix_blocks=held)
        times = []
        hit = 0
        for _ in range(LOOKUPS):
            t0 = time.perf_counter()
            hit = prefix_hit_tokens(info, md)
            times.append(time.perf_counter() - t0)
        times.sort()
        out[name] = {
            "hit_tokens": hit,
            "median_us": round(statistics.median(times) * 1e6, 2),
            "p99_us": round(times[int(0.99 * len(times))] * 1e6, 2),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kv_index")
    parser.add_argument("--blocks", type=int, default=1_500_000)
    parser.add_argument("--redis", default="", help="also run the Redis-backed index")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    if args.blocks < SESSION_TOKENS // BS:
        print(f"--blocks must be >= {SESSION_TOKENS // BS}", file=sys.stderr)
        return 2
    rng = random.Random(args.seed)
    cache = RadixCache(BS)
    cache.enable_events()
    log = KVEventLog("md-1")
    say(f"filling a radix cache to {args.blocks:,} blocks")
    t0 = time.perf_counter()
    sessions = fill(cache, log, args.blocks, rng)
    fill_s = time.perf_counter() - t0
    summary: dict = {"blocks": cache.stats().cached_blocks, "fill_and_record_s": round(fill_s, 2)}

    say("publishing into the in-memory index")
    tracemalloc.start()
    index = PrefixIndex()
    posts, apply_s = publish(index, log)
    current, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    held = index.held("md-1")
    summary["memory"] = {
        "posts": posts,
        "apply_s": round(apply_s, 2),
        "blocks_per_s": round(len(held) / apply_s),
        "index_bytes_per_block": round(current / max(len(held), 1), 1),
        "exact": set(held) == {h.hex() for _, hs in cache.held_hashes() for h in hs},
    }
    whole = sessions[len(sessions) // 2]
    half = whole[: SESSION_TOKENS // 2] + [rng.randrange(0, 150_000) for _ in range(32_768)]
    miss = [rng.randrange(0, 150_000) for _ in range(SESSION_TOKENS)]
    prompts = {"hit_100": whole, "hit_50": half, "hit_0": miss}
    summary["memory"]["lookup"] = lookups(held, prompts)
    say(json.dumps(summary["memory"]))

    if args.redis:
        say("publishing into the Redis index; a second mirror reads the stream")
        prefix = f"bench-kv-{os.getpid()}"
        writer = PrefixIndex(args.redis, prefix)
        log2 = KVEventLog("md-1")
        log2.reset(cache.held_hashes())
        try:
            posts, apply_s = publish(writer, log2)
            reader = PrefixIndex(args.redis, prefix)
            t1 = time.perf_counter()
            reader.sync()
            sync_s = time.perf_counter() - t1
            rheld = reader.held("md-1")
            summary["redis"] = {
                "posts": posts,
                "apply_s": round(apply_s, 2),
                "blocks_per_s": round(len(rheld) / apply_s),
                "mirror_load_s": round(sync_s, 2),
                "exact": len(rheld) == len(held),
                "lookup": lookups(rheld, prompts),
            }
            say(json.dumps(summary["redis"]))
        finally:
            writer.forget("md-1")
            writer._redis().delete(f"{prefix}:kv:stream")

    out = Path("var/bench-kv-index")
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (HERE / "kv_index_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
