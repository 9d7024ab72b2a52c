"""Fixtures for the agent-process tests: agents started as real processes on loopback (own
process groups, killed in teardown)."""

from __future__ import annotations

import pytest
from agent_node_helpers import FAST_LINK, agent_args, running

from agents.node.launch import AgentProcess


@pytest.fixture(scope="module")
def cluster():
    """P and RLD in dc-a, MD in dc-b (1 Gbit/s, 5 ms), and one engine for `single`."""
    with running(
        AgentProcess(agent_args("main_decode", "dc-b", "--link", f"dc-a={FAST_LINK}"), "md"),
        AgentProcess(agent_args("prefill", "dc-a", "--link", f"dc-b={FAST_LINK}"), "p"),
        AgentProcess(agent_args("relay_decode", "dc-a", "--link", f"dc-b={FAST_LINK}"), "rld"),
        AgentProcess(agent_args("main_decode", "dc-a"), "single"),
    ) as (md, p, rld, single):
        yield {"md": md, "p": p, "rld": rld, "single": single}
