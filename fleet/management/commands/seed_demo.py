"""Load the demo fleet: two datacenters joined by a WAN link, two GPU types, prices, nodes and
P / RLD / MD instances of baton-tiny; with --emulated also an emulated fleet of the paper's
model (profile:paper-dsv4) on two more datacenters, several nodes per role on the two GPU
types (docs/emulation.md). Running it again changes nothing."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from django.core.management.base import BaseCommand
from django.db import transaction

from fleet import services
from fleet.choices import InstanceRole
from fleet.models import Datacenter, GPUType, Instance, Node, ServedModel, UnitPrice, WANLink

# The demo's numbers are illustrative, not a vendor's datasheet: GPU-A is a compute-heavy
# flagship, GPU-B a decode-friendly chip with more memory bandwidth. GPU-B's price is 1.25x
# GPU-A's, the ratio docs/pdd.md derives from the published cost figures (an assumption).
DATACENTERS = [
    {"name": "dc-a", "region": "city-a", "description": "Main datacenter: prefill and relay."},
    {"name": "dc-b", "region": "city-b", "description": "Remote datacenter: main decode."},
]
GPU_TYPES = [
    {
        "vendor": "generic",
        "model": "gpu-a",
        "peak_bf16_tflops": 989.0,
        "memory_gib": 80.0,
        "memory_bandwidth_gbps": 3350.0,
        "interconnect_gbps": 400.0,
    },
    {
        "vendor": "generic",
        "model": "gpu-b",
        "peak_bf16_tflops": 800.0,
        "memory_gib": 141.0,
        "memory_bandwidth_gbps": 7000.0,
        "interconnect_gbps": 450.0,
    },
]
PRICES = [("gpu-a", "dc-a", Decimal("2.0000")), ("gpu-b", "dc-b", Decimal("2.5000"))]
LINK = {
    "bandwidth_gbps": 20.0,
    "rtt_ms": 30.0,
    "connection_pool_size": 16,
    "monthly_cost": Decimal("12000.00"),
}
# baton-tiny: 4 layers, 2 KV heads of 64 dims, float32 -> 2 (K and V) x 4 x 2 x 64 x 4 bytes.
MODEL = {
    "name": "baton-tiny",
    "source": "baton-tiny",
    "dtype": "float32",
    "num_layers": 4,
    "kv_bytes_per_token": 2 * 4 * 2 * 64 * 4,
    "max_context_tokens": 4096,
    "kv_block_size": 16,
}
NODES = [
    {"hostname": "a-prefill-1", "dc": "dc-a", "gpu": "gpu-a", "gpus": 8, "port": 9101},
    {"hostname": "a-relay-1", "dc": "dc-a", "gpu": "gpu-a", "gpus": 8, "port": 9102},
    {"hostname": "b-decode-1", "dc": "dc-b", "gpu": "gpu-b", "gpus": 8, "port": 9201},
]
INSTANCES = [
    ("a-prefill-1", InstanceRole.PREFILL, 8),
    ("a-relay-1", InstanceRole.RELAY_DECODE, 8),
    ("b-decode-1", InstanceRole.MAIN_DECODE, 8),
]
PRICES_FROM = datetime(2026, 1, 1, tzinfo=UTC)

# The emulated fleet (--emulated): the paper's model as a model profile, served by emulated
# engines that take the step times of their nodes' GPU types (8 GPUs a node, one instance per
# node), in two datacenters of its own: its link is declared at the paper-like speed, while
# dc-a -> dc-b is scaled for baton-tiny. The link is a 1 Gbit/s share of a WAN line: at 4,400
# bytes of KV per token an opening's ~40K-token KV takes ~1.4 s on it, a 95%-hit turn's delta
# ~0.1 s, the regime PDD is for.
EMULATED_DATACENTERS = [
    {"name": "emu-a", "region": "city-c", "description": "Emulated fleet: prefill and relay."},
    {"name": "emu-b", "region": "city-d", "description": "Emulated fleet: main decode."},
]
EMULATED_PRICES = [("gpu-a", "emu-a", Decimal("2.0000")), ("gpu-b", "emu-b", Decimal("2.5000"))]
EMULATED_LINK = {
    "bandwidth_gbps": 1.0,
    "rtt_ms": 30.0,
    "connection_pool_size": 16,
    "monthly_cost": Decimal("12000.00"),
}
EMULATED_MODEL = {
    "name": "paper-dsv4",
    "source": "profile:paper-dsv4",
    "dtype": "bfloat16",
    "num_layers": 61,
    "kv_bytes_per_token": 4400,
    "max_context_tokens": 262_144,
    "kv_block_size": 16,
}
EMULATED_NODES: list[dict[str, Any]] = [
    *(
        {"hostname": f"emu-a-prefill-{i}", "dc": "emu-a", "gpu": "gpu-a", "gpus": 8,
         "port": 9300 + i, "role": InstanceRole.PREFILL}
        for i in range(1, 5)
    ),
    *(
        {"hostname": f"emu-a-relay-{i}", "dc": "emu-a", "gpu": "gpu-a", "gpus": 8,
         "port": 9310 + i, "role": InstanceRole.RELAY_DECODE}
        for i in range(1, 3)
    ),
    *(
        {"hostname": f"emu-b-decode-{i}", "dc": "emu-b", "gpu": "gpu-b", "gpus": 8,
         "port": 9320 + i, "role": InstanceRole.MAIN_DECODE}
        for i in range(1, 4)
    ),
    # Spare nodes: an idle agent each and no instance, where the autopilot (docs/autopilot.md)
    # may start one when `make demo`'s traffic ramps (bench/demo.py --ramp-at-s).
    {"hostname": "emu-a-spare-1", "dc": "emu-a", "gpu": "gpu-a", "gpus": 8, "port": 9331,
     "role": None},
    {"hostname": "emu-b-spare-1", "dc": "emu-b", "gpu": "gpu-b", "gpus": 8, "port": 9332,
     "role": None},
]  # fmt: skip


class Command(BaseCommand):
    help = "Load the demo fleet (idempotent): 2 datacenters, 1 WAN link, 2 GPU types, P/RLD/MD."

    def add_arguments(self, parser):
        parser.add_argument(
            "--emulated",
            action="store_true",
            help="also load the emulated fleet of the paper's model (docs/emulation.md)",
        )

    @transaction.atomic
    def handle(self, *args, emulated: bool = False, **options):
        created: list[str] = []
        gpus = {}
        for spec in GPU_TYPES:
            gpus[spec["model"]], new = GPUType.objects.get_or_create(
                vendor=spec["vendor"], model=spec["model"], defaults=spec
            )
            if new:
                created.append(f"gpu type {spec['model']}")
        fleets: list[tuple[Any, ...]] = [(DATACENTERS, PRICES, LINK, MODEL, NODES, INSTANCES)]
        if emulated:
            instances = [(n["hostname"], n["role"], n["gpus"]) for n in EMULATED_NODES
                         if n["role"] is not None]  # fmt: skip
            fleets.append(
                (
                    EMULATED_DATACENTERS,
                    EMULATED_PRICES,
                    EMULATED_LINK,
                    EMULATED_MODEL,
                    EMULATED_NODES,
                    instances,
                )
            )
        for datacenters, prices, link, model_spec, node_specs, instance_specs in fleets:
            created += _load(
                gpus, datacenters, prices, link, model_spec, node_specs, instance_specs
            )
        if created:
            for line in created:
                self.stdout.write(f"created {line}")
        else:
            self.stdout.write("demo fleet already present; nothing to do")


def _load(gpus, datacenters, prices, link, model_spec, node_specs, instance_specs) -> list[str]:
    """One fleet: its datacenters (the first is the link's from end), prices, link, served
    model, nodes and instances; only what is missing is created."""
    created: list[str] = []
    dcs = {}
    for spec in datacenters:
        dcs[spec["name"]], new = Datacenter.objects.get_or_create(name=spec["name"], defaults=spec)
        if new:
            created.append(f"datacenter {spec['name']}")
    for gpu, dc, price in prices:
        if not UnitPrice.objects.filter(gpu_type=gpus[gpu], datacenter=dcs[dc]).exists():
            services.unit_price_save(
                price=UnitPrice(
                    gpu_type=gpus[gpu],
                    datacenter=dcs[dc],
                    price_per_gpu_hour=price,
                    effective_from=PRICES_FROM,
                )
            )
            created.append(f"price {gpu}@{dc}")
    src, dst = (spec["name"] for spec in datacenters)
    _, new = WANLink.objects.get_or_create(
        from_datacenter=dcs[src], to_datacenter=dcs[dst], defaults=link
    )
    if new:
        created.append(f"wan link {src} -> {dst}")
    model, new = ServedModel.objects.get_or_create(name=model_spec["name"], defaults=model_spec)
    if new:
        created.append(f"model {model.name}")
    nodes = {}
    for spec in node_specs:
        node = Node.objects.filter(hostname=spec["hostname"]).first()
        if node is None:
            node, token = services.node_create(
                hostname=spec["hostname"],
                datacenter=dcs[spec["dc"]],
                gpu_type=gpus[spec["gpu"]],
                gpu_count=spec["gpus"],
                agent_endpoint=f"http://127.0.0.1:{spec['port']}",
                actor="seed_demo",
            )
            created.append(f"node {node.hostname} (agent token, shown once: {token})")
        nodes[spec["hostname"]] = node
    for hostname, role, gpu_count in instance_specs:
        node = nodes[hostname]
        if not Instance.objects.filter(node=node, role=role, served_model=model).exists():
            services.instance_create(
                role=role, node=node, served_model=model, gpu_count=gpu_count, actor="seed_demo"
            )
            created.append(f"{role} instance on {hostname}")
    return created
