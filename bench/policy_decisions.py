"""Time ``pdd.policy.decide`` per decision on a realistic PDD snapshot.

Snapshot: 4 P, 2 RLD and 8 MD instances (MD in datacenter B behind one 20 Gbps WAN link with a
225 Mbit/s per-connection rate), each MD's decode-side cache holding the prefix blocks of its
share of 400 agent sessions of ~64K tokens (64-token blocks, so ~1,000 block hashes a session).
Requests are drawn from those sessions with the skewed hit mix (most hit > 95%, some low hit,
a few unseen sessions), so the policy walks long prefix runs as the gateway does when it has no
cache index (``prefix_hits`` absent). ``--mode hits`` instead passes measured per-MD hits (the
simulator's path). Loads and link utilisation change between decisions.

    .venv/bin/python bench/policy_decisions.py [--n 100000] [--mode hashes|hits] [--out PATH]

Prints JSON: median, p90, p99 and mean microseconds per decision, plus the setup.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdd.policy import (  # noqa: E402
    ClusterSnapshot,
    InstanceState,
    PolicySettings,
    RequestInfo,
    Role,
    WanLinkState,
    decide,
)

BLOCK = 64
SESSIONS = 400
CONTEXT_TOKENS = 64_000


def build(rng: random.Random):
    sessions = [
        tuple(f"s{s}-b{b}" for b in range(CONTEXT_TOKENS // BLOCK)) for s in range(SESSIONS)
    ]
    prefill = tuple(InstanceState(f"p{k}", Role.PREFILL, "A") for k in range(4))
    relay = tuple(InstanceState(f"rld{k}", Role.RELAY_DECODE, "A") for k in range(2))
    main = []
    for k in range(8):
        blocks: set[str] = set()
        for s in range(k, SESSIONS, 8):  # each session's home MD holds its prefix
            blocks.update(sessions[s][: int(len(sessions[s]) * rng.uniform(0.9, 1.0))])
        main.append(
            InstanceState(f"md{k}", Role.MAIN_DECODE, "B", cached_prefix_blocks=frozenset(blocks))
        )
    link = WanLinkState(20.0, 20.0, per_connection_gbps=0.225)
    snapshot = ClusterSnapshot(
        prefill=prefill, relay_decode=relay, main_decode=tuple(main), wan_links={"B": link}
    )
    return sessions, snapshot, link


def requests(rng: random.Random, sessions, n: int) -> list[RequestInfo]:
    out = []
    for _ in range(n):
        s = rng.randrange(SESSIONS + SESSIONS // 20)  # ~5% unseen sessions: no hit anywhere
        blocks = sessions[s] if s < SESSIONS else tuple(f"new{s}-b{b}" for b in range(1000))
        # Prompt = the session's context plus new blocks: usually few, sometimes many.
        tail = rng.choice((2, 5, 10, 20, 40, 100, 400, 1000))
        hashes = blocks + tuple(f"t{s}-{j}" for j in range(tail))
        out.append(
            RequestInfo(
                prompt_tokens=len(hashes) * BLOCK,
                max_tokens=rng.choice((16, 64, 256, 1024, 4096)),
                prefix_block_hashes=hashes,
                block_tokens=BLOCK,
            )
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100_000, help="decisions to time")
    parser.add_argument("--mode", choices=("hashes", "hits"), default="hashes")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    sessions, snapshot, link = build(rng)
    pool = requests(rng, sessions, 2_000)
    settings = PolicySettings()
    instances = snapshot.prefill + snapshot.relay_decode + snapshot.main_decode
    hits = None
    if args.mode == "hits":
        hits = [{m.id: rng.randrange(0, r.prompt_tokens + 1) for m in snapshot.main_decode}
                for r in pool]  # fmt: skip
    times = []
    clock = time.perf_counter_ns
    for k in range(args.n):
        j = k % len(pool)
        inst = instances[k % len(instances)]
        inst.load = rng.random()  # live state moves between decisions
        link.utilisation = rng.random()
        if hits is not None:
            snapshot.prefix_hits = hits[j]
        t0 = clock()
        decide(pool[j], snapshot, settings)
        times.append(clock() - t0)
    times.sort()
    us = [t / 1000 for t in times]
    result = {
        "decisions": args.n,
        "mode": args.mode,
        "snapshot": {"prefill": 4, "relay_decode": 2, "main_decode": 8, "wan_links": 1},
        "blocks_per_session": CONTEXT_TOKENS // BLOCK,
        "median_us": round(statistics.median(us), 2),
        "p90_us": round(us[int(0.9 * (len(us) - 1))], 2),
        "p99_us": round(us[int(0.99 * (len(us) - 1))], 2),
        "mean_us": round(statistics.fmean(us), 2),
        "python": sys.version.split()[0],
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
