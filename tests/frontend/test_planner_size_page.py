"""The planner page's sizing section: the form for operators, the latest runs and one run's
answer for everyone, and starting a run (the API with session + CSRF, or the plain form)."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Group, User
from django.test import Client

from fleet.choices import PlanRunStatus
from plans import sizing
from plans.models import SizingRun


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


@pytest.fixture
def done_sizing(operator):
    run = sizing.sizing_run_create(scenario="tiny-size", rps=5, p90=10, created_by=operator)
    return sizing.sizing_run_execute(sizing_run_id=run.pk)


def test_an_operator_gets_the_sizing_form_with_the_scenario_defaults(client, operator):
    client.force_login(operator)
    page = client.get("/planner/").content.decode()
    assert 'id="sizing"' in page and 'id="size-form"' in page
    assert 'action="/planner/size/"' in page
    assert '<option value="tiny-size" title=' in page
    assert 'name="rps" step="any" min="0" placeholder="5"' in page
    assert 'placeholder="10"' in page and 'placeholder="15"' in page
    assert 'name="from_db"' in page
    assert "frontend/planner_size.js" in page
    assert "No sizing runs yet." in page and "No finished sizing run yet." in page
    assert 'id="plan-form"' in page  # the plan section is still there


def test_a_viewer_reads_the_latest_answer_without_the_form(client, viewer, done_sizing):
    assert done_sizing.status == PlanRunStatus.DONE, done_sizing.error
    client.force_login(viewer)
    page = client.get("/planner/").content.decode()
    assert 'id="size-form"' not in page and 'id="size-viewer-note"' in page
    assert f'data-size-row="{done_sizing.pk}"' in page
    cheapest = done_sizing.result["cheapest"]
    assert f"Sizing #{done_sizing.pk} · tiny-size at 5 RPS" in page
    for key in cheapest["counts"]:
        assert f'<tr data-pool="{key}">' in page
    assert "breaks the SLA (P90 &ge; " in page and "at its minimum" in page  # MD at 1
    role, _, place = next(iter(cheapest["counts"])).partition("@")
    assert f"<td>{role}</td><td>{place.split(':')[0]}</td><td>{place.split(':')[1]}</td>" in page
    assert "<td>1</td><td>1.25</td>" in page  # one MD unit at GPU-B's unit price
    assert 'id="size-max-bcr"' in page and "Max-BCR fleet" in page
    assert 'id="size-band"' in page and "over +-5% rate" in page


def test_a_run_is_shown_by_its_id_even_unfinished(client, viewer, done_sizing):
    queued = SizingRun.objects.create(scenario="tiny-size")
    client.force_login(viewer)
    page = client.get(f"/planner/?size={queued.pk}").content.decode()
    assert f'Sizing #{queued.pk}: <span class="state state-queued">queued</span>' in page
    failed = SizingRun.objects.create(
        scenario="tiny-size", status=PlanRunStatus.FAILED, error="ValueError: rps"
    )
    page = client.get(f"/planner/?size={failed.pk}").content.decode()
    assert "state-failed" in page and "ValueError: rps" in page


def test_the_page_starts_a_run_through_the_api_with_csrf(operator, db):
    browser = Client(enforce_csrf_checks=True)
    browser.force_login(operator)
    page = browser.get("/planner/")
    token = page.cookies["csrftoken"].value
    body = {"scenario": "tiny-size", "rps": 5, "p90": 10, "p99": 15, "from_db": False}
    refused = browser.post("/api/v1/plans/sizing/", body, content_type="application/json")
    assert refused.status_code == 403
    accepted = browser.post(
        "/api/v1/plans/sizing/", body, content_type="application/json", HTTP_X_CSRFTOKEN=token
    )
    assert accepted.status_code == 201, accepted.content
    assert SizingRun.objects.get().created_by == operator


def test_the_plain_form_starts_a_run_and_shows_it(
    client, operator, django_capture_on_commit_callbacks
):
    from controlplane.celery import app

    client.force_login(operator)
    previous = app.conf.task_always_eager
    app.conf.update(task_always_eager=True)
    try:
        with django_capture_on_commit_callbacks(execute=True):
            response = client.post(
                "/planner/size/", {"scenario": "tiny-size", "rps": "5", "p90": ""}
            )
    finally:
        app.conf.update(task_always_eager=previous)
    run = SizingRun.objects.get()
    assert response.status_code == 302
    assert response["Location"] == f"/planner/?size={run.pk}#sizing"
    run.refresh_from_db()
    assert run.status == PlanRunStatus.DONE, run.error
    assert (run.rps, run.p90, run.start_from_db) == (5.0, None, False)
    page = client.get(response["Location"]).content.decode()
    assert f"Sizing run #{run.pk} queued." in page
    assert f"Sizing #{run.pk} · tiny-size at 5 RPS" in page


def test_bad_form_input_comes_back_as_a_message_naming_the_field(client, operator):
    client.force_login(operator)
    response = client.post("/planner/size/", {"scenario": "tiny-size", "rps": "-1"}, follow=True)
    page = response.content.decode()
    assert "rps: must be a number &gt; 0" in page and "msg-error" in page
    response = client.post("/planner/size/", {"scenario": "tiny-size", "p99": "soon"}, follow=True)
    assert "p99: must be a number, got &#x27;soon&#x27;" in response.content.decode()
    assert not SizingRun.objects.exists()


def test_viewers_and_anonymous_users_cannot_start_a_run(client, viewer):
    assert client.post("/planner/size/", {"scenario": "tiny-size"}).status_code == 302  # login
    client.force_login(viewer)
    assert client.post("/planner/size/", {"scenario": "tiny-size"}).status_code == 403
    assert client.get("/planner/size/").status_code == 405
    assert not SizingRun.objects.exists()
