"""MD's heartbeat carries the prefix blocks of the KV in flight to it (`incoming_prefix_blocks`),
which routing counts as held there, as MD's own `reserve` does (agents/PROTOCOL.md, "KV in
flight"). Driven in process on a real baton-tiny engine, as test_agent_kv_in_flight.py is."""

from __future__ import annotations

import asyncio

from agent_node_helpers import make_prompt

from agents.node.agent import Agent
from agents.node.pipelines import reserve_prefix
from agents.node.settings import AgentSettings
from pdd.prefix import prefix_block_hashes

BS = 16


def run(coro_fn):
    """Run coro_fn(agent, inst) against an agent with one baton-tiny MD instance "0"."""

    async def main():
        agent = Agent(AgentSettings(block_size=BS, num_blocks=256))
        try:
            inst = await agent.instances.put("0", "main_decode", "baton-tiny", "baton-tiny", 120)
            await asyncio.wait_for(inst.ready.wait(), 120)
            assert inst.worker is not None, inst.error
            return await asyncio.wait_for(coro_fn(agent, inst), 120)
        finally:
            await agent.close()

    return asyncio.run(main())


def _md_item(doc: dict) -> dict:
    (item,) = [i for i in doc["instances"] if i["instance_id"] == "0"]
    return item


async def _incoming(agent: Agent) -> list[str]:
    return _md_item(await agent.reporting.report(link_use=False))["incoming_prefix_blocks"]


def test_the_heartbeat_carries_the_blocks_of_the_kv_in_flight_to_md():
    p1 = make_prompt(70, 1)  # 4 whole blocks
    p2 = p1 + make_prompt(40, 2)  # shares them, 6 whole blocks
    other = make_prompt(33, 3)  # 2 whole blocks

    async def scenario(agent: Agent, inst):
        assert (
            _md_item(await agent.reporting.report(link_use=False))["incoming_prefix_blocks"] == []
        )
        await reserve_prefix(agent, inst, "t1", p1)
        item = _md_item(await agent.reporting.report(link_use=False))
        # The same chain hashes the gateway computes for the prompt (pdd/prefix.py).
        assert item["incoming_prefix_blocks"] == list(prefix_block_hashes(p1, BS))
        assert item["kv_events"]["digest"]["blocks"] == 0  # nothing has landed yet
        await reserve_prefix(agent, inst, "t2", p2)
        await reserve_prefix(agent, inst, "o", other)
        blocks = await _incoming(agent)
        # Newest request first; a block shared by two prompts is listed once.
        assert blocks == [*prefix_block_hashes(other, BS), *prefix_block_hashes(p2, BS)]
        # Bounded: at most `limit` hashes.
        assert agent.kv_flight.incoming_block_hashes("0", limit=3) == blocks[:3]
        assert agent.kv_flight.incoming_block_hashes("no-such-instance") == []
        # A reservation dropped (cancelled, expired, imported) leaves the report and the memo.
        for rid in ("t2", "o"):
            await agent.kv_flight.unreserve(rid)
        assert _md_item(await agent.reporting.report(link_use=False))[
            "incoming_prefix_blocks"
        ] == list(prefix_block_hashes(p1, BS))
        assert set(agent.kv_flight._incoming_blocks) == {"t1"}
        await agent.kv_flight.unreserve("t1")
        assert (
            _md_item(await agent.reporting.report(link_use=False))["incoming_prefix_blocks"] == []
        )
        assert agent.kv_flight._incoming_blocks == {}

    run(scenario)


def test_only_main_decode_instances_report_incoming_blocks():
    async def main():
        agent = Agent(AgentSettings(block_size=BS, num_blocks=256))
        try:
            inst = await agent.instances.put("r", "relay_decode", "baton-tiny", "baton-tiny", 120)
            await asyncio.wait_for(inst.ready.wait(), 120)
            (item,) = (await agent.reporting.report(link_use=False))["instances"]
            return item
        finally:
            await agent.close()

    assert "incoming_prefix_blocks" not in asyncio.run(main())
