"""How long /metrics and the fleet page take to render with N nodes' heartbeats, in one idle
process (no traffic, no other load): the render cost alone, which bench.control_path measures
again under 500 heartbeats a second.

    python -m bench.pages_at_scale --nodes 1000 --fetches 5 [--postgres]

Declares N nodes (half prefill in one datacenter, half main_decode in another) straight in a
fresh database (SQLite in a temporary file, or with ``--postgres`` the database
``baton_bench_pages`` on 127.0.0.1:5432, dropped and created, and Redis db 10, flushed; both
left empty at the end),
publishes each node's heartbeat (bench.control_path's real idle agent state document) to the
live view, then fetches each page ``--fetches`` times through Django's test client as an
operator and prints one JSON line per page with every fetch's seconds (the first is cold)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

PG_DB = "baton_bench_pages"
REDIS_URL = "redis://127.0.0.1:6379/10"


def _database(postgres: bool) -> None:
    if postgres:
        base = ["-h", "127.0.0.1", "-U", "postgres"]
        subprocess.run(["dropdb", *base, "--if-exists", PG_DB], check=True, capture_output=True)
        subprocess.run(["createdb", *base, PG_DB], check=True)
        os.environ["DATABASE_URL"] = f"postgres://postgres@127.0.0.1:5432/{PG_DB}"
        os.environ["REDIS_URL"] = REDIS_URL
    else:
        path = os.path.join(tempfile.mkdtemp(prefix="baton-pages-"), "db.sqlite3")
        os.environ["DATABASE_URL"] = f"sqlite:///{path}"
        os.environ.pop("REDIS_URL", None)
    os.environ["DJANGO_SETTINGS_MODULE"] = "controlplane.settings"


def declare(n: int) -> None:
    """N nodes with one instance each, and their heartbeats in the live view."""
    from bench.control_path import ProbeNode, state_document
    from fleet import live
    from fleet.choices import InstanceRole, NodeStatus
    from fleet.models import Datacenter, GPUType, Instance, Node, ServedModel

    a = Datacenter.objects.create(name="bench-a", region="r-a")
    b = Datacenter.objects.create(name="bench-b", region="r-b")
    gpu = GPUType.objects.create(
        vendor="g",
        model="gpu",
        peak_bf16_tflops=989,
        memory_gib=80,
        memory_bandwidth_gbps=3350,
        interconnect_gbps=400,
    )
    model = ServedModel.objects.create(
        name="m", source="baton-tiny", num_layers=4, kv_bytes_per_token=4096
    )
    nodes = Node.objects.bulk_create(
        Node(
            hostname=f"node-{i}",
            datacenter=a if i % 2 == 0 else b,
            gpu_type=gpu,
            gpu_count=8,
            agent_endpoint=f"http://127.0.0.1:{20000 + i}",
            agent_token_prefix=f"t{i}",
            status=NodeStatus.ONLINE,
        )
        for i in range(n)
    )
    roles = (InstanceRole.PREFILL, InstanceRole.MAIN_DECODE)
    instances = Instance.objects.bulk_create(
        Instance(role=roles[i % 2], node=node, served_model=model, gpu_count=8)
        for i, node in enumerate(nodes)
    )
    for node, inst in zip(nodes, instances, strict=True):
        probe = ProbeNode(
            hostname=node.hostname,
            token="-",
            role=inst.role,
            datacenter=node.datacenter.name,
            instance_id=inst.pk,
        )
        live.publish_report(
            node_id=node.pk,
            hostname=node.hostname,
            datacenter=node.datacenter.name,
            endpoint=node.agent_endpoint,
            report=state_document(probe),
        )


def fetch_times(paths: list[str], fetches: int) -> dict[str, list[float]]:
    from django.contrib.auth import get_user_model
    from django.test import Client

    password = "pages-at-scale-1"
    get_user_model().objects.create_superuser("bench-operator", "op@example.com", password)
    client = Client()
    client.login(username="bench-operator", password=password)
    out: dict[str, list[float]] = {}
    for path in paths:
        for _ in range(fetches):
            t0 = time.perf_counter()
            response = client.get(path)
            took = time.perf_counter() - t0
            if response.status_code != 200:
                raise RuntimeError(f"{path} answered {response.status_code}")
            out.setdefault(path, []).append(round(took, 4))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pages_at_scale")
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--fetches", type=int, default=5)
    parser.add_argument("--postgres", action="store_true", help="PostgreSQL + Redis")
    args = parser.parse_args(argv)
    if args.nodes < 1 or args.fetches < 1:
        print("--nodes and --fetches must be >= 1", file=sys.stderr)
        return 2
    _database(args.postgres)
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    if args.postgres:
        import redis

        redis.Redis.from_url(REDIS_URL).flushdb()
    declare(args.nodes)
    try:
        for path, times in fetch_times(["/metrics", "/fleet/"], args.fetches).items():
            print(json.dumps({"page": path, "nodes": args.nodes, "seconds": times}))
    finally:
        if args.postgres:  # leave nothing behind
            from django.db import connections

            connections.close_all()
            base = ["-h", "127.0.0.1", "-U", "postgres"]
            subprocess.run(["dropdb", *base, "--force", "--if-exists", PG_DB], capture_output=True)
            redis.Redis.from_url(REDIS_URL).flushdb()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
