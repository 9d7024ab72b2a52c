"""Runs one routed request on the agents: a single streaming call to the chosen prefill agent,
which ships KV to the decode side and relays the ordered token stream back (agents/PROTOCOL.md,
data plane).

Every call through ``http_client()`` connects only to an address checked against the agent
endpoint policy just before (at most BATON_AGENT_RESOLVE_TTL_S ago), with the endpoint's name
kept as Host and TLS server name (fleet.pinning): a name whose DNS answer changed to a refused
address since registration (DNS rebinding) gets no connection and no data-plane token; the
attempt fails like an unreachable agent and the request goes to another instance."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
from django.conf import settings

from fleet.agent_client import tls_context
from fleet.pinning import (
    AsyncPinnedTransport,
    EndpointNotCalled,
    EndpointRefused,
    resolved_endpoints,
)
from pdd.dataplane import CLIENT_IDLE_S, bearer_headers
from pdd.events import ENGINE_FULL
from pdd.policy import Decision, Pipeline
from pdd.token_ids import to_wire
from routing.gateway.transport import AiohttpTransport
from routing.live import Endpoint, LiveView

# One client per process: connection pooling to the agents.
_client: httpx.AsyncClient | None = None


def http_client() -> httpx.AsyncClient:
    global _client
    if _client is None:
        # One connection per stream in flight: httpx's default pool (100 connections) made the
        # 101st concurrent stream wait, then fail with a pool timeout ("unreachable").
        _client = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=5.0, read=300.0, write=30.0, pool=30.0),
            # Checked and pinned before each connection; no proxy from the environment (the
            # check could not see where a proxy connects) and no redirect followed.
            transport=AsyncPinnedTransport(
                # aiohttp's connections behind httpx's API (routing/gateway/transport.py): a
                # pool per agent, and a third of httpcore's CPU per streamed token.
                AiohttpTransport(
                    ssl_context=tls_context(),
                    max_per_agent=settings.BATON_GATEWAY_MAX_AGENT_CONNECTIONS,
                    # Closed here before the agent would close it (pdd/dataplane.py).
                    keepalive_s=CLIENT_IDLE_S,
                ),
                resolved_endpoints,
            ),
            trust_env=False,
            follow_redirects=False,
        )
    return _client


def data_plane_headers() -> dict[str, str]:
    """The fleet's data-plane token, when one is set (BATON_DATA_TOKEN)."""
    return bearer_headers(settings.BATON_DATA_TOKEN)


class AgentRunError(Exception):
    """The agents could not run the request (unreachable, refused, failed mid-way).

    ``at_prefill``: P itself could not be reached or refused the call (True), or P's stream
    reported a failure further down the path (False). ``role`` (``md``, ``rld``): the decoding
    role that failed, when known (its stream's, or the one an agent's error event names);
    the gateway blames its instance (routes.implicated), never by the message's text."""

    def __init__(self, message: str, *, at_prefill: bool = True, role: str = "") -> None:
        super().__init__(message)
        self.at_prefill = at_prefill
        self.role = role


class AgentBusy(AgentRunError):
    """An engine on the path had no room for the request now (``engine_full``): capacity, not
    a fault. The gateway queues the request and routes it again; no instance is blamed."""


def _busy_body(detail: str) -> bool:
    try:
        body = json.loads(detail)
    except ValueError:
        return False
    return isinstance(body, dict) and body.get("code") == ENGINE_FULL


@dataclass(slots=True)
class Sampling:
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    logprobs: int | None = None  # alternatives per token; None: no logprobs (no cost)


def _target(endpoint: Endpoint | None) -> dict[str, Any] | None:
    if endpoint is None:
        return None
    target = {
        "instance": endpoint.instance_id,
        "http": endpoint.http,
        "kv_host": endpoint.kv_host,
        "kv_port": endpoint.kv_port,
        "datacenter": endpoint.datacenter,
    }
    if endpoint.wan_port:
        target["wan_port"] = endpoint.wan_port
    return target


def build_plan(
    *,
    request_id: str,
    prompt_ids: list[int],
    sampling: Sampling,
    decision: Decision,
    view: LiveView,
    early_first_token: bool = False,
) -> tuple[str, dict[str, Any]]:
    """The P agent's URL and the body of its /v1/pdd/generate call for this decision."""
    prefill = view.endpoints[decision.prefill_id]
    relay = view.endpoints.get(decision.relay_id) if decision.relay_id else None
    main = view.endpoints.get(decision.main_id) if decision.main_id else None
    pipeline = decision.pipeline
    body: dict[str, Any] = {
        "request_id": request_id,
        "instance": prefill.instance_id,
        # Packed (pdd.token_ids): a 64K-token list cost ~5 ms of JSON per agent call.
        "prompt_ids": to_wire(prompt_ids),
        "sampling": {
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "seed": sampling.seed,
        },
        "pipeline": pipeline,
    }
    if sampling.logprobs is not None:
        body["sampling"]["logprobs"] = sampling.logprobs
    if early_first_token:
        body["early_first_token"] = True
    if pipeline in (Pipeline.P_MD, Pipeline.P_RLD_MD):
        body["main"] = _target(main)
        fmt = view.kv_formats.get((prefill.datacenter, main.datacenter)) if main else None
        if fmt and body["main"] is not None:
            body["main"]["kv_format"] = fmt  # what the WAN link asks P to send MD
    if pipeline in (Pipeline.P_RLD_MD, Pipeline.RLD_ONLY):
        body["relay"] = _target(relay)
    if pipeline == Pipeline.P_RLD_MD:
        body["handoff_mode"] = decision.handoff_mode
        if decision.catch_up_batch:
            body["catch_up_batch"] = decision.catch_up_batch
    if settings.BATON_GATEWAY_DIRECT_STREAMS:
        body["direct"] = True
    return prefill.http.rstrip("/") + "/v1/pdd/generate", body


