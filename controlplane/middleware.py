"""Django's middleware, without thread hops on the gateway's path.

Under ASGI Django runs each ``MiddlewareMixin`` hook (``process_request``, ``process_view``,
``process_response``) through ``sync_to_async``: a hop onto a thread and back, two or three per
middleware, about fifteen per request with the stack in ``controlplane/settings.py``, and a
middleware with only a sync ``__call__`` makes Django run the whole chain below it on one
thread. On a loaded machine every hop waits for a scheduler slot (measured: a gateway request
that fails fast took 1.2-1.8 ms with a free CPU and 7-8 ms with the CPUs busy, the difference
being the hops; bench/gateway/REPORT.md).

The wrappers here keep Django's behaviour and drop the hops:

- ``inline(cls)``: a middleware whose hooks do no I/O (security headers, the common
  redirects, X-Frame-Options) runs its hooks on the event loop, on every path.
- ``pages_only(cls)``: sessions, CSRF, authentication and messages serve the web UI and the
  REST API; the OpenAI-compatible gateway (``/v1/``) authenticates by API key and the agents'
  API (``/api/v1/agent/``) by agent token, their views are CSRF-exempt and never touch a
  session, so there these are skipped; elsewhere they run as Django runs them.

``settings.MIDDLEWARE`` names Django's own classes (its system checks, ``check --deploy``
included, look for them by name); ``ASGIHandler`` below, the one ``controlplane/asgi.py``
serves, builds its chain with each swapped for its wrapper (``ASYNC_MIDDLEWARE``). Under WSGI
(the test client, ``runserver``) the chain is Django's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
import weakref

from asgiref.sync import iscoroutinefunction, markcoroutinefunction, sync_to_async
from django.conf import settings
from django.core import signals
from django.core.exceptions import RequestAborted
from django.core.handlers.asgi import ASGIHandler as DjangoASGIHandler
from django.core.handlers.asgi import get_script_prefix
from django.urls import set_script_prefix
from django.utils.module_loading import import_string

from fleet import beats

GATEWAY_PREFIX = "/v1/"


# The agents' API (registration, heartbeats, KV cache events): authenticated by the node's
# agent token, CSRF-exempt, never a session; a thousand nodes beat there every 2 s.
AGENT_PREFIX = "/api/v1/agent/"


def is_gateway_path(path: str) -> bool:
    return path.startswith(GATEWAY_PREFIX)


def is_token_only_path(path: str) -> bool:
    """Paths whose callers authenticate by token alone: the page middleware skips them."""
    return path.startswith((GATEWAY_PREFIX, AGENT_PREFIX))


class _Wrapped:
    sync_capable = True
    async_capable = True
    inner_class: type
    on_gateway = True  # False: the gateway's path skips this middleware
    hops = True  # True: off the gateway's path, hooks run as Django runs them (threads)

    def __init__(self, get_response) -> None:
        self.get_response = get_response
        self.inner = self.inner_class(get_response)
        self.async_mode = iscoroutinefunction(get_response)
        if self.async_mode:
            markcoroutinefunction(self)
        # Django collects process_view from each middleware when it builds the chain.
        if hasattr(self.inner, "process_view"):
            self.process_view = self._aprocess_view if self.async_mode else self.inner.process_view

    def __repr__(self) -> str:
        return f"<{type(self).__qualname__} of {self.inner_class.__qualname__}>"

    def __call__(self, request):
        if not self.async_mode:
            return self.inner(request)
        return self.__acall__(request)

    async def __acall__(self, request):
        if not self.on_gateway and is_token_only_path(request.path_info):
            return await self.get_response(request)
        gateway = is_gateway_path(request.path_info)
        if self.hops and not gateway:
            return await self.inner.__acall__(request)
        inner = self.inner
        response = None
        if hasattr(inner, "process_request"):
            response = inner.process_request(request)
        response = response or await self.get_response(request)
        if hasattr(inner, "process_response"):
            response = inner.process_response(request, response)
        return response

    async def _aprocess_view(self, request, view, args, kwargs):
        if not self.on_gateway and is_token_only_path(request.path_info):
            return None
        gateway = is_gateway_path(request.path_info)
        if self.hops and not gateway:
            return await sync_to_async(self.inner.process_view, thread_sensitive=True)(
                request, view, args, kwargs
            )
        return self.inner.process_view(request, view, args, kwargs)


def _wrap(path: str, *, on_gateway: bool, hops: bool, prefix: str) -> type:
    cls = import_string(path)
    return type(
        f"{prefix}{cls.__name__}",
        (_Wrapped,),
        {
            "inner_class": cls,
            "on_gateway": on_gateway,
            "hops": hops,
            "__doc__": f"{path}, {prefix.lower()} (controlplane/middleware.py).",
            "__module__": __name__,
        },
    )


def inline(path: str) -> type:
    """``path``'s middleware with its hooks run on the event loop (they must do no I/O)."""
    return _wrap(path, on_gateway=True, hops=False, prefix="Inline")


