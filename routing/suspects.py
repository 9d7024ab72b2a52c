"""Instances a gateway saw failing (or the agent probe found dead), routed around until their
next report (``without_suspects``); shared by every gateway process through Redis when set."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import replace

from django.conf import settings

from pdd.policy import ClusterSnapshot, InstanceState
from routing.dispatches import RedisFallback
from routing.live import LiveView


class SuspectInstances(RedisFallback):
    """Instances a gateway saw fail (connection refused, a broken stream), by wall time.

    A suspect is routed around until its node sends a report newer than the failure: a dead
    instance stays avoided from the first failed request on, in every gateway process (Redis
    when ``redis_url`` is set), instead of until the node is marked offline several heartbeats
    later; a false alarm costs one heartbeat interval. Marks older than ``horizon_s`` are
    forgotten (by then a silent node is offline anyway).
    """

    _name = "suspect ledger"

    def __init__(
        self, horizon_s: float = 60.0, redis_url: str = "", *, prefix: str = "baton:suspect"
    ) -> None:
        self.horizon_s = horizon_s
        self.prefix = prefix
        self._marks: dict[str, float] = {}
        self._lock = threading.Lock()
        self._connect(redis_url)

    def mark(self, instance_ids: Iterable[str | None], now: float | None = None) -> None:
        now = time.time() if now is None else now
        ids = [str(i) for i in instance_ids if i]
        if not ids:
            return
        with self._lock:
            for instance_id in ids:
                self._marks[instance_id] = now
        if self._use_redis():
            try:
                pipe = self._redis.pipeline()
                pipe.hset(self.prefix, mapping={i: repr(now) for i in ids})
                pipe.expire(self.prefix, int(self.horizon_s) + 1)
                pipe.execute()
            except Exception as exc:  # noqa: BLE001 - Redis down: this process still avoids them
                self._redis_failed("write", exc)

    def marks(self, now: float | None = None) -> dict[str, float]:
        """instance id -> when it was last seen failing, within the horizon."""
        now = time.time() if now is None else now
        with self._lock:
            for key in [k for k, t in self._marks.items() if now - t > self.horizon_s]:
                del self._marks[key]
            found = dict(self._marks)
        if self._use_redis():
            try:
                for key, value in self._redis.hgetall(self.prefix).items():
                    at = float(value)
                    if now - at <= self.horizon_s:
                        name = key.decode() if isinstance(key, bytes) else str(key)
                        found[name] = max(found.get(name, 0.0), at)
            except Exception as exc:  # noqa: BLE001
                self._redis_failed("read", exc)
        return found

    def clear(self) -> None:
        with self._lock:
            self._marks.clear()
        if self._use_redis():
            try:
                self._redis.delete(self.prefix)
            except Exception as exc:  # noqa: BLE001
                self._redis_failed("clear", exc)


_suspects: SuspectInstances | None = None
_suspects_lock = threading.Lock()


def suspect_ledger() -> SuspectInstances:
    """This process's view of the suspect instances (shared through Redis when set): the
    gateway marks what it saw failing, the agent probe (routing/probes.py) what it found dead."""
    global _suspects
    with _suspects_lock:
        if _suspects is None:
            _suspects = SuspectInstances(
                redis_url=settings.REDIS_URL, prefix=f"{settings.REDIS_KEY_PREFIX}:suspect"
            )
        return _suspects


def without_suspects(
    view: LiveView, snapshot: ClusterSnapshot, ledger: SuspectInstances
) -> tuple[ClusterSnapshot, list[str]]:
    """``snapshot`` with every instance marked suspect after its last report made unhealthy,
    and the ids it made so."""
    marks = ledger.marks()
    if not marks:
        return snapshot, []
    avoided: list[str] = []

    def adjusted(states: tuple[InstanceState, ...]) -> tuple[InstanceState, ...]:
        out = []
        for st in states:
            marked = marks.get(st.id)
            reported_at = view.reported.get(st.id, (0.0, 0.0))[0]
            if marked is not None and st.healthy and marked >= reported_at:
                st = replace(st, healthy=False)
                avoided.append(st.id)
            out.append(st)
        return tuple(out)

    if not any(
        st.id in marks for st in (*snapshot.prefill, *snapshot.relay_decode, *snapshot.main_decode)
    ):
        return snapshot, []
    result = replace(
        snapshot,
        prefill=adjusted(snapshot.prefill),
        relay_decode=adjusted(snapshot.relay_decode),
        main_decode=adjusted(snapshot.main_decode),
    )
    return result, avoided
