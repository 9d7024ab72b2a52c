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
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from frontend import conf
from frontend.telemetry import histogram
from frontend.telemetry.aggregator import summarize
from frontend.telemetry.fleet import fleet_state
from frontend.telemetry.service import ensure_rebuilt, get_aggregator, tail_new_records

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


class TelemetryCollector:
    """Yields every pdd_* metric from one read of the totals and the 1-minute window."""

    def collect(self) -> Iterator[Metric]:
        ensure_rebuilt()
        aggregator = get_aggregator()
        tail_new_records()
        aggregator.store.flush()
        totals = aggregator.totals()
        fleet = fleet_state()

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

        requests = CounterMetricFamily(
            "pdd_requests",
            "Requests finished, by pipeline, handoff mode and status.",
            labels=["pipeline", "handoff_mode", "status"],
        )
        by_labels: dict[tuple[str, str, str], int] = {}
        for (_model, pipeline, handoff, status), n in totals.requests.items():
            key = (pipeline, handoff, status)
            by_labels[key] = by_labels.get(key, 0) + n
        for labels, n in sorted(by_labels.items()):
            requests.add_metric(list(labels), n)
        yield requests

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
        minute = summarize(p, seconds=span, cost_per_hour=fleet.cost_per_hour)
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
    return HttpResponse(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)
