"""Prometheus ``/metrics`` rendered from the shared aggregation state.

Choice: a custom collector over the aggregation state rather than prometheus_client's
multiprocess mode. Every gateway and web process already adds into one state (Redis when
REDIS_URL is set), so any process can answer a scrape with fleet-wide totals; multiprocess mode
would need a shared directory on one host and per-process files, which breaks across hosts.
Counters come from the running totals (they restart from zero only when the Redis state, or the
single process's memory, is lost - Prometheus treats that as a counter reset). Histogram
buckets are every 5th latency bin edge (4 per decade, 1 ms .. 1000 s), so `le` counts are exact.
Gauges are over the trailing 1-minute window.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Iterator

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from fleet.kv_index import prefix_index
from fleet.live import read_reports
from frontend import conf
from frontend.telemetry import histogram
from frontend.telemetry.aggregator import TOKEN_BUCKETS, summarize
from frontend.telemetry.fleet import fleet_state
from frontend.telemetry.service import ensure_rebuilt, get_aggregator, tail_new_records
from pdd import metrics as agent_metrics
from routing.gateway import coalesce
from routing.gateway.overload import overload

HISTOGRAMS = {
    "ttft": (
        "pdd_time_to_first_token_seconds",
        "Time to first token: the user's first token leaves with the decoding role's stream "
        "(MD in p-md, RLD in p-rld-md), so it includes the KV transfer that role waits for.",
    ),
    "prefill": ("pdd_prefill_seconds", "Prefill time on P (P's first token ready)."),
    "kv_wait": (
        "pdd_kv_wait_seconds",
        "From P's token ready to the decoding role's first token (KV transfer and admission).",
    ),
    "max_gap": (
        "pdd_largest_token_gap_seconds",
        "Largest gap between consecutive output tokens of a request (the handoff's stall).",
    ),
    "tpot": ("pdd_inter_token_latency_seconds", "Mean time per output token after the first."),
    "e2e": ("pdd_e2e_request_latency_seconds", "End-to-end request latency."),
}
ROLE_OF_TOKEN_KEY = {"rld": "relay_decode", "md": "main_decode"}
# The same request-record latencies under vLLM's names (labels model_name, pipeline), so
# dashboards built for vLLM chart Baton unchanged. docs/metrics.md has the mapping.
VLLM_HISTOGRAMS = {
    "ttft": ("vllm:time_to_first_token_seconds", "Time to first token (as pdd_*)."),
    "e2e": ("vllm:e2e_request_latency_seconds", "End-to-end request latency."),
    "tpot": (
        "vllm:request_time_per_output_token_seconds",
        "Per request: mean time per output token after the first.",
    ),
    "prefill": (
        "vllm:request_prefill_time_seconds",
        "Prefill time on P: P admitting the request to P's first token ready.",
    ),
    "decode": (
        "vllm:request_decode_time_seconds",
        "Decode time: the user's first token to the last (e2e less TTFT).",
    ),
    "queue": (
        "vllm:request_queue_time_seconds",
        "Arrival at the gateway to P admitting the request (authentication, tokenizing, "
        "routing, the hop to P): TTFT less P's prefill and KV wait.",
    ),
}
LENGTHS = {
    "prompt": ("vllm:request_prompt_tokens", "Prompt length of finished requests, tokens."),
    "generation": (
        "vllm:request_generation_tokens",
        "Output length of finished requests, tokens.",
    ),
}


class TelemetryCollector:
    """Yields every pdd_* metric from one read of the totals and the 1-minute window."""

    def collect(self) -> Iterator[Metric]:
        ensure_rebuilt()
        aggregator = get_aggregator()
        tail_new_records()
        aggregator.store.flush()
        totals = aggregator.totals()
        fleet = fleet_state(instances=False)

        for key, (name, doc) in HISTOGRAMS.items():
            family = HistogramMetricFamily(name, doc, labels=["model", "pipeline"])
            for (lat, model, pipeline), counts in sorted(totals.hist.items()):
                if lat != key:
                    continue
                sum_s = totals.sums_us.get((lat, model, pipeline), 0) / 1e6
                family.add_metric(
                    [model, pipeline], histogram.prometheus_buckets(counts), sum_value=sum_s
                )
            yield family

        for key, (name, doc) in VLLM_HISTOGRAMS.items():
            family = HistogramMetricFamily(name, doc, labels=["model_name", "pipeline"])
            for (lat, model, pipeline), counts in sorted(totals.hist.items()):
                if lat == key:
                    sum_s = totals.sums_us.get((lat, model, pipeline), 0) / 1e6
                    family.add_metric(
                        [model, pipeline], histogram.prometheus_buckets(counts), sum_value=sum_s
                    )
            yield family
        for key, (name, doc) in LENGTHS.items():
            family = HistogramMetricFamily(name, doc, labels=["model_name"])
            for (kind, model), counts in sorted(totals.lengths.items()):
                if kind == key:
                    family.add_metric(
                        [model],
                        token_buckets(counts),
                        sum_value=totals.length_sums.get((kind, model), 0),
                    )
            yield family
        success = CounterMetricFamily(
            "vllm:request_success",
            "Finished requests by finish_reason: stop, length (completed), abort (the client "
            "went away), unknown (completed before the gateway kept the reason).",
            labels=["model_name", "finish_reason"],
        )
        for (model, reason), n in sorted(totals.finished.items()):
            success.add_metric([model, reason], n)
        yield success

        requests = CounterMetricFamily(
            "pdd_requests",
            "Requests recorded, by model, pipeline, handoff mode and status (ok, cancelled, "
            "error, rejected, interrupted). Refusals before routing (400, 401, 404, 429) have "
            "no record: see pdd_gateway_errors_total.",
            labels=["model", "pipeline", "handoff_mode", "status"],
        )
        for labels, n in sorted(totals.requests.items()):
            requests.add_metric(list(labels), n)
        yield requests
        errors = CounterMetricFamily(
            "pdd_gateway_errors",
            "Error answers of the gateway, by tenant, model, HTTP status (code) and OpenAI "
            'error code (error); 429s are code="429". Tenant or model is none where the '
            "request did not get far enough to name it.",
            labels=["tenant", "model", "code", "error"],
        )
        for labels, n in sorted(totals.errors.items()):
            errors.add_metric(list(labels), n)
        yield errors

        generation = CounterMetricFamily(
            "pdd_generation_tokens", "Output tokens decoded, by decode role.", labels=["role"]
        )
        for key, role in ROLE_OF_TOKEN_KEY.items():
            generation.add_metric([role], totals.tokens.get(key, 0))
        yield generation
        yield CounterMetricFamily(
            "pdd_prompt_tokens", "Prompt tokens received.", value=totals.tokens.get("prompt", 0)
        )
        yield CounterMetricFamily(
            "pdd_request_migrations",
            "Requests moved to another decoder after theirs failed mid-stream.",
            value=totals.tokens.get("migrations", 0),
        )
        yield CounterMetricFamily(
            "pdd_cached_prompt_tokens",
            "Prompt tokens served from a prefix cache.",
            value=totals.tokens.get("cached", 0),
        )
        wan = CounterMetricFamily(
            "pdd_wan_bytes", "KV bytes shipped over each WAN link.", labels=["link"]
        )
        per_link: dict[str, int] = {link["name"]: 0 for link in fleet.links}
        for pair, link in fleet.link_of(totals.wan.keys()).items():
            per_link[link] = per_link.get(link, 0) + totals.wan[pair]
        for link, nbytes in sorted(per_link.items()):
            wan.add_metric([link], nbytes)
        yield wan

        p, span = aggregator.window("1m", now=time.time())
        minute = summarize(
            p,
            seconds=span,
            cost_per_hour=fleet.cost_per_hour,
            link_of=fleet.link_of(p.wan.keys()),
        )
        yield from self._links(fleet, minute)
        yield self._prefix_index()
        yield from self._overload()
        yield GaugeMetricFamily(
            "pdd_goodput_requests_per_second",
            "Requests per second counted as meeting their model's TTFT SLA, last minute.",
            value=minute["goodput_rps"],
        )
        yield GaugeMetricFamily(
            "pdd_fleet_cost_per_hour",
            "Running instances' GPUs x unit price in force, per hour.",
            value=fleet.cost_per_hour,
        )
        yield GaugeMetricFamily(
            "pdd_benefit_cost_ratio",
            "Goodput (requests/s) per unit of fleet cost per hour, last minute.",
            value=minute["bcr"] or 0.0,
        )

    def _links(self, fleet, minute) -> Iterator[Metric]:
        """Per WAN link: configured bandwidth, KV bits/s of the last minute's requests, and the
        use the prefill agents measured over their last heartbeat interval."""
        bandwidth = GaugeMetricFamily(
            "pdd_wan_link_bandwidth_bits_per_second",
            "Configured bandwidth of each WAN link.",
            labels=["link"],
        )
        throughput = GaugeMetricFamily(
            "pdd_wan_link_kv_bits_per_second",
            "KV bits per second the last minute's finished requests shipped over each link.",
            labels=["link"],
        )
        utilisation = GaugeMetricFamily(
            "pdd_wan_link_utilisation",
            "Share of each link's bandwidth in use, 0..1: the highest the agents sending on it "
            "measured over their last heartbeat interval (their shapers' grants).",
            labels=["link"],
        )
        used: dict[str, float] = {}
        for entry in read_reports():
            src = entry.get("datacenter")
            for peer, link in ((entry.get("report") or {}).get("links") or {}).items():
                value = link.get("utilisation") if isinstance(link, dict) else None
                if isinstance(value, int | float) and not isinstance(value, bool):
                    name = fleet.link_by_dcs.get((src, peer)) or fleet.link_by_dcs.get((peer, src))
                    if name:
                        used[name] = max(used.get(name, 0.0), float(value))
        for link in sorted(fleet.links, key=lambda link: link["name"]):
            name = link["name"]
            bandwidth.add_metric([name], float(link["bandwidth_gbps"]) * 1e9)
            gbps = (minute["wan"].get(name) or {}).get("gbps", 0.0)
            throughput.add_metric([name], gbps * 1e9)
            utilisation.add_metric([name], used.get(name, 0.0))
        yield bandwidth
        yield throughput
        yield utilisation

    def _overload(self) -> Iterator[Metric]:
        """The gateway's overload queue in this process (routing/gateway/overload.py)."""
        stats = overload.stats
        yield GaugeMetricFamily(
            "baton_gateway_queue_waiting",
            "Requests waiting in this gateway process for room on the fleet (engine full).",
            value=stats.waiting,
        )
        yield CounterMetricFamily(
            "baton_gateway_queue_requests",
            "Requests that waited for room at least once.",
            value=stats.queued_total,
        )
        yield CounterMetricFamily(
            "baton_gateway_queue_wait_seconds",
            "Seconds requests spent waiting for room, summed.",
            value=stats.wait_seconds_total,
        )
        yield CounterMetricFamily(
            "baton_gateway_queue_timeouts",
            "Requests answered 503 after waiting BATON_GATEWAY_QUEUE_TIMEOUT_S for room.",
            value=stats.timed_out_total,
        )
        yield CounterMetricFamily(
            "baton_gateway_queue_refused",
            "Requests refused because the queue (or the tenant's share of it) was full.",
            value=stats.refused_total,
        )
        yield GaugeMetricFamily(
            "baton_gateway_prefill_queue_waiting",
            "Requests of this gateway process a prefill engine holds in its queue now (P "
            "said 'queued', no token yet).",
            value=stats.at_prefill,
        )
        yield CounterMetricFamily(
            "baton_gateway_prefill_queue_timeouts",
            "Requests answered 503 after waiting BATON_GATEWAY_PREFILL_QUEUE_TIMEOUT_S in a "
            "prefill engine's queue.",
            value=stats.prefill_timed_out_total,
        )
        streams = coalesce.stats
        yield GaugeMetricFamily(
            "baton_gateway_streams_open",
            "Streamed responses this gateway process is sending now.",
            value=streams.open,
        )
        yield CounterMetricFamily(
            "baton_gateway_stream_writes",
            "Writes of streamed responses (each one or more tokens' events; fewer, larger "
            "writes under load: BATON_GATEWAY_STREAM_INTERVAL_S).",
            value=streams.writes_total,
        )
        yield CounterMetricFamily(
            "baton_gateway_stream_pieces",
            "Text pieces (token events) those writes carried.",
            value=streams.pieces_total,
        )

    def _prefix_index(self) -> Metric:
        """Blocks the prefix index holds per decode instance (from KV cache events)."""
        held = GaugeMetricFamily(
            "baton_prefix_index_blocks",
            "Prefix-cache blocks the control plane's prefix index holds per decode instance, "
            "kept from the agents' KV cache events (this process's view).",
            labels=["instance"],
        )
        index = prefix_index()
        index.sync()
        for instance, blocks in sorted(index.stats().items()):
            held.add_metric([instance], blocks)
        return held


