"""The agent's HTTP API as a real process: health, state, instance and link commands, input
errors, back-pressure, the command token after registration, and SIGTERM drain."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from agent_node_helpers import (
    FAST_LINK,
    agent_args,
    get,
    make_prompt,
    pdd_agents,
    run_single,
    running,
    stream_events,
    summarize,
)
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from agents.node.launch import AgentProcess
from agents.node.loopback import pdd_body
from pdd.token_ids import to_wire

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def agent():
    with running(AgentProcess(agent_args("main_decode", "dc-a", "--node", "n1"), "http")) as (a,):
        yield a


def test_health_and_state_document(agent):
    assert get(agent, "/health").json() == {
        "status": "ok",
        "node": "n1",
        "protocol": 1,
        "engine_options": {"device": "cpu", "dtype": "float32", "decode_weights": "full"},
    }
    run_single(agent, make_prompt(40, 1), 4)
    state = get(agent, "/state").json()
    (inst,) = state["instances"]
    assert inst["instance_id"] == "0" and inst["role"] == "main_decode"
    assert inst["state"] == "running"
    assert inst["kv"]["total_blocks"] == 256 and inst["kv"]["block_size"] == 16
    assert inst["kv"]["dtype"] == "float32"  # what a WAN link's format is relative to
    assert inst["load"]["max_running"] == 32
    assert inst["tokens_generated"] >= 4
    assert state["tokens_by_role"]["main_decode"] >= 4
    # The agent watches its own event loop: how late it ran recently (seconds, >= 0).
    assert set(state["loop_late_s"]) == {"10s", "60s"}
    assert 0 <= state["loop_late_s"]["10s"] <= state["loop_late_s"]["60s"] < 30
    assert inst["cache"]["cached_blocks"] >= 2
    assert set(state["fabrics"]) == {"intra_dc", "wan"}
    # The engine thread's time in engine work: the prefill and decode steps just run.
    assert inst["engine"]["busy_s"] > 0


def test_the_agent_reports_what_it_streamed_for_a_recent_request(agent):
    """A gateway that finishes a dead process's admissions asks P how many tokens it sent."""
    events, _, _ = stream_events(
        f"{agent.http}/v1/generate",
        {
            "request_id": "served-1",
            "prompt_ids": make_prompt(24, 3),
            "sampling": {"max_tokens": 5, "ignore_eos": True},
        },
    )
    assert events[-1]["type"] == "done"
    served = get(agent, "/v1/pdd/requests/served-1").json()
    assert served["request_id"] == "served-1"
    assert served["tokens"] == 5 and served["state"] == "done"
    assert served["finish_reason"] == events[-1]["finish_reason"]
    assert served["ended_at"] >= served["started_at"]
    missing = get(agent, "/v1/pdd/requests/never-seen")
    assert missing.status_code == 404 and missing.json()["field"] == "request_id"


def test_instance_put_is_idempotent_conflicts_and_deletes(agent):
    url = f"{agent.http}/instances/7"
    spec = {"role": "relay_decode", "model": "baton-tiny", "source": "baton-tiny"}
    first = httpx.put(url, json=spec, timeout=60)
    assert first.status_code == 200
    again = httpx.put(url, json=spec, timeout=60)
    assert again.status_code == 200 and again.json()["role"] == "relay_decode"
    assert httpx.put(url, json={**spec, "role": "prefill"}, timeout=60).status_code == 409
    drained = httpx.post(f"{url}/drain", timeout=60).json()
    assert drained["state"] == "drained"
    refused = httpx.post(
        f"{agent.http}/v1/generate",
        json={"instance": "7", "prompt_ids": [65, 66]},
        timeout=60,
    )
    assert refused.status_code == 503 and "draining" in refused.json()["error"]
    assert httpx.delete(url, timeout=60).json() == {"state": "stopped"}
    assert httpx.delete(url, timeout=60).json() == {"state": "stopped"}
    ids = [i["instance_id"] for i in get(agent, "/state").json()["instances"]]
    assert ids == ["0"]


