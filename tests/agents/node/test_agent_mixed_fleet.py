"""Decoders of another kind on real agents: P and RLD with one engine block size (and dtype),
MD with another.

- Block sizes only (float32 everywhere; P and RLD 16, MD 32, and the other way round): every
  pipeline gives ``single``'s tokens exactly, and with part of the prompt in MD's cache P sends
  only what MD lacks, counted in MD's own blocks.
- Mixed formats (P and RLD bfloat16 block 16, MD float16 block 32): every pipeline runs whole
  and P's token is a bfloat16 engine's; the two dtypes round differently, so this is not a
  lossless path and the rest is not compared token for token."""

from __future__ import annotations

import pytest
from agent_node_helpers import (
    FAST_LINK,
    PIPELINE_CASES,
    agent_args,
    make_prompt,
    run_pdd,
    run_single,
    running,
)

from agents.node.launch import AgentProcess

pytestmark = pytest.mark.slow

CASES = PIPELINE_CASES


def _fleet(p_side: tuple[str, ...], md_side: tuple[str, ...], single: tuple[str, ...], tag: str):
    specs = {
        "p": agent_args("prefill", "dc-a", "--link", f"dc-b={FAST_LINK}", *p_side),
        "rld": agent_args("relay_decode", "dc-a", "--link", f"dc-b={FAST_LINK}", *p_side),
        "md": agent_args("main_decode", "dc-b", "--link", f"dc-a={FAST_LINK}", *md_side),
        "single": agent_args("main_decode", "dc-a", *single),
    }
    procs = [AgentProcess(args, name + tag) for name, args in specs.items()]
    return specs, running(*procs)


@pytest.fixture(scope="module", params=[(16, 32), (32, 16)], ids=["p16-md32", "p32-md16"])
def blocks(request):
    p_bs, md_bs = request.param
    specs, ctx = _fleet(
        ("--block-size", str(p_bs)),
        ("--block-size", str(md_bs)),
        ("--block-size", str(p_bs)),
        f"-bs{p_bs}-{md_bs}",
    )
    with ctx as started:
        yield {"p_bs": p_bs, "md_bs": md_bs, **dict(zip(specs, started, strict=True))}


def _run(fleet, rid: str, prompt: list[int], max_tokens: int, pipeline, handoff, extra) -> dict:
    result = run_pdd(
        fleet["p"], fleet["rld"], fleet["md"], rid, prompt, max_tokens, pipeline, handoff, **extra
    )
    assert result["error"] is None, result["error"]
    assert result["indexes"] == list(range(max_tokens))
    if pipeline == "p-rld-md":
        assert result["stats"]["handoff"]["completed"] is True, result["stats"]["handoff"]
    return result


@pytest.mark.parametrize(("pipeline", "handoff", "extra"), CASES)
def test_block_sizes_that_differ_give_singles_tokens(blocks, pipeline, handoff, extra):
    prompt = make_prompt(75, 51)
    max_tokens = 120 if handoff == "catch-up" else 40  # catch-up: time for MD's batches
    expected = run_single(blocks["single"], prompt, max_tokens)["output_token_ids"]
    rid = f"bs-{blocks['p_bs']}-{pipeline}-{handoff}-{extra.get('handoff_at', 0)}"
    result = _run(blocks, rid, prompt, max_tokens, pipeline, handoff, extra)
    assert result["output_token_ids"] == expected


def test_p_sends_only_what_md_lacks_in_md_s_blocks(blocks):
    """MD holds 90 tokens of the prompt: its cache keeps whole blocks of its own size (80 at
    16, 64 at 32); P's delta starts exactly there, not at a block boundary of P's size."""
    prompt = make_prompt(150, 52)
    warm = run_single(blocks["md"], prompt[:90], 1)
    assert warm["error"] is None
    held = 90 - 90 % blocks["md_bs"]
    result = _run(blocks, f"bs-delta-{blocks['p_bs']}", prompt, 12, "p-md", "one-shot", {})
    assert result["stats"]["cached_tokens"] == held
    assert (
        result["output_token_ids"] == run_single(blocks["single"], prompt, 12)["output_token_ids"]
    )


@pytest.fixture(scope="module")
def mixed():
    specs, ctx = _fleet(
        ("--dtype", "bfloat16", "--block-size", "16"),
        ("--dtype", "float16", "--block-size", "32"),
        ("--dtype", "bfloat16", "--block-size", "16"),
        "-mixed",
    )
    with ctx as started:
        yield dict(zip(specs, started, strict=True))


@pytest.mark.parametrize(("pipeline", "handoff", "extra"), CASES)
def test_a_mixed_format_fleet_runs_every_pipeline(mixed, pipeline, handoff, extra):
    prompt = make_prompt(80, 53)
    max_tokens = 120 if handoff == "catch-up" else 40
    reference = run_single(mixed["single"], prompt, max_tokens)["output_token_ids"]
    rid = f"mixed-{pipeline}-{handoff}-{extra.get('handoff_at', 0)}"
    result = _run(mixed, rid, prompt, max_tokens, pipeline, handoff, extra)
    tokens = result["output_token_ids"]
    # P's token is a bfloat16 prefill's, exactly; MD decodes in float16 on P's KV (bfloat16
    # values fit float16's wider mantissa) with its own float16 arithmetic, so the greedy path
    # parts from a bfloat16 engine's at some token (measured here on 2026-12-05: 11 of 40
    # positions agreed in p-md and one-shot-asap, 35 of 40 when RLD decoded 9 tokens in
    # bfloat16 first, 35 of 120 in catch-up; random weights, small logit gaps). Every pipeline
    # ran to its length, MD decoding.
    assert tokens[0] == reference[0]
    assert result["stats"]["tokens_by_role"]["md"] > 0
