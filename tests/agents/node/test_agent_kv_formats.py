"""The KV format a WAN link asks for (the main peer's ``kv_format``), on real agents: P encodes
MD's delta, MD decodes it into its own dtype. Lossless conversions give ``single``'s tokens
exactly; 8-bit transport carries about a quarter of float32's bytes and its agreement with
the lossless path is measured."""

from __future__ import annotations

import pytest
from agent_node_helpers import FAST_LINK, make_prompt, pdd_agents, run_single

from agents.node.loopback import pdd_body, stream_events, summarize

pytestmark = pytest.mark.slow


def _p_md(agents, rid: str, prompt: list[int], max_tokens: int, fmt: str | None) -> dict:
    body = pdd_body(rid, prompt, max_tokens, "p-md", "one-shot", agents["p"], None, agents["md"])
    if fmt is not None:
        body["main"]["kv_format"] = fmt
    events, _, _ = stream_events(f"{agents['p'].http}/v1/pdd/generate", body)
    return summarize(events)


def test_widening_across_the_wan_gives_singles_tokens_on_a_bfloat16_fleet():
    """P and MD hold bfloat16; the link asks for float32 (widened on P, narrowed back exactly
    on MD): the same tokens as single, and twice the WAN bytes."""
    first, second = make_prompt(90, 41), make_prompt(90, 44)  # fresh: MD holds neither
    with pdd_agents(FAST_LINK, "--dtype", "bfloat16", tag="-bf16") as agents:
        expected = [
            run_single(agents["single"], p, 16)["output_token_ids"] for p in (first, second)
        ]
        own = _p_md(agents, "fmt-own", first, 16, None)
        wide = _p_md(agents, "fmt-f32", second, 16, "float32")
    assert own["error"] is None and wide["error"] is None, (own, wide)
    assert own["output_token_ids"] == expected[0]
    assert wide["output_token_ids"] == expected[1]
    own_wan, wide_wan = own["stats"]["kv_bytes"]["wan"], wide["stats"]["kv_bytes"]["wan"]
    assert wide_wan == pytest.approx(2 * own_wan, rel=0.01)


def test_int8_across_the_wan_is_a_quarter_of_the_bytes_and_its_agreement_measured(cluster):
    prompt, again = make_prompt(120, 42), make_prompt(120, 45)  # fresh: MD holds neither
    expected = run_single(cluster["single"], prompt, 24)["output_token_ids"]
    lossless = _p_md(cluster, "fmt-lossless", prompt, 24, None)
    packed = _p_md(cluster, "fmt-int8", again, 24, "int8")
    expected_again = run_single(cluster["single"], again, 24)["output_token_ids"]
    assert lossless["error"] is None and packed["error"] is None, packed
    assert lossless["output_token_ids"] == expected
    assert packed["stats"]["kv_format_wan"] == "int8"
    assert lossless["stats"]["kv_format_wan"] == ""  # the engine's own: nothing to say
    ratio = lossless["stats"]["kv_bytes"]["wan"] / packed["stats"]["kv_bytes"]["wan"]
    assert ratio >= 3.5, ratio
    # Lossy: the greedy tokens may part from the lossless path; how many agree is measured.
    agree = sum(a == b for a, b in zip(packed["output_token_ids"], expected_again, strict=True))
    # 24 of 24 at e137d3f; a decode that lost the values would agree on ~1 (P's own token).
    assert len(packed["output_token_ids"]) == 24 and agree >= 18, agree


def test_a_bad_kv_format_is_400_naming_the_field(cluster):
    body = pdd_body("fmt-bad", make_prompt(20, 43), 4, "p-md", "one-shot", cluster["p"], None,
                    cluster["md"])  # fmt: skip
    body["main"]["kv_format"] = "int4"
    events, _, _ = stream_events(f"{cluster['p'].http}/v1/pdd/generate", body)
    assert events[0]["type"] == "error" and "400" in events[0]["message"]
    assert "main.kv_format" in events[0]["message"]
