"""Load the demo fleet: two datacenters joined by a WAN link, two GPU types, prices, nodes and
P / RLD / MD instances of baton-tiny. Running it again changes nothing."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

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


class Command(BaseCommand):
    help = "Load the demo fleet (idempotent): 2 datacenters, 1 WAN link, 2 GPU types, P/RLD/MD."

    @transaction.atomic
    def handle(self, *args, **options):
        created: list[str] = []
        dcs = {}
        for spec in DATACENTERS:
            dcs[spec["name"]], new = Datacenter.objects.get_or_create(
                name=spec["name"], defaults=spec
            )
            if new:
                created.append(f"datacenter {spec['name']}")
        gpus = {}
        for spec in GPU_TYPES:
            gpus[spec["model"]], new = GPUType.objects.get_or_create(
                vendor=spec["vendor"], model=spec["model"], defaults=spec
            )
            if new:
                created.append(f"gpu type {spec['model']}")
        for gpu, dc, price in PRICES:
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
        _, new = WANLink.objects.get_or_create(
            from_datacenter=dcs["dc-a"], to_datacenter=dcs["dc-b"], defaults=LINK
        )
        if new:
            created.append("wan link dc-a -> dc-b")
        model, new = ServedModel.objects.get_or_create(name=MODEL["name"], defaults=MODEL)
        if new:
            created.append(f"model {model.name}")
        nodes = {}
        for spec in NODES:
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
        for hostname, role, gpu_count in INSTANCES:
            node = nodes[hostname]
            if not Instance.objects.filter(node=node, role=role, served_model=model).exists():
                services.instance_create(
                    role=role, node=node, served_model=model, gpu_count=gpu_count, actor="seed_demo"
                )
                created.append(f"{role} instance on {hostname}")
        if created:
            for line in created:
                self.stdout.write(f"created {line}")
        else:
            self.stdout.write("demo fleet already present; nothing to do")
