"""Emulated fleets' agents for the benchmarks: start one agent process per declared node (each
with its node token, on its own port), wait until every instance runs, and read the nodes'
command tokens (what an agent's /state wants)."""

from __future__ import annotations

import json
import threading

from agents.node.launch import AgentProcess
from bench.harness.control_plane import ControlPlane

KV_SCALE = 100  # emulated KV on the wire: the real bytes / this (docs/emulation.md)


def start_agents(
    cp: ControlPlane,
    nodes: list[dict],
    agents: dict[str, AgentProcess],
    options: tuple[str, ...] = ("--kv-scale", str(KV_SCALE), "--log-level", "ERROR"),
    parallel: int = 8,
    control_plane_url: str = "",
) -> None:
    """Start every node's agent into `agents` (the caller stops them, also on failure), each
    with `options` besides its node, datacenter, ports, control plane (`control_plane_url`,
    else the control plane's own) and one thread; at most `parallel` start at once (Python
    start-up is CPU)."""
    errors: list[BaseException] = []
    gate = threading.Semaphore(parallel)

    def start(node: dict) -> None:
        proc = AgentProcess(
            [
                "--node",
                node["hostname"],
                "--datacenter",
                node["dc"],
                "--listen",
                f"127.0.0.1:{node['port']}",
                "--kv-listen",
                "127.0.0.1:0",
                "--wan-port",
                "0",
                "--control-plane",
                control_plane_url or cp.url,
                "--threads",
                "1",
                *options,
            ],  # fmt: skip
            node["hostname"],
            agents_per_host=len(nodes),
        )
        agents[node["hostname"]] = proc
        with gate:
            try:
                proc.start(timeout_s=300, env={"BATON_AGENT_TOKEN": node["agent_token"]})
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

    threads = [threading.Thread(target=start, args=(n,)) for n in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def all_running(cp: ControlPlane, expected: int) -> bool:
    rows = cp.get_all("instances")
    return len(rows) == expected and all(r["actual_state"] == "running" for r in rows)


COMMAND_TOKENS: dict[str, str] = {}  # node -> the command token its agent's /state wants


def command_tokens(cp: ControlPlane) -> dict[str, str]:
    """Every node's command token (what its agent's /state wants), read from the database."""
    code = (
        "import json; from fleet.models import Node; "
        "print(json.dumps(dict(Node.objects.values_list('hostname', 'command_token'))))"
    )
    return json.loads(cp.cluster.shell(code).strip().splitlines()[-1])


def load_command_tokens(cp: ControlPlane) -> None:
    COMMAND_TOKENS.update(command_tokens(cp))
