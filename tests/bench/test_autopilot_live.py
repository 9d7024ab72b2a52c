"""The autopilot on a live emulated fleet, end to end (the control plane, Celery in-process,
real agents): a proposal asked for over REST is sized, an operator approves it, the apply
starts an instance on the spare node through its agent, and the gateway routes to it; every
answer is the emulated engine's. Floors make the proposal deterministic (two prefill nodes),
so this checks the path, not the planner's figures (bench/autopilot does those)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

from agents.node.launch import AgentProcess
from bench.autopilot import run as r
from bench.harness.control_plane import start_control_plane
from bench.harness.host import port_in_use

pytestmark = pytest.mark.slow

NODES = {"A": ("GPU-A", 2, "prefill"), "B": ("GPU-B", 1, "main_decode")}


class _Progress:
    done = failed = 0
    elapsed = 0.0

    def first(self) -> None:
        pass


@contextlib.contextmanager
def small_fleet(tmp_path: Path, first_port: int) -> Iterator[tuple]:
    """The embedded control plane and NODES' agents (auto-a-1 prefill and auto-b-1 main
    decode running, auto-a-2 spare): (control plane, nodes, served model id); every process
    stopped on the way out."""
    cp = start_control_plane(tmp_path)
    agents: dict[str, AgentProcess] = {}
    try:
        ports = (p for p in itertools.count(first_port) if not port_in_use("127.0.0.1", p))
        nodes, model = r.start_fleet(cp, ports, agents, NODES, parallel=3)
        yield cp, nodes, model
    finally:
        for proc in agents.values():
            proc.kill()
            proc.cleanup()
        cp.stop()


_batches = itertools.count()


def _send(cp, n: int) -> list[dict]:
    """n requests nearly at once, fresh prompts (another batch's differ from them)."""
    times = [0.05 * i for i in range(n)]
    prompts = [2_048 + 64 * i for i in range(n)]
    answers = [8] * n
    tag = f"b{next(_batches)}"
    return asyncio.run(r.replay(cp, times, prompts, answers, _Progress(), tag=tag))


def test_a_proposal_approved_over_rest_starts_an_instance_that_takes_traffic(tmp_path: Path):
    with small_fleet(tmp_path, 25000) as (cp, nodes, model):
        r._api(cp, "PATCH", "autopilot/settings/", {
            "served_model": model, "scenario": r.SCENARIO, "interval_s": 0,
            "floors": {"prefill": 2, "main_decode": 1, "relay_decode": 0},
        })  # fmt: skip
        first = _send(cp, 6)
        assert all(x.get("completed") and x.get("exact") for x in first), first
        proposal = r._api(cp, "POST", "autopilot/proposals/")
        proposal = r._api(cp, "GET", f"autopilot/proposals/{proposal['id']}/")
        assert proposal["status"] == "proposed", proposal
        assert [(c["action"], c["role"], c["hostname"]) for c in proposal["changes"]] == [
            ("start", "prefill", "auto-a-2")
        ]
        assert proposal["profile"]["requests"] >= 6
        decided = r._api(cp, "POST", f"autopilot/proposals/{proposal['id']}/approve/")
        assert decided["status"] in ("applying", "applied")
        cp.cluster.wait_for(
            lambda: r._api(cp, "GET", f"autopilot/proposals/{proposal['id']}/")["status"]
            == "applied",
            120, "the apply (the new instance running)",
        )  # fmt: skip
        running = [i for i in cp.get_all("instances") if i["actual_state"] == "running"]
        assert sorted(i["role"] for i in running) == ["main_decode", "prefill", "prefill"]
        new = next(i for i in running if i["node"] == nodes[1]["id"])
        cp.cluster.wait_for(lambda: _routed_to(cp, str(new["id"])), 60, "a request on the new P")
        events = [e["kind"] for e in cp.get_all("events") if e["kind"].startswith("autopilot.")]
        assert {"autopilot.approved", "autopilot.start", "autopilot.applied"} <= set(events)


def _routed_to(cp, instance_id: str) -> bool:
    """Send a few requests; True once one of the records names the new P."""
    batch = _send(cp, 4)
    assert all(x.get("completed") and x.get("exact") for x in batch), batch
    records = cp.get_all("requests")
    return any(rec.get("prefill_instance") == instance_id for rec in records)
