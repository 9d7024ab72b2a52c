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
