"""Telemetry benchmark: records aggregated per second, and the delay from a request's
completion (observe) to its effect on an open dashboard socket. Prints JSON.

    .venv/bin/python bench/telemetry_bench.py                  # in-process state
    REDIS_URL=redis://127.0.0.1:6379/0 .venv/bin/python bench/telemetry_bench.py   # + Redis

The delay is measured through the real consumer and snapshot loop (channel layer from
settings; an in-memory SQLite database with the demo fleet), observing one record at a random
phase of the 1 s snapshot tick and waiting for the first snapshot whose 1-minute request count
includes it.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import sys
import time
import uuid
from pathlib import Path

from pdd.vocab import HandoffMode, Pipeline

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")


def records(n: int, seed: int = 1) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        low = rng.random() < 0.25
        prompt = int(rng.lognormvariate(9.5, 0.8))
        cached = int(prompt * (rng.uniform(0, 0.9) if low else rng.uniform(0.95, 1)))
        ttft = rng.lognormvariate(0.9 if low else 1.4, 0.6)
        out.append(
            {
                "model": "baton-tiny",
                "pipeline": Pipeline.P_RLD_MD if low else Pipeline.P_MD,
                "handoff_mode": rng.choice([HandoffMode.ONE_SHOT, HandoffMode.CATCH_UP])
                if low
                else "none",
                "status": "ok",
                "ttft_s": ttft,
                "tpot_s": rng.uniform(0.02, 0.05),
                "e2e_s": ttft + 5,
                "prompt_tokens": prompt,
                "cached_tokens": cached,
                "completion_tokens": 200,
                "tokens_by_rld": 40 if low else 0,
                "tokens_by_md": 160 if low else 200,
                "kv_bytes_wan": (prompt - cached) * 4400,
                "prefill_instance": "1",
                "main_instance": "3",
            }
        )
    return out


def throughput(store_factory, *, n: int, batch: int) -> dict:
    from frontend.telemetry.aggregator import SLA, Aggregator

    agg = Aggregator(store_factory(), sla_for=lambda m: SLA())
    data = records(n)
    start = time.perf_counter()
    if batch == 1:
        for r in data:
            agg.observe(r)
    else:
        for i in range(0, n, batch):
            agg.observe_many(data[i : i + batch])
    agg.store.flush()
    elapsed = time.perf_counter() - start
    t0 = time.perf_counter()
    agg.window("5m", now=time.time())
    read_s = time.perf_counter() - t0
    assert sum(agg.totals().requests.values()) == n
    agg.store.clear()
    return {
        "records": n,
        "batch": batch,
        "seconds": round(elapsed, 3),
        "records_per_s": round(n / elapsed),
        "read_5m_window_ms": round(read_s * 1e3, 2),
    }


async def dashboard_delay(samples: int) -> dict:
    from asgiref.sync import sync_to_async
    from channels.testing.websocket import WebsocketCommunicator
    from django.contrib.auth.models import User

    from frontend.consumers import DashboardConsumer
    from frontend.telemetry import observe

    user = await sync_to_async(User.objects.get)(username="bench")
    comm = WebsocketCommunicator(DashboardConsumer.as_asgi(), "/ws/dashboard/")
    comm.scope["user"] = user
    ok, _ = await comm.connect()
    assert ok
    delays = []
    rng = random.Random(3)
    last = None
    while len(delays) < samples:
        msg = await comm.receive_json_from(timeout=30)
        if msg.get("type") != "snapshot":
            continue
        last = msg["windows"]["1m"]["requests"]
        await asyncio.sleep(rng.uniform(0, 0.95))  # a random phase of the tick
        t_done = time.perf_counter()
        await sync_to_async(observe)({**records(1)[0], "request_id": uuid.uuid4().hex})
        while True:
            msg = await comm.receive_json_from(timeout=30)
            if msg.get("type") == "snapshot" and msg["windows"]["1m"]["requests"] > last:
                delays.append(time.perf_counter() - t_done)
                break
    await comm.disconnect()
    delays.sort()
    return {
        "samples": samples,
        "mean_s": round(statistics.mean(delays), 3),
        "p50_s": round(delays[len(delays) // 2], 3),
        "max_s": round(delays[-1], 3),
    }


def main() -> None:
    import django

    os.environ["BATON_VAR_DIR"] = os.environ.get("BATON_BENCH_VAR", "/tmp/baton-telemetry-bench")
    redis_url = os.environ.get("REDIS_URL", "")
    django.setup()
    from django.core.management import call_command

    from frontend.telemetry.store import LocalStore, RedisStore

    result: dict = {"cpu_count": os.cpu_count(), "in_process": [], "redis": []}
    for batch in (1, 100):
        result["in_process"].append(throughput(LocalStore, n=100_000, batch=batch))
    if redis_url:
        prefix = f"bench-{uuid.uuid4().hex[:6]}"
        for batch in (1, 100):
            result["redis"].append(
                throughput(lambda: RedisStore(redis_url, prefix=prefix), n=100_000, batch=batch)
            )
    call_command("migrate", verbosity=0)
    with open(os.devnull, "w") as devnull:
        call_command("seed_demo", stdout=devnull)
    from django.contrib.auth.models import User

    User.objects.get_or_create(username="bench")
    from frontend.telemetry import set_aggregator

    set_aggregator(None, rebuilt=False)
    from asgiref.sync import async_to_sync

    result["dashboard_delay"] = async_to_sync(dashboard_delay)(20)
    result["dashboard_delay"]["store"] = "redis" if redis_url else "in-process"
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
