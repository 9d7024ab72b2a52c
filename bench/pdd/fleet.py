"""The three fleets on the local testbed, each built over the REST API with an operator token:
one control plane (uvicorn on the embedded defaults) and database for all of them, agents
started per fleet with the node tokens the API hands out, stopped before the next fleet.

Each fleet serves its own model name (baton-tiny-idc / -cdc / -pdd, all the built-in
baton-tiny), so the gateway's live view of one fleet never includes another's instances.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from agents.node.launch import AgentProcess
from bench.harness.control_plane import DEMO_POLICY, HEARTBEAT_S, ControlPlane
from bench.harness.testbed import free_port
from bench.pdd import scaling
from pdd.policy import PolicySettings

AGENT_NUM_BLOCKS = 4096  # 64K tokens of KV per engine (256 MiB): a few dozen sessions cached
NEVER_RELAY = {"wan_time_threshold_s": 1e9, "relay_when_main_saturated": False}


@dataclass(frozen=True)
class NodeSpec:
    host: str
    dc: str
    gpu: str
    role: str


@dataclass(frozen=True)
class SystemSpec:
    key: str  # idc-pd, cdc-pd, pdd
    label: str
    model: str
    datacenters: tuple[tuple[str, str, str], ...]  # (name, region, rdma domain)
    link: tuple[str, str, dict] | None  # None: one datacenter, no WAN (IDC-PD)
    nodes: tuple[NodeSpec, ...]
    policy: dict

    def policy_settings(self) -> dict:
        return PolicySettings.from_dict(
            {
                **PolicySettings().to_dict(),
                "kv_bytes_per_token": scaling.KV_BYTES_PER_TOKEN,
                **self.policy,
            }
        ).to_dict()


SYSTEMS: dict[str, SystemSpec] = {
    "idc-pd": SystemSpec(
        "idc-pd",
        "IDC-PD",
        "baton-tiny-idc",
        (("idc-a", "city-a", "idc-a"),),
        None,  # P and MD in one datacenter: the KV goes over its intra-DC fabric
        (
            NodeSpec("idc-p", "idc-a", "gpu-a", "prefill"),
            NodeSpec("idc-md", "idc-a", "gpu-a", "main_decode"),
        ),
        NEVER_RELAY,
    ),
    "cdc-pd": SystemSpec(
        "cdc-pd",
        "CDC-PD",
        "baton-tiny-cdc",
        (("cdc-a", "city-a", "cdc-a"), ("cdc-b", "city-b", "cdc-b")),
        ("cdc-a", "cdc-b", scaling.WAN_LINK),
        (
            NodeSpec("cdc-p", "cdc-a", "gpu-a", "prefill"),
            NodeSpec("cdc-md", "cdc-b", "gpu-b", "main_decode"),
        ),
        NEVER_RELAY,
    ),
    "pdd": SystemSpec(
        "pdd",
        "PDD",
        "baton-tiny-pdd",
        (("pdd-a", "city-a", "pdd-a"), ("pdd-b", "city-b", "pdd-b")),
        ("pdd-a", "pdd-b", scaling.WAN_LINK),
        (
            NodeSpec("pdd-p", "pdd-a", "gpu-a", "prefill"),
            NodeSpec("pdd-rld", "pdd-a", "gpu-a", "relay_decode"),
            NodeSpec("pdd-md", "pdd-b", "gpu-b", "main_decode"),
        ),
        dict(DEMO_POLICY),
    ),
}


@dataclass
class Fleet:
    spec: SystemSpec
    cp: ControlPlane
    agents: dict[str, AgentProcess] = field(default_factory=dict)
    instances: dict[str, dict] = field(default_factory=dict)  # role -> instance row
    nodes: dict[str, dict] = field(default_factory=dict)  # host -> node row (+ agent_token)
    cost_rows: list[dict] = field(default_factory=list)
    command_tokens: dict[str, str] = field(default_factory=dict)
    model_id: int = 0
    log_dir: Path | None = None

    @property
    def cost_per_hour(self) -> float:
        return scaling.fleet_cost_per_hour(self.cost_rows)

    def host_of(self, role: str) -> str:
        return next(n.host for n in self.spec.nodes if n.role == role)

    # -- bring-up over REST -----------------------------------------------------------------

    def create(self) -> None:
        cp, spec = self.cp, self.spec
        dcs = {}
        for name, region, domain in spec.datacenters:
            dcs[name] = cp.post(
                "datacenters", {"name": name, "region": region, "rdma_domain": domain}
            )["id"]
        if spec.link is not None:
            src, dst, link = spec.link
            cp.post(
                "wan-links",
                {
                    "from_datacenter": dcs[src],
                    "to_datacenter": dcs[dst],
                    **link,
                    "monthly_cost": "0",
                },
            )
        prices: dict[tuple[str, str], float] = {}
        for node in spec.nodes:
            key = (node.gpu, node.dc)
            if key in prices:
                continue
            prices[key] = scaling.PRICES[node.gpu]
            cp.post(
                "unit-prices",
                {
                    "gpu_type": cp.gpu_types[node.gpu],
                    "datacenter": dcs[node.dc],
                    "price_per_gpu_hour": f"{prices[key]:.2f}",
                    "currency": "USD",
                    "effective_from": "2026-01-01T00:00:00Z",
                },
            )
        self.model_id = cp.post(
            "models",
            {
                "name": spec.model,
                "source": "baton-tiny",
                "num_layers": 4,
                "kv_bytes_per_token": scaling.KV_BYTES_PER_TOKEN,
                "max_context_tokens": scaling.MODEL_MAX_CONTEXT,
                "kv_block_size": 16,
            },
        )["id"]
        for node in spec.nodes:
            gpus = scaling.GPUS[node.role]
            port = free_port()
            row = cp.post(
                "nodes",
                {
                    "hostname": node.host,
                    "datacenter": dcs[node.dc],
                    "gpu_type": cp.gpu_types[node.gpu],
                    "gpu_count": gpus,
                    "agent_endpoint": f"http://127.0.0.1:{port}",
                },
            )
            row["port"] = port
            self.nodes[node.host] = row
        # Prefill first: a relay_decode instance needs a prefill in its datacenter.
        for node in sorted(spec.nodes, key=lambda n: n.role != "prefill"):
            gpus = scaling.GPUS[node.role]
            inst = cp.post(
                "instances",
                {
                    "role": node.role,
                    "node": self.nodes[node.host]["id"],
                    "served_model": self.model_id,
                    "gpu_count": gpus,
                },
            )
            self.instances[node.role] = inst
            self.cost_rows.append(
                {
                    "role": node.role,
                    "gpu_type": node.gpu,
                    "datacenter": node.dc,
                    "gpu_count": gpus,
                    "price_per_gpu_hour": prices[(node.gpu, node.dc)],
                }
            )
        cp.patch_policy(spec.policy_settings())

    def start_agents(self) -> None:
        errors: list[BaseException] = []

        def start(node: NodeSpec) -> None:
            row = self.nodes[node.host]
            proc = AgentProcess(
                [
                    "--node",
                    node.host,
                    "--datacenter",
                    node.dc,
                    "--listen",
                    f"127.0.0.1:{row['port']}",
                    "--kv-listen",
                    "127.0.0.1:0",
                    "--wan-port",
                    "0",
                    "--control-plane",
                    self.cp.url,
                    "--threads",
                    "1",
                    "--num-blocks",
                    str(AGENT_NUM_BLOCKS),
                    "--heartbeat-interval-s",
                    str(HEARTBEAT_S),
                ],
                node.host,
            )
            self.agents[node.host] = proc
            try:
                proc.start(
                    env={
                        "OMP_NUM_THREADS": "1",
                        "OMP_WAIT_POLICY": "PASSIVE",
                        "BATON_AGENT_TOKEN": row["agent_token"],
                    }
                )
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=start, args=(n,)) for n in self.spec.nodes]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def wait_running(self, timeout_s: float = 240) -> None:
        def states() -> bool:
            rows = self.cp.get_all("instances", served_model=self.model_id)
            return bool(rows) and all(r["actual_state"] == "running" for r in rows)

        self.cp.cluster.wait_for(states, timeout_s, f"{self.spec.label}'s instances to run")
        for host in self.agents:
            code = (
                "from fleet.models import Node; "
                f"print(Node.objects.get(hostname={host!r}).command_token)"
            )
            self.command_tokens[host] = self.cp.cluster.shell(code).strip().splitlines()[-1]
        time.sleep(2 * HEARTBEAT_S)  # the gateway's view holds every instance's KV endpoint

    def bring_up(self) -> None:
        self.create()
        self.start_agents()
        self.wait_running()

    # -- while running ----------------------------------------------------------------------

    def state(self, host: str) -> dict | None:
        proc = self.agents.get(host)
        if proc is None or not proc.http:
            return None
        try:
            r = httpx.get(
                f"{proc.http}/state",
                headers={"Authorization": f"Bearer {self.command_tokens.get(host, '')}"},
                timeout=5,
            )
            return r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    def alive(self) -> list[str]:
        """Hosts whose agent process has exited."""
        return [h for h, p in self.agents.items() if p.proc is None or p.proc.poll() is not None]

    def stop(self) -> None:
        for host, proc in self.agents.items():
            if self.log_dir is not None and proc.log_path:
                try:
                    (self.log_dir / f"agent-{host}.log").write_text(Path(proc.log_path).read_text())
                except OSError:
                    pass
            proc.kill()
            proc.cleanup()
        self.agents.clear()


def dump(obj, path: Path) -> None:
    path.write_text(json.dumps(obj, indent=1, default=str))
