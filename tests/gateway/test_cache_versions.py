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
