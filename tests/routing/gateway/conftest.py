"""Each gateway test starts with fresh per-process caches and rate-limit counters."""

from __future__ import annotations

import uuid

import pytest
from django.conf import settings

from billing.ratelimit import RateLimiter
from routing.gateway import admission, routes


@pytest.fixture(autouse=True)
def fresh_gateway_state():
    # A key prefix of its own: with Redis, counters would otherwise carry over between tests.
    admission._limiter = RateLimiter(settings.REDIS_URL, prefix=f"test-rl-{uuid.uuid4().hex[:8]}")
    routes.live_views.clear()
    routes.policies.clear()
    admission.api_keys.clear()
    admission.served_models.clear()
    routes.dispatches.clear()
    routes.dispatched_blocks.clear()
    routes.suspects.clear()
    admission.api_keys.clear()
    admission.served_models.clear()
    yield
    admission._limiter = None
    routes.dispatches.clear()
    routes.dispatched_blocks.clear()
    routes.suspects.clear()
    routes.live_views.clear()
    routes.policies.clear()
    admission.api_keys.clear()
    admission.served_models.clear()


def post_stream(client, path: str, body: dict) -> tuple[int, bytes]:
    """POST a streaming request and read its body in one event loop, as the ASGI server does
    (the view awaits the first tokens before it answers; the rest of the stream continues on
    the same loop). ``client`` is an APIClient whose credentials are used."""
    import json

    from asgiref.sync import async_to_sync
    from django.test import AsyncClient

    headers = {
        k[5:].replace("_", "-").title(): v
        for k, v in getattr(client, "_credentials", {}).items()
        if k.startswith("HTTP_")
    }

    async def go() -> tuple[int, bytes]:
        response = await AsyncClient().post(
            path, json.dumps(body), content_type="application/json", headers=headers
        )
        if not response.streaming:
            return response.status_code, response.content
        return response.status_code, b"".join([chunk async for chunk in response.streaming_content])

    return async_to_sync(go)()
