"""Each gateway test starts with fresh per-process caches and rate-limit counters."""

from __future__ import annotations

import uuid

import pytest
from django.conf import settings

from billing.ratelimit import RateLimiter
from routing.gateway import views


@pytest.fixture(autouse=True)
def fresh_gateway_state():
    # A key prefix of its own: with Redis, counters would otherwise carry over between tests.
    views._limiter = RateLimiter(settings.REDIS_URL, prefix=f"test-rl-{uuid.uuid4().hex[:8]}")
    views.live_views.clear()
    views.policies.clear()
    views.api_keys.clear()
    views.served_models.clear()
    views.dispatches.clear()
    views.dispatched_blocks.clear()
    views.suspects.clear()
    views.api_keys.clear()
    views.served_models.clear()
    yield
    views._limiter = None
    views.dispatches.clear()
    views.dispatched_blocks.clear()
    views.suspects.clear()
    views.live_views.clear()
    views.policies.clear()
    views.api_keys.clear()
    views.served_models.clear()
