"""Telemetry and UI settings, read from Django settings when present, else the environment.

| variable | default | meaning |
|---|---|---|
| `BATON_METRICS_TOKEN` | unset | when set, `/metrics` wants `Authorization: Bearer <token>` |
| `BATON_TELEMETRY_FLUSH_S` | 0.2 | how often a process flushes its buffered increments to Redis |
| `BATON_TELEMETRY_PREFIX` | `baton:tlm` | Redis key prefix of the shared aggregation state |
| `BATON_TELEMETRY_REBUILD_ON_START` | true | in-process state: replay the last day on first use |
| `BATON_TELEMETRY_REBUILD_MAX_ROWS` | 200000 | most records such a replay reads (newest first) |
| `BATON_DASHBOARD_INTERVAL_S` | 1.0 | period of the snapshot pushed to open dashboards |
"""

from __future__ import annotations

from django.conf import settings

from base.env import env_bool, env_int, env_str


def _setting(name: str, fallback):
    return getattr(settings, name, fallback)


def metrics_token() -> str:
    return _setting("BATON_METRICS_TOKEN", env_str("BATON_METRICS_TOKEN", ""))


def redis_url() -> str:
    return _setting("REDIS_URL", "")


def flush_interval_s() -> float:
    return float(_setting("BATON_TELEMETRY_FLUSH_S", env_str("BATON_TELEMETRY_FLUSH_S", "0.2")))


def redis_prefix() -> str:
    return _setting("BATON_TELEMETRY_PREFIX", env_str("BATON_TELEMETRY_PREFIX", "baton:tlm"))


def rebuild_on_start() -> bool:
    return _setting(
        "BATON_TELEMETRY_REBUILD_ON_START", env_bool("BATON_TELEMETRY_REBUILD_ON_START", True)
    )


def rebuild_max_rows() -> int:
    return _setting(
        "BATON_TELEMETRY_REBUILD_MAX_ROWS", env_int("BATON_TELEMETRY_REBUILD_MAX_ROWS", 200_000)
    )


def dashboard_interval_s() -> float:
    return float(
        _setting("BATON_DASHBOARD_INTERVAL_S", env_str("BATON_DASHBOARD_INTERVAL_S", "1.0"))
    )
