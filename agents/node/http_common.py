"""What the agent's HTTP handlers share (http_commands.py, http_data.py): JSON errors, the
bearer check, the request body, and the NDJSON event stream."""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from agents.node.wire import bad, need_dict


class EventStream(Response):
    """NDJSON stream of event dicts. If the client goes away the producer is cancelled (so its
    cleanup runs at once), and `on_close` always runs exactly once afterwards."""

    media_type = "application/x-ndjson"

    def __init__(
        self, events: AsyncGenerator[dict[str, Any], None], on_close: Callable[[], Awaitable[None]]
    ) -> None:
        self.events = events
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-store"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def produce() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for event in self.events:
                line = json.dumps(event, separators=(",", ":")) + "\n"
                await send({"type": "http.response.body", "body": line.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def listen() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        producer = asyncio.create_task(produce())
        listener = asyncio.create_task(listen())
        try:
            await asyncio.wait({producer, listener}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (producer, listener):
                task.cancel()
            await asyncio.gather(producer, listener, return_exceptions=True)
            try:
                await self.events.aclose()
            finally:
                await self.on_close()


async def nothing() -> None:
    """An EventStream's close with nothing to release."""


def error(
    status: int, message: str, field: str | None = None, code: str | None = None
) -> JSONResponse:
    body: dict[str, Any] = {"error": message}
    if field:
        body["field"] = field
    if code:
        body["code"] = code
    return JSONResponse(body, status_code=status)


def bearer_ok(request: Request, token: str | None) -> bool:
    """True when no token is required or the request carries it (constant-time compare)."""
    if token is None:
        return True
    given = request.headers.get("authorization", "")
    return hmac.compare_digest(given.encode(), f"Bearer {token}".encode())


async def body_of(request: Request) -> dict[str, Any]:
    """The request's JSON object; AgentError (400, field "body") otherwise."""
    try:
        raw = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise bad("body", "must be JSON") from None
    return need_dict(raw)
