"""Operators' and viewers' API tokens: hashed at rest, named by a prefix, expiring, revocable."""

from __future__ import annotations

import hashlib
import importlib
from datetime import timedelta
from io import StringIO

import pytest
from django.contrib.auth.models import User
from django.core.management import CommandError, call_command
from django.db import connection
from django.test import Client
from django.utils import timezone
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from controlplane.models import PREFIX_LENGTH, ApiToken

pytestmark = pytest.mark.django_db

convert_migration = importlib.import_module("controlplane.migrations.0002_convert_drf_tokens")


def baton_user(*args: str) -> tuple[str, str]:
    out, err = StringIO(), StringIO()
    call_command("baton_user", *args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


def client_with(key: str, scheme: str = "Token") -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"{scheme} {key}")
    return client


def can_read(key: str, scheme: str = "Token") -> bool:
    return client_with(key, scheme).get("/api/v1/datacenters/").status_code == 200


def test_baton_user_prints_one_line_the_key():
    out, err = baton_user("ops", "--role", "operator")
    assert out.count("\n") == 1
    key = out.strip()
    assert key.startswith("bat_") and len(key) > 40
    assert "operator ops created" in err
    assert ApiToken.objects.get(user__username="ops").prefix in err


def test_the_database_holds_no_plaintext_key():
    key = baton_user("ops", "--role", "operator")[0].strip()
    secret = key[PREFIX_LENGTH:]
    table = ApiToken._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT * FROM {connection.ops.quote_name(table)}")
        rows = cursor.fetchall()
    assert len(rows) == 1
    for column in rows[0]:
        assert key not in str(column)
        assert secret not in str(column)
    token = ApiToken.objects.get()
    assert token.digest == hashlib.sha256(key.encode()).hexdigest()
    # Nor does DRF's plaintext table, nor any other text column of the database.
    assert Token.objects.count() == 0
    with connection.cursor() as cursor:
        for name in connection.introspection.table_names():
            cursor.execute(f"SELECT * FROM {connection.ops.quote_name(name)}")
            for row in cursor.fetchall():
                assert not any(secret in str(value) for value in row), name


def test_the_prefix_names_the_token_and_finds_it():
    key = baton_user("ops", "--role", "viewer", "--name", "laptop")[0].strip()
    token = ApiToken.objects.get(user__username="ops")
    assert token.prefix == key[:PREFIX_LENGTH]
    assert token.name == "laptop"
    out = StringIO()
    call_command("baton_tokens", "ops", stdout=out)
    listing = out.getvalue()
    assert token.prefix in listing and "laptop" in listing and "active" in listing
    assert key[PREFIX_LENGTH:] not in listing
    assert token.digest not in listing


def test_operator_token_writes_and_viewer_token_only_reads():
    operator_key = baton_user("ops", "--role", "operator")[0].strip()
    viewer_key = baton_user("view", "--role", "viewer")[0].strip()
    operator = client_with(operator_key)
    response = operator.post("/api/v1/datacenters/", {"name": "dc-q", "region": "r"})
    assert response.status_code == 201
    viewer = client_with(viewer_key)
    assert viewer.get("/api/v1/datacenters/").status_code == 200
    assert viewer.post("/api/v1/datacenters/", {"name": "dc-v", "region": "r"}).status_code == 403


def test_bearer_is_accepted_as_well():
    key = baton_user("ops", "--role", "viewer")[0].strip()
    assert can_read(key, "Bearer")
    assert can_read(key, "bearer")


def test_wrong_key_with_a_real_prefix_is_401():
    key = baton_user("ops", "--role", "viewer")[0].strip()
    response = client_with(key[:-1] + ("A" if key[-1] != "A" else "B")).get("/api/v1/nodes/")
    assert response.status_code == 401
    assert response["WWW-Authenticate"] == "Token"


