"""Overload queues, it does not fail: a request an engine has no room for now (``engine_full``
from P, or from MD / RLD before any token) waits here and is routed again as capacity frees,
with no instance blamed. Bounded (per process, and per tenant for a fair share), and for at
most ``BATON_GATEWAY_QUEUE_TIMEOUT_S``; past any bound the client gets a status code with
``Retry-After`` (the response has not started: views.py waits for the first token before it
answers a stream). A full engine is never marked suspect."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from django.conf import settings

from routing.gateway.errors import GatewayError

FIRST_WAIT_S = 0.05
MAX_WAIT_S = 1.0


@dataclass
class QueueStats:
    """What /metrics and the dashboard show: requests waiting now, and totals."""

    waiting: int = 0
    queued_total: int = 0  # requests that waited at least once
    wait_seconds_total: float = 0.0
    timed_out_total: int = 0
    refused_total: int = 0  # queue or tenant share full
    by_tenant: Counter = field(default_factory=Counter)
    # Requests P's engine holds in its queue now (P's stream said "queued", no token yet), and
    # those let go after BATON_GATEWAY_PREFILL_QUEUE_TIMEOUT_S there.
    at_prefill: int = 0
    prefill_timed_out_total: int = 0


class OverloadQueue:
    def __init__(self) -> None:
        self.stats = QueueStats()
        self._lock = threading.Lock()

    @staticmethod
    def limits() -> tuple[float, int, int]:
        return (
            float(settings.BATON_GATEWAY_QUEUE_TIMEOUT_S),
            int(settings.BATON_GATEWAY_QUEUE_MAX),
            int(settings.BATON_GATEWAY_QUEUE_PER_TENANT),
        )

    async def wait(self, tenant: str, since: float, tries: int) -> None:
        """Wait before routing a busy request again (backoff with jitter, 50 ms to 1 s);
        GatewayError 503 / 429 with Retry-After when the request has waited its limit or the
        queue (or the tenant's share of it) is full."""
        timeout, most, per_tenant = self.limits()
        waited = time.monotonic() - since
        if waited >= timeout:
            with self._lock:
                self.stats.timed_out_total += 1
            raise GatewayError(
                503,
                f"The fleet has had no room for this request for {waited:.0f} s; retry later.",
                type_="server_error",
                code="overloaded",
                headers={"Retry-After": str(max(1, int(min(timeout, 30))))},
            )
        with self._lock:
            if self.stats.waiting >= most or self.stats.by_tenant[tenant] >= per_tenant:
                self.stats.refused_total += 1
                share = self.stats.by_tenant[tenant] >= per_tenant
                raise GatewayError(
                    429 if share else 503,
                    "Too many requests waiting for room"
                    + (" for this tenant" if share else "")
                    + "; retry later.",
                    type_="rate_limit_error" if share else "server_error",
                    code="queue_full",
                    headers={"Retry-After": "2"},
                )
            self.stats.waiting += 1
            self.stats.by_tenant[tenant] += 1
            if tries == 0:
                self.stats.queued_total += 1
        delay = min(MAX_WAIT_S, FIRST_WAIT_S * 2**tries) * (0.5 + random.random())
        delay = min(delay, max(0.0, timeout - waited))
        began = time.monotonic()
        try:
            await asyncio.sleep(delay)
        finally:
            with self._lock:
                self.stats.waiting -= 1
                self.stats.by_tenant[tenant] -= 1
                if self.stats.by_tenant[tenant] <= 0:
                    del self.stats.by_tenant[tenant]
                self.stats.wait_seconds_total += time.monotonic() - began

    def queued_at_prefill(self, entered: bool) -> None:
        """A request's attempt began (True) or ended (False) waiting in P's engine queue."""
        with self._lock:
            self.stats.at_prefill += 1 if entered else -1

    def prefill_queue_timeout(self, waited: float) -> GatewayError:
        """The 503 of a request that waited BATON_GATEWAY_PREFILL_QUEUE_TIMEOUT_S in P's queue."""
        with self._lock:
            self.stats.prefill_timed_out_total += 1
        return GatewayError(
            503,
            f"The request waited {waited:.0f} s in the prefill queue without starting; "
            "retry later.",
            type_="server_error",
            code="overloaded",
            headers={"Retry-After": "30"},
        )


overload = OverloadQueue()
