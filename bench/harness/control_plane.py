"""The benchmarks' control plane: a fresh one started over the testbed (uvicorn on the embedded
defaults, its own SQLite database, an operator token, two GPU types and a tenant), and the REST
calls the benchmarks declare their fleets with.

`DEMO_LINK` and `DEMO_POLICY` are the scaled WAN link and routing threshold of a baton-tiny
fleet, which `make demo` and `make bench`'s PDD fleet share."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from bench.harness.testbed import Cluster, free_port, service_up, start_web

HEARTBEAT_S = 2.0  # the default (and the demo's)
# Scaled link: baton-tiny's KV is 4 KiB/token, so a 60 Mbit/s line makes an opening's KV take
# ~0.5 s, as production KV on a shared 20 Gbit/s line does; the policy threshold follows suit.
DEMO_LINK = {"bandwidth_gbps": 0.06, "rtt_ms": 30.0}
DEMO_POLICY = {"wan_time_threshold_s": 0.25}


class ApiError(RuntimeError):
    pass


@dataclass
class ControlPlane:
    cluster: Cluster
    gpu_types: dict[str, int] = field(default_factory=dict)
    api_key: str = ""

    @property
    def url(self) -> str:
        return self.cluster.url

    def post(self, path: str, body: dict) -> dict:
        with self.cluster.api() as api:
            r = api.post(f"/api/v1/{path}/", json=body)
        if r.status_code >= 300:
            raise ApiError(f"POST /api/v1/{path}/ -> {r.status_code}: {r.text[:500]}")
        return r.json()

    def get_all(self, path: str, **params) -> list[dict]:
        rows: list[dict] = []
        page = 1
        with self.cluster.api() as api:
            while True:
                r = api.get(f"/api/v1/{path}/", params={**params, "page": page, "page_size": 500})
                if r.status_code >= 300:
                    raise ApiError(f"GET /api/v1/{path}/ -> {r.status_code}: {r.text[:300]}")
                data = r.json()
                rows.extend(data.get("results", []))
                if not data.get("next"):
                    return rows
                page += 1

    def patch_policy(self, settings: dict) -> dict:
        with self.cluster.api() as api:
            r = api.patch("/api/v1/routing-policy/", json={"settings": settings})
        if r.status_code >= 300:
            raise ApiError(f"PATCH routing-policy -> {r.status_code}: {r.text[:300]}")
        return r.json()

    def stop(self) -> None:
        self.cluster.stop()


def start_control_plane(log_dir: Path, extra_env: dict[str, str] | None = None) -> ControlPlane:
    """Migrate a fresh SQLite database, make an operator, start uvicorn (embedded beat);
    ``extra_env`` on top of the benchmark's settings."""
    tmp = tempfile.mkdtemp(prefix="baton-bench-pdd-")
    env = {
        **os.environ,
        "BATON_VAR_DIR": tmp,
        "BATON_HEARTBEAT_INTERVAL_S": str(HEARTBEAT_S),
        "BATON_HEARTBEAT_MISSES": "3",
        "BATON_RECONCILE_INTERVAL_S": "2",
        "BATON_EMBEDDED_BEAT": "true",
        "DJANGO_SETTINGS_MODULE": "controlplane.settings",
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        "OMP_WAIT_POLICY": "PASSIVE",
    }
    for name in ("DATABASE_URL", "REDIS_URL", "BATON_DATA_TOKEN"):
        env.pop(name, None)
    env.update(extra_env or {})
    port = free_port()
    cluster = Cluster(url=f"http://127.0.0.1:{port}", env=env, setup={}, operator_token="", tmp=tmp)
    try:
        cluster.manage("migrate", "--noinput", timeout=600)
        cluster.operator_token = cluster.manage("baton_user", "bench", "--role", "operator").strip()
        cluster.processes.append(start_web(port=port, env=env, log_path=log_dir / "web.log"))
        cluster.wait_for(lambda: service_up(cluster.url), 120, "the control plane to answer")
    except BaseException:
        cluster.stop()
        raise
    cp = ControlPlane(cluster)
    for name, spec in (
        (
            "gpu-a",
            {
                "peak_bf16_tflops": 989,
                "memory_gib": 80,
                "memory_bandwidth_gbps": 3350,
                "interconnect_gbps": 400,
            },
        ),
        (
            "gpu-b",
            {
                "peak_bf16_tflops": 800,
                "memory_gib": 141,
                "memory_bandwidth_gbps": 7000,
                "interconnect_gbps": 450,
            },
        ),
    ):
        cp.gpu_types[name] = cp.post("gpu-types", {"vendor": "bench", "model": name, **spec})["id"]
    tenant = cp.post(
        "tenants",
        {"name": "bench", "requests_per_minute": 100_000, "tokens_per_minute": 1_000_000_000},
    )
    cp.api_key = cp.post("api-keys", {"tenant": tenant["id"], "name": "bench-pdd"})["key"]
    return cp
