"""PDD pipelines across real agent processes on loopback: token identity with `single`, the DRC
delta, WAN shaping, eviction under pressure, a corrupt frame, and MD dying mid-handoff."""

from __future__ import annotations

import os
import signal
import threading

import httpx
import pytest
from agent_node_helpers import (
    FAST_LINK,
    PIPELINE_CASES,
    agent_args,
    get,
    make_prompt,
    run_pdd,
    run_single,
    running,
    stream_events,
    summarize,
    warm,
)

from agents.engine.kv_pool import KV_HEADER_BYTES
from agents.node.launch import AgentProcess
from agents.node.loopback import pdd_body
from agents.transfer.frames import FrameKind, encode_end, encode_frame

pytestmark = pytest.mark.slow
KV_BYTES_PER_TOKEN = 2 * 4 * 2 * 64 * 4  # baton-tiny: K and V, 4 layers, 2 KV heads, dim 64, f32

CASES = PIPELINE_CASES


def assert_one_ordered_stream(result: dict) -> None:
    assert result["error"] is None, result["error"]
    assert result["indexes"] == list(range(len(result["output_token_ids"])))


@pytest.mark.parametrize("seed", [11, 12, 13])
@pytest.mark.parametrize(("pipeline", "handoff", "extra"), CASES)
def test_greedy_output_is_token_identical_to_single(cluster, seed, pipeline, handoff, extra):
    prompt = make_prompt(40 + 30 * (seed - 11), seed)
    max_tokens = 40
    expected = run_single(cluster["single"], prompt, max_tokens)["output_token_ids"]
    result = run_pdd(
        cluster["p"],
        cluster["rld"],
        cluster["md"],
        f"ident-{pipeline}-{handoff}-{seed}-{extra.get('handoff_at', 0)}",
        prompt,
        max_tokens,
        pipeline,
        handoff,
        **extra,
    )
    assert_one_ordered_stream(result)
    assert result["output_token_ids"] == expected
    roles = result["stats"]["tokens_by_role"]
    assert roles["prefill"] == 1 and roles["prefill"] + roles["rld"] + roles["md"] == max_tokens
    if pipeline == "p-md":
        assert roles["rld"] == 0
        return
    handoff_stats = result["stats"]["handoff"]
    assert handoff_stats["mode"] == handoff
    assert handoff_stats["completed"] is True, handoff_stats
    at = handoff_stats["at_token"]
    assert at >= extra.get("handoff_at", 0) + 1
    assert result["roles"][1:at] == ["rld"] * (at - 1)
    assert result["roles"][at:] == ["md"] * (max_tokens - at)
    assert result["stats"]["handoff_bytes"] > 0
    if handoff == "catch-up":
        # At least one catch-up batch of >= 4 tokens (8 were pending), at most two, then the
        # final one.
        assert 2 <= handoff_stats["batches"] <= 3


def test_shared_prefix_sends_only_the_delta_over_the_wan(cluster):
    prompt = make_prompt(150, 21)
    warm(cluster["md"], prompt[:100])  # MD's DRC now holds 96 tokens (6 whole blocks)
    result = run_pdd(cluster["p"], cluster["rld"], cluster["md"], "delta", prompt, 8, "p-md")
    assert_one_ordered_stream(result)
    stats = result["stats"]
    assert stats["cached_tokens"] == 96
    assert stats["kv_bytes"]["wan"] == KV_HEADER_BYTES + (150 - 96) * KV_BYTES_PER_TOKEN
    assert (
        result["output_token_ids"] == run_single(cluster["single"], prompt, 8)["output_token_ids"]
    )


def test_p_rld_md_sends_the_full_kv_intra_dc_and_the_delta_over_the_wan(cluster):
    prompt = make_prompt(120, 22)
    warm(cluster["md"], prompt[:64])
    result = run_pdd(cluster["p"], cluster["rld"], cluster["md"], "both", prompt, 8, "p-rld-md")
    assert_one_ordered_stream(result)
    kv = result["stats"]["kv_bytes"]
    assert kv["intra_dc"] == KV_HEADER_BYTES + 120 * KV_BYTES_PER_TOKEN
    assert kv["wan"] == KV_HEADER_BYTES + (120 - 64) * KV_BYTES_PER_TOKEN


