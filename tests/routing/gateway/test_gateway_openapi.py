"""The OpenAI-compatible gateway in the OpenAPI schema: /v1 under its own tag, errors in
OpenAI's shape with X-Request-Id, request bodies that say what the gateway accepts; one tag
per app for /api/v1; and the whole schema valid OpenAPI 3.0."""

from __future__ import annotations

import pytest
from drf_spectacular.generators import SchemaGenerator
from drf_spectacular.validation import validate_schema

from pdd.tokenizer import apply_chat_template
from routing.gateway import openai_fields, parsing
from routing.gateway.errors import GatewayError

METHODS = {"get", "put", "post", "patch", "delete"}


@pytest.fixture(scope="module")
def schema() -> dict:
    return SchemaGenerator().get_schema(request=None, public=True)


def _operations(schema):
    for path, item in schema["paths"].items():
        for method, op in item.items():
            if method in METHODS:
                yield path, method, op


def test_the_schema_is_valid_openapi(schema):
    validate_schema(schema)


def test_the_gateway_is_documented_under_its_own_tag(schema):
    gateway = {(p, m) for p, m, op in _operations(schema) if op["tags"] == ["openai"]}
    assert gateway == {
        ("/v1/chat/completions", "post"),
        ("/v1/completions", "post"),
        ("/v1/models", "get"),
    }
    assert schema["components"]["securitySchemes"]["apiKeyBearer"]["scheme"] == "bearer"


def test_api_v1_has_one_tag_per_app(schema):
    tags = {}
    for path, _, op in _operations(schema):
        if path.startswith("/api/v1/"):
            assert len(op["tags"]) == 1, path
            tags.setdefault(op["tags"][0], set()).add(path.split("/")[3])
    assert set(tags) == {"fleet", "billing", "routing", "planner", "agents"}
    assert {"datacenters", "nodes", "instances", "models"} <= tags["fleet"]
    assert {"tenants", "api-keys", "usage", "statements", "billing"} <= tags["billing"]
    assert {"requests", "decisions", "routing-policy"} <= tags["routing"]
    assert tags["planner"] == {"plans", "autopilot"} and tags["agents"] == {"agent"}
    assert [t["name"] for t in schema["tags"]][0] == "openai"
    assert {t["name"] for t in schema["tags"]} == {"openai", "organization", *tags}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_every_gateway_answer_documents_x_request_id_and_errors_in_openai_shape(schema, path):
    responses = schema["paths"][path]["post"]["responses"]
    assert {"200", "400", "401", "404", "429", "502", "503"} <= set(responses)
    for code, response in responses.items():
        assert "X-Request-Id" in response["headers"], code
        if code != "200":
            body = response["content"]["application/json"]["schema"]
            assert body == {"$ref": "#/components/schemas/OpenAIError"}
    assert "Retry-After" in responses["429"]["headers"]
    assert "text/event-stream" in responses["200"]["content"]


def test_the_request_schemas_match_what_the_gateway_accepts(schema):
    components = schema["components"]["schemas"]
    chat = components["OpenAIChatCompletionRequest"]
    completion = components["OpenAICompletionRequest"]
    assert chat["additionalProperties"] is False and completion["additionalProperties"] is False
    for component, endpoint in ((chat, "chat.completions"), (completion, "completions")):
        documented = set(component["properties"])
        accepted = openai_fields.HONOURED[endpoint] | openai_fields.IGNORED
        assert accepted <= documented, accepted - documented
        # Every other documented field is one refused unless at its neutral value.
        assert documented - accepted <= set(openai_fields.REFUSED)
    assert chat["properties"]["top_logprobs"]["maximum"] == 20
    assert completion["properties"]["logprobs"]["maximum"] == 5


@pytest.mark.parametrize(
    ("field", "neutral"),
    [
        ("tools", []),
        ("tool_choice", "none"),
        ("response_format", {"type": "text"}),
        ("logit_bias", {}),
        ("modalities", ["text"]),
        ("presence_penalty", 0),
        ("parallel_tool_calls", None),
    ],
)
def test_a_refused_fields_documented_value_is_accepted(schema, field, neutral):
    props = schema["components"]["schemas"]["OpenAIChatCompletionRequest"]["properties"]
    assert "Not supported" in props[field]["description"]
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], field: neutral}
    assert parsing.parse_chat(body, apply_chat_template).model == "m"
    with pytest.raises(GatewayError):
        parsing.parse_chat(body | {field: "something else"}, apply_chat_template)
