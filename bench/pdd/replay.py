"""Replays one trace through the gateway with the official `openai` client and measures what
a user sees: TTFT (the first content delta), the gaps between content deltas, e2e.

Sessions are closed loop, as the trace says: a turn is sent at its drawn time or when the
session's previous answer has ended, whichever is later, and it resends the conversation so
far (the real answers included) plus a new user message sized so the prompt has the trace's
token count (baton-tiny's byte tokenizer: one token per ASCII character, and the chat
template's framing is counted). A session whose first turn in the trace is not its opening
began before the trace: its context so far is sent once before the clock starts (the
*prewarm*, two output tokens, unmeasured), so P's and MD's prefix caches hold what a
long-running fleet's would, as the simulator's warm start assumes.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from openai import AsyncOpenAI

from bench.harness import prompts
from bench.harness.prompts import filler
from bench.pdd import scaling
from pdd.tokenizer import apply_chat_template
from planner.workload import Trace

SYSTEM_HEAD = "You are Baton's benchmark agent; answer tersely. "
USER_FRAME = len("<|user|>\n") + 1  # tokens the template adds around a user message


def system_message() -> dict:
    """The system prompt every session shares: exactly the trace's shared prefix tokens."""
    return prompts.system_message(scaling.SHARED_PREFIX_TOKENS, SYSTEM_HEAD)


def prompt_tokens(messages: list[dict]) -> int:
    return len(apply_chat_template(messages, True).encode("utf-8"))


@dataclass
class Result:
    index: int
    session: int
    drawn_s: float
    input_tokens: int  # the trace's
    max_tokens: int
    sent_s: float = float("nan")
    ttft_s: float = float("nan")
    e2e_s: float = float("nan")
    max_gap_s: float = float("nan")
    tpot_s: float = float("nan")
    chunks: int = 0
    request_id: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str = ""
    completed: bool = False
    error: str = ""


@dataclass
class Progress:
    total: int = 0
    sent: int = 0
    done: int = 0
    failed: int = 0
    phase: str = ""
    started: float = field(default_factory=time.monotonic)


async def one_request(
    client: AsyncOpenAI, model: str, messages: list[dict], max_tokens: int, result: Result
) -> str:
    """Stream one chat completion; fill ``result``; return the answer text ('' on failure)."""
    pieces: list[str] = []
    t0 = time.monotonic()
    first = last = None
    gaps = 0.0
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            result.request_id = result.request_id or chunk.id
            if chunk.usage is not None:
                result.prompt_tokens = chunk.usage.prompt_tokens
                result.completion_tokens = chunk.usage.completion_tokens
                details = chunk.usage.prompt_tokens_details
                result.cached_tokens = int(getattr(details, "cached_tokens", 0) or 0)
            for choice in chunk.choices:
                text = choice.delta.content if choice.delta else None
                if text:
                    now = time.monotonic()
                    if first is None:
                        first = now
                    else:
                        gaps = max(gaps, now - last)
                    last = now
                    result.chunks += 1
                    pieces.append(text)
                if choice.finish_reason:
                    result.finish_reason = choice.finish_reason
        result.completed = bool(result.finish_reason) and result.completion_tokens > 0
        if not result.completed:
            result.error = "stream ended without a finish reason or usage"
    except Exception as exc:  # noqa: BLE001 - every failure is a measured outcome
        result.error = f"{type(exc).__name__}: {exc}"[:300]
    end = time.monotonic()
    result.e2e_s = end - t0
    if first is not None:
        result.ttft_s = first - t0
        result.max_gap_s = gaps
        n = result.completion_tokens or result.chunks
        if n > 1:
            result.tpot_s = (last - first) / (n - 1)
    return "".join(pieces) if result.completed else ""


