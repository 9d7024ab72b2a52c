"""Overload queues, it does not fail: a prefill agent that answers `engine_full` is capacity,
not a fault. The gateway waits and routes the request again, blames no instance, and answers
a status code with Retry-After (never an error inside a 200) once the wait is over its limit
or the queue is full. The fleet is fake: rows in the database, heartbeats in the live state,
the prefill agent a mock."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from rest_framework.test import APIClient

from billing import services as billing
from billing.models import Tenant
from fleet import live as fleet_live
from fleet.choices import InstanceRole, NodeStatus
from fleet.models import Datacenter, GPUType, Instance, Node, ServedModel
from routing.gateway import overload as overload_module
from routing.gateway import routes, runner
from routing.gateway.overload import OverloadQueue
from routing.models import RequestRecord
from tests.routing.gateway.conftest import post_stream

FULL = {"error": "engine full: req-1: no room for 9 KV blocks", "code": "engine_full"}


def _lines(*events: dict) -> bytes:
    return "".join(json.dumps(e) + "\n" for e in events).encode()


ANSWER = _lines(
    {"type": "token", "index": 0, "token_id": 79, "role": "prefill"},
    {"type": "token", "index": 1, "token_id": 75, "role": "md"},
    {"type": "done", "finish_reason": "length", "stats": {"tokens_by_role": {"md": 2}}},
)


@pytest.fixture
def fleet(transactional_db, settings, monkeypatch):
    settings.REDIS_URL = ""
    settings.BATON_GATEWAY_QUEUE_TIMEOUT_S = 30.0
    monkeypatch.setattr(overload_module, "overload", OverloadQueue())
    monkeypatch.setattr("routing.gateway.routes.overload", overload_module.overload)
    monkeypatch.setattr("routing.gateway.run.overload", overload_module.overload)
    monkeypatch.setattr(overload_module, "FIRST_WAIT_S", 0.01)
    tenant = Tenant.objects.create(name="acme", requests_per_minute=100, tokens_per_minute=10**6)
    _, raw = billing.api_key_create(tenant=tenant)
    model = ServedModel.objects.create(
        name="baton-tiny", source="baton-tiny", num_layers=4, kv_bytes_per_token=4096
    )
    dc = Datacenter.objects.create(name="dc-a", region="city-a")
    gpu = GPUType.objects.create(
        vendor="g", model="gpu-a", peak_bf16_tflops=989, memory_gib=80,
        memory_bandwidth_gbps=3350, interconnect_gbps=400,
    )  # fmt: skip
    nodes = []
    for role in (InstanceRole.PREFILL, InstanceRole.MAIN_DECODE):
        node = Node.objects.create(
            hostname=f"a-{role}", datacenter=dc, gpu_type=gpu, gpu_count=8,
            agent_endpoint=f"http://{role}.agent", agent_token_prefix=f"t-{role}",
            status=NodeStatus.ONLINE,
        )  # fmt: skip
        inst = Instance.objects.create(role=role, node=node, served_model=model, gpu_count=8)
        item = {
            "instance_id": str(inst.pk), "role": role, "state": "running",
            "load": {"running": 0, "queued": 0, "max_running": 32},
            "kv_endpoint": {"host": "127.0.0.1", "port": 9000 + inst.pk, "wan_port": 9500},
        }  # fmt: skip
        fleet_live.publish_report(
            node_id=node.pk, hostname=node.hostname, datacenter="dc-a",
            endpoint=node.agent_endpoint, report={"instances": [item]},
        )  # fmt: skip
        nodes.append(node)
    routes.live_views.clear()
    answers: list[tuple[int, bytes]] = []  # what P answers, call by call (then ANSWER)
    calls: list[dict] = []

    def prefill_agent(request: httpx.Request) -> httpx.Response:
        calls.append(json.loads(request.content))
        status, body = answers.pop(0) if answers else (200, ANSWER)
        return httpx.Response(status, content=body)

    monkeypatch.setattr(
        runner, "_client", httpx.AsyncClient(transport=httpx.MockTransport(prefill_agent))
    )
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    yield {"client": client, "answers": answers, "calls": calls, "tenant": tenant}
    for node in nodes:
        fleet_live.forget(node.pk)


def _stream(client: APIClient) -> tuple[int, str]:
    status, raw = post_stream(
        client,
        "/v1/chat/completions",
        {"model": "baton-tiny", "messages": [{"role": "user", "content": "hi"}],
         "max_tokens": 2, "stream": True},
    )  # fmt: skip
    return status, raw.decode()


def _refused_stream(client: APIClient):
    """A streamed request whose answer is read whole (a status code is expected)."""
    return client.post(
        "/v1/chat/completions",
        {"model": "baton-tiny", "messages": [{"role": "user", "content": "hi"}],
         "max_tokens": 2, "stream": True},
        format="json",
    )  # fmt: skip


def test_a_full_engine_is_waited_for_and_not_blamed(fleet):
    busy = json.dumps(FULL).encode()
    fleet["answers"].extend([(503, busy), (503, busy)])
    status, body = _stream(fleet["client"])
    assert status == 200
    assert "[DONE]" in body and '"error"' not in body
    assert len(fleet["calls"]) == 3  # twice full, then room
    assert routes.suspects.marks() == {}  # capacity is not a fault
    record = RequestRecord.objects.get()
    assert record.status == "ok" and record.completion_tokens == 2
    assert overload_module.overload.stats.queued_total == 1
    assert overload_module.overload.stats.waiting == 0


def test_an_engine_full_event_before_any_token_is_waited_for_too(fleet):
    fleet["answers"].append(
        (200, _lines({"type": "error", "message": "MD: cannot import KV", "code": "engine_full"}))
    )
    status, body = _stream(fleet["client"])
    assert status == 200 and "[DONE]" in body
    assert routes.suspects.marks() == {}


def test_past_the_wait_limit_the_answer_is_a_503_status_with_retry_after(fleet, settings):
    settings.BATON_GATEWAY_QUEUE_TIMEOUT_S = 0.2
    busy = json.dumps(FULL).encode()
    fleet["answers"].extend([(503, busy)] * 1000)
    response = _refused_stream(fleet["client"])
    # No token went out: the answer is a status code, not an error inside a 200.
    assert response.status_code == 503
    assert int(response["Retry-After"]) >= 1
    assert response.json()["error"]["code"] == "overloaded"
    record = RequestRecord.objects.get()
    assert record.status == "rejected"
    assert overload_module.overload.stats.timed_out_total == 1
    assert routes.suspects.marks() == {}


def test_a_tenant_over_its_share_of_the_queue_gets_a_429(fleet, settings):
    settings.BATON_GATEWAY_QUEUE_PER_TENANT = 0
    fleet["answers"].append((503, json.dumps(FULL).encode()))
    response = fleet["client"].post(
        "/v1/chat/completions",
        {"model": "baton-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        format="json",
    )
    assert response.status_code == 429
    assert response["Retry-After"] == "2"
    assert response.json()["error"]["code"] == "queue_full"


def test_other_failures_still_blame_the_instance_and_are_a_status_code(fleet):
    fleet["answers"].append((500, b'{"error": "boom"}'))
    status, _ = _stream(fleet["client"])
    # A real fault: the only P is avoided, no path is left, and since no token went out the
    # client gets a status code rather than an error inside a 200.
    assert status == 502
    assert routes.suspects.marks()
    assert RequestRecord.objects.get().status == "error"


def test_the_queue_backs_off_and_counts_what_waits(settings):
    settings.BATON_GATEWAY_QUEUE_TIMEOUT_S = 5.0
    settings.BATON_GATEWAY_QUEUE_MAX = 1
    settings.BATON_GATEWAY_QUEUE_PER_TENANT = 1
    queue = OverloadQueue()

    async def main():
        import time

        since = time.monotonic()
        first = asyncio.create_task(queue.wait("t", since, 5))  # up to 1 s of backoff
        await asyncio.sleep(0.01)
        assert queue.stats.waiting == 1
        with pytest.raises(Exception) as err:  # the queue holds one: the next is refused
            await queue.wait("u", since, 0)
        assert err.value.status == 503 and err.value.code == "queue_full"
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        assert queue.stats.waiting == 0 and not queue.stats.by_tenant

    asyncio.run(main())


def _queued_then(seconds: float, every: float, then: bytes | None):
    """P's stream of a request its engine queued: a `queued` keep-alive every ``every`` for
    ``seconds``, then ``then`` (the answer), or silence (None: P froze in the queue)."""

    async def body():
        waited = 0.0
        while waited < seconds:
            yield _lines({"type": "queued", "waited_s": waited})
            await asyncio.sleep(every)
            waited += every
        if then is None:
            await asyncio.sleep(30)
        else:
            yield then

    return body()


def test_a_busy_prefill_s_keep_alives_outlast_the_first_token_timeout(fleet, monkeypatch):
    """A request queued at P longer than the first-token timeout is waited for, not failed
    over: P's `queued` events say it is busy, not frozen. No instance is blamed."""
    from routing.gateway import run as gw_run

    monkeypatch.setattr(gw_run, "FIRST_TOKEN_TIMEOUT_S", 0.3)
    fleet["answers"].append((200, _queued_then(1.0, 0.1, ANSWER)))
    status, body = _stream(fleet["client"])
    assert status == 200 and "[DONE]" in body and '"error"' not in body
    assert len(fleet["calls"]) == 1  # one attempt: no retry, no failover
    assert routes.suspects.marks() == {}
    record = RequestRecord.objects.get()
    assert record.status == "ok" and record.completion_tokens == 2
    assert "retried" not in (record.decision.inputs or {})
    assert overload_module.overload.stats.at_prefill == 0  # left the count at its first token


