"""`make demo`: the control plane on the embedded defaults, the demo fleet's agents on
localhost (P and RLD in dc-a, MD in dc-b, a shaped WAN link between), and gentle agentic traffic,
so the dashboard shows live TTFT, RLD/MD split and BCR within a minute; beside it an EMULATED
fleet of the paper's model (emu-a / emu-b: 4 P, 2 RLD, 3 MD nodes on the two GPU types, engines
that take their GPU types' step times, docs/emulation.md) with paper-like agentic traffic of
its own, and the price book seeded so the billing page shows revenue and margin. Ctrl-C stops
it all."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench.harness.control_plane import DEMO_LINK, DEMO_POLICY
from bench.harness.host import port_in_use
from bench.harness.testbed import stop_on_signals

ROOT = Path(__file__).resolve().parents[1]
AGENT_PORTS = {"a-prefill-1": 9101, "a-relay-1": 9102, "b-decode-1": 9201}
# The emulated fleet's agents (fleet/management/commands/seed_demo.py EMULATED_NODES).
EMULATED_PORTS = {
    **{f"emu-a-prefill-{i}": 9300 + i for i in range(1, 5)},
    **{f"emu-a-relay-{i}": 9310 + i for i in range(1, 3)},
    **{f"emu-b-decode-{i}": 9320 + i for i in range(1, 4)},
    "emu-a-spare-1": 9331,  # spare nodes: no instance until the autopilot starts one
    "emu-b-spare-1": 9332,
}
SPARE_NODES = ("emu-a-spare-1", "emu-b-spare-1")
# `--ramp-at-s`: the autopilot's automatic mode for the emulated fleet (docs/autopilot.md),
# sized with the paper model's scenario; the workload comes from the live records.
RAMP_AUTOPILOT = {
    "automatic": True,
    "scenario": "autopilot-demo",
    "interval_s": 60,
    "window_s": 300,
    "cooldown_s": 120,
    "max_change_per_step": 2,
    # The demo shows PDD: a relay, a prefill and a main decoder stay whatever the rate.
    "floors": {"prefill": 1, "relay_decode": 1, "main_decode": 1},
}
# Emulated KV on the wire: the real bytes / this, and the emulated agents' links shaped alike,
# so a transfer takes the declared link's time with 1% of the bytes on loopback.
EMULATED_KV_SCALE = 100
EMULATED_MODEL = "paper-dsv4"
# List prices per 1M tokens (input, cached input, output), USD: illustrative, cached input at
# 20-25% of uncached as providers bill it (docs/pdd.md).
MODEL_PRICES = {
    "baton-tiny": ("1.0000", "0.2000", "4.0000"),
    EMULATED_MODEL: ("0.5500", "0.1400", "2.1900"),
}


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


def logs_dir() -> Path:
    """Where the demo's processes log: beside the control plane's own state, in BATON_VAR_DIR
    (default var/)."""
    return Path(os.environ.get("BATON_VAR_DIR") or ROOT / "var") / "demo-logs"


def check_ports_free(host: str, ports: list[int]) -> None:
    """Fail at once, with the reason, when another demo (or anything) holds a port we need."""
    for port in ports:
        if port_in_use(host, port):
            raise SystemExit(
                f"[demo] port {port} on {host} is in use (another `make demo` running?); "
                "stop it or pass --port"
            )


def wait_until(
    pending,
    timeout_s: float,
    what: str,
    *,
    interval_s: float = 0.5,
    report_every_s: float = 30.0,
    clock=time.monotonic,
    sleep=time.sleep,
) -> None:
    """Call `pending()` until it returns an empty list: the things still waited for, by name.

    On timeout the error names what was still pending at the last look (or the last call's
    error); every `report_every_s` a progress line says the same."""
    start = clock()
    last: list[str] = [what]
    next_report = start + report_every_s
    while True:
        try:
            last = list(pending())
        except Exception as exc:  # the server not up yet, a transient error
            last = [f"{what} ({type(exc).__name__}: {exc})"]
        else:
            if not last:
                return
        now = clock()
        if now - start >= timeout_s:
            raise SystemExit(
                f"[demo] timed out after {timeout_s:.0f} s waiting for {what}; "
                f"still waiting for: {', '.join(last)}"
            )
        if now >= next_report:
            say(f"still waiting for: {', '.join(last)}")
            next_report = now + report_every_s
        sleep(interval_s)


def wait_for(check, timeout_s: float, what: str) -> None:
    wait_until(lambda: [] if check() else [what], timeout_s, what)


def pending_instances(instances: list[dict], node_names: dict[int, str], demo_nodes) -> list[str]:
    """The demo fleet's instances that are not running yet, named for the operator.

    Only instances on the demo's own nodes count: instances an operator added elsewhere (the
    curl walkthrough of docs/api.md creates some on nodes with no agent) never run here and are not
    the demo's to wait for. A demo node with no instance at all is named too."""
    demo_nodes = list(demo_nodes)
    waiting = []
    seen = set()
    for row in instances:
        node = node_names.get(row["node"])
        if node not in demo_nodes:
            continue
        seen.add(node)
        if row["actual_state"] != "running":
            waiting.append(f"{row['role']} #{row['id']} on {node} ({row['actual_state']})")
    waiting += [f"an instance on {node} (none exists)" for node in demo_nodes if node not in seen]
    return waiting


