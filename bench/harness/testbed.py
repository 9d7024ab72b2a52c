"""The testbed: a real local fleet for end-to-end tests and benchmarks. The control plane
(uvicorn, plus a Celery worker and beat when REDIS_URL is set) with its own database, and three
agent processes that register with it: P and RLD in dc-a, MD in dc-b, joined by a shaped WAN.

`start_cluster(wan_proxy=True)` (the chaos harness) puts fault-injecting TCP proxies
(bench/harness/proxy.py) on the dc-a <-> dc-b path: MD's HTTP API (`--advertise-url`) and its
WAN KV fabric (`--advertise-wan-port`) are reached through them,
`cluster.wan_link` switches them; off by default, so `make bench` and the tests are
unchanged."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from agents.node.launch import AgentProcess

ROOT = Path(__file__).resolve().parents[2]


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def stop_on_signals() -> None:
    """SIGTERM (a supervisor, `timeout`) and SIGHUP (the terminal closed) stop a benchmark
    just as Ctrl-C does, so its cleanup (``finally``) stops the processes it started."""
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGHUP, _interrupt)


SETUP = """
import json
from decimal import Decimal
from datetime import datetime, timezone
from fleet import services
from fleet.models import Datacenter, GPUType, ServedModel, UnitPrice, WANLink
from billing.models import Tenant
from billing.services import api_key_create
a = Datacenter.objects.create(name="dc-a", region="city-a")
b = Datacenter.objects.create(name="dc-b", region="city-b")
g = GPUType.objects.create(vendor="generic", model="gpu-a", peak_bf16_tflops=989, memory_gib=80,
    memory_bandwidth_gbps=3350, interconnect_gbps=400)
services.unit_price_save(price=UnitPrice(gpu_type=g, datacenter=a, price_per_gpu_hour=Decimal("2"),
    effective_from=datetime(2026, 1, 1, tzinfo=timezone.utc)))
services.unit_price_save(price=UnitPrice(gpu_type=g, datacenter=b, price_per_gpu_hour=Decimal("2.5"),
    effective_from=datetime(2026, 1, 1, tzinfo=timezone.utc)))
link = WANLink.objects.create(from_datacenter=a, to_datacenter=b, bandwidth_gbps=1, rtt_ms=5,
    connection_pool_size=16)
m = ServedModel.objects.create(name="baton-tiny", source="baton-tiny", num_layers=4,
    kv_bytes_per_token=4096, max_context_tokens=2048, kv_block_size=16)
ServedModel.objects.create(name="orphan", source="baton-tiny", num_layers=4, kv_bytes_per_token=4096)
out = {"link": link.pk, "nodes": {}, "instances": {}}
for host, dc, role in (("a-p", a, "prefill"), ("a-rld", a, "relay_decode"), ("b-md", b, "main_decode")):
    node, token = services.node_create(hostname=host, datacenter=dc, gpu_type=g, gpu_count=1)
    out["nodes"][host] = {"id": node.pk, "token": token, "dc": dc.name}
    out["instances"][role] = services.instance_create(role=role, node=node, served_model=m, gpu_count=1).pk
