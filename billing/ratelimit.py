"""Per-tenant requests-per-minute and tokens-per-minute limits, checked and charged in one
atomic step: a Lua script in Redis (shared by every gateway), or a lock in one process."""

from __future__ import annotations

import threading
import time
from typing import NamedTuple

# Fixed one-minute windows. KEYS: rpm key, tpm key. ARGV: rpm limit, tpm limit, tokens, ttl.
# Both counters are checked before either is charged, so a refused request costs nothing.
_LUA = """
local r = tonumber(redis.call('GET', KEYS[1]) or '0')
local t = tonumber(redis.call('GET', KEYS[2]) or '0')
local tokens = tonumber(ARGV[3])
if r + 1 > tonumber(ARGV[1]) then return {0, r, t} end
if t + tokens > tonumber(ARGV[2]) then return {1, r, t} end
r = redis.call('INCR', KEYS[1])
t = redis.call('INCRBY', KEYS[2], tokens)
redis.call('EXPIRE', KEYS[1], ARGV[4])
redis.call('EXPIRE', KEYS[2], ARGV[4])
return {2, r, t}
"""


class RateDecision(NamedTuple):
    allowed: bool
    limit: str  # "" when allowed, else "requests" or "tokens"
    retry_after_s: float


class RateLimiter:
    """Checks and charges a tenant's minute budget; the same interface over Redis or memory."""

    def __init__(self, redis_url: str = "", *, prefix: str = "baton:rl") -> None:
        self.prefix = prefix
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, int], list[int]] = {}
        self._redis = None
        if redis_url:
            import redis

            self._redis = redis.Redis.from_url(redis_url)
            self._script = self._redis.register_script(_LUA)

    def check(
        self, *, tenant: str, rpm: int, tpm: int, tokens: int, now: float | None = None
    ) -> RateDecision:
        now = time.time() if now is None else now
        window = int(now // 60)
        retry = 60 - (now % 60)
        if tokens > tpm:
            # It could never fit in one minute; waiting would not help.
            return RateDecision(False, "tokens", 60.0)
        if self._redis is not None:
            base = f"{self.prefix}:{tenant}:{window}"
            code, _, _ = self._script(keys=[f"{base}:r", f"{base}:t"], args=[rpm, tpm, tokens, 120])
            code = int(code)
        else:
            with self._lock:
                counts = self._counts.setdefault((tenant, window), [0, 0])
                if counts[0] + 1 > rpm:
                    code = 0
                elif counts[1] + tokens > tpm:
                    code = 1
                else:
                    counts[0] += 1
                    counts[1] += tokens
                    code = 2
                for key in [k for k in self._counts if k[1] < window]:
                    del self._counts[key]
        if code == 2:
            return RateDecision(True, "", 0.0)
        return RateDecision(False, "requests" if code == 0 else "tokens", retry)
