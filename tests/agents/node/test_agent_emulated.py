"""Emulated instances in real agent processes: labelled as emulated in the state document and
/metrics, every pipeline gives `single`'s tokens over the real fabrics and a shaped WAN with
scaled KV bytes, and bad start commands get a 400 naming the field."""

from __future__ import annotations

import json

import httpx
import pytest
from agent_node_helpers import agent_args, get, make_prompt, run_pdd, run_single, running

from agents.node.launch import AgentProcess
from pdd.hardware import decode_step_time
from pdd.profiles import PAPER_GPUS, load_profile

pytestmark = pytest.mark.slow

# Per chip, as the fleet's GPU type rows hold them; 8 chips a unit (the planner's GPU-A/B).
GPU_A, GPU_B = PAPER_GPUS["GPU-A"], PAPER_GPUS["GPU-B"]
PROFILE = "profile:paper-dsv4"
KV_SCALE = 100
# 20 Gbit/s declared: the shaper runs at 20 / KV_SCALE.
WAN = "20:20:16"


def emulated_args(role: str, dc: str, gpu: dict, *extra: str) -> list[str]:
    return agent_args(
        role,
        dc,
        "--model",
        PROFILE,
        "--gpu",
        json.dumps(gpu),
        "--kv-scale",
        str(KV_SCALE),
        *extra,
    )


@pytest.fixture(scope="module")
def fleet():
    specs = {
        "p": emulated_args("prefill", "dc-a", GPU_A, "--link", f"dc-b={WAN}"),
        "rld": emulated_args("relay_decode", "dc-a", GPU_A, "--link", f"dc-b={WAN}"),
        "md": emulated_args("main_decode", "dc-b", GPU_B, "--link", f"dc-a={WAN}"),
        "single": emulated_args("main_decode", "dc-a", GPU_A),
    }
    procs = [AgentProcess(args, f"emu-{name}") for name, args in specs.items()]
    with running(*procs) as started:
        yield dict(zip(specs, started, strict=True))


def test_the_state_document_and_metrics_say_emulated(fleet):
    (inst,) = get(fleet["md"], "/state").json()["instances"]
    assert inst["engine_kind"] == "emulated" and inst["gpu"] == "GPU-B"
    assert inst["kv"]["dtype"] == "bfloat16"  # a profile's KV (pdd/kv_formats.py)
    emulation = inst["emulation"]
    assert emulation["profile"] == "paper-dsv4" and emulation["kv_scale"] == KV_SCALE
    assert emulation["gpu"]["mem_bw_tbps"] == pytest.approx(8 * 3350 * 2.1 / 1000)
    assert inst["load"]["max_running"] == 128
    metrics = get(fleet["md"], "/metrics").text
    assert 'engine="emulated"' in metrics and 'engine="torch"' not in metrics
    link = get(fleet["p"], "/state").json()["links"]["dc-b"]
    assert link["bandwidth_gbps"] == 20 and link["wire_bandwidth_gbps"] == pytest.approx(0.2)


@pytest.mark.parametrize(
    ("pipeline", "handoff", "extra"),
    [
        ("p-md", "one-shot", {}),
        ("p-rld-md", "one-shot", {"handoff_at": 5}),
        ("p-rld-md", "catch-up", {"handoff_at": 4, "catch_up_batch": 3}),
    ],
)
def test_every_pipeline_gives_singles_tokens(fleet, pipeline, handoff, extra):
    prompt = make_prompt(3000, 7)
    expected = run_single(fleet["single"], prompt, 60)["output_token_ids"]
    result = run_pdd(
        fleet["p"],
        fleet["rld"],
        fleet["md"],
        f"emu-{pipeline}-{handoff}",
        prompt,
        60,
        pipeline,
        handoff,
        **extra,
    )
    assert result["error"] is None, result["error"]
    assert result["output_token_ids"] == expected


def test_wan_bytes_are_the_real_bytes_over_the_kv_scale(fleet):
    before = get(fleet["p"], "/state").json()["fabrics"]["wan"]["sent_payload_bytes"]
    prompt = make_prompt(2048, 99)
    result = run_pdd(fleet["p"], None, fleet["md"], "emu-bytes", prompt, 4, "p-md")
    assert result["error"] is None
    sent = get(fleet["p"], "/state").json()["fabrics"]["wan"]["sent_payload_bytes"] - before
    real = 2048 * load_profile(PROFILE).model.kv_bytes_per_token
    assert sent >= real // KV_SCALE
    assert sent < real // KV_SCALE + 4096  # plus headers and framing