def _die_with_parent() -> None:
    """In a child, before exec: get SIGTERM if the demo dies without cleaning up (SIGKILL)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Children:
    """The processes the demo starts, each in its own process group, and their stopping.

    The children do not get the terminal's Ctrl-C themselves (their own sessions, so that a
    Ctrl-C cannot hit them mid-way and so that each is stopped as a whole), so the demo stops
    them: on leaving the `with` block, for whatever reason, every group gets SIGTERM at once,
    and whatever is left after `grace_s` (or at once on a second Ctrl-C or SIGTERM during the
    wait) gets SIGKILL. A further Ctrl-C cannot cut that short. On Linux a child also gets
    SIGTERM if the demo itself is killed (PR_SET_PDEATHSIG)."""

    def __init__(self, grace_s: float = 10.0) -> None:
        self.grace_s = grace_s
        self.procs: list[subprocess.Popen] = []
        self._hurry = False

    def __enter__(self) -> Children:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def spawn(self, argv: list[str], **kwargs) -> subprocess.Popen:
        if sys.platform.startswith("linux"):
            kwargs.setdefault("preexec_fn", _die_with_parent)
        proc = subprocess.Popen(argv, start_new_session=True, **kwargs)
        self.procs.append(proc)
        return proc

    def alive(self) -> list[subprocess.Popen]:
        return [p for p in self.procs if p.poll() is None]

    def _signal(self, sig: int) -> None:
        for proc in reversed(self.alive()):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)

    def _hurry_up(self, signum, frame) -> None:
        self._hurry = True

    def stop(self) -> None:
        handlers = {}
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            with contextlib.suppress(ValueError, OSError):  # not the main thread
                handlers[sig] = signal.signal(sig, self._hurry_up)
        try:
            if self.alive():
                self._signal(signal.SIGTERM)
            deadline = time.monotonic() + self.grace_s
            while self.alive() and not self._hurry and time.monotonic() < deadline:
                time.sleep(0.1)
            for proc in self.alive():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
            for proc in self.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=10)
        finally:
            for sig, handler in handlers.items():
                with contextlib.suppress(ValueError, OSError, TypeError):
                    signal.signal(sig, handler)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--rps", type=float, default=0.8, help="mean request rate of the traffic")
    parser.add_argument("--duration-s", type=float, default=3600.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-traffic", action="store_true")
    parser.add_argument(
        "--no-emulated", action="store_true", help="only the baton-tiny trio, no emulated fleet"
    )
    parser.add_argument(
        "--emulated-rps",
        type=float,
        default=0.25,
        help="mean request rate of the emulated fleet's paper-like traffic",
    )
    parser.add_argument(
        "--ramp-at-s",
        type=float,
        default=None,
        help="double the emulated fleet's traffic this many seconds in, with the autopilot's "
        "automatic mode on for it (spare nodes: emu-a-spare-1, emu-b-spare-1)",
    )
    parser.add_argument("--wait-s", type=float, default=240.0, help="how long the fleet may take")
    parser.add_argument(
        "--grace-s", type=float, default=10.0, help="on stop: SIGTERM, then SIGKILL after this"
    )
    args = parser.parse_args()

    stop_on_signals()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    url = f"http://{args.host}:{args.port}"
    logs = logs_dir()
    logs.mkdir(parents=True, exist_ok=True)
    check_ports_free(args.host, [args.port])
    agent_ports = dict(AGENT_PORTS) if args.no_emulated else {**AGENT_PORTS, **EMULATED_PORTS}
    check_ports_free("127.0.0.1", list(agent_ports.values()))
    children = Children(grace_s=args.grace_s)

    def spawn(name: str, argv: list[str], extra_env: dict[str, str] | None = None):
        with open(logs / f"{name}.log", "w") as log:
            return children.spawn(
                argv, cwd=ROOT, env={**env, **(extra_env or {})}, stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip

    try:
        say("migrating the database and loading the demo fleet")
        manage("migrate", "--noinput", env=env)
        manage("seed_demo", *([] if args.no_emulated else ["--emulated"]), env=env)
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
        seed_prices(api)

        for node, port in agent_ports.items():
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
                str(len(agent_ports)),
            ]
            if node in EMULATED_PORTS:
                argv += ["--kv-scale", str(EMULATED_KV_SCALE)]
            say(f"starting agent {node} on port {port}")
            spawn(f"agent-{node}", argv, agent_env)

        node_names = {
            n["id"]: n["hostname"]
            for n in api.get("/api/v1/nodes/", params={"page_size": 500}).json()["results"]
        }

        def demo_instances() -> list[dict]:
            rows = api.get("/api/v1/instances/", params={"page_size": 500}).json()["results"]
            return [r for r in rows if node_names.get(r["node"]) in agent_ports]

        # An operator may have drained or stopped one in an earlier run: the demo needs them all.
        for row in demo_instances():
            if row["desired_state"] != "running":
                say(f"starting {row['role']} #{row['id']} (it was {row['desired_state']})")
                api.post(f"/api/v1/instances/{row['id']}/start/").raise_for_status()

        def demo_pending() -> list[str]:
            wanted = [node for node in agent_ports if node not in SPARE_NODES]
            return pending_instances(demo_instances(), node_names, wanted)

        wait_until(demo_pending, args.wait_s, "the demo fleet's P, RLD and MD instances to run")
        say("fleet is up: P and RLD in dc-a, MD in dc-b, WAN 60 Mbit/s / 30 ms (scaled)")
        if not args.no_emulated:
            say(
                "emulated fleet is up (EMULATED: model profile paper-dsv4, no weights): 4 P and "
                "2 RLD on gpu-a in emu-a, 3 MD on gpu-b in emu-b, WAN 1 Gbit/s / 30 ms"
            )
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
            while not [p for p in children.procs if p.poll() is not None]:
                time.sleep(1)
            return 1
        if args.ramp_at_s is not None and not args.no_emulated:
            start_autopilot(api)
        return asyncio.run(run_traffic(url, api_key, args, children.procs))
    except KeyboardInterrupt:
        return 0
    finally:
        say("stopping")
        children.stop()


def start_autopilot(api: httpx.Client) -> None:
    """The autopilot's automatic mode for the emulated fleet (`--ramp-at-s`)."""
    models = api.get("/api/v1/models/", params={"page_size": 100}).json()["results"]
    model = next(m["id"] for m in models if m["name"] == EMULATED_MODEL)
    body = {**RAMP_AUTOPILOT, "served_model": model}
    api.patch("/api/v1/autopilot/settings/", json=body).raise_for_status()
    say(
        f"autopilot: automatic mode on for {EMULATED_MODEL}, a proposal every "
        f"{RAMP_AUTOPILOT['interval_s']} s; follow it on /planner/#autopilot"
    )


