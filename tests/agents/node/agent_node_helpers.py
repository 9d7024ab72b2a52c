"""Helpers for the agent-process tests (imported by conftest.py and the tests)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import httpx
import pytest

from agents.node.launch import AgentProcess
from agents.node.loopback import make_prompt, pdd_body, stream_events, summarize

FAST_LINK = "1:5:16"  # 1 Gbit/s, 5 ms RTT

# Every pipeline and handoff (id, and the handoff plan's extra fields), for tests that run them
# all: P-MD, P-RLD-MD handing off at once or after 9 tokens, and catch-up in batches of 4.
PIPELINE_CASES = [
    pytest.param("p-md", "one-shot", {}, id="p-md"),
    pytest.param("p-rld-md", "one-shot", {"handoff_at": 0}, id="one-shot-asap"),
    pytest.param("p-rld-md", "one-shot", {"handoff_at": 9}, id="one-shot-at-9"),
    pytest.param(
        "p-rld-md",
        "catch-up",
        {"handoff_at": 8, "catch_up_batch": 4, "max_catch_up_batches": 2},
        id="catch-up",
    ),
]


def agent_args(role: str, dc: str, *extra: str) -> list[str]:
    return [
        "--role",
        role,
        "--datacenter",
        dc,
        "--listen",
        "127.0.0.1:0",
        "--kv-listen",
        "127.0.0.1:0",
        "--threads",
        "1",
        "--num-blocks",
        "256",
        *extra,
    ]


@contextlib.contextmanager
def running(*procs: AgentProcess) -> Iterator[tuple[AgentProcess, ...]]:
    started: list[AgentProcess] = []
    try:
        for proc in procs:
            started.append(proc.start())
        yield tuple(started)
    finally:
        for proc in procs:
            proc.kill()
            proc.cleanup()


def run_single(agent: AgentProcess, prompt: list[int], max_tokens: int) -> dict:
    events, _, _ = stream_events(
        f"{agent.http}/v1/generate",
        {"prompt_ids": prompt, "sampling": {"max_tokens": max_tokens, "ignore_eos": True}},
    )
    return summarize(events)


def run_pdd(p, rld, md, request_id, prompt, max_tokens, pipeline, handoff="one-shot", **kw):
    body = pdd_body(request_id, prompt, max_tokens, pipeline, handoff, p, rld, md, **kw)
    events, _, _ = stream_events(f"{p.http}/v1/pdd/generate", body)
    return summarize(events)


def warm(agent: AgentProcess, prompt: list[int]) -> None:
    events, _, _ = stream_events(
        f"{agent.http}/v1/generate", {"prompt_ids": prompt, "sampling": {"max_tokens": 1}}
    )
    assert events[-1]["type"] == "done", events


def get(agent: AgentProcess, path: str, **kw) -> httpx.Response:
    return httpx.get(f"{agent.http}{path}", timeout=30, **kw)


__all__ = ["make_prompt", "stream_events", "summarize"]


@contextlib.contextmanager
def pdd_agents(
    p_link: str = FAST_LINK, *extra: str, single: bool = True, tag: str = ""
) -> Iterator[dict[str, AgentProcess]]:
    """P and RLD in dc-a, MD in dc-b, P's WAN link to MD `p_link` (the others fast), every
    agent started with `extra` flags; with `single`, one more engine in dc-a for reference
    runs. Yields them by name: "md", "p", "rld" (and "single")."""
    specs = {
        "md": agent_args("main_decode", "dc-b", "--link", f"dc-a={FAST_LINK}", *extra),
        "p": agent_args("prefill", "dc-a", "--link", f"dc-b={p_link}", *extra),
        "rld": agent_args("relay_decode", "dc-a", "--link", f"dc-b={FAST_LINK}", *extra),
    }
    if single:
        specs["single"] = agent_args("main_decode", "dc-a", *extra)
    procs = [AgentProcess(args, name + tag) for name, args in specs.items()]
    with running(*procs) as started:
        yield dict(zip(specs, started, strict=True))
