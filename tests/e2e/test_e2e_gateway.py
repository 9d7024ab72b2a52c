"""The gateway end to end, through the official `openai` client, against real agents."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from pdd.tokenizer import ByteTokenizer, apply_chat_template

pytestmark = pytest.mark.slow

MESSAGES = [
    {"role": "system", "content": "You are a terse assistant. " * 6},
    {"role": "user", "content": "List three prime numbers and explain why each is prime. " * 3},
]


def client(cluster, key: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{cluster.url}/v1",
        api_key=key or cluster.setup["key"],
        max_retries=0,
        timeout=120,
    )


def set_policy(cluster, **settings) -> None:
    with cluster.api() as api:
        response = api.patch("/api/v1/routing-policy/", json={"settings": settings})
        assert response.status_code == 200, response.text
    time.sleep(1.2)  # gateways reload within a second


def single_run(cluster, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """The same request on one engine, no transfer: the reference output."""
    agent = cluster.agents["b-md"]
    events = []
    with httpx.stream(
        "POST",
        f"{agent.http}/v1/generate",
        json={"prompt_ids": prompt_ids, "sampling": {"max_tokens": max_tokens, "temperature": 0.0}},
        timeout=120,
    ) as response:
        for line in response.iter_lines():
            if line.strip():
                events.append(json.loads(line))
    return [e["token_id"] for e in events if e["type"] == "token"]


def last_request(cluster) -> dict:
    with cluster.api() as api:
        return api.get("/api/v1/requests/", params={"page_size": 1}).json()["results"][0]


def chat_prompt_ids(messages) -> list[int]:
    return ByteTokenizer().encode(apply_chat_template(messages))


def test_non_streamed_and_streamed_chat_match_a_single_engine_run(cluster):
    set_policy(cluster, wan_time_threshold_s=0.0)  # every request relays: p-rld-md
    messages = [*MESSAGES, {"role": "user", "content": "first question"}]
    reference = ByteTokenizer().decode(single_run(cluster, chat_prompt_ids(messages), 24))
    answer = client(cluster).chat.completions.create(
        model="baton-tiny", messages=messages, max_tokens=24, temperature=0
    )
    assert answer.choices[0].message.content == reference
    assert answer.usage.completion_tokens == 24
    record = last_request(cluster)
    assert record["pipeline"] == "p-rld-md"
    assert record["status"] == "ok"
    assert record["tokens_by_rld"] + record["tokens_by_md"] >= 23

    chunks = client(cluster).chat.completions.create(
        model="baton-tiny",
        messages=messages,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = "", None
    for chunk in chunks:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage:
            usage = chunk.usage
    assert text == reference
    assert usage.completion_tokens == 24
    assert usage.prompt_tokens == len(chat_prompt_ids(messages))


def test_after_the_handoff_the_gateway_reads_md_itself(cluster):
    """One hop per token in p-rld-md too: once MD acknowledged the handoff, RLD's stream ends
    with a `continue` to MD's, which the gateway reads itself; the tokens are single's."""
    set_policy(cluster, wan_time_threshold_s=0.0)  # every request relays: p-rld-md
    messages = [*MESSAGES, {"role": "user", "content": f"one hop {time.time_ns()}"}]
    reference = ByteTokenizer().decode(single_run(cluster, chat_prompt_ids(messages), 200))
    tokens = {host: cluster.command_token(host) for host in cluster.agents}

    def attached() -> int:
        return sum(
            cluster.agent_state(host, tokens[host]).get("handed_over", {}).get("attached", 0)
            for host in cluster.agents
        )

    before = attached()
    answer = client(cluster).chat.completions.create(
        model="baton-tiny", messages=messages, max_tokens=200, temperature=0
    )
    assert answer.choices[0].message.content == reference
    record = last_request(cluster)
    assert record["pipeline"] == "p-rld-md" and record["status"] == "ok", record
    assert record["handoff_at_token"], record  # the handoff completed
    assert record["tokens_by_md"] == 200 - record["handoff_at_token"]
    assert attached() == before + 1  # MD's stream was attached to by the gateway


def test_completions_endpoint_works_with_the_client(cluster):
    set_policy(cluster, wan_time_threshold_s=10.0)
    prompt = "The quick brown fox jumps over the lazy dog. " * 4
    reference = ByteTokenizer().decode(single_run(cluster, ByteTokenizer().encode(prompt), 12))
    answer = client(cluster).completions.create(
        model="baton-tiny", prompt=prompt, max_tokens=12, temperature=0
    )
    assert answer.choices[0].text == reference
    assert answer.choices[0].finish_reason == "length"


def test_low_hit_request_relays_and_high_hit_request_goes_straight_to_main_decode(cluster):
    # Full prompt ~300 tokens x 4 KiB over 1 Gbit/s + 5 ms RTT ~ 15 ms; a cached one ~ 6 ms.
    set_policy(cluster, wan_time_threshold_s=0.010)
    # Unique from the first token: no cache anywhere holds any of it.
    messages = [{"role": "system", "content": f"session {time.time_ns()}"}, *MESSAGES]
    client(cluster).chat.completions.create(
        model="baton-tiny", messages=messages, max_tokens=8, temperature=0
    )
    first = last_request(cluster)
    assert first["pipeline"] == "p-rld-md", first
    # Once MD holds the KV (it lands after RLD's answer) and its heartbeat names the prefix
    # (every 2 s), the same prompt goes straight to MD. Poll instead of one fixed sleep: on a
    # loaded machine the transfer, the import and the next heartbeat can take longer.
    deadline = time.monotonic() + 60
    while True:
        time.sleep(1.0)
        client(cluster).chat.completions.create(
            model="baton-tiny", messages=messages, max_tokens=8, temperature=0
        )
        second = last_request(cluster)
        if second["pipeline"] == "p-md" or time.monotonic() > deadline:
            break
    assert second["pipeline"] == "p-md", second
    assert second["cached_tokens"] >= second["prompt_tokens"] - 32
    assert "high hit" in second["reason"]


def test_a_policy_change_takes_effect_live(cluster):
    messages = [*MESSAGES, {"role": "user", "content": f"policy {time.time_ns()}"}]
    set_policy(cluster, wan_time_threshold_s=10.0)
    client(cluster).chat.completions.create(
        model="baton-tiny", messages=messages, max_tokens=4, temperature=0
    )
    assert last_request(cluster)["pipeline"] == "p-md"
    set_policy(cluster, wan_time_threshold_s=0.0)
    messages[-1]["content"] += " again"
    client(cluster).chat.completions.create(
        model="baton-tiny", messages=messages, max_tokens=4, temperature=0
    )
    assert last_request(cluster)["pipeline"] == "p-rld-md"


def _request_until(cluster, messages, want, timeout_s: float = 60.0) -> dict:
    """Send the chat until its record satisfies ``want`` (a policy change reaches the gateway
    within a second or so; on a loaded machine it can take longer): the last record."""
    deadline = time.monotonic() + timeout_s
    while True:
        messages[-1]["content"] += "."
        client(cluster).chat.completions.create(
            model="baton-tiny", messages=messages, max_tokens=8, temperature=0
        )
        record = last_request(cluster)
        if want(record) or time.monotonic() > deadline:
            return record
        time.sleep(0.5)


def test_records_carry_the_latency_breakdown_and_the_early_token_flag(cluster):
    set_policy(cluster, wan_time_threshold_s=10.0)  # p-md: MD carries on decoding
    messages = [*MESSAGES, {"role": "user", "content": f"latency {time.time_ns()}"}]
    record = _request_until(cluster, messages, lambda r: r["pipeline"] == "p-md")
    assert record["pipeline"] == "p-md" and record["status"] == "ok", record
    assert record["first_token_early"] is False
    assert record["prefill_s"] > 0 and record["kv_wait_s"] > 0
    # The gateway's TTFT counts from the request's arrival, so it holds P's prefill and the
    # wait for MD (the KV delta's transfer and MD's admission) at least.
    assert record["ttft_s"] >= record["prefill_s"] + record["kv_wait_s"]
    assert record["max_gap_s"] is not None and 0 <= record["max_gap_s"] <= record["e2e_s"]

    set_policy(cluster, wan_time_threshold_s=10.0, stream_first_token_early=True)
    try:
        record = _request_until(cluster, messages, lambda r: r["first_token_early"])
        assert record["first_token_early"] is True, record
        assert record["status"] == "ok"
    finally:
        set_policy(cluster, wan_time_threshold_s=10.0)


def test_bad_key_is_401(cluster):
    with pytest.raises(openai.AuthenticationError):
        client(cluster, key="sk-baton-nope-nope").chat.completions.create(
            model="baton-tiny", messages=MESSAGES, max_tokens=4
        )


def test_bad_parameter_is_400(cluster):
    with pytest.raises(openai.BadRequestError) as err:
        client(cluster).chat.completions.create(
            model="baton-tiny", messages=MESSAGES, max_tokens=4, temperature=5
        )
    assert err.value.body["param"] == "temperature"


def test_tenant_over_its_rate_is_429(cluster):
    slow = client(cluster, key=cluster.setup["slow_key"])
    # Rate windows are fixed minutes: both calls must fall in the same one.
    if time.time() % 60 > 50:
        time.sleep(61 - time.time() % 60)
    slow.chat.completions.create(model="baton-tiny", messages=MESSAGES, max_tokens=2, temperature=0)
    with pytest.raises(openai.RateLimitError):
        slow.chat.completions.create(
            model="baton-tiny", messages=MESSAGES, max_tokens=2, temperature=0
        )


def test_model_without_healthy_instances_is_503(cluster):
    with pytest.raises(openai.InternalServerError) as err:
        client(cluster).chat.completions.create(model="orphan", messages=MESSAGES, max_tokens=2)
    assert err.value.status_code == 503


def test_client_disconnect_cancels_the_request_on_the_agents(cluster):
    set_policy(cluster, wan_time_threshold_s=0.0)
    body = {
        "model": "baton-tiny",
        "messages": [*MESSAGES, {"role": "user", "content": f"long {time.time_ns()}"}],
        "max_tokens": 1500,
        "temperature": 0,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {cluster.setup['key']}"}
    with httpx.stream(
        "POST", f"{cluster.url}/v1/chat/completions", json=body, headers=headers, timeout=60
    ) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 3:
                break  # leave mid-stream
    tokens = {host: cluster.command_token(host) for host in cluster.agents}

    def settled():
        record = last_request(cluster)
        active = sum(
            cluster.agent_state(host, tokens[host]).get("active_requests", 0)
            for host in cluster.agents
        )
        return record if record["status"] == "cancelled" and active == 0 else None

    record = cluster.wait_for(settled, 60, "the cancelled request to be recorded and drained")
    assert record["completion_tokens"] < 1500
