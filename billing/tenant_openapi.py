"""A tenant's self-service endpoints (/v1/organization/..., billing/tenant_api.py) in the OpenAPI
schema, under the ``organization`` tag.

Like the gateway's /v1 operations they are plain Django views (no DRF), authenticated with the
tenant's API key, so drf-spectacular does not see them: ``add_tenant_paths``, a postprocessing
hook (SPECTACULAR_SETTINGS["POSTPROCESSING_HOOKS"]), adds their operations as written here. The
statement bodies are the operator API's components (``Statement``, ``StatementSummary``: the same
serializers answer both); errors are OpenAI's shape (``OpenAIError``), with ``error.param``
naming the query or path parameter at fault.
"""

from __future__ import annotations

from typing import Any

from billing import tenant_api
from pdd import openai_errors

TAG = "organization"  # described in SPECTACULAR_SETTINGS["TAGS"]
REF = "#/components/schemas/"
# The tenant API key, as the gateway's /v1 operations take it too (routing/gateway/openapi.py).
SECURITY_SCHEME_NAME = "apiKeyBearer"
SECURITY_SCHEME = {
    "type": "http",
    "scheme": "bearer",
    "description": "A tenant's API key: 'Authorization: Bearer <key>'.",
}
# The operator API's components these answers share (billing/api/serializers.py).
SHARED_COMPONENTS = ("Statement", "StatementSummary")

LATEST_UNIX_S = int(tenant_api.LATEST.timestamp())


def _ref(name: str) -> dict[str, str]:
    return {"$ref": REF + name}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "nullable": True}


COMPONENTS: dict[str, Any] = {
    "OrganizationUsageResult": {
        "type": "object",
        "description": "One group's usage in one bucket. As in OpenAI's API, input_tokens "
        "counts every prompt token, cached ones included; input_cached_tokens is the cached "
        "part of it.",
        "required": [
            "object",
            "input_tokens",
            "input_cached_tokens",
            "output_tokens",
            "num_model_requests",
        ],
        "properties": {
            "object": {"type": "string", "enum": ["organization.usage.completions.result"]},
            "input_tokens": {"type": "integer", "minimum": 0},
            "input_cached_tokens": {"type": "integer", "minimum": 0},
            "output_tokens": {"type": "integer", "minimum": 0},
            "num_model_requests": {"type": "integer", "minimum": 0},
            "project_id": _nullable({"type": "string", "description": "Always null."}),
            "user_id": _nullable({"type": "string", "description": "Always null."}),
            "api_key_id": _nullable(
                {
                    "type": "string",
                    "description": "The key's prefix, with group_by=api_key_id; else null.",
                }
            ),
            "model": _nullable(
                {"type": "string", "description": "The model, with group_by=model; else null."}
            ),
            "batch": _nullable({"type": "boolean", "description": "Always null."}),
        },
    },
    "OrganizationUsageBucket": {
        "type": "object",
        "description": "One UTC day [start_time, end_time), Unix seconds.",
        "required": ["object", "start_time", "end_time", "results"],
        "properties": {
            "object": {"type": "string", "enum": ["bucket"]},
            "start_time": {"type": "integer"},
            "end_time": {"type": "integer"},
            "results": {"type": "array", "items": _ref("OrganizationUsageResult")},
        },
    },
    "OrganizationUsagePage": {
        "type": "object",
        "required": ["object", "data", "has_more", "next_page"],
        "properties": {
            "object": {"type": "string", "enum": ["page"]},
            "data": {"type": "array", "items": _ref("OrganizationUsageBucket")},
            "has_more": {"type": "boolean"},
            "next_page": _nullable(
                {
                    "type": "string",
                    "description": "The next page's ?page= value, while has_more is true.",
                }
            ),
        },
    },
    "OrganizationStatementList": {
        "type": "object",
        "required": ["object", "data", "has_more"],
        "properties": {
            "object": {"type": "string", "enum": ["list"]},
            "data": {
                "type": "array",
                "description": "Newest first, at most 120, without lines.",
                "items": _ref("StatementSummary"),
            },
            "has_more": {"type": "boolean", "enum": [False]},
        },
    },
}


def _error(description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/json": {"schema": _ref("OpenAIError")}},
    }


_400 = _error(
    "A query parameter is missing or invalid: error.param names it, error.message says why "
    "(error.code invalid_value)."
)
_401 = _error(
    "No API key, or an invalid, revoked or inactive one (error.type authentication_error, "
    "error.code invalid_api_key)."
)
_404 = _error(
    "No such statement among the tenant's own (error.param statement_id, error.code "
    "not_found); another tenant's statement is as absent as a missing one."
)


def _unix_param(name: str, description: str, *, required: bool = False) -> dict[str, Any]:
    return {
        "in": "query",
        "name": name,
        "required": required,
        "description": f"{description} (Unix seconds, up to 2999-12-31).",
        "schema": {"type": "integer", "minimum": 0, "maximum": LATEST_UNIX_S},
    }


def _list_param(name: str, description: str, items: dict[str, Any]) -> dict[str, Any]:
    return {
        "in": "query",
        "name": name,
        "description": f"{description} Repeat the parameter or separate values with commas.",
        "schema": {"type": "array", "items": items},
        "style": "form",
        "explode": True,
    }


