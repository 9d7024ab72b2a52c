"""Gateway pieces that need no agent: request parsing, OpenAI error shapes, stop strings and
incremental detokenisation, authentication and limits before any agent is called."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from billing import services as billing
from billing.models import Tenant
from fleet.models import ServedModel
from pdd.tokenizer import ByteTokenizer, apply_chat_template
from routing.gateway import parsing
from routing.gateway.errors import GatewayError
from routing.gateway.stream import TextAssembler


def test_chat_body_becomes_a_request_with_defaults():
    req = parsing.parse_chat(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]}, apply_chat_template
    )
    assert (req.endpoint, req.model, req.max_tokens, req.stream) == (
        "chat.completions",
        "m",
        256,
        False,
    )
    assert req.prompt_text == "<|user|>\nhi\n<|assistant|>\n"


def test_completion_body_takes_max_tokens_and_stream_options():
    req = parsing.parse_completion(
        {
            "model": "m",
            "prompt": "abc",
            "max_tokens": 5,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    assert (req.max_tokens, req.stream, req.include_usage) == (5, True, True)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x"}, "model"),
        ({"model": "m", "prompt": ""}, "prompt"),
        ({"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"model": "m", "prompt": "x", "max_tokens": "5"}, "max_tokens"),
        ({"model": "m", "prompt": "x", "temperature": 3}, "temperature"),
        ({"model": "m", "prompt": "x", "top_p": -0.1}, "top_p"),
        ({"model": "m", "prompt": "x", "n": 2}, "n"),
        ({"model": "m", "prompt": "x", "stream": "yes"}, "stream"),
        ({"model": "m", "prompt": "x", "stop": [1]}, "stop"),
        ({"model": "m", "prompt": "x", "seed": 1.5}, "seed"),
    ],
)
def test_bad_completion_parameters_are_400_naming_the_parameter(body, param):
    with pytest.raises(GatewayError) as err:
        parsing.parse_completion(body)
    assert err.value.status == 400
    assert err.value.body()["error"]["param"] == param


def test_bad_chat_messages_are_400():
    with pytest.raises(GatewayError) as err:
        parsing.parse_chat(
            {"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, apply_chat_template
        )
    assert (err.value.status, err.value.param) == (400, "messages")


def test_invalid_json_is_400():
    with pytest.raises(GatewayError) as err:
        parsing.parse_json(b"{nope")
    assert err.value.status == 400
    assert err.value.body()["error"]["type"] == "invalid_request_error"


def _feed(assembler: TextAssembler, text: str) -> tuple[list[str], bool]:
    out = []
    for token in ByteTokenizer().encode(text):
        piece, stopped = assembler.push(token)
        if piece:
            out.append(piece)
        if stopped:
            return out, True
    tail = assembler.flush()
    if tail:
        out.append(tail)
    return out, False


def test_multibyte_characters_are_released_whole():
    pieces, stopped = _feed(TextAssembler(ByteTokenizer()), "h\u00e9\u20ac!")
    assert "".join(pieces) == "h\u00e9\u20ac!"
    assert all("\ufffd" not in p for p in pieces)
    assert stopped is False


def test_stop_string_ends_the_text_before_it():
    pieces, stopped = _feed(TextAssembler(ByteTokenizer(), stop=["END"]), "abc ENDxyz")
    assert "".join(pieces) == "abc "
    assert stopped is True


def test_partial_stop_prefix_is_released_when_it_does_not_complete():
    pieces, stopped = _feed(TextAssembler(ByteTokenizer(), stop=["END"]), "an ENigma")
    assert "".join(pieces) == "an ENigma"
    assert stopped is False


# --- through the HTTP endpoints, before any agent is involved ---------------------------------


@pytest.fixture
def tenant_key(transactional_db):
    tenant = Tenant.objects.create(name="acme", requests_per_minute=2, tokens_per_minute=10_000)
    ServedModel.objects.create(
        name="baton-tiny",
        source="baton-tiny",
        num_layers=4,
        kv_bytes_per_token=4096,
        max_context_tokens=512,
    )
    _, raw = billing.api_key_create(tenant=tenant)
    return raw


def _client(raw: str | None) -> APIClient:
    client = APIClient()
    if raw:
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    return client


def test_missing_key_is_401_in_openai_shape(tenant_key):
    response = _client(None).post(
        "/v1/completions", {"model": "baton-tiny", "prompt": "x"}, format="json"
    )
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "authentication_error"


def test_revoked_key_is_401(tenant_key):
    key = billing.api_key_authenticate(tenant_key)
    billing.api_key_revoke(key=key)
    response = _client(tenant_key).post(
        "/v1/completions", {"model": "baton-tiny", "prompt": "x"}, format="json"
    )
    assert response.status_code == 401


def test_unknown_model_is_404_model_not_found(tenant_key):
    response = _client(tenant_key).post(
        "/v1/completions", {"model": "gpt-9", "prompt": "x"}, format="json"
    )
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"


def test_prompt_over_the_context_is_400(tenant_key):
    response = _client(tenant_key).post(
        "/v1/completions",
        {"model": "baton-tiny", "prompt": "x" * 500, "max_tokens": 20},
        format="json",
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "max_tokens"


def test_no_healthy_path_is_503_and_recorded(tenant_key):
    from routing.models import RequestRecord

    response = _client(tenant_key).post(
        "/v1/completions", {"model": "baton-tiny", "prompt": "x"}, format="json"
    )
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "no_healthy_path"
    assert RequestRecord.objects.get().status == "rejected"


def test_over_the_request_rate_is_429_with_retry_after(tenant_key):
    client = _client(tenant_key)
    for _ in range(2):
        assert (
            client.post(
                "/v1/completions", {"model": "baton-tiny", "prompt": "x"}, format="json"
            ).status_code
            == 503
        )
    response = client.post("/v1/completions", {"model": "baton-tiny", "prompt": "x"}, format="json")
    assert response.status_code == 429
    assert response.json()["error"]["code"] == "rate_limit_exceeded"
    assert int(response["Retry-After"]) >= 1


def test_models_lists_served_models(tenant_key):
    body = _client(tenant_key).get("/v1/models").json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["baton-tiny"]


def test_the_gateway_sends_the_data_plane_token_to_the_agents(settings, monkeypatch):
    import asyncio

    import httpx

    from routing.gateway import runner

    seen: list[str | None] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("authorization"))
        return httpx.Response(200, content=b'{"type": "done", "finish_reason": "stop"}\n')

    monkeypatch.setattr(runner, "_client", httpx.AsyncClient(transport=httpx.MockTransport(answer)))

    async def run() -> list[dict]:
        return [e async for b in runner.run_events("http://agent/v1/pdd/generate", {}) for e in b]

    settings.BATON_DATA_TOKEN = ""
    assert asyncio.run(run())[-1]["type"] == "done"
    settings.BATON_DATA_TOKEN = "fleet-data-token-0123456789"
    asyncio.run(run())
    assert seen == [None, "Bearer fleet-data-token-0123456789"]


def test_the_rate_limiter_keys_live_under_the_configured_redis_prefix(settings):
    from routing.gateway import admission

    settings.REDIS_KEY_PREFIX = "tenant-a"
    admission._limiter = None
    assert admission.limiter().prefix == "tenant-a:rl"


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_pool_thread_does_not_keep_a_dead_or_expired_connection():
    import asyncio

    from django.db import connections

    from routing.gateway.workers import in_worker

    def query():
        connection = connections["default"]  # this pool thread's own wrapper, not the proxy
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        return connection

    wrapper = asyncio.run(in_worker(query)())
    # Past CONN_MAX_AGE (0 in tests) it is closed after the call, in the pool thread itself;
    # Django's request signals would only do this in the thread-sensitive thread.
    assert wrapper.connection is None

    def broken():
        from django.db import OperationalError

        connection = connections["default"]
        # The server ends this session (as a database restart would) under a persistent
        # connection: only its being unusable can close it.
        connection.ensure_connection()
        connection.close_at = None
        with pytest.raises(OperationalError), connection.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(pg_backend_pid())")
        return connection

    wrapper = asyncio.run(in_worker(broken)())
    assert wrapper.errors_occurred or wrapper.connection is None
    assert wrapper.connection is None


@pytest.fixture
def cached_key(transactional_db):
    tenant = Tenant.objects.create(name="acme", requests_per_minute=1000, tokens_per_minute=10**6)
    ServedModel.objects.create(
        name="baton-tiny", source="baton-tiny", num_layers=4, kv_bytes_per_token=4096
    )
    key, raw = billing.api_key_create(tenant=tenant)
    return key, _client(raw)


BODY = {"model": "baton-tiny", "prompt": "hi", "max_tokens": 1}


def test_keys_and_models_are_cached_and_a_change_elsewhere_lands_within_a_second(cached_key):
    """The hot path reads the key and the model from the database once and keeps them until
    their change counter moves; a change made by another process is seen within half a
    second. (No fleet here: an authenticated request gets 503, no healthy path.)"""
    import time

    from django.db import connection
    from django.test.utils import CaptureQueriesContext
    from django.utils import timezone

    from billing.models import ApiKey
    from routing.gateway import caches

    key, client = cached_key
    assert client.post("/v1/completions", BODY, format="json").status_code == 503
    with CaptureQueriesContext(connection) as queries:
        assert client.post("/v1/completions", BODY, format="json").status_code == 503
    tables = " ".join(q["sql"] for q in queries.captured_queries)
    assert "billing_apikey" not in tables and "fleet_servedmodel" not in tables
    # Revoked by another process: its save bumped the counter there (a queryset update sends
    # no signal here), so this process sees it at its next check of the counters.
    from django.db.models import F

    from routing.models import CacheVersion

    ApiKey.objects.filter(pk=key.pk).update(revoked_at=timezone.now())
    assert client.post("/v1/completions", BODY, format="json").status_code == 503  # cached
    CacheVersion.objects.filter(name="auth").update(version=F("version") + 1)
    time.sleep(caches.CHECK_EVERY_S + 0.05)
    assert client.post("/v1/completions", BODY, format="json").status_code == 401


def test_a_revocation_in_this_process_lands_at_once(cached_key):
    key, client = cached_key
    assert client.post("/v1/completions", BODY, format="json").status_code == 503
    billing.api_key_revoke(key=key)
    assert client.post("/v1/completions", BODY, format="json").status_code == 401


def test_every_answer_says_where_the_gateway_spent_its_time(cached_key):
    """Server-Timing: the stages of the gateway's own work, in milliseconds."""
    import re

    from routing.gateway.timing import Stopwatch

    watch = Stopwatch()
    watch.lap("auth")
    watch.lap("auth")
    watch.lap("route")
    assert list(watch.laps) == ["auth", "route"]
    assert re.fullmatch(r"auth;dur=\d+\.\d{3}, route;dur=\d+\.\d{3}", watch.header())


