"""logprobs / top_logprobs through the gateway: asked for in the plan's sampling, returned in
the chat shape and the legacy completions shape, streaming too. The agent here is a real
baton-tiny engine run in process, and the values are checked against the model's own
log-softmax over one forward of prompt + answer (greedy)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from rest_framework.test import APIClient

from agents.engine import Engine, EngineConfig, PagedKVPool, build_baton_tiny
from agents.engine.batch import SeqChunk, build_forward_batch
from agents.node.wire import parse_sampling, token_event
from billing import services as billing
from billing.models import Tenant
from fleet import live as fleet_live
from fleet.choices import InstanceRole
from pdd.token_ids import from_wire
from routing.gateway import run as gw_run
from routing.gateway.openai_shapes import completion_logprobs
from tests.routing.gateway.conftest import post_stream
from tests.routing.gateway.test_route_around_the_dead import _one_dc_fleet

torch.set_num_threads(1)
ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny():
    return build_baton_tiny(seed=0)


def _reference(tiny, ids: list[int]) -> torch.Tensor:
    """log-softmax of the model's logits over `ids` in one forward (row t: token t + 1)."""
    cfg, bs = tiny.config, 16
    blocks = -(-len(ids) // bs)
    pool = PagedKVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, blocks, bs)
    batch = build_forward_batch([SeqChunk(ids, 0, pool.allocate(blocks))], bs)
    with torch.inference_mode():
        logits = tiny.model(batch, pool.k_cache, pool.v_cache).float()
    return torch.log_softmax(logits, dim=-1)


@pytest.fixture
def fleet(transactional_db, settings, monkeypatch, tiny):
    """A P and an MD in the live view; the 'agents' are one in-process engine that streams
    token events as the node roles do (agents/node/wire.token_event)."""
    settings.REDIS_URL = ""
    _one_dc_fleet(("p", InstanceRole.PREFILL), ("md", InstanceRole.MAIN_DECODE))
    plans: list[dict] = []

    async def events(url, plan):
        plans.append(plan)
        engine = Engine(tiny, EngineConfig(block_size=16, num_blocks=64))
        sampling = parse_sampling(plan["sampling"] | {"ignore_eos": True})
        engine.add_request("r", from_wire(plan["prompt_ids"]), sampling)
        index = 0
        while engine.has_work():
            for out in engine.step():
                for j, token in enumerate(out.token_ids):
                    lp = out.logprobs[j] if out.logprobs else None
                    yield token_event(index, token, "md" if index else "prefill", lp)
                    index += 1
                if out.finished:
                    yield {"type": "done", "finish_reason": out.finish_reason, "stats": {}}

    monkeypatch.setattr(gw_run, "run_events", events)
    tenant = Tenant.objects.create(name="acme", requests_per_minute=100, tokens_per_minute=10**6)
    _, raw = billing.api_key_create(tenant=tenant)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    yield client, plans
    fleet_live._memory.clear()


CHAT = {
    "model": "baton-tiny",
    "messages": [{"role": "user", "content": "tell me about prefill"}],
    "max_tokens": 8,
    "temperature": 0,
}
COMPLETION = {"model": "baton-tiny", "prompt": "tell me about decode", "max_tokens": 8}


def _sse(client, path: str, body: dict) -> list[dict]:
    status, raw = post_stream(client, path, body)
    assert status == 200, raw[:300]
    lines = raw.decode().splitlines()
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


def _check_chat(tiny, plan, content, k):
    prompt = from_wire(plan["prompt_ids"])
    ids = [bytes_[0] for bytes_ in (c["bytes"] for c in content)]  # byte tokens
    ref = _reference(tiny, [*prompt, *ids])
    for j, c in enumerate(content):
        row = ref[len(prompt) - 1 + j]
        assert math.isclose(c["logprob"], float(row[ids[j]]), abs_tol=ATOL)
        assert c["token"] == bytes(c["bytes"]).decode("utf-8", errors="replace")
        top = c["top_logprobs"]
        assert len(top) == k
        values = [t["logprob"] for t in top]
        assert values == sorted(values, reverse=True)
        for t, ref_v in zip(top, row.topk(k).values.tolist(), strict=True):
            assert math.isclose(t["logprob"], ref_v, abs_tol=ATOL)
            assert set(t) == {"token", "logprob", "bytes"}
        if k:  # greedy: the sampled token is the most likely
            assert top[0]["bytes"] == c["bytes"]
            assert math.isclose(top[0]["logprob"], c["logprob"], abs_tol=1e-6)


@pytest.mark.parametrize("k", [0, 5, 20])
def test_chat_logprobs_are_the_models_log_softmax(fleet, tiny, k):
    client, plans = fleet
    body = CHAT | {"logprobs": True, "top_logprobs": k}
    response = client.post("/v1/chat/completions", body, format="json")
    assert response.status_code == 200, response.content
    choice = response.json()["choices"][0]
    assert plans[-1]["sampling"]["logprobs"] == k
    content = choice["logprobs"]["content"]
    assert len(content) == response.json()["usage"]["completion_tokens"] == 8
    assert "".join(c["token"] for c in content) == choice["message"]["content"]
    _check_chat(tiny, plans[-1], content, k)


