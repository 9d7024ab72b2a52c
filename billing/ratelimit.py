"""Per-tenant requests-per-minute and tokens-per-minute limits, checked and charged in one
atomic step: a Lua script in Redis (shared by every gateway), or a lock in one process.

The algorithm is GCRA (the generic cell rate algorithm, a token bucket kept as one timestamp
per limit): a limit of N per minute lets a tenant use up to N at once, then refills at N/60
per second. There are no window boundaries, so a tenant can never get 2 N through by
straddling one (the fixed one-minute windows used before let RPM 5 pass 10 requests within
2 s). Per limit the state is the "theoretical arrival time" (TAT): when the tenant's debt
would be paid off. A request costing c at rate N/min adds c * 60/N seconds of debt; it is
allowed while the debt after charging stays within one minute, and is refused otherwise, with
the wait until it would fit as its Retry-After.
"""

from __future__ import annotations

import threading
import time
from typing import NamedTuple

WINDOW_S = 60.0

# KEYS: requests TAT, tokens TAT. ARGV: now, seconds per request, seconds per token, tokens,
# window. Both limits are checked before either is charged, so a refused request costs nothing.
# Returns {code, retry-after (string: Lua numbers become integers)}: 2 allowed, 0 requests,
# 1 tokens.
_LUA = """
local now = tonumber(ARGV[1])
local per_request = tonumber(ARGV[2])
local per_token = tonumber(ARGV[3])
local tokens = tonumber(ARGV[4])
local window = tonumber(ARGV[5])
local r = math.max(tonumber(redis.call('GET', KEYS[1]) or '0'), now) + per_request
local t = math.max(tonumber(redis.call('GET', KEYS[2]) or '0'), now) + per_token * tokens
if r - now > window then return {0, tostring(r - now - window)} end
if t - now > window then return {1, tostring(t - now - window)} end
redis.call('SET', KEYS[1], tostring(r), 'PX', math.ceil((r - now) * 1000) + 1000)
redis.call('SET', KEYS[2], tostring(t), 'PX', math.ceil((t - now) * 1000) + 1000)
return {2, '0'}
"""


class RateDecision(NamedTuple):
    allowed: bool
    limit: str  # "" when allowed, else "requests" or "tokens"
    retry_after_s: float


def _gcra(
    tat_r: float, tat_t: float, *, now: float, per_request: float, per_token: float, tokens: int
) -> tuple[int, float, float, float]:
    """(code, retry after, new requests TAT, new tokens TAT): the Lua script's rule."""
    r = max(tat_r, now) + per_request
    t = max(tat_t, now) + per_token * tokens
    if r - now > WINDOW_S:
        return 0, r - now - WINDOW_S, tat_r, tat_t
    if t - now > WINDOW_S:
        return 1, t - now - WINDOW_S, tat_r, tat_t
    return 2, 0.0, r, t


class RateLimiter:
    """Checks and charges a tenant's per-minute budgets; the same rule over Redis or memory."""

    def __init__(self, redis_url: str = "", *, prefix: str = "baton:rl") -> None:
        self.prefix = prefix
        self._lock = threading.Lock()
        self._tats: dict[str, tuple[float, float]] = {}
        self._checks = 0
        self._redis = None
        if redis_url:
            import redis

            self._redis = redis.Redis.from_url(redis_url)
            self._script = self._redis.register_script(_LUA)

    def check(
        self, *, tenant: str, rpm: int, tpm: int, tokens: int, now: float | None = None
    ) -> RateDecision:
        now = time.time() if now is None else now
        if tokens > tpm:
            # It could never fit in one minute; waiting would not help.
            return RateDecision(False, "tokens", WINDOW_S)
        per_request, per_token = WINDOW_S / rpm, WINDOW_S / tpm
        if self._redis is not None:
            base = f"{self.prefix}:{tenant}"
            code, retry = self._script(
                keys=[f"{base}:r", f"{base}:t"],
                args=[repr(now), repr(per_request), repr(per_token), tokens, WINDOW_S],
            )
            code, retry = int(code), float(retry)
        else:
            with self._lock:
                tat_r, tat_t = self._tats.get(tenant, (0.0, 0.0))
                code, retry, tat_r, tat_t = _gcra(
                    tat_r,
                    tat_t,
                    now=now,
                    per_request=per_request,
                    per_token=per_token,
                    tokens=tokens,
                )
                self._tats[tenant] = (tat_r, tat_t)
                self._checks += 1
                if self._checks % 1024 == 0:  # forget tenants whose debt is paid off
                    for name in [n for n, (a, b) in self._tats.items() if max(a, b) < now]:
                        del self._tats[name]
        if code == 2:
            return RateDecision(True, "", 0.0)
        return RateDecision(False, "requests" if code == 0 else "tokens", max(retry, 0.0))
