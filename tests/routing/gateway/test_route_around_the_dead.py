"""A request that fails before its first token is retried on another path, and the instance
that failed is avoided by every later request until its node reports again."""

from __future__ import annotations

import time

import pytest
from rest_framework.test import APIClient

from billing import services as billing
from billing.models import Tenant
from fleet import live as fleet_live
from fleet.choices import InstanceRole, NodeStatus
from fleet.models import Datacenter, GPUType, Instance, Node, ServedModel
from pdd.token_ids import from_wire
from routing.gateway import records, routes
from routing.gateway import run as gw_run
from routing.gateway.runner import AgentRunError
from routing.models import RequestRecord
from tests.routing.gateway.conftest import post_stream


def _publish(node: Node, inst: Instance) -> None:
    fleet_live.publish_report(
        node_id=node.pk,
        hostname=node.hostname,
        datacenter=node.datacenter.name,
        endpoint=node.agent_endpoint,
        report={
            "instances": [
                {
                    "instance_id": str(inst.pk),
                    "role": inst.role,
                    "state": "running",
                    "load": {"running": 0, "queued": 0, "max_running": 32},
                }
            ]
        },
    )


def _one_dc_fleet(*specs: tuple[str, str]) -> dict[str, tuple[Node, Instance]]:
    """One datacenter; a node with one running, reported instance per (hostname, role)."""
    fleet_live._memory.clear()
    model = ServedModel.objects.create(
        name="baton-tiny", source="baton-tiny", num_layers=4, kv_bytes_per_token=4096
    )
    dc = Datacenter.objects.create(name="dc-a", region="city-a")
    gpu = GPUType.objects.create(
        vendor="g",
        model="gpu",
        peak_bf16_tflops=989,
        memory_gib=80,
        memory_bandwidth_gbps=3350,
        interconnect_gbps=400,
    )
    made = {}
    for i, (name, role) in enumerate(specs):
        node = Node.objects.create(
            hostname=name,
            datacenter=dc,
            gpu_type=gpu,
            gpu_count=8,
            agent_endpoint=f"http://10.0.0.{i + 1}:9000",
            agent_token_prefix=f"t-{name}",
            status=NodeStatus.ONLINE,
        )
        inst = Instance.objects.create(role=role, node=node, served_model=model, gpu_count=8)
        _publish(node, inst)
        made[name] = (node, inst)
    return made


def _tenant_client() -> APIClient:
    tenant = Tenant.objects.create(name="acme", requests_per_minute=100, tokens_per_minute=10**6)
    _, raw = billing.api_key_create(tenant=tenant)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    return client


@pytest.fixture
def two_prefills(transactional_db, settings, monkeypatch):
    settings.REDIS_URL = ""
    made = _one_dc_fleet(
        ("p1", InstanceRole.PREFILL), ("p2", InstanceRole.PREFILL), ("md", InstanceRole.MAIN_DECODE)
    )
    dead_url = made["p1"][0].agent_endpoint
    calls: list[str] = []

    async def events(url, plan):
        calls.append(url)
        if url.startswith(dead_url):
            raise AgentRunError("prefill agent unreachable: connection refused")
        for i, token in enumerate(b"ok!"):
            yield {"type": "token", "index": i, "token_id": token, "role": "md"}
        yield {"type": "done", "finish_reason": "length", "stats": {}}

    monkeypatch.setattr(gw_run, "run_events", events)
    yield _tenant_client(), made, calls, dead_url
    fleet_live._memory.clear()


def _send(client):
    return client.post(
        "/v1/completions",
        {"model": "baton-tiny", "prompt": "hello", "max_tokens": 3},
        format="json",
    )


