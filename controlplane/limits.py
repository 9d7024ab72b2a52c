"""Request-body limits: how large a body may be on each part of the API, how long a client may
take to send it, and the error it gets otherwise, in the caller's error shape (OpenAI's on
``/v1``, DRF's ``{"detail": ...}`` everywhere else).

Two layers apply them: ``BodyLimitMiddleware`` (Django; refuses a declared Content-Length over
the limit before anything reads the body) and ``BodyGuard`` (ASGI; reads the body itself, so a
body without a Content-Length, or one trickled in byte by byte, is cut off too).
"""

from __future__ import annotations

import asyncio
import json
import time

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.conf import settings
from django.http import JsonResponse

from routing.gateway.request_ids import answer_id
from routing.gateway.timing import RECEIVED

MIB = 1024 * 1024


def body_limit(path: str) -> int:
    """Most bytes a request body to `path` may have."""
    if path.startswith("/v1/"):
        return int(getattr(settings, "BATON_MAX_BODY_BYTES", 4 * MIB))
    if path.startswith("/api/v1/agent/"):
        return int(getattr(settings, "BATON_MAX_HEARTBEAT_BYTES", 4 * MIB))
    return int(getattr(settings, "BATON_MAX_API_BODY_BYTES", 1 * MIB))


def body_timeout_s() -> float:
    return float(getattr(settings, "BATON_BODY_TIMEOUT_S", 15.0))


def error_body(path: str, status: int, message: str, code: str) -> dict:
    if path.startswith("/v1/"):
        return {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": None,
                "code": code,
            }
        }
    return {"detail": message, "code": code}


def too_large_message(limit: int) -> str:
    return f"The request body is larger than {limit} bytes ({limit / MIB:g} MiB), the limit here."


def error_response(
    path: str, status: int, message: str, code: str, request_id: str | None = None
) -> JsonResponse:
    response = JsonResponse(error_body(path, status, message, code), status=status)
    if path.startswith("/v1/"):  # every gateway answer carries one (request_ids.py)
        response["X-Request-Id"] = answer_id(path, request_id)
    return response


class BodyLimitMiddleware:
    """413 for a declared Content-Length over the path's limit, before the body is read.
    Sync and async (no thread hop under ASGI)."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response) -> None:
        self.get_response = get_response
        self.async_mode = iscoroutinefunction(get_response)
        if self.async_mode:
            markcoroutinefunction(self)

    def __call__(self, request):
        refused = self._refuse(request)
        if self.async_mode:
            return self._acall(request, refused)
        return refused if refused is not None else self.get_response(request)

    async def _acall(self, request, refused):
        return refused if refused is not None else await self.get_response(request)

    @staticmethod
    def _refuse(request):
        """The error response for a declared length that is not a number or over the limit."""
        try:
            declared = int(request.META.get("CONTENT_LENGTH") or 0)
        except ValueError:
            return error_response(
                request.path,
                400,
                "Content-Length is not a number.",
                "bad_length",
                request.headers.get("X-Request-Id"),
            )
        limit = body_limit(request.path)
        if declared > limit:
            return error_response(
                request.path,
                413,
                too_large_message(limit),
                "body_too_large",
                request.headers.get("X-Request-Id"),
            )
        return None


class BodyGuard:
    """ASGI middleware: reads an HTTP request's body (at most the path's limit, within the
    body timeout) before the app sees it, then hands the app the same messages.

    413 for a body over the limit (declared or sent), 408 for one that takes longer than
    ``BATON_BODY_TIMEOUT_S`` to arrive: 30 clients sending a byte a second hold nothing for
    long. Django reads the whole body before a view runs anyway, so nothing streams less.
    """

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope[RECEIVED] = time.perf_counter()  # the gateway's first Server-Timing lap
        path = scope.get("path", "")
        limit = body_limit(path)
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    return await _answer(
                        send, path, 400, "Content-Length is not a number.", "bad_length", scope
                    )
                if declared > limit:
                    return await _answer(
                        send, path, 413, too_large_message(limit), "body_too_large", scope
                    )
        messages: list[dict] = []
        size = 0
        deadline = time.monotonic() + body_timeout_s()
        while True:
            left = deadline - time.monotonic()
            try:
                # Not wait_for: on Python 3.11 it can swallow a cancellation of this task.
                async with asyncio.timeout(max(left, 0.001)):
                    message = await receive()
            except TimeoutError:
                return await _answer(
                    send,
                    path,
                    408,
                    f"The request body did not arrive within {body_timeout_s():g} s.",
                    "body_timeout",
                    scope,
                )
            if message["type"] == "http.disconnect":
                return None
            size += len(message.get("body", b""))
            if size > limit:
                return await _answer(
                    send, path, 413, too_large_message(limit), "body_too_large", scope
                )
            messages.append(message)
            if not message.get("more_body", False):
                break

        async def replay():
            if messages:
                return messages.pop(0)
            return await receive()

        return await self.app(scope, replay, send)


async def _answer(
    send, path: str, status: int, message: str, code: str, scope: dict | None = None
) -> None:
    body = json.dumps(error_body(path, status, message, code)).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    if path.startswith("/v1/"):  # every gateway answer carries one (request_ids.py)
        sent = next(
            (v for k, v in (scope or {}).get("headers", ()) if k.lower() == b"x-request-id"),
            b"",
        )
        rid = answer_id(path, sent.decode("latin-1"))
        headers.append((b"x-request-id", rid.encode("ascii")))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
