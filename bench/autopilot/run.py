"""The autopilot's live benchmark: an emulated fleet, a rate that doubles, the automatic mode.

The scenario, fixed before the first run (never retuned after seeing a result):

* **Fleet** (declared over REST, emulated agents at real time: ``--speedup 1``, KV bytes on
  the wire / 100 and the link shaped alike): datacenter A with 4 GPU-A nodes, datacenter B with
  3 GPU-B nodes (the paper's 8-chip units, USD 2.00 / 2.50 per GPU-hour), joined by the paper's
  WAN scaled as bench/paper does (2.5 Gbit/s, 20 ms, 10 connections); served model
  ``profile:paper-dsv4``. At the start one prefill node (a-1) and one main decoder (b-1) run;
  the other five nodes run an idle agent each (free capacity the autopilot may start on).
* **Traffic** (open loop, seeded): single-turn chat requests, each a shared 1K-token system
  prompt and a fresh user message, prompt lengths and answer lengths drawn from
  planner/scenarios/autopilot-demo.json's workload (log-normal, median 16K and 32 tokens),
  arriving as a Poisson process of RATE_LOW req/s for RAMP_AT_S, rising linearly to
  RATE_HIGH = 2 x RATE_LOW over RAMP_S (the rate doubles within one minute), then RATE_HIGH
  until RUN_S; then at most DRAIN_S more for the last answers.
* **Autopilot** (PATCH /api/v1/autopilot/settings/ before the traffic): automatic mode, scenario
  ``autopilot-demo``, SLA P90 TTFT <= 10 s and P99 <= 15 s, a proposal every 30 s over a 120-s
  window, cool-down 60 s, at most 4 changes per step, floors 1 P / 1 MD / 0 RLD, no budget.
* **Measured** (the client's clock): TTFT of every request by the minute it arrived; the
  minute from which every later full minute meets the SLA; every proposal and its steps; the
  fleet's cost per hour at the end; the applied proposal's predicted P90 TTFT and cost beside
  the realised ones (its first 5-minute window, the requests that arrived in it: the fleet
  stays up after the replay until the autopilot has recorded it, at most REALISED_WAIT_S);
  every answer checked against the emulated engine's tokens and its record.

**Late ramp** (``--late-ramp``, fixed before its first run, after the third run of the
default scenario scaled up before its ramp on a first-minute burst): the same scenario with
the ramp at LATE_RAMP_AT_S and arrivals until LATE_RUN_S, so that the autopilot has fitted the
fleet to the low rate (its scale-down stabilisation holds a shrink for 300 s after a proposal
that wanted more) before the rate doubles; the goals are the same.

Goals (issue 41): the SLA met again within 5 minutes of the ramp (every minute from one that
starts at most 300 s after the ramp's end meets it); the fleet's cost at most 10% above the
cheapest fleet ``planner size`` finds offline for the new rate (the same scenario, the run's
fleet, the workload fitted to the run's records); the predicted P90 TTFT and cost per hour of
the applied fleet within 15% of the realised; 0 requests lost or failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import shutil
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from agents.node.launch import AgentProcess
from bench.harness.control_plane import ControlPlane
from bench.harness.emulated import start_agents
from bench.harness.prompts import (
    PAPER_SYSTEM_HEAD,
    emulated_answer,
    filler,
    stream_one,
    system_message,
    tokens_of,
)
from pdd.profiles import PAPER_GPUS
from pdd.tokenizer import apply_chat_template

SCENARIO = "autopilot-demo"
MODEL = "bench-autopilot"
PROFILE = "profile:paper-dsv4"
RATE_LOW = 0.6  # req/s: one prefill node meets the SLA (the simulator: P90 ~6 s)
RATE_HIGH = 2 * RATE_LOW  # one prefill node cannot (P90 ~42 s); two can (~5 s)
RAMP_AT_S = 120.0
LATE_RAMP_AT_S = 480.0
LATE_RUN_S = 900.0
RAMP_S = 60.0
RUN_S = 600.0
DRAIN_S = 60.0
# After the replay, the fleet stays up at most this long for the autopilot's first realised
# window of its first applied proposal (added after the second --late-ramp run ended before
# it was taken, so the prediction could not be judged).
REALISED_WAIT_S = 420.0
TICK_S = 15.0  # the autopilot's tick (10 s) and a margin
# plans.autopilot's realised window and its settle time (a test keeps them equal).
REALISED_WINDOW_S = 300.0
REALISED_SETTLE_S = 60.0
SEED = 7
SHARED_TOKENS = 1024
SLA = {"ttft_p90_s": 10.0, "ttft_p99_s": 15.0}
RECOVER_WITHIN_S = 300.0  # after the ramp's end
COST_WITHIN = 0.10
PREDICTION_WITHIN = 0.15
NODES = {"A": ("GPU-A", 4, "prefill"), "B": ("GPU-B", 3, "main_decode")}
PRICES = {"GPU-A": "2.00", "GPU-B": "2.50"}
LINK = {"bandwidth_gbps": 2.5, "rtt_ms": 20.0, "connection_pool_size": 10}
AUTOPILOT = {
    "automatic": True,
    "scenario": SCENARIO,
    "p90": SLA["ttft_p90_s"],
    "p99": SLA["ttft_p99_s"],
    "interval_s": 30,
    "window_s": 120,
    "cooldown_s": 60,
    "max_change_per_step": 4,
    "floors": {"prefill": 1, "main_decode": 1, "relay_decode": 0},
    "budget_per_hour": None,
}
AGENT_OPTIONS = ("--kv-scale", "100", "--speedup", "1", "--log-level", "WARNING")


def rate_at(t: float) -> float:
    """The arrival rate (req/s) at t seconds into the run."""
    if t < RAMP_AT_S:
        return RATE_LOW
    if t < RAMP_AT_S + RAMP_S:
        return RATE_LOW + (RATE_HIGH - RATE_LOW) * (t - RAMP_AT_S) / RAMP_S
    return RATE_HIGH


def arrivals(
    seed: int = SEED, run_s: float = RUN_S, rate=rate_at, peak: float = RATE_HIGH
) -> list[float]:
    """Arrival times of a Poisson process of rate ``rate(t)`` (thinning at ``peak``, its
    highest rate)."""
    rng = random.Random(seed)
    out, t = [], 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= run_s:
            return out
        if rng.random() < rate(t) / peak:
            out.append(t)


def lengths(n: int, seed: int = SEED) -> tuple[list[int], list[int]]:
    """(prompt tokens, answer tokens) of n requests, from the scenario's workload."""
    import numpy as np

    from planner.scenario import case_configs, load_scenario
    from planner.workload import LengthDist

    work = next(iter(case_configs(load_scenario(SCENARIO)).values()))["workload"]
    rng = np.random.default_rng(seed)

    def dist(spec: dict) -> LengthDist:
        return LengthDist(**{k: v for k, v in spec.items() if not k.startswith("_")})

    prompts = dist(work["input_tokens"]).sample(rng, n).tolist()
    answers = dist(work["output_tokens"]).sample(rng, n).tolist()
    return [max(int(p), SHARED_TOKENS + 256) for p in prompts], [int(a) for a in answers]


