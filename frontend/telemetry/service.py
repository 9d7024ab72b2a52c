"""The process-wide aggregator and the calls the gateway, the dashboard and /metrics make."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

from asgiref.sync import sync_to_async
from django.utils import timezone

from frontend import conf
from frontend.telemetry.aggregator import SLA, Aggregator
from frontend.telemetry.store import LocalStore, RedisStore, Store

log = logging.getLogger(__name__)

_lock = threading.Lock()
_aggregator: Aggregator | None = None
_rebuilt = False
_SLA_TTL_S = 30.0
_sla_cache: dict[str, SLA] = {}
_sla_loaded_at = 0.0
# In-process state only: records this process observed itself (so tailing skips them) and the
# highest RequestRecord id already aggregated.
_OBSERVED_MAX = 200_000
_observed_ids: set[int] = set()
_observed_order: deque[int] = deque()
_watermark: int | None = None


def _in_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def sla_for(model: str) -> SLA:
    """The model's SLA; the table is re-read at most every 30 s, and never from inside an event
    loop (there the cached table, or the default, is used)."""
    global _sla_cache, _sla_loaded_at
    if time.monotonic() - _sla_loaded_at > _SLA_TTL_S and not _in_event_loop():
        from frontend.models import ServedModelSLA

        try:
            _sla_cache = {
                row.model_name: SLA(row.p90_ttft_s, row.p99_ttft_s)
                for row in ServedModelSLA.objects.all()
            }
        except Exception:  # table not migrated yet: defaults
            log.debug("SLA table unreadable; using defaults", exc_info=True)
        _sla_loaded_at = time.monotonic()
    return _sla_cache.get(model) or SLA()


def sla_cache_clear() -> None:
    global _sla_loaded_at
    _sla_loaded_at = 0.0


def make_store() -> Store:
    url = conf.redis_url()
    if url:
        return RedisStore(url, prefix=conf.redis_prefix(), flush_interval_s=conf.flush_interval_s())
    return LocalStore()


def get_aggregator() -> Aggregator:
    """This process's aggregator: Redis-backed when REDIS_URL is set, else in-process."""
    global _aggregator
    if _aggregator is None:
        with _lock:
            if _aggregator is None:
                _aggregator = Aggregator(make_store(), sla_for=sla_for)
    return _aggregator


def set_aggregator(aggregator: Aggregator | None, *, rebuilt: bool = True) -> None:
    """Replace (or with None, forget) the process aggregator; for tests and benchmarks.
    ``rebuilt`` says whether the first read should skip the replay of stored records."""
    global _aggregator, _rebuilt, _watermark
    with _lock:
        _aggregator = aggregator
        _rebuilt = rebuilt
        _watermark = None
        _observed_ids.clear()
        _observed_order.clear()


def _remember(records: list[Any]) -> None:
    if conf.redis_url():
        return
    with _lock:
        for record in records:
            pk = getattr(record, "pk", None)
            if isinstance(pk, int) and pk not in _observed_ids:
                _observed_ids.add(pk)
                _observed_order.append(pk)
        while len(_observed_order) > _OBSERVED_MAX:
            _observed_ids.discard(_observed_order.popleft())


def observe(record: Any) -> None:
    """Aggregate one finished request. The gateway calls this right after it saves the
    RequestRecord, from sync code (inside the same ``sync_to_async`` as the save)."""
    observe_many([record])


def observe_many(records: Iterable[Any]) -> int:
    """Aggregate a batch of finished requests; returns how many."""
    records = list(records)
    try:
        _remember(records)
        return get_aggregator().observe_many(records)
    except Exception:  # telemetry must never fail a request
        log.warning("telemetry observe failed", exc_info=True)
        return 0


def observe_error(status: int, code: str, tenant: str, model: str) -> None:
    """Count one error answer of the gateway (routing.gateway.errors.error_observers)."""
    try:
        get_aggregator().observe_error(status, code, tenant, model)
    except Exception:  # telemetry must never fail a request
        log.warning("telemetry observe_error failed", exc_info=True)


def tail_new_records(*, limit: int = 50_000) -> int:
    """In-process state only: aggregate RequestRecord rows saved since the last look that no
    ``observe`` call in this process has seen (e.g. written by another process). With Redis the
    writers' own ``observe`` calls reach the shared state, so nothing is tailed there."""
    global _watermark
    if conf.redis_url():
        return 0
    from routing.models import RequestRecord

    if _watermark is None:
        _watermark = RequestRecord.objects.order_by("-pk").values_list("pk", flat=True).first() or 0
        return 0
    rows = list(RequestRecord.objects.filter(pk__gt=_watermark).order_by("pk")[:limit])
    if not rows:
        return 0
    _watermark = rows[-1].pk
    with _lock:
        fresh = [row for row in rows if row.pk not in _observed_ids]
    return get_aggregator().observe_many(fresh)


async def aobserve(record: Any) -> None:
    """``observe`` for async callers (reads the SLA table in a thread when it is stale)."""
    await sync_to_async(observe)(record)


def rebuild(*, hours: float = 24.0, max_rows: int | None = None, clear: bool = True) -> int:
    """Replay RequestRecord rows of the last ``hours`` (newest ``max_rows`` at most) into the
    aggregation state, so a restart does not blank the dashboard. Returns rows replayed."""
    from routing.models import RequestRecord

    global _watermark
    aggregator = get_aggregator()
    max_rows = conf.rebuild_max_rows() if max_rows is None else max_rows
    cutoff = timezone.now()
    top = RequestRecord.objects.order_by("-pk").values_list("pk", flat=True).first() or 0
    if not conf.redis_url():
        _watermark = top
    rows = RequestRecord.objects.filter(
        created_at__gte=cutoff - timedelta(hours=hours), pk__lte=top
    ).order_by("-created_at")[:max_rows]
    if clear:
        aggregator.store.clear()
    batch: list[Any] = []
    count = 0
    for row in rows.iterator(chunk_size=2000):
        batch.append(row)
        if len(batch) >= 2000:
            count += aggregator.observe_many(batch)
            batch = []
    count += aggregator.observe_many(batch)
    aggregator.store.flush()
    return count


def ensure_rebuilt() -> None:
    """With in-process state, replay the last day once per process before the first read.
    Redis state outlives processes; there ``manage.py telemetry_rebuild`` does it on demand."""
    global _rebuilt
    if _rebuilt:
        return
    with _lock:
        if _rebuilt:
            return
        _rebuilt = True
    if conf.redis_url() or not conf.rebuild_on_start():
        return
    try:
        n = rebuild(clear=False)
        log.info("telemetry: replayed %d request records into in-process state", n)
    except Exception:
        log.warning("telemetry rebuild failed; starting empty", exc_info=True)


def live_bcr() -> dict[str, Any]:
    """Goodput requests/s over the last hour, the fleet's cost per hour now and their ratio
    (BCR), in the fleet's currency: what billing's margin shows live (billing.margin)."""
    from frontend.telemetry.aggregator import summarize
    from frontend.telemetry.fleet import fleet_cost_per_hour

    cost, currency, _ = fleet_cost_per_hour()
    p, span = get_aggregator().window("1h", now=time.time())
    summary = summarize(p, seconds=span, cost_per_hour=cost)
    return {
        "goodput_rps": summary["goodput_rps"],
        "cost_per_hour": cost,
        "currency": currency,
        "bcr": summary["bcr"],
    }