acme = Tenant.objects.create(name="acme", requests_per_minute=1000, tokens_per_minute=10_000_000)
out["key"] = api_key_create(tenant=acme)[1]
slow = Tenant.objects.create(name="slow", requests_per_minute=1, tokens_per_minute=10_000_000)
out["slow_key"] = api_key_create(tenant=slow)[1]
print("SETUP " + json.dumps(out))
"""


def start_web(*, port: int | str, env: dict[str, str], log_path: Path) -> subprocess.Popen:
    """The control plane's web process (uvicorn on 127.0.0.1:`port`), in its own process group,
    its output in `log_path`."""
    with open(log_path, "w") as log:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "uvicorn",
                "controlplane.asgi:application",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ],  # fmt: skip
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Cluster:
    url: str
    env: dict[str, str]
    setup: dict
    operator_token: str
    agents: dict[str, AgentProcess] = field(default_factory=dict)
    processes: list[subprocess.Popen] = field(default_factory=list)
    tmp: str = ""
    database: str = ""
    # wan_proxy=True: the proxies in front of MD (bench.harness.proxy.WanLink) and, per host,
    # the fixed ports its agent listens on behind them (kept across restarts).
    wan_link: object | None = None
    behind_proxy: dict[str, dict[str, int]] = field(default_factory=dict)

    # -- helpers for tests -----------------------------------------------------------------

    def api(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, headers={"Authorization": f"Token {self.operator_token}"}, timeout=30
        )

    def manage(self, *args: str, timeout: float = 120) -> str:
        out = subprocess.run(
            [sys.executable, "manage.py", *args],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if out.returncode != 0:
            raise RuntimeError(f"manage.py {' '.join(args)} failed: {out.stderr[-3000:]}")
        return out.stdout

    def shell(self, code: str, timeout: float = 120) -> str:
        return self.manage("shell", "-c", code, timeout=timeout)

    def wait_for(self, predicate, timeout_s: float = 90, what: str = "condition"):
        deadline = time.monotonic() + timeout_s
        last = None
        while time.monotonic() < deadline:
            last = predicate()
            if last:
                return last
            time.sleep(0.5)
        raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}; last: {last!r}")

    def instance_states(self) -> dict[str, str]:
        with self.api() as api:
            rows = api.get("/api/v1/instances/").json()["results"]
        return {row["role"]: row["actual_state"] for row in rows}

    def node_status(self, hostname: str) -> str:
        with self.api() as api:
            return api.get("/api/v1/nodes/", params={"hostname": hostname}).json()["results"][0][
                "status"
            ]

    def command_token(self, host: str) -> str:
        code = f"from fleet.models import Node; print(Node.objects.get(hostname={host!r}).command_token)"
        return self.shell(code).strip().splitlines()[-1]

    def agent_state(self, host: str, token: str | None = None) -> dict:
        token = token or self.command_token(host)
        response = httpx.get(
            f"{self.agents[host].http}/state",
            headers={"Authorization": f"Bearer {token}"},
            timeout=30,
        )
        response.raise_for_status()
        return response.json()

    def start_agent(self, host: str) -> AgentProcess:
        node = self.setup["nodes"][host]
        env = {"BATON_AGENT_TOKEN": node["token"]}
        fixed = self.behind_proxy.get(host)
        listen, wan_port, extra = f"127.0.0.1:{free_port()}", 0, []
        if fixed:
            listen, wan_port = f"127.0.0.1:{fixed['http']}", fixed["wan"]
            extra = [
                "--advertise-url",
                f"http://127.0.0.1:{fixed['http_proxy']}",
                "--advertise-wan-port",
                str(fixed["wan_proxy"]),
            ]
        proc = AgentProcess(
            [
                "--node",
                host,
                "--datacenter",
                node["dc"],
                "--listen",
                listen,
                *extra,
                "--kv-listen",
                "127.0.0.1:0",
                "--wan-port",
                str(wan_port),
                "--control-plane",
                self.url,
                # One torch thread each and passive OpenMP waiting: the three agents share
                # the host's cores with the control plane (2 cores on CI).
                "--threads",
                "1",
                "--agents-per-host",
                str(len(self.setup["nodes"])),
                "--num-blocks",
                "512",
                "--heartbeat-interval-s",
                "1",
            ],
            host,
        ).start(env=env)
        self.agents[host] = proc
        return proc

    def add_agent(self, host: str, datacenter: str, role: str) -> AgentProcess:
        """A further node with one instance of `role` (e.g. a second P in dc-a), registered
        in the control plane and its agent started; returns once the instance runs."""
        code = f"""
import json
from fleet import services
from fleet.models import Datacenter, GPUType, ServedModel
node, token = services.node_create(hostname={host!r},
    datacenter=Datacenter.objects.get(name={datacenter!r}), gpu_type=GPUType.objects.first(),
    gpu_count=1)
inst = services.instance_create(role={role!r}, node=node,
    served_model=ServedModel.objects.get(name="baton-tiny"), gpu_count=1)
