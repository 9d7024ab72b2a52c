"""The gateway's data-plane calls connect only to an address the agent endpoint policy just
checked (fleet.pinning): a prefill agent whose name now resolves to the cloud metadata service
(DNS rebinding after registration) gets no connection and no data-plane token; the attempt
fails like an unreachable agent, the request is served by another prefill instance and the
refused one is routed around. The agent probe and the admissions' recovery (which asks P how
many tokens it streamed) are pinned the same way."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from fleet import live as fleet_live
from fleet.choices import InstanceRole
from fleet.models import Node
from fleet.pinning import AsyncPinnedTransport, resolved_endpoints
from routing.gateway import interrupted, routes, runner
from routing.gateway.transport import AiohttpTransport
from routing.models import Admission, RequestRecord
from routing.probes import DEAD, OK, probe_agents
from routing.suspects import suspect_ledger
from tests.fleet.test_pinning import FakeDNS, two_agents  # noqa: F401 (fixture)
from tests.routing.gateway.test_route_around_the_dead import (
    _one_dc_fleet,
    _publish,
    _send,
    _tenant_client,
)


@pytest.fixture(autouse=True)
def fresh_answers(settings):
    settings.BATON_AGENT_RESOLVE_TTL_S = 0  # resolve before every call: no waiting in tests
    resolved_endpoints.clear()
    yield
    resolved_endpoints.clear()


def test_the_gateway_client_pins_without_proxies_or_redirects(monkeypatch):
    monkeypatch.setattr(runner, "_client", None)
    client = runner.http_client()
    assert isinstance(client._transport, AsyncPinnedTransport)
    assert client._transport.endpoints is resolved_endpoints
    # Behind the pin, aiohttp's connections (routing/gateway/transport.py).
    assert isinstance(client._transport.inner, AiohttpTransport)
    assert client.trust_env is False and client.follow_redirects is False


def _answer(request: httpx.Request) -> httpx.Response:
    lines = [
        *({"type": "token", "index": i, "token_id": t, "role": "md"} for i, t in enumerate(b"ok!")),
        {"type": "done", "finish_reason": "length", "stats": {}},
    ]
    return httpx.Response(200, content="".join(json.dumps(x) + "\n" for x in lines).encode())


@pytest.fixture
def named_prefills(transactional_db, settings, monkeypatch):
    """Two P agents registered by name (p1.agents.test, p2.agents.test) and one MD; the gateway's
    own client, its connections answered by a mock that records where each one went."""
    settings.REDIS_URL = ""
    settings.BATON_DATA_TOKEN = "fleet-data-token-0123456789"
    made = _one_dc_fleet(
        ("p1", InstanceRole.PREFILL), ("p2", InstanceRole.PREFILL), ("md", InstanceRole.MAIN_DECODE)
    )
    for name in ("p1", "p2"):
        node, inst = made[name]
        Node.objects.filter(pk=node.pk).update(agent_endpoint=f"http://{name}.agents.test:9000")
        node.refresh_from_db()
        _publish(node, inst)
    routes.live_views.clear()
    dns = FakeDNS({"p1.agents.test": ["10.0.0.1"], "p2.agents.test": ["10.0.0.2"]})
    monkeypatch.setattr(socket, "getaddrinfo", dns)
    connected: list[tuple[str, str, str | None]] = []  # (address, Host, Authorization)

    def agent(request: httpx.Request) -> httpx.Response:
        connected.append(
            (request.url.host, request.headers["host"], request.headers.get("authorization"))
        )
        return _answer(request)

    monkeypatch.setattr(runner, "_client", None)
    client = runner.http_client()
    client._transport.inner = httpx.MockTransport(agent)
    yield _tenant_client(), made, dns, connected


def test_a_prefill_rebound_to_the_metadata_service_is_refused_and_routed_around(
    named_prefills, caplog
):
    client, made, dns, connected = named_prefills
    p1 = str(made["p1"][1].pk)
    # Both agents are reached by the address their name resolves to, with the name as Host.
    for _ in range(6):
        assert _send(client).status_code == 200
        if {host for _, host, _ in connected} == {"p1.agents.test:9000", "p2.agents.test:9000"}:
            break
    assert {(a, h) for a, h, _ in connected} == {
        ("10.0.0.1", "p1.agents.test:9000"),
        ("10.0.0.2", "p2.agents.test:9000"),
    }
    # p1's DNS answer changes after registration.
    dns.table["p1.agents.test"] = ["169.254.169.254"]
    connected.clear()
    with caplog.at_level("WARNING"):
        for _ in range(6):
            response = _send(client)
            assert response.status_code == 200, response.content
            assert response.json()["choices"][0]["text"] == "ok!"
            if RequestRecord.objects.filter(decision__inputs__has_key="retried").exists():
                break
    record = RequestRecord.objects.get(decision__inputs__has_key="retried")
    (retried,) = record.decision.inputs["retried"]
    assert retried["instances"] == [p1]
    assert "prefill agent endpoint refused" in retried["error"]
    assert "169.254.169.254" in retried["error"] and "metadata" in retried["error"]
    assert record.status == "ok" and record.prefill_instance == str(made["p2"][1].pk)
    # Nothing went to the metadata address, and no data-plane token either.
    assert {a for a, _, _ in connected} == {"10.0.0.2"}
    assert all(auth == "Bearer fleet-data-token-0123456789" for _, _, auth in connected)
    assert any("p1.agents.test" in r.getMessage() and "refused" in r.getMessage()
               for r in caplog.records)  # fmt: skip
    # The refused P is routed around by the next requests, without another attempt.
    assert p1 in routes.suspects.marks()
    connected.clear()
    for _ in range(3):
        assert _send(client).status_code == 200
    assert {a for a, _, _ in connected} == {"10.0.0.2"}


def test_ip_literal_endpoints_are_called_as_before(two_prefills_by_address):
    client, connected, dns = two_prefills_by_address
    for _ in range(4):
        assert _send(client).status_code == 200
    assert set(connected) <= {("10.0.0.1", "10.0.0.1:9000"), ("10.0.0.2", "10.0.0.2:9000")}
    # No agent endpoint was resolved (the database's own host may be, on PostgreSQL).
    assert not [h for h in dns.asked if h.startswith("10.0.0.")]


@pytest.fixture
def two_prefills_by_address(transactional_db, settings, monkeypatch):
    settings.REDIS_URL = ""
    _one_dc_fleet(
        ("p1", InstanceRole.PREFILL), ("p2", InstanceRole.PREFILL), ("md", InstanceRole.MAIN_DECODE)
    )  # registered as http://10.0.0.1:9000 and http://10.0.0.2:9000
    dns = FakeDNS({})
    monkeypatch.setattr(socket, "getaddrinfo", dns)
    connected: list[tuple[str, str]] = []

    def agent(request: httpx.Request) -> httpx.Response:
        connected.append((request.url.host, request.headers["host"]))
        return _answer(request)

    monkeypatch.setattr(runner, "_client", None)
    runner.http_client()._transport.inner = httpx.MockTransport(agent)
    yield _tenant_client(), connected, dns


# --- the probe and the admissions' recovery, over real sockets --------------------------------


@pytest.fixture
def rebinding(two_agents, settings, monkeypatch):  # noqa: F811
    """agent.test resolves to 127.0.0.1 (an agent), then, when ``rebind()`` is called, to
    127.0.0.2, where another server listens that the policy refuses."""
    (allowed, forbidden), port = two_agents
    settings.REDIS_URL = ""
    settings.BATON_PROBE_AFTER_S = 0  # the probe asks every agent, late or not
    settings.BATON_AGENT_NETWORKS = ["127.0.0.1/32"]
    dns = FakeDNS({"agent.test": ["127.0.0.1"]})
    monkeypatch.setattr(socket, "getaddrinfo", dns)

    def rebind() -> None:
        dns.table["agent.test"] = ["127.0.0.2"]

    return f"http://agent.test:{port}", allowed, forbidden, rebind


def test_the_probe_calls_only_the_checked_address_and_a_refused_one_is_dead(rebinding):
    endpoint, allowed, forbidden, rebind = rebinding
    fleet_live._memory.clear()
    fleet_live.publish_report(
        node_id=1,
        hostname="a-1",
        datacenter="dc-a",
        endpoint=endpoint,
        report={"instances": [{"instance_id": "11", "role": "prefill"}]},
    )
    try:
        assert [r.verdict for r in probe_agents(timeout_s=1.0)] == [OK]
        rebind()
        (result,) = probe_agents(timeout_s=1.0)
    finally:
        fleet_live._memory.clear()
    assert result.verdict == DEAD and "not in BATON_AGENT_NETWORKS" in result.detail
    assert "11" in suspect_ledger().marks()
    assert [host for _, host in allowed.seen] == [endpoint.removeprefix("http://")]
    assert forbidden.seen == []


def test_the_recovery_asks_only_the_checked_address(rebinding, caplog):
    endpoint, allowed, forbidden, rebind = rebinding
    admission = Admission(request_id="r-1", attempt_request_id="r-1.0", prefill_url=endpoint)
    assert interrupted.agent_reported_tokens(admission) == 7
    rebind()
    with caplog.at_level("WARNING", logger="routing.gateway.records"):
        assert interrupted.agent_reported_tokens(admission) is None
    assert "not an allowed agent endpoint now" in caplog.text
    assert allowed.seen == [("127.0.0.1", endpoint.removeprefix("http://"))]
    assert forbidden.seen == []
