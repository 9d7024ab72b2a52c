"""``X-Request-Id`` on every /v1 answer.

A client may send its own ``X-Request-Id``: when it is 1 to 128 printable ASCII characters
(space to ``~``, surrounding spaces stripped) the gateway echoes it on the answer and keeps it
in the request record (``client_request_id``); any other value is ignored, not refused (a proxy's
malformed header must not fail the request), and the answer carries the gateway's own id. That
id (``chatcmpl-<hex>`` / ``cmpl-<hex>``, the body's ``id`` and the record's ``request_id``) is
made before anything else, so errors (401, 404, 429, 503, ...) carry one too.
"""

from __future__ import annotations

import functools
import re
import uuid

from django.http import HttpRequest

HEADER = "X-Request-Id"
MAX_LENGTH = 128
_PRINTABLE = re.compile(r"[\x20-\x7e]+")
_PREFIX = {"chat.completions": "chatcmpl", "completions": "cmpl"}


def valid_client_id(value: str | None) -> str:
    """`value` (an X-Request-Id header) when it is a valid client id, else ""."""
    raw = (value or "").strip()
    if not raw or len(raw) > MAX_LENGTH or not _PRINTABLE.fullmatch(raw):
        return ""
    return raw


def client_request_id(request: HttpRequest) -> str:
    """The client's X-Request-Id when valid, else ""."""
    return valid_client_id(request.headers.get(HEADER))


def answer_id(path: str, header: str | None) -> str:
    """The X-Request-Id of an answer given before any view runs (the body limits): the
    client's when valid, else a fresh gateway id for the path's kind."""
    kind = {"/v1/chat/completions": "chat.completions", "/v1/completions": "completions"}
    return valid_client_id(header) or new_request_id(kind.get(path.rstrip("/")))


def new_request_id(kind: str | None) -> str:
    return f"{_PREFIX.get(kind or '', 'req')}-{uuid.uuid4().hex}"


def mark(request: HttpRequest, **notes: str) -> None:
    """Note what the gateway learnt about a request on it (``baton_*`` attributes: its ids,
    its tenant and model for the error counters), read back with ``getattr``."""
    for name, value in notes.items():
        setattr(request, name, value)


def gateway_request_id(request: HttpRequest, kind: str | None = None) -> str:
    """The gateway's id for this request (made once, on first use)."""
    rid = getattr(request, "baton_request_id", None)
    if rid is None:
        rid = new_request_id(kind)
        mark(request, baton_request_id=rid)
    return rid


def with_request_id(kind: str | None = None):
    """Decorate an async /v1 view: the request gets its ids up front (``baton_request_id``,
    ``baton_client_request_id``) and every answer, error or not, ``X-Request-Id``."""

    def wrap(view):
        @functools.wraps(view)
        async def run(request: HttpRequest, *args, **kwargs):
            client = client_request_id(request)
            mark(request, baton_client_request_id=client)
            gateway = gateway_request_id(request, kind)
            response = await view(request, *args, **kwargs)
            response[HEADER] = client or gateway
            return response

        return run

    return wrap