def test_relayed_kv_to_md_is_background_wan_traffic(cluster):
    def connections() -> dict:
        return get(cluster["p"], "/state").json()["links"]["dc-b"]["connections"]

    before = connections()
    relayed = run_pdd(
        cluster["p"], cluster["rld"], cluster["md"], "bg", make_prompt(50, 24), 4, "p-rld-md"
    )
    middle = connections()
    direct = run_pdd(
        cluster["p"], cluster["rld"], cluster["md"], "fg", make_prompt(50, 25), 4, "p-md"
    )
    after = connections()
    assert_one_ordered_stream(relayed)
    assert_one_ordered_stream(direct)
    # P-RLD-MD: RLD answers the user, so P's KV for MD queues behind urgent transfers ...
    assert middle["acquisitions"] == before["acquisitions"] + 1
    assert middle["background_acquisitions"] == before["background_acquisitions"] + 1
    # ... while P-MD's transfer is what the first token waits on: urgent.
    assert after["acquisitions"] == middle["acquisitions"] + 1
    assert after["background_acquisitions"] == middle["background_acquisitions"]
    assert after["in_use"] == 0 and after["waiting"] == 0


def test_unreachable_md_leaves_rld_to_finish_the_request(cluster):
    prompt = make_prompt(60, 23)
    body = pdd_body(
        "no-md", prompt, 16, "p-rld-md", "one-shot", cluster["p"], cluster["rld"], cluster["md"]
    )
    body["main"]["http"] = "http://127.0.0.1:9"  # nothing listens there
    events, _, _ = stream_events(f"{cluster['p'].http}/v1/pdd/generate", body)
    result = summarize(events)
    assert_one_ordered_stream(result)
    assert (
        result["output_token_ids"] == run_single(cluster["single"], prompt, 16)["output_token_ids"]
    )
    assert result["stats"]["tokens_by_role"]["md"] == 0


def test_corrupt_frame_fails_one_request_and_not_the_agent(cluster):
    md = cluster["md"]
    prompt = make_prompt(40, 24)
    outcome: dict = {}

    def decode() -> None:
        events, _, _ = stream_events(
            f"{md.http}/v1/pdd/decode",
            {
                "request_id": "corrupt",
                "instance": "0",
                "prompt_ids": prompt,
                "first_token": 65,
                "sampling": {"max_tokens": 4},
                "start_token": 0,
            },
        )
        outcome["events"] = events

    thread = threading.Thread(target=decode)
    thread.start()
    frame = bytearray(
        encode_frame(FrameKind.KV_BLOCKS, "corrupt|0|kv", b"x" * 4096, block_end=3, token_end=40)
    )
    frame[-1] ^= 0xFF  # payload no longer matches its CRC
    import socket

    with socket.create_connection(("127.0.0.1", md.wan_port), timeout=10) as sock:
        sock.sendall(bytes(frame) + encode_end("corrupt|0|kv", payload_bytes=4096, frames=1))
    thread.join(120)
    assert not thread.is_alive()
    events = outcome["events"]
    assert events[-1]["type"] == "error" and "KV transfer failed" in events[-1]["message"]
    assert get(md, "/health").json()["status"] == "ok"
    assert run_single(md, prompt, 4)["finish_reason"] == "length"


def test_eviction_under_pressure_keeps_the_reserved_prefix(cluster):
    p, single = cluster["p"], cluster["single"]
    with running(
        AgentProcess(agent_args("main_decode", "dc-b", "--num-blocks", "40"), "md-small")
    ) as (md,):
        kept, other = make_prompt(64, 31), make_prompt(64, 32)
        warm(md, kept)
        warm(md, other)  # 4 + 4 cached blocks, 32 free
        reserve = httpx.post(
            f"{md.http}/v1/pdd/reserve",
            json={"request_id": "pinned", "instance": "0", "prompt_ids": kept + [70] * 20},
            timeout=30,
        ).json()
        assert reserve["cached_tokens"] == 64
        flood = run_single(md, make_prompt(560, 33), 8)  # needs 36 blocks: must evict
        assert flood["finish_reason"] == "length"

        def cached(prompt, rid):
            return httpx.post(
                f"{md.http}/v1/pdd/reserve",
                json={"request_id": rid, "instance": "0", "prompt_ids": prompt},
                timeout=30,
            ).json()["cached_tokens"]

        assert cached(other, "probe-other") == 0  # the unpinned prefix was evicted
        assert cached(kept, "probe-kept") == 64  # the pinned one was kept
        httpx.post(f"{md.http}/v1/pdd/cancel", json={"request_id": "probe-kept"}, timeout=30)
        httpx.post(f"{md.http}/v1/pdd/cancel", json={"request_id": "probe-other"}, timeout=30)
        prompt = kept + [70] * 20
        result = run_pdd(p, None, md, "pinned", prompt, 8, "p-md")
        assert_one_ordered_stream(result)
        assert result["stats"]["cached_tokens"] == 64
        assert result["output_token_ids"] == run_single(single, prompt, 8)["output_token_ids"]


