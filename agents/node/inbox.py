"""The agent's inbox: the KV and handoff transfers its fabric servers receive (or their
failures) wait here, by (request, instance), for the pipeline that consumes them; it also
remembers which requests ended, were cancelled or were released here, so that what turns up
for them later is dropped or answered at once."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from agents.transfer.records import Transfer

log = logging.getLogger(__name__)

# Transfer ids on the fabric: "<request id>|<target instance id>|<what>", what = "kv" or
# "h<n>" / "h<n>.final" (a handoff batch of token ids).
SEP = "|"
# How many ended (request, instance) pairs an agent remembers, to drop their late transfers.
ENDED_REMEMBERED = 4096


def transfer_id(request_id: str, instance_id: str, what: str) -> str:
    return SEP.join((request_id, instance_id, what))


@dataclass(slots=True)
class _InboxEntry:
    queue: asyncio.Queue
    created_at: float
    claimed: bool = False


def _remember(seen: OrderedDict, key: Any) -> None:
    """Add ``key`` as the newest of ``seen``, forgetting the oldest past ENDED_REMEMBERED."""
    seen[key] = None
    seen.move_to_end(key)
    while len(seen) > ENDED_REMEMBERED:
        seen.popitem(last=False)


class Inbox:
    """Received transfers by (request, instance), until their consumer takes them. Lives on
    the event loop's thread."""

    def __init__(self) -> None:
        self._entries: dict[tuple[str, str], _InboxEntry] = {}
        # (request, instance) whose consumer has finished here, newest last (bounded): a
        # transfer for one of them arriving or failing later (RLD cancels its unsent handoff
        # batches once the request is over) is expected and dropped without a new inbox entry.
        self._ended: OrderedDict[tuple[str, str], None] = OrderedDict()
        # Requests cancelled here, newest last (bounded): a consumer or transfer for one that
        # turns up after the cancel (its call raced the cancel on another connection) finds
        # the cancel already in its inbox instead of waiting for KV that is not coming.
        self._cancelled: OrderedDict[str, None] = OrderedDict()
        # (request, instance) that RLD answered alone and released here (POST
        # /v1/pdd/release), newest last (bounded): a decode call for one of them that turns up
        # afterwards ends at once instead of sharing the inbox the release's import reads.
        self._released: OrderedDict[tuple[str, str], None] = OrderedDict()

    def queue(self, request_id: str, instance_id: str) -> asyncio.Queue:
        """The queue of transfers (or failures) for this request on this instance."""
        entry = self._entries.get((request_id, instance_id)) or self._new_entry(
            (request_id, instance_id)
        )
        entry.claimed = True
        return entry.queue

    def claim_released(self, request_id: str, instance_id: str) -> asyncio.Queue | None:
        """The request was answered elsewhere (RLD alone): claim its inbox here, for caching
        the KV P sends, unless a consumer already has it (None). Remembers the release."""
        if self.consumer_started(request_id, instance_id):
            return None
        _remember(self._released, (request_id, instance_id))
        return self.queue(request_id, instance_id)

    def released(self, request_id: str, instance_id: str) -> bool:
        return (request_id, instance_id) in self._released

    def consumer_started(self, request_id: str, instance_id: str) -> bool:
        """Whether a consumer has claimed this request's inbox here, or has finished with it."""
        key = (request_id, instance_id)
        entry = self._entries.get(key)
        return key in self._ended or (entry is not None and entry.claimed)

    def _new_entry(self, key: tuple[str, str]) -> _InboxEntry:
        entry = _InboxEntry(asyncio.Queue(), time.monotonic())
        if key[0] in self._cancelled:
            entry.queue.put_nowait(RuntimeError("cancelled"))
        self._entries[key] = entry
        return entry

    def drop(self, request_id: str, instance_id: str) -> None:
        """The request is over on this instance: drop its inbox and remember that it ended."""
        key = (request_id, instance_id)
        self._entries.pop(key, None)
        _remember(self._ended, key)

    @staticmethod
    def _parse_transfer_id(transfer_id: str | None) -> tuple[tuple[str, str], str] | None:
        """``request|instance|kind`` -> ((request, instance), kind); None if malformed."""
        if transfer_id is None or transfer_id.count(SEP) != 2:
            return None
        request_id, instance_id, what = transfer_id.split(SEP)
        return (request_id, instance_id), what

    def _ended_here(self, transfer_id: str | None) -> bool:
        parsed = self._parse_transfer_id(transfer_id)
        return parsed is not None and parsed[0] in self._ended

    def fail(self, request_id: str, reason: str) -> None:
        """Wake every consumer of request_id with a failure (a cancel, a failed send)."""
        for (rid, _iid), entry in list(self._entries.items()):
            if rid == request_id:
                entry.queue.put_nowait(RuntimeError(reason))

    def cancel(self, request_id: str) -> None:
        """Cancel request_id here: wake its consumers, and every consumer that arrives later
        finds the cancel waiting in its inbox (remembered for the last ENDED_REMEMBERED)."""
        _remember(self._cancelled, request_id)
        self.fail(request_id, "cancelled")

    def _entry(self, transfer_id: str | None) -> tuple[_InboxEntry | None, str]:
        parsed = self._parse_transfer_id(transfer_id)
        if parsed is None:
            return None, ""
        key, what = parsed
        entry = self._entries.get(key) or self._new_entry(key)
        return entry, what

    async def on_transfer(self, transfer: Transfer) -> None:
        if self._ended_here(transfer.request_id):
            log.debug("transfer %s arrived after its request ended here; dropped",
                      transfer.request_id)  # fmt: skip
            return
        entry, what = self._entry(transfer.request_id)
        if entry is None:
            log.warning("transfer %r names no request|instance|kind; dropped", transfer.request_id)
            return
        entry.queue.put_nowait((what, transfer))

    async def on_transfer_error(self, transfer_id: str | None, exc: Exception) -> None:
        if self._ended_here(transfer_id):
            # The sender gave up on a request that is already over here (RLD cancels its
            # in-flight handoff batches when the request ends): nobody waits for it.
            log.info("transfer %s cut after its request ended here: %r", transfer_id, exc)
            return
        log.warning("transfer %s failed: %r", transfer_id, exc)
        entry, _ = self._entry(transfer_id)
        if entry is not None:
            entry.queue.put_nowait(exc)

    def sweep(self, now: float, kv_timeout_s: float) -> None:
        """Drop the entries no consumer claimed within kv_timeout_s."""
        for key, entry in list(self._entries.items()):
            if not entry.claimed and now - entry.created_at > kv_timeout_s:
                self._entries.pop(key, None)
