"""A tenant's /v1/organization endpoints in the OpenAPI schema (billing/tenant_openapi.py):
every route documented, with the tenant API key as its auth and its error answers in OpenAI's
shape; and the answers the schema promises for what schemathesis does not send (no key, a bad
key, a path that is not a statement). tests/controlplane/test_schemathesis.py checks the
answers to generated requests against the same schema."""

from __future__ import annotations

import re

import pytest
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver
from drf_spectacular.generators import SchemaGenerator
from drf_spectacular.validation import validate_schema

from billing import services
from billing.models import Tenant

PREFIX = "/v1/organization/"
OPENAI_ERROR = {"$ref": "#/components/schemas/OpenAIError"}
# The catch-all that answers any other path below the prefix with a JSON 404: not an operation.
CATCH_ALL = "/v1/organization/{rest}"


@pytest.fixture(scope="module")
def schema() -> dict:
    return SchemaGenerator().get_schema(request=None, public=True)


def _routes(patterns, prefix: str = "/"):
    """Every route of the URL configuration, in OpenAPI's notation (``{name}`` parameters)."""
    for pattern in patterns:
        route = prefix + re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", str(pattern.pattern))
        if isinstance(pattern, URLResolver):
            yield from _routes(pattern.url_patterns, route)
        elif isinstance(pattern, URLPattern):
            yield route


def _organization_routes() -> set[str]:
    return {r for r in _routes(get_resolver().url_patterns) if r.startswith(PREFIX)} - {CATCH_ALL}


def _organization_operations(schema):
    for path, item in schema["paths"].items():
        if path.startswith(PREFIX):
            for method, operation in item.items():
                yield path, method, operation


def test_every_organization_route_is_in_the_schema(schema):
    routes = _organization_routes()
    assert len(routes) == 6, routes  # usage, statements, range, range/csv, one, one as CSV
    documented = {path for path, _, _ in _organization_operations(schema)}
    assert routes - documented == set(), "routes missing from the schema"
    assert documented - routes == set(), "documented paths that are not routes"
    validate_schema(schema)  # and the schema with them is valid OpenAPI 3.0


def test_each_operation_documents_its_auth_shapes_and_errors(schema):
    assert schema["components"]["securitySchemes"]["apiKeyBearer"] == {
        "type": "http",
        "scheme": "bearer",
        "description": "A tenant's API key: 'Authorization: Bearer <key>'.",
    }
    for path, method, op in _organization_operations(schema):
        label = f"{method.upper()} {path}"
        assert method == "get", label  # the views answer GET only (require_GET)
        assert op["tags"] == ["organization"], label
        assert op["security"] == [{"apiKeyBearer": []}], label  # as the gateway's /v1
        responses = op["responses"]
        content = responses["200"]["content"]
        assert set(content) == ({"text/csv"} if path.endswith("/csv") else {"application/json"})
        errors = {code for code in responses if code != "200"}
        assert "401" in errors, label
        in_ = {p["in"] for p in op["parameters"]}
        assert ("400" in errors) == ("query" in in_), label
        assert ("404" in errors) == ("path" in in_), label
        for code in errors:
            assert responses[code]["content"] == {"application/json": {"schema": OPENAI_ERROR}}


def test_the_bodies_refer_to_the_statement_serializers_components(schema):
    ops, ref = schema["paths"], "#/components/schemas/"
    one = ops["/v1/organization/statements/{statement_id}"]["get"]["responses"]["200"]
    assert one["content"]["application/json"]["schema"] == {"$ref": ref + "Statement"}
    listed = schema["components"]["schemas"]["OrganizationStatementList"]
    assert listed["properties"]["data"]["items"] == {"$ref": ref + "StatementSummary"}
    usage = ops["/v1/organization/usage/completions"]["get"]
    names = {p["name"] for p in usage["parameters"]}
    assert names == {
        "start_time", "end_time", "bucket_width", "group_by", "models", "api_key_ids", "limit",
        "page",
    }  # fmt: skip
    start = next(p for p in usage["parameters"] if p["name"] == "start_time")
    assert start["required"] is True and start["schema"]["type"] == "integer"


# --- the answers schemathesis does not ask for --------------------------------------------


@pytest.fixture
def tenant_key(db) -> str:
    tenant = Tenant.objects.create(name="acme", requests_per_minute=60, tokens_per_minute=1000)
    return services.api_key_create(tenant=tenant, name="ci")[1]


def _concrete(path: str) -> str:
    return path.replace("{statement_id}", "1")


QUERY = {"start_time": "1767225600"}


@pytest.mark.django_db
@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer", "Bearer sk-baton-nope-0000", "Token sk-baton-nope-0000"],
    ids=["none", "empty", "unknown", "wrong-scheme"],
)
def test_without_a_valid_key_every_operation_answers_401_in_openai_shape(authorization):
    client = Client()
    headers = {"Authorization": authorization} if authorization else {}
    for route in sorted(_organization_routes()):
        response = client.get(_concrete(route), QUERY, headers=headers)
        assert response.status_code == 401, route
        assert response["Content-Type"] == "application/json"
        error = response.json()["error"]
        assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
        assert error["message"]


@pytest.mark.parametrize(
    ("path", "query", "param", "reason"),
    [
        ("usage/completions", {}, "start_time", "is required"),
        ("usage/completions", {**QUERY, "limit": "99"}, "limit", "must be 1 to 31"),
        ("usage/completions", {**QUERY, "models": "a\x00b"}, "models", "NUL"),
        ("usage/completions", {**QUERY, "group_by": "user"}, "group_by", "Cannot group by"),
        ("statements", {"status": "paid"}, "status", "open or closed"),
        ("statements", {"period": "2026-13"}, "period", "YYYY-MM"),
        ("statements/range", {"start_time": "x"}, "start_time", "Unix seconds"),
        ("statements/range/csv", {**QUERY, "end_time": "0"}, "end_time", "later than"),
    ],
)
def test_a_4xx_names_the_parameter_and_the_reason(tenant_key, path, query, param, reason):
    response = Client().get(PREFIX + path, query, headers={"Authorization": f"Bearer {tenant_key}"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and reason in error["message"], error
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_value"


@pytest.mark.parametrize(
    "path",
    [
        "statements/abc",
        "statements/-1",
        "statements/0.5/csv",
        "statements/99999999999999999999",
        "statements/١",  # a digit, but not an ASCII one
    ],
)
def test_a_statement_id_that_is_not_one_is_a_json_404(tenant_key, path):
    response = Client().get(PREFIX + path, headers={"Authorization": f"Bearer {tenant_key}"})
    assert response.status_code == 404
    assert response.json()["error"]["param"] == "statement_id"
    assert response.json()["error"]["code"] == "not_found"


@pytest.mark.parametrize("path", ["statements/", "statements/1/csv/x", "nothing", "usage"])
def test_any_other_path_below_the_prefix_is_a_json_404(db, path):
    response = Client().get(PREFIX + path)
    assert response.status_code == 404
    assert response["Content-Type"] == "application/json"
    assert response.json()["error"]["message"] == f"Invalid URL (GET {PREFIX}{path})."
