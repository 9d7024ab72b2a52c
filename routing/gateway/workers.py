"""Where the gateway's blocking work runs (a thread pool, with Django's connection upkeep),
and the record writes in flight that a shutting-down process waits for."""

from __future__ import annotations

import asyncio

from asgiref.sync import sync_to_async
from django.db import close_old_connections

# Blocking work (ORM, tokenizer, policy) runs in a thread pool, not Django's single
# thread-sensitive thread: concurrent requests must not queue behind each other there.


def in_worker(fn):
    """``fn`` as a coroutine function run in the thread pool, with the connection upkeep that
    Django's request signals do only in the thread-sensitive thread: before and after the call,
    this pool thread's database connection is closed if it is broken (a database restart) or
    older than CONN_MAX_AGE, so a pool thread never keeps a dead or stale connection."""

    def run(*args, **kwargs):
        close_old_connections()
        try:
            return fn(*args, **kwargs)
        finally:
            close_old_connections()

    return sync_to_async(run, thread_sensitive=False)


# Record writes in flight (each its own task, so a client's disconnect cannot cancel one);
# a shutting-down process waits for them (drain_pending_records).
pending_records: set[asyncio.Future] = set()


async def drain_pending_records(timeout_s: float = 30.0) -> int:
    """Wait for the record writes still in flight; returns how many did not finish in time."""
    if not pending_records:
        return 0
    _, left = await asyncio.wait(set(pending_records), timeout=timeout_s)
    return len(left)
