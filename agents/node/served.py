"""What each recent request streamed to its caller, kept after the stream ends.

The gateway writes a durable admission for every request it accepts; when the gateway process
dies (SIGKILL) a later one finishes that admission as ``interrupted`` and bills the tokens the
agents report here, not only the count the dead process last saved. P is the agent the
gateway's stream comes from, so P's count is what the user was sent (PROTOCOL.md,
``GET /v1/pdd/requests/{request_id}``)."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

RUNNING = "running"
DONE = "done"  # the stream ended with its `done` event
FAILED = "failed"  # it ended with an `error` event
CLOSED = "closed"  # the caller went away (or the stream broke) before the end


@dataclass(slots=True)
class Served:
    request_id: str
    started_at: float  # wall time
    tokens: int = 0
    state: str = RUNNING
    finish_reason: str | None = None
    ended_at: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "tokens": self.tokens,
            "state": self.state,
            "finish_reason": self.finish_reason,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
        }


class ServedLedger:
    """The last `capacity` requests (newest last), each forgotten `horizon_s` after it ended."""

    def __init__(self, capacity: int = 16384, horizon_s: float = 3600.0) -> None:
        if capacity < 1 or horizon_s <= 0:
            raise ValueError("capacity must be >= 1 and horizon_s > 0")
        self.capacity = capacity
        self.horizon_s = horizon_s
        self._entries: OrderedDict[str, Served] = OrderedDict()

    def open(self, request_id: str) -> Served:
        entry = Served(request_id, time.time())
        self._entries[request_id] = entry
        self._entries.move_to_end(request_id)
        self._trim()
        return entry

    def get(self, request_id: str) -> Served | None:
        self._trim()
        return self._entries.get(request_id)

    def __len__(self) -> int:
        return len(self._entries)

    def _trim(self) -> None:
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        now = time.time()
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if oldest.ended_at is None or now - oldest.ended_at <= self.horizon_s:
                break
            self._entries.popitem(last=False)

    async def count(
        self, request_id: str, events: AsyncIterator[dict[str, Any]]
    ) -> AsyncGenerator[dict[str, Any], None]:
        """Pass `events` through, counting the token events handed on to the caller."""
        entry = self.open(request_id)
        try:
            async for event in events:
                kind = event.get("type")
                if kind == "token":
                    entry.tokens += 1
                elif kind == "done":
                    entry.state, entry.finish_reason = DONE, event.get("finish_reason")
                elif kind == "error":
                    entry.state = FAILED
                yield event
        finally:
            if entry.state == RUNNING:
                entry.state = CLOSED
            entry.ended_at = time.time()
            close = getattr(events, "aclose", None)
            if close is not None:
                await close()
