"""Each gateway test starts with fresh per-process caches and rate-limit counters."""

from __future__ import annotations

import pytest

from routing.gateway import views


@pytest.fixture(autouse=True)
def fresh_gateway_state():
    views._limiter = None
    views.live_views.clear()
    views.policies.clear()
    yield
    views._limiter = None
    views.live_views.clear()
    views.policies.clear()
