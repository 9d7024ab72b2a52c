"""The gateway's own overhead per request: the same kind of request sent (a) through the gateway
and (b) straight to the prefill agent's /v1/pdd/generate with the plan the gateway would send,
on the local testbed (real control plane and agents), interleaved so both arms share the
machine's state, plus the gateway's own stage timings (its Server-Timing header).

Scenario (fixed before the first run of this version):
- the testbed fleet (P and RLD in dc-a, MD in dc-b over a 1 Gbit/s / 5 ms link), the policy
  forced to p-md (wan_time_threshold_s 10), streamed chat requests with 16 output tokens;
- prompt k of arm X: a shared system prompt plus "question X<k:05d>: " and a fixed question,
  so both arms' prompts have the same length and neither warms the other's cache beyond the
  shared system prompt; 4 warm-up requests per arm first, not counted;
- 1 stream: --requests pairs, gateway then direct, alternating; 32 streams: rounds of 32
  concurrent requests of one arm, alternating arms, --requests // 8 rounds each (at least 4);
- 128 streams: one round of 128 concurrent requests through the gateway, errors counted.
Each request is timed from sending it to its last event: the gateway's `data: [DONE]` (SSE
clients such as openai's stop there) and the agent's `done` line. Overhead = median(gateway) -
median(direct); at 1 stream also the median of the per-pair differences. Run:
    .venv/bin/python -m bench.gateway_overhead --requests 64 --out var/gw/overhead.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path

import httpx

from bench.harness.testbed import start_cluster
from pdd.dataplane import bearer_headers, env_data_token
from pdd.tokenizer import ByteTokenizer, apply_chat_template


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def messages_for(arm: str, i: int) -> list[dict]:
    # A shared system prompt (cached after the first request) and a distinct question of the
    # same length in both arms.
    return [
        {"role": "system", "content": "You are a benchmark assistant. " * 8},
        {"role": "user", "content": f"question {arm}{i:05d}: " + "measure me " * 10},
    ]


def server_timing(header: str) -> dict[str, float]:
    stages = {}
    for part in header.split(","):
        name, _, dur = part.strip().partition(";dur=")
        if name and dur:
            stages[name] = float(dur)
    return stages


TIMINGS: list[dict[str, float]] = []  # the gateway arm's Server-Timing, per request
# Per arm, per request: seconds from sending to the response headers, to the first token, to
# the last event; where in a request the gateway's extra time appears.
MILESTONES: dict[str, list[tuple[float, float, float]]] = {"gateway": [], "direct": []}


# Gateway request id -> (seconds to the first token at the client, its Server-Timing).
FIRST_TOKENS: dict[str, tuple[float, dict[str, float]]] = {}


def first_token_split(api) -> dict:
    """The gateway arm's time to first token at the client, split by the gateway's clocks:
    before admission (``django`` + ``queue`` laps), from admission to the first token leaving
    the gateway (the record's ``ttft_s``, which includes the call to P and P's own prefill),
    and the rest: outside the gateway's clocks (the client's connection and send, uvicorn,
    the token's way back to the client)."""
    rows = []
    for request_id, (first_s, stages) in FIRST_TOKENS.items():
        found = api.get("/api/v1/requests/", params={"request_id": request_id}).json()
        results = found.get("results") or []
        if not results or results[0].get("ttft_s") is None:
            continue
        before = stages.get("django", 0.0) + stages.get("queue", 0.0)
        ttft_ms = results[0]["ttft_s"] * 1000
        prefill_ms = (results[0].get("prefill_s") or 0.0) * 1000
        rows.append(
            (first_s * 1000, before, ttft_ms, prefill_ms, first_s * 1000 - before - ttft_ms)
        )
    FIRST_TOKENS.clear()
    if not rows:
        return {}
    names = ("client_first_token", "before_admission", "record_ttft", "p_prefill", "outside")
    return {
        "requests": len(rows),
        **{f"{n}_ms": round(statistics.median(r[k] for r in rows), 2) for k, n in enumerate(names)},
    }


def milestone_medians() -> dict:
    out = {}
    for arm, rows in MILESTONES.items():
        if rows:
            out[arm] = {
                name: round(statistics.median(r[k] for r in rows) * 1000, 2)
                for k, name in enumerate(("headers_ms", "first_token_ms", "last_event_ms"))
            }
    if len(out) == 2:
        out["overhead"] = {
            k: round(out["gateway"][k] - out["direct"][k], 2) for k in out["gateway"]
        }
    for rows in MILESTONES.values():
        rows.clear()
    return out


