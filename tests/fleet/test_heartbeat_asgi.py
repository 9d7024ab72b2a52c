"""Heartbeats that repeat their node's last full one are taken before Django, on the event loop
(fleet/beats.py, controlplane/middleware.py): answered at once, written in batches, and only
while the token, the node and its report are what the last full heartbeat saw."""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta

import httpx
import pytest
from django.utils import timezone

from controlplane.limits import BodyGuard
from controlplane.middleware import ASGIHandler
from fleet import agent_services, beats, live, services
from fleet.api import agent as agent_api
from fleet.choices import ActualState, NodeStatus
from fleet.models import Node

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def world(node_a, tiny_model, settings, monkeypatch):
    settings.REDIS_URL = ""
    node, token = services.node_create(
        hostname="asgi-1", datacenter=node_a.datacenter, gpu_type=node_a.gpu_type, gpu_count=8
    )
    inst = services.instance_create(
        role="main_decode", node=node, served_model=tiny_model, gpu_count=4
    )
    calls: list[int] = []
    real = agent_api.AgentHeartbeatView.post

    def counted(self, request):
        calls.append(1)
        return real(self, request)

    monkeypatch.setattr(agent_api.AgentHeartbeatView, "post", counted)
    agent_services._full_beats.clear()
    beats._tokens.clear()
    beats._pending.clear()
    yield node, token, inst, calls
    beats._tokens.clear()
    beats._pending.clear()
    agent_services._full_beats.clear()


def doc(inst, n: int, state: str = "running") -> dict:
    return {
        "protocol": 1,
        "instances": [{"instance_id": str(inst.pk), "role": inst.role, "state": state}],
        "control_plane": {"heartbeats_answered": n},
    }


async def _post(client, token, path, body):
    return await client.post(
        path, content=json.dumps(body), headers={"Authorization": f"AgentToken {token}",
                                                 "Content-Type": "application/json"},
    )  # fmt: skip


def run(coro):
    return asyncio.run(coro)


def _client():
    app = BodyGuard(ASGIHandler())
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver")


def test_repeated_beats_skip_django_and_are_written_in_a_batch(world):
    node, token, inst, calls = world

    async def go():
        async with _client() as client:
            r = await _post(client, token, "/api/v1/agent/register",
                            doc(inst, 0) | {"endpoint": "http://127.0.0.1:9155"})  # fmt: skip
            assert r.status_code == 200, r.text
            assert (await _post(client, token, "/api/v1/agent/heartbeat", doc(inst, 1))).json() == {
                "ok": True
            }
            before = len(calls)
            for n in range(2, 6):
                r = await _post(client, token, "/api/v1/agent/heartbeat", doc(inst, n))
                assert r.status_code == 200 and r.json() == {"ok": True}
            return before

    taken = beats.stats["taken"]
    before = run(go())
    assert len(calls) == before  # four beats, none reached Django's view
    assert beats.stats["taken"] - taken == 4
    first = Node.objects.get(pk=node.pk).last_heartbeat_at
    beats.flush()
    node.refresh_from_db()
    assert node.last_heartbeat_at >= first
    entry = next(e for e in live.read_reports() if e["node_id"] == node.pk)
    assert entry["received_at"] >= first.timestamp()


def test_a_changed_report_a_rotated_token_and_an_offline_node_go_to_django(world):
    node, token, inst, calls = world

    async def register_and_beat(client):
        r = await _post(client, token, "/api/v1/agent/register",
                        doc(inst, 0) | {"endpoint": "http://127.0.0.1:9156"})  # fmt: skip
        assert r.status_code == 200
        await _post(client, token, "/api/v1/agent/heartbeat", doc(inst, 1))

    async def go():
        async with _client() as client:
            await register_and_beat(client)
            n = len(calls)
            await _post(client, token, "/api/v1/agent/heartbeat", doc(inst, 2, "draining"))
            assert len(calls) == n + 1  # changed: Django took it
            return client

    run(go())
    inst.refresh_from_db()
    assert inst.actual_state == ActualState.DRAINING

    # Offline meanwhile (the health check, another process): the batch finds it and the next
    # beat goes to Django, which brings the node back.
    async def beat_again():
        async with _client() as client:
            r = await _post(client, token, "/api/v1/agent/heartbeat", doc(inst, 3, "draining"))
            assert r.status_code == 200

    run(beat_again())  # fast: the same report as the last full beat
    later = timezone.now() + timedelta(seconds=60)
    agent_services.nodes_mark_offline(now=later)
    beats.flush()
    assert Node.objects.get(pk=node.pk).status == NodeStatus.OFFLINE
    n = len(calls)
    run(beat_again())
    assert len(calls) == n + 1
    assert Node.objects.get(pk=node.pk).status == NodeStatus.ONLINE

    # A rotated token is refused at once, not trusted for the rest of its time.
    services.node_rotate_token(node=Node.objects.get(pk=node.pk))

    async def old_token():
        async with _client() as client:
            return await _post(client, token, "/api/v1/agent/heartbeat", doc(inst, 4, "draining"))

    assert run(old_token()).status_code == 401