def declare(
    cp: ControlPlane, ports, nodes_per_dc: dict[str, tuple[str, int, str]] | None = None
) -> tuple[list[dict], int]:
    """GPU types, datacenters, link, prices, model, the nodes (NODES: 7) and the 2 starting
    instances (on auto-a-1 and auto-b-1) over REST; (nodes, served model id)."""
    gpu_ids = {}
    for key, name in (("GPU-A", "paper-a"), ("GPU-B", "paper-b")):
        spec = {k: PAPER_GPUS[key][k] for k in ("peak_bf16_tflops", "memory_gib",
                                                 "memory_bandwidth_gbps")}  # fmt: skip
        gpu_ids[key] = cp.post(
            "gpu-types", {"vendor": "bench", "model": name, **spec, "interconnect_gbps": 400}
        )["id"]
    dcs = {
        dc: cp.post(
            "datacenters",
            {
                "name": f"auto-{dc.lower()}",
                "region": f"city-{dc.lower()}",
                "rdma_domain": f"auto-{dc.lower()}",
            },
        )["id"]  # fmt: skip
        for dc in (nodes_per_dc or NODES)
    }
    cp.post("wan-links", {"from_datacenter": dcs["A"], "to_datacenter": dcs["B"], **LINK,
                          "monthly_cost": "0"})  # fmt: skip
    for dc, (gpu, _, _) in (nodes_per_dc or NODES).items():
        cp.post("unit-prices", {"gpu_type": gpu_ids[gpu], "datacenter": dcs[dc],
                                "price_per_gpu_hour": PRICES[gpu], "currency": "USD",
                                "effective_from": "2026-01-01T00:00:00Z"})  # fmt: skip
    model = cp.post(
        "models",
        {"name": MODEL, "source": PROFILE, "num_layers": 61, "kv_bytes_per_token": 4400,
         "max_context_tokens": 262_144, "kv_block_size": 16},
    )["id"]  # fmt: skip
    nodes = []
    for dc, (gpu, count, role) in (nodes_per_dc or NODES).items():
        for i in range(1, count + 1):
            port = next(ports)
            host = f"auto-{dc.lower()}-{i}"
            row = cp.post("nodes", {"hostname": host, "datacenter": dcs[dc],
                                    "gpu_type": gpu_ids[gpu], "gpu_count": 8,
                                    "agent_endpoint": f"http://127.0.0.1:{port}"})  # fmt: skip
            nodes.append({**row, "role": role, "dc": f"auto-{dc.lower()}", "port": port})
    for node in nodes:
        if node["hostname"] in ("auto-a-1", "auto-b-1"):
            cp.post("instances", {"role": node["role"], "node": node["id"],
                                  "served_model": model, "gpu_count": 8})  # fmt: skip
    return nodes, model


