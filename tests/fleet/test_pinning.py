"""Calls to agents connect only to an address the endpoint policy just checked (fleet.pinning):
a name that resolved to an allowed address and later resolves to a refused one (DNS
rebinding) is refused before any connection; the connection goes to the checked address with
the name kept as Host and TLS server name; an IP literal is only checked; answers are kept a
few seconds, then the name is resolved again."""

from __future__ import annotations

import asyncio
import http.server
import ipaddress
import socket
import threading

import httpx
import pytest

from fleet import pinning
from fleet.pinning import (
    AsyncPinnedTransport,
    EndpointNotCalled,
    EndpointRefused,
    EndpointUnresolvable,
    PinnedTransport,
    ResolvedEndpoints,
)

REAL_GETADDRINFO = socket.getaddrinfo


class FakeDNS:
    """socket.getaddrinfo answering the names in `table` (mutable: a rebinding server), passing
    anything else (IP literals) to the real one; every host asked is in `asked`."""

    def __init__(self, table: dict[str, list[str]]) -> None:
        self.table = table
        self.asked: list[str] = []

    def __call__(self, host, port, family=0, type=0, proto=0, flags=0):
        host = host.decode() if isinstance(host, bytes) else host
        self.asked.append(host)
        if host in self.table:
            return [
                (
                    socket.AF_INET6 if ":" in a else socket.AF_INET,
                    socket.SOCK_STREAM,
                    6,
                    "",
                    (a, port, 0, 0) if ":" in a else (a, port),
                )
                for a in self.table[host]
            ]
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known") from None
        return REAL_GETADDRINFO(host, port, family, type, proto, flags)


@pytest.fixture
def dns(monkeypatch) -> FakeDNS:
    fake = FakeDNS({"agent.example": ["10.0.0.5"]})
    monkeypatch.setattr(socket, "getaddrinfo", fake)
    return fake


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def recording():
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"ok": True})

    return seen, httpx.MockTransport(handler)


def sync_client(endpoints: ResolvedEndpoints, inner: httpx.BaseTransport) -> httpx.Client:
    return httpx.Client(transport=PinnedTransport(inner, endpoints), trust_env=False)


# --- DNS rebinding --------------------------------------------------------------------------


def test_a_name_that_rebinds_to_the_metadata_service_is_refused_and_never_called(dns, caplog):
    seen, inner = recording()
    clock = Clock()
    endpoints = ResolvedEndpoints(ttl_s=5.0, clock=clock)
    with sync_client(endpoints, inner) as client:
        assert client.get("http://agent.example:9000/health").status_code == 200
        dns.table["agent.example"] = ["169.254.169.254"]  # the attacker's DNS answer changes
        clock.now += 5.0  # the first answer expired: the name is resolved again
        with (
            caplog.at_level("WARNING", logger="fleet.pinning"),
            pytest.raises(EndpointRefused, match="resolves to 169.254.169.254") as refused,
        ):
            client.get("http://agent.example:9000/v1/pdd/generate")
    assert isinstance(refused.value, httpx.ConnectError)  # handled as an unreachable agent
    assert "metadata" in str(refused.value)
    assert [str(r.url) for r in seen] == ["http://10.0.0.5:9000/health"]  # never connected
    assert dns.asked == ["agent.example", "agent.example"]
    assert any("refused" in r.getMessage() for r in caplog.records)


def test_every_address_of_the_answer_must_pass(dns):
    seen, inner = recording()
    dns.table["agent.example"] = ["10.0.0.5", "169.254.169.254"]  # one good, one refused
    with sync_client(ResolvedEndpoints(ttl_s=0), inner) as client, pytest.raises(EndpointRefused):
        client.get("http://agent.example:9000/health")
    assert seen == []


