"""One hop per token on real agent processes: P called with ``direct`` ends its stream with a
``continue`` event naming the decoding role's stream; the caller reads MD's (p-md) or RLD's
(p-rld-md) stream itself, with P's token at its head, and gets ``single``'s tokens, in order,
with the handoff as before. The decoder's served ledger counts what it streamed."""

from __future__ import annotations

import time

import httpx
import pytest
from agent_node_helpers import FAST_LINK, get, make_prompt, pdd_agents, run_single

from agents.node.loopback import pdd_body, stream_events, summarize

pytestmark = pytest.mark.slow


def run_direct(p, rld, md, request_id, prompt, max_tokens, pipeline, handoff="one-shot", **kw):
    """P's stream, then the decoder's it names: (P's events, the decoder's events)."""
    body = pdd_body(request_id, prompt, max_tokens, pipeline, handoff, p, rld, md, **kw)
    body["direct"] = True
    first, _, _ = stream_events(f"{p.http}/v1/pdd/generate", body)
    assert first[-1]["type"] == "continue", first
    follow = first[-1]
    assert "prompt_ids" not in follow["body"]  # the caller has them
    follow["body"]["prompt_ids"] = prompt
    rest, _, _ = stream_events(follow["url"], follow["body"])
    return first, follow, rest


def follow_handoff(rest):
    """RLD's stream ends with a `continue` to MD's after the handoff: (RLD's events without it,
    the continue, MD's stream from the handoff's index)."""
    assert rest[-1]["type"] == "continue", rest[-3:]
    handed = rest[-1]
    main, _, _ = stream_events(handed["url"], handed["body"])
    return rest[:-1], handed, main


CASES = [
    pytest.param("p-md", "one-shot", {}, id="p-md"),
    pytest.param("p-rld-md", "one-shot", {"handoff_at": 4}, id="one-shot"),
    # MD may be ready before RLD's first token: P's token still leads RLD's `continue`.
    pytest.param("p-rld-md", "one-shot", {"handoff_at": 0}, id="one-shot-at-once"),
    pytest.param(
        "p-rld-md",
        "catch-up",
        {"handoff_at": 8, "catch_up_batch": 4, "max_catch_up_batches": 2},
        id="catch-up",
    ),
]


@pytest.mark.parametrize(("pipeline", "handoff", "extra"), CASES)
def test_the_decoders_stream_read_directly_equals_single(cluster, pipeline, handoff, extra):
    prompt = make_prompt(70, 31)
    # Catch-up: RLD decodes on while MD takes its batches; with 30 tokens RLD sometimes
    # finished before MD caught up (the handoff then never completes), so the catch-up case
    # leaves RLD enough tokens (~0.5 s of decoding) for MD's two batches.
    max_tokens = 200 if handoff == "catch-up" else 30
    expected = run_single(cluster["single"], prompt, max_tokens)["output_token_ids"]
    rid = f"direct-{pipeline}-{handoff}-{extra.get('handoff_at', 0)}"
    first, follow, rest = run_direct(
        cluster["p"], cluster["rld"], cluster["md"], rid, prompt, max_tokens, pipeline, handoff,
        **extra,
    )  # fmt: skip
    # P sent no token itself (its token leads the decoder's stream) and named the routed one.
    assert [e["type"] for e in first] == ["continue"]
    decoder = cluster["md"] if pipeline == "p-md" else cluster["rld"]
    assert follow["url"].startswith(decoder.http + "/v1/pdd/")
    assert follow["role"] == ("md" if pipeline == "p-md" else "rld")
    assert follow["stats"]["prefill_s"] > 0
    if pipeline == "p-md":
        result = summarize(rest)
    else:
        # One hop per token after the handoff too: RLD names MD's stream from its token index.
        relayed, handed, main = follow_handoff(rest)
        assert handed["role"] == "md" and handed["url"] == cluster["md"].http + "/v1/pdd/attach"
        result = summarize(relayed + main)
        result["stats"] = handed["stats"]
    assert result["error"] is None, result["error"]
    assert result["output_token_ids"] == expected
    assert result["indexes"] == list(range(max_tokens))
    assert result["roles"][0] == "prefill"
    # Each decoder's ledger counts what it streamed to the caller, P's token included.
    served = get(decoder, f"/v1/pdd/requests/{rid}").json()
    if pipeline == "p-md":
        assert set(result["roles"][1:]) == {"md"}
        assert served["tokens"] == max_tokens and served["state"] == "done"
    else:
        handoff_stats = result["stats"]["handoff"]
        assert handoff_stats["completed"] is True, handoff_stats
        at = handoff_stats["at_token"]
        assert handed["body"]["from_index"] == at
        assert result["roles"][1:at] == ["rld"] * (at - 1)
        assert result["roles"][at:] == ["md"] * (max_tokens - at)
        assert result["stats"]["tokens_by_role"] == {"rld": at - 1, "md": 0}
        assert served["tokens"] == at
        md_served = get(cluster["md"], f"/v1/pdd/requests/{rid}").json()
        assert md_served["tokens"] == max_tokens - at and md_served["state"] == "done"