def test_bad_bodies_still_get_djangos_answers(world):
    node, token, inst, _ = world

    async def go():
        async with _client() as client:
            await _post(client, token, "/api/v1/agent/register",
                        doc(inst, 0) | {"endpoint": "http://127.0.0.1:9157"})  # fmt: skip
            await _post(client, token, "/api/v1/agent/heartbeat", doc(inst, 1))
            bad = await client.post(
                "/api/v1/agent/heartbeat",
                content=b"{not json",
                headers={"Authorization": f"AgentToken {token}",
                         "Content-Type": "application/json"},
            )  # fmt: skip
            wrong = await _post(client, token, "/api/v1/agent/heartbeat", {"instances": "x"})
            return bad, wrong

    bad, wrong = run(go())
    assert bad.status_code == 400
    assert wrong.status_code == 400 and "instances" in wrong.text


# Concurrent requests in threads: the test's SQLite (one in-memory database shared by the
# threads) locks whole tables per transaction; the real servers do not.
@pytest.mark.postgres
def test_a_burst_of_agent_calls_waits_for_a_slot(world, settings, monkeypatch):
    node, token, inst, _ = world
    settings.BATON_AGENT_API_CONCURRENCY = 2
    from controlplane import middleware

    monkeypatch.setattr(middleware, "_slots", middleware.weakref.WeakKeyDictionary())
    inside = {"now": 0, "most": 0}

    def slow(self, request):  # a registration that holds its thread for 50 ms, writing nothing
        import time

        from rest_framework.response import Response

        inside["now"] += 1
        inside["most"] = max(inside["most"], inside["now"])
        try:
            time.sleep(0.05)
            return Response({"ok": True})
        finally:
            inside["now"] -= 1

    monkeypatch.setattr(agent_api.AgentRegisterView, "post", slow)

    async def go():
        async with _client() as client:
            body = doc(inst, 0) | {"endpoint": "http://127.0.0.1:9158"}
            return await asyncio.gather(
                *(_post(client, token, "/api/v1/agent/register", body) for _ in range(8))
            )

    answers = run(go())
    assert [r.status_code for r in answers] == [200] * 8
    assert inside["most"] <= 2


def test_a_request_that_waited_too_long_for_a_slot_is_answered_busy(world, settings, monkeypatch):
    node, token, inst, _ = world
    settings.BATON_AGENT_API_CONCURRENCY = 1  # one at a time: no two threads in the database
    settings.BATON_AGENT_API_QUEUE_TIMEOUT_S = 0.02
    from controlplane import middleware

    monkeypatch.setattr(middleware, "_slots", middleware.weakref.WeakKeyDictionary())
    real = agent_api.AgentRegisterView.post

    def slow(self, request):
        import time

        time.sleep(0.1)
        return real(self, request)

    monkeypatch.setattr(agent_api.AgentRegisterView, "post", slow)

    async def go():
        async with _client() as client:
            body = doc(inst, 0) | {"endpoint": "http://127.0.0.1:9159"}
            return await asyncio.gather(
                *(_post(client, token, "/api/v1/agent/register", body) for _ in range(4))
            )

    answers = run(go())
    codes = sorted(r.status_code for r in answers)
    assert codes[0] == 200 and 503 in codes  # the first served; those that waited, refused
    busy = next(r for r in answers if r.status_code == 503)
    assert busy.headers["retry-after"] == "1" and busy.json()["code"] == "busy"


def test_a_token_rotated_in_another_process_ends_the_fast_path_at_the_next_flush(world):
    node, token, inst, calls = world

    async def beat(n):
        async with _client() as client:
            if n == 0:
                await _post(client, token, "/api/v1/agent/register",
                            doc(inst, 0) | {"endpoint": "http://127.0.0.1:9160"})  # fmt: skip
            return await _post(client, token, "/api/v1/agent/heartbeat", doc(inst, n + 1))

    assert run(beat(0)).status_code == 200
    assert run(beat(1)).status_code == 200  # fast
    # Another process rotates the token: no signal reaches this one.
    Node.objects.filter(pk=node.pk).update(agent_token_hash="0" * 64)
    beats.flush()
    n = len(calls)
    assert run(beat(2)).status_code == 401
    assert len(calls) == n  # refused by authentication, before the view


def test_an_agent_call_slower_than_the_threshold_is_logged_with_where_its_time_went(
    world, settings, caplog
):
    node, token, inst, calls = world

    async def go():
        async with _client() as client:
            r = await _post(client, token, "/api/v1/agent/register",
                            doc(inst, 0) | {"endpoint": "http://127.0.0.1:9155"})  # fmt: skip
            assert r.status_code == 200
            settings.BATON_AGENT_API_SLOW_S = 0.0  # every call is "slow"
            await _post(client, token, "/api/v1/agent/heartbeat", doc(inst, 1))  # Django
            await _post(client, token, "/api/v1/agent/heartbeat", doc(inst, 2))  # fast path

    with caplog.at_level("WARNING", logger="baton.agent_api"):
        run(go())
    lines = [r.getMessage() for r in caplog.records if r.name == "baton.agent_api"]
    assert any("heartbeat answered in" in m and "the view began" in m for m in lines), lines
    assert any("(fast path;" in m and "waiting for a slot" in m for m in lines), lines
    assert all("event loop's recent delay" in m for m in lines)
