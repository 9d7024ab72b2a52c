"""Telemetry: request records aggregated into rolling windows, shared across processes.

The gateway calls ``observe(record)`` (or ``observe_many``) after saving each RequestRecord;
the dashboard and ``/metrics`` read windows back. See ``frontend/telemetry/histogram.py`` for
the latency bin resolution and ``store.py`` for where the state lives.
"""

from __future__ import annotations

from frontend.telemetry.service import (
    aobserve,
    ensure_rebuilt,
    get_aggregator,
    observe,
    observe_many,
    rebuild,
    set_aggregator,
    sla_for,
)

__all__ = [
    "aobserve",
    "ensure_rebuilt",
    "get_aggregator",
    "observe",
    "observe_many",
    "rebuild",
    "set_aggregator",
    "sla_for",
]
