"""Idle data-plane connections are closed by the caller, never by the agent as the caller
reuses one: the agent's server keeps an idle connection longer than the gateway's and the
agents' pools keep it (pdd/dataplane.py). With both at 5 s a gateway's call to an MD went out
on a connection the agent was closing and failed the request (``ReadError``)."""

from __future__ import annotations

import asyncio

from agents.node.serve import server_config
from pdd.dataplane import CLIENT_IDLE_S, SERVER_IDLE_S


async def _app(scope, receive, send):  # pragma: no cover - never called
    raise AssertionError


def _pool_expiry(client) -> float:
    transport = client._transport
    transport = getattr(transport, "inner", transport)  # the gateway's pinned transport
    if hasattr(transport, "keepalive_s"):  # the gateway's aiohttp transport
        return transport.keepalive_s
    return transport._pool._keepalive_expiry


def test_agent_server_outlasts_its_callers_pools(settings):
    from routing.gateway import runner

    config = server_config(_app)
    assert config.timeout_keep_alive >= SERVER_IDLE_S - 1
    assert config.timeout_keep_alive > 2 * CLIENT_IDLE_S
    runner._client = None
    try:
        assert _pool_expiry(runner.http_client()) == CLIENT_IDLE_S
    finally:
        client, runner._client = runner._client, None
        asyncio.run(client.aclose())


def test_peer_agents_pool_drops_idle_connections_first():
    from agents.node.agent import Agent
    from agents.node.settings import AgentSettings

    async def scenario():
        agent = Agent(AgentSettings(block_size=16, num_blocks=16))
        try:
            return _pool_expiry(agent.http)
        finally:
            await agent.http.aclose()

    assert asyncio.run(scenario()) == CLIENT_IDLE_S
