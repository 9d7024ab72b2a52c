"""`make bench-paper`: the paper's experiment on the live system (see bench/paper/scale.py for
the scaling, fixed before the first run, and bench/paper/REPORT.md for the results).

IDC-PD, CDC-PD and PDD in turn, each an emulated fleet of the paper model (profile
paper-dsv4) on GPU-A / GPU-B units, declared over the REST API on one control plane, its
agents started, its prefix caches warmed with the sessions' context so far, then the agentic
trace replayed through the gateway, in slow motion. The planner simulates the same scaled
fleet on the same trace for its prediction.

    python -m bench.paper                 # all three systems (~25 min), writes bench/paper/
    python -m bench.paper --systems pdd --window-s 20   # a development run (not written)

Raw results under var/bench-paper/.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import shutil
import sys
import threading
import time
import traceback
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from agents.node.launch import AgentProcess
from bench.harness.control_plane import ControlPlane, start_control_plane
from bench.harness.emulated import command_tokens, start_agents
from bench.harness.host import cpu_seconds, machine_busy, port_in_use
from bench.harness.prompts import (
    PAPER_SYSTEM_HEAD,
    emulated_answer,
    filler,
    stream_one,
    system_message,
    tokens_of,
)
from bench.harness.testbed import ROOT, stop_on_signals
from bench.paper import report, scale
from pdd.kv_formats import KV_FORMATS
from pdd.profiles import PAPER_GPUS
from pdd.tokenizer import apply_chat_template
from planner.api import make_trace, run_fleet
from planner.fleet import fleet_from_dict, session_home
from planner.metrics import Sla

HERE = Path(__file__).resolve().parent
BASE_PORT = 23000


def say(message: str) -> None:
    print(f"\r\033[K[paper] {message}" if sys.stderr.isatty() else f"[paper] {message}",
          file=sys.stderr, flush=True)  # fmt: skip


class Bar:
    """One status line: the system, the phase, requests sent / first token / done, time."""

    def __init__(self, total_systems: int) -> None:
        self.total = total_systems
        self.index = 0
        self.label = ""
        self.phase = ""
        self.sent = self.first = self.done = self.failed = self.planned = 0
        self.t0 = time.monotonic()
        self._stop = threading.Event()
        self._tty = sys.stderr.isatty()
        self._last = 0.0
        threading.Thread(target=self._loop, daemon=True).start()

    def line(self) -> str:
        width = 24
        fill = int(width * self.sent / self.planned) if self.planned else 0
        el = time.monotonic() - self.t0
        return (
            f"[paper] {self.index}/{self.total} {self.label} [{'#' * fill}{'-' * (width - fill)}] "
            f"{self.sent}/{self.planned} sent, {self.first} first token, {self.done} done, "
            f"{self.failed} failed | {self.phase} | {int(el // 60)}:{int(el % 60):02d}"
        )

    def _loop(self) -> None:
        while not self._stop.wait(0.5):
            if self._tty:
                sys.stderr.write("\r\033[K" + self.line()[:170])
                sys.stderr.flush()
            elif time.monotonic() - self._last > 20:
                self._last = time.monotonic()
                sys.stderr.write(self.line() + "\n")
                sys.stderr.flush()

    def close(self) -> None:
        self._stop.set()


# -- the fleet ----------------------------------------------------------------------------------


def declare_common(cp: ControlPlane) -> None:
    """GPU types of the paper's units (per chip; 8 per node) and the datacenters."""
    for name, key in (("paper-a", "GPU-A"), ("paper-b", "GPU-B")):
        spec = {k: PAPER_GPUS[key][k] for k in ("peak_bf16_tflops", "memory_gib",
                                                 "memory_bandwidth_gbps")}  # fmt: skip
        cp.gpu_types[key] = cp.post(
            "gpu-types", {"vendor": "bench", "model": name, **spec, "interconnect_gbps": 400}
        )["id"]


