"""`python -m bench.engine handoff`: the handoff microbenchmark of docs/pdd.md on this engine:
recomputing k handed-over tokens on MD
(one extend forward) versus shipping their KV over the shaped WAN fabric, for k = 1, 16, 64, 100
(mean / max / std and the bytes of each), plus prefill and decode tokens/s at batch 1, 8, 32
(reusing `python -m bench.engine throughput`'s runs). Prints JSON; a report, not a timed test."""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from agents.engine import BATON_TINY, load_model
from agents.engine.kv_pool import PagedKVPool
from agents.transfer.fabric import FabricClient, FabricName, FabricServer, KVChunk
from agents.transfer.frames import encode_token_ids
from agents.transfer.records import TokenIds
from agents.transfer.shaping import LinkSettings, LinkShaper
from bench.engine.throughput import bench_batch, bench_recompute, stats_ms
from bench.harness.output import publish


async def ship_kv(k: int, cfg, link: LinkSettings, repeats: int) -> dict:
    """Send k tokens' KV (kv_pool wire format) over a shaped WAN to a FabricServer; time from
    send() to the receiver's verified transfer, then the receiver's import into its pool."""
    pool = PagedKVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 64, 16)
    src = pool.allocate(pool.blocks_for(k))
    payload = pool.export_kv(src, 0, k)
    arrived: asyncio.Queue = asyncio.Queue()
    times, import_ms, wire = [], [], 0
    async with FabricServer(
        lambda t: arrived.put_nowait((time.perf_counter(), t)), port=0, fabric=FabricName.WAN
    ) as server:
        client = FabricClient(FabricName.WAN, LinkShaper(link))
        for rep in range(repeats + 1):
            start = time.perf_counter()
            chunk = KVChunk(0, pool.blocks_for(k), 0, k, payload)
            stats = await client.send(server.host, server.port, f"kv-{k}-{rep}", [chunk])
            done_at, transfer = await arrived.get()
            t0 = time.perf_counter()
            dst = pool.allocate(pool.blocks_for(k))
            pool.import_kv(transfer.chunks[0].payload, dst)
            pool.free(dst)
            if rep:  # the first run opens sockets and warms allocations
                times.append(1000 * (done_at - start))
                import_ms.append(1000 * (time.perf_counter() - t0))
            wire = stats.bytes_sent
    return {
        **stats_ms(times),
        "payload_bytes": len(payload),
        "wire_bytes": wire,
        "import_mean_ms": statistics.fmean(import_ms),
    }


def token_id_bytes(k: int) -> dict[str, int]:
    """What the extend-decode handoff sends instead: k token ids in one TOKENS transfer."""
    ids = encode_token_ids(range(k))
    from agents.transfer.client import Wire  # the exact frames the client would write

    wire = Wire("req|0|h0.final", [], TokenIds(0, tuple(range(k))))
    return {"payload_bytes": len(ids), "wire_bytes": wire.data_bytes + len(wire.end)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.engine handoff", description=__doc__)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 16, 64, 100])
    parser.add_argument("--context-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--wan-gbps", type=float, default=1.0)
    parser.add_argument("--wan-rtt-ms", type=float, default=20.0)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    loaded = load_model(BATON_TINY)
    cfg = loaded.config
    link = LinkSettings(bandwidth_gbps=args.wan_gbps, rtt_ms=args.wan_rtt_ms, pool_size=16)
    handoff = {}
    for k in args.ks:
        handoff[str(k)] = {
            "recompute": bench_recompute(loaded, k, args.context_len, args.repeats),
            "ship_kv": asyncio.run(ship_kv(k, cfg, link, args.repeats)),
            "token_ids": token_id_bytes(k),
        }
    result = {
        "model": BATON_TINY,
        "kv_bytes_per_token": cfg.kv_bytes_per_token(4),
        "torch": torch.__version__,
        "threads": args.threads,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset"),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "wan": {"bandwidth_gbps": args.wan_gbps, "rtt_ms": args.wan_rtt_ms},
        "recompute_context_len": args.context_len,
        "handoff": handoff,
        "throughput": {
            str(b): bench_batch(loaded, b, args.prompt_len, args.decode_steps) for b in args.batches
        },
    }
    publish(result, args.out)
    return result