def start_fleet(
    cp: ControlPlane,
    ports,
    agents: dict[str, AgentProcess],
    nodes_per_dc: dict[str, tuple[str, int, str]] | None = None,
    parallel: int = 4,
) -> tuple[list[dict], int]:
    """``declare``, start every node's agent into ``agents`` (the caller stops them) and wait
    for the two starting instances to run; (nodes, served model id)."""
    nodes, model = declare(cp, ports, nodes_per_dc)
    start_agents(cp, nodes, agents, AGENT_OPTIONS, parallel=parallel)
    cp.cluster.wait_for(
        lambda: [r["actual_state"] for r in cp.get_all("instances")] == ["running"] * 2,
        300, "the two starting instances to run",
    )  # fmt: skip
    return nodes, model


def _api(cp: ControlPlane, method: str, path: str, body: dict | None = None) -> Any:
    with cp.cluster.api() as api:
        r = api.request(method, f"/api/v1/{path}", json=body)
    if r.status_code >= 300:
        raise RuntimeError(f"{method} /api/v1/{path} -> {r.status_code}: {r.text[:300]}")
    return r.json()


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


def per_minute(results: list[dict], run_s: float = RUN_S) -> list[dict]:
    """TTFT figures of the requests that arrived in each minute of the run."""
    out = []
    for k in range(int(math.ceil(run_s / 60))):
        rows = [r for r in results if k * 60 <= r["arrival_s"] < (k + 1) * 60]
        ttft = [r["ttft_s"] for r in rows if r.get("ttft_s") is not None]
        p90, p99 = quantile(ttft, 0.9), quantile(ttft, 0.99)
        unanswered = sum(1 for r in rows if r.get("ttft_s") is None)
        met = bool(rows) and unanswered == 0 and p90 is not None and p99 is not None
        met = met and p90 <= SLA["ttft_p90_s"] and p99 <= SLA["ttft_p99_s"]
        out.append({"minute": k, "from_s": k * 60, "requests": len(rows),
                    "p50": quantile(ttft, 0.5), "p90": p90, "p99": p99,
                    "unanswered": unanswered, "met": met})  # fmt: skip
    return out


def recovered_at(minutes: list[dict]) -> float | None:
    """The start of the first minute after the ramp began from which every later minute meets
    the SLA; None when the last minute does not."""
    first = None
    for m in minutes:
        if m["from_s"] < RAMP_AT_S:
            continue
        first = (m["from_s"] if first is None else first) if m["met"] else None
    return first


async def replay(cp: ControlPlane, times: list[float], prompts: list[int], answers: list[int],
                 progress, tag: str = "") -> list[dict]:  # fmt: skip
    """Send every request at its time; each one's outcome (client clock). ``tag`` makes the
    prompts of another call differ from this one's."""
    system = system_message(SHARED_TOKENS, PAPER_SYSTEM_HEAD)
    results = [{"i": i, "arrival_s": t, "prompt_tokens": prompts[i], "max_tokens": answers[i]}
               for i, t in enumerate(times)]  # fmt: skip
    limits = httpx.Limits(max_connections=500, max_keepalive_connections=100, keepalive_expiry=2.0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=30), limits=limits) as http:
        start = time.monotonic()

        async def one(i: int) -> None:
            res = results[i]
            await asyncio.sleep(max(0.0, start + res["arrival_s"] - time.monotonic()))
            size = prompts[i] - tokens_of([system], False) - len("<|user|>\n") - 1
            size -= len("<|assistant|>\n")
            rng = random.Random(f"autopilot-{SEED}-{tag}{i}")
            head = f"[{tag}r{i}] "  # the benchmark's own prompts: tag ""
            text = head + filler(rng, max(size - 8 - len(tag), 8))
            msgs = [system, {"role": "user", "content": text}]
            text = await stream_one(http, cp.url, cp.api_key, MODEL, msgs, answers[i], res,
                                    progress.first)  # fmt: skip
            res["ttft_s"] = res.get("ttft_wall")
            if res.get("completed"):
                ids = list(apply_chat_template(msgs, True).encode("utf-8"))
                want = emulated_answer(ids, res.get("completion_tokens", 0))
                res["exact"] = bytes(want).decode("utf-8", "replace") == text
                progress.done += 1
            else:
                progress.failed += 1

        tasks = [asyncio.create_task(one(i)) for i in range(len(times))]
        deadline = start + RUN_S + DRAIN_S
        while time.monotonic() < deadline and not all(t.done() for t in tasks):
            progress.elapsed = time.monotonic() - start
            await asyncio.sleep(1.0)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for res in results:
        res.pop("ttft_wall", None)
    return results


