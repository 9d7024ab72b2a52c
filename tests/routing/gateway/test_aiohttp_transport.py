"""The gateway's transport to the agents (routing/gateway/transport.py): httpx's API on
aiohttp's connections, against a real socket. Chunks arrive as the agent sends them; the
pinned request's Host header is what the agent sees; no redirect is followed; idle connections
are reused; a stream cut short closes its connection (the agent's cancellation); failures are
the httpx exceptions the gateway handles."""

from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
import pytest

from fleet.agent_client import tls_context
from routing.gateway import runner
from routing.gateway.transport import AiohttpTransport


class Agent:
    """A tiny HTTP/1.1 server: ``/stream`` sends NDJSON lines 20 ms apart (chunked),
    ``/redirect`` a 307, ``/slow`` nothing for 1 s. It notes each request's head and body,
    the connections it accepted, and the streams whose caller left before their end."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, str], bytes]] = []
        self.connections = 0
        self.cut: list[int] = []
        self.server: asyncio.base_events.Server | None = None
        self.port = 0

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                line, *rest = head.decode().split("\r\n")
                headers = {
                    k.lower(): v.strip() for k, _, v in (h.partition(":") for h in rest if h)
                }
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                path = line.split()[1]
                self.requests.append((path, headers, body))
                if path == "/redirect":
                    writer.write(b"HTTP/1.1 307 Temporary Redirect\r\nLocation: http://x/\r\n"
                                 b"Content-Length: 0\r\n\r\n")  # fmt: skip
                elif path == "/slow":
                    with contextlib.suppress(asyncio.CancelledError):  # the loop may end first
                        await asyncio.sleep(1)
                    return
                else:
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\n"
                                 b"Transfer-Encoding: chunked\r\n\r\n")  # fmt: skip
                    for i in range(5):
                        data = (json.dumps({"type": "token", "index": i}) + "\n").encode()
                        writer.write(b"%x\r\n%s\r\n" % (len(data), data))
                        try:
                            await writer.drain()
                        except ConnectionError:
                            self.cut.append(i)
                            return
                        await asyncio.sleep(0.02)
                        if writer.is_closing() or reader.at_eof():
                            self.cut.append(i)
                            return
                    writer.write(b"0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()


def _client(**timeouts) -> httpx.AsyncClient:
    transport = AiohttpTransport(ssl_context=tls_context(), max_per_agent=8, keepalive_s=2.0)
    return httpx.AsyncClient(
        transport=transport, timeout=httpx.Timeout(**({"timeout": 5.0} | timeouts))
    )


def _run(scenario):
    async def main():
        agent = Agent()
        await agent.start()
        try:
            return await scenario(agent)
        finally:
            await agent.stop()

    return asyncio.run(main())


def test_a_stream_arrives_chunk_by_chunk_with_the_pinned_host_and_the_body():
    async def scenario(agent):
        async with _client() as client:
            url = f"http://127.0.0.1:{agent.port}/stream"
            headers = {"Host": "p1.agents.test:9000", "Authorization": "Bearer t"}
            async with client.stream("POST", url, json={"prompt_ids": "AQAAAA=="},
                                     headers=headers) as response:  # fmt: skip
                assert response.status_code == 200
                assert response.headers["content-type"] == "application/x-ndjson"
                chunks = [c async for c in response.aiter_bytes()]
        return agent, chunks

    agent, chunks = _run(scenario)
    assert len(chunks) == 5  # one read per event, as the agent sent them 20 ms apart
    assert [json.loads(c)["index"] for c in chunks] == [0, 1, 2, 3, 4]
    (path, headers, body), = agent.requests  # fmt: skip
    assert path == "/stream" and headers["host"] == "p1.agents.test:9000"
    assert headers["authorization"] == "Bearer t"
    assert json.loads(body) == {"prompt_ids": "AQAAAA=="}
    assert headers["content-type"] == "application/json"


def test_idle_connections_are_reused_and_no_redirect_is_followed():
    async def scenario(agent):
        async with _client() as client:
            for _ in range(3):
                response = await client.post(f"http://127.0.0.1:{agent.port}/stream", json={})
                assert response.status_code == 200 and len(response.content.splitlines()) == 5
            redirect = await client.post(f"http://127.0.0.1:{agent.port}/redirect", json={})
        return agent, redirect

    agent, redirect = _run(scenario)
    assert agent.connections == 1  # the three streams and the redirect on one connection
    assert redirect.status_code == 307 and [r[0] for r in agent.requests][-1] == "/redirect"


def test_a_stream_cut_short_closes_its_connection():
    async def scenario(agent):
        async with _client() as client:
            async with client.stream("POST", f"http://127.0.0.1:{agent.port}/stream",
                                     json={}) as response:  # fmt: skip
                async for _ in response.aiter_bytes():
                    break  # the caller leaves after the first event
            for _ in range(50):
                if agent.cut:
                    break
                await asyncio.sleep(0.02)
            again = await client.post(f"http://127.0.0.1:{agent.port}/stream", json={})
        return agent, again

    agent, again = _run(scenario)
    assert agent.cut and agent.cut[0] < 4  # the agent saw its caller go
    assert again.status_code == 200 and agent.connections == 2  # not reused after the cut


def test_failures_are_the_httpx_exceptions_the_gateway_handles():
    async def refused():
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        async with _client() as client:
            with pytest.raises(httpx.ConnectError):
                await client.post(f"http://127.0.0.1:{port}/stream", json={})

    asyncio.run(refused())

    async def slow(agent):
        async with _client(read=0.2) as client:
            with pytest.raises(httpx.ReadTimeout):
                await client.post(f"http://127.0.0.1:{agent.port}/slow", json={})

    _run(slow)


def test_the_gateway_client_is_pinned_over_this_transport(monkeypatch):
    monkeypatch.setattr(runner, "_client", None)
    client = runner.http_client()
    assert isinstance(client._transport.inner, AiohttpTransport)
    asyncio.run(client.aclose())
    monkeypatch.setattr(runner, "_client", None)
