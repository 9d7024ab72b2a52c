"""`python -m agents loopback`: P, RLD and MD as separate agent processes on loopback (P and RLD
in dc-a, MD in dc-b behind a shaped WAN link), MD's cache warmed with the prompt's first M
tokens, one greedy request through the same `POST /v1/pdd/generate` call the gateway uses."""

from __future__ import annotations

import json
import random
import time
from typing import Any

import httpx

from agents.node.launch import AgentProcess
from pdd.dataplane import bearer_headers, env_data_token
from pdd.vocab import Pipeline


def make_prompt(length: int, seed: int) -> list[int]:
    """Printable-byte token ids (baton-tiny's byte vocabulary), reproducible from the seed."""
    rng = random.Random(seed)
    return [rng.randrange(32, 127) for _ in range(length)]


def stream_events(
    url: str, body: dict[str, Any], timeout_s: float = 300.0, headers: dict[str, str] | None = None
) -> tuple[list[dict[str, Any]], float | None, float]:
    """POST and read the NDJSON events; returns (events, client TTFT, client e2e). Without
    `headers`, sends $BATON_DATA_TOKEN (the agents started from this environment need it)."""
    if headers is None:
        headers = bearer_headers(env_data_token())
    events: list[dict[str, Any]] = []
    started = time.monotonic()
    ttft = None
    with (
        httpx.Client(timeout=httpx.Timeout(30.0, read=timeout_s)) as http,
        http.stream("POST", url, json=body, headers=headers) as response,
    ):
        if response.status_code != 200:
            response.read()
            return (
                [
                    {
                        "type": "error",
                        "message": f"HTTP {response.status_code}: {response.text[:500]}",
                    }
                ],
                None,
                time.monotonic() - started,
            )
        for line in response.iter_lines():
            if not line.strip():
                continue
            event = json.loads(line)
            if event.get("type") == "token" and ttft is None:
                ttft = time.monotonic() - started
            events.append(event)
    return events, ttft, time.monotonic() - started


def summarize(events: list[dict[str, Any]]) -> dict[str, Any]:
    tokens = [e for e in events if e.get("type") == "token"]
    done = next((e for e in events if e.get("type") == "done"), None)
    error = next((e for e in events if e.get("type") == "error"), None)
    return {
        "output_token_ids": [e["token_id"] for e in tokens],
        "indexes": [e["index"] for e in tokens],
        "roles": [e["role"] for e in tokens],
        "finish_reason": done.get("finish_reason") if done else None,
        "stats": (done or {}).get("stats", {}),
        "error": error.get("message") if error else None,
    }


def pdd_body(
    request_id: str,
    prompt: list[int],
    max_tokens: int,
    pipeline: str,
    handoff: str,
    p: AgentProcess,
    rld: AgentProcess | None,
    md: AgentProcess,
    *,
    catch_up_batch: int = 64,
    handoff_at: int = 0,
    max_catch_up_batches: int | None = None,
    main_datacenter: str = "dc-b",
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "request_id": request_id,
        "prompt_ids": prompt,
        "sampling": {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True},
        "pipeline": pipeline,
        "handoff_mode": handoff,
        "catch_up_batch": catch_up_batch,
        "handoff_at": handoff_at,
        **({} if max_catch_up_batches is None else {"max_catch_up_batches": max_catch_up_batches}),
        "main": {
            "http": md.http,
            "kv_host": "127.0.0.1",
            "kv_port": md.kv_port,
            "wan_port": md.wan_port,
            "instance": "0",
            "datacenter": main_datacenter,
        },
        "relay": None,
    }
    if rld is not None:
        body["relay"] = {
            "http": rld.http,
            "kv_host": "127.0.0.1",
            "kv_port": rld.kv_port,
            "instance": "0",
            "datacenter": "dc-a",
        }
    return body


def agent_args(role: str, datacenter: str, link: str | None, threads: int) -> list[str]:
    args = [
        "--role",
        role,
        "--model",
        "baton-tiny",
        "--datacenter",
        datacenter,
        "--listen",
        "127.0.0.1:0",
        "--kv-listen",
        "127.0.0.1:0",
        "--threads",
        str(threads),
    ]
    if link:
        args += ["--link", link]
    return args


