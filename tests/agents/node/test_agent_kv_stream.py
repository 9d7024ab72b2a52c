"""P's streamed export (agents/node/kv_stream.py) on real agents: with ``--kv-stream-tokens``
MD's delta leaves in pieces while prefill runs (a 32-token chunked prefill here), MD joins
them and decodes ``single``'s tokens exactly, in every pipeline, in the engine's own format
and in a WAN format; the bytes are those of the whole delta."""

from __future__ import annotations

import pytest
from agent_node_helpers import FAST_LINK, make_prompt, pdd_agents, run_single

from agents.node.loopback import pdd_body, stream_events, summarize

pytestmark = pytest.mark.slow

STREAMED = ("--kv-stream-tokens", "32", "--max-batch-tokens", "32")


def _generate(agents, rid: str, prompt: list[int], max_tokens: int, pipeline: str,
              fmt: str | None = None) -> dict:  # fmt: skip
    rld = agents["rld"] if pipeline != "p-md" else None
    body = pdd_body(rid, prompt, max_tokens, pipeline, "catch-up", agents["p"], rld, agents["md"])
    if fmt is not None:
        body["main"]["kv_format"] = fmt
    events, _, _ = stream_events(f"{agents['p'].http}/v1/pdd/generate", body)
    return summarize(events)


def test_a_streamed_delta_gives_singles_tokens_in_every_pipeline():
    prompts = {p: make_prompt(150, seed) for p, seed in (("p-md", 51), ("p-rld-md", 52))}
    with pdd_agents(FAST_LINK, *STREAMED, tag="-stream") as agents:
        for pipeline, prompt in prompts.items():
            expected = run_single(agents["single"], prompt, 12)["output_token_ids"]
            got = _generate(agents, f"stream-{pipeline}", prompt, 12, pipeline)
            assert got["error"] is None, got
            assert got["output_token_ids"] == expected, pipeline
            stats = got["stats"]
            # 150 tokens from MD's empty cache in 32-token forwards: pieces as prefill ran,
            # then the rest (a partial block) when it ended.
            assert stats["kv_stream_pieces"] >= 3, stats
            assert stats["kv_bytes"]["wan"] == 150 * 4096  # baton-tiny: 4 KiB a token


def test_without_the_flag_the_delta_goes_whole_and_the_bytes_are_the_same():
    prompt = make_prompt(150, 53)
    with pdd_agents(FAST_LINK, "--max-batch-tokens", "32", tag="-whole") as agents:
        expected = run_single(agents["single"], prompt, 8)["output_token_ids"]
        got = _generate(agents, "whole", prompt, 8, "p-md")
    assert got["error"] is None and got["output_token_ids"] == expected
    assert "kv_stream_pieces" not in got["stats"]
    assert got["stats"]["kv_bytes"]["wan"] == 150 * 4096


def test_streamed_pieces_in_a_wan_format_are_encoded_one_by_one_and_joined():
    """Widening (float32 over a bfloat16 fleet) is lossless: single's tokens exactly."""
    prompt = make_prompt(150, 54)
    with pdd_agents(FAST_LINK, "--dtype", "bfloat16", *STREAMED, tag="-stream-bf16") as agents:
        expected = run_single(agents["single"], prompt, 12)["output_token_ids"]
        got = _generate(agents, "stream-f32", prompt, 12, "p-md", "float32")
    assert got["error"] is None, got
    assert got["output_token_ids"] == expected
    assert got["stats"]["kv_format_wan"] == "float32"
    assert got["stats"]["kv_stream_pieces"] >= 3
