"""Routing's periodic tasks."""

from __future__ import annotations

from celery import shared_task

from routing.gateway import interrupted
from routing.probes import probe_agents as probe


@shared_task(name="routing.finish_interrupted")
def finish_interrupted() -> list[str]:
    """Record the requests a dead gateway process left behind as ``interrupted``."""
    return interrupted.finish_interrupted()


@shared_task(name="routing.probe_agents")
def probe_agents() -> dict[str, str]:
    """Probe every reporting agent; dead or silent ones are routed around at once."""
    return {r.hostname: r.verdict for r in probe()}
