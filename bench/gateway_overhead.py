"""The gateway's own overhead per request: the same requests sent (a) through the gateway and
(b) straight to the prefill agent's /v1/pdd/generate with the plan the gateway would send, at 1
and 32 concurrent streams, on the local testbed (real control plane and agents).

Overhead = gateway latency - direct latency (medians and p90 over the same prompts), i.e. what
authentication, rate limiting, tokenization, the policy, SSE framing and the records add. Run:
    .venv/bin/python -m bench.gateway_overhead --requests 64 --out bench/gateway/overhead.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import httpx

from agents.dataplane import bearer_headers, env_data_token
from agents.engine.tokenizer import ByteTokenizer, apply_chat_template
from bench.testbed import start_cluster


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def messages_for(i: int) -> list[dict]:
    # A shared system prompt (cached after the first request) and a short distinct question.
    return [
        {"role": "system", "content": "You are a benchmark assistant. " * 8},
        {"role": "user", "content": f"question {i}: " + "measure me " * 10},
    ]


async def via_gateway(url: str, key: str, i: int, max_tokens: int) -> float:
    body = {
        "model": "baton-tiny",
        "messages": messages_for(i),
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
            async for _ in response.aiter_lines():
                pass
        return time.perf_counter() - t0


async def direct(p_http: str, plan: dict, i: int, max_tokens: int) -> float:
    prompt = ByteTokenizer().encode(apply_chat_template(messages_for(i)))
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
            async for _ in response.aiter_lines():
                pass
        return time.perf_counter() - t0


async def measure(fn, n: int, concurrency: int) -> list[float]:
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> float:
        async with gate:
            return await fn(i)

    return list(await asyncio.gather(*(one(i) for i in range(n))))


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
        results = {}
        for concurrency in (1, 32):
            gateway = asyncio.run(
                measure(
                    lambda i: via_gateway(cluster.url, key, i, args.max_tokens),
                    args.requests,
                    concurrency,
                )
            )
            straight = asyncio.run(
                measure(
                    lambda i: direct(p_http, plan, i, args.max_tokens), args.requests, concurrency
                )
            )
            g, d = summary(gateway), summary(straight)
            results[f"concurrency_{concurrency}"] = {
                "gateway": g,
                "direct_to_prefill_agent": d,
                "overhead_median_ms": round((g["median_s"] - d["median_s"]) * 1000, 1),
                "overhead_p90_ms": round((g["p90_s"] - d["p90_s"]) * 1000, 1),
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
