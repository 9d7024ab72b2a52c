"""The ASGI body guard: bodies over the limit (declared or not) are 413, bodies that trickle
in slower than the timeout are 408, and everything else reaches the app unchanged."""

from __future__ import annotations

import asyncio
import json

import pytest

from controlplane.limits import BodyGuard


async def _echo_app(scope, receive, send):
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": body})


def _run(path: str, chunks: list[bytes], *, headers=(), delay_s: float = 0.0):
    sent: list[dict] = []
    queue = list(chunks)

    async def receive():
        if delay_s:
            await asyncio.sleep(delay_s)
        if not queue:
            await asyncio.sleep(3600)
        chunk = queue.pop(0)
        return {"type": "http.request", "body": chunk, "more_body": bool(queue)}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "path": path, "headers": list(headers)}
    asyncio.run(asyncio.wait_for(BodyGuard(_echo_app)(scope, receive, send), 10))
    status = sent[0]["status"]
    body = b"".join(m.get("body", b"") for m in sent[1:])
    return status, body


def test_a_small_body_reaches_the_app_whole():
    assert _run("/v1/completions", [b'{"a":', b"1}"]) == (200, b'{"a":1}')


def test_a_declared_length_over_the_limit_is_413_before_reading(settings):
    settings.BATON_MAX_BODY_BYTES = 10
    status, body = _run("/v1/completions", [b"x"], headers=[(b"content-length", b"11")])
    assert status == 413
    assert json.loads(body)["error"]["code"] == "body_too_large"


def test_an_undeclared_body_over_the_limit_is_413(settings):
    settings.BATON_MAX_API_BODY_BYTES = 10
    status, body = _run("/api/v1/datacenters/", [b"x" * 6, b"y" * 6])
    assert status == 413
    assert "detail" in json.loads(body)


def test_a_trickled_body_is_408_after_the_timeout(settings):
    settings.BATON_BODY_TIMEOUT_S = 0.3
    status, body = _run("/v1/completions", [b"x"] * 100, delay_s=0.05)
    assert status == 408
    assert json.loads(body)["error"]["code"] == "body_timeout"


@pytest.mark.parametrize("length", [b"abc", b"-"])
def test_a_bad_content_length_is_400(length):
    status, _ = _run("/v1/completions", [b"{}"], headers=[(b"content-length", length)])
    assert status == 400