def pages_only(path: str) -> type:
    """``path``'s middleware, skipped on the gateway's path, as Django runs it elsewhere."""
    return _wrap(path, on_gateway=False, hops=True, prefix="PagesOnly")


InlineSecurityMiddleware = inline("django.middleware.security.SecurityMiddleware")
InlineCommonMiddleware = inline("django.middleware.common.CommonMiddleware")
InlineXFrameOptionsMiddleware = inline("django.middleware.clickjacking.XFrameOptionsMiddleware")
PagesOnlySessionMiddleware = pages_only("django.contrib.sessions.middleware.SessionMiddleware")
PagesOnlyCsrfViewMiddleware = pages_only("django.middleware.csrf.CsrfViewMiddleware")
PagesOnlyAuthenticationMiddleware = pages_only(
    "django.contrib.auth.middleware.AuthenticationMiddleware"
)
PagesOnlyMessageMiddleware = pages_only("django.contrib.messages.middleware.MessageMiddleware")


ASYNC_MIDDLEWARE = {
    "django.middleware.security.SecurityMiddleware": InlineSecurityMiddleware,
    "django.middleware.common.CommonMiddleware": InlineCommonMiddleware,
    "django.middleware.clickjacking.XFrameOptionsMiddleware": InlineXFrameOptionsMiddleware,
    "django.contrib.sessions.middleware.SessionMiddleware": PagesOnlySessionMiddleware,
    "django.middleware.csrf.CsrfViewMiddleware": PagesOnlyCsrfViewMiddleware,
    "django.contrib.auth.middleware.AuthenticationMiddleware": PagesOnlyAuthenticationMiddleware,
    "django.contrib.messages.middleware.MessageMiddleware": PagesOnlyMessageMiddleware,
}
"""Django's middleware -> the wrapper the ASGI handler runs instead."""

_loading = threading.Lock()


class ASGIHandler(DjangoASGIHandler):
    """Django's ASGI handler, its middleware chain built from ``ASYNC_MIDDLEWARE``'s wrappers;
    on the gateway's path, Django's request signals sent on the event loop.

    Django sends ``request_started`` and, from ``response.close()``, ``request_finished``
    through ``sync_to_async``: two more hops per request, onto a thread made for the request.
    Their receivers (``close_old_connections``, ``reset_queries``, ``close_caches``,
    ``reset_urlconf``) tend the calling thread's database connections and caches; on the
    gateway's path no database work runs on the event loop's thread (the gateway's own
    threads tend their connections themselves, routing/gateway/workers.py), so there they run
    inline, with nothing to close. Elsewhere, where sync views use the request's thread, the
    handler is Django's."""

    async def handle(self, scope, receive, send):
        path = scope.get("path", "")
        if path.startswith(AGENT_PREFIX):
            return await self._agent(scope, receive, send)
        if not is_gateway_path(path):
            return await super().handle(scope, receive, send)
        try:
            body_file = await self.read_body(receive)
        except RequestAborted:
            return None
        set_script_prefix(get_script_prefix(scope))
        signals.request_started.send(sender=self.__class__, scope=scope)
        request, error_response = self.create_request(scope, body_file)
        try:
            if request is None:
                await self.send_response(error_response, send)
                error_response.close()
                return None
            await self._serve(request, receive, send)
        finally:
            body_file.close()
        return None

    async def _agent(self, scope, receive, send) -> None:
        """The agents' API: a heartbeat that repeats its node's last full one is taken on the
        event loop (fleet/beats.py); the rest is Django's, at most BATON_AGENT_API_CONCURRENCY
        at a time, so that a burst (a thousand agents registering after a restart) waits here
        rather than in threads holding the database pool's connections past its timeout; one
        that waited longer than BATON_AGENT_API_QUEUE_TIMEOUT_S is answered 503 (busy,
        Retry-After) instead of served after its agent stopped waiting."""
        began = time.monotonic()
        if scope.get("path") == HEARTBEAT_PATH and scope.get("method") == "POST":
            body, more = await _whole_body(receive)
            if not more:
                authorization = next(
                    (v for k, v in scope.get("headers", ()) if k == b"authorization"), b""
                )
                if beats.take(authorization, body):
                    await _answer_ok(send)
                    _note_slow_agent_call(scope, began, began, "fast path")
                    return
            receive = _replayed(body, more, receive)
        queued = time.monotonic()
        async with _agent_slots():
            if time.monotonic() - queued > float(settings.BATON_AGENT_API_QUEUE_TIMEOUT_S):
                # Its agent has likely given up on it (a 10-s client timeout) and will try
                # again: serving it now would only delay the requests queued behind it.
                await _answer_busy(send)
                return
            slot = time.monotonic()
            await super().handle(scope, receive, send)
        _note_slow_agent_call(scope, began, slot, "Django")

    async def _serve(self, request, receive, send) -> None:
        """The response, sent unless the client leaves first (its disconnect cancels the
        view, as in Django's handler); then closed, which sends ``request_finished``."""

        async def respond():
            response = await self.run_get_response(request)
            try:
                await self.send_response(response, send)
            except asyncio.CancelledError:
                pass  # the client left while the answer was going out
            return response

        serving = asyncio.create_task(respond())
        listening = asyncio.create_task(self.listen_for_disconnect(receive))
        await asyncio.wait((listening, serving), return_when=asyncio.FIRST_COMPLETED)
        if not listening.done():
            listening.cancel()
        with contextlib.suppress(asyncio.CancelledError, RequestAborted):
            await listening
        if not serving.done():
            serving.cancel()
        try:
            response = await serving
        except asyncio.CancelledError:
            signals.request_finished.send(sender=self.__class__)
            return
        response.close()

    def load_middleware(self, is_async: bool = False) -> None:
        if not is_async:
            return super().load_middleware(is_async)
        # Django's loader reads settings.MIDDLEWARE by path; for the moment it builds the
        # chain, the paths are the wrappers' (once per process, at start-up).
        with _loading:
            names = list(settings.MIDDLEWARE)
            settings.MIDDLEWARE = [_path(ASYNC_MIDDLEWARE.get(name)) or name for name in names]
            try:
                super().load_middleware(is_async)
            finally:
                settings.MIDDLEWARE = names
        return None