def test_within_the_ttl_the_checked_answer_is_used_then_the_name_is_resolved_again(dns):
    seen, inner = recording()
    clock = Clock()
    with sync_client(ResolvedEndpoints(ttl_s=5.0, clock=clock), inner) as client:
        client.get("http://agent.example:9000/a")
        dns.table["agent.example"] = ["10.0.0.6"]  # the agent moved (an allowed address)
        clock.now += 4.9
        client.get("http://agent.example:9000/b")  # still the checked 10.0.0.5
        clock.now += 0.1
        client.get("http://agent.example:9000/c")
    assert [r.url.host for r in seen] == ["10.0.0.5", "10.0.0.5", "10.0.0.6"]
    assert dns.asked == ["agent.example", "agent.example"]


def test_a_refusal_is_kept_as_briefly_and_a_name_that_does_not_resolve_is_unreachable(dns):
    seen, inner = recording()
    clock = Clock()
    dns.table["agent.example"] = ["169.254.169.254"]
    with sync_client(ResolvedEndpoints(ttl_s=5.0, clock=clock), inner) as client:
        for _ in range(3):
            with pytest.raises(EndpointRefused):
                client.get("http://agent.example:9000/health")
        assert dns.asked == ["agent.example"]  # one lookup (and one warning) per TTL
        clock.now += 5.0
        dns.table.clear()
        with pytest.raises(EndpointUnresolvable, match="Could not resolve") as caught:
            client.get("http://agent.example:9000/health")
        clock.now += 5.0
        dns.table["agent.example"] = ["10.0.0.5"]
        assert client.get("http://agent.example:9000/health").status_code == 200
    assert isinstance(caught.value, EndpointNotCalled)
    assert len(seen) == 1


# --- pinning --------------------------------------------------------------------------------


def test_the_request_goes_to_the_checked_address_with_the_name_as_host(dns):
    seen, inner = recording()
    with sync_client(ResolvedEndpoints(ttl_s=0), inner) as client:
        client.post("http://agent.example:9000/v1/pdd/generate?x=%20y", json={"a": 1})
    (request,) = seen
    assert str(request.url) == "http://10.0.0.5:9000/v1/pdd/generate?x=%20y"
    assert request.headers["host"] == "agent.example:9000"
    assert "sni_hostname" not in request.extensions
    assert request.content == b'{"a":1}'


def test_https_keeps_the_name_as_the_tls_server_name(dns):
    seen, inner = recording()
    with sync_client(ResolvedEndpoints(ttl_s=0), inner) as client:
        client.get("https://agent.example/state")
    (request,) = seen
    assert str(request.url) == "https://10.0.0.5/state"  # port 443, the scheme's default
    assert request.headers["host"] == "agent.example"
    assert request.extensions["sni_hostname"] == "agent.example"


def test_an_ipv6_answer_is_pinned_in_brackets(dns):
    seen, inner = recording()
    dns.table["agent.example"] = ["fd00::5"]
    with sync_client(ResolvedEndpoints(ttl_s=0), inner) as client:
        client.get("http://agent.example:9000/health")
    assert str(seen[0].url) == "http://[fd00::5]:9000/health"


def test_an_ip_literal_is_checked_but_neither_resolved_nor_rewritten(dns, settings):
    seen, inner = recording()
    with sync_client(ResolvedEndpoints(ttl_s=0), inner) as client:
        client.get("http://10.0.0.5:9000/health")
        client.get("https://[::1]:9443/health")
        settings.BATON_AGENT_NETWORKS = ["192.168.0.0/16"]  # the policy changed since
        with pytest.raises(EndpointRefused, match="not in BATON_AGENT_NETWORKS"):
            client.get("http://10.0.0.5:9000/health")
    assert [str(r.url) for r in seen] == [
        "http://10.0.0.5:9000/health",
        "https://[::1]:9443/health",
    ]
    assert [r.headers["host"] for r in seen] == ["10.0.0.5:9000", "[::1]:9443"]
    assert all("sni_hostname" not in r.extensions for r in seen)
    assert dns.asked == []


# --- the async transport (the gateway's) ----------------------------------------------------


