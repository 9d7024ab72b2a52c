"""Replay PDD's WAN microbenchmark (20 Gbps line, 80 RPS, 90% mean prefix hit, skewed vs uniform
hit distribution) at reduced scale over loopback TCP through the shaped WAN fabric.

Scaling: bandwidth and KV bytes per token are both divided by --scale (default 100: a 200 Mbit/s
link and 44 B/token instead of 20 Gbit/s and ~4.4 KB/token), so bytes / bandwidth, and therefore
every transfer time, equal the full-scale ones; RPS, context length, hit rates and RTT are not
scaled. The receiver runs in a child process so sender and receiver do not share one event loop.
Assumptions that are ours, not the paper's: RTT 20 ms, a pool of 8 connections, one connection
per transfer (setup charged one RTT), fixed-interval arrivals, 64-token blocks sent 16 per frame,
and no per-connection TCP window limit (the shaper's fair sharing stands in for TCP fairness).
Skewed: 78% of requests hit U(0.95, 1.0), the rest U(0.35, 0.918); uniform: U(0.85, 0.95);
both average a 90% hit. If the host cannot push the scaled bandwidth, achieved_mbps shows it.

Usage: python bench/wan_microbench.py [--duration-s 15] [--out results.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import random
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agents.transfer import (  # noqa: E402 - needs the repository root on sys.path
    FabricClient,
    FabricName,
    FabricServer,
    KVChunk,
    LinkSettings,
    LinkShaper,
    TransferStats,
)

PAPER_BANDWIDTH_GBPS = 20.0
PAPER_BYTES_PER_TOKEN = 4400
BLOCK_TOKENS = 64
BLOCKS_PER_FRAME = 16


def skewed_hit(rng: random.Random) -> float:
    if rng.random() < 0.78:
        return rng.uniform(0.95, 1.0)
    return rng.uniform(0.35, 0.918)


def uniform_hit(rng: random.Random) -> float:
    return rng.uniform(0.85, 0.95)


DISTRIBUTIONS = {"skewed": skewed_hit, "uniform": uniform_hit}


def kv_delta_chunks(
    hit: float, context_tokens: int, bytes_per_token: int, source: memoryview
) -> list[KVChunk]:
    """The KV the decode side lacks: tokens [cached, context) in frames of 16 blocks."""
    cached = min(context_tokens, int(hit * context_tokens) // BLOCK_TOKENS * BLOCK_TOKENS)
    chunks = []
    for first in range(cached, context_tokens, BLOCK_TOKENS * BLOCKS_PER_FRAME):
        last = min(context_tokens, first + BLOCK_TOKENS * BLOCKS_PER_FRAME)
        size = (last - first) * bytes_per_token
        offset = (first * bytes_per_token) % (len(source) - size)
        chunks.append(
            KVChunk(
                first // BLOCK_TOKENS,
                math.ceil(last / BLOCK_TOKENS),
                first,
                last,
                source[offset : offset + size],
            )
        )
    return chunks


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def _receiver_main(conn: Connection) -> None:
    """Child process: a WAN FabricServer that counts what it receives until told to stop."""

    async def serve() -> None:
        received = {"transfers": 0, "payload_bytes": 0, "errors": 0}

        async def on_transfer(transfer) -> None:
            received["transfers"] += 1
            received["payload_bytes"] += transfer.payload_bytes

        async def on_error(request_id, exc) -> None:
            received["errors"] += 1

        async with FabricServer(on_transfer, on_error, fabric=FabricName.WAN) as server:
            conn.send(server.port)
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, conn.recv)  # any message means stop
        conn.send(received)

    asyncio.run(serve())


async def run_distribution(
    name: str, args: argparse.Namespace, port: int, source: memoryview
) -> dict[str, object]:
    rng = random.Random(f"{args.seed}-{name}")
    settings = LinkSettings(
        bandwidth_gbps=args.bandwidth_mbps / 1000,
        rtt_ms=args.rtt_ms,
        pool_size=args.pool_size,
        quantum_bytes=args.quantum_kib * 1024,
    )
    shaper = LinkShaper(settings)
    client = FabricClient(FabricName.WAN, shaper)
    hits: list[float] = []
    results: list[tuple[float, TransferStats]] = []
    failures = 0

    async def one(index: int, hit: float) -> None:
        nonlocal failures
        chunks = kv_delta_chunks(hit, args.context_tokens, args.bytes_per_token, source)
        try:
            stats = await client.send("127.0.0.1", port, f"{name}-{index}", chunks)
        except Exception:  # noqa: BLE001 - a failed transfer is a data point, not a crash
            failures += 1
            return
        results.append((hit, stats))

    count = int(args.rps * args.duration_s)
    started = time.monotonic()
    shaper.pool.reset_stats()
    tasks = []
    for index in range(count):
        delay = started + index / args.rps - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        hit = DISTRIBUTIONS[name](rng)
        hits.append(hit)
        tasks.append(asyncio.create_task(one(index, hit)))
    arrivals_s = time.monotonic() - started
    pool = shaper.pool.stats()  # over the arrival window: the loaded steady state
    granted_at_end = shaper.bytes_granted
    _, pending = await asyncio.wait(tasks, timeout=args.drain_timeout_s)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)

    total = [stats.total_s for _, stats in results]
    waits = [stats.wait_for_connection_s for _, stats in results]
    light = [stats.total_s for hit, stats in results if hit > 0.95]
    heavy = [stats.total_s for hit, stats in results if hit <= 0.95]
    mean_delta = sum((1 - hit) * args.context_tokens * args.bytes_per_token for hit in hits)
    mean_delta /= max(1, len(hits))
    return {
        "requests": count,
        "completed": len(results),
        "failed": failures,
        "unfinished_after_drain": len(pending),
        "mean_hit": round(sum(hits) / max(1, len(hits)), 4),
        "mean_delta_bytes": round(mean_delta),
        "offered_load": round(mean_delta * args.rps * 8 / (args.bandwidth_mbps * 1e6), 3),
        "achieved_mbps_during_arrivals": round(granted_at_end * 8 / arrivals_s / 1e6, 1),
        "transfer_total_s": {
            "p50": percentile(total, 50),
            "p90": percentile(total, 90),
            "p99": percentile(total, 99),
            "max": max(total, default=None),
        },
        "wait_for_connection_s": {
            "mean": sum(waits) / len(waits) if waits else None,
            "p99": percentile(waits, 99),
        },
        "p50_total_s_hit_above_95pct": percentile(light, 50),
        "p50_total_s_hit_at_most_95pct": percentile(heavy, 50),
        "pool_utilisation": round(pool.utilisation, 3),
        "pool_full_fraction": round(pool.full_s / pool.elapsed_s, 3) if pool.elapsed_s else None,
        "pool_peak_in_use": pool.peak_in_use,
    }


async def run_all(args: argparse.Namespace, port: int) -> dict[str, dict[str, object]]:
    # One random source sliced by memoryview: payloads cost no allocation per request.
    source = memoryview(os.urandom(args.context_tokens * args.bytes_per_token + 1))
    return {name: await run_distribution(name, args, port, source) for name in args.distributions}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=100.0, help="divide bandwidth and KV by")
    parser.add_argument("--rps", type=float, default=80.0)
    parser.add_argument("--duration-s", type=float, default=15.0, help="arrivals per distribution")
    parser.add_argument("--drain-timeout-s", type=float, default=25.0)
    parser.add_argument("--context-tokens", type=int, default=65536)
    parser.add_argument("--rtt-ms", type=float, default=20.0)
    parser.add_argument("--pool-size", type=int, default=8)
    parser.add_argument("--quantum-kib", type=int, default=64)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--distributions", nargs="+", default=list(DISTRIBUTIONS))
    parser.add_argument("--in-process-receiver", action="store_true")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.scale <= 0 or args.rps <= 0 or args.duration_s <= 0:
        parser.error("--scale, --rps and --duration-s must be > 0")
    unknown = set(args.distributions) - set(DISTRIBUTIONS)
    if unknown:
        parser.error(f"unknown distributions {sorted(unknown)}; choose from {list(DISTRIBUTIONS)}")
    args.bandwidth_mbps = PAPER_BANDWIDTH_GBPS * 1000 / args.scale
    args.bytes_per_token = max(1, round(PAPER_BYTES_PER_TOKEN / args.scale))
    return args


async def _run_in_process(args: argparse.Namespace) -> dict[str, dict[str, object]]:
    async with FabricServer(lambda transfer: None, fabric=FabricName.WAN) as server:
        return await run_all(args, server.port)


def main(argv: list[str] | None = None) -> dict[str, object]:
    args = parse_args(argv)
    started = time.monotonic()
    receiver: dict[str, int] | None = None
    if args.in_process_receiver:
        results = asyncio.run(_run_in_process(args))
    else:
        parent, child = multiprocessing.get_context("spawn").Pipe()
        process = multiprocessing.get_context("spawn").Process(
            target=_receiver_main, args=(child,), daemon=True
        )
        process.start()
        try:
            if not parent.poll(30):
                raise RuntimeError("receiver process did not report its port")
            results = asyncio.run(run_all(args, parent.recv()))
            parent.send("stop")
            receiver = parent.recv() if parent.poll(30) else None
        finally:
            process.join(10)
            if process.is_alive():
                process.kill()
    report = {
        "config": {
            "scale": args.scale,
            "bandwidth_mbps": args.bandwidth_mbps,
            "paper_bandwidth_gbps": PAPER_BANDWIDTH_GBPS,
            "bytes_per_token": args.bytes_per_token,
            "paper_bytes_per_token": PAPER_BYTES_PER_TOKEN,
            "context_tokens": args.context_tokens,
            "rps": args.rps,
            "duration_s": args.duration_s,
            "rtt_ms": args.rtt_ms,
            "pool_size": args.pool_size,
            "quantum_kib": args.quantum_kib,
            "seed": args.seed,
            "times_are_full_scale_equivalent": True,
        },
        "results": results,
        "receiver": receiver,
        "wall_s": round(time.monotonic() - started, 1),
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return report


if __name__ == "__main__":
    main()
