"""Every role that emits tokens (P's first token, RLD, MD after a handoff, single) adds the
token's logprob and its top alternatives when the request asks (sampling.logprobs), the same
values `single` gives for the same greedy request; nothing when it does not ask."""

from __future__ import annotations

import math

import pytest
from agent_node_helpers import make_prompt, stream_events

from agents.node.loopback import pdd_body

pytestmark = pytest.mark.slow
K = 3


def _tokens(events: list[dict]) -> list[dict]:
    assert events[-1]["type"] == "done", events[-1]
    return [e for e in events if e["type"] == "token"]


def _single(cluster, prompt, max_tokens, logprobs):
    sampling = {"max_tokens": max_tokens, "ignore_eos": True}
    if logprobs is not None:
        sampling["logprobs"] = logprobs
    events, _, _ = stream_events(
        f"{cluster['single'].http}/v1/generate", {"prompt_ids": prompt, "sampling": sampling}
    )
    return _tokens(events)


def _same_logprobs(got: dict, want: dict) -> None:
    assert got["token_id"] == want["token_id"]
    assert math.isclose(got["logprob"], want["logprob"], abs_tol=1e-4), (got, want)
    assert len(got["top_logprobs"]) == K
    for (_, v), (_, w) in zip(got["top_logprobs"], want["top_logprobs"], strict=True):
        assert math.isclose(v, w, abs_tol=1e-4)
    assert got["top_logprobs"][0][0] == got["token_id"]  # greedy: the most likely token


@pytest.mark.parametrize(
    ("pipeline", "handoff", "extra"),
    [
        ("p-md", "one-shot", {}),
        ("p-rld-md", "one-shot", {"handoff_at": 6}),
        # At most 2 catch-up batches, then the final one (as test_agent_pipelines does): a
        # catch-up left to converge on its own may never do so within 32 tokens when MD
        # extends slower than RLD decodes, and RLD then finishes alone.
        ("p-rld-md", "catch-up", {"handoff_at": 4, "catch_up_batch": 3, "max_catch_up_batches": 2}),
        ("rld-only", "one-shot", {}),
    ],
)
def test_every_role_adds_the_logprobs_single_gives(cluster, pipeline, handoff, extra):
    prompt = make_prompt(50, 21)
    max_tokens = 32
    expected = _single(cluster, prompt, max_tokens, K)
    body = pdd_body(
        f"lp-{pipeline}-{handoff}",
        prompt,
        max_tokens,
        pipeline,
        handoff,
        cluster["p"],
        cluster["rld"] if pipeline != "p-md" else None,
        cluster["md"],
        **extra,
    )
    body["sampling"]["logprobs"] = K
    if pipeline == "rld-only":
        body.pop("main")
    got = _tokens(stream_events(f"{cluster['p'].http}/v1/pdd/generate", body)[0])
    assert len(got) == max_tokens
    for g, w in zip(got, expected, strict=True):
        _same_logprobs(g, w)
    roles = {e["role"] for e in got}
    assert "prefill" in roles
    if pipeline == "p-rld-md":
        assert {"rld", "md"} <= roles  # both sides of the handoff carried them


def test_without_asking_no_event_carries_logprobs(cluster):
    prompt = make_prompt(40, 22)
    assert not any("logprob" in e for e in _single(cluster, prompt, 6, None))
    body = pdd_body(
        "lp-none", prompt, 6, "p-rld-md", "one-shot", cluster["p"], cluster["rld"], cluster["md"]
    )
    body["handoff_at"] = 2
    got = _tokens(stream_events(f"{cluster['p'].http}/v1/pdd/generate", body)[0])
    assert len(got) == 6
    assert not any("logprob" in e or "top_logprobs" in e for e in got)