def test_a_prefill_that_falls_silent_in_its_queue_still_fails_over(fleet, monkeypatch):
    """Keep-alives, then silence: a P frozen with the request queued fails over after the
    first-token timeout, and is the instance blamed."""
    from routing.gateway import run as gw_run

    monkeypatch.setattr(gw_run, "FIRST_TOKEN_TIMEOUT_S", 0.3)
    fleet["answers"].append((200, _queued_then(0.3, 0.1, None)))
    status, _ = _stream(fleet["client"])
    assert status == 502  # the only P is avoided: no path left, and no token went out
    assert routes.suspects.marks()
    record = RequestRecord.objects.get()
    assert record.status == "error" and "no first token" in record.error
    assert overload_module.overload.stats.at_prefill == 0


def test_past_the_prefill_queue_limit_the_answer_is_a_503_with_retry_after(fleet, monkeypatch):
    """A P that keeps saying `queued` is waited for BATON_GATEWAY_PREFILL_QUEUE_TIMEOUT_S at
    most; then a status code (no token went out), the record `rejected`, P not blamed."""
    from routing.gateway import run as gw_run

    monkeypatch.setattr(gw_run, "PREFILL_QUEUE_TIMEOUT_S", 0.4)
    fleet["answers"].append((200, _queued_then(30.0, 0.1, ANSWER)))
    response = _refused_stream(fleet["client"])
    assert response.status_code == 503
    assert response["Retry-After"] == "30"
    assert response.json()["error"]["code"] == "overloaded"
    assert "prefill queue" in response.json()["error"]["message"]
    assert RequestRecord.objects.get().status == "rejected"
    assert routes.suspects.marks() == {}
    stats = overload_module.overload.stats
    assert stats.prefill_timed_out_total == 1 and stats.at_prefill == 0


