"""Agentic turns over a slow WAN, real agent processes on loopback: MD counts the previous
turn's KV while it is still crossing the WAN (reserved, in flight) in the next turn's prefix
match, so P sends only the delta; when that KV never lands MD recomputes the prefix it
counted on (p-md) or RLD finishes the turn (p-rld-md), never a hang."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from agent_node_helpers import (
    get,
    make_prompt,
    pdd_agents,
    run_pdd,
    run_single,
    summarize,
)

from agents.engine.kv_pool import KV_HEADER_BYTES
from agents.node.launch import AgentProcess
from agents.node.loopback import pdd_body

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
KV_BYTES_PER_TOKEN = 2 * 4 * 2 * 64 * 4  # baton-tiny: K and V, 4 layers, 2 KV heads, dim 64, f32
BS = 16
# 2 Mbit/s = 250 KB/s: a 405-token prompt's KV (1.66 MB) needs ~6.6 s to reach MD, while RLD
# (intra-DC, unshaped) answers the few output tokens in well under a second.
SLOW_LINK = "0.002:5:16"


@pytest.fixture(scope="module")
def slow_wan():
    """P and RLD in dc-a, MD in dc-b behind a slow WAN from P, and one engine for `single`."""
    with pdd_agents(SLOW_LINK, tag="-slow-wan") as agents:
        yield agents


def assert_one_ordered_stream(result: dict) -> None:
    assert result["error"] is None, result["error"]
    assert result["indexes"] == list(range(len(result["output_token_ids"])))


def in_flight(md: AgentProcess) -> dict:
    return get(md, "/state").json()["kv_in_flight"]


def wait_until(predicate, timeout_s: float = 90.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def md_settled(md: AgentProcess) -> bool:
    state = in_flight(md)
    return state["incoming"] == 0 and state["reservations"] == 0


def in_background(fn) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def target() -> None:
        out["result"] = fn()

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, out


def test_next_turn_counts_the_previous_turns_kv_in_flight(slow_wan):
    p, rld, md, single = slow_wan["p"], slow_wan["rld"], slow_wan["md"], slow_wan["single"]
    turn1_prompt = make_prompt(405, 61)
    turn1_expected = run_single(single, turn1_prompt, 4)["output_token_ids"]
    # The agent's next turn: the whole conversation so far plus a few new tokens.
    turn2_prompt = turn1_prompt + turn1_expected + make_prompt(11, 62)
    turn2_expected = run_single(single, turn2_prompt, 8)["output_token_ids"]
    hits_before = in_flight(md)["prefix_hits"]

    # Turn 1: RLD answers alone (handoff_at beyond max_tokens) while its KV crawls to MD.
    body = pdd_body("turn-1", turn1_prompt, 4, "p-rld-md", "one-shot", p, rld, md, handoff_at=50)
    events: list[dict] = []
    turn2: tuple[threading.Thread, dict] | None = None
    with (
        httpx.Client(timeout=httpx.Timeout(30, read=180)) as http,
        http.stream("POST", f"{p.http}/v1/pdd/generate", json=body) as response,
    ):
        assert response.status_code == 200
        first_at = None
        for line in response.iter_lines():
            if not line.strip():
                continue
            events.append(json.loads(line))
            first_at = first_at or time.monotonic()
            if turn2 is None and events[-1].get("index") == 3:
                # The user has turn 1's answer: the agent sends turn 2 at once.
                turn2 = in_background(
                    lambda: run_pdd(p, rld, md, "turn-2", turn2_prompt, 8, "p-md")
                )
        ended_after_first_s = time.monotonic() - first_at
    assert turn2 is not None, events
    # The user's stream ends with RLD's answer, not when the background KV for MD lands
    # (1.66 MB at 2 Mbit/s needs >= 6.6 s from about P's first token on).
    assert ended_after_first_s < 5.0
    turn2[0].join(240)
    assert not turn2[0].is_alive(), "turn 2 hung"

    first = summarize(events)
    assert_one_ordered_stream(first)
    assert first["output_token_ids"] == turn1_expected
    assert first["stats"]["tokens_by_role"]["md"] == 0

    second = turn2[1]["result"]
    assert_one_ordered_stream(second)
    stats = second["stats"]
    cached = len(turn1_prompt) // BS * BS
    assert stats["cached_tokens"] == cached == 400
    assert stats["kv_bytes"]["wan"] == KV_HEADER_BYTES + (len(turn2_prompt) - cached) * (
        KV_BYTES_PER_TOKEN
    )
    assert second["output_token_ids"] == turn2_expected
    # MD answered from turn 1's KV in flight (its radix cache did not hold it yet) ...
    assert in_flight(md)["prefix_hits"] == hits_before + 1
    # ... and forgets both turns once they are imported.
    assert wait_until(lambda: md_settled(md)), in_flight(md)


def reserve(md: AgentProcess, request_id: str, prompt: list[int]) -> int:
    response = httpx.post(
        f"{md.http}/v1/pdd/reserve",
        json={"request_id": request_id, "instance": "0", "prompt_ids": prompt},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    return response.json()["cached_tokens"]


def cancel(agent: AgentProcess, request_id: str) -> None:
    response = httpx.post(
        f"{agent.http}/v1/pdd/cancel", json={"request_id": request_id}, timeout=30
    )
    assert response.status_code == 200, response.text


def test_kv_in_flight_that_never_lands_is_recomputed_by_md_for_the_next_turn(slow_wan):
    p, rld, md, single = slow_wan["p"], slow_wan["rld"], slow_wan["md"], slow_wan["single"]
    earlier = make_prompt(64, 71)
    prompt = earlier + make_prompt(16, 72)
    expected = run_single(single, prompt, 8)["output_token_ids"]

    # p-md: a reservation whose KV never comes ("ghost") counts, the next turn's import waits
    # for it; cancelling the ghost ends the wait and MD computes the 64 tokens it counted on
    # from the prompt's ids: the user gets the same tokens, not an error or a hang.
    assert reserve(md, "ghost", earlier) == 0
    hits = in_flight(md)["prefix_hits"]
    recomputed = in_flight(md)["recomputed_imports"], in_flight(md)["recomputed_tokens"]
    thread, out = in_background(lambda: run_pdd(p, rld, md, "on-ghost", prompt, 8, "p-md"))
    assert wait_until(lambda: in_flight(md)["prefix_hits"] == hits + 1)
    time.sleep(0.5)
    assert thread.is_alive()  # waiting for the ghost's KV
    cancel(md, "ghost")
    thread.join(120)
    assert not thread.is_alive(), "the dependent request hung"
    assert_one_ordered_stream(out["result"])
    assert out["result"]["output_token_ids"] == expected
    assert out["result"]["stats"]["cached_tokens"] == 64
    assert (in_flight(md)["recomputed_imports"], in_flight(md)["recomputed_tokens"]) == (
        recomputed[0] + 1,
        recomputed[1] + 64,
    )
    assert wait_until(lambda: md_settled(md)), in_flight(md)

    # p-rld-md (a fresh context, MD now caches the first): the same wait costs the user
    # nothing, RLD finishes the request with the same tokens; MD, left waiting to cache the
    # KV, recomputes the ghost's prefix once it is cancelled and caches the turn, so its
    # cache stays aligned with P's.
    earlier = make_prompt(64, 73)
    prompt = earlier + make_prompt(16, 74)
    expected = run_single(single, prompt, 8)["output_token_ids"]
    assert reserve(md, "ghost-2", earlier) == 0
    relayed = run_pdd(p, rld, md, "on-ghost-2", prompt, 8, "p-rld-md", handoff_at=0)
    assert_one_ordered_stream(relayed)
    assert relayed["output_token_ids"] == expected
    assert relayed["stats"]["cached_tokens"] == 64
    assert relayed["stats"]["tokens_by_role"]["md"] == 0
    assert in_flight(md)["prefix_hits"] == hits + 2
    cancel(md, "ghost-2")
    assert wait_until(lambda: md_settled(md)), in_flight(md)
    assert in_flight(md)["recomputed_imports"] == recomputed[0] + 2

    # Nothing in flight any more: the same turn finds its whole prompt (80 tokens, five
    # blocks) in MD's cache.
    result = run_pdd(p, rld, md, "after-ghosts", prompt, 8, "p-md")
    assert_one_ordered_stream(result)
    assert result["output_token_ids"] == expected
    assert result["stats"]["cached_tokens"] == 80
    assert get(md, "/health").json()["status"] == "ok"
    assert wait_until(lambda: md_settled(md)), in_flight(md)
