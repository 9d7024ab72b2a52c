"""Celery beat for the embedded default: without a broker there is no beat process, so the web
process runs the periodic schedule (health checks, reconcile) itself in a daemon thread."""

from __future__ import annotations

import logging
import threading
import time

from django.conf import settings

log = logging.getLogger(__name__)
_started = threading.Event()


def _run(stop: threading.Event) -> None:
    from controlplane.celery import app

    schedule = {
        name: (entry["task"], float(entry["schedule"]))  # type: ignore[arg-type]
        for name, entry in settings.CELERY_BEAT_SCHEDULE.items()
    }
    due = {name: time.monotonic() + period for name, (_, period) in schedule.items()}
    while not stop.is_set():
        now = time.monotonic()
        for name, (task, period) in schedule.items():
            if now < due[name]:
                continue
            due[name] = now + period
            try:
                app.tasks[task].apply()
            except Exception:  # one failed round must not stop the schedule
                log.warning("embedded beat: %s failed", task, exc_info=True)
        stop.wait(0.2)


def start_embedded_beat() -> threading.Event | None:
    """Start the in-process schedule once, only when tasks run in-process (no broker)."""
    if not (settings.CELERY_TASK_ALWAYS_EAGER and settings.BATON_EMBEDDED_BEAT):
        return None
    if _started.is_set():
        return None
    _started.set()
    stop = threading.Event()
    threading.Thread(target=_run, args=(stop,), name="embedded-beat", daemon=True).start()
    log.info("embedded beat started (no broker): %s", ", ".join(settings.CELERY_BEAT_SCHEDULE))
    return stop
