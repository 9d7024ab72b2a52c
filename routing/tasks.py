"""Routing's periodic tasks."""

from __future__ import annotations

from celery import shared_task


@shared_task(name="routing.finish_interrupted")
def finish_interrupted() -> list[str]:
    """Record the requests a dead gateway process left behind as ``interrupted``."""
    from routing.gateway.records import finish_interrupted as finish

    return finish()