def seed_prices(api: httpx.Client) -> None:
    """List prices for the demo's served models, unless the price book has some already."""
    models = {m["name"]: m["id"] for m in api.get("/api/v1/models/").json()["results"]}
    priced = {p["model_name"] for p in api.get("/api/v1/model-prices/").json()["results"]}
    for name, (inp, cached, out) in MODEL_PRICES.items():
        if name in models and name not in priced:
            api.post(
                "/api/v1/model-prices/",
                json={
                    "served_model": models[name],
                    "input_per_mtok": inp,
                    "cached_input_per_mtok": cached,
                    "output_per_mtok": out,
                    "currency": "USD",
                    "effective_from": "2026-01-01T00:00:00Z",
                },
            ).raise_for_status()


def rate_usage(env: dict[str, str]) -> None:
    """Rate pending usage into the open statements (billing.statements.rate_pending)."""
    code = "from billing.statements import rate_pending; rate_pending()"
    out = subprocess.run(
        [sys.executable, "manage.py", "shell", "-c", code],
        cwd=ROOT, env=env, capture_output=True, text=True,
    )  # fmt: skip
    if out.returncode == 0:
        say("rated the first minute's usage: the billing page shows this month's statements")
    else:
        say(f"rating usage failed (beat rates it within 5 minutes): {out.stderr.strip()[-200:]}")


