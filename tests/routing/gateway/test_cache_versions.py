"""The fleet's rows stay cached until a save changes what the live view uses; a heartbeat's
save does not count, an operator's edit does."""

from __future__ import annotations

import pytest

from routing import live
from routing.models import CacheVersion

from .test_route_around_the_dead import _one_dc_fleet

pytestmark = pytest.mark.django_db(transaction=True)


def _version() -> int:
    row = CacheVersion.objects.filter(name="topology").first()
    return row.version if row else 0


def test_a_heartbeat_save_keeps_the_rows_an_edit_drops_them(settings):
    settings.REDIS_URL = ""
    made = _one_dc_fleet(("p", "prefill"), ("md", "main_decode"))
    node, inst = made["md"]
    live.build_live_view("baton-tiny")
    before = _version()
    node.save(update_fields=["last_heartbeat_at", "last_report", "updated_at"])
    inst.save(update_fields=["actual_state", "last_report", "updated_at"])
    assert _version() == before
    assert len(live.topology) == 1  # still cached
    inst.desired_state = "stopped"
    inst.save()
    assert _version() == before + 1
    assert len(live.topology) == 0
    view = live.build_live_view("baton-tiny")
    assert not next(s for s in view.snapshot.main_decode if s.id == str(inst.pk)).healthy


def test_the_refresher_reads_the_counters_so_requests_do_not(django_assert_num_queries):
    """A serving process reads the change counters on a thread of its own: a change made by
    another process (the counter moved, this process's caches untouched) empties the cache
    within a couple of periods, and a request's check reads nothing meanwhile."""
    import time

    from routing.caching import CacheVersions, VersionedCache

    versions = CacheVersions(check_every_s=0.5)
    cache = versions.register("auth", VersionedCache())
    versions.check()  # what this process has seen: nothing yet
    cache.get("k", lambda: "cached")
    stop = versions.start_refresher()
    try:
        with django_assert_num_queries(0):
            for _ in range(20):
                versions.check()  # on the request path: the refresher did the read
                time.sleep(0.005)
        CacheVersion.objects.update_or_create(name="auth", defaults={"version": 41})
        deadline = time.monotonic() + 10
        while len(cache) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(cache) == 0  # another process's change reached this one
    finally:
        stop.set()