def test_a_dead_prefill_is_retried_elsewhere_and_then_avoided(two_prefills):
    client, made, calls, dead_url = two_prefills
    # Send until a request lands on the dead P first (the policy picks the least loaded).
    for _ in range(6):
        response = _send(client)
        assert response.status_code == 200, response.content
        assert response.json()["choices"][0]["text"] == "ok!"
        if any(u.startswith(dead_url) for u in calls):
            break
    assert any(u.startswith(dead_url) for u in calls), "the dead P was never chosen"
    record = RequestRecord.objects.filter(decision__inputs__has_key="retried").first()
    assert record is not None and record.status == "ok"
    assert record.prefill_instance == str(made["p2"][1].pk)
    assert record.decision.inputs["retried"][0]["instances"] == [str(made["p1"][1].pk)]
    # Every later request avoids the dead P at once, without trying it.
    calls.clear()
    for _ in range(4):
        assert _send(client).status_code == 200
    assert not any(u.startswith(dead_url) for u in calls)
    # A fresh report from the dead P's node clears the suspicion.
    time.sleep(0.01)
    _publish(*made["p1"])
    routes.live_views.clear()
    calls.clear()
    for _ in range(6):
        _send(client)
    assert any(u.startswith(dead_url) for u in calls)


def test_with_every_path_dead_the_request_fails_once_recorded(two_prefills, monkeypatch):
    client, _, calls, _ = two_prefills

    async def broken(url, plan):
        calls.append(url)
        raise AgentRunError("prefill agent unreachable: connection refused")
        yield  # pragma: no cover

    monkeypatch.setattr(gw_run, "run_events", broken)
    response = _send(client)
    assert response.status_code == 502
    assert len(calls) == 2  # both P tried, then no healthy path left
    assert RequestRecord.objects.get().status == "error"


@pytest.fixture
def two_decoders(transactional_db, settings, monkeypatch):
    """One P and two MDs; whichever MD a request goes to first dies after 3 tokens."""
    settings.REDIS_URL = ""
    made = {
        name: inst
        for name, (_, inst) in _one_dc_fleet(
            ("p", InstanceRole.PREFILL),
            ("md1", InstanceRole.MAIN_DECODE),
            ("md2", InstanceRole.MAIN_DECODE),
        ).items()
    }
    # The reference continuation: token k of the answer is ord("a") + k (a greedy "model").
    plans: list[dict] = []

    async def events(url, plan):
        plans.append(plan)
        start = len(from_wire(plan["prompt_ids"])) - len(PROMPT)  # tokens the user already has
        for i in range(plan["sampling"]["max_tokens"]):
            if len(plans) == 1 and i == 3:
                yield {"type": "error", "message": "downstream stream ended without done"}
                return
            yield {"type": "token", "index": i, "token_id": ord("a") + start + i, "role": "md"}
        yield {"type": "done", "finish_reason": "length", "stats": {}}

    monkeypatch.setattr(gw_run, "run_events", events)
    yield _tenant_client(), made, plans
    fleet_live._memory.clear()


PROMPT = list(b"hello")  # baton-tiny's byte tokenizer


@pytest.mark.parametrize("stream", [False, True])
def test_a_decoder_dying_mid_stream_migrates_the_request_without_gap_or_duplicate(
    two_decoders, stream
):
    client, made, plans = two_decoders
    body = {"model": "baton-tiny", "prompt": "hello", "max_tokens": 8, "stream": stream}
    if stream:
        import json

        status, raw = post_stream(client, "/v1/completions", body)
        assert status == 200
        text = ""
        for line in raw.decode().splitlines():
            if line.startswith("data: {"):
                choices = json.loads(line[6:])["choices"]
                text += choices[0]["text"] if choices else ""
    else:
        response = client.post("/v1/completions", body, format="json")
        assert response.status_code == 200
        text = response.json()["choices"][0]["text"]
    assert text == "abcdefgh"  # 3 tokens, then the rest from the new decoder: no gap, no repeat
    first, second = plans
    assert from_wire(second["prompt_ids"]) == [*from_wire(first["prompt_ids"]), *b"abc"]
    assert second["sampling"]["max_tokens"] == 5
    assert second["main"]["instance"] != first["main"]["instance"]
    assert second["request_id"].endswith("-r1")
    record = RequestRecord.objects.get()
    assert record.status == "ok"
    assert record.migrations == 1
    assert record.completion_tokens == 8
    assert record.prompt_tokens == 5
    assert record.decision.inputs["retried"][0]["migrated_at_token"] == 3


