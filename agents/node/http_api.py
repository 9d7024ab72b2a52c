"""The agent's HTTP API (starlette), built from a route table: health, state and operator
commands from agents/PROTOCOL.md (http_commands.py), and the data plane (`/v1/generate`,
`/v1/pdd/*`, http_data.py) that streams NDJSON token events. Each route names its guard: open,
the command token, or the data-plane token."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from agents.node import http_commands as cmd
from agents.node import http_data as data
from agents.node.agent import Agent
from agents.node.errors import AgentError
from agents.node.http_common import bearer_ok, error

Handler = Callable[[Agent, Request], Awaitable[Response]]

OPEN = "open"  # no token: /health and /metrics
COMMAND = "command"  # the command token the control plane returned at registration
DATA = "data"  # the fleet's data-plane token, once registered

ROUTES: list[tuple[str, str, str, Handler]] = [
    ("GET", "/health", OPEN, cmd.health),
    ("GET", "/state", COMMAND, cmd.state),
    ("GET", "/metrics", OPEN, cmd.metrics),
    ("PUT", "/instances/{instance_id}", COMMAND, cmd.put_instance),
    ("DELETE", "/instances/{instance_id}", COMMAND, cmd.delete_instance),
    ("POST", "/instances/{instance_id}/drain", COMMAND, cmd.drain_instance),
    ("GET", "/instances/{instance_id}/cache", COMMAND, cmd.instance_cache),
    ("POST", "/instances/{instance_id}/warm", COMMAND, cmd.warm_instance),
    ("PUT", "/links/{peer}", COMMAND, cmd.put_link),
    ("POST", "/v1/generate", DATA, data.generate),
    ("POST", "/v1/pdd/generate", DATA, data.pdd_generate),
    ("POST", "/v1/pdd/reserve", DATA, data.pdd_reserve),
    ("POST", "/v1/pdd/decode", DATA, data.pdd_decode),
    ("POST", "/v1/pdd/relay", DATA, data.pdd_relay),
    ("POST", "/v1/pdd/attach", DATA, data.pdd_attach),
    ("POST", "/v1/pdd/release", DATA, data.pdd_release),
    ("POST", "/v1/pdd/cancel", DATA, data.pdd_cancel),
    ("GET", "/v1/pdd/requests/{request_id}", DATA, data.pdd_request),
]


def build_app(agent: Agent) -> Starlette:
    return Starlette(routes=[route(agent, *entry) for entry in ROUTES])


def route(agent: Agent, method: str, path: str, guard: str, handler: Handler) -> Route:
    async def endpoint(request: Request) -> Response:
        return await serve(guard, handler, agent, request)

    return Route(path, endpoint, methods=[method])


async def serve(guard: str, handler: Handler, agent: Agent, request: Request) -> Response:
    """Check the route's guard, then run its handler; an AgentError becomes its JSON error."""
    if guard == COMMAND and not bearer_ok(request, agent.command_token):
        return error(401, "missing or wrong command token (Authorization: Bearer)")
    if guard == DATA:
        if agent.settings.control_plane and not agent.registered:
            # Nobody routes here before the control plane knows this agent, and its answer
            # may carry the fleet's data-plane token: refuse until then.
            return error(503, "not registered with the control plane yet")
        if not bearer_ok(request, agent.data_token):
            return error(401, "missing or wrong data-plane token (Authorization: Bearer)")
    if guard == OPEN:
        return await handler(agent, request)
    try:
        return await handler(agent, request)
    except AgentError as exc:
        return error(exc.status, exc.message, exc.field, exc.code)
