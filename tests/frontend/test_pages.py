"""Pages: login required, the dashboard at /, viewer versus operator."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Group, User

PAGES = ["/", "/fleet/", "/requests/", "/telemetry/snapshot/", "/telemetry/history/"]


@pytest.fixture
def viewer(db):
    user = User.objects.create_user("vera", password="pw-viewer-1")
    user.groups.add(Group.objects.get_or_create(name="viewer")[0])
    return user


@pytest.fixture
def operator(db):
    user = User.objects.create_user("otto", password="pw-operator-1")
    user.groups.add(Group.objects.get_or_create(name="operator")[0])
    return user


@pytest.mark.parametrize("path", PAGES)
def test_pages_send_anonymous_users_to_the_login_page(client, db, path):
    response = client.get(path)
    assert response.status_code == 302
    assert response["Location"].startswith("/login/?next=")


def test_login_lands_on_the_dashboard(client, viewer):
    response = client.post("/login/", {"username": "vera", "password": "pw-viewer-1"})
    assert response.status_code == 302 and response["Location"] == "/"
    page = client.get("/")
    assert page.status_code == 200
    assert b'id="chart-ttft"' in page.content
    assert b"uPlot.iife.min.js" in page.content


def test_every_page_renders_for_a_viewer(client, viewer, fleet, aggregator):
    from frontend.synthetic import synthetic_records_create

    synthetic_records_create(count=5, seed=4)
    client.force_login(viewer)
    for path in [
        *PAGES,
        f"/fleet/instances/{fleet['main'].pk}/",
        f"/fleet/links/{fleet['link'].pk}/",
        "/requests/?pipeline=p-md&status=ok",
        "/telemetry/history/?scale=day",
    ]:
        assert client.get(path).status_code == 200, path


def test_request_log_filters_by_pipeline_and_shows_the_reason(client, viewer, fleet):
    from frontend.synthetic import synthetic_records_create
    from routing.models import RequestRecord

    synthetic_records_create(count=30, seed=5)
    client.force_login(viewer)
    page = client.get("/requests/?pipeline=p-rld-md")
    shown = page.context["page"].paginator.count
    assert shown == RequestRecord.objects.filter(pipeline="p-rld-md").count() > 0
    assert b"[synthetic] hit" in page.content


def test_only_operators_see_the_instance_buttons(client, viewer, operator, fleet):
    client.force_login(viewer)
    assert b'data-action="drain"' not in client.get("/fleet/").content
    client.force_login(operator)
    assert b'data-action="drain"' in client.get("/fleet/").content


def test_drain_from_the_ui_session_is_for_operators_only(client, viewer, operator, fleet):
    pk = fleet["prefill"].pk
    client.force_login(viewer)
    assert client.post(f"/api/v1/instances/{pk}/drain/").status_code == 403
    client.force_login(operator)
    assert client.post(f"/api/v1/instances/{pk}/drain/").status_code == 200
