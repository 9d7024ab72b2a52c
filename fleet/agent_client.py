"""HTTP client the control plane uses to command node agents (see agents/PROTOCOL.md).

Before every call the node's endpoint is checked again against the agent endpoint policy
(fleet.endpoints), its name resolved afresh, and the connection goes to the address that was
checked: a DNS answer that changed since registration (rebinding) is caught, and the command
token is never sent to an address the policy refuses. Redirects are never followed, and proxy
variables in the environment are not used (the check would not see where a proxy connects).
"""

from __future__ import annotations

import functools
import ssl
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
from django.core.exceptions import ValidationError

from fleet.endpoints import AgentTarget, resolve_agent_endpoint
from fleet.models import Node
from fleet.pinning import PinnedTransport, resolved_endpoints


class AgentError(Exception):
    """An agent answered with an error, or could not be reached."""


class AgentUnreachable(AgentError):
    """Connection refused, timed out or reset: worth retrying later."""


class AgentNotRegistered(AgentError):
    """The node has no registered endpoint; there is nobody to call."""


class AgentEndpointRefused(AgentError):
    """The node's endpoint is one the control plane may not call (fleet.endpoints): nothing was
    sent, and retrying will not help until the agent registers elsewhere or the policy changes."""


class AgentEndpointUnresolvable(AgentUnreachable):
    """The endpoint's name did not resolve just now: like an unreachable agent, worth a retry."""


@functools.cache
def tls_context() -> ssl.SSLContext:
    """One TLS context for every call the control plane makes to agents. httpx builds one per
    client (loading the CA bundle); with a client per node per reconcile and probe run that was
    the largest CPU item of an idle embedded control plane (py-spy, bench/gateway/REPORT.md)."""
    return httpx.create_ssl_context()


def health_answers(
    endpoints: Sequence[str], timeout_s: float
) -> list[httpx.Response | httpx.HTTPError]:
    """``GET /health`` of each agent endpoint, concurrently (16 at a time), through the pinned
    transport (fleet.pinning: only an address the endpoint policy checked is connected to): per
    endpoint, in order, its answer or the error that stood for one. Callers judge the answers
    by their own rules (the health check, the gateway's probe)."""
    if not endpoints:
        return []
    transport = PinnedTransport(httpx.HTTPTransport(verify=tls_context()), resolved_endpoints)

    def ask(client: httpx.Client, endpoint: str) -> httpx.Response | httpx.HTTPError:
        try:
            return client.get(f"{endpoint.rstrip('/')}/health")
        except httpx.HTTPError as exc:
            return exc
        except Exception as exc:  # noqa: BLE001 - a bad endpoint is that endpoint's answer
            return httpx.TransportError(f"{type(exc).__name__}: {exc}")

    with (
        httpx.Client(timeout=timeout_s, transport=transport, trust_env=False) as client,
        ThreadPoolExecutor(max_workers=min(16, len(endpoints))) as pool,
    ):
        return list(pool.map(lambda endpoint: ask(client, endpoint), endpoints))


class AgentClient:
    """Calls exactly the endpoint the node registered, with the command token it was given."""

    def __init__(self, node: Node, *, timeout_s: float = 5.0, transport=None) -> None:
        if node.registered_at is None or not node.agent_endpoint:
            raise AgentNotRegistered(f"node {node.hostname} has not registered an agent endpoint")
        headers = {"Authorization": f"Bearer {node.command_token}"} if node.command_token else {}
        self.node = node
        self._http = httpx.Client(
            headers=headers,
            timeout=timeout_s,
            # An explicit transport also keeps httpx from routing through $HTTP(S)_PROXY.
            transport=transport
            if transport is not None
            else httpx.HTTPTransport(verify=tls_context()),
            follow_redirects=False,
            trust_env=False,
        )

    def __enter__(self) -> AgentClient:
        return self

    def __exit__(self, *exc) -> None:
        self._http.close()

    def _target(self, method: str, path: str) -> AgentTarget:
        """The endpoint checked now (re-resolved: no cache), or the AgentError saying why not."""
        endpoint = self.node.agent_endpoint
        try:
            return resolve_agent_endpoint(endpoint)
        except ValidationError as exc:
            reason = " ".join(exc.messages)
            what = f"{self.node.hostname}: {method} {path}: not calling {endpoint}: {reason}"
            if exc.code == "unresolvable":
                raise AgentEndpointUnresolvable(what) from None
            raise AgentEndpointRefused(what) from None

    def _call(self, method: str, path: str, json: dict | None = None) -> dict[str, Any]:
        # Connect to the address just checked; a name goes in Host (and TLS SNI, which is
        # also the name the certificate is verified against).
        url, headers, extensions = self._target(method, path).request_parts(path)
        try:
            response = self._http.request(
                method, url, json=json, headers=headers, extensions=extensions
            )
        except (httpx.ConnectError, httpx.TimeoutException, httpx.RemoteProtocolError) as exc:
            raise AgentUnreachable(f"{self.node.hostname}: {method} {path}: {exc}") from exc
        if 300 <= response.status_code < 400:
            location = response.headers.get("location", "")
            raise AgentError(
                f"{self.node.hostname}: {method} {path}: agent answered a redirect "
                f"(HTTP {response.status_code}{' to ' + location[:200] if location else ''}); "
                "agent calls never follow redirects"
            )
        if response.status_code >= 500:
            raise AgentUnreachable(
                f"{self.node.hostname}: {method} {path}: HTTP {response.status_code}"
            )
        if response.status_code >= 400:
            raise AgentError(
                f"{self.node.hostname}: {method} {path}: HTTP {response.status_code} "
                f"{response.text[:300]}"
            )
        return response.json() if response.content else {}

    def state(self) -> dict[str, Any]:
        return self._call("GET", "/state")

    def start_instance(
        self,
        *,
        instance_id: int,
        role: str,
        model: str,
        source: str,
        dtype: str | None = None,
        gpu: dict[str, Any] | None = None,
    ) -> dict:
        """PUT the instance; `dtype` (the served model's) is left out when None, so the agent
        uses its own --dtype. `gpu`: the GPU unit the instance runs on (gpu_unit), which an
        emulated instance takes its step times from."""
        body: dict[str, Any] = {"role": role, "model": model, "source": source}
        if dtype is not None:
            body["dtype"] = dtype
        if gpu is not None:
            body["gpu"] = gpu
        return self._call("PUT", f"/instances/{instance_id}", body)

    def drain_instance(self, *, instance_id: int) -> dict:
        return self._call("POST", f"/instances/{instance_id}/drain")

    def stop_instance(self, *, instance_id: int) -> dict:
        return self._call("DELETE", f"/instances/{instance_id}")

    def set_link(
        self, *, peer_datacenter: str, bandwidth_gbps: float, rtt_ms: float, pool_size: int
    ) -> dict:
        return self._call(
            "PUT",
            f"/links/{peer_datacenter}",
            {"bandwidth_gbps": bandwidth_gbps, "rtt_ms": rtt_ms, "pool_size": pool_size},
        )