def declare(cp: ControlPlane, system: scale.System, ports) -> list[dict]:
    """One system's datacenters, link, prices, model, nodes and instances over REST."""
    dcs = {
        dc: cp.post(
            "datacenters",
            {"name": f"{system.key}-{dc.lower()}", "region": f"city-{dc.lower()}",
             "rdma_domain": f"{system.key}-{dc.lower()}"},
        )["id"]
        for dc in system.datacenters
    }  # fmt: skip
    if len(dcs) > 1:
        cp.post(
            "wan-links",
            {"from_datacenter": dcs["A"], "to_datacenter": dcs["B"], **scale.link(system),
             "monthly_cost": "0"},
        )  # fmt: skip
    for gpu, dc in {(p.gpu, p.datacenter) for p in system.pools}:
        cp.post(
            "unit-prices",
            {"gpu_type": cp.gpu_types[gpu], "datacenter": dcs[dc],
             # USD 2.00 / 2.50 per GPU-hour: the planner's 1.0 / 1.25 per node-hour ratio.
             "price_per_gpu_hour": f"{2.0 * scale.PRICES[gpu]:.2f}", "currency": "USD",
             "effective_from": "2026-01-01T00:00:00Z"},
        )  # fmt: skip
    model = cp.post(
        "models",
        {"name": system.model, "source": scale.PROFILE, "num_layers": 61,
         "kv_bytes_per_token": 4400, "max_context_tokens": 262_144, "kv_block_size": 16},
    )["id"]  # fmt: skip
    nodes = []
    for pool in system.pools:
        for i in range(1, pool.count + 1):
            port = next(ports)
            host = f"{system.key}-{pool.role.replace('_', '-')}-{i}"
            row = cp.post(
                "nodes",
                {"hostname": host, "datacenter": dcs[pool.datacenter],
                 "gpu_type": cp.gpu_types[pool.gpu], "gpu_count": 8,
                 "agent_endpoint": f"http://127.0.0.1:{port}"},
            )  # fmt: skip
            nodes.append({**row, "role": pool.role, "dc": f"{system.key}-{pool.datacenter.lower()}",
                          "port": port})  # fmt: skip
    for node in sorted(nodes, key=lambda n: n["role"] != "prefill"):
        inst = cp.post(
            "instances",
            {"role": node["role"], "node": node["id"], "served_model": model, "gpu_count": 8},
        )
        node["instance_id"] = str(inst["id"])
    return nodes


AGENT_OPTIONS = (
    "--kv-scale", str(scale.KV_SCALE), "--speedup", str(scale.SPEEDUP), "--log-level", "WARNING",
)  # fmt: skip


# -- the sessions -------------------------------------------------------------------------------


USER_FRAME = len("<|user|>\n") + 1
ASSISTANT_FRAME = len("<|assistant|>\n") + 1