@pytest.mark.parametrize(("fmt", "width"), [("int8", 0.5 * (1 + 1 / 256)), ("float32", 2.0)])
def test_a_links_kv_format_changes_what_emulated_kv_takes_on_the_wan(fleet, fmt, width):
    """The WAN link's format (the main peer's kv_format) on emulated engines: the payload
    crosses with that format's bytes per token (the profile's KV taken as bfloat16), P's stats
    count it so, MD imports it, and the tokens are single's."""
    from agents.node.loopback import pdd_body, stream_events, summarize

    prompt = make_prompt(2048, 98 if fmt == "int8" else 97)
    expected = run_single(fleet["single"], prompt, 4)["output_token_ids"]
    before = get(fleet["p"], "/state").json()["fabrics"]["wan"]["sent_payload_bytes"]
    body = pdd_body(f"emu-{fmt}", prompt, 4, "p-md", "one-shot", fleet["p"], None, fleet["md"])
    body["main"]["kv_format"] = fmt
    events, _, _ = stream_events(f"{fleet['p'].http}/v1/pdd/generate", body)
    result = summarize(events)
    assert result["error"] is None, result["error"]
    assert result["output_token_ids"] == expected
    assert result["stats"]["kv_format_wan"] == fmt
    real = 2048 * load_profile(PROFILE).model.kv_bytes_per_token
    assert result["stats"]["kv_bytes"]["wan"] == pytest.approx(real * width, rel=1e-3)
    sent = get(fleet["p"], "/state").json()["fabrics"]["wan"]["sent_payload_bytes"] - before
    # The wire carries whole bytes per token: the format's share of the engine's own.
    wire = 2048 * round(round(load_profile(PROFILE).model.kv_bytes_per_token / KV_SCALE) * width)
    assert wire <= sent < wire + 4096


def test_decode_steps_take_the_units_modelled_time(fleet):
    # The modelled busy time of a fresh 1-request decode equals the hardware model's sum.
    def busy(agent: AgentProcess) -> float:
        (inst,) = get(agent, "/state").json()["instances"]
        return inst["emulation"]["modelled_busy_s"]

    agent = fleet["single"]
    prompt = make_prompt(100, 3)
    run_single(agent, prompt, 2)  # prompt cached: the next request decodes only
    start = busy(agent)
    run_single(agent, prompt, 21)
    used = busy(agent) - start
    profile = load_profile(PROFILE)
    from pdd.hardware import forward_time, unit_from_json

    unit = unit_from_json(GPU_A)
    # Positions 96..99 recomputed (prefix cache is block-aligned), then 20 decode steps.
    expected = forward_time([4], [96], profile.model, unit, profile.engine) + sum(
        decode_step_time(100 + i + 1, profile.model, unit, profile.engine, batch=1)
        for i in range(20)
    )
    assert used == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"role": "prefill", "source": PROFILE}, "gpu"),
        ({"role": "prefill", "source": PROFILE, "gpu": {**GPU_A, "memory_gib": -1}}, "memory_gib"),
        ({"role": "prefill", "source": PROFILE, "gpu": {**GPU_A, "count": 0}}, "gpu.count"),
        ({"role": "prefill", "source": "profile:nope", "gpu": GPU_A}, "names no profile"),
        ({"role": "prefill", "source": "baton-tiny"}, "emulated instances only"),
    ],
)
def test_a_bad_start_command_gets_a_400_naming_the_field(fleet, body, field):
    response = httpx.put(f"{fleet['p'].http}/instances/9", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert field in response.text
    assert [i["instance_id"] for i in get(fleet["p"], "/state").json()["instances"]] == ["0"]


def test_an_agent_of_emulated_instances_never_loads_torch(fleet):
    # Deterministic: torch's shared library is not mapped into the agent process.
    pid = fleet["md"].proc.pid
    with open(f"/proc/{pid}/maps") as maps:
        assert "libtorch" not in maps.read()


def test_the_agent_and_the_emulated_engine_import_without_torch():
    import subprocess
    import sys

    code = (
        "import sys, agents.node.serve, agents.node.http_api, agents.engine.emulated; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_slow_motion_slows_the_wan_link_as_it_slows_the_engines():
    """--speedup F: the shaper runs at bandwidth x F / kv_scale and RTT / F; the state
    document still declares the link as given."""
    import asyncio

    from agents.node.agent import Agent
    from agents.node.settings import AgentSettings
    from agents.transfer.shaping import LinkSettings

    async def main():
        agent = Agent(AgentSettings(kv_scale=100, speedup=0.125))
        try:
            declared = agent.links.set("dc-b", LinkSettings(2.5, 20.0, 10))
            shaped = agent.links.shaper("dc-b").settings
            assert shaped.bandwidth_gbps == pytest.approx(2.5 * 0.125 / 100)
            assert shaped.rtt_ms == pytest.approx(160.0)
            assert (declared.bandwidth_gbps, declared.rtt_ms) == pytest.approx((2.5, 20.0))
            doc = agent.reporting.state()["links"]["dc-b"]
            assert doc["speedup"] == 0.125 and doc["bandwidth_gbps"] == pytest.approx(2.5)
        finally:
            await agent.close()

    asyncio.run(main())


def test_slow_motion_stretches_the_protocols_timeouts():
    from agents.node.settings import SLOW_MOTION_TIMEOUTS, AgentSettings, load_settings

    normal = AgentSettings()
    slow = load_settings(None, {"speedup": 0.125, "kv_timeout_s": 10.0})
    assert slow.kv_timeout_s == pytest.approx(80.0)  # given in modelled seconds
    for name in SLOW_MOTION_TIMEOUTS[1:]:
        assert getattr(slow, name) == pytest.approx(getattr(normal, name) * 8)
    assert load_settings(None, {"speedup": 2.0}).reserve_ttl_s == normal.reserve_ttl_s
