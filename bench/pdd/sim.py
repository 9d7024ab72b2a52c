"""The planner on the same scaled scenario: the testbed's link, its fleets' prices, the engine
step times measured on this machine (``calibrate``), the same trace (same workload, seed and
rate), the same policies. Each live system becomes a planner fleet with one unit per role.

The fitted engine maps onto the planner's formulas exactly: with a chip of 1 TFLOP/s at
efficiency 1, prefill seconds = overhead + a x new + b x new x (cached + new / 2) gives
``active_params_b`` = a x 500 and ``attn_flops_per_token_ctx`` = b x 1e12; a decode step =
overhead + c x context tokens gives memory bandwidth = KV bytes per token / c (efficiency 1,
weights negligible).

The testbed runs every engine as a one-thread process on one machine, beside the control plane
(gateway) and the load client, so :func:`testbed_host` puts the simulated fleet on a shared
host of this machine's cores (``fleet.host``, planner/host.py: each busy engine's work is
stretched by max(1, busy tasks / cores)), with the gateway's CPU per request as measured in
bench/gateway/REPORT.md. Without ``host`` every engine runs alone at its measured speed.
"""

from __future__ import annotations

import math
import os
from typing import Any

from bench.harness.control_plane import HEARTBEAT_S
from bench.pdd import scaling
from bench.pdd.fleet import AGENT_NUM_BLOCKS, SYSTEMS
from planner.api import run_fleet
from planner.fleet import fleet_from_dict
from planner.metrics import Sla
from planner.workload import generate

# Assumptions for a run that did not measure its KV fabric (calibrate.measure_fabric): loopback
# TCP between agent processes, ~1 GB/s, 0.5 ms. Measured on idle agents on 2026-12-03 it was
# 24.7 ms + 1.03 Gbit/s (bench/planner/calibration_fabric.json).
INTRA_DC_GBPS = 8.0
INTRA_DC_LATENCY_MS = 0.5
AGENT_MAX_RUNNING = 32  # agents' default decode slots
AGENT_BATCH_TOKENS = 2048  # agents' default prefill chunk (EngineConfig.max_batch_tokens)
# The control plane's CPU per gateway request at 1 stream (bench/gateway/REPORT.md, "The
# gateway's own overhead per request": 18.3 ms, 24.2 ms per request less 5.9 ms of background).
GATEWAY_CPU_S = 0.0183


def testbed_host(cores: int | None = None) -> dict[str, Any]:
    """The live testbed's machine as a planner host: its cores (this machine's by default)
    shared by the engines, and the gateway's CPU per request."""
    return {"cores": cores or os.cpu_count() or 1, "request_cpu_s": GATEWAY_CPU_S}


def fleet_dict(
    system: str,
    engine: dict[str, Any],
    host: dict[str, Any] | None = None,
    reports_s: float = HEARTBEAT_S,
    decision_in_flight: bool = True,
) -> dict[str, Any]:
    """The live ``system`` as a planner fleet, its policy seeing what the live gateway sees.

    ``reports_s``: the WAN link's use as the agents' heartbeats report it, every this many
    seconds (the testbed's heartbeat interval; 0: its use at the moment of each decision, the
    rule before this was modelled). ``decision_in_flight``: MD's prefix counts the KV already
    on its way to it, as the gateway counts an MD agent's ``incoming_prefix_blocks``
    (``fleet.decision_counts_in_flight``; off: landed KV only, the rule before)."""
    spec = SYSTEMS[system]
    kv = scaling.KV_BYTES_PER_TOKEN
    pre, dec = engine["prefill"], engine["decode"]
    kv_gb = AGENT_NUM_BLOCKS * 16 * kv / 1e9
    resident = 1e-3
    # The KV fabric as measured on the agents (calibrate.fit_fabric), when the run measured it;
    # else the old assumption (runs before 2026-12-03).
    fabric = engine.get("fabric") or {}
    chip = {
        "peak_tflops": 1.0,
        "mem_gb": resident + kv_gb,
        "mem_bw_tbps": kv / max(dec["per_ctx_token_s"], 1e-12) / 1e12,
        "interconnect_gbps": fabric.get("gbps", INTRA_DC_GBPS),
    }
    gpu_types = {}
    pools = []
    for node in spec.nodes:
        name = f"{node.gpu}x{scaling.GPUS[node.role]}"
        gpu_types[name] = {
            **chip,
            "unit_price": scaling.PRICES[node.gpu] * scaling.GPUS[node.role],
        }
        dc = "A" if node.dc == spec.datacenters[0][0] else "B"
        if system == "idc-pd":
            dc = "A"
        pools.append({"role": node.role, "gpu": name, "count": 1, "datacenter": dc})
    link = scaling.WAN_LINK
    links = {}
    if system != "idc-pd":
        links["B"] = {
            "bandwidth_gbps": link["bandwidth_gbps"],
            "rtt_ms": link["rtt_ms"],
            "per_connection_gbps": link["bandwidth_gbps"],  # the agents' shaper has no cap
            "pool_size": link["connection_pool_size"],
        }
        if reports_s:
            links["B"]["report_interval_s"] = reports_s
        if fabric.get("wan_handoff"):
            # The measured handoff's fixed work (export, import) on the WAN path too.
            links["B"]["handoff_ms"] = fabric["latency_ms"]
    extra = {"host": dict(host)} if host is not None else {}
    return {
        **extra,
        "system": system,
        "gpu_types": gpu_types,
        "model": {
            "name": "baton-tiny",
            "active_params_b": max(pre["per_token_s"] * 500.0, 1e-9),
            "attn_flops_per_token_ctx": max(pre["per_pair_s"] * 1e12, 1e-9),
            "kv_bytes_per_token": kv,
            "decode_weight_gb": 1e-6,
        },
        "pools": pools,
        "links": links,
        "engine": {
            "prefill_efficiency": 1.0,
            "prefill_overhead_s": max(pre["overhead_s"], 1e-6),
            "prefill_batch_tokens": AGENT_BATCH_TOKENS,
            "decode_mem_efficiency": 1.0,
            "decode_overhead_s": max(dec["overhead_s"], 0.0),
            "max_decode_batch": AGENT_MAX_RUNNING,
            "prefill_half_tokens": 0,
            "prefill_order": "fifo",
        },
        "fabric": {
            "latency_ms": fabric.get("latency_ms", INTRA_DC_LATENCY_MS),
            # A relay's handoff, measured apart (calibrate.measure_fabric kind="relay").
            **(
                {"relay_latency_ms": relay["latency_ms"], "relay_gbps": relay["gbps"]}
                if (relay := fabric.get("relay"))
                else {}
            ),
        },
        "policy": spec.policy_settings(),
        "handoff": "adaptive",
        "decision_counts_in_flight": decision_in_flight,
        "resident_weight_gb": resident,
        "drc_capacity_gb": kv_gb,
    }