def warm_main(md: AgentProcess, prompt: list[int], cached_len: int) -> None:
    """Run the prompt's first cached_len tokens on MD, so its DRC holds them (whole blocks)."""
    if cached_len <= 0:
        return
    events, _, _ = stream_events(
        f"{md.http}/v1/generate",
        {
            "prompt_ids": prompt[:cached_len],
            "sampling": {"max_tokens": 1},
            "request_id": "warm-main",
        },
    )
    if not any(e.get("type") == "done" for e in events):
        raise RuntimeError(f"warming MD failed: {events}")


def run_loopback(args) -> dict[str, Any]:
    prompt = make_prompt(args.prompt_len, args.seed)
    procs: list[AgentProcess] = []
    share = {"single": 1, Pipeline.P_MD: 2}.get(args.pipeline, 3)  # agents on this host's cores
    try:
        if args.pipeline == "single":
            one = AgentProcess(agent_args("main_decode", "dc-a", None, args.threads), "single", 1)
            procs.append(one.start())
            warm_main(one, prompt, args.cached_len)
            events, ttft, e2e = stream_events(
                f"{one.http}/v1/generate",
                {
                    "request_id": "loopback",
                    "prompt_ids": prompt,
                    "sampling": {"max_tokens": args.max_tokens, "ignore_eos": True},
                },
            )
            result = summarize(events)
            return {
                "pipeline": "single",
                "output_token_ids": result["output_token_ids"],
                "ttft_s": ttft,
                "e2e_s": e2e,
                "tokens_by_role": {"rld": 0, "md": 0, "single": len(result["output_token_ids"])},
                "handoff": {"mode": None, "at_token": None, "batches": 0},
                "kv_bytes": {"intra_dc": 0, "wan": 0},
                "handoff_bytes": 0,
                "finish_reason": result["finish_reason"],
                "error": result["error"],
            }
        link = f"{args.wan_gbps}:{args.wan_rtt_ms}:{args.wan_pool}"
        md_dc = args.md_datacenter
        md_link = f"dc-a={link}" if md_dc == "dc-b" else None  # in P's datacenter: no WAN
        md = AgentProcess(agent_args("main_decode", md_dc, md_link, args.threads), "md", share)
        p = AgentProcess(agent_args("prefill", "dc-a", f"dc-b={link}", args.threads), "p", share)
        rld = None
        procs += [md.start(), p.start()]
        if args.pipeline == Pipeline.P_RLD_MD:
            rld = AgentProcess(
                agent_args("relay_decode", "dc-a", f"dc-b={link}", args.threads), "rld", share
            )
            procs.append(rld.start())
        warm_main(md, prompt, args.cached_len)
        body = pdd_body(
            "loopback",
            prompt,
            args.max_tokens,
            args.pipeline,
            args.handoff,
            p,
            rld,
            md,
            catch_up_batch=args.catch_up_batch,
            handoff_at=args.handoff_at,
            main_datacenter=md_dc,
        )
        events, ttft, e2e = stream_events(f"{p.http}/v1/pdd/generate", body)
        result = summarize(events)
        stats = result["stats"]
        roles = stats.get("tokens_by_role", {})
        handoff = stats.get("handoff", {})
        return {
            "pipeline": args.pipeline,
            "output_token_ids": result["output_token_ids"],
            "ttft_s": ttft,
            "e2e_s": e2e,
            "tokens_by_role": {
                "rld": roles.get("rld", 0),
                "md": roles.get("md", 0),
                "prefill": roles.get("prefill", 0),
            },
            "handoff": {
                "mode": handoff.get("mode"),
                "at_token": handoff.get("at_token"),
                "batches": handoff.get("batches", 0),
                "completed": handoff.get("completed"),
                "failed": handoff.get("failed"),
            },
            "kv_bytes": stats.get("kv_bytes", {"intra_dc": 0, "wan": 0}),
            "handoff_bytes": stats.get("handoff_bytes", 0),
            "cached_tokens": stats.get("cached_tokens", 0),
            # At P, by the one TTFT definition: P's token leaves with the decoding role's first
            # token, so ttft_s = prefill_s + kv_wait_s (the KV transfer that role waited for).
            "server_ttft_s": stats.get("ttft_s"),
            "prefill_s": stats.get("prefill_s"),
            "kv_wait_s": stats.get("kv_wait_s"),
            "max_gap_s": stats.get("max_gap_s"),
            "finish_reason": result["finish_reason"],
            "error": result["error"],
        }
    finally:
        for proc in procs:
            proc.terminate(timeout_s=30)
            proc.cleanup()
