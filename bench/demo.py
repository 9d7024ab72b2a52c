"""`make demo`: the control plane on the embedded defaults, the demo fleet's agents on
localhost (P and RLD in dc-a, MD in dc-b, a shaped WAN link between), and gentle agentic traffic,
so the dashboard shows live TTFT, RLD/MD split and BCR within a minute. Ctrl-C stops it all."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
AGENT_PORTS = {"a-prefill-1": 9101, "a-relay-1": 9102, "b-decode-1": 9201}
# Scaled link: baton-tiny's KV is 4 KiB/token, so a 60 Mbit/s line makes an opening's KV take
# ~0.5 s, as production KV on a shared 20 Gbit/s line does; the policy threshold follows suit.
DEMO_LINK = {"bandwidth_gbps": 0.06, "rtt_ms": 30.0}
DEMO_POLICY = {"wan_time_threshold_s": 0.25}


def say(message: str) -> None:
    print(f"[demo] {message}", flush=True)


def manage(*args: str, env: dict[str, str]) -> str:
    out = subprocess.run(
        [sys.executable, "manage.py", *args], cwd=ROOT, env=env, capture_output=True, text=True
    )
    if out.returncode != 0:
        raise SystemExit(
            f"[demo] manage.py {args[0]} failed: {out.stderr.strip().splitlines()[-1:]}"
        )
    return out.stdout.strip()


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def check_ports_free(host: str, ports: list[int]) -> None:
    """Fail at once, with the reason, when another demo (or anything) holds a port we need."""
    for port in ports:
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                raise SystemExit(
                    f"[demo] port {port} on {host} is in use (another `make demo` running?); "
                    "stop it or pass --port"
                ) from None


def wait_for(check, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if check():
                return
        time.sleep(0.5)
    raise SystemExit(f"[demo] timed out waiting for {what}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--rps", type=float, default=0.8, help="mean request rate of the traffic")
    parser.add_argument("--duration-s", type=float, default=3600.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-traffic", action="store_true")
    args = parser.parse_args()

    # SIGTERM (a supervisor, `timeout`) stops everything just as Ctrl-C does.
    signal.signal(signal.SIGTERM, _interrupt)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    url = f"http://{args.host}:{args.port}"
    procs: list[subprocess.Popen] = []
    logs = ROOT / "var" / "demo-logs"
    logs.mkdir(parents=True, exist_ok=True)

    def spawn(name: str, argv: list[str], extra_env: dict[str, str] | None = None):
        log = open(logs / f"{name}.log", "w")
        proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            env={**env, **(extra_env or {})},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        procs.append(proc)
        return proc

    check_ports_free(args.host, [args.port])
    check_ports_free("127.0.0.1", list(AGENT_PORTS.values()))
    try:
        say("migrating the database and loading the demo fleet")
        manage("migrate", "--noinput", env=env)
        manage("seed_demo", env=env)
        operator_token = manage(
            "baton_user", "demo", "--role", "operator", "--password", "demo-operator", env=env
        )
        api_key = manage("tenant_key", "demo", "--name", "make-demo", env=env)

        say(f"starting the control plane at {url} (logs in {logs})")
        spawn(
            "web",
            [
                sys.executable,
                "-m",
                "uvicorn",
                "controlplane.asgi:application",
                "--host",
                args.host,
                "--port",
                str(args.port),
            ],
        )
        wait_for(
            lambda: httpx.get(f"{url}/healthz", timeout=2).status_code == 200,
            120,
            "the control plane",
        )
        api = httpx.Client(
            base_url=url, headers={"Authorization": f"Token {operator_token}"}, timeout=30
        )
        link = api.get("/api/v1/wan-links/").json()["results"][0]
        api.patch(f"/api/v1/wan-links/{link['id']}/", json=DEMO_LINK).raise_for_status()
        api.patch("/api/v1/routing-policy/", json={"settings": DEMO_POLICY}).raise_for_status()

        for node, port in AGENT_PORTS.items():
            line = manage(
                "agent_command",
                node,
                "--control-plane",
                url,
                "--listen",
                f"127.0.0.1:{port}",
                "--python",
                sys.executable,
                env=env,
            )
            # The agents share this host's cores with each other and the web process: torch
            # threads = cores // agents (1 on 2 cores), and passive OpenMP waiting.
            # The line is `BATON_AGENT_TOKEN=... python -m agents serve ...`: the token goes
            # into the agent's environment, never its arguments.
            words = shlex.split(line)
            agent_env = {}
            while words and "=" in words[0] and not words[0].startswith("-"):
                name, _, value = words.pop(0).partition("=")
                agent_env[name] = value
            argv = words + [
                "--kv-listen",
                "127.0.0.1:0",
                "--wan-port",
                "0",
                "--agents-per-host",
                str(len(AGENT_PORTS)),
            ]
            say(f"starting agent {node} on port {port}")
            spawn(f"agent-{node}", argv, agent_env)

        def all_running() -> bool:
            rows = api.get("/api/v1/instances/").json()["results"]
            return bool(rows) and all(r["actual_state"] == "running" for r in rows)

        wait_for(all_running, 240, "the P, RLD and MD instances to run")
        say("fleet is up: P and RLD in dc-a, MD in dc-b, WAN 60 Mbit/s / 30 ms (scaled)")
        print(
            f"\n  Dashboard:  {url}/  (user demo, password demo-operator)\n"
            f"  API docs:   {url}/api/docs/\n"
            f"  API token:  {operator_token}\n"
            f"  Gateway:    {url}/v1  (OpenAI-compatible; API key {api_key})\n"
            f"  Metrics:    {url}/metrics\n"
            "  Ctrl-C stops every process this started.\n",
            flush=True,
        )
        if args.no_traffic:
            while all(p.poll() is None for p in procs):
                time.sleep(1)
            return 1
        return asyncio.run(run_traffic(url, api_key, args, procs))
    except KeyboardInterrupt:
        return 0
    finally:
        say("stopping")
        for proc in reversed(procs):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)


async def run_traffic(url: str, api_key: str, args, procs) -> int:
    from bench.traffic import TrafficStats, demo_workload, replay

    stop = asyncio.Event()
    stats = TrafficStats()
    spec = demo_workload(rps=args.rps, duration_s=args.duration_s, seed=args.seed)
    say(f"sending agentic traffic (~{args.rps} req/s, multi-turn sessions sharing prefixes)")
    task = asyncio.create_task(
        replay(base_url=url, api_key=api_key, model="baton-tiny", spec=spec, stop=stop, stats=stats)
    )
    try:
        while not task.done():
            await asyncio.sleep(10)
            say(stats.line())
            dead = [p for p in procs if p.poll() is not None]
            if dead:
                say(f"a process exited (code {dead[0].returncode}); logs in var/demo-logs")
                stop.set()
                return 1
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