def test_an_early_first_token_comes_from_p_and_not_again(cluster):
    prompt = make_prompt(50, 32)
    body = pdd_body("direct-early", prompt, 10, "p-md", "one-shot", cluster["p"], None,
                    cluster["md"])  # fmt: skip
    body |= {"direct": True, "early_first_token": True}
    first, _, _ = stream_events(f"{cluster['p'].http}/v1/pdd/generate", body)
    assert [e["type"] for e in first] == ["token", "continue"]
    assert "first_event" not in first[-1]["body"]
    rest, _, _ = stream_events(first[-1]["url"], first[-1]["body"] | {"prompt_ids": prompt})
    result = summarize(rest)
    expected = run_single(cluster["single"], prompt, 10)["output_token_ids"]
    assert [first[0]["token_id"], *result["output_token_ids"]] == expected
    assert result["indexes"] == list(range(1, 10))


def test_a_first_event_that_is_not_ps_token_is_400(cluster):
    prompt = make_prompt(40, 33)
    body = pdd_body("direct-bad", prompt, 4, "p-md", "one-shot", cluster["p"], None,
                    cluster["md"])  # fmt: skip
    body["direct"] = True
    first, _, _ = stream_events(f"{cluster['p'].http}/v1/pdd/generate", body)
    follow = first[-1]
    follow["body"]["prompt_ids"] = prompt
    forged = dict(follow["body"])
    forged["first_event"] = dict(forged["first_event"], token_id=forged["first_token"] + 1)
    r = httpx.post(follow["url"], json=forged, timeout=30)
    assert r.status_code == 400 and "first_event" in r.text
    # The real one still streams (nothing of the refused call stayed on MD).
    rest, _, _ = stream_events(follow["url"], follow["body"])
    assert summarize(rest)["error"] is None


def test_an_attach_for_no_handed_off_stream_is_404(cluster):
    r = httpx.post(
        f"{cluster['md'].http}/v1/pdd/attach",
        json={"request_id": "never-handed-off", "from_index": 3},
        timeout=30,
    )
    assert r.status_code == 404 and r.json()["field"] == "request_id"
    r = httpx.post(
        f"{cluster['md'].http}/v1/pdd/attach",
        json={"request_id": "x", "from_index": -1},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["field"] == "from_index"


def test_a_handed_off_stream_nobody_attaches_to_is_let_go_on_md():
    """RLD handed over and the caller never came: MD decodes on for --handoff-attach-s, then
    lets the request go (no slot held for ever); the KV stays cached."""
    prompt = make_prompt(60, 34)
    with pdd_agents(FAST_LINK, "--handoff-attach-s", "0.5", single=False, tag="-attach") as ag:
        body = pdd_body("direct-orphan", prompt, 1500, "p-rld-md", "one-shot", ag["p"],
                        ag["rld"], ag["md"], handoff_at=4)  # fmt: skip
        body["direct"] = True
        first, _, _ = stream_events(f"{ag['p'].http}/v1/pdd/generate", body)
        follow = first[-1]
        rest, _, _ = stream_events(follow["url"], follow["body"] | {"prompt_ids": prompt})
        assert rest[-1]["type"] == "continue", rest[-3:]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            state = get(ag["md"], "/state").json()
            if state["active_requests"] == 0:
                break
            time.sleep(0.1)
        assert state["active_requests"] == 0, state
        # The request is gone from MD's engine; an attach now finds it ended or forgotten.
        handed = rest[-1]
        late, _, _ = stream_events(handed["url"], handed["body"])
        assert late[-1]["type"] == "error"


def test_a_decoder_waiting_for_its_kv_keeps_the_stream_alive():
    """MD's direct stream while P's KV crosses a slow WAN (10 Mbit/s: ~0.4 s for this prompt)
    says ``queued`` (waiting for kv) every --queued-every-s, so the gateway's first-token
    timeout measures silence, not the transfer; the tokens are single's all the same."""
    prompt, again = make_prompt(120, 34), make_prompt(120, 35)
    with pdd_agents("0.01:5:16", "--queued-every-s", "0.05", tag="-slow") as agents:
        expected = run_single(agents["single"], prompt, 8)["output_token_ids"]
        _, _, rest = run_direct(
            agents["p"], agents["rld"], agents["md"], "direct-slow", prompt, 8, "p-md"
        )
        # P relaying MD's stream (no `direct`) passes MD's keep-alives on.
        body = pdd_body("relayed-slow", again, 8, "p-md", "one-shot", agents["p"], None,
                        agents["md"])  # fmt: skip
        relayed, _, _ = stream_events(f"{agents['p'].http}/v1/pdd/generate", body)
        expected_again = run_single(agents["single"], again, 8)["output_token_ids"]
    for stream, want in ((rest, expected), (relayed, expected_again)):
        waits = [e for e in stream if e["type"] == "queued" and e["waiting_for"] == "kv"]
        assert waits, [e["type"] for e in stream]
        tokens = [e for e in stream if e["type"] == "token"]
        assert stream.index(waits[-1]) < stream.index(tokens[0])  # all before the first token
        assert summarize(stream)["output_token_ids"] == want
