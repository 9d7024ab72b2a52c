"""TTFT as the user sees it, on real agent processes over a slow shaped WAN: P's token leaves at
the head of the decoding role's stream, so p-md's TTFT includes the KV delta's WAN transfer and
p-rld-md's does not (RLD gets the KV over the intra-DC fabric); streaming P's token early is an
explicit request flag."""

from __future__ import annotations

import pytest
from agent_node_helpers import make_prompt, pdd_agents, pdd_body, stream_events, summarize

pytestmark = pytest.mark.slow
KV_BYTES_PER_TOKEN = 2 * 4 * 2 * 64 * 4  # baton-tiny: K and V, 4 layers, 2 KV heads, dim 64, f32
GBPS = 0.005  # 625 KB/s: a 400-token prompt's KV (1.6 MB) takes ~2.6 s on P's link to MD
PROMPT_TOKENS = 400


@pytest.fixture(scope="module")
def slow_wan():
    with pdd_agents(f"{GBPS}:10:4", single=False, tag="-ttft") as agents:
        yield agents


def wan_floor_s(tokens: int) -> float:
    """The least time the KV of `tokens` uncached tokens can take on P's link to MD."""
    return 0.9 * tokens * KV_BYTES_PER_TOKEN / (GBPS * 1e9 / 8)


def run(agents, rid, prompt, pipeline, **extra):
    body = pdd_body(rid, prompt, 12, pipeline, "one-shot", agents["p"], agents["rld"], agents["md"])
    body.update(extra)
    events, client_ttft, _ = stream_events(f"{agents['p'].http}/v1/pdd/generate", body)
    result = summarize(events)
    assert result["error"] is None, result["error"]
    assert result["indexes"] == list(range(12))
    return result, client_ttft


def test_p_md_ttft_includes_the_wan_transfer(slow_wan):
    result, client_ttft = run(slow_wan, "ttft-pmd", make_prompt(PROMPT_TOKENS, 71), "p-md")
    stats = result["stats"]
    floor = wan_floor_s(PROMPT_TOKENS)
    assert stats["cached_tokens"] == 0
    assert stats["first_token_early"] is False
    assert stats["ttft_s"] >= floor
    assert client_ttft >= floor
    # P's own work is a small part of it; the rest is the KV wait (transfer + MD admission).
    assert stats["prefill_s"] < stats["ttft_s"]
    assert stats["kv_wait_s"] >= floor
    assert stats["ttft_s"] == pytest.approx(stats["prefill_s"] + stats["kv_wait_s"], abs=0.05)
    assert 0 <= stats["max_gap_s"] <= stats["e2e_s"]
    # P's token rides at the head of MD's stream.
    assert result["roles"][0] == "prefill" and set(result["roles"][1:]) == {"md"}


def test_p_rld_md_ttft_does_not_wait_for_the_wan(slow_wan):
    result, client_ttft = run(slow_wan, "ttft-prld", make_prompt(PROMPT_TOKENS, 72), "p-rld-md")
    stats = result["stats"]
    floor = wan_floor_s(PROMPT_TOKENS)
    assert stats["cached_tokens"] == 0
    assert result["roles"][1] == "rld"
    # RLD got the full KV intra-DC and started at once; MD's KV was still crossing the WAN.
    assert stats["ttft_s"] < floor
    assert client_ttft < floor
    assert stats["kv_wait_s"] < floor
    # The handoff to MD waited for the WAN: the stall shows as the largest gap, or RLD
    # finished alone before MD was ready.
    assert stats["max_gap_s"] >= 0


def test_early_first_token_is_an_explicit_flag(slow_wan):
    result, client_ttft = run(
        slow_wan, "ttft-early", make_prompt(PROMPT_TOKENS, 73), "p-md", early_first_token=True
    )
    stats = result["stats"]
    floor = wan_floor_s(PROMPT_TOKENS)
    assert stats["first_token_early"] is True
    # Token 0 left when prefill ended; token 1 waited for the WAN, and that wait is the gap.
    assert stats["ttft_s"] < floor
    assert client_ttft < floor
    assert stats["max_gap_s"] >= floor
    assert stats["kv_wait_s"] >= floor


def test_early_first_token_must_be_a_boolean(slow_wan):
    import httpx

    body = pdd_body(
        "ttft-bad", make_prompt(32, 74), 4, "p-md", "one-shot", slow_wan["p"], None, slow_wan["md"]
    )
    body["early_first_token"] = "yes"
    response = httpx.post(f"{slow_wan['p'].http}/v1/pdd/generate", json=body, timeout=30)
    assert response.status_code == 400
    assert "early_first_token" in response.text