def test_wan_shaping_cannot_deliver_faster_than_its_bandwidth(cluster):
    gbps, rtt_ms = 0.02, 10.0  # 2.5 MB/s
    with running(
        AgentProcess(agent_args("prefill", "dc-a", "--link", f"dc-b={gbps}:{rtt_ms}:4"), "p-slow")
    ) as (p,):
        prompt = make_prompt(200, 41)
        result = run_pdd(p, None, cluster["md"], "shaped", prompt, 4, "p-md")
        assert_one_ordered_stream(result)
        wire = result["stats"]["kv_wire_bytes"]["wan"]
        rate = gbps * 1e9 / 8
        allowance = 32 * 1024 + rate * 0.005  # one quantum + the catch-up window
        floor_s = (wire - allowance) / rate + rtt_ms / 1000
        delivered_s = result["stats"]["e2e_s"] - result["stats"]["prefill_s"]
        assert wire > 200 * KV_BYTES_PER_TOKEN
        assert delivered_s >= floor_s
        state = get(p, "/state").json()
        assert state["fabrics"]["wan"]["sent_bytes"] == wire
        assert state["links"]["dc-b"]["bandwidth_gbps"] == gbps


def test_md_killed_mid_handoff_leaves_rld_to_finish_with_the_same_tokens(cluster):
    rld, single = cluster["rld"], cluster["single"]
    # A slow WAN keeps MD short of "ready" while it is killed, so the handoff cannot complete.
    with running(
        AgentProcess(agent_args("prefill", "dc-a", "--link", "dc-b=0.01:10:4"), "p-slow"),
        AgentProcess(agent_args("main_decode", "dc-b"), "md-doomed"),
    ) as (p, md):
        prompt = make_prompt(200, 51)
        body = pdd_body("doomed", prompt, 48, "p-rld-md", "one-shot", p, rld, md)
        events: list[dict] = []
        with (
            httpx.Client(timeout=httpx.Timeout(30, read=120)) as http,
            http.stream("POST", f"{p.http}/v1/pdd/generate", json=body) as response,
        ):
            assert response.status_code == 200
            import json

            for line in response.iter_lines():
                if not line.strip():
                    continue
                events.append(json.loads(line))
                if events[-1].get("index") == 1:
                    os.killpg(md.proc.pid, signal.SIGKILL)
        result = summarize(events)
        assert md.proc.wait(30) is not None
        assert_one_ordered_stream(result)
        assert result["output_token_ids"] == run_single(single, prompt, 48)["output_token_ids"]
        handoff = result["stats"]["handoff"]
        assert handoff["completed"] is False
        assert handoff["failed"]
        assert result["stats"]["tokens_by_role"]["rld"] == 47
        assert get(rld, "/health").json()["status"] == "ok"
        assert get(p, "/health").json()["status"] == "ok"


def test_rld_only_finishes_on_the_relay_with_no_wan_transfer(cluster):
    """Singular traffic (and the no-MD fallback): P ships KV to RLD only; RLD decodes it all."""
    prompt = make_prompt(90, 31)
    body = pdd_body(
        "solo", prompt, 10, "rld-only", "one-shot", cluster["p"], cluster["rld"], cluster["md"]
    )
    body.pop("main")
    events, _, _ = stream_events(f"{cluster['p'].http}/v1/pdd/generate", body)
    result = summarize(events)
    assert_one_ordered_stream(result)
    stats = result["stats"]
    assert stats["kv_bytes"] == {"intra_dc": KV_HEADER_BYTES + 90 * KV_BYTES_PER_TOKEN, "wan": 0}
    assert stats["tokens_by_role"]["md"] == 0
    assert stats["tokens_by_role"]["rld"] == 9
    assert (
        result["output_token_ids"] == run_single(cluster["single"], prompt, 10)["output_token_ids"]
    )


def md_cache(agent) -> set[str]:
    state = get(agent, "/state").json()
    iid = state["instances"][0]["instance_id"]
    return set(get(agent, f"/instances/{iid}/cache").json()["blocks"])


def test_decode_agents_name_their_cached_prefix_blocks_as_gateway_hashes(cluster):
    """MD's KV cache events (and its cache endpoint) name its DRC blocks with the same chain
    hashes the gateway computes."""
    from pdd.prefix import prefix_block_hashes

    prompt = make_prompt(70, 32)
    warm(cluster["md"], prompt)
    assert set(prefix_block_hashes(prompt, 16)[:4]) <= md_cache(cluster["md"])
    summary = get(cluster["md"], "/state").json()["instances"][0]["kv_events"]
    assert summary["digest"]["blocks"] == len(md_cache(cluster["md"]))