print("ADDED " + json.dumps({{"id": node.pk, "token": token, "instance": inst.pk}}))
"""
        added = json.loads(self.shell(code).split("ADDED ", 1)[1])
        self.setup["nodes"][host] = {"id": added["id"], "token": added["token"], "dc": datacenter}
        self.setup.setdefault("extra_instances", {})[host] = added["instance"]
        proc = self.start_agent(host)

        def running() -> bool:
            with self.api() as api:
                rows = api.get("/api/v1/instances/").json()["results"]
            return any(r.get("id") == added["instance"] and r["actual_state"] == "running"
                       for r in rows)  # fmt: skip

        self.wait_for(running, 180, f"{host}'s {role} instance to run")
        return proc

    def stop(self) -> None:
        if self.wan_link is not None:
            self.wan_link.stop()
        for proc in self.agents.values():
            proc.kill()
            proc.cleanup()
        for proc in reversed(self.processes):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
        if self.database:
            _drop_database(self.database)


def _postgres_url_for(db_name: str) -> str | None:
    url = os.environ.get("DATABASE_URL", "")
    if not url.startswith(("postgres://", "postgresql://")):
        return None
    base, _, _ = url.rpartition("/")
    return f"{base}/{db_name}"


def _admin_connect():
    import psycopg

    url = os.environ["DATABASE_URL"]
    return psycopg.connect(url.replace("postgresql://", "postgres://", 1), autocommit=True)


def _create_database(name: str) -> None:
    with _admin_connect() as conn:
        conn.execute(f'CREATE DATABASE "{name}"')


def _drop_database(name: str) -> None:
    try:
        with _admin_connect() as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    except Exception:
        pass


def start_cluster(*, wan_proxy: bool = False) -> Cluster:
    tmp = tempfile.mkdtemp(prefix="baton-e2e-")
    env = {
        **os.environ,
        "BATON_VAR_DIR": tmp,
        "BATON_HEARTBEAT_INTERVAL_S": "1",
        "BATON_HEARTBEAT_MISSES": "3",
        "BATON_RECONCILE_INTERVAL_S": "2",
        "BATON_EMBEDDED_BEAT": "true",
        "DJANGO_SETTINGS_MODULE": "controlplane.settings",
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
    }
    database = ""
    pg_url = _postgres_url_for(f"baton_e2e_{uuid.uuid4().hex[:8]}")
    if pg_url:
        database = pg_url.rpartition("/")[2]
        _create_database(database)
        env["DATABASE_URL"] = pg_url
    else:
        env.pop("DATABASE_URL", None)
    redis_url = env.get("REDIS_URL", "")
    if redis_url:
        env["BATON_CHANNEL_PREFIX"] = f"e2e-{uuid.uuid4().hex[:6]}"
        # Rate-limit windows and dispatch counts of its own: the test database is made anew
        # every run, so tenant and instance ids repeat, and a run within a minute of the last
        # would otherwise start inside that run's rate-limit window.
        env["BATON_REDIS_PREFIX"] = f"e2e-{uuid.uuid4().hex[:8]}"
        # A queue of its own, so no other worker on this Redis takes these tasks.
        env["CELERY_TASK_DEFAULT_QUEUE"] = f"e2e-{uuid.uuid4().hex[:8]}"
    port = free_port()
    cluster = Cluster(
        url=f"http://127.0.0.1:{port}",
        env=env,
        setup={},
        operator_token="",
        tmp=tmp,
        database=database,
    )
    try:
        cluster.manage("migrate", "--noinput", timeout=300)
        out = cluster.shell(SETUP)
        cluster.setup = json.loads(out.split("SETUP ", 1)[1])
        cluster.operator_token = cluster.manage("baton_user", "ops", "--role", "operator").strip()
        cluster.processes.append(start_web(port=port, env=env, log_path=Path(tmp) / "web.log"))
        if redis_url:
            queue = env["CELERY_TASK_DEFAULT_QUEUE"]
            for name, args in (
                (
                    "worker",
                    ["worker", "--pool=solo", "-Q", queue, "--without-gossip", "--without-mingle"],
                ),
                ("beat", ["beat", "-s", str(Path(tmp) / "beat-schedule")]),
            ):
                # The process keeps its own handle on the log; ours closes once it started.
                with open(Path(tmp) / f"{name}.log", "w") as wlog:
                    cluster.processes.append(
                        subprocess.Popen(
                            [
                                sys.executable,
                                "-m",
                                "celery",
                                "-A",
                                "controlplane",
                                *args,
                                "--loglevel=INFO",
                            ],
                            cwd=ROOT,
                            env=env,
                            stdout=wlog,
                            stderr=subprocess.STDOUT,
                            start_new_session=True,
                        )
                    )
        cluster.wait_for(lambda: service_up(cluster.url), 120, "the control plane to answer")
        if wan_proxy:
            _put_wan_proxies(cluster, "b-md")
        for host in ("a-p", "a-rld", "b-md"):
            cluster.start_agent(host)
        cluster.wait_for(
            lambda: set(cluster.instance_states().values()) == {"running"},
            180,
            "all three instances to run",
        )
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _put_wan_proxies(cluster: Cluster, host: str) -> None:
    """The dc-a <-> dc-b data-plane path through fault proxies: `host` (MD, the only agent in
    dc-b) listens on fixed ports and is advertised at the proxies' (HTTP and WAN fabric)."""
    from bench.harness.proxy import FaultProxy, WanLink

    http, wan = free_port(), free_port()
    http_proxy = FaultProxy(("127.0.0.1", http), name="md-http").start()
    wan_proxy = FaultProxy(("127.0.0.1", wan), name="md-wan").start()
    cluster.wan_link = WanLink({"http": http_proxy, "wan": wan_proxy})
    cluster.behind_proxy[host] = {
        "http": http,
        "wan": wan,
        "http_proxy": http_proxy.port,
        "wan_proxy": wan_proxy.port,
    }


def service_up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
