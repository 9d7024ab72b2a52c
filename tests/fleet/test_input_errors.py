"""Bad input is a 4xx in the caller's error shape, never a 500: invalid Unicode, JSON nested
too deep, bodies over the limit, integers beyond a column, a broken tokenizer file."""

from __future__ import annotations

import json

import pytest
from rest_framework.test import APIClient

from billing import services as billing
from billing.models import Tenant
from fleet import services
from fleet.models import Datacenter, Node, ServedModel

pytestmark = pytest.mark.django_db

DEEP = "[" * 100_000 + "]" * 100_000


@pytest.fixture
def tenant_key(transactional_db):
    tenant = Tenant.objects.create(name="acme", requests_per_minute=100, tokens_per_minute=10**6)
    ServedModel.objects.create(
        name="baton-tiny", source="baton-tiny", num_layers=4, kv_bytes_per_token=4096
    )
    _, raw = billing.api_key_create(tenant=tenant)
    return raw


def _gateway(raw: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    return client


def _post_raw(client: APIClient, path: str, body: str | bytes):
    return client.generic("POST", path, body, content_type="application/json")


def _openai_error(response, status: int) -> dict:
    assert response.status_code == status, response.content[:300]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize(
    "path, body, param",
    [
        (
            "/v1/chat/completions",
            '{"model":"baton-tiny","messages":[{"role":"user","content":"\\ud800"}]}',
            "messages[0].content",
        ),
        ("/v1/completions", '{"model":"baton-tiny","prompt":"\\udfff abc"}', "prompt"),
    ],
)
def test_a_lone_surrogate_is_400_naming_the_field(tenant_key, path, body, param):
    error = _openai_error(_post_raw(_gateway(tenant_key), path, body), 400)
    assert error["param"] == param
    assert "Unicode" in error["message"]


def test_a_valid_surrogate_pair_is_accepted_as_text(tenant_key):
    # An emoji escaped as a UTF-16 pair is valid: past parsing, no path -> 503.
    body = '{"model":"baton-tiny","prompt":"\\ud83d\\ude00 hi"}'
    assert _post_raw(_gateway(tenant_key), "/v1/completions", body).status_code == 503


def test_json_nested_100000_deep_is_400_in_the_gateway(tenant_key):
    error = _openai_error(_post_raw(_gateway(tenant_key), "/v1/completions", DEEP), 400)
    assert "nested deeper" in error["message"]


def test_json_nested_too_deep_is_400_in_the_rest_api(operator):
    response = _post_raw(operator, "/api/v1/datacenters/", DEEP)
    assert response.status_code == 400
    assert "nested deeper" in response.json()["detail"]
    assert Datacenter.objects.count() == 0


def test_json_nested_too_deep_is_400_on_the_heartbeat(node_a):
    token = services.node_rotate_token(node=node_a)
    agent = APIClient()
    agent.credentials(HTTP_AUTHORIZATION=f"AgentToken {token}")
    response = _post_raw(agent, "/api/v1/agent/heartbeat", '{"instances":' + DEEP + "}")
    assert response.status_code == 400
    assert "nested deeper" in response.json()["detail"]


def test_a_lone_surrogate_is_400_in_the_rest_api(operator):
    response = _post_raw(operator, "/api/v1/datacenters/", '{"name":"dc-x","region":"\\ud800"}')
    assert response.status_code == 400
    assert "region" in response.json()["detail"]
    assert Datacenter.objects.count() == 0


def test_a_model_whose_tokenizer_file_is_not_a_tokenizer_is_503_naming_the_model(
    tenant_key, tmp_path
):
    broken = tmp_path / "tokenizer.json"
    broken.write_text("this is not a tokenizer")
    ServedModel.objects.create(
        name="broken", source=str(tmp_path), num_layers=4, kv_bytes_per_token=4096
    )
    response = _post_raw(
        _gateway(tenant_key), "/v1/completions", '{"model":"broken","prompt":"hello"}'
    )
    error = _openai_error(response, 503)
    assert error["code"] == "tokenizer_unavailable"
    assert "'broken'" in error["message"]


def test_a_5_mb_prompt_is_413_in_the_openai_shape(tenant_key):
    body = json.dumps({"model": "baton-tiny", "prompt": "x" * (5 * 1024 * 1024)})
    error = _openai_error(_post_raw(_gateway(tenant_key), "/v1/completions", body), 413)
    assert error["code"] == "body_too_large"


def test_a_5_mb_heartbeat_is_413_and_not_stored(node_a):
    token = services.node_rotate_token(node=node_a)
    agent = APIClient()
    agent.credentials(HTTP_AUTHORIZATION=f"AgentToken {token}")
    body = json.dumps({"instances": [], "padding": "x" * (5 * 1024 * 1024)})
    response = _post_raw(agent, "/api/v1/agent/heartbeat", body)
    assert response.status_code == 413
    assert "detail" in response.json()
    node_a.refresh_from_db()
    assert "padding" not in json.dumps(node_a.last_report)


@pytest.mark.parametrize(
    "query",
    [
        "datacenter=9223372036854775808",
        "datacenter=-9223372036854775809",
        "node=9223372036854775808",
        "served_model=99999999999999999999999",
        "datacenter=1e400",
    ],
)
def test_integers_beyond_the_column_in_filters_are_400(viewer, query):
    response = viewer.get(f"/api/v1/instances/?{query}")
    assert response.status_code == 400, response.content[:300]
    assert query.split("=")[0] in response.json()


@pytest.mark.parametrize("pk", ["9223372036854775808", "99999999999999999999999999"])
def test_ids_beyond_the_column_in_paths_are_404(viewer, pk):
    assert viewer.get(f"/api/v1/nodes/{pk}/").status_code == 404
    assert viewer.get(f"/api/v1/datacenters/{pk}/").status_code == 404


def test_tenant_limits_up_to_the_validator_fit_the_column(operator):
    tenant = Tenant.objects.create(name="big", requests_per_minute=10, tokens_per_minute=10)
    response = operator.patch(
        f"/api/v1/tenants/{tenant.pk}/", {"tokens_per_minute": 2_147_483_648}, format="json"
    )
    assert response.status_code == 200, response.content
    tenant.refresh_from_db()
    assert tenant.tokens_per_minute == 2_147_483_648
    response = operator.patch(
        f"/api/v1/tenants/{tenant.pk}/", {"tokens_per_minute": 10**30}, format="json"
    )
    assert response.status_code == 400
    assert "tokens_per_minute" in response.json()


def test_node_list_is_unchanged_by_rejected_input(operator, node_a):
    before = Node.objects.count()
    _post_raw(operator, "/api/v1/nodes/", DEEP)
    assert Node.objects.count() == before


def test_a_report_with_too_many_instances_or_blocks_is_400(node_a):
    from fleet.api.agent import MAX_REPORTED_BLOCKS, MAX_REPORTED_INSTANCES

    token = services.node_rotate_token(node=node_a)
    agent = APIClient()
    agent.credentials(HTTP_AUTHORIZATION=f"AgentToken {token}")
    many = [{"instance_id": str(i), "state": "running"} for i in range(MAX_REPORTED_INSTANCES + 1)]
    response = agent.post("/api/v1/agent/heartbeat", {"instances": many}, format="json")
    assert response.status_code == 400
    assert "instances" in response.json()
    blocks = ["b"] * (MAX_REPORTED_BLOCKS + 1)
    item = {"instance_id": "1", "state": "running", "incoming_prefix_blocks": blocks}
    response = agent.post("/api/v1/agent/heartbeat", {"instances": [item]}, format="json")
    assert response.status_code == 400


@pytest.mark.parametrize(
    "query",
    ["until=0902-01-24T06:54:10-18:23", "since=1721-02-03T18:54:29.6%2B17:21"],
)
def test_date_time_filters_with_any_utc_offset_are_not_500(viewer, query):
    # Python takes offsets up to +-23:59, PostgreSQL up to +-15:59: converted to UTC first.
    assert viewer.get(f"/api/v1/requests/?{query}").status_code == 200


def test_a_date_time_filter_beyond_year_1_in_utc_is_400(viewer):
    response = viewer.get("/api/v1/requests/?since=0001-01-01T00:10:00%2B05:00")
    assert response.status_code == 400
    assert "since" in response.json()