def _freeze_the_first_decoder(monkeypatch, plans: list[dict]) -> None:
    """The first attempt's MD falls silent after 3 tokens; the next attempt answers (token k
    of the answer is ord("a") + k). The stall limit is 0.3 s."""
    import asyncio as aio

    monkeypatch.setattr(gw_run, "STALL_FLOOR_S", 0.3)

    async def events(url, plan):
        plans.append(plan)
        start = len(from_wire(plan["prompt_ids"])) - len(PROMPT)
        for i in range(plan["sampling"]["max_tokens"]):
            if len(plans) == 1 and i == 3:
                await aio.sleep(30)  # frozen
            yield {"type": "token", "index": i, "token_id": ord("a") + start + i, "role": "md"}
        yield {"type": "done", "finish_reason": "length", "stats": {}}

    monkeypatch.setattr(gw_run, "run_events", events)


def test_a_decoder_that_falls_silent_mid_stream_is_migrated(two_decoders, monkeypatch):
    """A frozen MD (SIGSTOP, a black-holed link after the handoff) sends nothing more: after
    the stall limit the request moves on, and the frozen MD is avoided from then on."""
    client, made, plans = two_decoders
    _freeze_the_first_decoder(monkeypatch, plans)
    started = time.monotonic()
    response = client.post(
        "/v1/completions",
        {"model": "baton-tiny", "prompt": "hello", "max_tokens": 8},
        format="json",
    )
    assert time.monotonic() - started < 10
    assert response.json()["choices"][0]["text"] == "abcdefgh"
    record = RequestRecord.objects.get()
    assert record.migrations == 1
    frozen = plans[0]["main"]["instance"]
    assert record.decision.inputs["retried"][0]["instances"] == [frozen]
    assert "stalled" in record.decision.inputs["retried"][0]["error"]


@pytest.mark.parametrize(
    ("message", "role", "pipeline", "expected"),
    [
        ("r1: MD stream ended after the handoff: RemoteProtocolError(...)", "md", "p-rld-md",
         "main"),
        ("r1: downstream stream ended without done: RemoteProtocolError(...)", "", "p-rld-md",
         "relay"),
        ("r1: downstream stream ended without done", "", "p-md", "main"),
        ("stream stalled: no token for 3.0 s (the last one from MD)", "md", "p-rld-md", "main"),
        ("stream stalled: no token for 3.0 s (the last one from RLD)", "rld", "p-rld-md",
         "relay"),
        # The text is never read: a message naming MD without the role blames the next hop.
        ("r1: something about MD", "", "p-rld-md", "relay"),
    ],
)  # fmt: skip
def test_a_failure_implicates_one_decoder_not_both(message, role, pipeline, expected):
    from pdd.policy import Decision

    relay = "2" if pipeline == "p-rld-md" else None
    decision = Decision(pipeline, "one-shot", "1", relay, "3", 0, 10, 0.1, "test")
    got = routes.implicated(decision, AgentRunError(message, at_prefill=False, role=role))
    assert got == [{"main": "3", "relay": "2"}[expected]]
    assert routes.implicated(decision, AgentRunError("unreachable")) == ["1"]


def test_an_error_event_carries_the_role_that_failed():
    from pdd.events import ErrorEvent, parse_event

    event = ErrorEvent("r1: MD failed after the handoff", role="md")
    assert event.to_json() == {"type": "error", "message": event.message, "role": "md"}
    assert parse_event(event.to_json()) == event
    assert parse_event({"type": "error", "message": "x", "role": "p"}).role == ""  # unknown
    assert "role" not in ErrorEvent("x").to_json()


