"""A fleet at scale for the fleet and overview pages: 64 nodes, 128 instances over two
datacenters, two GPU types and the three roles, with a known mix of states, load, emulated
engines, one offline node and one unpriced (datacenter, GPU type).

``declare()`` writes it straight into the models (no agent commands queued), so the same code
serves the in-process page tests and the browser tests' server (``manage.py shell -c``).
``expected()`` says what every group must count, from the same plan."""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime
from decimal import Decimal

# (datacenter, role, GPU type, nodes); every node has 8 GPUs and two 4-GPU instances
GROUPS = [
    ("dc-a", "prefill", "gpu-a", 12),
    ("dc-a", "prefill", "gpu-b", 4),
    ("dc-a", "relay_decode", "gpu-a", 6),
    ("dc-a", "main_decode", "gpu-b", 4),
    ("dc-b", "prefill", "gpu-a", 6),
    ("dc-b", "relay_decode", "gpu-b", 6),
    ("dc-b", "main_decode", "gpu-a", 6),
    ("dc-b", "main_decode", "gpu-b", 20),
]
PRICES = {("dc-a", "gpu-a"): "2.00", ("dc-b", "gpu-b"): "2.50", ("dc-b", "gpu-a"): "2.20"}
OFFLINE_NODE = "dc-b-md-gpu-b-03"
SHORT = {"prefill": "p", "relay_decode": "rld", "main_decode": "md"}


def state_of(j: int) -> str:
    if j % 8 == 7:
        return "failed"
    if j % 8 == 5:
        return "starting"
    if j % 12 == 3:
        return "draining"
    return "running"


def engine_of(dc: str, role: str, gpu: str, j: int) -> str:
    if (dc, role, gpu) == ("dc-b", "main_decode", "gpu-a"):
        return "emulated"
    if (dc, role, gpu) == ("dc-a", "prefill", "gpu-b") and j % 2 == 0:
        return "emulated"
    return "torch"


def report_of(dc: str, role: str, gpu: str, j: int) -> dict:
    """The instance's part of a heartbeat: its state and engine; load and KV when running."""
    state = state_of(j)
    report: dict = {"state": state}
    if state == "running":
        report["load"] = {"running": j % 5, "queued": j % 3, "max_running": 32}
        report["kv"] = {"used_blocks": 64 * (j % 4), "total_blocks": 512}
    stats = {"tokens_computed": 10, "busy_s": 1.0}
    if engine_of(dc, role, gpu, j) == "emulated":
        if gpu == "gpu-b":
            report["engine"] = "emulated"  # the kind in "engine" itself
        else:
            report |= {"engine_kind": "emulated", "engine": stats}  # the agent's own fields
    elif j % 3 == 0:
        report |= {"engine_kind": "torch", "engine": stats}
    elif j % 3 == 1:
        report["engine"] = stats  # an agent older than engine_kind: torch
    return report


def plan():
    """(datacenter, role, GPU type, node hostname, index in group) for every instance."""
    for dc, role, gpu, nodes in GROUPS:
        for k in range(nodes):
            host = f"{dc}-{SHORT[role]}-{gpu}-{k + 1:02d}"
            for half in range(2):
                yield dc, role, gpu, host, 2 * k + half


def declare() -> dict:
    from fleet import services
    from fleet.models import (
        Datacenter,
        GPUType,
        Instance,
        Node,
        ServedModel,
        UnitPrice,
        WANLink,
    )

    dcs = {
        name: Datacenter.objects.create(name=name, region=f"city-{name[-1]}")
        for name in ("dc-a", "dc-b")
    }
    gpus = {
        name: GPUType.objects.create(
            vendor="g",
            model=name,
            peak_bf16_tflops=900,
            memory_gib=80,
            memory_bandwidth_gbps=4000,
            interconnect_gbps=400,
        )
        for name in ("gpu-a", "gpu-b")
    }
    start = datetime(2026, 1, 1, tzinfo=UTC)
    for (dc, gpu), price in PRICES.items():
        UnitPrice.objects.create(
            gpu_type=gpus[gpu],
            datacenter=dcs[dc],
            price_per_gpu_hour=Decimal(price),
            effective_from=start,
        )
    WANLink.objects.create(
        from_datacenter=dcs["dc-a"], to_datacenter=dcs["dc-b"], bandwidth_gbps=20, rtt_ms=30
    )
    model = ServedModel.objects.create(
        name="baton-tiny", source="baton-tiny", num_layers=4, kv_bytes_per_token=2048
    )
    nodes: dict[str, Node] = {}
    instances = []
    for dc, role, gpu, host, j in plan():
        if host not in nodes:
            _, prefix, token_hash = services.node_token_generate()
            nodes[host] = Node.objects.create(
                hostname=host,
                datacenter=dcs[dc],
                gpu_type=gpus[gpu],
                gpu_count=8,
                status="offline" if host == OFFLINE_NODE else "online",
                agent_token_prefix=prefix,
                agent_token_hash=token_hash,
            )
        instances.append(
            Instance(
                role=role,
                node=nodes[host],
                served_model=model,
                gpu_count=4,
                actual_state=state_of(j),
                last_report=report_of(dc, role, gpu, j),
            )
        )
    Instance.objects.bulk_create(instances)
    return {"nodes": len(nodes), "instances": len(instances)}


def expected() -> dict[tuple[str, str, str], dict]:
    """Per (datacenter, role, GPU type): instances, nodes, offline nodes, GPUs, emulated, the
    count per state, running / max running, queued and cost per hour."""
    out: dict[tuple[str, str, str], dict] = {}
    for dc, role, gpu, host, j in plan():
        g = out.setdefault(
            (dc, role, gpu),
            {
                "instances": 0,
                "nodes": set(),
                "offline": set(),
                "gpus": 0,
                "emulated": 0,
                "states": Counter(),
                "running": 0,
                "max_running": 0,
                "queued": 0,
                "cost": Decimal(0),
            },
        )
        g["instances"] += 1
        g["nodes"].add(host)
        if host == OFFLINE_NODE:
            g["offline"].add(host)
        g["gpus"] += 4
        g["emulated"] += engine_of(dc, role, gpu, j) == "emulated"
        state = state_of(j)
        g["states"][state] += 1
        load = report_of(dc, role, gpu, j).get("load")
        if load:
            g["running"] += load["running"]
            g["max_running"] += load["max_running"]
            g["queued"] += load["queued"]
        if state == "running" and (dc, gpu) in PRICES:
            g["cost"] += 4 * Decimal(PRICES[(dc, gpu)])
    for g in out.values():
        g["nodes"] = len(g["nodes"])
        g["offline"] = len(g["offline"])
    return out