def test_chat_stream_carries_each_chunks_logprobs(fleet, tiny):
    client, plans = fleet
    body = CHAT | {"logprobs": True, "top_logprobs": 3, "stream": True}
    chunks = _sse(client, "/v1/chat/completions", body)
    assert chunks[0]["choices"][0]["logprobs"] is None  # the role chunk
    content, text = [], ""
    for chunk in chunks[1:]:
        choice = chunk["choices"][0]
        text += choice["delta"].get("content", "")
        if choice["logprobs"] is not None:
            part = choice["logprobs"]["content"]
            if choice["delta"].get("content"):  # a chunk's logprobs are its text's tokens
                assert "".join(c["token"] for c in part) == choice["delta"]["content"]
            content += part
    assert len(content) == 8
    assert "".join(c["token"] for c in content) == text
    _check_chat(tiny, plans[-1], content, 3)


def test_completions_logprobs_in_the_legacy_shape(fleet, tiny):
    client, plans = fleet
    response = client.post("/v1/completions", COMPLETION | {"logprobs": 2}, format="json")
    assert response.status_code == 200, response.content
    choice = response.json()["choices"][0]
    lp = choice["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 8
    assert "".join(lp["tokens"]) == choice["text"]
    offsets = [0]
    for token in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(token))
    assert lp["text_offset"] == offsets
    prompt = from_wire(plans[-1]["prompt_ids"])
    ids = list(choice["text"].encode())
    ref = _reference(tiny, [*prompt, *ids])
    for j, (token, value, top) in enumerate(
        zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True)
    ):
        row = ref[len(prompt) - 1 + j]
        assert math.isclose(value, float(row[ids[j]]), abs_tol=ATOL)
        assert token in top and math.isclose(top[token], value, abs_tol=1e-6)
        assert 1 <= len(top) <= 3  # the top 2, plus the sampled token when not among them


def test_completions_stream_carries_the_legacy_shape(fleet):
    client, _ = fleet
    body = COMPLETION | {"logprobs": 1, "stream": True}
    chunks = [c for c in _sse(client, "/v1/completions", body) if c["choices"]]
    tokens, offsets, text = [], [], ""
    for chunk in chunks:
        choice = chunk["choices"][0]
        text += choice["text"]
        if choice["logprobs"] is not None:
            tokens += choice["logprobs"]["tokens"]
            offsets += choice["logprobs"]["text_offset"]
    assert "".join(tokens) == text and len(tokens) == 8
    assert offsets == sorted(offsets) and offsets[0] == 0


@pytest.mark.parametrize("stream", [False, True])
def test_without_asking_there_are_no_logprobs(fleet, stream):
    client, plans = fleet
    if stream:
        chunks = _sse(client, "/v1/chat/completions", CHAT | {"stream": True})
        assert all(c["choices"][0]["logprobs"] is None for c in chunks if c["choices"])
    else:
        response = client.post("/v1/chat/completions", CHAT, format="json")
        assert response.json()["choices"][0]["logprobs"] is None
    assert "logprobs" not in plans[-1]["sampling"]  # the agents compute none


def test_a_legacy_entry_keeps_the_sampled_token_beside_the_top_ones():
    from pdd.tokenizer import ByteTokenizer
    from routing.gateway.openai_shapes import DeliveredToken

    shaped = completion_logprobs(
        ByteTokenizer(), [DeliveredToken(ord("b"), -2.0, [(ord("a"), -0.5)], 0)]
    )
    assert shaped["top_logprobs"] == [{"a": -0.5, "b": -2.0}]
    assert shaped["tokens"] == ["b"] and shaped["token_logprobs"] == [-2.0]


def test_logprobs_continue_across_a_migration(transactional_db, settings, monkeypatch):
    """The decoder dies after 3 tokens; the new path (the prompt plus those tokens, asked for
    the same logprobs) supplies the rest: one logprob per delivered token, none repeated."""
    settings.REDIS_URL = ""
    _one_dc_fleet(
        ("p", InstanceRole.PREFILL),
        ("md1", InstanceRole.MAIN_DECODE),
        ("md2", InstanceRole.MAIN_DECODE),
    )
    plans: list[dict] = []
    prompt = list(b"hello")

    async def events(url, plan):
        plans.append(plan)
        start = len(from_wire(plan["prompt_ids"])) - len(prompt)
        for i in range(plan["sampling"]["max_tokens"]):
            if len(plans) == 1 and i == 3:
                yield {"type": "error", "message": "downstream stream ended without done"}
                return
            n = start + i
            event = token_event(i, ord("a") + n, "md")
            event |= {"logprob": -n / 10, "top_logprobs": [[ord("a") + n, -n / 10], [0, -9.0]]}
            yield event
        yield {"type": "done", "finish_reason": "length", "stats": {}}

    monkeypatch.setattr(gw_run, "run_events", events)
    tenant = Tenant.objects.create(name="acme", requests_per_minute=100, tokens_per_minute=10**6)
    _, raw = billing.api_key_create(tenant=tenant)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    body = {"model": "baton-tiny", "prompt": "hello", "max_tokens": 8, "logprobs": 1}
    response = client.post("/v1/completions", body, format="json")
    assert response.status_code == 200, response.content
    lp = response.json()["choices"][0]["logprobs"]
    assert response.json()["choices"][0]["text"] == "abcdefgh"
    assert lp["tokens"] == list("abcdefgh")
    assert lp["token_logprobs"] == [-n / 10 for n in range(8)]
    assert lp["text_offset"] == list(range(8))
    assert [p["sampling"]["logprobs"] for p in plans] == [1, 1]
    fleet_live._memory.clear()
