"""The OpenAPI schema documents each operation's error answers (base.schema)."""

from __future__ import annotations

import pytest
from drf_spectacular.generators import SchemaGenerator

from base.schema import DESCRIPTIONS

METHODS = {"get", "put", "post", "patch", "delete", "head", "options", "trace"}
ERROR_DETAIL = {"$ref": "#/components/schemas/ErrorDetail"}


@pytest.fixture(scope="module")
def schema() -> dict:
    return SchemaGenerator().get_schema(request=None, public=True)


# Plain Django views, not DRF: errors in OpenAI's shape, no permission layer or content
# negotiation (no 403, no 415). tests/routing/gateway/test_gateway_openapi.py checks the
# gateway's (``openai``), tests/billing/test_tenant_openapi.py a tenant's (``organization``).
OPENAI_SHAPED_TAGS = {"openai", "organization"}


def _operations(schema: dict):
    """The DRF operations."""
    for path, item in schema["paths"].items():
        for method, operation in item.items():
            if method in METHODS and not OPENAI_SHAPED_TAGS & set(operation.get("tags", ())):
                yield f"{method.upper()} {path}", operation


def _needs_auth(operation: dict) -> bool:
    security = operation.get("security", [])
    return bool(security) and {} not in security


def test_the_schema_has_operations(schema):
    assert len(list(_operations(schema))) > 50


def test_every_operation_documents_a_client_error(schema):
    missing = [
        label
        for label, op in _operations(schema)
        if not any(400 <= int(code) < 500 for code in op["responses"])
    ]
    assert missing == []


def test_every_authenticated_operation_documents_401_and_403(schema):
    missing = [
        label
        for label, op in _operations(schema)
        if _needs_auth(op) and not {"401", "403"} <= set(op["responses"])
    ]
    assert missing == []
    assert any(_needs_auth(op) for _, op in _operations(schema))


def test_every_operation_with_a_path_parameter_documents_404(schema):
    with_path = [
        (label, op)
        for label, op in _operations(schema)
        if any(p["in"] == "path" for p in op.get("parameters", []))
    ]
    assert with_path
    assert [label for label, op in with_path if "404" not in op["responses"]] == []


def test_every_operation_with_a_body_documents_400_408_413_and_415(schema):
    with_body = [(label, op) for label, op in _operations(schema) if "requestBody" in op]
    assert with_body
    missing = [
        label for label, op in with_body if not {"400", "408", "413", "415"} <= set(op["responses"])
    ]
    assert missing == []


def test_error_bodies_use_the_shared_components(schema):
    """The error answers BatonAutoSchema adds (those a view declares itself are its own)."""
    components = schema["components"]["schemas"]
    assert components["ErrorDetail"]["required"] == ["detail"]
    assert components["ValidationErrorMap"]["type"] == "object"
    assert components["ValidationErrorList"]["type"] == "array"
    for label, op in _operations(schema):
        for code, response in op["responses"].items():
            if response.get("description") != DESCRIPTIONS.get(code):
                continue
            body = response["content"]["application/json"]["schema"]
            if code == "400":
                refs = [s["$ref"].rsplit("/", 1)[-1] for s in body["anyOf"]]
                assert refs == ["ValidationErrorMap", "ErrorDetail", "ValidationErrorList"], label
            else:
                assert body == ERROR_DETAIL, (label, code)


def test_401_names_the_authenticate_header(schema):
    op = schema["paths"]["/api/v1/datacenters/"]["get"]
    assert "WWW-Authenticate" in op["responses"]["401"]["headers"]


def test_a_views_own_error_answer_is_kept(schema):
    heartbeat = schema["paths"]["/api/v1/agent/heartbeat"]["post"]["responses"]["404"]
    assert heartbeat["description"] == "The node has not registered yet."
    assert heartbeat["content"]["application/json"]["schema"] == ERROR_DETAIL


def test_paginated_lists_document_404_for_a_page_past_the_end(schema):
    assert "404" in schema["paths"]["/api/v1/datacenters/"]["get"]["responses"]
    # An operation without pagination or path parameter has no 404.
    assert "404" not in schema["paths"]["/api/v1/topology/"]["get"]["responses"]


def test_read_only_choices_of_blank_model_fields_allow_the_blank_value(schema):
    handoff = schema["components"]["schemas"]["RequestRecord"]["properties"]["handoff_mode"]
    assert {"$ref": "#/components/schemas/BlankEnum"} in handoff["oneOf"]
