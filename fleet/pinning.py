"""Calls to agent endpoints that go only where the endpoint policy looked (DNS rebinding).

An agent endpoint's name is checked against the policy (fleet.endpoints) when it is registered,
but a DNS answer can change afterwards: a name that resolved to 10.0.0.5 then may resolve to
169.254.169.254 now. So before a connection is made the name is resolved again, every address
it resolves to is checked, and the connection goes to the checked address (pinned): the
request's URL names that address while its ``Host`` header, and for https the TLS server name
(SNI, which the certificate is also verified against), stay the endpoint's name. Nothing is
looked up a second time between the check and the connect.

``AgentTarget.request_parts`` (fleet.endpoints) says how a call is pinned; the control plane's
agent client (fleet.agent_client) pins its commands with it, resolving before every call. The
gateway's data-plane calls, the agent probe and the admissions' recovery go through the
transports below, which pin every request they send with the same function and keep each
answer for ``BATON_AGENT_RESOLVE_TTL_S`` seconds (default 5; 0: resolve before every request),
so a name is re-resolved every few seconds rather than trusted for ever, and a gateway under
load does not resolve before each of thousands of requests a second. An IP literal is only
checked (the policy may have changed), never resolved, and its request is sent as it is.

A refused endpoint (``EndpointRefused``) or a name that does not resolve
(``EndpointUnresolvable``) is an ``httpx.ConnectError`` (``EndpointNotCalled``), raised before
any connection is opened: callers that handle an agent they cannot reach handle it the same
way (the gateway fails over to another instance and marks this one suspect, the probe marks it
dead). Each refusal is logged once per resolution (at most once per endpoint every TTL).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
from django.conf import settings
from django.core.exceptions import ValidationError

from fleet.endpoints import AgentTarget, resolve_agent_endpoint

log = logging.getLogger(__name__)

DEFAULT_TTL_S = 5.0
MAX_ENTRIES = 4096  # endpoints remembered (a fleet's agents); the expired ones go first


class EndpointNotCalled(httpx.ConnectError):
    """The request was not sent: no connection was opened, no token went out."""


class EndpointRefused(EndpointNotCalled):
    """The policy refuses the endpoint, or an address its name resolves to now."""


class EndpointUnresolvable(EndpointNotCalled):
    """The endpoint's name did not resolve just now (possibly a passing DNS failure)."""


@dataclass(frozen=True, slots=True)
class _Answer:
    expires: float
    target: AgentTarget | None = None
    reason: str = ""  # why refused, when target is None
    unresolvable: bool = False


def _is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


class ResolvedEndpoints:
    """Checked endpoints by base URL (``scheme://host[:port]``), each kept for ``ttl_s``."""

    def __init__(
        self, ttl_s: float | None = None, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._ttl_s = ttl_s
        self._clock = clock
        self._answers: dict[str, _Answer] = {}
        self._lock = threading.Lock()
        # Lookups under way on an event loop, so that concurrent requests to one endpoint whose
        # answer expired wait for one lookup instead of each starting its own.
        self._pending: dict[str, asyncio.Future[_Answer]] = {}

    @property
    def ttl_s(self) -> float:
        if self._ttl_s is not None:
            return self._ttl_s
        return float(getattr(settings, "BATON_AGENT_RESOLVE_TTL_S", DEFAULT_TTL_S))

    def clear(self) -> None:
        with self._lock:
            self._answers.clear()

    def _fresh(self, base: str) -> _Answer | None:
        answer = self._answers.get(base)
        if answer is not None and answer.expires > self._clock():
            return answer
        return None

    def _resolve(self, base: str) -> _Answer:
        """Check `base` now (resolving its name) and keep the answer; never raises for a
        refused or unresolvable endpoint (the answer says so)."""
        try:
            target = resolve_agent_endpoint(base)
        except ValidationError as exc:
            reason = " ".join(exc.messages)
            unresolvable = exc.code == "unresolvable"
            log.warning("agent endpoint %s %s: %s", base,
                        "does not resolve" if unresolvable else "refused", reason)  # fmt: skip
            answer = _Answer(self._clock() + self.ttl_s, reason=reason, unresolvable=unresolvable)
        else:
            answer = _Answer(self._clock() + self.ttl_s, target=target)
        with self._lock:
            if len(self._answers) >= MAX_ENTRIES and base not in self._answers:
                now = self._clock()
                for key in [k for k, a in self._answers.items() if a.expires <= now]:
                    del self._answers[key]
                if len(self._answers) >= MAX_ENTRIES:
                    self._answers.pop(next(iter(self._answers)))
            self._answers[base] = answer
        return answer

    @staticmethod
    def _target(base: str, answer: _Answer, request: httpx.Request | None) -> AgentTarget:
        if answer.target is not None:
            return answer.target
        kind = EndpointUnresolvable if answer.unresolvable else EndpointRefused
        raise kind(f"not calling {base}: {answer.reason}", request=request)

    def lookup(self, base: str, request: httpx.Request | None = None) -> AgentTarget:
        """The checked endpoint (resolved at most ``ttl_s`` ago); EndpointRefused or
        EndpointUnresolvable (``request`` attached) otherwise. Blocks while a name is resolved
        (at most 2 s)."""
        answer = self._fresh(base) or self._resolve(base)
        return self._target(base, answer, request)

    async def alookup(self, base: str, request: httpx.Request | None = None) -> AgentTarget:
        """``lookup`` without blocking the event loop: a name is resolved on a thread."""
        answer = self._fresh(base)
        if answer is None:
            host = httpx.URL(base).host
            if _is_ip_literal(host):
                answer = self._resolve(base)  # nothing to look up: only the policy's check
            else:
                loop = asyncio.get_running_loop()
                pending = self._pending.get(base)
                if pending is None or pending.get_loop() is not loop:
                    pending = loop.run_in_executor(None, self._resolve, base)
                    self._pending[base] = pending
                    pending.add_done_callback(lambda done: self._forget(base, done))
                answer = await asyncio.shield(pending)
        return self._target(base, answer, request)

    def _forget(self, base: str, done: asyncio.Future) -> None:
        if self._pending.get(base) is done:
            del self._pending[base]


def _base(url: httpx.URL) -> str:
    return f"{url.scheme}://{url.netloc.decode('ascii')}"


def pin(request: httpx.Request, target: AgentTarget) -> None:
    """Point `request` at the address `target` checked: its URL, Host and TLS server name as
    ``AgentTarget.request_parts`` gives them (an IP literal's request is left as it is)."""
    if target.is_ip_literal:
        return
    url, headers, extensions = target.request_parts(request.url.raw_path.decode("ascii"))
    request.url = httpx.URL(url)
    request.headers.update(headers)
    request.extensions = {**request.extensions, **extensions}


class PinnedTransport(httpx.BaseTransport):
    """A transport that checks and pins every request before `inner` connects."""

    def __init__(self, inner: httpx.BaseTransport, endpoints: ResolvedEndpoints) -> None:
        self.inner = inner
        self.endpoints = endpoints

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        pin(request, self.endpoints.lookup(_base(request.url), request))
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.inner.close()


class AsyncPinnedTransport(httpx.AsyncBaseTransport):
    """The same for an async client: a name is resolved on a thread, not on the loop."""

    def __init__(self, inner: httpx.AsyncBaseTransport, endpoints: ResolvedEndpoints) -> None:
        self.inner = inner
        self.endpoints = endpoints

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        pin(request, await self.endpoints.alookup(_base(request.url), request))
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


# One per process: the gateway's data-plane client, the probe and the admissions' recovery
# share the answers.
resolved_endpoints = ResolvedEndpoints()