def offline_size(cp: ControlPlane, profile_window_s: int = 300) -> dict:
    """What `planner size` finds offline for the new rate: the run's fleet in the database,
    the scenario, the workload fitted to the run's last records."""
    code = (
        "import json\n"
        "from plans.autopilot import _inputs, settings_get\n"
        "from plans.profile import workload_overrides, workload_profile\n"
        "from planner.size import size\n"
        "row = settings_get()\n"
        "inputs = _inputs(row)\n"
        "fleet = inputs['fleet_spec']\n"
        "fleet['pools'] = [{k: p[k] for k in ('role', 'gpu', 'datacenter')} | {'count': 1 if "
        "p['role'] != 'relay_decode' else 0} for p in inputs['search_space']['pools']]\n"
        f"prof = workload_profile({profile_window_s}, model={MODEL!r})\n"
        f"out = size({SCENARIO!r}, {RATE_HIGH}, fleet=fleet, sla={SLA!r}, "
        "workload=workload_overrides(prof), workers=1, bcr_scan=(), band_pct=0, "
        "constants_pct=0, seeds=0, max_count=64)\n"
        "print(json.dumps({'cheapest': out['cheapest'], 'unit_prices': out['unit_prices']}))\n"
    )
    return json.loads(cp.cluster.shell(code, timeout=600).strip().splitlines()[-1])


def realised_due(proposals: list[dict], now: float) -> float | None:
    """When the first applied proposal's first realised window will be recorded (epoch
    seconds: its window of REALISED_WINDOW_S after apply, REALISED_SETTLE_S for the last
    answers, a tick more), or None when it is recorded already or none was applied."""
    applied = [p for p in proposals if p.get("applied_at")]
    if not applied:
        return None
    first = min(applied, key=lambda p: p["applied_at"])
    if first.get("realised"):
        return None
    at = datetime.fromisoformat(first["applied_at"]).timestamp()
    return at + REALISED_WINDOW_S + REALISED_SETTLE_S + TICK_S


def wait_for_realised(cp: ControlPlane) -> None:
    """Keep the fleet up until the autopilot has recorded how its first applied proposal
    came out (its first realised window), at most REALISED_WAIT_S: the prediction is judged
    on it. The window's requests are those that arrived in it; arrivals may have ended
    before it does."""
    deadline = time.time() + REALISED_WAIT_S
    while time.time() < deadline:
        due = realised_due(cp.get_all("autopilot/proposals"), time.time())
        if due is None or due > deadline:
            return
        time.sleep(min(5.0, max(0.5, due - time.time())))


def run(cp: ControlPlane, ports, out: Path, progress, run_s: float = RUN_S) -> dict:
    """Declare, start the agents, set the autopilot, replay, collect."""
    agents: dict[str, AgentProcess] = {}
    result: dict[str, Any] = {}
    try:
        progress.phase = "agents"
        nodes, model = start_fleet(cp, ports, agents)
        result["nodes"] = {str(n["id"]): n["hostname"] for n in nodes}
        _api(cp, "PATCH", "autopilot/settings/", {**AUTOPILOT, "served_model": model})
        times = arrivals(run_s=run_s)
        prompts, answers = lengths(len(times))
        progress.phase, progress.planned = "replay", len(times)
        results = asyncio.run(replay(cp, times, prompts, answers, progress))
        # The fleet the traffic ran on, judged against the offline answer: taken before the
        # wait below, in which the autopilot may shrink it for the rate that has stopped (the
        # first --late-ramp run with the wait judged the fleet of a scale-down made then).
        instances = cp.get_all("instances")
        progress.phase = "waiting for the realised window"
        wait_for_realised(cp)
        progress.phase = "collecting"
        time.sleep(3.0)
        records = [r for r in cp.get_all("requests") if r.get("model") == MODEL]
        proposals = [_api(cp, "GET", f"autopilot/proposals/{p['id']}/")
                     for p in cp.get_all("autopilot/proposals")]  # fmt: skip
        events = [
            e for e in cp.get_all("events") if str(e.get("kind", "")).startswith("autopilot.")
        ]
        result |= {"results": results, "records": records, "proposals": proposals,
                   "instances": instances, "events": events}  # fmt: skip
        progress.phase = "offline sizing"
        result["offline"] = offline_size(cp)
    finally:
        for host, proc in agents.items():
            proc.kill()
            if proc.log_path:
                (out / "agents").mkdir(parents=True, exist_ok=True)
                with contextlib.suppress(OSError):
                    shutil.copyfile(proc.log_path, out / "agents" / f"{host}.log")
            proc.cleanup()
    return result
