"""Where the control plane's web process spends a gateway request: py-spy samples of the
testbed's uvicorn process while one client sends streamed chat requests (16 tokens, the
overhead benchmark's kind) one after another, grouped by what they are in.

Run (py-spy from PyPI: `.venv/bin/pip install py-spy`; it needs ptrace rights):
    .venv/bin/python -m bench.gateway_profile --seconds 22 --out var/gw/spy.txt
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench import gateway_overhead as overhead
from bench.testbed import start_cluster

# First match wins: (group, a substring of a sampled stack).
GROUPS = (
    ("idle", "EpollSelector.select"),
    ("idle", "Condition.wait"),
    ("idle", "SimpleQueue.get"),
    ("idle", "_worker (concurrent"),
    ("reconcile task", "node_reconcile"),
    ("probe task", "probe_agents"),
    ("embedded schedule, other", "embedded_beat"),
    ("record writer thread", "BatchWriter"),
    ("gateway view and run", "routing/gateway"),
    ("Django's ASGI handler", "django/core/handlers"),
    ("uvicorn", "uvicorn"),
    ("asyncio", "asyncio/"),
)


def group_samples(raw: Path) -> dict[str, int]:
    groups: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        name = next((g for g, pattern in GROUPS if pattern in stack), "other")
        groups[name] += int(count)
    return dict(groups.most_common())


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=22.0)
    parser.add_argument("--rate", type=int, default=200, help="samples per second")
    parser.add_argument("--out", type=Path, default=Path("var/gw/spy.txt"))
    args = parser.parse_args(argv)
    spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if spy is None:
        parser.exit(2, "gateway_profile: py-spy is not installed (pip install py-spy)\n")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    cluster = start_cluster()
    try:
        with cluster.api() as api:
            api.patch("/api/v1/routing-policy/", json={"settings": {"wan_time_threshold_s": 10.0}})
        time.sleep(1.5)
        key = cluster.setup["key"]
        for i in range(6):  # warm-up, not sampled
            asyncio.run(overhead.via_gateway(cluster.url, key, 80_000 + i, 16))
        record = subprocess.Popen(
            [spy, "record", "-p", str(cluster.processes[0].pid), "-r", str(args.rate),
             "-f", "raw", "-o", str(args.out), "-d", str(int(args.seconds + 3)), "--nonblocking"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        time.sleep(1.0)
        started, sent = time.time(), 0
        while time.time() - started < args.seconds:
            asyncio.run(overhead.via_gateway(cluster.url, key, 70_000 + sent, 16))
            sent += 1
        record.wait()
    finally:
        cluster.stop()
    groups = group_samples(args.out)
    busy = sum(n for g, n in groups.items() if g != "idle")
    result = {
        "requests": sent,
        "rate_hz": args.rate,
        "samples": groups,
        "busy_ms_per_request": round(busy / args.rate / max(1, sent) * 1000, 2),
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
