"""The gateway's HTTP transport to the agents: httpx's API on aiohttp's connections.

Every token of a stream is one read from an agent's socket. Through httpcore each read passes
anyio's stream and timeout scopes and h11's parser in Python: ~125 us of CPU per NDJSON event
on this machine, against ~45 us through aiohttp's C parser behind the same httpx client
(32 concurrent 64-event streams, ``bench/gateway/SCALE.md``). So the gateway keeps httpx for
what it does above the wire (the pinning transport, fleet.pinning, wraps this one; tests swap
this one for a mock) and lets aiohttp own the connections.

What is kept from the httpx transport it replaces: a connection pool per agent (aiohttp keys
its pool by host and port) of at most ``max_per_agent`` connections, idle ones closed after
``keepalive_s``; httpx's timeouts (connect, read, pool); no redirect followed, no proxy from
the environment, no decompression; the pinned request's Host header and TLS server name
(``sni_hostname``) as fleet.pinning sets them. aiohttp's failures are raised as the httpx
exceptions a caller handles (ConnectError, ConnectTimeout, ReadTimeout, RemoteProtocolError,
ReadError). A stream closed before its end closes its connection, which the agents take as
the caller's cancellation (agents/PROTOCOL.md).

One aiohttp session per event loop (made on first use in that loop): the gateway runs on one,
tests run several in turn."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import httpx

# httpx sets these itself; aiohttp would add its own otherwise.
_SKIP_AUTO = ("User-Agent", "Accept", "Accept-Encoding", "Content-Type")


def _as_httpx(exc: BaseException, *, reading: bool) -> httpx.HTTPError:
    """The httpx exception standing for an aiohttp failure."""
    text = f"{type(exc).__name__}: {exc}".rstrip(": ")
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return httpx.ConnectTimeout(text)
    if isinstance(exc, aiohttp.SocketTimeoutError):  # no byte for the read timeout
        return httpx.ReadTimeout(text)
    if isinstance(exc, TimeoutError):
        return httpx.ReadTimeout(text) if reading else httpx.PoolTimeout(text)
    if isinstance(exc, aiohttp.ClientConnectorError):
        return httpx.ConnectError(text)
    if isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError)):
        return httpx.RemoteProtocolError(text)
    if isinstance(exc, aiohttp.ClientResponseError):
        return httpx.RemoteProtocolError(text)
    return httpx.ReadError(text) if reading else httpx.ConnectError(text)


class _Body(httpx.AsyncByteStream):
    """An aiohttp response's body as httpx reads it: each chunk as it arrives."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _as_httpx(exc, reading=True) from exc

    async def aclose(self) -> None:
        if self._response.content.at_eof():
            self._response.release()  # read to its end: the connection goes back to the pool
        else:
            self._response.close()  # cut short: closed, the agent sees the cancellation


class AiohttpTransport(httpx.AsyncBaseTransport):
    """An httpx transport sending each request through an aiohttp session (per event loop)."""

    def __init__(
        self, *, ssl_context: ssl.SSLContext, max_per_agent: int, keepalive_s: float
    ) -> None:
        self.ssl_context = ssl_context
        self.max_per_agent = max_per_agent
        self.keepalive_s = keepalive_s
        self._sessions: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}

    def _session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        session = self._sessions.get(loop)
        if session is None or session.closed:
            for old in [lp for lp in self._sessions if lp.is_closed()]:
                del self._sessions[old]  # its loop is gone, and its connections with it
            connector = aiohttp.TCPConnector(
                ssl=self.ssl_context,
                limit=0,
                limit_per_host=self.max_per_agent,
                keepalive_timeout=self.keepalive_s,
                use_dns_cache=False,  # fleet.pinning resolves; a pinned URL names an address
            )
            session = aiohttp.ClientSession(
                connector=connector, auto_decompress=False, trust_env=False
            )
            self._sessions[loop] = session
        return session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        limits: dict[str, Any] = request.extensions.get("timeout") or {}
        connect, pool = limits.get("connect"), limits.get("pool")
        timeout = aiohttp.ClientTimeout(
            total=None,
            connect=None if connect is None or pool is None else connect + pool,
            sock_connect=connect,
            sock_read=limits.get("read"),
        )
        body = await request.aread()
        sni = request.extensions.get("sni_hostname")
        try:
            response = await self._session().request(
                request.method,
                str(request.url),
                headers=list(request.headers.multi_items()),
                data=body or None,
                allow_redirects=False,
                timeout=timeout,
                server_hostname=sni.decode() if isinstance(sni, bytes) else sni,
                skip_auto_headers=_SKIP_AUTO,
            )
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _as_httpx(exc, reading=False) from exc
        return httpx.Response(
            response.status,
            headers=list(response.raw_headers),
            stream=_Body(response),
            extensions={"http_version": b"HTTP/1.1"},
        )

    async def aclose(self) -> None:
        sessions, self._sessions = list(self._sessions.values()), {}
        for session in sessions:
            await session.close()
