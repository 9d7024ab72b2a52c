"""Where the gateway's blocking work runs (on the event loop while its reads are in memory,
else a thread pool with Django's connection upkeep), the batched record writer, and the record
writes in flight that a shutting-down process waits for."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence

from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.exceptions import SynchronousOnlyOperation
from django.db import (
    InterfaceError,
    OperationalError,
    close_old_connections,
    connection,
    transaction,
)

log = logging.getLogger(__name__)

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


async def in_order(steps: Sequence[Callable[[], object]], *, inline: bool, watch) -> None:
    """Call ``steps`` in order, each once. With ``inline`` (a process whose hot path is in
    memory), on the event loop, until a step's read needs the database: Django refuses the ORM
    there (SynchronousOnlyOperation), which a step raises before it changed anything, as each
    one reads first; that step and the rest then run in one hop onto a worker thread. Without
    ``inline``, every step runs in that one hop. ``watch`` (a timing.Stopwatch) gets the laps
    ``inline`` (the time on the loop before the hop) and ``resume`` (back on the loop)."""
    rest = list(steps)
    while inline and rest:
        try:
            rest[0]()
        except SynchronousOnlyOperation:
            watch.lap("inline")  # a read needed the database: a worker does the rest
            break
        rest.pop(0)
    if not rest:
        return

    def run_rest() -> None:
        for step in rest:
            step()

    await in_worker(run_rest)()
    watch.lap("resume")  # back on the event loop


# Record writes in flight (each its own task, so a client's disconnect cannot cancel one);
# a shutting-down process waits for them (drain_pending_records).
pending_records: set[asyncio.Future] = set()


async def drain_pending_records(timeout_s: float = 30.0) -> int:
    """Wait for the record writes still in flight; returns how many did not finish in time."""
    if not pending_records:
        return 0
    _, left = await asyncio.wait(set(pending_records), timeout=timeout_s)
    return len(left)


class BatchWriter:
    """Record writes batched: a dedicated thread takes every write queued while it was busy
    and runs them in one transaction, one commit for many requests. Consecutive writes of a
    function registered with ``batched`` run as one call of its batch form (a few multi-row
    statements for all of them); any other write, or a batch form that fails, runs one write
    at a time, each in its own savepoint, so one bad write does not undo the others.

    The queue needs no disk of its own to keep the exactly-once guarantee: every request has
    its durable admission row before any agent runs, so a write lost with a killed process is
    finished by the next one as ``interrupted`` (interrupted.finish_interrupted), and
    ``record_request`` writes a request id at most once. A live process loses none either: a
    batch that fails on its connection is tried again, in order, for up to
    ``BATON_RECORD_RETRY_S`` (``_write``). Each write's future resolves after its batch
    committed (or failed), so a caller that awaits it reads its own write."""

    def __init__(
        self,
        max_batch: int = 256,
        *,
        retry_s: float = 300.0,
        first_delay_s: float = 0.05,
        max_delay_s: float = 5.0,
    ) -> None:
        self.max_batch = max_batch
        # A batch that fails on its connection is tried again for up to retry_s (``_write``).
        self.retry_s, self.first_delay_s, self.max_delay_s = retry_s, first_delay_s, max_delay_s
        self.retries = 0  # failed tries that were tried again (the tests and bench)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.batches = 0  # committed batches, and the writes in them (for the tests and bench)
        self.writes = 0
        self.many: dict[Callable, Callable[[list[dict]], list]] = {}

    def batched(self, fn: Callable, many: Callable[[list[dict]], list]) -> None:
        """Run consecutive writes of ``fn`` as ``many([kwargs, ...])``, which returns their
        results in order (the same rows as ``fn`` for each in turn) or raises, and then
        they run one by one."""
        self.many[fn] = many

    def submit(self, fn, /, **kwargs) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((fn, kwargs, future))
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="gateway-record-writer", daemon=True
                )
                self._thread.start()
        return future

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            while len(batch) < self.max_batch:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            self._write(batch)

    def _write(self, batch: list) -> None:
        """Commit ``batch``. A connection-class failure (the database restarted, refused a
        connection, ran out of pooled connections, or chose this transaction as a deadlock's
        victim) commits nothing; the batch is tried again on a new connection, waiting longer
        each time, until it commits or ``retry_s`` has passed. Until then no write is lost
        and none is reordered: a later write (a request's record after its admission row)
        waits behind it."""
        delay, waited, tries = self.first_delay_s, 0.0, 0
        while True:
            _tend_connection()
            tries += 1
            try:
                results = self._attempt(batch)
                break
            except (OperationalError, InterfaceError) as exc:
                connection.close()
                if waited >= self.retry_s:
                    log.error(
                        "record writer: a batch of %d write(s) failed %d times over %.0f s, "
                        "given up (a request's admission stays in this process's journal): "
                        "%s: %s",
                        len(batch), tries, waited, type(exc).__name__, exc,
                    )  # fmt: skip
                    for _, _, future in batch:
                        future.set_exception(exc)
                    return
                (log.info if tries == 1 else log.warning)(
                    "record writer: a batch of %d write(s) failed (%s: %s); trying again in "
                    "%.2f s (try %d)",
                    len(batch), type(exc).__name__, str(exc).strip()[:200], delay, tries + 1,
                )  # fmt: skip
                self.retries += 1
                time.sleep(delay)
                waited += delay
                delay = min(delay * 2, self.max_delay_s)
            except Exception as exc:  # noqa: BLE001 - the commit itself failed: every write did
                log.error("record writer: a batch's commit failed: %s: %s", type(exc).__name__, exc)
                for _, _, future in batch:
                    future.set_exception(exc)
                return
        self.batches += 1
        self.writes += len(batch)
        for future, value, error in results:
            if error is None:
                future.set_result(value)
            else:
                future.set_exception(error)

    def _attempt(self, batch: list) -> list:
        results: list[tuple[concurrent.futures.Future, object, BaseException | None]] = []
        with transaction.atomic():
            for fn, run in itertools.groupby(batch, key=lambda write: write[0]):
                writes = list(run)
                many = self.many.get(fn)
                if many is not None:
                    try:
                        with transaction.atomic():
                            values = many([kwargs for _, kwargs, _ in writes])
                        results += [(w[2], v, None) for w, v in zip(writes, values, strict=True)]
                        continue
                    except (OperationalError, InterfaceError):
                        raise  # the connection: the whole batch again
                    except Exception:  # noqa: BLE001 - undone; each write on its own below
                        log.debug("batched %s failed; one at a time", fn.__name__, exc_info=True)
                for _, kwargs, future in writes:
                    try:
                        with transaction.atomic():
                            results.append((future, fn(**kwargs), None))
                    except (OperationalError, InterfaceError):
                        raise  # the connection, not this write: the whole batch again
                    except Exception as exc:  # noqa: BLE001 - that write only
                        results.append((future, None, exc))
        return results


def _tend_connection() -> None:
    """The writer thread's database connection, kept from batch to batch (one long-lived
    thread: reconnecting per batch cost ~1 ms of CPU on SQLite, where CONN_MAX_AGE is 0, as
    a profile of the web process showed); closed when it is broken, or past CONN_MAX_AGE
    where one is set."""
    if connection.connection is None:
        return
    if connection.settings_dict.get("CONN_MAX_AGE"):
        connection.close_if_unusable_or_obsolete()
    elif connection.errors_occurred and not connection.is_usable():
        connection.close()


record_writer = BatchWriter(retry_s=settings.BATON_RECORD_RETRY_S)