def test_a_prefill_that_fails_after_it_was_queued_blames_p(fleet):
    """P's own failure after its stream started (an error event naming ``prefill``) is P's
    fault, as a P that refused the call: P is avoided, not the decoder."""
    fleet["answers"].append(
        (200, _lines({"type": "error", "message": "r: prefill failed: boom", "role": "prefill"}))
    )
    status, _ = _stream(fleet["client"])
    assert status == 502
    prefill = Instance.objects.get(role=InstanceRole.PREFILL)
    assert list(routes.suspects.marks()) == [str(prefill.pk)]


def test_a_decoder_s_keep_alives_relayed_by_p_are_not_a_prefill_queue(fleet, monkeypatch):
    """P relaying MD's stream (no one hop per token) passes on MD's keep-alives while MD waits
    for its KV: they restart the first-token timeout, but are neither counted as waiting in a
    prefill queue nor bounded by its timeout (MD's own KV timeout bounds them)."""
    from routing.gateway import run as gw_run

    monkeypatch.setattr(gw_run, "FIRST_TOKEN_TIMEOUT_S", 0.3)
    monkeypatch.setattr(gw_run, "PREFILL_QUEUE_TIMEOUT_S", 0.2)

    async def body():
        for i in range(6):
            yield _lines({"type": "queued", "waited_s": i * 0.1, "waiting_for": "kv"})
            await asyncio.sleep(0.1)
        yield ANSWER

    fleet["answers"].append((200, body()))
    status, text = _stream(fleet["client"])
    assert status == 200 and "[DONE]" in text and '"error"' not in text
    stats = overload_module.overload.stats
    assert stats.at_prefill == 0 and stats.prefill_timed_out_total == 0
    assert RequestRecord.objects.get().status == "ok"