def test_a_prefill_that_sends_no_first_token_fails_over_after_the_timeout(
    two_prefills, monkeypatch
):
    """A frozen P (SIGSTOP: it accepts the connection and says nothing) costs the request the
    first-token timeout, then it runs on the other P; the frozen one is avoided after that."""
    import asyncio as aio

    client, made, calls, dead_url = two_prefills
    monkeypatch.setattr(gw_run, "FIRST_TOKEN_TIMEOUT_S", 0.3)

    async def events(url, plan):
        calls.append(url)
        if url.startswith(dead_url):
            await aio.sleep(30)  # frozen
        for i, token in enumerate(b"ok!"):
            yield {"type": "token", "index": i, "token_id": token, "role": "md"}
        yield {"type": "done", "finish_reason": "length", "stats": {}}

    monkeypatch.setattr(gw_run, "run_events", events)
    started = time.monotonic()
    for _ in range(6):
        response = _send(client)
        assert response.status_code == 200, response.content
        assert response.json()["choices"][0]["text"] == "ok!"
        if any(u.startswith(dead_url) for u in calls):
            break
    assert time.monotonic() - started < 10
    record = RequestRecord.objects.filter(decision__inputs__has_key="retried").get()
    retried = record.decision.inputs["retried"][0]
    assert retried["instances"] == [str(made["p1"][1].pk)]
    assert "no first token" in retried["error"]
    assert record.prefill_instance == str(made["p2"][1].pk)


def test_a_migration_notes_the_new_attempt_on_the_admission(two_decoders, monkeypatch):
    """So a process finishing this one's admission after a SIGKILL asks the right P about the
    right attempt, and adds the tokens delivered before it."""
    client, made, plans = two_decoders
    noted = []
    real = records.admission_attempt

    def note(**kw):
        noted.append(kw)
        return real(**kw)

    monkeypatch.setattr(records, "admission_attempt", note)
    response = client.post(
        "/v1/completions",
        {"model": "baton-tiny", "prompt": "hello", "max_tokens": 8},
        format="json",
    )
    assert response.json()["choices"][0]["text"] == "abcdefgh"
    (attempt,) = noted
    request_id, attempt_id = attempt["request_id"], attempt["attempt_request_id"]
    prefill_url, offset = attempt["prefill_url"], attempt["token_offset"]
    assert attempt_id == plans[1]["request_id"] == f"{request_id}-r1"
    assert prefill_url.startswith("http://10.0.0.1:9000") and offset == 3


@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_carries_the_gateway_s_stage_timings(two_decoders, stream):
    client, _, _ = two_decoders
    response = client.post(
        "/v1/completions",
        {"model": "baton-tiny", "prompt": "hello", "max_tokens": 2, "stream": stream},
        format="json",
    )
    assert response.status_code == 200
    stages = [part.split(";")[0] for part in response["Server-Timing"].split(", ")]
    # The first request of a test finds its caches cold: admission starts on the event loop,
    # a read needs the database ("inline"), and a worker does it all ("resume" after).
    expected = ["queue", "inline", "auth", "parse", "tokenize", "limit", "route", "admit"]
    assert stages == expected + ["resume"] + ([] if stream else ["agents", "record"])


def test_a_streamed_request_whose_decoder_falls_silent_is_migrated_to_its_end(
    two_decoders, monkeypatch
):
    """As above, streamed: the migrated attempt's tokens and the final events reach the
    client, and the record says ok (bench/paper's run: every migrated stream cut)."""
    import json

    client, made, plans = two_decoders
    _freeze_the_first_decoder(monkeypatch, plans)
    body = {"model": "baton-tiny", "prompt": "hello", "max_tokens": 8, "stream": True}
    status, raw = post_stream(client, "/v1/completions", body)
    assert status == 200
    lines = [line for line in raw.decode().splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    text = "".join(
        (json.loads(line[6:])["choices"] or [{"text": ""}])[0]["text"] for line in lines[:-1]
    )
    assert text == "abcdefgh"
    record = RequestRecord.objects.get()
    assert (record.status, record.migrations, record.completion_tokens) == ("ok", 1, 8)
