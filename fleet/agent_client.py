"""HTTP client the control plane uses to command node agents (see agents/PROTOCOL.md)."""

from __future__ import annotations

from typing import Any

import httpx

from fleet.models import Node


class AgentError(Exception):
    """An agent answered with an error, or could not be reached."""


class AgentUnreachable(AgentError):
    """Connection refused, timed out or reset: worth retrying later."""


class AgentNotRegistered(AgentError):
    """The node has no registered endpoint; there is nobody to call."""


class AgentClient:
    """Calls exactly the endpoint the node registered, with the command token it was given."""

    def __init__(self, node: Node, *, timeout_s: float = 5.0, transport=None) -> None:
        if node.registered_at is None or not node.agent_endpoint:
            raise AgentNotRegistered(f"node {node.hostname} has not registered an agent endpoint")
        headers = {"Authorization": f"Bearer {node.command_token}"} if node.command_token else {}
        self.node = node
        self._http = httpx.Client(
            base_url=node.agent_endpoint.rstrip("/"),
            headers=headers,
            timeout=timeout_s,
            transport=transport,
        )

    def __enter__(self) -> AgentClient:
        return self

    def __exit__(self, *exc) -> None:
        self._http.close()

    def _call(self, method: str, path: str, json: dict | None = None) -> dict[str, Any]:
        try:
            response = self._http.request(method, path, json=json)
        except (httpx.ConnectError, httpx.TimeoutException, httpx.RemoteProtocolError) as exc:
            raise AgentUnreachable(f"{self.node.hostname}: {method} {path}: {exc}") from exc
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

    def start_instance(self, *, instance_id: int, role: str, model: str, source: str) -> dict:
        return self._call(
            "PUT", f"/instances/{instance_id}", {"role": role, "model": model, "source": source}
        )

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
