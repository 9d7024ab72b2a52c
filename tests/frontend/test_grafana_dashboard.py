"""docker/grafana/baton.json: every panel query names metric families the control plane's
/metrics really serves (with samples) after requests went through the gateway, and
docker/prometheus.yml scrapes it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from rest_framework.test import APIClient

from billing import services as billing
from billing.models import Tenant
from fleet import live as fleet_live
from fleet.choices import InstanceRole
from fleet.models import Datacenter, WANLink
from routing.gateway import run as gw_run
from tests.routing.gateway.conftest import fresh_gateway_state  # noqa: F401 - autouse: fresh limits
from tests.routing.gateway.test_route_around_the_dead import _one_dc_fleet

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "docker" / "grafana" / "baton.json"
PROMQL_WORDS = {
    "by", "without", "ignoring", "on", "group_left", "group_right", "and", "or", "unless",
    "bool", "offset", "le", "inf", "nan",
}  # fmt: skip
SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (labels, ranges, functions removed)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(by|without|ignoring|on|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for match in re.finditer(r"(?<![\w.])[A-Za-z_:][A-Za-z0-9_:]*", text):
        rest = text[match.end() :].lstrip()
        word = match.group(0)
        if rest.startswith("(") or word.lower() in PROMQL_WORDS:
            continue
        names.add(word)
    return names


def panel_queries(dashboard: dict) -> list[tuple[str, str]]:
    out = []
    for panel in dashboard["panels"]:
        for nested in [panel, *panel.get("panels", [])]:
            for target in nested.get("targets", []):
                out.append((nested["title"], target["expr"]))
    return out


def test_the_query_parser_finds_metrics_and_skips_functions_labels_and_ranges():
    expr = (
        'histogram_quantile(0.9, sum by (le, pipeline) (rate(a:b_bucket{job="x",le="1"}'
        "[$__rate_interval]))) / ignoring(role) group_left sum(c_total) * 8 / 1e9"
    )
    assert metric_names(expr) == {"a:b_bucket", "c_total"}


def _instance_doc(inst, role: str, model: str) -> dict:
    return {
        "instance_id": str(inst.pk),
        "role": role,
        "model": model,
        "state": "running",
        "load": {"running": 2, "queued": 1, "max_running": 32},
        "kv": {"used_blocks": 64, "total_blocks": 256, "block_size": 16},
        "cache": {"queried_tokens": 900, "matched_tokens": 640},
        "engine": {"tokens_computed": 2000, "preemptions": 0},
        "tokens_generated": 12,
        "cached_prefix_blocks": [],
    }


@pytest.fixture
def served(transactional_db, settings, monkeypatch, aggregator):
    """A gateway fleet (P and MD in dc-a, a link to dc-b) whose agents report state documents
    like real ones, with agent runs stubbed to stream two tokens."""
    settings.REDIS_URL = ""
    made = _one_dc_fleet(("p", InstanceRole.PREFILL), ("md", InstanceRole.MAIN_DECODE))
    b = Datacenter.objects.create(name="dc-b", region="city-b")
    a = made["p"][0].datacenter
    WANLink.objects.create(from_datacenter=a, to_datacenter=b, bandwidth_gbps=20, rtt_ms=30)
    for name, (node, inst) in made.items():
        fabric = {"sent_bytes": 10, "received_bytes": 5, "sent_payload_bytes": 8,
                  "received_payload_bytes": 4, "transfers": 1, "failures": 0}  # fmt: skip
        fleet_live.publish_report(
            node_id=node.pk,
            hostname=node.hostname,
            datacenter=a.name,
            endpoint=node.agent_endpoint,
            report={
                "instances": [_instance_doc(inst, inst.role, "baton-tiny")],
                "tokens_by_role": {inst.role: 12},
                "active_requests": 1,
                "kv_in_flight": {"incoming": 0, "reservations": 0},
                "fabrics": {"wan": fabric, "intra_dc": fabric},
                "links": {"dc-b": {"utilisation": 0.25, "connections": {"in_use": 1, "waiting": 0}}}
                if name == "p"
                else {},
            },
        )

    async def events(url, plan):
        for i, token in enumerate(b"ok"):
            yield {"type": "token", "index": i, "token_id": token, "role": "md"}
        stats = {"prefill_s": 0.001, "kv_wait_s": 0.001, "tokens_by_role": {"rld": 0, "md": 2}}
        yield {"type": "done", "finish_reason": "length", "stats": stats}

    monkeypatch.setattr(gw_run, "run_events", events)
    tenant = Tenant.objects.create(name="acme", requests_per_minute=3, tokens_per_minute=10**6)
    _, raw = billing.api_key_create(tenant=tenant)
    yield raw
    fleet_live._memory.clear()


def _send(raw: str | None, **extra):
    client = APIClient()
    if raw:
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    body = {"model": "baton-tiny", "prompt": "hi", "max_tokens": 2} | extra
    return client.post("/v1/completions", body, format="json")


def _scrape() -> dict:
    response = APIClient().get("/metrics")
    assert response.status_code == 200, response.content
    return {f.name: f for f in text_string_to_metric_families(response.content.decode())}


def test_every_dashboard_query_names_a_family_metrics_serves(served):
    for _ in range(3):
        assert _send(served).status_code == 200
    assert _send(served).status_code == 429
    assert _send(None).status_code == 401
    assert _send(served, model="nope").status_code in (404, 429)
    families = _scrape()
    served_samples = {s.name for f in families.values() for s in f.samples}
    dashboard = json.loads(DASHBOARD.read_text())
    queries = panel_queries(dashboard)
    assert len(queries) >= 20
    missing = []
    for title, expr in queries:
        names = metric_names(expr)
        assert names, (title, expr)
        for name in names:
            if name not in served_samples:
                missing.append(f"{title}: {name}")
    assert not missing, missing
    titles = " ".join(t for t, _ in queries)
    for wanted in ("TTFT", "output token", "E2E", "Running", "Waiting", "KV-cache",
                   "Prefix-cache", "RLD / MD", "BCR", "WAN", "errors", "429"):  # fmt: skip
        assert wanted in titles, wanted


def test_metrics_after_gateway_traffic_count_errors_finish_reasons_and_instances(served):
    for _ in range(3):
        assert _send(served).status_code == 200
    assert _send(served).status_code == 429
    assert _send(None).status_code == 401
    families = _scrape()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in families.values()
        for s in f.samples
    }
    assert samples[
        ("pdd_gateway_errors_total",
         (("code", "429"), ("error", "rate_limit_exceeded"), ("model", "baton-tiny"),
          ("tenant", "acme")))
    ] == 1  # fmt: skip
    assert samples[
        ("pdd_gateway_errors_total",
         (("code", "401"), ("error", "invalid_api_key"), ("model", "none"), ("tenant", "none")))
    ] == 1  # fmt: skip
    ok = (("handoff_mode", "none"), ("model", "baton-tiny"), ("pipeline", "p-md"), ("status", "ok"))
    assert samples[("pdd_requests_total", ok)] == 3
    success = (("finish_reason", "length"), ("model_name", "baton-tiny"))
    assert samples[("vllm:request_success_total", success)] == 3
    gen = families["vllm:request_generation_tokens"].samples
    count = [s for s in gen if s.name.endswith("_count")][0]
    total = [s for s in gen if s.name.endswith("_sum")][0]
    assert (count.value, total.value) == (3, 6)
    ttft = [s for s in families["vllm:time_to_first_token_seconds"].samples
            if s.name.endswith("_count")]  # fmt: skip
    assert ttft[0].value == 3 and ttft[0].labels["model_name"] == "baton-tiny"
    running = families["vllm:num_requests_running"].samples
    assert {s.labels["role"] for s in running} == {"prefill", "main_decode"}
    assert set(running[0].labels) == {
        "model_name",
        "instance",
        "role",
        "datacenter",
        "node",
        "engine",
    }
    assert {s.labels["engine"] for s in running} == {"torch"}
    assert {s.value for s in running} == {2}
    kv = families["vllm:kv_cache_usage_perc"].samples
    assert {s.value for s in kv} == {0.25}
    hits = families["vllm:prefix_cache_hits"].samples
    assert {s.value for s in hits} == {640}
    link = (("link", "dc-a->dc-b"),)
    assert samples[("pdd_wan_link_utilisation", link)] == 0.25
    assert samples[("pdd_wan_link_bandwidth_bits_per_second", link)] == 20e9
    assert "process_resident_memory_bytes" in {s.name for f in families.values() for s in f.samples}


def test_the_prometheus_config_scrapes_the_control_plane_and_the_agents():
    config = yaml.safe_load((ROOT / "docker" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"baton", "baton-agents"}
    for job in jobs.values():
        assert job["metrics_path"] == "/metrics"
        assert job["honor_labels"] is True
        assert job["static_configs"][0]["targets"]
    # The dashboard reads the control plane's job.
    assert all(
        'job="baton"' in expr for _, expr in panel_queries(json.loads(DASHBOARD.read_text()))
    )


def test_docs_metrics_lists_every_family_metrics_serves(served):
    assert _send(served).status_code == 200
    documented = set(
        re.findall(r"^\| `([^`]+)` \|", (ROOT / "docs" / "metrics.md").read_text(), re.M)
    )
    undocumented = []
    for family in _scrape().values():
        if family.name.startswith(("process_", "python_")):
            continue
        name = family.name + ("_total" if family.type == "counter" else "")
        if name not in documented:
            undocumented.append(name)
    assert not undocumented, undocumented
