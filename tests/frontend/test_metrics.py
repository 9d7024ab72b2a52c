"""/metrics: every pdd_* metric with its labels, rendered from the aggregation state."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

NOW_RECORD = {
    "model": "baton-tiny",
    "pipeline": "p-rld-md",
    "handoff_mode": "catch-up",
    "status": "ok",
    "ttft_s": 1.2,
    "tpot_s": 0.04,
    "e2e_s": 5.0,
    "prompt_tokens": 1000,
    "cached_tokens": 400,
    "completion_tokens": 50,
    "tokens_by_rld": 20,
    "tokens_by_md": 30,
    "kv_bytes_wan": 1234,
}


def scrape(client, **headers) -> dict:
    response = client.get("/metrics", **headers)
    assert response.status_code == 200, response.content
    return {f.name: f for f in text_string_to_metric_families(response.content.decode())}


def test_metrics_expose_every_pdd_metric_with_its_labels(client, fleet, aggregator):
    from frontend.telemetry import observe

    observe(
        {
            **NOW_RECORD,
            "prefill_instance": str(fleet["prefill"].pk),
            "main_instance": str(fleet["main"].pk),
        }
    )
    families = scrape(client)
    labels = {
        "pdd_time_to_first_token_seconds": {"model", "pipeline", "le"},
        "pdd_inter_token_latency_seconds": {"model", "pipeline", "le"},
        "pdd_e2e_request_latency_seconds": {"model", "pipeline", "le"},
        "pdd_requests": {"model", "pipeline", "handoff_mode", "status"},
        "pdd_generation_tokens": {"role"},
        "pdd_prompt_tokens": set(),
        "pdd_cached_prompt_tokens": set(),
        "pdd_wan_bytes": {"link"},
        "pdd_goodput_requests_per_second": set(),
        "pdd_fleet_cost_per_hour": set(),
        "pdd_benefit_cost_ratio": set(),
    }
    for name, expected in labels.items():
        assert name in families, name
        samples = families[name].samples
        assert samples, name
        assert set(samples[0].labels) == expected, name
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in families.values()
        for s in f.samples
    }
    assert (
        samples[
            (
                "pdd_requests_total",
                (
                    ("handoff_mode", "catch-up"),
                    ("model", "baton-tiny"),
                    ("pipeline", "p-rld-md"),
                    ("status", "ok"),
                ),
            )
        ]
        == 1
    )
    assert samples[("pdd_generation_tokens_total", (("role", "relay_decode"),))] == 20
    assert samples[("pdd_generation_tokens_total", (("role", "main_decode"),))] == 30
    assert samples[("pdd_prompt_tokens_total", ())] == 1000
    assert samples[("pdd_cached_prompt_tokens_total", ())] == 400
    assert samples[("pdd_wan_bytes_total", (("link", "dc-a->dc-b"),))] == 1234
    ttft = (("model", "baton-tiny"), ("pipeline", "p-rld-md"))
    assert samples[("pdd_time_to_first_token_seconds_count", ttft)] == 1
    assert samples[("pdd_time_to_first_token_seconds_sum", ttft)] == pytest.approx(1.2)
    buckets = {
        float(s.labels["le"]): s.value
        for s in families["pdd_time_to_first_token_seconds"].samples
        if s.name.endswith("_bucket") and s.labels["pipeline"] == "p-rld-md"
    }
    assert buckets[1.0] == 0 and buckets[1.77828] == 1 and buckets[float("inf")] == 1
    assert samples[("pdd_goodput_requests_per_second", ())] == pytest.approx(1 / 60)
    assert samples[("pdd_fleet_cost_per_hour", ())] == 0.0  # nothing is running yet


def test_metrics_need_no_login_but_honour_a_bearer_token(client, db, aggregator, settings):
    assert client.get("/metrics").status_code == 200
    settings.BATON_METRICS_TOKEN = "s3cret"
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer wrong").status_code == 401
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer s3cret").status_code == 200