def simulate(
    system: str,
    engine: dict,
    rps: float,
    duration_s: float,
    sla: dict,
    host: dict[str, Any] | None = None,
    reports_s: float = HEARTBEAT_S,
    decision_in_flight: bool = True,
) -> dict:
    """The planner's summary for one (system, rate), on the trace the live run replays; on a
    shared ``host`` (:func:`testbed_host`) when given, else every engine on its own;
    ``reports_s`` and ``decision_in_flight`` as in :func:`fleet_dict`."""
    fleet = fleet_from_dict(fleet_dict(system, engine, host, reports_s, decision_in_flight))
    trace = generate(scaling.workload(rps=rps, duration_s=duration_s))
    summary, record = run_fleet(fleet, trace, Sla(sla["ttft_p90_s"], sla["ttft_p99_s"]), 0.0)
    out = {
        "ttft_s": {k: summary["ttft_s"][k] for k in ("p50", "p90", "p99")},
        "e2e_s": {k: summary["e2e_s"][k] for k in ("p50", "p90")},
        "rld_share": summary["tokens"]["relay_share"],
        "pipelines": summary["pipelines"],
        "wan_utilisation": summary["wan_link_utilisation"],
        "requests": summary["requests"],
        "unfinished": summary["unfinished"],
        "sla_met": summary["sla"]["met"],
        "cost_per_hour": summary["cost_per_hour"],
        "means": request_means(record),
    }
    if "host" in summary:
        out["host"] = {
            "cores": summary["host"]["cores"],
            "request_cpu_s": summary["host"]["request_cpu_s"],
            "cpu": role_cores(summary["host"]["cpu_s"], summary["host"]["span_s"]),
        }
    return out


def request_means(record) -> dict[str, float]:
    """Mean seconds per answered request in P (arrival to P's last token ready) and from there
    to the first token: the live records' ``prefill_s`` and ``kv_wait_s``."""
    ttft = record.ttft_s
    prefill = record.prefill_done_s - record.arrival_s
    ok = ~(ttft != ttft) & ~(prefill != prefill)  # both known (not NaN)
    if not ok.any():
        return {"prefill_s": math.nan, "kv_wait_s": math.nan}
    return {
        "prefill_s": float(prefill[ok].mean()),
        "kv_wait_s": float((ttft[ok] - prefill[ok]).mean()),
    }


def role_cores(cpu_s: dict[str, float], span_s: float) -> dict[str, float]:
    """CPU seconds per host task (instance ids, "gateway") as cores per role over ``span_s``."""
    out: dict[str, float] = {}
    for name, seconds in cpu_s.items():
        role = name.split("-", 1)[0]
        out[role] = out.get(role, 0.0) + (seconds / span_s if span_s > 0 else 0.0)
    return out
