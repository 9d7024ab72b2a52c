"""What one agent heartbeat costs the control plane: time and database statements per beat.

    .venv/bin/python bench/heartbeat_cost.py [--nodes 20] [--rounds 20] [--blocks 0]
    DATABASE_URL=postgresql://postgres@127.0.0.1:5432/test .venv/bin/python bench/heartbeat_cost.py

A throwaway test database (a SQLite file, or ``test_baton_heartbeat_cost`` on the PostgreSQL
server of ``DATABASE_URL``) gets one datacenter of ``--nodes`` registered nodes, each with a
prefill and a main-decode instance that run as operators want. Each node then heartbeats with
an agent's state document (agents/PROTOCOL.md; ``control_plane`` stats that change at every
beat, as a real agent's do; ``--blocks`` cached prefix hashes on the MD), one beat at a time:

- ``unchanged``: the same document again (only the agent's heartbeat stats move);
- ``changed``: the MD's load and token count move at every beat.

Each way is timed through the service function in a transaction (what ATOMIC_REQUESTS wraps
it in) and through the Django test client (token authentication, validation, the view). Prints
JSON: median and p90 microseconds per beat, median microseconds spent inside database
statements, and statements (writes) per beat.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
os.environ.setdefault("BATON_EMBEDDED_BEAT", "false")


class StatementClock:
    """Counts statements and the time spent executing them (a connection execute wrapper)."""

    def __init__(self) -> None:
        self.statements = 0
        self.writes = 0
        self.seconds = 0.0

    def __call__(self, execute, sql, params, many, context):
        start = time.perf_counter()
        try:
            return execute(sql, params, many, context)
        finally:
            self.seconds += time.perf_counter() - start
            self.statements += 1
            if sql.lstrip()[:6].upper() in {"UPDATE", "INSERT", "DELETE"}:
                self.writes += 1


def state_document(node, instances, beat: int, *, blocks: int, changed: bool) -> dict:
    items = []
    for inst in instances:
        running = (beat % 7) if changed and inst.role == "main_decode" else 0
        item = {
            "instance_id": str(inst.pk),
            "role": inst.role,
            "model": "baton-tiny",
            "source": "baton-tiny",
            "dtype": "float32",
            "engine_kind": "torch",
            "state": "running",
            "load": {
                "running": running,
                "queued": 0,
                "held": 0,
                "active_requests": running,
                "max_running": 32,
            },
            "kv": {"used_blocks": 10, "total_blocks": 512, "block_size": 16},
            "cache": {
                "lookups": 3,
                "hits": 2,
                "queried_tokens": 900,
                "matched_tokens": 640,
                "cached_blocks": blocks,
                "hit_rate": 0.71,
            },
            "engine": {
                "tokens_computed": 2000,
                "tokens_sampled": 1300,
                "forwards": 90,
                "preemptions": 0,
                "busy_s": 41.2,
            },
            "tokens_generated": 1234 + (beat if changed else 0),
        }
        if inst.role == "main_decode" and blocks:
            item["cached_prefix_blocks"] = [f"{inst.pk:08x}{k:056x}" for k in range(blocks)]
        items.append(item)
    fabric = {
        "sent_bytes": 0,
        "received_bytes": 0,
        "sent_payload_bytes": 0,
        "received_payload_bytes": 0,
        "transfers": 0,
        "failures": 0,
    }
    return {
        "node": node.hostname,
        "datacenter": "dc-a",
        "protocol": 1,
        "draining": False,
        "active_requests": 0,
        "instances": items,
        "tokens_by_role": {"prefill": 10, "relay_decode": 0, "main_decode": 0},
        "late_kv_cached": 0,
        "kv_in_flight": {"incoming": 0, "reservations": 0, "prefix_hits": 0},
        "fabrics": {"wan": dict(fabric), "intra_dc": dict(fabric)},
        "links": {},
        "engine_options": {"device": "cpu", "dtype": "float32", "decode_weights": "full"},
        # What a real agent adds: its own account of its heartbeats, new at every beat.
        "control_plane": {
            "heartbeats_answered": beat,
            "heartbeats_refused": 0,
            "heartbeat_timeouts": 0,
            "unreachable": 0,
            "rtt_p50_s": 0.004 + beat * 1e-6,
            "rtt_p99_s": 0.01,
            "rtt_max_s": 0.02,
        },
    }


def build_fleet(n_nodes: int):
    from django.utils import timezone

    from fleet import services
    from fleet.models import Datacenter, GPUType, Instance, Node, ServedModel

    dc = Datacenter.objects.create(name="dc-a", region="r")
    gpu = GPUType.objects.create(
        vendor="g",
        model="gpu-a",
        peak_bf16_tflops=900,
        memory_gib=80,
        memory_bandwidth_gbps=4000,
        interconnect_gbps=400,
    )
    model = ServedModel.objects.create(
        name="baton-tiny", source="baton-tiny", num_layers=4, kv_bytes_per_token=2048
    )
    fleet = []
    for k in range(n_nodes):
        token, prefix, token_hash = services.node_token_generate()
        node = Node.objects.create(
            hostname=f"n-{k:04d}",
            datacenter=dc,
            gpu_type=gpu,
            gpu_count=8,
            status="online",
            agent_endpoint=f"http://127.0.0.1:{10000 + k}",
            registered_at=timezone.now(),
            last_heartbeat_at=timezone.now(),
            agent_token_prefix=prefix,
            agent_token_hash=token_hash,
        )
        instances = [
            Instance.objects.create(
                role=role,
                node=node,
                served_model=model,
                gpu_count=4,
                actual_state="running",
                desired_state="running",
            )
            for role in ("prefill", "main_decode")
        ]
        fleet.append((node, token, instances))
    return fleet


def measure(fleet, *, rounds: int, blocks: int, changed: bool, via: str, first_beat: int):
    from django.db import connection, transaction
    from rest_framework.test import APIClient

    from fleet import agent_services, services

    client = APIClient()
    times, db_times, statements, writes = [], [], [], []
    beat = first_beat
    for round_ in range(rounds + 1):
        beat += 1
        for node, token, instances in fleet:
            doc = state_document(node, instances, beat, blocks=blocks, changed=changed)
            body = json.dumps(doc)
            clock = StatementClock()
            with connection.execute_wrapper(clock):
                start = time.perf_counter()
                if via == "service":
                    with transaction.atomic():
                        me = services.node_authenticate_token(token)
                        agent_services.node_heartbeat(node=me, report=json.loads(body))
                else:
                    response = client.post(
                        "/api/v1/agent/heartbeat",
                        body,
                        content_type="application/json",
                        HTTP_AUTHORIZATION=f"AgentToken {token}",
                    )
                    assert response.status_code == 200, response.content[:300]
                elapsed = time.perf_counter() - start
            if round_ == 0:
                continue  # the first round changes whatever the previous way left
            times.append(elapsed)
            db_times.append(clock.seconds)
            statements.append(clock.statements)
            writes.append(clock.writes)
    times.sort()
    return {
        "beats": len(times),
        "median_us": round(statistics.median(times) * 1e6),
        "p90_us": round(times[int(0.9 * (len(times) - 1))] * 1e6),
        "db_median_us": round(statistics.median(db_times) * 1e6),
        "statements": round(statistics.mean(statements), 2),
        "writes": round(statistics.mean(writes), 2),
    }, beat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--blocks", type=int, default=0, help="cached prefix hashes per MD")
    args = parser.parse_args()

    import django
    from django.conf import settings

    tmp = tempfile.TemporaryDirectory()
    db = settings.DATABASES["default"]
    if db["ENGINE"].endswith("sqlite3"):
        # A file, as the embedded default runs (WAL), not the test runner's in-memory database.
        db["TEST"] = {"NAME": str(Path(tmp.name) / "bench.sqlite3")}
    else:  # a name of its own: a test run on the same server uses test_<name>
        db["TEST"] = {"NAME": "test_baton_heartbeat_cost"}
    db["CONN_MAX_AGE"] = 0
    django.setup()
    from django.db import connection
    from django.test.utils import setup_test_environment

    setup_test_environment()
    original_name = connection.settings_dict["NAME"]
    connection.creation.create_test_db(verbosity=0, autoclobber=True, serialize=False)
    try:
        fleet = build_fleet(args.nodes)
        results: dict = {
            "database": connection.vendor,
            "nodes": args.nodes,
            "rounds": args.rounds,
            "blocks": args.blocks,
        }
        beat = 0
        for via in ("service", "http"):
            for changed in (False, True):
                out, beat = measure(
                    fleet,
                    rounds=args.rounds,
                    blocks=args.blocks,
                    changed=changed,
                    via=via,
                    first_beat=beat,
                )
                results[f"{via}_{'changed' if changed else 'unchanged'}"] = out
        print(json.dumps(results, indent=2))
    finally:
        connection.creation.destroy_test_db(original_name, verbosity=0, keepdb=False)
        tmp.cleanup()


if __name__ == "__main__":
    main()
