"""Tenants, hashed API keys with a visible prefix, revocation, the ledger, and rate limits."""

from __future__ import annotations

import os
import uuid

import pytest

from billing import services
from billing.models import ApiKey, Tenant, UsageEntry
from billing.ratelimit import RateLimiter


@pytest.fixture
def tenant(db) -> Tenant:
    return Tenant.objects.create(name="acme", requests_per_minute=3, tokens_per_minute=100)


def test_api_key_is_shown_once_and_stored_hashed(tenant):
    key, raw = services.api_key_create(tenant=tenant, name="ci")
    assert raw.startswith(f"sk-baton-{key.prefix}-")
    assert raw not in key.digest
    assert services.api_key_authenticate(raw) == key


@pytest.mark.django_db(transaction=True)
def test_the_rename_to_digest_keeps_every_stored_key_working():
    """billing.0007 renames key_hash to digest (the name every hashed token has): a key
    issued before it still authenticates after it."""
    from django.db import connection
    from django.db.migrations.executor import MigrationExecutor

    from pdd import tokens

    before, after = ("billing", "0006_deleted_instance_runs"), ("billing", "0007_apikey_digest")
    executor = MigrationExecutor(connection)
    executor.migrate([before])
    old = executor.loader.project_state([before]).apps
    tenant = old.get_model("billing", "Tenant").objects.create(name="acme")
    raw = "sk-baton-0badc0de-" + "s" * 43
    old.get_model("billing", "ApiKey").objects.create(
        tenant=tenant, prefix="0badc0de", key_hash=tokens.digest(raw)
    )
    executor = MigrationExecutor(connection)
    executor.migrate([after])
    key = services.api_key_authenticate(raw)
    assert key is not None and key.digest == tokens.digest(raw)


@pytest.mark.parametrize(
    "raw", ["", "sk-baton-", "sk-baton-abcd", "Bearer x", "sk-baton-00000000-zzz"]
)
def test_malformed_or_unknown_keys_are_refused(tenant, raw):
    services.api_key_create(tenant=tenant)
    assert services.api_key_authenticate(raw) is None


def test_revoked_key_is_refused(tenant):
    key, raw = services.api_key_create(tenant=tenant)
    services.api_key_revoke(key=key)
    assert services.api_key_authenticate(raw) is None


def test_inactive_tenant_key_is_refused(tenant):
    _, raw = services.api_key_create(tenant=tenant)
    Tenant.objects.filter(pk=tenant.pk).update(active=False)
    assert services.api_key_authenticate(raw) is None


def test_usage_is_recorded_once_per_request_id(tenant):
    kwargs = dict(
        request_id="req-1",
        tenant=tenant,
        api_key=None,
        model="baton-tiny",
        prompt_tokens=100,
        cached_tokens=90,
        completion_tokens=7,
    )
    first, created = services.usage_record(**kwargs)
    again, created_again = services.usage_record(**{**kwargs, "completion_tokens": 999})
    assert (created, created_again) == (True, False)
    assert again.pk == first.pk
    assert UsageEntry.objects.get().completion_tokens == 7


def test_api_creates_a_key_and_shows_it_only_then(operator, tenant):
    created = operator.post("/api/v1/api-keys/", {"tenant": tenant.id, "name": "laptop"})
    assert created.status_code == 201, created.json()
    raw = created.json()["key"]
    assert services.api_key_authenticate(raw) is not None
    listed = operator.get("/api/v1/api-keys/").json()["results"]
    assert "key" not in listed[0]
    assert listed[0]["display"] == f"sk-baton-{created.json()['prefix']}-..."


def test_api_revokes_a_key(operator, tenant):
    key, raw = services.api_key_create(tenant=tenant)
    response = operator.post(f"/api/v1/api-keys/{key.id}/revoke/")
    assert response.status_code == 200
    assert response.json()["active"] is False
    assert services.api_key_authenticate(raw) is None


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({"name": "Bad Name"}, "name"),
        ({"name": "t", "requests_per_minute": 0}, "requests_per_minute"),
        ({"name": "t", "tokens_per_minute": -5}, "tokens_per_minute"),
    ],
)
def test_bad_tenant_fields_are_400(operator, payload, field):
    response = operator.post("/api/v1/tenants/", payload)
    assert response.status_code == 400
    assert field in response.json()
    assert Tenant.objects.count() == 0


