"""MD's stream after RLD's handoff, kept apart from whoever reads it (one hop per token).

In p-rld-md the gateway reads RLD's stream; once MD acknowledged the handoff, RLD ends its
stream with a ``continue`` naming MD's ``/v1/pdd/attach`` and lets go, and the gateway reads
MD's tokens itself from the handoff's token index on. MD's decoding must therefore outlive the
stream RLD opened: a `Tail` runs it as a task of its own, keeps its events, and serves any
reader from a token index (RLD's held stream first, then the gateway's attach).

A tail ends with its request (``done`` or ``error``, then its cleanup). It is cancelled when
nobody has read it for `grace_s` (the agent's ``handoff_attach_s``: the reader left and no
attach came), or by the request's cancel (``POST /v1/pdd/cancel``, which reaches its inbox).
An ended tail is kept `grace_s` more, so an attach that comes after a short remainder still
gets its tokens and ``done``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

log = logging.getLogger(__name__)


class Tail:
    """One request's post-handoff events on MD and the task that makes them."""

    def __init__(self, request_id: str, instance_id: str, grace_s: float) -> None:
        self.request_id = request_id
        self.instance_id = instance_id
        self.grace_s = grace_s
        self.events: list[dict[str, Any]] = []
        self.ended = False
        self.finished = False  # ended with `done`
        self.readers = 0
        self.attached = 0  # readers that came through /v1/pdd/attach
        self._changed = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._timer: asyncio.TimerHandle | None = None
        # Why the tail was cancelled, for its readers: nobody read it, or the agent stops.
        self._cancelled_because = ""
        # The agent's counts (Tails.counts), when it runs under one.
        self.counts: dict[str, int] = {}

    def start(
        self,
        events: AsyncIterator[dict[str, Any]],
        cleanup: Callable[[bool], Awaitable[None]],
        on_forget: Callable[[], None],
    ) -> None:
        """Run `events` (MD's decode loop) into this tail; `cleanup(finished)` runs once at
        its end, and `on_forget` when the ended tail is dropped (grace_s later)."""
        self._task = asyncio.create_task(self._run(events, cleanup, on_forget))

    async def _run(self, events, cleanup, on_forget) -> None:
        try:
            async for event in events:
                self._append(event)
                if event.get("type") == "done":
                    self.finished = True
        except asyncio.CancelledError:
            because = self._cancelled_because or "cancelled"
            self._append({"type": "error", "message": f"{self.request_id}: {because}"})
        except Exception as exc:  # noqa: BLE001 - the reader gets it as the stream's end
            log.exception("%s: MD's decoding failed after the handoff", self.request_id)
            self._append({"type": "error", "message": f"{self.request_id}: {exc!r}"})
        finally:
            close = getattr(events, "aclose", None)
            if close is not None:
                await close()
            self.ended = True
            self._notify()
            self._disarm()
            try:
                await cleanup(self.finished)
            finally:
                loop = asyncio.get_running_loop()
                loop.call_later(self.grace_s, on_forget)

    def _append(self, event: dict[str, Any]) -> None:
        self.events.append(event)
        self._notify()

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _unread(self) -> None:
        """Nobody came to read within grace_s: let the request go."""
        self._timer = None
        if self.readers == 0 and not self.ended and self._task is not None:
            log.warning(
                "%s: nobody read MD's stream for %g s after the handoff; aborted",
                self.request_id,
                self.grace_s,
            )
            self._count("unread")
            self._cancelled_because = (
                f"no reader for MD's stream within {self.grace_s:g} s after the handoff"
            )
            self._task.cancel()

    def _count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    async def read(self, from_index: int = 0, *, attach: bool = False):
        """The events from token index `from_index` on (tokens before it skipped), then the
        last event; waits for events still to come."""
        self.readers += 1
        if attach:
            self.attached += 1
            self._count("attached")
        self._disarm()
        position = 0
        try:
            while True:
                changed = self._changed
                while position < len(self.events):
                    event = self.events[position]
                    position += 1
                    if event.get("type") == "token" and int(event.get("index", 0)) < from_index:
                        continue
                    yield event
                    if event.get("type") in ("done", "error"):
                        return
                if self.ended:
                    return
                await changed.wait()
        finally:
            self.readers -= 1
            if self.readers == 0 and not self.ended and self._timer is None:
                self._timer = asyncio.get_running_loop().call_later(self.grace_s, self._unread)

    async def cancel(self, because: str = "cancelled") -> None:
        """End the tail now (its cleanup aborts the request unless it finished); a reader
        still on it gets an error event saying ``because``."""
        if self._task is not None and not self._task.done():
            self._cancelled_because = self._cancelled_because or because
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


class Tails:
    """The tails of an agent's requests, by (request, instance)."""

    def __init__(self) -> None:
        self._tails: dict[tuple[str, str], Tail] = {}
        # Handed over since start; attaches that read one; ones let go unread.
        self.counts = {"handed_over": 0, "attached": 0, "unread": 0}

    def __len__(self) -> int:
        return len(self._tails)

    def get(self, request_id: str, instance_id: str) -> Tail | None:
        return self._tails.get((request_id, instance_id))

    def start(
        self,
        tail: Tail,
        events: AsyncIterator[dict[str, Any]],
        cleanup: Callable[[bool], Awaitable[None]],
    ) -> None:
        key = (tail.request_id, tail.instance_id)
        self._tails[key] = tail
        tail.counts = self.counts
        self.counts["handed_over"] += 1

        def forget() -> None:
            if self._tails.get(key) is tail:
                del self._tails[key]

        tail.start(events, cleanup, forget)

    def to_json(self) -> dict[str, int]:
        """For the state document: tails running now and the counts since start."""
        running = sum(1 for tail in self._tails.values() if not tail.ended)
        return {"running": running, **self.counts}

    async def close(self) -> None:
        """Cancel every running tail (the agent stops)."""
        for tail in list(self._tails.values()):
            await tail.cancel("the agent is stopping")