def test_expired_token_is_401():
    user = User.objects.create_user("ops")
    token, key = ApiToken.objects.issue(user=user, expires_in=timedelta(days=1))
    assert can_read(key)
    ApiToken.objects.filter(pk=token.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    response = client_with(key).get("/api/v1/datacenters/")
    assert response.status_code == 401
    assert "token expired" in response.json()["detail"]
    assert response["WWW-Authenticate"] == "Token"


def test_expires_in_days_sets_the_expiry():
    baton_user("ops", "--role", "viewer", "--expires-in-days", "30")
    token = ApiToken.objects.get()
    expected = timezone.now() + timedelta(days=30)
    assert abs(token.expires_at - expected) < timedelta(minutes=1)
    with pytest.raises(CommandError, match="at least 1"):
        call_command("baton_user", "ops", "--expires-in-days", "0", stderr=StringIO())


def test_revoked_token_is_401():
    key = baton_user("ops", "--role", "operator")[0].strip()
    assert can_read(key)
    err = StringIO()
    call_command("baton_tokens", "--revoke", key[:PREFIX_LENGTH], stderr=err)
    assert "revoked" in err.getvalue()
    response = client_with(key).get("/api/v1/datacenters/")
    assert response.status_code == 401
    assert "token revoked" in response.json()["detail"]
    out = StringIO()
    call_command("baton_tokens", "ops", stdout=out)
    assert "revoked" in out.getvalue()


def test_inactive_user_is_401():
    key = baton_user("ops", "--role", "operator")[0].strip()
    User.objects.filter(username="ops").update(is_active=False)
    response = client_with(key).get("/api/v1/datacenters/")
    assert response.status_code == 401
    assert "inactive" in response.json()["detail"]


def test_rotate_token_invalidates_the_old_key():
    old = baton_user("ops", "--role", "operator")[0].strip()
    new, err = baton_user("ops", "--role", "operator", "--rotate-token")
    new = new.strip()
    assert new != old and "revoked 1 earlier" in err
    assert not can_read(old)
    assert can_read(new)


def test_rerun_without_rotate_issues_another_key_and_keeps_the_old_one():
    old = baton_user("ops", "--role", "operator")[0].strip()
    new, err = baton_user("ops", "--role", "operator")
    new = new.strip()
    assert new != old
    assert "operator ops updated" in err and "1 earlier API token(s) still work" in err
    assert can_read(old) and can_read(new)


def test_last_used_at_is_updated_at_most_once_a_minute():
    user = User.objects.create_user("ops")
    token, key = ApiToken.objects.issue(user=user)
    assert token.last_used_at is None
    assert can_read(key)
    token.refresh_from_db()
    first = token.last_used_at
    assert first is not None and timezone.now() - first < timedelta(minutes=1)
    assert can_read(key)
    token.refresh_from_db()
    assert token.last_used_at == first  # within the minute: not written again
    ApiToken.objects.filter(pk=token.pk).update(last_used_at=first - timedelta(minutes=2))
    assert can_read(key)
    token.refresh_from_db()
    assert token.last_used_at > first


def test_migration_converts_plaintext_drf_tokens():
    alice = User.objects.create_user("alice")
    created = timezone.now() - timedelta(days=100)
    # bulk_create: rows as an older Baton left them (no signal moves them).
    Token.objects.bulk_create([Token(key="0123456789abcdef0123456789abcdef01234567", user=alice)])
    Token.objects.filter(user=alice).update(created=created)
    old_key = "0123456789abcdef0123456789abcdef01234567"

    assert convert_migration.convert_plaintext_tokens(ApiToken, connection) == 1

    assert Token.objects.count() == 0
    token = ApiToken.objects.get(user=alice)
    assert token.prefix == old_key[:PREFIX_LENGTH]
    assert token.digest == hashlib.sha256(old_key.encode()).hexdigest()
    assert abs(token.created_at - created) < timedelta(seconds=1)
    assert can_read(old_key)
    # Run again: nothing left to convert.
    assert convert_migration.convert_plaintext_tokens(ApiToken, connection) == 0


def test_baton_tokens_converts_leftover_plaintext_rows():
    alice = User.objects.create_user("alice")
    Token.objects.bulk_create([Token(key="f" * 40, user=alice)])
    err = StringIO()
    call_command("baton_tokens", "--convert-drf", stderr=err)
    assert "converted 1" in err.getvalue()
    assert Token.objects.count() == 0
    assert can_read("f" * 40)


def test_drf_token_create_still_gives_a_working_key_but_stores_none():
    alice = User.objects.create_user("alice")
    drf_token = Token.objects.create(user=alice)
    drf_token.save()  # saved again: still one ApiToken, no plaintext row
    key = drf_token.key
    assert Token.objects.count() == 0
    token = ApiToken.objects.get(user=alice)
    assert token.prefix == key[:PREFIX_LENGTH] and key not in token.digest
    assert can_read(key)


def test_agent_token_is_refused_as_bearer_too():
    from fleet import services
    from fleet.models import Datacenter, GPUType

    dc = Datacenter.objects.create(name="dc-a", region="r")
    gpu = GPUType.objects.create(
        vendor="g",
        model="m",
        peak_bf16_tflops=1,
        memory_gib=1,
        memory_bandwidth_gbps=1,
        interconnect_gbps=1,
    )
    node, _ = services.node_create(hostname="a-1", datacenter=dc, gpu_type=gpu, gpu_count=1)
    agent_token = services.node_rotate_token(node=node)
    assert client_with(agent_token, "Bearer").get("/api/v1/nodes/").status_code == 401
    # And an operator's key is no agent credential.
    key = baton_user("ops", "--role", "operator")[0].strip()
    assert client_with(key, "AgentToken").post("/api/v1/agent/heartbeat", {}).status_code == 401


def test_schema_documents_the_api_token_scheme():
    response = APIClient().get("/api/schema/", {"format": "json"})
    assert response.status_code == 200
    schemes = response.json()["components"]["securitySchemes"]
    assert schemes["apiToken"]["in"] == "header"
    assert "tokenAuth" not in schemes


def test_admin_lists_tokens_without_digest_and_shows_a_new_key_once():
    admin_user = User.objects.create_superuser("root", password="pw-123456789")
    alice = User.objects.create_user("alice")
    token, _ = ApiToken.objects.issue(user=alice, name="laptop")
    client = Client()  # the admin takes forms, not the API's JSON
    client.force_login(admin_user)
    listing = client.get("/admin/controlplane/apitoken/").content.decode()
    assert token.prefix in listing and token.digest not in listing
    change = client.get(f"/admin/controlplane/apitoken/{token.pk}/change/").content.decode()
    assert token.digest not in change

    response = client.post(
        "/admin/controlplane/apitoken/add/",
        {"user": alice.pk, "name": "from-admin", "expires_at_0": "", "expires_at_1": ""},
        follow=True,
    )
    assert response.status_code == 200
    added = ApiToken.objects.get(name="from-admin")
    page = response.content.decode()
    shown = [word for word in page.split() if word.startswith(added.prefix + "_")]
    assert len(shown) == 1
    key = shown[0].split("<")[0]
    assert added.matches(key)
    assert can_read(key)