HEARTBEAT_PATH = AGENT_PREFIX + "heartbeat"


def _note_slow_agent_call(scope, began: float, slot: float, path: str) -> None:
    """Log an agents' API call this process took longer than BATON_AGENT_API_SLOW_S to answer
    (from the ASGI call to the answer), split into its wait for a slot and the rest, beside
    the event loop's own recent delay: where a late heartbeat spent its time here."""
    took = time.monotonic() - began
    if took < float(settings.BATON_AGENT_API_SLOW_S):
        return
    from pdd import looplag

    view = ""
    if "baton.view" in scope:  # fleet.api.agent.AgentView: when its view ran, and in the DB
        start, end, in_db = scope["baton.view"]
        view = (
            f"; the view began {start - slot:.2f} s after the slot and ran {end - start:.2f} s, "
            f"{in_db:.2f} s of it in database statements"
        )
    logging.getLogger("baton.agent_api").warning(
        "%s %s answered in %.2f s (%s; %.2f s waiting for a slot, %.2f s after it%s); the "
        "event loop's recent delay %.2f s",
        scope.get("method"), scope.get("path"), took, path, slot - began,
        time.monotonic() - slot, view, looplag.recent_s(10.0),
    )  # fmt: skip


# Per event loop (a semaphore binds to the loop it first waits on; tests run several).
_slots: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _agent_slots() -> asyncio.Semaphore:
    loop = asyncio.get_running_loop()
    slots = _slots.get(loop)
    if slots is None:
        slots = _slots[loop] = asyncio.Semaphore(max(1, int(settings.BATON_AGENT_API_CONCURRENCY)))
    return slots


async def _whole_body(receive) -> tuple[bytes, bool]:
    """The request's body (BodyGuard, outside, has bounded its size and time); `more` True
    when the client left first, so that Django sees the disconnect."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message.get("type") != "http.request":
            return b"".join(chunks), True
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks), False


def _replayed(body: bytes, more: bool, receive):
    """`receive` with the first message, already read, given back once."""
    first = [{"type": "http.request", "body": body, "more_body": more}]

    async def again():
        if first:
            return first.pop()
        return await receive()

    return again


async def _answer_busy(send) -> None:
    body = json.dumps(
        {"detail": "The control plane is busy; try again shortly.", "code": "busy"}
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 503,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"retry-after", b"1"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _answer_ok(send) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(beats.OK)).encode()),
                (b"x-content-type-options", b"nosniff"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": beats.OK})


def _path(cls: type | None) -> str | None:
    return f"{cls.__module__}.{cls.__qualname__}" if cls is not None else None
