"""Does any node flap offline under the demo's traffic plus a burst of concurrent streams?

Starts the testbed (bench/testbed.py: the real control plane with its embedded beat, and P, RLD
and MD agents on loopback, heartbeating every 1 s, offline after 3 missed beats), sets the
demo's WAN link and relay threshold, then for a bounded time sends the demo workload
(bench/traffic.py, ~0.8 req/s of multi-turn sessions) and, `--burst-at-s` in, `--streams`
concurrent streaming chat completions through the gateway. Meanwhile it polls the nodes'
status and heartbeat age each second. Afterwards it reads the fleet's event history
(`/api/v1/events/`: `node.offline` / `node.online`, instances going `unavailable`) and says
whether any node went offline while its agent was alive. Exit 0: none did; 1: one did (or an
agent died); 2: the testbed could not start.

    .venv/bin/python bench/agents/flap_check.py            # defaults: 150 s, 64 streams
    .venv/bin/python bench/agents/flap_check.py --out var/flap_check.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.demo import DEMO_LINK, DEMO_POLICY  # noqa: E402
from bench.testbed import Cluster, start_cluster  # noqa: E402
from bench.traffic import TrafficStats, demo_workload, filler, replay  # noqa: E402

MAX_DURATION_S = 180.0


@dataclass
class BurstStats:
    started: int = 0
    ok: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    tokens: int = 0


async def one_stream(
    http: httpx.AsyncClient,
    index: int,
    max_tokens: int,
    chars: tuple[int, int],
    stats: BurstStats,
):
    rng = random.Random(10_000 + index)
    # Distinct openings (low prefix hits): every one needs its KV over the WAN or the relay.
    prompt = f"[burst {index}] " + filler(rng, rng.randrange(chars[0], chars[1] + 1))
    body = {
        "model": "baton-tiny",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    stats.started += 1
    t0 = time.monotonic()
    first = None
    pieces = 0
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(str(chunk["error"])[:200])
                choices = chunk.get("choices") or [{}]
                if (choices[0].get("delta") or {}).get("content"):
                    pieces += 1
                    if first is None:
                        first = time.monotonic() - t0
    except Exception as exc:  # noqa: BLE001 - counted and reported
        stats.failed += 1
        stats.errors.append(f"{type(exc).__name__}: {exc}"[:300])
        return
    stats.ok += 1
    stats.tokens += pieces
    stats.e2e_s.append(time.monotonic() - t0)
    if first is not None:
        stats.ttft_s.append(first)


async def burst(
    url: str, api_key: str, streams: int, max_tokens: int, chars: tuple[int, int], stats: BurstStats
):
    limits = httpx.Limits(max_connections=streams + 8, max_keepalive_connections=streams)
    async with httpx.AsyncClient(
        base_url=url,
        headers={"Authorization": f"Bearer {api_key}"},
        timeout=httpx.Timeout(30.0, read=300.0),
        limits=limits,
    ) as http:
        await asyncio.gather(
            *(one_stream(http, i, max_tokens, chars, stats) for i in range(streams))
        )


def _age_s(stamp: str | None, now: datetime) -> float | None:
    if not stamp:
        return None
    return (now - datetime.fromisoformat(stamp.replace("Z", "+00:00"))).total_seconds()


async def watch_nodes(cluster: Cluster, stop: asyncio.Event, seen: dict[str, dict]) -> None:
    """Each second: every node's status and how old its last heartbeat is."""
    headers = {"Authorization": f"Token {cluster.operator_token}"}
    async with httpx.AsyncClient(base_url=cluster.url, headers=headers, timeout=10) as http:
        while not stop.is_set():
            try:
                rows = (await http.get("/api/v1/nodes/")).json()["results"]
            except Exception as exc:  # noqa: BLE001 - a slow answer is itself worth noting
                seen.setdefault("_poll_errors", {"count": 0})["count"] += 1
                seen["_poll_errors"]["last"] = repr(exc)[:200]
                rows = []
            now = datetime.now(UTC)
            for row in rows:
                node = seen.setdefault(
                    row["hostname"], {"statuses": {}, "max_heartbeat_age_s": 0.0, "samples": 0}
                )
                node["samples"] += 1
                node["statuses"][row["status"]] = node["statuses"].get(row["status"], 0) + 1
                age = _age_s(row.get("last_heartbeat_at"), now)
                if age is not None:
                    node["max_heartbeat_age_s"] = round(max(node["max_heartbeat_age_s"], age), 3)
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except TimeoutError:
                pass


def fleet_events(cluster: Cluster, since_id: int) -> list[dict]:
    """Every fleet event after `since_id`, oldest first."""
    events: list[dict] = []
    with cluster.api() as api:
        page = 1
        while True:
            body = api.get(
                "/api/v1/events/", params={"page": page, "page_size": 500, "ordering": "created_at"}
            ).json()
            events += [e for e in body["results"] if e["id"] > since_id]
            if not body.get("next"):
                return events
            page += 1


