"""The OpenAI request fields the engine cannot honour get a 400 naming the field (never a
silently different answer), harmless ones are accepted, and every /v1 answer carries an
X-Request-Id: the client's when it sent a valid one (kept in the request record), else the
gateway's own."""

from __future__ import annotations

import pytest
from asgiref.sync import async_to_sync
from rest_framework.test import APIClient

from billing import services as billing
from billing.models import Tenant
from fleet import live as fleet_live
from fleet.choices import InstanceRole
from fleet.models import ServedModel
from pdd.tokenizer import apply_chat_template
from routing.gateway import parsing
from routing.gateway import run as gw_run
from routing.gateway.errors import GatewayError
from routing.models import RequestRecord
from tests.routing.gateway.test_route_around_the_dead import _one_dc_fleet

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}


def _parse(kind: str, extra: dict):
    if kind == "chat":
        return parsing.parse_chat(CHAT | extra, apply_chat_template)
    return parsing.parse_completion(COMPLETION | extra)


REFUSED = [
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("tool_choice", "required"),
    ("tool_choice", {"type": "function", "function": {"name": "f"}}),
    ("functions", [{"name": "f", "parameters": {}}]),
    ("function_call", "auto"),
    ("parallel_tool_calls", True),
    ("response_format", {"type": "json_object"}),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}),
    ("logit_bias", {"50256": -100}),
    ("audio", {"voice": "alloy", "format": "wav"}),
    ("modalities", ["text", "audio"]),
    ("prediction", {"type": "content", "content": "x"}),
    ("presence_penalty", 0.5),
    ("frequency_penalty", -1),
    ("reasoning_effort", "low"),
    ("best_of", 2),
    ("echo", True),
    ("suffix", "tail"),
]


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize(("field", "value"), REFUSED)
def test_a_field_the_engine_cannot_honour_is_a_400_naming_it(kind, field, value):
    with pytest.raises(GatewayError) as err:
        _parse(kind, {field: value})
    body = err.value.body()["error"]
    assert err.value.status == 400
    assert (body["param"], body["type"], body["code"]) == (
        field,
        "invalid_request_error",
        "unsupported_parameter",
    )
    assert field in body["message"]


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize(
    "extra",
    [
        {"tools": [], "tool_choice": "none", "functions": None, "function_call": "none"},
        {"response_format": {"type": "text"}, "logit_bias": {}, "modalities": ["text"]},
        {"presence_penalty": 0, "frequency_penalty": 0.0, "best_of": 1, "echo": False},
        {"suffix": "", "parallel_tool_calls": None, "n": 1},
        {"user": "u-1", "metadata": {"a": "b"}, "store": False, "service_tier": "auto"},
    ],
)
def test_neutral_values_and_harmless_fields_are_accepted(kind, extra):
    assert _parse(kind, extra).model == "m"


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_an_unknown_field_is_a_400_naming_it(kind):
    with pytest.raises(GatewayError) as err:
        _parse(kind, {"top_k": 5})
    assert (err.value.status, err.value.param, err.value.code) == (
        400,
        "top_k",
        "unknown_parameter",
    )


def test_n_above_one_keeps_its_clear_400():
    with pytest.raises(GatewayError) as err:
        _parse("chat", {"n": 2})
    assert (err.value.status, err.value.param) == (400, "n")


@pytest.mark.parametrize(
    ("kind", "extra", "expected"),
    [
        ("chat", {}, None),
        ("chat", {"logprobs": False}, None),
        ("chat", {"logprobs": True}, 0),
        ("chat", {"logprobs": True, "top_logprobs": 0}, 0),
        ("chat", {"logprobs": True, "top_logprobs": 20}, 20),
        ("completion", {}, None),
        ("completion", {"logprobs": None}, None),
        ("completion", {"logprobs": 0}, 0),
        ("completion", {"logprobs": 5}, 5),
    ],
)
def test_the_logprobs_count_is_parsed(kind, extra, expected):
    assert _parse(kind, extra).logprobs == expected


