"""Control-plane housekeeping tasks."""

from __future__ import annotations

from celery import shared_task


@shared_task(name="controlplane.ping")
def ping(value: str = "pong") -> str:
    """Echo a value back: proves a worker is consuming from the broker."""
    return value
