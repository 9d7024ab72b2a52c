"""Stream chunks coalesce under load: the text pieces of a streamed answer leave in fewer,
larger writes when the gateway process carries many streams, and one write per read from the
agent when it carries few.

Every streamed response in the process counts itself in ``stats.open`` while it runs. A
stream reads its pieces through ``coalesced``: a pump task reads the run's pieces into a
queue as they come. While fewer than ``BATON_GATEWAY_COALESCE_FROM`` streams are open, each
read from the agent is written as it comes (per token at low load); at or above it, a chunk
that has its first piece waits ``BATON_GATEWAY_STREAM_INTERVAL_S`` and takes every piece that
came meanwhile before it is written. Each piece is still its own server-sent event, in order, with
its own logprobs; only the writes (one ASGI send, one socket write) are fewer. The interval
bounds the delay a piece waits here; 0 turns coalescing off (the run's pieces are written as
they come, without the pump).

vLLM and SGLang do the same with a token count (``--stream-interval``); a time bound keeps the
added delay bounded whatever the decode speed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from django.conf import settings


@dataclass
class CoalesceStats:
    """This process's streams: open now, and the writes and pieces they sent (metrics)."""

    open: int = 0
    writes_total: int = 0
    pieces_total: int = 0


stats = CoalesceStats()


class _End:
    pass


class _Failed:
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


_END = _End()


def busy() -> bool:
    """Whether this process carries enough streams that chunks should wait to coalesce."""
    return stats.open >= int(settings.BATON_GATEWAY_COALESCE_FROM)


async def coalesced(source: AsyncIterator[list[Any]]) -> AsyncGenerator[list[Any], None]:
    """``source``'s lists of pieces, merged as described above. An exception of ``source``
    comes after the pieces before it; closing this generator cancels the pump, which closes
    ``source`` (the agents' streams with it)."""
    interval = float(settings.BATON_GATEWAY_STREAM_INTERVAL_S)
    if interval <= 0:
        try:
            async for pieces in source:
                stats.writes_total += 1
                stats.pieces_total += len(pieces)
                yield pieces
        finally:
            await source.aclose()  # type: ignore[attr-defined]
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump() -> None:
        try:
            async for pieces in source:
                queue.put_nowait(pieces)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the reader, raised there
            queue.put_nowait(_Failed(exc))
        else:
            queue.put_nowait(_END)

    task = asyncio.ensure_future(pump())
    try:
        while True:
            item = await queue.get()
            if item is _END:
                return
            if isinstance(item, _Failed):
                raise item.exc
            batch = list(item)
            ending: _End | _Failed | None = None
            if not busy():  # one write per read from the agent, as it comes
                stats.writes_total += 1
                stats.pieces_total += len(batch)
                yield batch
                continue
            await asyncio.sleep(interval)
            while not queue.empty():
                more = queue.get_nowait()
                if isinstance(more, _End | _Failed):
                    ending = more
                    break
                batch.extend(more)
            if batch:
                stats.writes_total += 1
                stats.pieces_total += len(batch)
                yield batch
            if isinstance(ending, _Failed):
                raise ending.exc
            if ending is not None:
                return
    finally:
        if not task.done():
            task.cancel()
            try:
                await task
            except BaseException:  # noqa: BLE001 - the pump's end is the source's business
                pass