async def via_gateway(url: str, key: str, i: int, max_tokens: int) -> float:
    body = {
        "model": "baton-tiny",
        "messages": messages_for("g", i),
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    async with httpx.AsyncClient(timeout=300) as http:
        t0 = time.perf_counter()
        async with http.stream(
            "POST",
            f"{url}/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {key}"},
        ) as response:
            response.raise_for_status()
            headers_at = time.perf_counter()
            TIMINGS.append(server_timing(response.headers.get("server-timing", "")))
            done_at = first_at = None
            async for line in response.aiter_lines():
                if first_at is None and '"content":"' in line and '"content":""' not in line:
                    first_at = time.perf_counter()  # the first token's text
                if done_at is None and line.strip() == "data: [DONE]":
                    done_at = time.perf_counter()  # what the user waits for (SSE clients stop)
        done_at = done_at or time.perf_counter()
        MILESTONES["gateway"].append((headers_at - t0, (first_at or done_at) - t0, done_at - t0))
        FIRST_TOKENS[response.headers.get("x-request-id", "")] = (
            (first_at or done_at) - t0,
            TIMINGS[-1],
        )
        return done_at - t0


async def direct(p_http: str, plan: dict, i: int, max_tokens: int) -> float:
    prompt = ByteTokenizer().encode(apply_chat_template(messages_for("d", i)))
    body = {
        **plan,
        "request_id": f"direct-{i}-{time.time_ns()}",
        "prompt_ids": prompt,
        "sampling": {"max_tokens": max_tokens, "temperature": 0.0},
    }
    async with httpx.AsyncClient(timeout=300) as http:
        t0 = time.perf_counter()
        url = f"{p_http}/v1/pdd/generate"
        async with http.stream(
            "POST", url, json=body, headers=bearer_headers(env_data_token())
        ) as response:
            response.raise_for_status()
            headers_at = time.perf_counter()
            done_at = first_at = None
            async for line in response.aiter_lines():
                if first_at is None and '"type":"token"' in line:
                    first_at = time.perf_counter()
                if done_at is None and '"type":"done"' in line:
                    done_at = time.perf_counter()  # the agent's last event
        done_at = done_at or time.perf_counter()
        MILESTONES["direct"].append((headers_at - t0, (first_at or done_at) - t0, done_at - t0))
        return done_at - t0


async def measure(fn, n: int, concurrency: int) -> list[float]:
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> float:
        async with gate:
            return await fn(i)

    return list(await asyncio.gather(*(one(i) for i in range(n))))


