"""Fixtures for the agent-process tests: agents started as real processes on loopback (own
process groups, killed in teardown)."""

from __future__ import annotations

import pytest
from agent_node_helpers import pdd_agents


@pytest.fixture(scope="module")
def cluster():
    """P and RLD in dc-a, MD in dc-b (1 Gbit/s, 5 ms), and one engine for `single`."""
    with pdd_agents() as agents:
        yield agents