async def run_traffic(url: str, api_key: str, args, procs) -> int:
    from bench.harness.traffic import (
        TrafficStats,
        demo_workload,
        paper_workload,
        replay,
        session_options,
    )

    stop = asyncio.Event()
    stats = TrafficStats()
    spec = demo_workload(rps=args.rps, duration_s=args.duration_s, seed=args.seed)
    say(f"sending agentic traffic (~{args.rps} req/s, multi-turn sessions sharing prefixes)")
    tasks = [
        asyncio.create_task(
            replay(
                base_url=url, api_key=api_key, model="baton-tiny", spec=spec, stop=stop,
                stats=stats,
            )
        )
    ]  # fmt: skip
    emulated = TrafficStats()
    if not args.no_emulated:
        paper = paper_workload(rps=args.emulated_rps, duration_s=args.duration_s, seed=args.seed)
        say(
            f"sending paper-like traffic to the emulated fleet (~{args.emulated_rps} req/s, "
            "~40K-token openings, contexts up to 128K, outputs of hundreds of tokens)"
        )
        tasks.append(
            asyncio.create_task(
                replay(
                    base_url=url, api_key=api_key, model=EMULATED_MODEL, spec=paper, stop=stop,
                    stats=emulated, max_in_flight=32,
                    **session_options(paper),
                )
            )
        )  # fmt: skip
    rated = False
    ramped = args.ramp_at_s is None or args.no_emulated
    began = time.monotonic()
    try:
        while not all(t.done() for t in tasks):
            await asyncio.sleep(10)
            if not ramped and time.monotonic() - began >= args.ramp_at_s:
                # The emulated fleet's rate doubles: a second stream of sessions as heavy.
                ramped = True
                more = paper_workload(
                    rps=args.emulated_rps, duration_s=args.duration_s, seed=args.seed + 1
                )
                say(f"ramp: the emulated fleet's traffic doubles (~{2 * args.emulated_rps} req/s)")
                tasks.append(
                    asyncio.create_task(
                        replay(
                            base_url=url, api_key=api_key, model=EMULATED_MODEL, spec=more,
                            stop=stop, stats=emulated, max_in_flight=32,
                            **session_options(more),
                        )
                    )
                )  # fmt: skip
            if not rated and time.monotonic() - began > 60:
                # Rate the first minute's usage now (beat rates every 5 minutes), so the billing
                # page shows this month's open statements without waiting.
                rated = True
                await asyncio.to_thread(rate_usage, dict(os.environ, PYTHONUNBUFFERED="1"))
            say(f"baton-tiny: {stats.line()}")
            if not args.no_emulated:
                say(f"{EMULATED_MODEL} (emulated): {emulated.line()}")
            dead = [p for p in procs if p.poll() is not None]
            if dead:
                say(f"a process exited (code {dead[0].returncode}); logs in {logs_dir()}")
                stop.set()
                return 1
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.gather(*tasks), 5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