def test_the_async_transport_refuses_a_rebound_name_without_connecting(dns):
    seen, inner = recording()
    endpoints = ResolvedEndpoints(ttl_s=0)

    async def run():
        transport = AsyncPinnedTransport(inner, endpoints)
        async with httpx.AsyncClient(transport=transport, trust_env=False) as client:
            first = await client.get("http://agent.example:9000/health")
            dns.table["agent.example"] = ["169.254.169.254"]
            with pytest.raises(EndpointRefused, match="169.254.169.254"):
                await client.get("http://agent.example:9000/health")
            return first

    assert asyncio.run(run()).status_code == 200
    assert [r.url.host for r in seen] == ["10.0.0.5"]
    assert seen[0].headers["host"] == "agent.example:9000"


def test_concurrent_requests_share_one_lookup_off_the_event_loop(dns, monkeypatch):
    seen, inner = recording()
    endpoints = ResolvedEndpoints(ttl_s=5.0)
    lookups: list[str] = []
    loop_threads: set[int] = set()
    real_resolve = pinning.resolve_agent_endpoint

    def resolve(base):
        lookups.append(threading.current_thread().name)
        return real_resolve(base)

    monkeypatch.setattr(pinning, "resolve_agent_endpoint", resolve)

    async def run():
        loop_threads.add(threading.get_ident())
        transport = AsyncPinnedTransport(inner, endpoints)
        async with httpx.AsyncClient(transport=transport, trust_env=False) as client:
            return await asyncio.gather(
                *(client.get(f"http://agent.example:9000/r/{i}") for i in range(20))
            )

    answers = asyncio.run(run())
    assert [a.status_code for a in answers] == [200] * 20
    assert len(lookups) == 1 and lookups[0] != threading.main_thread().name
    assert {r.url.host for r in seen} == {"10.0.0.5"}


# --- real connections -----------------------------------------------------------------------


class _Agent(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        self.server.seen.append((self.server.server_address[0], self.headers["Host"]))
        body = b'{"ok": true, "tokens": 7}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def two_agents():
    """HTTP servers on 127.0.0.1 and 127.0.0.2, same port: the allowed agent and the address a
    rebinding DNS answer points at later."""
    servers = []
    port = 0
    for address in ("127.0.0.1", "127.0.0.2"):
        server = http.server.ThreadingHTTPServer((address, port), _Agent)
        server.seen = []
        port = server.server_address[1]
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
    yield servers, port
    for server in servers:
        server.shutdown()
        server.server_close()


def test_over_real_sockets_the_connection_goes_only_to_the_checked_address(
    two_agents, settings, monkeypatch
):
    (allowed, forbidden), port = two_agents
    settings.BATON_AGENT_NETWORKS = ["127.0.0.1/32"]  # 127.0.0.2 is outside the policy
    dns = FakeDNS({"agent.test": ["127.0.0.1"]})
    monkeypatch.setattr(socket, "getaddrinfo", dns)
    url = f"http://agent.test:{port}/health"
    endpoints = ResolvedEndpoints(ttl_s=0)

    async def pinned_calls():
        transport = AsyncPinnedTransport(httpx.AsyncHTTPTransport(), endpoints)
        async with httpx.AsyncClient(transport=transport, trust_env=False) as client:
            assert (await client.get(url)).status_code == 200
            dns.table["agent.test"] = ["127.0.0.2"]  # rebinding
            with pytest.raises(EndpointRefused, match="not in BATON_AGENT_NETWORKS"):
                await client.get(url)

    asyncio.run(pinned_calls())
    with sync_client(endpoints, httpx.HTTPTransport()) as client:
        dns.table["agent.test"] = ["127.0.0.1"]
        assert client.get(url).status_code == 200
        dns.table["agent.test"] = ["127.0.0.2"]
        with pytest.raises(EndpointRefused):
            client.get(url)
    assert allowed.seen == [("127.0.0.1", f"agent.test:{port}")] * 2
    assert forbidden.seen == []
    # The name was looked up only by the checks: the connections went to the checked address.
    assert dns.asked.count("agent.test") == 4
    # Without pinning the same DNS answer reaches the forbidden address: the attack is real.
    with httpx.Client(trust_env=False) as unpinned:
        assert unpinned.get(url).status_code == 200
    assert forbidden.seen == [("127.0.0.2", f"agent.test:{port}")]