def arm_summary(gateway: list[float], straight: list[float]) -> dict:
    g, d = summary(gateway), summary(straight)
    return {
        "gateway": g,
        "direct_to_prefill_agent": d,
        "overhead_median_ms": round((g["median_s"] - d["median_s"]) * 1000, 2),
        "overhead_p90_ms": round((g["p90_s"] - d["p90_s"]) * 1000, 2),
    }


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (Linux /proc, clock ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """The control plane's CPU per request, per arm: its process's CPU time over each arm's
    requests (or rounds); the direct arm's is what the process spends meanwhile on other work
    (the agents' heartbeats, the embedded schedule), so gateway - direct is the gateway's."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.cpu = {"gateway": 0.0, "direct": 0.0}
        self.requests = {"gateway": 0, "direct": 0}

    def run(self, arm: str, requests: int, fn):
        before = process_cpu_s(self.pid)
        out = fn()
        self.cpu[arm] += process_cpu_s(self.pid) - before
        self.requests[arm] += requests
        return out

    def summary(self) -> dict:
        per = {a: self.cpu[a] / max(1, self.requests[a]) * 1000 for a in self.cpu}
        out = {
            "control_plane_cpu_ms_per_request_gateway_arm": round(per["gateway"], 2),
            "control_plane_cpu_ms_per_request_direct_arm": round(per["direct"], 2),
            "gateway_cpu_ms_per_request": round(per["gateway"] - per["direct"], 2),
        }
        self.cpu = {"gateway": 0.0, "direct": 0.0}
        self.requests = {"gateway": 0, "direct": 0}
        return out


def stage_counts(timings: list[dict[str, float]]) -> dict[str, int]:
    """How many of the requests had each stage (``inline``/``resume``: the worker path)."""
    counts: dict[str, int] = {}
    for t in timings:
        for name in t:
            counts[name] = counts.get(name, 0) + 1
    return {"requests": len(timings), **counts}


def stage_medians(timings: list[dict[str, float]]) -> dict[str, float]:
    names: list[str] = []
    for t in timings:
        names += [name for name in t if name not in names]
    return {
        name: round(statistics.median([t[name] for t in timings if name in t]), 3) for name in names
    }


def summary(values: list[float]) -> dict:
    return {
        "n": len(values),
        "median_s": statistics.median(values),
        "p90_s": percentile(values, 0.9),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    cluster = start_cluster()
    try:
        with cluster.api() as api:
            api.patch("/api/v1/routing-policy/", json={"settings": {"wan_time_threshold_s": 10.0}})
        time.sleep(1.5)
        # The plan the gateway sends for these (p-md) requests, read from one gateway request.
        key = cluster.setup["key"]
        asyncio.run(via_gateway(cluster.url, key, -1, 2))
        with cluster.api() as api:
            record = api.get("/api/v1/requests/", params={"page_size": 1}).json()["results"][0]
        state = {h: cluster.agent_state(h) for h in ("a-p", "b-md")}
        md = state["b-md"]["instances"][0]
        plan = {
            "pipeline": record["pipeline"],
            "instance": record["prefill_instance"],
            "main": {
                "http": cluster.agents["b-md"].http,
                "kv_host": md["kv_endpoint"]["host"],
                "kv_port": md["kv_endpoint"]["port"],
                "wan_port": md["kv_endpoint"]["wan_port"],
                "instance": record["main_instance"],
                "datacenter": "dc-b",
            },
        }
        p_http = cluster.agents["a-p"].http

        def gw(i: int):
            return via_gateway(cluster.url, key, i, args.max_tokens)

        def dr(i: int):
            return direct(p_http, plan, i, args.max_tokens)

        asyncio.run(measure(lambda i: gw(90_000 + i), 4, 1))  # warm-up, not counted
        asyncio.run(measure(lambda i: dr(90_000 + i), 4, 1))
        TIMINGS.clear()
        FIRST_TOKENS.clear()
        milestone_medians()  # forget the warm-ups'
        results = {}
        # 1 stream: pairs, gateway then direct.
        gateway, straight = [], []
        cpu = CpuMeter(cluster.processes[0].pid)
        for i in range(args.requests):
            gateway.append(cpu.run("gateway", 1, lambda i=i: asyncio.run(gw(i))))
            straight.append(cpu.run("direct", 1, lambda i=i: asyncio.run(dr(i))))
        pairs = [(g - d) * 1000 for g, d in zip(gateway, straight, strict=True)]
        results["concurrency_1"] = arm_summary(gateway, straight)
        results["concurrency_1"]["paired_difference_median_ms"] = round(statistics.median(pairs), 2)
        results["concurrency_1"]["gateway_stages_median_ms"] = stage_medians(TIMINGS)
        results["concurrency_1"]["gateway_stage_counts"] = stage_counts(TIMINGS)
        results["concurrency_1"]["cpu"] = cpu.summary()
        results["concurrency_1"]["milestones_median"] = milestone_medians()
        with cluster.api() as api:
            results["concurrency_1"]["first_token_split_median"] = first_token_split(api)
        # 32 streams: alternating rounds of 32 concurrent requests.
        TIMINGS.clear()
        FIRST_TOKENS.clear()
        gateway, straight = [], []
        rounds = max(4, args.requests // 8)
        for r in range(rounds):
            base = 10_000 + r * 32
            gateway += cpu.run(
                "gateway", 32, lambda b=base: asyncio.run(measure(lambda i: gw(b + i), 32, 32))
            )
            straight += cpu.run(
                "direct", 32, lambda b=base: asyncio.run(measure(lambda i: dr(b + i), 32, 32))
            )
        results["concurrency_32"] = arm_summary(gateway, straight)
        results["concurrency_32"]["gateway_stages_median_ms"] = stage_medians(TIMINGS)
        results["concurrency_32"]["gateway_stage_counts"] = stage_counts(TIMINGS)
        results["concurrency_32"]["cpu"] = cpu.summary()
        results["concurrency_32"]["milestones_median"] = milestone_medians()
        with cluster.api() as api:
            results["concurrency_32"]["first_token_split_median"] = first_token_split(api)
        # 128 streams through the gateway: does every one finish?
        errors: list[str] = []

        async def guarded(i: int) -> float:
            try:
                return await gw(50_000 + i)
            except Exception as exc:  # noqa: BLE001 - counted, not raised
                errors.append(f"{type(exc).__name__}: {exc}"[:200])
                return float("nan")

        started = time.perf_counter()
        asyncio.run(measure(guarded, 128, 128))
        results["concurrency_128"] = {
            "requests": 128,
            "errors": len(errors),
            "first_errors": errors[:5],
            "wall_s": round(time.perf_counter() - started, 2),
        }
        report = {"pipeline": plan["pipeline"], "max_tokens": args.max_tokens, **results}
        print(json.dumps(report, indent=2))
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=2) + "\n")
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