def instances_text() -> str:
    """Per-instance and per-node figures from the nodes' fresh heartbeats (the same families
    each agent's own /metrics serves: pdd/metrics.py), in the text format.

    Rendered by pdd.metrics.render, not prometheus_client: at a thousand nodes they are ~31,000
    samples, and prometheus_client's exposition (label names checked and escaped per sample)
    took 0.9 of /metrics' 1.4 s. The same lines but for label order and float spelling
    (``1650000.0`` for ``1.65e+06``), which Prometheus reads alike."""
    nodes = [
        (str(e.get("hostname") or ""), str(e.get("datacenter") or ""), e.get("report") or {})
        for e in sorted(read_reports(), key=lambda e: str(e.get("hostname")))
    ]
    return agent_metrics.render(
        agent_metrics.instance_families(nodes) + agent_metrics.node_families(nodes)
    )


def token_buckets(counts) -> list[tuple[str, int]]:
    """Cumulative (le, count) pairs over vLLM's 1-2-5 token buckets, ending with +Inf."""
    out: list[tuple[str, int]] = []
    cumulative = 0
    for i, bound in enumerate(TOKEN_BUCKETS):
        cumulative += counts.get(i, 0)
        out.append((f"{float(bound)}", cumulative))
    out.append(("+Inf", sum(counts.values())))
    return out


def _authorised(request: HttpRequest) -> bool:
    token = conf.metrics_token()
    if not token:
        # Open in the development profile; the production profile wants a token.
        return bool(getattr(settings, "BATON_METRICS_OPEN", True))
    header = request.headers.get("Authorization", "")
    scheme, _, given = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip(), token)


def metrics_view(request: HttpRequest) -> HttpResponse:
    """Prometheus exposition: a bearer token when BATON_METRICS_TOKEN is set; without one,
    open in development and closed in production (BATON_METRICS_OPEN)."""
    if not _authorised(request):
        message = (
            "metrics need a bearer token\n"
            if conf.metrics_token()
            else "metrics are closed: set BATON_METRICS_TOKEN and send it as a bearer token\n"
        )
        response = HttpResponse(message, status=401)
        response["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return response
    registry = CollectorRegistry(auto_describe=False)
    registry.register(TelemetryCollector())
    # The answering process's own figures (process_*, python_gc_*, python_info): with several
    # web processes, each scrape sees whichever one Prometheus reached.
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    body = generate_latest(registry) + instances_text().encode()
    return HttpResponse(body, content_type=CONTENT_TYPE_LATEST)