async def drive(cluster: Cluster, args) -> dict:
    api_key = cluster.setup["key"]
    stop = asyncio.Event()
    traffic = TrafficStats()
    bursts = BurstStats()
    seen: dict[str, dict] = {}
    spec = demo_workload(rps=args.rps, duration_s=args.duration_s, seed=args.seed)
    watcher = asyncio.create_task(watch_nodes(cluster, stop, seen))
    demo = asyncio.create_task(
        replay(
            base_url=cluster.url,
            api_key=api_key,
            model="baton-tiny",
            spec=spec,
            stop=stop,
            stats=traffic,
        )
    )
    started = time.monotonic()
    await asyncio.sleep(args.burst_at_s)
    say(f"burst: {args.streams} concurrent streams ({traffic.line()})")
    burst_task = asyncio.create_task(
        burst(
            cluster.url,
            api_key,
            args.streams,
            args.stream_max_tokens,
            tuple(args.burst_prompt_chars),
            bursts,
        )
    )
    deadline = started + args.duration_s
    while time.monotonic() < deadline and not (burst_task.done() and demo.done()):
        await asyncio.sleep(min(10.0, max(0.0, deadline - time.monotonic())))
        say(
            f"{time.monotonic() - started:.0f} s: demo {traffic.line()}; burst ok {bursts.ok}, "
            f"failed {bursts.failed} of {bursts.started}"
        )
    stop.set()
    burst_done = burst_task.done()
    if not burst_done:
        burst_task.cancel()
    await asyncio.gather(burst_task, demo, watcher, return_exceptions=True)
    return {
        "elapsed_s": round(time.monotonic() - started, 1),
        "demo": {
            "sent": traffic.sent,
            "ok": traffic.ok,
            "failed": traffic.failed,
            "by_status": {str(k): v for k, v in traffic.by_status.items()},
        },
        "burst": {
            "streams": args.streams,
            "prompt_chars": args.burst_prompt_chars,
            "max_tokens": args.stream_max_tokens,
            "finished_in_time": burst_done,
            "ok": bursts.ok,
            "failed": bursts.failed,
            "tokens": bursts.tokens,
            "ttft_s_median": _median(bursts.ttft_s),
            "ttft_s_max": max(bursts.ttft_s, default=None),
            "e2e_s_median": _median(bursts.e2e_s),
            "e2e_s_max": max(bursts.e2e_s, default=None),
            "errors": bursts.errors[:5],
        },
        "nodes": seen,
    }


def _median(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[len(ordered) // 2], 3)


def say(message: str) -> None:
    print(f"[flap-check] {message}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=150.0, help="at most 180")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--stream-max-tokens", type=int, default=64)
    parser.add_argument("--burst-at-s", type=float, default=15.0)
    parser.add_argument(
        "--burst-prompt-chars",
        type=int,
        nargs=2,
        default=[100, 250],
        metavar=("MIN", "MAX"),
        help="each burst prompt's length (1 token per character); the default lets the 64 fit "
        "the testbed's 512 KV blocks per agent, longer ones are refused as engine full",
    )
    parser.add_argument("--rps", type=float, default=0.8, help="the demo's request rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="also write the result as JSON here")
    args = parser.parse_args(argv)
    if not 0 < args.duration_s <= MAX_DURATION_S:
        parser.error(f"--duration-s must be in (0, {MAX_DURATION_S:.0f}]")
    if args.streams < 1 or not 0 <= args.burst_at_s < args.duration_s:
        parser.error("--streams must be >= 1 and --burst-at-s within --duration-s")
    low, high = args.burst_prompt_chars
    if not 1 <= low <= high:
        parser.error("--burst-prompt-chars needs 1 <= MIN <= MAX")

    say("starting the testbed (control plane + P, RLD, MD agents)")
    try:
        cluster = start_cluster()
    except Exception as exc:  # noqa: BLE001 - reported with its reason
        say(f"the testbed did not start: {exc!r}")
        return 2
    try:
        with cluster.api() as api:
            link = api.get("/api/v1/wan-links/").json()["results"][0]
            api.patch(f"/api/v1/wan-links/{link['id']}/", json=DEMO_LINK).raise_for_status()
            api.patch("/api/v1/routing-policy/", json={"settings": DEMO_POLICY}).raise_for_status()
        before = max((e["id"] for e in fleet_events(cluster, 0)), default=0)
        threads = {
            host: cluster.agent_state(host).get("threads") for host in sorted(cluster.agents)
        }
        say(f"fleet up; agent threads: {json.dumps(threads)}")
        result = asyncio.run(drive(cluster, args))
        events = fleet_events(cluster, before)
        alive = {host: proc.proc.poll() is None for host, proc in cluster.agents.items()}
    finally:
        cluster.stop()

    offline = [e for e in events if e["kind"] == "node.offline"]
    unavailable = [
        e
        for e in events
        if e["kind"] == "instance.state" and (e.get("data") or {}).get("new") == "unavailable"
    ]
    seen_offline = {
        host: node["statuses"].get("offline", 0)
        for host, node in result["nodes"].items()
        if not host.startswith("_")
    }
    result |= {
        "command": " ".join(["bench/agents/flap_check.py", *(argv or sys.argv[1:])]),
        "heartbeat": {"interval_s": 1, "misses": 3},
        "agent_threads": threads,
        "agents_alive_at_end": alive,
        "node_offline_events": [f"{e['created_at']} {e['message']}" for e in offline],
        "instances_unavailable": [f"{e['created_at']} {e['message']}" for e in unavailable],
        "offline_samples": seen_offline,
        "node_events": [
            f"{e['created_at']} {e['kind']} {e['message']}"
            for e in events
            if e["kind"].startswith("node.")
        ],
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    for host, node in sorted(result["nodes"].items()):
        if not host.startswith("_"):
            say(
                f"{host}: statuses seen {node['statuses']}, max heartbeat age "
                f"{node['max_heartbeat_age_s']:.2f} s (offline after 3 s)"
            )
    say(f"demo traffic: {result['demo']}")
    say(f"burst: {json.dumps({k: v for k, v in result['burst'].items() if k != 'errors'})}")
    flapped = bool(offline) or any(seen_offline.values())
    dead = [host for host, ok in alive.items() if not ok]
    if dead:
        say(f"FAIL: agent(s) died: {dead}")
    if flapped:
        say(f"FAIL: {len(offline)} node.offline event(s): {result['node_offline_events']}")
    else:
        say("OK: no node went offline")
    return 1 if flapped or dead else 0


if __name__ == "__main__":
    sys.exit(main())