def test_link_put_changes_the_shaper(agent):
    body = {"bandwidth_gbps": 2.5, "rtt_ms": 12.0, "pool_size": 3}
    assert httpx.put(f"{agent.http}/links/dc-z", json=body, timeout=30).json() == body
    body2 = {"bandwidth_gbps": 5.0, "rtt_ms": 1.0, "pool_size": 8}
    httpx.put(f"{agent.http}/links/dc-z", json=body2, timeout=30)
    link = get(agent, "/state").json()["links"]["dc-z"]
    assert {k: v for k, v in link.items() if k != "connections"} == body2
    bad = httpx.put(
        f"{agent.http}/links/dc-z",
        json={"bandwidth_gbps": -1, "rtt_ms": 1, "pool_size": 1},
        timeout=30,
    )
    assert bad.status_code == 400


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/generate", {}, "prompt_ids"),
        ("/v1/generate", {"prompt_ids": "abc"}, "prompt_ids"),
        ("/v1/generate", {"prompt_ids": [1, 2], "sampling": {"max_tokens": "x"}}, "max_tokens"),
        ("/v1/generate", {"prompt_ids": [1] * 4090, "sampling": {"max_tokens": 16}}, "prompt_ids"),
        ("/v1/generate", {"prompt_ids": [100000]}, "prompt_ids"),
        ("/v1/generate", {"prompt_ids": "AQAAAA!="}, "prompt_ids"),  # packed: not base64
        ("/v1/generate", {"prompt_ids": "AQAA"}, "prompt_ids"),  # packed: 3 bytes
        ("/v1/generate", {"prompt_ids": ""}, "prompt_ids"),  # packed: empty
        ("/v1/generate", {"prompt_ids": to_wire([1, 100000])}, "prompt_ids"),  # packed: vocab
        ("/v1/pdd/decode", {"prompt_ids": [1, 2]}, "first_token"),
        ("/v1/pdd/decode", {"prompt_ids": [1, 2], "first_token": 5}, "request_id"),
        ("/v1/pdd/reserve", {"request_id": "r", "prompt_ids": [1], "instance": "0"}, None),
        ("/v1/pdd/release", {"start_token": 0}, "request_id"),
        ("/v1/pdd/release", {"request_id": "r", "start_token": -16}, "start_token"),
        ("/v1/pdd/release", {"request_id": "r", "start_token": 5}, "start_token"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(agent, path, body, field):
    response = httpx.post(f"{agent.http}{path}", json=body, timeout=30)
    if field is None:  # a valid reserve: 200
        assert response.status_code == 200
        httpx.post(f"{agent.http}/v1/pdd/cancel", json={"request_id": "r"}, timeout=30)
        return
    assert response.status_code == 400, response.text
    assert field in response.json()["error"]


def test_packed_prompt_ids_give_the_same_tokens_as_a_list(agent):
    prompt = make_prompt(60, 3)
    answers = [run_single(agent, ids, 6)["output_token_ids"] for ids in (prompt, to_wire(prompt))]
    assert answers[0] == answers[1] and len(answers[0]) == 6


def test_a_release_caches_only_what_was_reserved_here(agent):
    """POST /v1/pdd/release (RLD answered alone): nothing reserved, nothing to cache; a start
    beyond the reserved prompt is a 400 naming start_token."""
    url = f"{agent.http}/v1/pdd/release"
    answer = httpx.post(url, json={"request_id": "nobody", "start_token": 0}, timeout=30)
    assert answer.status_code == 200 and answer.json() == {"request_id": "nobody", "caching": False}
    httpx.post(
        f"{agent.http}/v1/pdd/reserve",
        json={"request_id": "short", "prompt_ids": [1, 2, 3], "instance": "0"},
        timeout=30,
    ).raise_for_status()
    answer = httpx.post(url, json={"request_id": "short", "start_token": 16}, timeout=30)
    assert answer.status_code == 400 and "start_token" in answer.json()["error"]
    answer = httpx.post(url, json={"request_id": "short", "start_token": 0}, timeout=30)
    assert answer.json()["caching"] is True
    httpx.post(f"{agent.http}/v1/pdd/cancel", json={"request_id": "short"}, timeout=30)


def test_unknown_pipeline_and_wrong_role_are_400(agent):
    body = {"prompt_ids": [1, 2], "pipeline": "p-d"}
    response = httpx.post(f"{agent.http}/v1/pdd/generate", json=body, timeout=30)
    assert response.status_code == 400 and "instance" in response.json()["error"]


def test_engine_full_is_a_503_not_a_crash():
    with running(AgentProcess(agent_args("prefill", "dc-a", "--max-queued", "0"), "full")) as (a,):
        response = httpx.post(f"{a.http}/v1/generate", json={"prompt_ids": [65] * 20}, timeout=30)
        assert response.status_code == 503 and "engine full" in response.json()["error"]
        assert get(a, "/health").json()["status"] == "ok"


class FakeControlPlane:
    def __init__(self) -> None:
        self.registrations: list[dict] = []
        self.heartbeats = 0

        async def register(request: Request):
            assert request.headers["authorization"] == "AgentToken agent-secret"
            self.registrations.append(await request.json())
            return JSONResponse(
                {
                    "node_id": 1,
                    "hostname": "n2",
                    "datacenter": "dc-a",
                    "heartbeat_interval_s": 0.2,
                    "command_token": "cmd-secret",
                    "data_token": "cp-data-token-0123456789",
                    "links": {
                        "dc-b": {
                            "bandwidth_gbps": 3.0,
                            "rtt_ms": 7.0,
                            "pool_size": 2,
                            "status": "up",
                        }
                    },
                }
            )

        async def heartbeat(request: Request):
            self.heartbeats += 1
            return JSONResponse({"ok": True})

        app = Starlette(
            routes=[
                Route("/api/v1/agent/register", register, methods=["POST"]),
                Route("/api/v1/agent/heartbeat", heartbeat, methods=["POST"]),
            ]
        )
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(
            uvicorn.Config(app, log_level="warning", lifespan="off", ws="none")
        )
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]})

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)


