"""Rate limits have no window boundary: RPM N lets N through at once, then N/60 per second,
whenever the minute starts; the same rule in memory and in Redis."""

from __future__ import annotations

import os
import uuid

import pytest

from billing.ratelimit import RateLimiter


def _limiters():
    yield pytest.param(lambda: RateLimiter(""), id="memory")
    yield pytest.param(
        lambda: RateLimiter(os.environ["REDIS_URL"], prefix=f"test-rl-{uuid.uuid4().hex[:8]}"),
        id="redis",
        marks=pytest.mark.redis,
    )


@pytest.mark.parametrize("make", _limiters())
def test_no_burst_of_twice_the_rpm_across_a_minute_boundary(make):
    limiter = make()
    start = 1_000_019.0 * 60 - 1.0  # one second before a minute boundary
    passed = [
        limiter.check(tenant="t", rpm=5, tpm=10**6, tokens=1, now=start + i * 0.22).allowed
        for i in range(10)  # 10 requests within 1.98 s
    ]
    assert sum(passed) == 5
    assert passed[:5] == [True] * 5


@pytest.mark.parametrize("make", _limiters())
def test_the_budget_refills_at_the_rate_and_says_when(make):
    limiter = make()
    now = 2_000_000.0
    for _ in range(6):
        assert limiter.check(tenant="t", rpm=6, tpm=10**6, tokens=1, now=now).allowed
    refused = limiter.check(tenant="t", rpm=6, tpm=10**6, tokens=1, now=now + 1)
    assert refused.allowed is False and refused.limit == "requests"
    assert refused.retry_after_s == pytest.approx(9.0)  # one request per 10 s
    assert limiter.check(tenant="t", rpm=6, tpm=10**6, tokens=1, now=now + 10).allowed
    assert not limiter.check(tenant="t", rpm=6, tpm=10**6, tokens=1, now=now + 11).allowed


@pytest.mark.parametrize("make", _limiters())
def test_tokens_refill_the_same_way_and_a_refusal_costs_nothing(make):
    limiter = make()
    now = 3_000_000.0
    assert limiter.check(tenant="t", rpm=100, tpm=600, tokens=600, now=now).allowed
    refused = limiter.check(tenant="t", rpm=100, tpm=600, tokens=60, now=now)
    assert (refused.allowed, refused.limit) == (False, "tokens")
    assert refused.retry_after_s == pytest.approx(6.0)
    # After 6 s exactly 60 tokens have come back.
    assert limiter.check(tenant="t", rpm=100, tpm=600, tokens=60, now=now + 6).allowed
    assert not limiter.check(tenant="t", rpm=100, tpm=600, tokens=1, now=now + 6).allowed


@pytest.mark.parametrize("make", _limiters())
def test_sustained_traffic_gets_the_rate_over_any_minute(make):
    limiter = make()
    now, allowed = 4_000_000.0, 0
    for step in range(600):  # 10 requests/s for 60 s against RPM 60
        allowed += limiter.check(
            tenant="t", rpm=60, tpm=10**6, tokens=1, now=now + step * 0.1
        ).allowed
    assert 60 <= allowed <= 60 + 60  # the minute's burst plus one per second, never more
