"""bench/gateway_scale.py end to end on the smallest scenario: 2 closed-loop streams for a few
seconds per phase, one gateway process on the embedded control plane (SQLite, no Redis), one
prefill and one main-decode emulated agent. Asserts what happened (answers complete, the
emulated engine's tokens in both arms, one record per gateway request), never how fast: the
machine running the suite may be loaded."""

from __future__ import annotations

import json

import pytest

from agents.engine.emulated import context_token
from bench import gateway_scale

pytestmark = pytest.mark.slow


def test_expected_tokens_are_the_emulated_engines():
    prompt = gateway_scale.prompt_head(1, "g", 2, 3) + gateway_scale.filler(40)[18:]
    tokens = gateway_scale.expected_tokens(prompt, 5)
    assert tokens == [context_token(list(prompt) + tokens[:i]) for i in range(5)]


def test_two_streams_through_both_arms(tmp_path):
    config = gateway_scale.Config(
        levels=(2,), long_levels=(), gateways=(1,), prompt_tokens=256, max_tokens=8,
        warmup_s=0.5, measure_s=2.5, drain_s=30.0, n_main=1, production=False, cross_checks=2,
        out=tmp_path, label="test",
    )  # fmt: skip
    result = gateway_scale.run(config)

    [level] = result["levels"]
    assert level["clients"] == 2 and level["gateway_processes"] == 1
    for arm in ("gateway", "direct"):
        figures = level[arm]
        assert figures["phases"] == 2
        assert figures["requests_ok_started"] >= 2, (arm, figures)
        assert figures["error_total"] == 0, (arm, figures["errors"])
        assert figures["unfinished_at_drain"] == 0
        # Every answer is whole and is the emulated engine's greedy answer to its prompt.
        assert figures["tokens_checked_requests"] >= figures["requests_ok_started"]
        assert figures["tokens_not_exact"] == 0
        assert figures["latency_p50_ms"] >= figures["ttft_p50_ms"] > 0
        assert figures["tokens_per_s"] > 0
        assert figures["cpu_windows"] and all(w["span_s"] > 0 for w in figures["cpu_windows"])
    assert "tokenize" in level["gateway"]["server_timing_median_ms"]
    # One record per request sent through the gateway, every one of them P-MD.
    records = level["records"]
    assert records["exactly_once"], records
    assert records["records"] == records["gateway_requests_sent"] > 0
    assert set(records["by_pipeline"]) == {"p-md"}
    # The same prompts through both arms: the same answers.
    cross = level["cross_arm"]
    assert cross["prompts"] == 2 and cross["equal"] == 2 and cross["exact"] == 2
    assert cross["records"]["exactly_once"]
    assert result["goals"]["tokens_exact"]["met"] and result["goals"]["records_exactly_once"]["met"]
    assert set(level["gateway_cpu"]) >= {"cpu_ms_per_request", "cpu_us_per_token_net"}
    saved = json.loads((tmp_path / "result.json").read_text())
    assert saved["levels"][0]["records"]["exactly_once"]