# Who a stream comes from, as failures name it (routes.implicated reads "MD" in a message).
AGENT_NAMES = {"prefill": "prefill agent", "md": "MD agent", "rld": "RLD agent"}


def continuation_target(plan: dict[str, Any], url: str, body: Any, role: str) -> str | None:
    """Why P's ``continue`` event may not be followed (None: it may): the decoder it names
    must be the one this request was routed to (``plan``'s ``main`` for MD, ``relay`` for
    RLD), so an agent cannot send the gateway's data-plane call anywhere else."""
    target = plan.get("main" if role == "md" else "relay")
    if not isinstance(target, dict):
        return f"no {role.upper()} on this request's path"
    base = str(target.get("http") or "").rstrip("/")
    if not base or not url.startswith(base + "/"):
        return f"the {role.upper()} stream {url[:200]!r} is not at {base!r}"
    if not isinstance(body, dict) or str(body.get("instance")) != str(target.get("instance")):
        return f"the {role.upper()} stream is not for instance {target.get('instance')}"
    return None


# Cancels in flight (held so that they are not collected before they ran).
_cancels: set = set()


def cancel_on_path(plan: dict[str, Any]) -> None:
    """Tell the decoders of a request's plan (its ``main`` and ``relay``) to let it go
    (``POST /v1/pdd/cancel``, idempotent), in the background: the stream P handed over ended
    without its ``done``. Failures are ignored (a dead agent has nothing to let go)."""
    rid = plan.get("request_id")
    targets = [plan.get(k) for k in ("main", "relay")]
    urls = [
        str(t["http"]).rstrip("/") + "/v1/pdd/cancel"
        for t in targets
        if isinstance(t, dict) and t.get("http")
    ]
    if not rid or not urls:
        return

    async def cancel(url: str) -> None:
        try:
            await http_client().post(
                url, json={"request_id": rid}, headers=data_plane_headers(), timeout=5.0
            )
        except Exception:  # noqa: BLE001 - best effort, as P's own cancels are
            pass

    for url in urls:
        task = asyncio.ensure_future(cancel(url))
        _cancels.add(task)
        task.add_done_callback(_cancels.discard)


async def run_events(
    url: str, body: dict[str, Any], *, source: str = "prefill"
) -> AsyncIterator[list[dict[str, Any]]]:
    """Yield an agent's NDJSON events, as lists: the events of one read from the socket
    together (a burst of tokens that arrived at once is relayed in one write to the client).
    ``source`` (``prefill``, ``md`` or ``rld``) is whose stream it is: a failure to open P's
    is ``at_prefill``. Closing the generator closes the stream, which the agents take as a
    cancellation."""
    name = AGENT_NAMES.get(source, f"{source} agent")
    at_prefill = source == "prefill"
    try:
        async with http_client().stream(
            "POST", url, json=body, headers=data_plane_headers()
        ) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:500]
                message = f"{name} answered HTTP {response.status_code}: {detail}"
                role = "" if at_prefill else source
                if response.status_code == 503 and _busy_body(detail):
                    raise AgentBusy(message, at_prefill=at_prefill, role=role)
                raise AgentRunError(message, at_prefill=at_prefill, role=role)
            rest = b""
            async for data in response.aiter_bytes():
                *lines, rest = (rest + data).split(b"\n")
                batch = [json.loads(line) for line in lines if line.strip()]
                if batch:
                    yield batch
            if rest.strip():
                yield [json.loads(rest)]
    except EndpointNotCalled as exc:  # nothing was sent: fails over as an unreachable agent
        what = "endpoint refused" if isinstance(exc, EndpointRefused) else "unreachable"
        raise AgentRunError(
            f"{name} {what}: {exc}", at_prefill=at_prefill, role="" if at_prefill else source
        ) from exc
    except httpx.HTTPError as exc:
        raise AgentRunError(
            f"{name} unreachable: {type(exc).__name__}: {exc}".rstrip(": "),
            at_prefill=at_prefill,
            role="" if at_prefill else source,
        ) from exc
