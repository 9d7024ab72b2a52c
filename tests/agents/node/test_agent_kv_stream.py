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
            # baton-tiny: 4 KiB a token, and each piece's 24-byte header.
            assert stats["kv_bytes"]["wan"] == 150 * 4096 + 24 * stats["kv_stream_pieces"]


def test_without_the_flag_the_delta_goes_whole_and_the_bytes_are_the_same():
    prompt = make_prompt(150, 53)
    with pdd_agents(FAST_LINK, "--max-batch-tokens", "32", tag="-whole") as agents:
        expected = run_single(agents["single"], prompt, 8)["output_token_ids"]
        got = _generate(agents, "whole", prompt, 8, "p-md")
    assert got["error"] is None and got["output_token_ids"] == expected
    assert got["stats"]["kv_stream_pieces"] == 0
    assert got["stats"]["kv_bytes"]["wan"] == 150 * 4096 + 24  # one payload, one header


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


def test_a_narrower_md_gets_its_own_dtype_converted_on_the_sending_side():
    """MD says at reservation what it stores: a bfloat16 MD gets bfloat16 from a float32 P
    (half the bytes) and holds exactly what it held when it narrowed the float32 itself."""
    from agent_node_helpers import agent_args, running

    from agents.node.launch import AgentProcess

    prompt = make_prompt(120, 55)
    bf16 = ("--dtype", "bfloat16")
    procs = [
        AgentProcess(agent_args("prefill", "dc-a", "--link", f"dc-b={FAST_LINK}"), "p-narrow"),
        AgentProcess(
            agent_args("main_decode", "dc-b", "--link", f"dc-a={FAST_LINK}", *bf16), "md-narrow"
        ),  # fmt: skip
        AgentProcess(agent_args("main_decode", "dc-a", *bf16), "md2-narrow"),
    ]
    with running(*procs) as (p, md, md2):
        # Over the WAN with the link asking for float32: P sends float32, MD narrows it.
        body = pdd_body("narrow-md", prompt, 12, "p-md", "one-shot", p, None, md)
        body["main"]["kv_format"] = "float32"
        wide = summarize(stream_events(f"{p.http}/v1/pdd/generate", body)[0])
        # In P's datacenter, no link format: P narrows to the MD's bfloat16 before sending.
        body = pdd_body("narrow-p", prompt, 12, "p-md", "one-shot", p, None, md2,
                        main_datacenter="dc-a")  # fmt: skip
        narrow = summarize(stream_events(f"{p.http}/v1/pdd/generate", body)[0])
    assert wide["error"] is None and narrow["error"] is None, (wide, narrow)
    assert narrow["output_token_ids"] == wide["output_token_ids"]
    assert wide["stats"]["kv_bytes"]["wan"] == 120 * 4096 + 24
    assert narrow["stats"]["kv_bytes"]["intra_dc"] == 120 * 4096 // 2 + 24


def test_pieces_that_cover_the_whole_prompt_close_the_transfer_without_an_empty_one():
    """128 tokens in 32-token forwards: the pieces cover the prompt before prefill ends, so
    nothing is left for the end (an empty 8-bit piece once failed the whole transfer)."""
    prompt = make_prompt(128, 56)
    with pdd_agents(FAST_LINK, *STREAMED, tag="-stream-int8") as agents:
        got = _generate(agents, "stream-int8", prompt, 8, "p-md", "int8")
    assert got["error"] is None, got
    assert got["stats"]["kv_format_wan"] == "int8"
    # One piece per forward (4), or fewer when the sender fell behind and joined the blocks
    # of two forwards (a loaded machine: the clean-clone suite beside a benchmark gave 3);
    # never a fifth, empty one for the end.
    assert 2 <= got["stats"]["kv_stream_pieces"] <= 4
    assert len(got["output_token_ids"]) == 8