def test_commands_need_the_command_token_once_registered(tmp_path):
    token_file = tmp_path / "agent-token"
    token_file.write_text("agent-secret\n")
    with FakeControlPlane() as cp:
        # The agent token from a file: never on the command line, where `ps` shows it.
        args = [
            "--node",
            "n2",
            "--datacenter",
            "dc-a",
            "--listen",
            "127.0.0.1:0",
            "--control-plane",
            cp.url,
            "--token-file",
            str(token_file),
            "--threads",
            "1",
        ]
        with running(AgentProcess(args, "registered")) as (a,):
            deadline = time.monotonic() + 60
            while cp.heartbeats < 1 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert cp.registrations and cp.registrations[0]["endpoint"] == a.http
            assert cp.heartbeats >= 1
            assert get(a, "/health").status_code == 200
            assert get(a, "/state").status_code == 401
            wrong = {"Authorization": "Bearer nope"}
            assert get(a, "/state", headers=wrong).status_code == 401
            ok = {"Authorization": "Bearer cmd-secret"}
            state = get(a, "/state", headers=ok).json()
            link = {k: v for k, v in state["links"]["dc-b"].items() if k != "connections"}
            assert link == {"bandwidth_gbps": 3.0, "rtt_ms": 7.0, "pool_size": 2}
            put = httpx.put(
                f"{a.http}/instances/5",
                json={"role": "prefill", "model": "baton-tiny", "source": "baton-tiny"},
                timeout=60,
            )
            assert put.status_code == 401
            put = httpx.put(
                f"{a.http}/instances/5",
                json={"role": "prefill", "model": "baton-tiny", "source": "baton-tiny"},
                headers=ok,
                timeout=60,
            )
            assert put.status_code == 200
            # The control plane handed out the fleet's data-plane token: data calls need it.
            cancel = f"{a.http}/v1/pdd/cancel"
            assert httpx.post(cancel, json={"request_id": "x"}, timeout=60).status_code == 401
            data = {"Authorization": "Bearer cp-data-token-0123456789"}
            answer = httpx.post(cancel, json={"request_id": "x"}, headers=data, timeout=60)
            assert answer.status_code == 200


