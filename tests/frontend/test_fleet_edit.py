"""Fleet editing in the UI: operators add and edit through the API's serializers (same errors,
shown on the field), viewers read only (403 on the forms, GET or POST), anonymous users log in;
the operator group can use the admin."""

from __future__ import annotations

import json
from decimal import Decimal

import pytest
from django.contrib.auth.models import Group, User


@pytest.fixture
def viewer(db):
    user = User.objects.create_user("vivi", password="pw-viewer-3")
    user.groups.add(Group.objects.get(name="viewer"))
    return user


@pytest.fixture
def operator(db):
    # as `manage.py baton_user NAME --role operator` makes one: in the group, and staff
    user = User.objects.create_user("opal", password="pw-operator-3", is_staff=True)
    user.groups.add(Group.objects.get(name="operator"))
    return user


FORMS = ["datacenters", "gpu-types", "unit-prices", "links", "nodes", "instances"]


@pytest.mark.parametrize(
    "path", ["/fleet/config/", "/fleet/links/add/", "/fleet/datacenters/1/edit/"]
)
def test_anonymous_users_go_to_the_login_page(client, db, path):
    for response in (client.get(path), client.post(path, {"name": "x"})):
        assert response.status_code == 302
        assert response["Location"].startswith("/login/?next=")


def test_viewers_read_the_configuration_without_forms(client, viewer, fleet):
    client.force_login(viewer)
    page = client.get("/fleet/config/")
    assert page.status_code == 200
    html = page.content.decode()
    assert "dc-a → dc-b" in html and "gpu-a" in html and "a-prefill-1" in html
    assert (
        "/add/" not in html
        and "/edit/" not in html
        and '<form method="post" class="fleet' not in html
    )
    fleet_page = client.get("/fleet/").content.decode()
    assert "Add WAN link" not in fleet_page


@pytest.mark.parametrize("kind", FORMS)
def test_viewers_get_403_on_the_forms(client, viewer, fleet, kind):
    from fleet.models import Datacenter

    client.force_login(viewer)
    assert client.get(f"/fleet/{kind}/add/").status_code == 403
    assert client.post(f"/fleet/{kind}/add/", {"name": "dc-x", "region": "r"}).status_code == 403
    dc = Datacenter.objects.get(name="dc-a")
    response = client.post(f"/fleet/datacenters/{dc.pk}/edit/", {"name": "renamed", "region": "r"})
    assert response.status_code == 403
    assert not Datacenter.objects.filter(name__in=["dc-x", "renamed"]).exists()


@pytest.mark.parametrize("kind", FORMS)
def test_operators_get_every_form(client, operator, fleet, kind):
    client.force_login(operator)
    page = client.get(f"/fleet/{kind}/add/")
    assert page.status_code == 200
    assert b'id="fleet-form"' in page.content


def test_an_operator_adds_a_wan_link_and_sees_it_on_the_topology(client, operator, fleet):
    from fleet.models import Datacenter, WANLink

    c = Datacenter.objects.create(name="dc-c", region="city-c")
    a = Datacenter.objects.get(name="dc-a")
    client.force_login(operator)
    response = client.post(
        "/fleet/links/add/",
        {"from_datacenter": a.pk, "to_datacenter": c.pk, "bandwidth_gbps": "0.06",
         "rtt_ms": "42", "connection_pool_size": "4", "monthly_cost": "0", "currency": "USD",
         "status": "up"},
    )  # fmt: skip
    assert response.status_code == 302 and response["Location"] == "/fleet/config/#links"
    link = WANLink.objects.get(from_datacenter=a, to_datacenter=c)
    assert link.bandwidth_gbps == 0.06
    fleet_page = client.get("/fleet/").content.decode()
    assert 'data-link="dc-a->dc-c"' in fleet_page and "0.06 Gbit/s" in fleet_page
    assert "WAN link dc-a -&gt; dc-c" in client.get("/fleet/config/").content.decode()


def test_errors_are_the_apis_and_sit_on_their_field(client, operator, fleet):
    from fleet.models import Datacenter, WANLink

    a = Datacenter.objects.get(name="dc-a")
    data = {"from_datacenter": a.pk, "to_datacenter": a.pk, "bandwidth_gbps": "-1", "rtt_ms": "5"}
    client.force_login(operator)
    api = client.post("/api/v1/wan-links/", json.dumps(data), content_type="application/json")
    assert api.status_code == 400
    page = client.post("/fleet/links/add/", data)
    assert page.status_code == 400
    form = page.context["form"]
    for field, messages in api.json().items():
        assert form.errors[field] == messages, field
    html = page.content.decode()
    assert 'id="bandwidth_gbps-errors"' in html
    assert WANLink.objects.count() == 1
    # the value typed is kept
    assert 'name="rtt_ms" value="5"' in html


