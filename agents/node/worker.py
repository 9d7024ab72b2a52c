"""The one thread that drives an Engine: runs commands queued from the event loop, steps the
engine while it has work (and blocks while it has none), and hands each request's tokens to the
loop through per-request sinks. Between steps it refreshes the copies the loop reads without
queueing behind engine work (stats, and an optional snapshot such as the prefix-cache blocks a
heartbeat reports), so heartbeats and /state never wait for a busy engine."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from agents.engine.core import EngineCore as Engine
from agents.engine.outputs import EngineStats, TokenOutput

log = logging.getLogger(__name__)

T = TypeVar("T")
Sink = Callable[[TokenOutput | BaseException], None]
_STOP = object()
# After step() returned nothing (the queue head waits for blocks held elsewhere), wait this long
# for a command (e.g. a release) before trying again: waiting, not spinning.
STALL_WAIT_S = 0.05
# While the engine is busy its snapshot is taken at most this often (the walk costs the engine
# thread time); once the engine has no work left it is taken at once, so an idle engine's
# snapshot is exact.
SNAPSHOT_EVERY_S = 0.5
# A step or command that holds the engine thread longer than this (wall seconds) is logged
# with what it was: every stream of the instance waits for it (a stall the gateway may take
# for a frozen decoder).
SLOW_S = 1.0


# on_chunk(first token, end token, payload), called on the loop.
OnChunk = Callable[[int, int, bytes], None]


class _ExportWatch:
    """A request's KV exported as prefill computes it: whole blocks from ``next_token``, in
    pieces of at least ``min_tokens`` (engine thread only)."""

    __slots__ = ("next_token", "min_tokens", "on_chunk")

    def __init__(self, next_token: int, min_tokens: int, on_chunk: OnChunk) -> None:
        self.next_token = next_token
        self.min_tokens = min_tokens
        self.on_chunk = on_chunk


class EngineWorker:
    """Owns an Engine; only its thread touches it. Safe to call from the loop's thread."""

    def __init__(
        self,
        engine: Engine,
        loop: asyncio.AbstractEventLoop,
        name: str,
        snapshot: Callable[[Engine], Any] | None = None,
        snapshot_every_s: float = SNAPSHOT_EVERY_S,
    ) -> None:
        self.engine = engine
        self._loop = loop
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self.stats: EngineStats = engine.stats()  # refreshed by the engine thread
        # snapshot(engine), taken on the engine thread after the engine changed (a step or a
        # command), before the loop hears of the change; read by the loop without a call.
        self._snapshot_fn = snapshot
        self._snapshot_every_s = snapshot_every_s
        self.snapshot: Any = snapshot(engine) if snapshot is not None else None
        self.snapshot_at = time.monotonic()  # when `snapshot` was taken
        self._changed = False  # the engine changed since the last snapshot
        # Wall seconds this thread has spent in engine work (commands and steps) since it
        # started: the instance's engine_busy_s in the agent's state document.
        self.busy_s = 0.0
        # The longest step and command so far (wall seconds), for the state document.
        self.longest_step_s = 0.0
        self.longest_command_s = 0.0
        # Other requests' tokens from the forwards a command runs go out forward by forward.
        engine.on_outputs = self._deliver
        # Requests whose KV goes out as prefill computes it (a streamed export), by id; the
        # lock because the export at the prefill's end runs off the engine thread (read_held).
        self._watches: dict[str, _ExportWatch] = {}
        self._watches_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"engine-{name}", daemon=True)
        self._thread.start()

    # -- loop side ---------------------------------------------------------------------------

    def call(self, fn: Callable[[Engine], T]) -> asyncio.Future[T]:
        """Run fn(engine) on the engine thread; the future resolves on the loop."""
        future: asyncio.Future[T] = self._loop.create_future()
        self._commands.put((fn, future))
        return future

    def add_sink(self, request_id: str, sink: Sink) -> None:
        """Deliver request_id's step outputs to `sink` (called on the loop's thread)."""
        self._sinks[request_id] = sink

    def remove_sink(self, request_id: str) -> None:
        self._sinks.pop(request_id, None)

    def watch_export(
        self, request_id: str, from_token: int, min_tokens: int, on_chunk: OnChunk
    ) -> asyncio.Future[int]:
        """Export request_id's KV from ``from_token`` (block-aligned) as its prefill computes
        it: after each step, the whole blocks computed since the last piece, once they are at
        least ``min_tokens``, go to ``on_chunk(first, end, payload)`` on the loop (what is
        computed already goes at once). The future gives the token the next piece starts at.
        ``take_export_watch`` (on the engine thread) ends it, with the rest of the prompt."""

        def register(engine: Engine) -> int:
            watch = _ExportWatch(from_token, max(1, min_tokens), on_chunk)
            with self._watches_lock:
                self._watches[request_id] = watch
                self._export_pieces(request_id, watch)
            return watch.next_token

        return self.call(register)

    def take_export_watch(self, request_id: str) -> int | None:
        """End request_id's streamed export (from any thread: the engine's commands, a
        ``read_held`` reader, the loop when the request fails): the token its next piece would
        have started at (what the caller exports itself), or None when no export was watched."""
        with self._watches_lock:
            watch = self._watches.pop(request_id, None)
        return None if watch is None else watch.next_token

    def read_held(self, fn: Callable[[Engine], T]) -> asyncio.Future[T]:
        """Run fn(engine) now on a helper thread, beside the engine thread's step: only for
        reading a held request (P's after its first token: ``prefill_result``, ``export_kv``),
        whose blocks and table no step touches. A command would wait for the step in flight,
        a whole prefill chunk on a busy P (0.5-3 s on the paper's GPU-A), before P's KV could
        leave (bench/paper/REPORT.md)."""
        return asyncio.ensure_future(asyncio.to_thread(fn, self.engine))

    def stop(self) -> None:
        self._commands.put(_STOP)

    def join(self, timeout_s: float | None = None) -> None:
        self._thread.join(timeout_s)

    # -- engine thread -----------------------------------------------------------------------

    def _run(self) -> None:
        stalled = False
        while True:
            busy = self.engine.has_work()
            try:
                if busy and not stalled:
                    item = self._commands.get_nowait()
                else:
                    item = self._commands.get(timeout=STALL_WAIT_S if busy else None)
            except queue.Empty:
                item = None
            if item is _STOP:
                self._fail_all(RuntimeError("engine instance stopped"))
                return
            if item is not None:
                self._run_command(*item)
                stalled = False
                continue
            began = time.perf_counter()
            try:
                outputs = self.engine.step()
            except Exception as exc:  # noqa: BLE001 - fail the requests, keep the agent alive
                log.exception("engine step failed")
                self._fail_all(exc)
                outputs = []
            took = time.perf_counter() - began
            self.busy_s += took
            if took > self.longest_step_s:
                self.longest_step_s = took
            if took > SLOW_S:
                last = getattr(self.engine, "steps", None)
                log.warning(
                    "engine step took %.2f s (%s)", took, last[-1] if last else "no step record"
                )
            stalled = not outputs
            if self._watches:
                with self._watches_lock:
                    for request_id, watch in list(self._watches.items()):
                        self._export_pieces(request_id, watch)
            self.stats = self.engine.stats()
            self._changed = True
            self._refresh_snapshot()
            self._deliver(outputs)

    def _deliver(self, outputs: list[TokenOutput]) -> None:
        """Hand each output to its request's sink on the loop (engine thread)."""
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is not None:
                self._loop.call_soon_threadsafe(sink, out)

    def _export_pieces(self, request_id: str, watch: _ExportWatch) -> None:
        """The whole blocks of request_id computed since its last piece, if enough."""
        req = self.engine.requests.get(request_id)
        if req is None:  # finished or aborted: nothing more comes (the caller holds the lock)
            self._watches.pop(request_id, None)
            return
        bs = self.engine.config.block_size
        done = req.cached_len - req.cached_len % bs
        if done - watch.next_token < watch.min_tokens:
            return
        try:
            payload = self.engine.export_kv(request_id, watch.next_token, done)
        except Exception:  # noqa: BLE001 - the export at the prefill's end sends the rest
            log.exception("%s: streamed KV export failed", request_id)
            watch.min_tokens = 1 << 62  # no more pieces until then
            return
        self._loop.call_soon_threadsafe(watch.on_chunk, watch.next_token, done, payload)
        watch.next_token = done

    def _run_command(self, fn: Callable[[Engine], Any], future: asyncio.Future) -> None:
        error: BaseException | None
        began = time.perf_counter()
        try:
            result = fn(self.engine)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            result, error = None, exc
        else:
            error = None
        took = time.perf_counter() - began
        self.busy_s += took
        if took > self.longest_command_s:
            self.longest_command_s = took
        if took > SLOW_S:
            log.warning("engine command %s took %.2f s", getattr(fn, "__qualname__", fn), took)
        self.stats = self.engine.stats()
        self._changed = True
        self._refresh_snapshot()
        self._loop.call_soon_threadsafe(_settle, future, result, error)

    def _refresh_snapshot(self) -> None:
        """Retake the snapshot after a change: at once when the engine has nothing left to do
        (so what an idle engine reports is exact), else at most every snapshot_every_s."""
        if self._snapshot_fn is None or not self._changed:
            return
        now = time.monotonic()
        idle = not self.engine.has_work() and self._commands.empty()
        if not idle and now - self.snapshot_at < self._snapshot_every_s:
            return
        try:
            self.snapshot = self._snapshot_fn(self.engine)
        except Exception:  # noqa: BLE001 - keep the last snapshot, keep the engine running
            log.exception("engine snapshot failed")
        self.snapshot_at = now
        self._changed = False

    def _fail_all(self, exc: BaseException) -> None:
        for request_id, sink in list(self._sinks.items()):
            self._loop.call_soon_threadsafe(sink, exc)
            self._sinks.pop(request_id, None)
        for req_id in list(self.engine.requests):
            try:
                self.engine.abort(req_id)
            except Exception:  # noqa: BLE001
                log.exception("abort of %s failed", req_id)


def _settle(future: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
