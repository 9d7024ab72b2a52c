"""The routing REST resources: the live policy settings and the request / decision logs."""

from __future__ import annotations

import pytest

from billing.models import Tenant
from pdd.policy import PolicySettings
from routing.models import RequestRecord, RoutingDecision
from tests.conftest import api_client

pytestmark = pytest.mark.django_db


@pytest.fixture
def operator():
    return api_client("ops", "operator")


@pytest.fixture
def viewer():
    return api_client("view", "viewer")


def test_policy_starts_at_the_defaults(viewer):
    body = viewer.get("/api/v1/routing-policy/").json()
    assert body["version"] == 1
    assert body["settings"] == PolicySettings().to_dict()


def test_operator_changes_one_setting_and_the_version_moves(operator):
    response = operator.patch(
        "/api/v1/routing-policy/", {"settings": {"catch_up_batch_tokens": 32}}, format="json"
    )
    assert response.status_code == 200, response.json()
    body = operator.get("/api/v1/routing-policy/").json()
    assert body["version"] == 2
    assert body["settings"]["catch_up_batch_tokens"] == 32
    assert body["settings"]["wan_time_threshold_s"] == PolicySettings().wan_time_threshold_s
    assert body["updated_by"] == "ops"


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"catch_up_batch_tokens": "many"}, "catch_up_batch_tokens"),
        ({"rld_load_catch_up_below": -1}, "rld_load_catch_up_below"),
        ({"no_such_setting": 1}, "no_such_setting"),
    ],
)
def test_invalid_policy_change_is_400_naming_the_setting_and_keeps_the_old_one(
    operator, change, field
):
    before = operator.get("/api/v1/routing-policy/").json()
    response = operator.patch("/api/v1/routing-policy/", {"settings": change}, format="json")
    assert response.status_code == 400
    assert field in response.json()["settings"]
    assert operator.get("/api/v1/routing-policy/").json() == before


def test_viewer_cannot_change_the_policy(viewer):
    response = viewer.patch(
        "/api/v1/routing-policy/", {"settings": {"catch_up_batch_tokens": 8}}, format="json"
    )
    assert response.status_code == 403


def _record(request_id: str, pipeline: str, tenant: Tenant) -> RequestRecord:
    record = RequestRecord.objects.create(
        request_id=request_id,
        tenant=tenant,
        model="baton-tiny",
        endpoint="chat.completions",
        status="ok",
        pipeline=pipeline,
        handoff_mode="catch-up" if pipeline == "p-rld-md" else "none",
        prompt_tokens=100,
        cached_tokens=50,
        completion_tokens=10,
    )
    RoutingDecision.objects.create(
        request=record,
        policy_version=1,
        pipeline=pipeline,
        handoff_mode=record.handoff_mode,
        cached_tokens=50,
        delta_tokens=50,
        est_wan_s=0.2,
        reason=f"because {pipeline}",
    )
    return record


def test_request_log_filters_by_pipeline_and_shows_the_reason(viewer):
    tenant = Tenant.objects.create(name="acme")
    _record("r1", "p-md", tenant)
    _record("r2", "p-rld-md", tenant)
    body = viewer.get("/api/v1/requests/?pipeline=p-rld-md").json()
    assert [r["request_id"] for r in body["results"]] == ["r2"]
    assert body["results"][0]["reason"] == "because p-rld-md"
    assert body["results"][0]["tenant_name"] == "acme"


def test_decision_log_filters_by_request_id(viewer):
    tenant = Tenant.objects.create(name="acme")
    _record("r1", "p-md", tenant)
    _record("r2", "p-rld-md", tenant)
    body = viewer.get("/api/v1/decisions/?request_id=r1").json()
    assert [d["pipeline"] for d in body["results"]] == ["p-md"]