async def replay(
    *,
    base_url: str,
    api_key: str,
    model: str,
    trace: Trace,
    tag: str,
    progress: Progress,
    drain_s: float = 60.0,
    prewarm_wait: Callable[[int], float] | None = None,
    on_start: Callable[[], None] | None = None,
) -> dict:
    """Prewarm, then replay ``trace``; the per-request results and the run's wall times.
    ``on_start()`` runs once the prewarm is over, just before the measured replay starts."""
    rng = random.Random(f"{tag}-{len(trace)}")
    system = system_message()
    n = len(trace)
    arrival = trace.arrival_s.tolist()
    sessions = trace.session_id.tolist()
    inputs = trace.input_tokens.tolist()
    cached = trace.cached_tokens.tolist()
    outputs = trace.output_tokens.tolist()
    prev = trace.previous_turn().tolist()
    shared = scaling.SHARED_PREFIX_TOKENS
    history: dict[int, list[dict]] = {}
    results = [Result(i, sessions[i], arrival[i], inputs[i], int(outputs[i])) for i in range(n)]
    ended = [asyncio.Event() for _ in range(n)]
    answers: list[str | None] = [None] * n

    def user(session: int, size: int) -> dict:
        head = f"[{tag}s{session}] "
        return {"role": "user", "content": head + filler(rng, max(size - len(head), 4))}

    def fresh(session: int, target: int) -> list[dict]:
        msgs = [dict(system)]
        size = target - prompt_tokens(msgs) - USER_FRAME
        msgs.append(user(session, size))
        return msgs

    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, timeout=180)
    # --- prewarm: the contexts of sessions that began before the trace ---------------------
    warm = [i for i in range(n) if prev[i] < 0 and cached[i] > shared and cached[i] < inputs[i]]
    progress.phase = f"prewarm ({len(warm)} sessions)"
    warm_bytes = 0
    sem = asyncio.Semaphore(6)

    async def prewarm(i: int) -> None:
        nonlocal warm_bytes
        msgs = fresh(sessions[i], cached[i])
        async with sem:
            # Two output tokens: with one, P finishes the request alone and MD never gets its KV.
            r = Result(-1, sessions[i], 0.0, cached[i], 2)
            answer = await one_request(client, model, msgs, 2, r)
        msgs.append({"role": "assistant", "content": answer})
        history[sessions[i]] = msgs
        warm_bytes += cached[i] * scaling.KV_BYTES_PER_TOKEN

    t_warm = time.monotonic()
    await asyncio.gather(*(prewarm(i) for i in warm))
    if prewarm_wait is not None:
        await asyncio.sleep(prewarm_wait(warm_bytes))
    prewarm_s = time.monotonic() - t_warm
    if on_start is not None:
        on_start()

    # --- the measured replay ----------------------------------------------------------------
    progress.phase = "replay"
    progress.total, progress.sent, progress.done, progress.failed = n, 0, 0, 0
    start = time.monotonic()
    start_wall = time.time()

    async def turn(i: int) -> None:
        delay = start + arrival[i] - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        j = prev[i]
        if j >= 0:
            await ended[j].wait()  # closed loop: the agent waits for its previous answer
        s = sessions[i]
        msgs = history.get(s)
        if msgs is None or cached[i] <= shared:
            msgs = fresh(s, inputs[i])  # an opening or a compaction: a fresh context
        else:
            if j >= 0 and answers[j] is not None:
                msgs = msgs + [{"role": "assistant", "content": answers[j]}]
            size = inputs[i] - prompt_tokens(msgs) - USER_FRAME
            msgs = msgs + [user(s, max(size, 8))]
        history[s] = msgs
        res = results[i]
        res.sent_s = time.monotonic() - start
        progress.sent += 1
        answers[i] = await one_request(client, model, msgs, res.max_tokens, res)
        if res.completed:
            progress.done += 1
        else:
            progress.failed += 1
        ended[i].set()

    tasks = [asyncio.create_task(turn(i)) for i in range(n)]
    last_arrival = arrival[-1] if n else 0.0
    _, pending = await asyncio.wait(tasks, timeout=last_arrival + drain_s)
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)
    end = time.monotonic()
    await client.close()
    return {
        "results": [asdict(r) for r in results],
        "start_wall": start_wall,
        "span_s": end - start,
        "last_arrival_s": last_arrival,
        "prewarm_sessions": len(warm),
        "prewarm_s": prewarm_s,
        "unfinished_at_drain": len(pending),
    }