def test_md_keeps_the_kv_when_rld_finishes_before_the_handoff(cluster):
    """MD's prefix cache must not fall behind P's, or later turns turn low-hit (docs/pdd.md): when
    RLD finishes a request alone, MD still imports the KV P sent it into its cache."""
    import time

    from pdd.prefix import prefix_block_hashes

    prompt = make_prompt(130, 33)
    # handoff_at beyond max_tokens: RLD finishes alone and just closes MD's stream.
    result = run_pdd(
        cluster["p"], cluster["rld"], cluster["md"], "alone", prompt, 4, "p-rld-md", handoff_at=50
    )
    assert_one_ordered_stream(result)
    assert result["stats"]["tokens_by_role"]["md"] == 0
    wanted = set(prefix_block_hashes(prompt, 16))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        state = get(cluster["md"], "/state").json()
        md_state = state["instances"][0]
        if wanted <= md_cache(cluster["md"]) and md_state["load"]["held"] == 0:
            break
        time.sleep(0.2)
    # MD let the request go (a held request nobody hands off to would keep a decode slot and
    # its blocks for good) and kept its KV.
    assert md_state["load"]["held"] == 0, md_state["load"]
    assert wanted <= md_cache(cluster["md"]), (
        result["stats"],
        md_state["load"],
        md_state["kv"],
        state.get("late_kv_cached"),
        state.get("kv_in_flight"),
    )


def test_a_full_md_leaves_the_relay_decoding_until_it_has_a_slot(cluster):
    """The full-MD rule relays a request whose MD is full; RLD hands off when MD admits it: MD
    says `ready` only once a decode slot is free, so RLD keeps streaming meanwhile instead of
    handing off into MD's queue. Same greedy tokens as `single`."""
    import time

    rld, single = cluster["rld"], cluster["single"]
    with running(
        AgentProcess(agent_args("prefill", "dc-a", "--link", f"dc-b={FAST_LINK}"), "p-slot"),
        AgentProcess(
            agent_args("main_decode", "dc-b", "--max-running", "1", "--link", f"dc-a={FAST_LINK}"),
            "md-one-slot",
        ),
    ) as (p, md):
        # A long request takes MD's only decode slot.
        results: list[dict] = []
        blocker = threading.Thread(
            target=lambda: results.append(
                run_pdd(p, rld, md, "slot-taker", make_prompt(40, 61), 300, "p-md")
            )
        )
        blocker.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if get(md, "/state").json()["instances"][0]["load"]["running"] == 1:
                break
            time.sleep(0.02)
        prompt = make_prompt(60, 62)
        relayed = run_pdd(p, rld, md, "waits-for-slot", prompt, 900, "p-rld-md", handoff_at=0)
        blocker.join(120)
    assert_one_ordered_stream(results[0])
    assert_one_ordered_stream(relayed)
    assert relayed["output_token_ids"] == run_single(single, prompt, 900)["output_token_ids"]
    handoff = relayed["stats"]["handoff"]
    assert handoff["completed"] is True, handoff
    # MD was not ready while the slot was taken (before, it was ready at once and RLD, asked
    # to hand off as early as it can, stopped after its first token).
    assert handoff["slot_wait_s"] > 0
    assert relayed["stats"]["tokens_by_role"]["rld"] == handoff["at_token"] - 1 > 1


def test_a_decode_call_that_arrives_after_its_cancel_gives_up_at_once(cluster):
    """P's or RLD's cancel can overtake the decode call for the same request (two
    connections): MD must end that call at once, not hold it until its KV timeout (120 s)."""
    from agents.node.loopback import bearer_headers, env_data_token

    md = cluster["md"]
    headers = bearer_headers(env_data_token())
    cancelled = httpx.post(
        f"{md.http}/v1/pdd/cancel", json={"request_id": "overtaken"}, headers=headers, timeout=30
    )
    assert cancelled.status_code == 200
    body = {
        "request_id": "overtaken",
        "instance": "0",
        "prompt_ids": make_prompt(32, 71),
        "first_token": 5,
        "sampling": {"max_tokens": 8},
        "start_token": 0,
        "hold": True,
    }
    events, _, elapsed = stream_events(f"{md.http}/v1/pdd/decode", body, timeout_s=20)
    assert events[-1]["type"] == "error" and "cancelled" in events[-1]["message"]
    assert elapsed < 20
