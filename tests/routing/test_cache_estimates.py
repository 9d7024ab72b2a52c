"""The decision's cached-token estimate beside what MD actually reserved, in the REST API and the
operator UI's request log, and the count of requests relayed although MD held their prefix."""

from __future__ import annotations

import json
from io import StringIO

import pytest
from django.contrib.auth.models import Group, User
from django.core.management import call_command
from rest_framework.test import APIClient

from billing.models import Tenant
from controlplane.models import ApiToken
from routing.analysis import cache_estimate_summary, relayed_despite_cache
from routing.models import RequestRecord, RoutingDecision

pytestmark = pytest.mark.django_db


@pytest.fixture
def viewer_user():
    user = User.objects.create_user("view")
    user.groups.add(Group.objects.get(name="viewer"))
    return user


@pytest.fixture
def api(viewer_user):
    client = APIClient()
    _, key = ApiToken.objects.issue(user=viewer_user)
    client.credentials(HTTP_AUTHORIZATION=f"Token {key}")
    return client


def _record(
    request_id: str,
    pipeline: str,
    *,
    prompt: int,
    actual: int,
    estimate: int | None,
    status: str = "ok",
    model: str = "baton-tiny",
) -> RequestRecord:
    tenant, _ = Tenant.objects.get_or_create(name="acme")
    record = RequestRecord.objects.create(
        request_id=request_id,
        tenant=tenant,
        model=model,
        endpoint="chat.completions",
        status=status,
        pipeline=pipeline,
        handoff_mode="catch-up" if pipeline == "p-rld-md" else "none",
        prompt_tokens=prompt,
        cached_tokens=actual,
        completion_tokens=10,
    )
    if estimate is not None:
        RoutingDecision.objects.create(
            request=record,
            policy_version=1,
            pipeline=pipeline,
            handoff_mode=record.handoff_mode,
            cached_tokens=estimate,
            delta_tokens=prompt - estimate,
            est_wan_s=0.2,
            reason=f"low hit {estimate / prompt:.1%}" if prompt else "",
        )
    return record


@pytest.fixture
def log():
    """The demo's pattern: a relayed turn whose prefix MD in fact held (1,232 of 1,261)."""
    _record("stale", "p-rld-md", prompt=1261, actual=1232, estimate=96)
    _record("cold", "p-rld-md", prompt=1000, actual=0, estimate=0)
    _record("edge", "p-rld-md", prompt=1000, actual=900, estimate=900)  # exactly 90%: not over
    _record("hit", "p-md", prompt=840, actual=800, estimate=800)
    _record("alone", "rld-only", prompt=200_000, actual=0, estimate=0)
    _record("failed", "p-rld-md", prompt=500, actual=480, estimate=0, status="error")
    _record("refused", "", prompt=100, actual=0, estimate=None, status="rejected")


def test_relayed_despite_cache_counts_relayed_records_md_held_over_the_threshold(log):
    assert relayed_despite_cache() == (2, 4)  # stale and failed, of the four p-rld-md
    assert relayed_despite_cache(RequestRecord.objects.filter(status="ok")) == (1, 3)
    assert relayed_despite_cache(threshold=0.85) == (3, 4)
    assert relayed_despite_cache(RequestRecord.objects.none()) == (0, 0)
    with pytest.raises(ValueError, match="threshold"):
        relayed_despite_cache(threshold=1.5)
    summary = cache_estimate_summary(RequestRecord.objects.filter(status="ok"))
    assert summary == {
        "threshold": 0.9,
        "relayed": 3,
        "relayed_despite_cache": 1,
        "relayed_despite_cache_share": round(1 / 3, 4),
        "to_main_decode": 4,
        "prompt_tokens": 1261 + 1000 + 1000 + 840,
        "estimated_cached_tokens": 96 + 0 + 900 + 800,
        "actual_cached_tokens": 1232 + 0 + 900 + 800,
    }


def test_the_request_log_shows_the_estimate_beside_the_actual(api, log):
    rows = {r["request_id"]: r for r in api.get("/api/v1/requests/").json()["results"]}
    assert (rows["stale"]["estimated_cached_tokens"], rows["stale"]["cached_tokens"]) == (96, 1232)
    assert rows["refused"]["estimated_cached_tokens"] is None  # no decision was taken
    assert rows["stale"]["reason"] == "low hit 7.6%"


def test_the_decision_log_shows_the_actual_beside_the_estimate(api, log):
    (row,) = api.get("/api/v1/decisions/?request_id=stale").json()["results"]
    assert (row["cached_tokens"], row["actual_cached_tokens"], row["prompt_tokens"]) == (
        96,
        1232,
        1261,
    )


def test_the_request_log_summary_counts_relayed_despite_cache_under_its_filters(api, log):
    body = api.get("/api/v1/requests/summary/").json()
    assert (body["relayed_despite_cache"], body["relayed"]) == (2, 4)
    assert body["relayed_despite_cache_share"] == 0.5
    body = api.get("/api/v1/requests/summary/?status=ok&threshold=0.85").json()
    assert (body["relayed_despite_cache"], body["relayed"], body["threshold"]) == (2, 3, 0.85)
    body = api.get("/api/v1/requests/summary/?pipeline=p-md").json()
    assert (body["relayed"], body["relayed_despite_cache_share"]) == (0, None)
    assert body["estimated_cached_tokens"] == body["actual_cached_tokens"] == 800
    response = api.get("/api/v1/requests/summary/?threshold=2")
    assert response.status_code == 400 and "threshold" in response.json()


def test_routing_report_prints_the_count_for_the_benchmark(log):
    out = StringIO()
    call_command("routing_report", stdout=out)
    assert "relayed although MD held > 90% of the prompt: 2 of 4 relayed requests (50.0%)" in (
        out.getvalue()
    )
    out = StringIO()
    call_command("routing_report", "--json", "--status", "ok", "--hours", "1", stdout=out)
    body = json.loads(out.getvalue())
    assert (body["relayed_despite_cache"], body["relayed"]) == (1, 3)
    out = StringIO()
    call_command("routing_report", "--model", "other", stdout=out)
    assert "0 of 0 relayed requests" in out.getvalue()


def test_the_operator_ui_request_log_shows_actual_and_estimate(client, viewer_user, log):
    client.force_login(viewer_user)
    page = client.get("/requests/?status=ok")
    assert page.status_code == 200
    html = page.content.decode()
    assert "1232 <span" in html and "· 96</span>" in html
    assert "relayed although MD held their prefix: 1 of 3" in html
    # A filter with no relayed request hides the line.
    html = client.get("/requests/?pipeline=p-md").content.decode()
    assert 'id="relayed-despite-cache"' not in html
