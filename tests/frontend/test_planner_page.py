"""The planner page: login required, past plans for everyone, the form for operators only."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Group, User

from fleet.choices import PlanRunStatus
from plans import services as planning
from plans.models import PlanRun


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
def done_run(fleet, operator):
    run = planning.plan_run_create(
        prefill_counts=[1],
        relay_counts=[1],
        main_counts=[1],
        top=1,
        created_by=operator,
        duration_s=40,
    )
    return planning.plan_run_execute(plan_run_id=run.pk)


def test_the_planner_page_needs_a_login(client, db):
    response = client.get("/planner/")
    assert response.status_code == 302
    assert response["Location"] == "/login/?next=/planner/"


def test_a_viewer_sees_past_plans_read_only(client, viewer, done_run):
    assert done_run.status == PlanRunStatus.DONE, done_run.error
    client.force_login(viewer)
    page = client.get("/planner/").content.decode()
    assert 'id="plan-form"' not in page
    assert 'id="plan-viewer-note"' in page
    assert f'data-plan-row="{done_run.pk}"' in page
    assert "otto" in page and "tiny-plan" in page
    best = done_run.results[0]
    assert f"{best['bcr']:.4f}" in page  # best BCR in the list and in the results table
    assert f"{best['cost_per_hour']:.2f} USD" in page


def test_an_operator_gets_the_form_with_the_scenario_defaults(client, operator, db):
    client.force_login(operator)
    page = client.get("/planner/").content.decode()
    assert 'id="plan-form"' in page
    assert 'name="prefill_counts" value="2,4"' in page
    assert 'name="main_counts" value="1,2"' in page
    assert '<option value="tiny-plan" title=' in page and "selected" in page
    assert 'name="csrfmiddlewaretoken"' in page
    assert "frontend/planner.js" in page
    assert "No plans yet." in page


def test_the_nav_links_the_planner_and_marks_it_active(client, viewer):
    client.force_login(viewer)
    page = client.get("/planner/").content.decode()
    assert '<a href="/planner/" class="active">Planner</a>' in page
    assert '<a href="/planner/" >Planner</a>' in client.get("/fleet/").content.decode()


def test_a_failed_plan_shows_its_reason(client, viewer, fleet):
    PlanRun.objects.create(
        scenario="tiny-plan", status=PlanRunStatus.FAILED, error="ValueError: sla.ttft_p90_s"
    )
    client.force_login(viewer)
    page = client.get("/planner/").content.decode()
    assert "state-failed" in page and "ValueError: sla.ttft_p90_s" in page


def test_the_page_posts_with_session_auth_and_csrf(operator, fleet):
    from django.test import Client

    browser = Client(enforce_csrf_checks=True)
    browser.force_login(operator)
    page = browser.get("/planner/")
    token = page.cookies["csrftoken"].value
    body = {"prefill_counts": [1], "relay_counts": [0], "main_counts": [1], "top": 1}
    refused = browser.post("/api/v1/plans/", body, content_type="application/json")
    assert refused.status_code == 403
    accepted = browser.post(
        "/api/v1/plans/", body, content_type="application/json", HTTP_X_CSRFTOKEN=token
    )
    assert accepted.status_code == 201, accepted.content
