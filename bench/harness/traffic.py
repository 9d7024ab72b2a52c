"""Agentic traffic against the gateway, from the one workload model (planner.workload).

Sessions are multi-turn conversations: every turn resends the conversation so far (the
assistant's real answers included) plus a new user message, so the prefix caches hit the way
agent loops make them hit; openings are the low-hit requests. Token counts come from a scaled-
down `ContextGrowth` (baton-tiny has a 2K context); the byte tokenizer makes one token per
ASCII character, so message lengths are exact.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from bench.harness.prompts import filler
from planner.workload import ContextGrowth, HitRateDist, LengthDist, WorkloadSpec, generate


def demo_workload(*, rps: float, duration_s: float, seed: int) -> WorkloadSpec:
    """The production shape at toy scale: long-ish openings, small appends, short outputs."""
    return WorkloadSpec(
        rps=rps,
        duration_s=duration_s,
        seed=seed,
        mean_turns=6.0,
        turn_gap_s=4.0,
        output_tokens=LengthDist(median=40, sigma=0.7, min=4, max=160),
        hit_rate=HitRateDist(kind="session"),
        context=ContextGrowth(
            first_prompt=LengthDist(median=700, sigma=0.4, min=200, max=1400),
            append=LengthDist(median=60, sigma=0.8, min=8, max=400),
            shared_prefix_tokens=64,
            max_context_tokens=1700,
        ),
    )


def paper_workload(*, rps: float, duration_s: float, seed: int) -> WorkloadSpec:
    """The published agentic shape for the emulated paper model (docs/emulation.md): openings of
    median 40K tokens sharing a 4K-token system prompt, small appends, contexts up to 128K,
    outputs of a few hundred tokens (docs/pdd.md: ~30% under 100, ~40% up to 500)."""
    return WorkloadSpec(
        rps=rps,
        duration_s=duration_s,
        seed=seed,
        mean_turns=8.0,
        turn_gap_s=10.0,
        output_tokens=LengthDist(median=150, sigma=0.9, min=8, max=1000),
        hit_rate=HitRateDist(kind="session"),
        context=ContextGrowth(
            first_prompt=LengthDist(median=40_000, sigma=0.6, min=1024, max=100_000),
            append=LengthDist(median=300, sigma=1.2, min=1, max=16_384),
            shared_prefix_tokens=4000,
            max_context_tokens=131_072,
        ),
    )


SYSTEM_HEAD = "You are Baton's demo agent. "


def session_options(spec: WorkloadSpec) -> dict[str, int]:
    """`replay`'s session options for a spec with a context model: compact at its max context,
    open with a system prompt of its shared prefix's tokens."""
    if spec.context is None:
        raise ValueError("workload.context: required for session options")
    return {
        "max_context": spec.context.max_context_tokens,
        "system_tokens": spec.context.shared_prefix_tokens - len(SYSTEM_HEAD),
    }


@dataclass
class TrafficStats:
    sent: int = 0
    ok: int = 0
    failed: int = 0
    by_status: Counter = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)

    def line(self) -> str:
        lat = sorted(self.latencies)
        p50 = lat[len(lat) // 2] if lat else 0.0
        return (
            f"sent {self.sent}, ok {self.ok}, failed {self.failed} "
            f"({dict(self.by_status)}), median latency {p50:.2f} s"
        )


async def replay(
    *,
    base_url: str,
    api_key: str,
    model: str,
    spec: WorkloadSpec,
    stop: asyncio.Event,
    stats: TrafficStats,
    max_in_flight: int = 8,
    max_context: int = 1500,
    system_tokens: int = 60,
) -> None:
    """Send the trace's requests at their arrival times until it ends or `stop` is set. A
    session's context is compacted (a fresh one) past `max_context` tokens (1,500 fits
    baton-tiny's 2K positions); every session opens with the same system prompt, SYSTEM_HEAD
    and `system_tokens` tokens of filler (`session_options` sizes both from a spec)."""
    trace = generate(spec)
    rng = random.Random(spec.seed)
    limit = max_context
    system = SYSTEM_HEAD + filler(rng, system_tokens, pad=False)
    sessions: dict[int, list[dict]] = {}
    gate = asyncio.Semaphore(max_in_flight)
    started = time.monotonic()
    async with httpx.AsyncClient(
        base_url=base_url, headers={"Authorization": f"Bearer {api_key}"}, timeout=600
    ) as http:

        async def one(session: int, input_tokens: int, output_tokens: int) -> None:
            history = sessions.setdefault(session, [{"role": "system", "content": system}])
            used = sum(len(m["content"]) + 16 for m in history)
            if used >= input_tokens or used > limit:
                # A compaction (or the opening): a fresh context of the requested size.
                history[:] = [{"role": "system", "content": system + filler(rng, 40, pad=False)}]
                used = sum(len(m["content"]) + 16 for m in history)
            need = max(8, input_tokens - used - 16)
            history.append(
                {"role": "user", "content": f"[s{session}] " + filler(rng, need, pad=False)}
            )
            body = {
                "model": model,
                "messages": history,
                "max_tokens": int(output_tokens),
                "temperature": 0,
            }
            async with gate:
                stats.sent += 1
                t0 = time.monotonic()
                try:
                    response = await http.post("/v1/chat/completions", json=body)
                except httpx.HTTPError as exc:
                    stats.failed += 1
                    stats.by_status[type(exc).__name__] += 1
                    history.pop()
                    return
            stats.by_status[response.status_code] += 1
            if response.status_code != 200:
                stats.failed += 1
                history.pop()
                return
            stats.ok += 1
            stats.latencies.append(time.monotonic() - t0)
            answer = response.json()["choices"][0]["message"]["content"]
            history.append({"role": "assistant", "content": answer})

        tasks: set[asyncio.Task] = set()
        for arrival, session, inp, out in zip(
            trace.arrival_s.tolist(),
            trace.session_id.tolist(),
            trace.input_tokens.tolist(),
            trace.output_tokens.tolist(),
            strict=True,
        ):
            delay = started + arrival - time.monotonic()
            if delay > 0:
                try:
                    await asyncio.wait_for(stop.wait(), timeout=delay)
                    break
                except TimeoutError:
                    pass
            if stop.is_set():
                break
            task = asyncio.create_task(one(session, inp, out))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait(tasks, timeout=60)
