"""How late this process's event loop runs: a task sleeps ``PERIOD_S`` and notes by how much it
overslept; ``recent_s`` is the largest such delay in a recent window (0 when no loop is
watched: tests, Celery workers, the embedded test client). Torch- and Django-free: the web
process and the node agents both watch their loops with it.

In the web process (controlplane/asgi.py's lifespan), so that its own delay is not taken for
a node's: a heartbeat's liveness is noted when this process takes it (fleet/beats.py), not
when the agent sent it. When the event loop runs late (a web process saturated by gateway
streams: at 1,024 streams on one process the loop ran seconds behind), every node's beats are
noted that much later, their gaps grow by the change in that delay, and reports looked older
than the live TTL although every agent kept beating: the gateway then answered 503 "no healthy
prefill instance" for a fleet that was up (bench/gateway/SCALE.md). ``read_reports``
(fleet/live.py) therefore allows a report the TTL plus the most this process's loop ran late
over the last TTL.

In a node agent (``Agent.start``), so that its state document says how late the agent's own
loop answers calls and writes streams (``loop_late_s``, agents/PROTOCOL.md): at 1,024 streams
an MD that had its KV did not start its answer within 60 s, and its engine was on time."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque

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


async def _watch() -> None:
    while True:
        began = time.monotonic()
        await asyncio.sleep(PERIOD_S)
        note(time.monotonic() - began - PERIOD_S)


def start() -> asyncio.Task:
    """Watch the running loop (call from it); cancel the task to stop."""
    return asyncio.get_running_loop().create_task(_watch(), name="baton-loop-lag")
