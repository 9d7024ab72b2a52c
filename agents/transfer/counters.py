"""Byte and transfer counters per fabric and per request id, for the agent's /state endpoint.

Counted: payload bytes (the KV the engine handed over), wire bytes (frames as they crossed the
socket), completed transfers and failures, split by fabric and by direction (sent / received).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import NamedTuple

DEFAULT_MAX_REQUESTS = 10_000


class FabricName:
    """The two fabrics a prefill agent ships KV over."""

    INTRA_DC = "intra_dc"  # RDMA stand-in inside datacenter A (P -> RelayDecode)
    WAN = "wan"  # shaped TCP across datacenters (P -> MainDecode)
    ALL = (INTRA_DC, WAN)


class Direction:
    SENT = "sent"
    RECEIVED = "received"
    ALL = (SENT, RECEIVED)


class CounterValues(NamedTuple):
    transfers: int = 0
    payload_bytes: int = 0
    wire_bytes: int = 0
    failures: int = 0

    def add(self, other: CounterValues) -> CounterValues:
        return CounterValues(*(mine + theirs for mine, theirs in zip(self, other, strict=True)))


_Key = tuple[str, str]  # (fabric, direction)


class FabricCounters:
    """Thread-safe counters; the agent's event loop writes them, /state may read from anywhere.

    Per-request entries are kept for the most recent `max_requests` request ids only, so a
    long-running agent does not grow without bound; the per-fabric totals never forget.
    """

    def __init__(self, *, max_requests: int = DEFAULT_MAX_REQUESTS) -> None:
        if max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {max_requests}")
        self._max_requests = max_requests
        self._lock = threading.Lock()
        self._fabrics: dict[_Key, CounterValues] = {}
        self._requests: OrderedDict[str, dict[_Key, CounterValues]] = OrderedDict()

    def record_transfer(
        self,
        *,
        fabric: str,
        direction: str,
        request_id: str,
        payload_bytes: int,
        wire_bytes: int,
    ) -> None:
        """Count one completed transfer."""
        self._add(fabric, direction, request_id, CounterValues(1, payload_bytes, wire_bytes, 0))

    def record_failure(
        self, *, fabric: str, direction: str, request_id: str | None, wire_bytes: int = 0
    ) -> None:
        """Count one failed transfer (request_id None when the stream failed before naming one)."""
        self._add(fabric, direction, request_id, CounterValues(0, 0, wire_bytes, 1))

    def totals(self, fabric: str, direction: str = Direction.SENT) -> CounterValues:
        with self._lock:
            return self._fabrics.get((fabric, direction), CounterValues())

    def for_request(
        self, request_id: str, fabric: str, direction: str = Direction.SENT
    ) -> CounterValues:
        with self._lock:
            return self._requests.get(request_id, {}).get((fabric, direction), CounterValues())

    def snapshot(self) -> dict[str, object]:
        """JSON-ready copy: {"fabrics": {fabric: {direction: {...}}}, "requests": {...}}."""
        with self._lock:
            return {
                "fabrics": _nest(self._fabrics),
                "requests": {rid: _nest(per) for rid, per in self._requests.items()},
            }

    def reset(self) -> None:
        with self._lock:
            self._fabrics.clear()
            self._requests.clear()

    def _add(
        self, fabric: str, direction: str, request_id: str | None, values: CounterValues
    ) -> None:
        if fabric not in FabricName.ALL:
            raise ValueError(f"fabric must be one of {FabricName.ALL}, got {fabric!r}")
        if direction not in Direction.ALL:
            raise ValueError(f"direction must be one of {Direction.ALL}, got {direction!r}")
        key = (fabric, direction)
        with self._lock:
            self._fabrics[key] = self._fabrics.get(key, CounterValues()).add(values)
            if request_id is None:
                return
            per_request = self._requests.setdefault(request_id, {})
            self._requests.move_to_end(request_id)
            per_request[key] = per_request.get(key, CounterValues()).add(values)
            while len(self._requests) > self._max_requests:
                self._requests.popitem(last=False)


def _nest(flat: dict[_Key, CounterValues]) -> dict[str, dict[str, dict[str, int]]]:
    nested: dict[str, dict[str, dict[str, int]]] = {}
    for (fabric, direction), values in flat.items():
        nested.setdefault(fabric, {})[direction] = values._asdict()
    return nested