def history_for(session: int, context: int, system: dict, tag: str) -> list[dict]:
    """A mid-life session's conversation so far, ``context`` tokens long: the shared system
    prompt, what the user and the tools said, and the assistant's last answer."""
    rng = random.Random(f"{tag}-history-{session}")
    msgs = [system]
    rest = context - tokens_of(msgs, False) - USER_FRAME - ASSISTANT_FRAME
    answer = min(400, max(rest // 10, 1))
    head = f"[s{session}] "
    msgs.append({"role": "user", "content": head + filler(rng, max(rest - answer - len(head), 1))})
    msgs.append({"role": "assistant", "content": filler(rng, answer)})
    return msgs


# -- one request --------------------------------------------------------------------------------


# -- one system ---------------------------------------------------------------------------------


def fetch_state(agents: dict[str, AgentProcess], tokens: dict[str, str]) -> dict[str, dict]:
    out = {}
    with httpx.Client(timeout=30) as http:
        for host, proc in agents.items():
            try:
                doc = http.get(
                    f"{proc.http}/state", headers={"Authorization": f"Bearer {tokens[host]}"}
                ).json()
            except (httpx.HTTPError, ValueError):
                continue
            out[host] = doc
    return out


def role_tokens(states: dict[str, dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for doc in states.values():
        for inst in doc.get("instances", []):
            out[inst["role"]] = out.get(inst["role"], 0) + int(inst.get("tokens_generated", 0))
    return out


def kv_settled(states: dict[str, dict]) -> bool:
    """Every instance's KV cache events acknowledged by the prefix index."""
    for doc in states.values():
        for inst in doc.get("instances", []):
            ev = inst.get("kv_events")
            if ev is None or ev["acked"] < ev["seq"] or ev["pending_batches"] > 0:
                return False
    return True


def run_system(cp: ControlPlane, system: scale.System, nodes: list[dict], bar: Bar,
               window_s: float, logs: Path | None = None) -> dict:  # fmt: skip
    """One system's replay; each agent's log (warnings: slow engine steps, recomputes) is kept
    under ``logs`` when given."""
    config = system.config
    trace = make_trace(config | {"workload": config["workload"] | {"duration_s": window_s}})
    n = len(trace)
    shared = int(config["workload"]["context"]["shared_prefix_tokens"])
    arrival = (trace.arrival_s / scale.SPEEDUP).tolist()  # wall seconds
    sessions = trace.session_id.tolist()
    inputs, cached = trace.input_tokens.tolist(), trace.cached_tokens.tolist()
    outputs = trace.output_tokens.tolist()
    prev = trace.previous_turn().tolist()
    system_msg = system_message(shared, PAPER_SYSTEM_HEAD)
    # The session homes and prompts: the system's (a WAN-format variant keeps its base's).
    tag = system.config["fleet"]["session_home_salt"]

    bar.phase = "agents"
    agents: dict[str, AgentProcess] = {}
    result: dict[str, Any] = {"system": system.key, "requests": n}
    try:
        start_agents(cp, nodes, agents, AGENT_OPTIONS, parallel=4)
        cp.cluster.wait_for(
            lambda: all(r["actual_state"] == "running" for r in cp.get_all("instances")
                        if r["node"] in {x["id"] for x in nodes}),
            300, "every instance to run",
        )  # fmt: skip
        tokens = command_tokens(cp)
        by_role: dict[str, list[dict]] = {}
        for node in nodes:
            by_role.setdefault(node["role"], []).append(node)

        # -- warm: every session's context so far in one P's and one MD's cache ------------
        bar.phase = "warming caches"
        t_warm = time.monotonic()
        history: dict[int, list[dict]] = {}
        warm_texts: dict[str, list[str]] = {}
        sys_text = apply_chat_template([system_msg], False)
        for role in ("prefill", "main_decode"):
            for node in by_role.get(role, []):
                warm_texts.setdefault(node["hostname"], []).append(sys_text)
        for i in range(n):
            if prev[i] >= 0 or cached[i] <= shared:
                continue
            s = sessions[i]
            history[s] = history_for(s, cached[i], system_msg, tag)
            text = apply_chat_template(history[s], False)
            for role in ("prefill", "main_decode"):
                pool = by_role[role]
                # The simulator's prediction starts from the same homes (session_home_salt).
                node = pool[session_home(tag, s, len(pool))]
                warm_texts.setdefault(node["hostname"], []).append(text)
        warm_tokens = 0
        with httpx.Client(timeout=600) as http:
            for node in nodes:
                texts = warm_texts.get(node["hostname"], [])
                for k in range(0, len(texts), 16):
                    part = texts[k : k + 16]
                    r = http.post(
                        f"http://127.0.0.1:{node['port']}/instances/{node['instance_id']}/warm",
                        json={"texts": part},
                        headers={"Authorization": f"Bearer {tokens[node['hostname']]}"},
                    )
                    r.raise_for_status()
                    warm_tokens += sum(len(t) for t in part)
        deadline = time.monotonic() + 300
        while not kv_settled(fetch_state(agents, tokens)) and time.monotonic() < deadline:
            time.sleep(1.0)
        time.sleep(3.0)  # the gateways' live view: rebuilt every 0.25 s
        result["warm"] = {"sessions": len(history), "tokens": warm_tokens,
                          "wall_s": round(time.monotonic() - t_warm, 1)}  # fmt: skip

        # -- the measured replay ------------------------------------------------------------
        web_pid = cp.cluster.processes[0].pid
        pids = {h: p.proc.pid for h, p in agents.items() if p.proc}
        results: list[dict] = [
            {"i": i, "session": sessions[i], "drawn_s": trace.arrival_s[i].item(),
             "input_tokens": inputs[i], "max_tokens": int(outputs[i])}
            for i in range(n)
        ]  # fmt: skip
        marks: dict[str, Any] = {}
        bar.planned, bar.sent, bar.first, bar.done, bar.failed = n, 0, 0, 0, 0
        bar.phase = "replay"

        async def replay() -> None:
            ended = [asyncio.Event() for _ in range(n)]
            answers: list[str | None] = [None] * n
            # Idle connections expire here before uvicorn's 5-s keep-alive timeout closes them:
            # at 5 s on both sides a request could go out on a connection the server was
            # closing (likely how 4 PDD and 1 CDC-PD requests of the run at 5eb5b9c ended:
            # ReadError after 1-2 s, before any byte of an answer, so with no record).
            limits = httpx.Limits(
                max_connections=2000, max_keepalive_connections=200, keepalive_expiry=2.0
            )
            async with httpx.AsyncClient(timeout=httpx.Timeout(3600, connect=30),
                                         limits=limits) as http:  # fmt: skip
                start = time.monotonic()
                marks["start"] = start

                async def warm_mark() -> None:
                    await asyncio.sleep(scale.WARMUP_S / scale.SPEEDUP)
                    marks["states_warm"] = await asyncio.to_thread(fetch_state, agents, tokens)
                    marks["cpu_warm"] = {
                        "web": cpu_seconds(web_pid),
                        "machine": machine_busy(),
                        **{h: cpu_seconds(p) for h, p in pids.items()},
                    }
                    marks["t_warm"] = time.monotonic()

                async def turn(i: int) -> None:
                    await asyncio.sleep(max(0.0, start + arrival[i] - time.monotonic()))
                    j = prev[i]
                    if j >= 0:
                        await ended[j].wait()
                    s = sessions[i]
                    msgs = history.get(s)
                    if msgs is None or cached[i] <= shared:
                        msgs = [system_msg]
                        size = (
                            inputs[i] - tokens_of(msgs, False) - USER_FRAME - len("<|assistant|>\n")
                        )
                        rng = random.Random(f"{tag}-{i}")
                        msgs = msgs + [{"role": "user", "content": f"[{tag}s{s}t{i}] "
                                        + filler(rng, max(size - 16, 8))}]  # fmt: skip
                    else:
                        if j >= 0 and answers[j]:
                            msgs = msgs + [{"role": "assistant", "content": answers[j]}]
                        size = inputs[i] - tokens_of(msgs, True) - USER_FRAME
                        rng = random.Random(f"{tag}-{i}")
                        msgs = msgs + [{"role": "user", "content": filler(rng, max(size, 8))}]
                    history[s] = msgs
                    res = results[i]
                    res["sent_wall"] = time.monotonic() - start
                    res["prompt_ids_digest"] = len(apply_chat_template(msgs, True))
                    bar.sent += 1

                    def first() -> None:
                        bar.first += 1

                    text = await stream_one(http, cp.url, cp.api_key, system.model, msgs,
                                            res["max_tokens"], res, first)  # fmt: skip
                    answers[i] = text if res.get("completed") else None
                    if res.get("completed"):
                        bar.done += 1
                        ids = list(apply_chat_template(msgs, True).encode("utf-8"))
                        want = emulated_answer(ids, res.get("completion_tokens", 0))
                        res["exact"] = bytes(want).decode("utf-8", "replace") == text
                    else:
                        bar.failed += "error" in res
                    ended[i].set()

                mark = asyncio.create_task(warm_mark())
                tasks = [asyncio.create_task(turn(i)) for i in range(n)]
                # Arrivals end with the window; the fleet keeps running (decoding included) until
                # every measured request has its first token, at most DRAIN_S more.
                await asyncio.sleep(max(0.0, start + window_s / scale.SPEEDUP - time.monotonic()))
                bar.phase = "drain"
                stop_at = start + (window_s + scale.DRAIN_S) / scale.SPEEDUP
                measured = [r for r in results if r["drawn_s"] >= scale.WARMUP_S]
                while time.monotonic() < stop_at and not all(
                    "ttft_wall" in r or "error" in r or r.get("completed") for r in measured
                ):
                    await asyncio.sleep(1.0)
                marks["states_end"] = await asyncio.to_thread(fetch_state, agents, tokens)
                marks["cpu_end"] = {
                    "web": cpu_seconds(web_pid),
                    "machine": machine_busy(),
                    "client": cpu_seconds(os.getpid()),
                    **{h: cpu_seconds(p) for h, p in pids.items()},
                }
                marks["t_end"] = time.monotonic()
                await mark
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

        replay_began = datetime.now(UTC).isoformat()
        asyncio.run(replay())
        bar.phase = "collecting"
        time.sleep(3.0)  # records of the cut streams
        records = [r for r in cp.get_all("requests") if r.get("model") == system.model]
        # Nodes of this system the control plane took offline while the fleet ran (a heartbeat
        # flap: the agents never stop during the run).
        hosts = {n["hostname"] for n in nodes}
        offline = [
            e for e in cp.get_all("events", kind="node.offline")
            if e.get("created_at", "") >= replay_began and any(h in e.get("message", "")
                                                                for h in hosts)
        ]  # fmt: skip
        result |= {
            "results": results,
            "records": records,
            "nodes_gone_offline": len(offline),
            "marks": {
                k: v for k, v in marks.items() if k.startswith(("states", "cpu", "t_", "start"))
            },
        }
    finally:
        for host, proc in agents.items():
            proc.kill()
            if logs is not None and proc.log_path:
                logs.mkdir(parents=True, exist_ok=True)
                with contextlib.suppress(OSError):
                    shutil.copyfile(proc.log_path, logs / f"{host}.log")
            proc.cleanup()
    return result


def simulate(system: scale.System, window_s: float) -> dict:
    config = system.config
    config = config | {"workload": config["workload"] | {"duration_s": window_s}}
    fleet = fleet_from_dict(config["fleet"])
    trace = make_trace(config)
    summary, _ = run_fleet(
        fleet, trace, Sla(scale.SLA["ttft_p90_s"], scale.SLA["ttft_p99_s"]), scale.WARMUP_S
    )
    return {
        "ttft_s": {k: summary["ttft_s"][k] for k in ("p50", "p90", "p99")},
        "rld_share": summary["tokens"]["relay_share"],
        "pipelines": summary["pipelines"],
        "wan_utilisation": summary["wan_link_utilisation"],
        "requests": summary["requests"],
        "sla_met": summary["sla"]["met"],
        "cost_per_hour": summary["cost_per_hour"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.paper")
    parser.add_argument("--systems", default="idc-pd,cdc-pd,pdd")
    parser.add_argument(
        "--window-s",
        type=float,
        default=scale.WINDOW_S,
        help="modelled seconds of arrivals (a shorter run is not written)",
    )
    parser.add_argument(
        "--wan-formats",
        default="own",
        help="comma-separated KV formats for the WAN link, each system run once per format "
        f"in turn ('own': the engines'; or {', '.join(KV_FORMATS)}); a system without a WAN "
        "link runs only 'own'",
    )
    parser.add_argument("--out", default=str(ROOT / "var" / "bench-paper"))
    args = parser.parse_args(argv)
    stop_on_signals()  # the agents and the control plane are stopped in the finally blocks
    catalogue = scale.systems()
    wanted = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in catalogue]
    if unknown or not wanted:
        print(f"--systems: unknown {unknown} (known: {', '.join(catalogue)})", file=sys.stderr)
        return 2
    formats = [f.strip() for f in args.wan_formats.split(",") if f.strip()]
    bad = [f for f in formats if f != "own" and f not in KV_FORMATS]
    if bad or not formats:
        print(f"--wan-formats: unknown {bad} (known: own, {', '.join(KV_FORMATS)})",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.window_s <= scale.WARMUP_S:
        print(f"--window-s must be > the warm-up ({scale.WARMUP_S:g} s)", file=sys.stderr)
        return 2
    full = wanted == list(catalogue) and args.window_s == scale.WINDOW_S and formats == ["own"]
    runs: dict[str, scale.System] = {}
    for key in wanted:
        for fmt in formats:
            if fmt == "own":
                runs[key] = catalogue[key]
            elif len(catalogue[key].datacenters) > 1:
                variant = scale.with_wan_format(catalogue[key], fmt)
                runs[variant.key] = variant
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    began = time.monotonic()
    bar = Bar(len(runs))
    say("starting the control plane")
    # The gateway's wall-clock limits stretched as the fleet is (slow motion): a first token
    # 8x later is not a frozen P.
    stretch = 1.0 / scale.SPEEDUP
    cp = start_control_plane(
        out,
        {
            "BATON_GATEWAY_FIRST_TOKEN_TIMEOUT_S": str(60.0 * stretch),
            "BATON_GATEWAY_STALL_S": str(1.6 * stretch),
            "BATON_GATEWAY_QUEUE_TIMEOUT_S": str(60.0 * stretch),
        },
    )
    results: dict[str, Any] = {
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "window_s": args.window_s,
        "systems": {},
    }
    try:
        declare_common(cp)
        ports = (p for p in range(BASE_PORT, BASE_PORT + 2000) if not port_in_use("127.0.0.1", p))
        fleets = {key: declare(cp, system, ports) for key, system in runs.items()}
        for index, (key, system) in enumerate(runs.items(), 1):
            bar.index, bar.label = index, system.label
            say(f"{system.label}: {', '.join(f'{p.count} {p.role} {p.gpu}' for p in system.pools)}")
            try:
                live = run_system(
                    cp, system, fleets[key], bar, args.window_s, logs=out / "agents" / key
                )
            except Exception:  # noqa: BLE001 - reported, the other systems still run
                live = {"error": traceback.format_exc()[-2000:]}
                say(f"{system.label} failed: {live['error'][-300:]}")
            (out / f"{key}.json").write_text(json.dumps(live, default=float) + "\n")
            bar.phase = "simulating"
            predicted = simulate(system, args.window_s)
            results["systems"][key] = {
                "live": report.summarise(live, system) if "error" not in live else live,
                "predicted": predicted,
                "cost_per_hour": system.cost_per_hour,
                "pools": [p.__dict__ for p in system.pools],
                "wan_format": scale.link(system)["kv_format"] or "own",
            }
            say(f"{system.label}: {json.dumps(results['systems'][key]['live'])[:400]}")
    finally:
        bar.close()
        cp.stop()
    results["wall_s"] = round(time.monotonic() - began, 1)
    (out / "summary.json").write_text(json.dumps(results, indent=2, default=float) + "\n")
    text = report.render(results)
    (out / "REPORT.md").write_text(text)
    if full:
        (HERE / "summary.json").write_text(json.dumps(results, indent=2, default=float) + "\n")
        (HERE / "REPORT.md").write_text(text)
    say(f"done in {results['wall_s'] / 60:.1f} min; report: {out / 'REPORT.md'}")
    return 0
