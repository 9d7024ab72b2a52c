"""The record writer's CPU per request: each request's admission row and then its record
(record, decision, usage line, admission removed) through the gateway's batched writer, as
the gateway submits them, in batches of 1 (one stream at a time) and 32 (32 streams finishing
together).

Scenario (fixed before the first run): SQLite test database in memory (the embedded
defaults), one tenant, one key; per batch size, 5 rounds of 64 batches of 1 or 4 batches of
32; the figure is process CPU seconds (all threads, the writer's included) per request,
median and spread over the rounds. Run:
    .venv/bin/python -m bench.gateway_writer --out var/gw/writer.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench.harness.inprocess import setup_test_database
from bench.harness.output import publish, spread
from pdd.vocab import HandoffMode, Pipeline

BATCHES = {1: 64, 32: 4}  # batch size -> batches per round


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    setup_test_database()

    from billing import services as billing
    from billing.models import Tenant
    from pdd.policy import Decision
    from routing.gateway import records

    key, _ = billing.api_key_create(tenant=Tenant.objects.create(name="bench"))
    decision = Decision(Pipeline.P_MD, HandoffMode.ONE_SHOT, "1", None, "2", 0, 2, 0.01, "bench")
    common = {
        "api_key": key,
        "model": "baton-tiny",
        "endpoint": "completions",
        "stream": True,
        "decision": decision,
        "policy_version": 1,
        "decision_inputs": {"mds": 8},
    }
    writer = records.record_writer

    def requests(first: int, count: int) -> None:
        ids = [f"w{i}" for i in range(first, first + count)]
        admitted = [
            writer.submit(
                records.admission_row,
                entry=records.admission_entry(
                    request_id=i, prompt_tokens=40, attempt_request_id=i, **common
                ),
                owner="bench:1",
            )
            for i in ids
        ]
        for future in admitted:
            future.result()
        outcome = records.Outcome(status="ok", prompt_tokens=40, completion_tokens=16)
        done = [writer.submit(records.record_request, request_id=i, outcome=outcome, **common)
                for i in ids]  # fmt: skip
        for future in done:
            future.result()

    requests(0, 8)  # warm-up
    n = 8
    ms: dict[int, list[float]] = {size: [] for size in BATCHES}
    for _ in range(args.rounds):
        for size, batches in BATCHES.items():
            start = time.process_time()
            for _ in range(batches):
                requests(n, size)
                n += size
            ms[size].append((time.process_time() - start) / (batches * size) * 1000)
    result = {
        "rounds": args.rounds,
        "cpu_ms_per_request": {str(size): spread(v, 3) for size, v in ms.items()},
        "writer": {"batches": writer.batches, "writes": writer.writes},
    }
    publish(result, args.out)
    return result


if __name__ == "__main__":
    main()
