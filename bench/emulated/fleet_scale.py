"""The control plane carrying the paper's fleet: 40 prefill and 3 relay units (GPU-A) in one
datacenter, 32 main-decode units (GPU-B) in another, each unit one node of 8 GPUs with one
emulated instance and its own agent process (75 agents), declared over the REST API, started,
then watched: idle, and under paper-like agentic traffic through the gateway.

The scenario is fixed by rule before the first run: the paper's fleet at full size (docs/pdd.md:
43 GPU-A with 3 for RLD, 32 GPU-B), its link (20 Gbit/s, 20 ms, 76 connections: the planner's
numbers), agents at --kv-scale 100 and the default 2-s heartbeat, the embedded control plane
(one uvicorn process, SQLite, in-process beat) as `make demo` runs it; an idle phase, then a
traffic phase of `bench.harness.traffic.paper_workload` at --rps (default 1). It reports what the
control plane does meanwhile: bring-up time, its CPU, every agent's heartbeat round trip
(p50/p99/max over the phase), heartbeats refused or timed out, nodes that went offline, and the
traffic's outcome.

    python -m bench.emulated.fleet_scale [--idle-s 120] [--traffic-s 180] [--rps 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx

from agents.node.launch import AgentProcess
from bench.harness.control_plane import ControlPlane, start_control_plane
from bench.harness.emulated import COMMAND_TOKENS, all_running, load_command_tokens, start_agents
from bench.harness.host import cpu_seconds, machine_busy, port_in_use
from bench.harness.testbed import ROOT
from bench.harness.traffic import TrafficStats, paper_workload, replay, session_options
from pdd.profiles import PAPER_GPUS

HERE = Path(__file__).resolve().parent
PROFILE = "profile:paper-dsv4"
# Per chip: the planner's GPU-A / GPU-B units divided by 8 (pdd.profiles.PAPER_GPUS).
GPUS = {
    model: {
        k: PAPER_GPUS[name][k] for k in ("peak_bf16_tflops", "memory_gib", "memory_bandwidth_gbps")
    }
    for model, name in (("paper-a", "GPU-A"), ("paper-b", "GPU-B"))
}
PRICES = {"paper-a": "2.00", "paper-b": "2.50"}
FLEET = (("prefill", "pa", "paper-a", 40), ("relay_decode", "pa", "paper-a", 3),
         ("main_decode", "pb", "paper-b", 32))  # fmt: skip
LINK = {"bandwidth_gbps": 20, "rtt_ms": 20, "connection_pool_size": 76}
BASE_PORT = 21000


def say(message: str) -> None:
    print(f"[fleet-scale] {message}", file=sys.stderr, flush=True)


def declare(cp: ControlPlane) -> list[dict]:
    """The fleet over REST; returns its nodes (hostname, role, port, agent token)."""
    dcs = {
        name: cp.post("datacenters", {"name": name, "region": region, "rdma_domain": name})["id"]
        for name, region in (("pa", "city-a"), ("pb", "city-b"))
    }
    cp.post(
        "wan-links",
        {"from_datacenter": dcs["pa"], "to_datacenter": dcs["pb"], **LINK, "monthly_cost": "0"},
    )
    gpus = {
        name: cp.post(
            "gpu-types", {"vendor": "bench", "model": name, **spec, "interconnect_gbps": 50}
        )["id"]
        for name, spec in GPUS.items()
    }
    for name, dc in (("paper-a", "pa"), ("paper-b", "pb")):
        cp.post(
            "unit-prices",
            {
                "gpu_type": gpus[name],
                "datacenter": dcs[dc],
                "price_per_gpu_hour": PRICES[name],
                "currency": "USD",
                "effective_from": "2026-01-01T00:00:00Z",
            },
        )
    model = cp.post(
        "models",
        {
            "name": "paper-dsv4",
            "source": PROFILE,
            "num_layers": 61,
            "kv_bytes_per_token": 4400,
            "max_context_tokens": 262_144,
            "kv_block_size": 16,
        },
    )["id"]
    nodes = []
    # HTTP ports below the kernel's ephemeral range, so no agent's KV listener (port 0) takes
    # one between the pick and the bind; each checked free.
    ports = (p for p in range(BASE_PORT, BASE_PORT + 1000) if not port_in_use("127.0.0.1", p))
    for role, dc, gpu, count in FLEET:
        for i in range(1, count + 1):
            port = next(ports)
            row = cp.post(
                "nodes",
                {
                    "hostname": f"{dc}-{role.replace('_', '-')}-{i}",
                    "datacenter": dcs[dc],
                    "gpu_type": gpus[gpu],
                    "gpu_count": 8,
                    "agent_endpoint": f"http://127.0.0.1:{port}",
                },
            )
            nodes.append({**row, "role": role, "dc": dc, "port": port})
    for node in sorted(nodes, key=lambda n: n["role"] != "prefill"):
        cp.post(
            "instances",
            {"role": node["role"], "node": node["id"], "served_model": model, "gpu_count": 8},
        )
    return nodes


def agent_stats(agents: dict[str, AgentProcess]) -> list[dict]:
    out = []
    with httpx.Client(timeout=10) as http:
        for name, proc in agents.items():
            headers = {"Authorization": f"Bearer {COMMAND_TOKENS.get(name, '')}"}
            try:
                doc = http.get(f"{proc.http}/state", headers=headers).json()
            except (httpx.HTTPError, ValueError):
                out.append({"node": name, "error": "no state"})
                continue
            out.append({"node": name, **(doc.get("control_plane") or {})})
    return out


def rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def phase(cp: ControlPlane, agents: dict[str, AgentProcess], seconds: float, web_pid: int,
          traffic: tuple[float, str] | None) -> dict:  # fmt: skip
    """Watch for `seconds` (with traffic at (rps, api key) when given)."""
    before = {s["node"]: s for s in agent_stats(agents)}
    cpu0, t0, busy0 = cpu_seconds(web_pid), time.monotonic(), machine_busy()
    since = datetime.now(UTC).isoformat()
    stats = TrafficStats()
    if traffic is not None:
        rps, api_key = traffic

        async def run() -> None:
            stop = asyncio.Event()
            spec = paper_workload(rps=rps, duration_s=seconds, seed=1)
            task = asyncio.create_task(
                replay(
                    base_url=cp.url, api_key=api_key, model="paper-dsv4", spec=spec, stop=stop,
                    stats=stats, max_in_flight=64, **session_options(spec),
                )
            )  # fmt: skip
            await asyncio.sleep(seconds)
            stop.set()
            await asyncio.wait({task}, timeout=120)

        asyncio.run(run())
    else:
        time.sleep(seconds)
    span = time.monotonic() - t0
    cpu1, busy1 = cpu_seconds(web_pid), machine_busy()
    after = agent_stats(agents)
    answered = refused = timeouts = unreachable = 0
    p99s, maxes, p50s = [], [], []
    for s in after:
        b = before.get(s["node"], {})
        answered += s.get("heartbeats_answered", 0) - b.get("heartbeats_answered", 0)
        refused += s.get("heartbeats_refused", 0) - b.get("heartbeats_refused", 0)
        timeouts += s.get("heartbeat_timeouts", 0) - b.get("heartbeat_timeouts", 0)
        unreachable += s.get("unreachable", 0) - b.get("unreachable", 0)
        if s.get("rtt_p50_s") is not None:
            p50s.append(s["rtt_p50_s"])
            p99s.append(s["rtt_p99_s"])
            maxes.append(s["rtt_max_s"])
    offline = [
        e for e in cp.get_all("events", kind="node.offline") if e.get("created_at", "") >= since
    ]
    return {
        "seconds": round(span, 1),
        "control_plane_cpu_cores": None if cpu0 is None or cpu1 is None else (cpu1 - cpu0) / span,
        "control_plane_rss_mb": rss_mb(web_pid),
        "machine_busy": round((busy1[0] - busy0[0]) / max(busy1[1] - busy0[1], 1), 3),
        "load_avg_1m": os.getloadavg()[0],
        "heartbeats_answered": answered,
        "heartbeats_expected": round(len(agents) * span / 2.0),
        "heartbeats_refused": refused,
        "heartbeat_timeouts": timeouts,
        "control_plane_unreachable": unreachable,
        "rtt_p50_s_median_over_agents": statistics.median(p50s) if p50s else None,
        "rtt_p99_s_worst_agent": max(p99s) if p99s else None,
        "rtt_max_s": max(maxes) if maxes else None,
        "nodes_gone_offline": len(offline),
        "traffic": None
        if traffic is None
        else {"sent": stats.sent, "ok": stats.ok, "failed": stats.failed,
              "by_status": {str(k): v for k, v in stats.by_status.items()},
              "median_latency_s": statistics.median(stats.latencies) if stats.latencies else None},
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.emulated.fleet_scale")
    parser.add_argument("--idle-s", type=float, default=120.0)
    parser.add_argument("--traffic-s", type=float, default=180.0)
    parser.add_argument("--rps", type=float, default=1.0)
    parser.add_argument("--out", default=str(ROOT / "var" / "bench-fleet-scale"))
    args = parser.parse_args(argv)
    if args.idle_s <= 0 or args.traffic_s < 0 or args.rps <= 0:
        print("--idle-s and --rps must be > 0, --traffic-s >= 0", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    say("starting the control plane")
    cp = start_control_plane(out)
    agents: dict[str, AgentProcess] = {}
    try:
        web_pid = cp.cluster.processes[0].pid
        nodes = declare(cp)
        say(f"declared {len(nodes)} nodes; starting their agents")
        t0 = time.monotonic()
        start_agents(cp, nodes, agents)
        started = time.monotonic() - t0
        say(f"{len(agents)} agents up in {started:.0f} s; waiting for every instance to run")
        cp.cluster.wait_for(lambda: all_running(cp, len(nodes)), 600, "every instance to run")
        running = time.monotonic() - t0
        rss = [r for r in (rss_mb(p.proc.pid) for p in agents.values() if p.proc) if r]
        load_command_tokens(cp)
        say(f"all {len(nodes)} instances running after {running:.0f} s; idle phase")
        idle = phase(cp, agents, args.idle_s, web_pid, None)
        say(f"idle: {json.dumps(idle)}")
        loaded = None
        if args.traffic_s > 0:
            say(f"traffic phase: paper-like agentic traffic at {args.rps} req/s")
            loaded = phase(cp, agents, args.traffic_s, web_pid, (args.rps, cp.api_key))
            say(f"traffic: {json.dumps(loaded)}")
        summary = {
            "nodes": len(nodes),
            "agents_started_s": round(started, 1),
            "all_running_s": round(running, 1),
            "agent_rss_mb_median": statistics.median(rss) if rss else None,
            "agents_rss_mb_total": round(sum(rss)) if rss else None,
            "idle": idle,
            "traffic": loaded,
            "rps": args.rps,
        }
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        print(json.dumps(summary, indent=2))
    finally:
        for proc in agents.values():
            proc.kill()
            proc.cleanup()
        cp.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
