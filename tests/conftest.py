"""Suite-wide fixtures and the rules for tests that need real PostgreSQL or Redis.

Tests marked ``postgres`` or ``redis`` are skipped on the embedded defaults. When
``BATON_REQUIRE_SERVICES=1`` (as .ci/run sets) a missing service fails the test instead, so CI
cannot pass with the real-server tests silently skipped.
"""

from __future__ import annotations

import os

import pytest
from rest_framework.test import APIClient

# Importing the ASGI app must not start the in-process beat inside the test runner: tests
# call tasks themselves, deterministically. (Server subprocesses started by tests keep it.)
os.environ.setdefault("BATON_EMBEDDED_BEAT", "false")
try:
    from django.conf import settings as _settings

    if _settings.configured:
        _settings.BATON_EMBEDDED_BEAT = False
        # Connections close after each unit of work, as with Django's default: pool threads of
        # the gateway (routing.gateway.views.in_worker) then hold none when the test database
        # is dropped at the end of the session.
        _settings.DATABASES["default"]["CONN_MAX_AGE"] = 0
except ImportError:  # pragma: no cover
    pass

REQUIRE_SERVICES = os.environ.get("BATON_REQUIRE_SERVICES", "") in {"1", "true", "yes"}


def _redis_available() -> str | None:
    url = os.environ.get("REDIS_URL", "")
    if not url:
        return "REDIS_URL is not set"
    try:
        import redis

        redis.Redis.from_url(url, socket_connect_timeout=2).ping()
    except Exception as exc:  # any failure means the service is not usable
        return f"Redis at {url} is not reachable: {exc}"
    return None


def _postgres_available() -> str | None:
    url = os.environ.get("DATABASE_URL", "")
    if not url.startswith(("postgres://", "postgresql://", "pgsql://")):
        return "DATABASE_URL does not point at PostgreSQL"
    return None


def pytest_runtest_setup(item: pytest.Item) -> None:
    for marker, probe in (("postgres", _postgres_available), ("redis", _redis_available)):
        if item.get_closest_marker(marker) is None:
            continue
        reason = probe()
        if reason is None:
            continue
        if REQUIRE_SERVICES:
            pytest.fail(f"needs {marker} but {reason} (BATON_REQUIRE_SERVICES is set)")
        pytest.skip(reason)


# --- REST API clients per role --------------------------------------------------------------


def api_client(username: str, group: str | None) -> APIClient:
    """An API client authenticated as a new user in `group` ("operator", "viewer" or None)."""
    from django.contrib.auth.models import Group, User

    from controlplane.models import ApiToken

    user = User.objects.create_user(username=username)
    if group:
        user.groups.add(Group.objects.get(name=group))
    _, key = ApiToken.objects.issue(user=user, name="test")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {key}")
    return client


@pytest.fixture
def operator(db) -> APIClient:
    return api_client("olivia", "operator")


@pytest.fixture
def viewer(db) -> APIClient:
    return api_client("victor", "viewer")


@pytest.fixture
def anonymous(db) -> APIClient:
    return APIClient()


@pytest.fixture(autouse=True, scope="session")
def _own_admission_journal(tmp_path_factory):
    """The gateway's admission journal (routing/gateway/journal.py) in a folder of this test
    run's own: a journal left by another run must not be recovered into this run's database."""
    try:
        from django.conf import settings
    except Exception:  # noqa: BLE001 - Django not set up in this test run
        yield
        return
    settings.BATON_JOURNAL_DIR = tmp_path_factory.mktemp("journal")
    yield


@pytest.fixture(autouse=True)
def _fresh_gateway_caches():
    """The gateway keeps keys, models and the fleet's rows until their change counters move; a
    test's database is new, so nothing cached by an earlier test may answer for it."""
    yield
    try:
        from routing.caching import versions
    except Exception:  # noqa: BLE001 - Django not set up in this test run
        return
    versions.reset()
    # The prefix index: a test's instance ids may be an earlier test's (rolled back).
    from fleet import kv_index

    kv_index._index = None