@pytest.mark.parametrize(
    ("kind", "extra", "param"),
    [
        ("chat", {"logprobs": 3}, "logprobs"),
        ("chat", {"logprobs": "yes"}, "logprobs"),
        ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("chat", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ("chat", {"logprobs": True, "top_logprobs": 2.5}, "top_logprobs"),
        ("chat", {"top_logprobs": 2}, "top_logprobs"),
        ("chat", {"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
        ("completion", {"logprobs": 6}, "logprobs"),
        ("completion", {"logprobs": -1}, "logprobs"),
        ("completion", {"logprobs": True}, "logprobs"),
        ("completion", {"top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_logprobs_out_of_range_is_a_400_naming_the_field(kind, extra, param):
    with pytest.raises(GatewayError) as err:
        _parse(kind, extra)
    assert (err.value.status, err.value.param) == (400, param)


# -- X-Request-Id ----------------------------------------------------------------------------


@pytest.fixture
def fleet(transactional_db, settings, monkeypatch):
    settings.REDIS_URL = ""
    _one_dc_fleet(("p", InstanceRole.PREFILL), ("md", InstanceRole.MAIN_DECODE))

    async def events(url, plan):
        for i, token in enumerate(b"ok"):
            yield {"type": "token", "index": i, "token_id": token, "role": "md"}
        yield {"type": "done", "finish_reason": "length", "stats": {}}

    monkeypatch.setattr(gw_run, "run_events", events)
    tenant = Tenant.objects.create(name="acme", requests_per_minute=3, tokens_per_minute=10**6)
    _, raw = billing.api_key_create(tenant=tenant)
    yield raw
    fleet_live._memory.clear()


def _client(raw: str | None, request_id: str | None = None) -> APIClient:
    client = APIClient()
    headers = {}
    if raw:
        headers["HTTP_AUTHORIZATION"] = f"Bearer {raw}"
    if request_id is not None:
        headers["HTTP_X_REQUEST_ID"] = request_id
    client.credentials(**headers)
    return client


def _post(client: APIClient, path: str = "/v1/completions", **extra):
    body = {"model": "baton-tiny", "prompt": "hi", "max_tokens": 2} | extra
    return client.post(path, body, format="json")


def test_a_success_echoes_the_clients_request_id_and_records_it(fleet):
    response = _post(_client(fleet, "trace-42"))
    assert response.status_code == 200, response.content
    assert response["X-Request-Id"] == "trace-42"
    record = RequestRecord.objects.get()
    assert record.client_request_id == "trace-42"
    assert record.request_id == response.json()["id"]


def test_without_a_client_id_the_answer_carries_the_gateways_id(fleet):
    response = _client(fleet).post(
        "/v1/chat/completions",
        {"model": "baton-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        format="json",
    )
    assert response.status_code == 200
    assert response["X-Request-Id"] == response.json()["id"]
    assert response["X-Request-Id"].startswith("chatcmpl-")
    assert RequestRecord.objects.get().client_request_id == ""


def test_a_stream_carries_the_request_id(fleet):
    response = _post(_client(fleet, "stream-1"), stream=True)
    assert response.status_code == 200
    assert response["X-Request-Id"] == "stream-1"

    async def read() -> bytes:
        return b"".join([chunk async for chunk in response.streaming_content])

    assert async_to_sync(read)().endswith(b"data: [DONE]\n\n")
    assert RequestRecord.objects.get().client_request_id == "stream-1"


@pytest.mark.parametrize("bad", ["x" * 129, "tab\there", "caf\u00e9", "   "])
def test_an_invalid_client_id_is_ignored_for_the_gateways(fleet, bad):
    response = _post(_client(fleet, bad))
    assert response.status_code == 200
    assert response["X-Request-Id"] == response.json()["id"]
    assert RequestRecord.objects.get(request_id=response.json()["id"]).client_request_id == ""


def test_errors_carry_the_request_id(fleet):
    # 401: no key
    response = _post(_client(None, "e-401"))
    assert (response.status_code, response["X-Request-Id"]) == (401, "e-401")
    assert _post(_client(None))["X-Request-Id"].startswith("cmpl-")
    # 400: a refused field
    response = _post(_client(fleet, "e-400"), tools=[{"type": "function"}])
    assert (response.status_code, response["X-Request-Id"]) == (400, "e-400")
    assert response.json()["error"]["param"] == "tools"
    # 404: unknown model
    response = _post(_client(fleet, "e-404"), model="nope")
    assert (response.status_code, response["X-Request-Id"]) == (404, "e-404")
    # 405
    response = _client(fleet, "e-405").get("/v1/completions")
    assert (response.status_code, response["X-Request-Id"]) == (405, "e-405")
    # /v1/models, with and without a key
    assert _client(fleet, "m-1").get("/v1/models")["X-Request-Id"] == "m-1"
    response = _client(None).get("/v1/models")
    assert response.status_code == 401 and response["X-Request-Id"].startswith("req-")


def test_a_429_carries_the_request_id(fleet):
    client = _client(fleet, "rl")
    for _ in range(3):
        assert _post(client).status_code == 200
    response = _post(client)
    assert (response.status_code, response["X-Request-Id"]) == (429, "rl")


def test_a_503_carries_the_request_id_of_its_record(transactional_db, settings):
    settings.REDIS_URL = ""
    ServedModel.objects.create(
        name="baton-tiny", source="baton-tiny", num_layers=4, kv_bytes_per_token=4096
    )
    tenant = Tenant.objects.create(name="acme")
    _, raw = billing.api_key_create(tenant=tenant)
    response = _post(_client(raw))
    assert response.status_code == 503
    record = RequestRecord.objects.get()
    assert response["X-Request-Id"] == record.request_id
    response = _post(_client(raw, "mine"))
    assert response["X-Request-Id"] == "mine"
    assert RequestRecord.objects.get(client_request_id="mine").status == "rejected"


def test_the_request_api_shows_and_filters_the_client_id(fleet, django_user_model):
    _post(_client(fleet, "find-me"))
    _post(_client(fleet))
    admin = django_user_model.objects.create_superuser("root", "r@example.com", "pw")
    api = APIClient()
    api.force_authenticate(admin)
    rows = api.get("/api/v1/requests/", {"client_request_id": "find-me"}).json()
    rows = rows["results"] if isinstance(rows, dict) else rows
    assert [r["client_request_id"] for r in rows] == ["find-me"]


def test_body_limit_answers_carry_the_request_id_too(settings):
    """The 413 / 408 / 400 the body limits give before any view runs (controlplane/limits.py):
    the ASGI guard and the Django middleware."""
    import asyncio

    from django.test import RequestFactory

    from controlplane.limits import BodyGuard, BodyLimitMiddleware

    settings.BATON_MAX_BODY_BYTES = 10

    def guard(headers):
        sent: list[dict] = []

        async def receive():
            return {"type": "http.request", "body": b"x", "more_body": False}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "path": "/v1/completions", "headers": headers}
        asyncio.run(BodyGuard(None)(scope, receive, send))
        return sent[0]["status"], dict(sent[0]["headers"])[b"x-request-id"]

    too_long = (b"content-length", b"11")
    assert guard([too_long, (b"x-request-id", b"abc")]) == (413, b"abc")
    status, rid = guard([too_long])
    assert status == 413 and rid.startswith(b"cmpl-")

    middleware = BodyLimitMiddleware(lambda request: None)
    request = RequestFactory().post(
        "/v1/chat/completions", b"x" * 11, content_type="application/json", HTTP_X_REQUEST_ID="q"
    )
    response = middleware(request)
    assert (response.status_code, response["X-Request-Id"]) == (413, "q")
    request = RequestFactory().post("/v1/chat/completions", b"x" * 11, "application/json")
    assert middleware(request)["X-Request-Id"].startswith("chatcmpl-")