def test_released_text_is_the_whole_decode_for_any_text():
    """However the bytes fall, the pieces join to what the whole sequence decodes to, and the
    offsets the logprobs use are the whole decode's lengths."""
    import random

    rng = random.Random(7)
    alphabet = "ab \u00e9\u20ac\U0001f600xyz\n"
    tok = ByteTokenizer()
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
        assembler = TextAssembler(tok)
        pieces, lengths = [], []
        for token in tok.encode(text):
            piece, _ = assembler.push(token)
            pieces.append(piece)
            lengths.append(assembler.decoded_len)
        pieces.append(assembler.flush())
        assert "".join(pieces) == text
        ids = tok.encode(text)
        assert lengths == [len(tok.decode(ids[: i + 1])) for i in range(len(ids))]


def test_invalid_bytes_do_not_hold_the_text_back_for_ever():
    tok = ByteTokenizer()
    assembler = TextAssembler(tok)
    ids = [0xFF] * 40 + tok.encode("ok")
    out = "".join(assembler.push(i)[0] for i in ids) + assembler.flush()
    assert out == tok.decode(ids)


def test_a_leading_space_marker_tokenizer_streams_the_whole_decode(tmp_path):
    """Sentencepiece-style tokenizers drop the space marker of a sequence's first token; the
    window decode must not lose the spaces between words."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    from pdd.tokenizer import HFTokenizer

    words = ["\u2581hello", "\u2581world", "\u2581a", "\u2581b", "[UNK]", "</s>"]
    raw = RawTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Metaspace()
    path = tmp_path / "tokenizer.json"
    raw.save(str(path))
    tok = HFTokenizer(path)
    ids = [0, 1, 2, 3, 1, 0, 2]
    assembler = TextAssembler(tok)
    out = "".join(assembler.push(i)[0] for i in ids) + assembler.flush()
    assert out == tok.decode(ids) == "hello world a b world hello a"


def test_a_malformed_agent_event_fails_the_attempt_with_a_clear_error(monkeypatch):
    import asyncio

    from routing.gateway import run as gw_run
    from routing.gateway.runner import AgentRunError

    async def events(url, plan):
        yield {"type": "token", "index": 0, "token_id": "x"}

    monkeypatch.setattr(gw_run, "run_events", events)

    class P:
        url, plan, offset = "http://p", {}, 0

    run = gw_run.Run.__new__(gw_run.Run)
    run.p = P()
    run.token_count = run.offset = 0

    async def drain():
        async for _ in run._events():
            pass

    with pytest.raises(AgentRunError, match="malformed event.*token_id"):
        asyncio.run(drain())
