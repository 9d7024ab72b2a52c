"""Control-plane housekeeping tasks."""

from __future__ import annotations

import time

from celery import shared_task
from django.conf import settings


@shared_task(name="controlplane.ping")
def ping(value: str = "pong", delay_s: float = 0.0, count_key: str = "") -> str:
    """Echo a value back: proves a worker is consuming from the broker. Diagnostics: wait
    `delay_s` first; with `count_key` (and Redis) count starts and completions in Redis
    (``<key>:started``, ``<key>:done``), which shows whether a task was run again."""
    client = None
    if count_key and settings.REDIS_URL:
        import redis

        client = redis.Redis.from_url(settings.REDIS_URL)
        client.incr(f"{count_key}:started")
    if delay_s > 0:
        time.sleep(min(delay_s, 60.0))
    if client is not None:
        client.incr(f"{count_key}:done")
    return value