_RANGE = [
    _unix_param("start_time", "Start of the range, inclusive", required=True),
    _unix_param(
        "end_time",
        "End of the range, exclusive; default now. Later than start_time, at most 366 days "
        "after it",
    ),
]
_STATEMENT_ID = {
    "in": "path",
    "name": "statement_id",
    "required": True,
    "description": "The statement's id.",
    "schema": {"type": "integer", "minimum": 1},
}


def _operation(
    operation_id: str,
    summary: str,
    description: str,
    ok: dict[str, Any],
    errors: dict[str, dict[str, Any]],
    parameters: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    return {
        "get": {
            "operationId": operation_id,
            "summary": summary,
            "description": description,
            "tags": [TAG],
            "security": [{SECURITY_SCHEME_NAME: []}],
            "parameters": parameters or [],
            "responses": {"200": ok, **errors},
        }
    }


def _json(description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _csv(description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"text/csv": {"schema": {"type": "string"}}},
    }


_CSV_NOTE = (
    "One row per line, then one 'total' row per currency; the values are the JSON's, "
    "character for character."
)

PATHS: dict[str, Any] = {
    "/v1/organization/usage/completions": _operation(
        "organization_usage_completions",
        "Completions usage",
        "The tenant's requests and input, cached input and output tokens in daily UTC buckets, "
        "shaped like OpenAI's organization usage API. A page holds `limit` buckets from the "
        "day of start_time; `next_page` continues.",
        _json("Daily buckets.", _ref("OrganizationUsagePage")),
        {"400": _400, "401": _401},
        [
            _RANGE[0],
            _unix_param("end_time", "End, exclusive; default now. Later than start_time"),
            {
                "in": "query",
                "name": "bucket_width",
                "description": "Only 1d (the default).",
                "schema": {"type": "string", "enum": ["1d"], "default": "1d"},
            },
            _list_param(
                "group_by",
                "Split each bucket's results by these.",
                {"type": "string", "enum": sorted(tenant_api.GROUPS)},
            ),
            _list_param("models", "Only these models.", {"type": "string"}),
            _list_param("api_key_ids", "Only these keys (their prefixes).", {"type": "string"}),
            {
                "in": "query",
                "name": "limit",
                "description": "Buckets per page.",
                "schema": {
                    "type": "integer",
                    "minimum": 1,
                    "maximum": tenant_api.MAX_LIMIT,
                    "default": tenant_api.DEFAULT_LIMIT,
                },
            },
            {
                "in": "query",
                "name": "page",
                "description": "A previous page's next_page.",
                "schema": {"type": "string"},
            },
        ],
    ),
    "/v1/organization/statements": _operation(
        "organization_statements_list",
        "List statements",
        "The tenant's monthly statements, newest first, without lines.",
        _json("The statements.", _ref("OrganizationStatementList")),
        {"400": _400, "401": _401},
        [
            {
                "in": "query",
                "name": "status",
                "description": "Only open or only closed statements.",
                "schema": {"type": "string", "enum": ["open", "closed"]},
            },
            {
                "in": "query",
                "name": "period",
                "description": "Only the statement of this month, YYYY-MM.",
                "schema": {"type": "string", "pattern": r"^(19|2\d)\d\d-(0[1-9]|1[0-2])$"},
            },
        ],
    ),
    "/v1/organization/statements/range": _operation(
        "organization_statement_range",
        "Statement of any range",
        "The tenant's statement for [start_time, end_time): lines and totals worked out from "
        "its usage by request time, status preview and no id (not stored).",
        _json("The statement with its lines.", _ref("Statement")),
        {"400": _400, "401": _401},
        _RANGE,
    ),
    "/v1/organization/statements/range/csv": _operation(
        "organization_statement_range_csv",
        "Statement of any range as CSV",
        f"The same as /v1/organization/statements/range, as CSV. {_CSV_NOTE}",
        _csv("The statement as CSV."),
        {"400": _400, "401": _401},
        _RANGE,
    ),
    "/v1/organization/statements/{statement_id}": _operation(
        "organization_statement",
        "Retrieve statement",
        "One of the tenant's statements with its lines.",
        _json("The statement with its lines.", _ref("Statement")),
        {"401": _401, "404": _404},
        [_STATEMENT_ID],
    ),
    "/v1/organization/statements/{statement_id}/csv": _operation(
        "organization_statement_csv",
        "Retrieve statement as CSV",
        f"One of the tenant's statements as CSV. {_CSV_NOTE}",
        _csv("The statement as CSV."),
        {"401": _401, "404": _404},
        [_STATEMENT_ID],
    ),
}


def add_tenant_paths(result: dict, generator, request, public) -> dict:
    """drf-spectacular postprocessing hook: the tenant self-service operations, their
    components and the API key's security scheme."""
    components = result.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    missing = [name for name in SHARED_COMPONENTS if name not in schemas]
    if missing:  # the operator API's statement views are gone or renamed their serializers
        raise RuntimeError(f"add_tenant_paths: no component {', '.join(missing)} to refer to")
    result.setdefault("paths", {}).update(PATHS)
    schemas.update(COMPONENTS)
    schemas["OpenAIError"] = openai_errors.OPENAPI_SCHEMA
    components.setdefault("securitySchemes", {})[SECURITY_SCHEME_NAME] = SECURITY_SCHEME
    return result
