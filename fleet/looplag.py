"""How late this process's event loop runs, so that its own delay is not taken for a node's.

A heartbeat's liveness is noted when this process takes it (fleet/beats.py), not when the agent
sent it. When the event loop runs late (a web process saturated by gateway streams: at 1,024
streams on one process the loop ran seconds behind), every node's beats are noted that much
later, their gaps grow by the change in that delay, and reports looked older than the live TTL
although every agent kept beating: the gateway then answered 503 "no healthy prefill instance"
for a fleet that was up (bench/gateway/SCALE.md). ``read_reports`` (fleet/live.py) therefore
allows a report the TTL plus the most this process's loop ran late over the last TTL.

``start`` (controlplane/asgi.py's lifespan) runs a task that sleeps ``PERIOD_S`` and notes by how
much it overslept; ``recent_s`` is the largest such delay in a recent window (0 when no loop is
watched: tests, Celery workers, the embedded test client). The web process also publishes it
(fleet.live.publish_loop_lag), and the health check that marks silent nodes offline allows it
too (agent_services.nodes_mark_offline): its database's last heartbeat times come from the
same late process."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable

PERIOD_S = 0.1
KEEP_S = 60.0  # samples older than this are dropped

_samples: deque[tuple[float, float]] = deque()  # (monotonic time, seconds late)
_lock = threading.Lock()


def note(late_s: float, at: float | None = None) -> None:
    """Record that the loop ran `late_s` behind at `at` (now)."""
    at = time.monotonic() if at is None else at
    with _lock:
        _samples.append((at, max(0.0, late_s)))
        while _samples and _samples[0][0] < at - KEEP_S:
            _samples.popleft()


def recent_s(window_s: float) -> float:
    """The most the loop ran late over the last `window_s` seconds (0 without samples)."""
    since = time.monotonic() - window_s
    with _lock:
        return max((late for at, late in _samples if at >= since), default=0.0)


def clear() -> None:
    with _lock:
        _samples.clear()


PUBLISH_EVERY_S = 1.0


async def _watch(publish: Callable[[float], None] | None, window_s: float) -> None:
    published = 0.0
    while True:
        began = time.monotonic()
        await asyncio.sleep(PERIOD_S)
        note(time.monotonic() - began - PERIOD_S)
        if publish is not None and time.monotonic() - published >= PUBLISH_EVERY_S:
            published = time.monotonic()
            try:  # off the loop: a Redis call must not add to the delay it reports
                await asyncio.to_thread(publish, recent_s(window_s))
            except Exception:  # noqa: BLE001 - the next round tries again
                pass


def start(publish: Callable[[float], None] | None = None, window_s: float = 6.0) -> asyncio.Task:
    """Watch the running loop (call from it); every second hand ``publish`` the largest delay
    of the last ``window_s`` (fleet.live.publish_loop_lag: for the Celery health check).
    Cancel the task to stop."""
    return asyncio.get_running_loop().create_task(_watch(publish, window_s), name="baton-loop-lag")
