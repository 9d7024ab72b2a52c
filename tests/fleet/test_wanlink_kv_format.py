"""A WAN link's KV format (what P sends across it): set over REST, validated, and in the live
view the gateway plans with."""

from __future__ import annotations

from fleet.models import WANLink


def test_the_kv_format_is_set_and_checked_over_rest(operator, link_ab):
    url = f"/api/v1/wan-links/{link_ab.pk}/"
    assert operator.get(url).json()["kv_format"] == ""  # the engine's own by default
    response = operator.patch(url, {"kv_format": "int8"}, format="json")
    assert response.status_code == 200 and response.json()["kv_format"] == "int8"
    bad = operator.patch(url, {"kv_format": "int4"}, format="json")
    assert bad.status_code == 400 and "kv_format" in bad.json()
    assert WANLink.objects.get(pk=link_ab.pk).kv_format == "int8"  # the bad one changed nothing


def test_the_live_view_maps_each_link_to_its_format(db, link_ab):
    from routing.live import _load_topology

    WANLink.objects.filter(pk=link_ab.pk).update(kv_format="bfloat16")
    _, links = _load_topology("any-model")
    assert [(r.src, r.dst, r.kv_format) for r in links] == [("dc-a", "dc-b", "bfloat16")]
