"""Blocking wrappers for callers on other threads (e.g. the engine thread) of a fabric whose
event loop runs elsewhere."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Iterable

from agents.transfer.client import FabricClient
from agents.transfer.records import KVChunk, TokenIds, TransferStats
from agents.transfer.shaping import LinkSettings, LinkShaper


def _check_not_loop_thread(loop: asyncio.AbstractEventLoop) -> None:
    # Blocking the loop's own thread on work scheduled to that loop would never return.
    if loop.is_running() and getattr(loop, "_thread_id", None) == threading.get_ident():
        raise RuntimeError("called from the event loop's own thread; await the coroutine instead")


def send_from_thread(
    loop: asyncio.AbstractEventLoop,
    client: FabricClient,
    host: str,
    port: int,
    request_id: str,
    chunks: Iterable[KVChunk],
    *,
    tokens: TokenIds | None = None,
    timeout_s: float | None = None,
) -> TransferStats:
    """Run `client.send(...)` on `loop` and block this thread until it finishes.

    On timeout the send is cancelled (freeing its pool slot) and TimeoutError is raised.
    """
    _check_not_loop_thread(loop)
    chunk_list = list(chunks)  # the engine may reuse its iterator; freeze it on this thread
    future = asyncio.run_coroutine_threadsafe(
        client.send(host, port, request_id, chunk_list, tokens=tokens), loop
    )
    try:
        return future.result(timeout_s)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise TimeoutError(f"send of {request_id!r} took longer than {timeout_s} s") from None


def update_link_from_thread(
    loop: asyncio.AbstractEventLoop,
    shaper: LinkShaper,
    *,
    timeout_s: float | None = 5.0,
    **changes: float | int,
) -> LinkSettings:
    """Apply `shaper.update(**changes)` on the shaper's loop; returns the new settings."""
    _check_not_loop_thread(loop)

    async def apply() -> LinkSettings:
        return shaper.update(**changes)  # type: ignore[arg-type]

    return asyncio.run_coroutine_threadsafe(apply(), loop).result(timeout_s)