def test_tenant_key_command_creates_tenant_and_prints_a_key(db, capsys):
    from django.core.management import call_command

    call_command("tenant_key", "newco", "--rpm", "5")
    raw = capsys.readouterr().out.strip()
    key = services.api_key_authenticate(raw)
    assert key.tenant.name == "newco"
    assert key.tenant.requests_per_minute == 5
    assert ApiKey.objects.count() == 1


# --- rate limits ------------------------------------------------------------------------------


def _exercise(limiter: RateLimiter, tenant: str) -> list[tuple[bool, str]]:
    now = 1_000_020.0  # 20 s into a minute window
    calls = [
        limiter.check(tenant=tenant, rpm=3, tpm=100, tokens=40, now=now),
        limiter.check(tenant=tenant, rpm=3, tpm=100, tokens=40, now=now + 1),
        limiter.check(tenant=tenant, rpm=3, tpm=100, tokens=40, now=now + 2),  # tokens: 120 > 100
        limiter.check(tenant=tenant, rpm=3, tpm=100, tokens=10, now=now + 3),
        limiter.check(tenant=tenant, rpm=3, tpm=100, tokens=1, now=now + 4),  # 4th request
        limiter.check(tenant=tenant, rpm=3, tpm=100, tokens=1, now=now + 60),  # next window
        limiter.check(tenant=tenant, rpm=3, tpm=100, tokens=500, now=now + 61),  # never fits
    ]
    return [(d.allowed, d.limit) for d in calls]


EXPECTED = [
    (True, ""),
    (True, ""),
    (False, "tokens"),
    (True, ""),
    (False, "requests"),
    (True, ""),
    (False, "tokens"),
]


def test_in_process_rate_limits_requests_and_tokens_per_minute():
    assert _exercise(RateLimiter(""), "acme") == EXPECTED


def test_refusal_says_when_to_retry():
    limiter = RateLimiter("")
    limiter.check(tenant="t", rpm=1, tpm=100, tokens=1, now=1_000_020.0)
    refused = limiter.check(tenant="t", rpm=1, tpm=100, tokens=1, now=1_000_030.0)
    assert refused.allowed is False
    assert refused.retry_after_s == pytest.approx(50.0)


@pytest.mark.redis
def test_redis_rate_limits_are_the_same_and_shared_between_limiters():
    prefix = f"test-rl-{uuid.uuid4().hex[:8]}"
    assert _exercise(RateLimiter(os.environ["REDIS_URL"], prefix=prefix), "acme") == EXPECTED
    # Two gateways share one budget: a second limiter sees the first one's count.
    first = RateLimiter(os.environ["REDIS_URL"], prefix=prefix + "b")
    second = RateLimiter(os.environ["REDIS_URL"], prefix=prefix + "b")
    assert first.check(tenant="x", rpm=1, tpm=10, tokens=1, now=5_000_000.0).allowed is True
    assert second.check(tenant="x", rpm=1, tpm=10, tokens=1, now=5_000_001.0).allowed is False


@pytest.mark.parametrize(
    ("status", "prompt", "billed"),
    [("ok", 5, True), ("cancelled", 5, True), ("interrupted", 5, True),
     ("rejected", 5, False), ("error", 5, False), ("ok", 0, False)],
)  # fmt: skip
def test_what_is_billed_is_billings_rule(status, prompt, billed):
    from billing.services import is_billed

    assert is_billed(status, prompt) is billed


@pytest.mark.django_db
def test_a_billed_request_s_line_is_its_key_s_tenant_s_and_an_unbilled_one_has_none():
    from billing.services import api_key_create, usage_line

    tenant = Tenant.objects.create(name="lines")
    key, _ = api_key_create(tenant=tenant)
    fields = {"request_id": "r1", "api_key": key, "model": "m", "prompt_tokens": 5,
              "cached_tokens": 2, "completion_tokens": 3}  # fmt: skip
    line = usage_line(status="cancelled", **fields)
    assert line is not None and line["tenant"] == tenant and line["api_key"] == key
    assert (line["prompt_tokens"], line["cached_tokens"], line["completion_tokens"]) == (5, 2, 3)
    assert usage_line(status="error", **fields) is None
