"""The ASGI handler's middleware (controlplane/middleware.py): on the gateway's path no hook
leaves the event loop and the page-only middleware does not run; pages keep sessions, CSRF
and the security headers; ``settings.MIDDLEWARE`` still names Django's classes."""

from __future__ import annotations

import asyncio
import threading

import pytest
from django.conf import settings
from django.contrib.sessions.middleware import SessionMiddleware
from django.middleware.csrf import CsrfViewMiddleware
from django.middleware.security import SecurityMiddleware

from controlplane.middleware import ASYNC_MIDDLEWARE, ASGIHandler


def _call(app, path: str, method: str = "GET", body: bytes = b""):
    sent: list[dict] = []
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        if messages:
            return messages.pop()
        await asyncio.sleep(3600)

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"localhost"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
        "client": ("127.0.0.1", 1234),
        "server": ("127.0.0.1", 8000),
    }

    async def run():
        loop_thread = threading.get_ident()
        await asyncio.wait_for(app(scope, receive, send), 30)
        return loop_thread

    loop_thread = asyncio.run(run())
    start = sent[0]
    headers = {k.decode().lower(): v.decode() for k, v in start["headers"]}
    return loop_thread, start["status"], headers


@pytest.fixture
def recorded(monkeypatch):
    """Which thread ran each hook, by hook name."""
    seen: dict[str, list[int]] = {}

    def record(cls, name):
        original = getattr(cls, name)

        def hook(self, *args, **kwargs):
            seen.setdefault(f"{cls.__name__}.{name}", []).append(threading.get_ident())
            return original(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, hook)

    record(SecurityMiddleware, "process_request")
    record(SecurityMiddleware, "process_response")
    record(SessionMiddleware, "process_request")
    record(CsrfViewMiddleware, "process_view")
    return seen


def test_settings_name_djangos_own_middleware():
    # Django's system checks (check --deploy, the admin's) look for these names.
    for name in ASYNC_MIDDLEWARE:
        assert name in settings.MIDDLEWARE


@pytest.mark.django_db(transaction=True)
def test_a_gateway_request_runs_its_middleware_on_the_event_loop(recorded):
    loop_thread, status, headers = _call(ASGIHandler(), "/v1/chat/completions", "POST", b"{}")
    assert status == 401  # no API key: the view ran and answered
    assert headers["x-content-type-options"] == "nosniff"  # SecurityMiddleware ran
    assert headers["x-frame-options"] == "DENY"
    assert recorded["SecurityMiddleware.process_request"] == [loop_thread]
    assert recorded["SecurityMiddleware.process_response"] == [loop_thread]
    assert "SessionMiddleware.process_request" not in recorded  # pages only
    assert "CsrfViewMiddleware.process_view" not in recorded


@pytest.mark.django_db(transaction=True)
def test_a_page_keeps_sessions_csrf_and_the_security_headers(recorded):
    loop_thread, status, headers = _call(ASGIHandler(), "/login/")
    assert status == 200
    assert "csrftoken=" in headers["set-cookie"]  # CSRF ran and set its cookie
    assert headers["content-security-policy"] == settings.BATON_CSP
    assert headers["x-frame-options"] == "DENY"
    assert "SessionMiddleware.process_request" in recorded
    assert "CsrfViewMiddleware.process_view" in recorded
    # The security middleware does no I/O: inline on every path.
    assert recorded["SecurityMiddleware.process_request"] == [loop_thread]


@pytest.mark.django_db(transaction=True)
def test_a_page_post_without_a_csrf_token_is_still_refused():
    _, status, _ = _call(ASGIHandler(), "/login/", "POST", b"username=a&password=b")
    assert status == 403


def test_the_body_limit_answers_under_asgi(settings):
    settings.BATON_MAX_BODY_BYTES = 1
    _, status, headers = _call(ASGIHandler(), "/v1/completions", "POST", b"{}")
    assert status == 413
    assert headers["x-request-id"]


def test_the_served_application_uses_the_lean_handler():
    from controlplane import asgi

    assert isinstance(asgi.django_http, ASGIHandler)


@pytest.mark.django_db(transaction=True)
def test_the_request_signals_of_a_gateway_request_run_on_the_event_loop():
    from django.core import signals

    threads: dict[str, int] = {}

    def started(**_):
        threads["started"] = threading.get_ident()

    def finished(**_):
        threads["finished"] = threading.get_ident()

    signals.request_started.connect(started)
    signals.request_finished.connect(finished)
    try:
        loop_thread, status, _ = _call(ASGIHandler(), "/v1/chat/completions", "POST", b"{}")
        assert status == 401
        assert threads == {"started": loop_thread, "finished": loop_thread}
        threads.clear()
        page_loop, status, _ = _call(ASGIHandler(), "/login/")
        assert status == 200
        # A page's signals run where its sync view and middleware ran: Django's own way.
        assert threads["started"] != page_loop and threads["finished"] != page_loop
    finally:
        signals.request_started.disconnect(started)
        signals.request_finished.disconnect(finished)


def test_a_gateway_client_that_leaves_cancels_the_view(monkeypatch):
    """As in Django's handler: a disconnect before the answer cancels the view."""
    from routing.gateway import views

    cancelled = []

    async def slow(request, kind):
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    monkeypatch.setattr(views, "_handle", slow)
    messages = [
        {"type": "http.request", "body": b"{}", "more_body": False},
        {"type": "http.disconnect"},
    ]
    sent: list[dict] = []

    async def receive():
        message = messages.pop(0)
        if message["type"] == "http.disconnect":
            await asyncio.sleep(0.2)
        return message

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"localhost"), (b"content-length", b"2")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 8000),
    }
    asyncio.run(asyncio.wait_for(ASGIHandler()(scope, receive, send), 10))
    assert cancelled == [True]
    assert sent == []  # nothing was answered to a client that left