def test_the_data_plane_token_is_required_and_sent_between_agents():
    # P calls RLD and MD itself (reserve, relay, decode, handoff): with a fleet-wide data-plane
    # token every agent refuses calls without it and sends it to its peers.
    token = "data-plane-secret-0123"
    with pdd_agents(FAST_LINK, "--data-token", token, single=False, tag="-token") as agents:
        md, p, rld = agents["md"], agents["p"], agents["rld"]
        prompt = make_prompt(60, 5)
        # Long enough that MD is ready before RLD would finish alone (6 tokens took ~20 ms,
        # sometimes less than MD's import: the handoff, and MD's calls, did not happen).
        body = pdd_body("tok-1", prompt, 64, "p-rld-md", "one-shot", p, rld, md, handoff_at=2)
        url = f"{p.http}/v1/pdd/generate"
        for headers in ({}, {"Authorization": "Bearer wrong-token-0123456789"}):
            refused = httpx.post(url, json=body, headers=headers, timeout=60)
            assert refused.status_code == 401
            assert "data-plane token" in refused.json()["error"]
        cancel = httpx.post(f"{md.http}/v1/pdd/cancel", json={"request_id": "x"}, timeout=60)
        assert cancel.status_code == 401
        events, _, _ = stream_events(url, body, headers={"Authorization": f"Bearer {token}"})
        result = summarize(events)
        assert result["error"] is None, result["error"]
        assert len(result["output_token_ids"]) == 64
        assert result["stats"]["tokens_by_role"]["md"] > 0, result["stats"]  # RLD handed off
        assert get(p, "/health").status_code == 200  # health stays open


def test_an_agent_with_a_control_plane_takes_no_data_calls_before_registering():
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        nowhere = f"http://127.0.0.1:{closed.getsockname()[1]}"  # bound, never listening
    args = ["--node", "n3", "--datacenter", "dc-a", "--listen", "127.0.0.1:0",
            "--control-plane", nowhere, "--token", "agent-secret", "--threads", "1"]  # fmt: skip
    with running(AgentProcess(args, "unregistered")) as (a,):
        assert get(a, "/health").status_code == 200
        answer = httpx.post(f"{a.http}/v1/pdd/cancel", json={"request_id": "x"}, timeout=60)
        assert answer.status_code == 503
        assert "not registered" in answer.json()["error"]


def test_sigterm_drains_the_in_flight_request_then_exits_0():
    with running(AgentProcess(agent_args("main_decode", "dc-a"), "drain")) as (a,):
        events: list[dict] = []
        first = threading.Event()

        def consume() -> None:
            body = {
                "prompt_ids": make_prompt(40, 3),
                "sampling": {"max_tokens": 300, "ignore_eos": True},
            }
            with (
                httpx.Client(timeout=httpx.Timeout(30, read=120)) as http,
                http.stream("POST", f"{a.http}/v1/generate", json=body) as response,
            ):
                for line in response.iter_lines():
                    if line.strip():
                        events.append(json.loads(line))
                        first.set()

        thread = threading.Thread(target=consume)
        thread.start()
        assert first.wait(60)
        import os
        import signal

        os.killpg(a.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        refused = None
        while refused is None and time.monotonic() < deadline:
            try:
                r = httpx.post(f"{a.http}/v1/generate", json={"prompt_ids": [65, 66]}, timeout=30)
            except httpx.HTTPError:
                break
            if r.status_code == 503:
                refused = r
        thread.join(120)
        assert a.proc.wait(60) == 0
        tokens = [e for e in events if e["type"] == "token"]
        assert len(tokens) == 300 and events[-1]["type"] == "done"
        if refused is not None:
            assert "draining" in refused.json()["error"]