def test_model_rules_and_services_report_on_the_field(client, operator, fleet):
    from fleet.models import Datacenter

    a = Datacenter.objects.get(name="dc-a")
    client.force_login(operator)
    page = client.post(
        "/fleet/links/add/", {"from_datacenter": a.pk, "to_datacenter": a.pk, "bandwidth_gbps": 1,
                              "rtt_ms": 5}
    )  # fmt: skip
    assert page.status_code == 400
    assert "two different datacenters" in str(page.context["form"].errors["to_datacenter"])
    # a service's check: shrinking a node below what its instances use
    node = fleet["prefill"].node
    page = client.post(
        f"/fleet/nodes/{node.pk}/edit/",
        {"hostname": node.hostname, "datacenter": node.datacenter_id,
         "gpu_type": node.gpu_type_id, "gpu_count": 2, "agent_endpoint": ""},
    )  # fmt: skip
    assert page.status_code == 400
    assert "already use 8 GPUs" in str(page.context["form"].errors["gpu_count"])


def test_an_operator_edits_a_datacenter_and_adds_a_node(client, operator, fleet):
    from fleet.models import Datacenter, FleetEvent, GPUType, Node

    dc = Datacenter.objects.get(name="dc-b")
    client.force_login(operator)
    edit = client.get(f"/fleet/datacenters/{dc.pk}/edit/")
    assert b'value="dc-b"' in edit.content
    response = client.post(
        f"/fleet/datacenters/{dc.pk}/edit/", {"name": "dc-b", "region": "city-b2"}
    )
    assert response.status_code == 302
    dc.refresh_from_db()
    assert dc.region == "city-b2"
    assert "updated" in client.get("/fleet/config/").content.decode()  # the message
    gpu = GPUType.objects.get(model="gpu-b")
    created = client.post(
        "/fleet/nodes/add/",
        {"hostname": "b-decode-2", "datacenter": dc.pk, "gpu_type": gpu.pk, "gpu_count": 8},
    )
    assert created.status_code == 201
    node = Node.objects.get(hostname="b-decode-2")
    assert b'id="agent-token"' in created.content
    assert node.agent_token_prefix.encode() in created.content  # the token, shown once
    assert FleetEvent.objects.filter(node=node).exists()  # the service wrote its event


def test_an_operator_adds_a_unit_price_with_a_typed_date(client, operator, fleet):
    from fleet.models import Datacenter, GPUType, UnitPrice

    client.force_login(operator)
    gpu = GPUType.objects.get(model="gpu-a")
    dc = Datacenter.objects.get(name="dc-b")
    response = client.post(
        "/fleet/unit-prices/add/",
        {"gpu_type": gpu.pk, "datacenter": dc.pk, "price_per_gpu_hour": "3.10",
         "currency": "USD", "effective_from": "2026-02-01 00:00", "effective_to": ""},
    )  # fmt: skip
    assert response.status_code == 302, response.content.decode()[-2000:]
    price = UnitPrice.objects.get(gpu_type=gpu, datacenter=dc)
    assert price.price_per_gpu_hour == Decimal("3.10") and price.effective_to is None


def test_the_operator_group_can_use_the_admin(client, operator, viewer):
    client.force_login(operator)
    html = client.get("/admin/").content.decode()
    assert "have permission to view or edit anything" not in html
    assert "/admin/fleet/datacenter/" in html and "/admin/frontend/" in html
    assert client.get("/admin/frontend/servedmodelsla/").status_code == 200
    assert client.get("/admin/auth/user/").status_code == 403  # users stay superuser work
    group = Group.objects.get(name="operator")
    assert group.permissions.filter(codename="change_servedmodelsla").exists()
    assert not Group.objects.get(name="viewer").permissions.exists()


def test_detail_pages_link_to_the_forms_for_operators_only(client, viewer, operator, fleet):
    pages = [f"/fleet/instances/{fleet['main'].pk}/", f"/fleet/links/{fleet['link'].pk}/"]
    client.force_login(viewer)
    for path in pages:
        assert b"/edit/" not in client.get(path).content, path
    client.force_login(operator)
    assert f"/fleet/instances/{fleet['main'].pk}/edit/".encode() in client.get(pages[0]).content
    assert f"/fleet/links/{fleet['link'].pk}/edit/".encode() in client.get(pages[1]).content
