"""One hop per token at the gateway: P's stream ends with ``continue`` and the gateway reads the
decoder's stream itself; only the decoder the request was routed to is followed, a failure of
its stream points at it, and a later process would ask it (not P) what was delivered."""

from __future__ import annotations

import asyncio

import pytest

from fleet import live as fleet_live
from fleet.choices import InstanceRole
from routing.gateway import records
from routing.gateway import run as gw_run
from routing.gateway.runner import AgentRunError
from routing.models import RequestRecord
from tests.routing.gateway.conftest import post_stream
from tests.routing.gateway.test_route_around_the_dead import _one_dc_fleet, _tenant_client


@pytest.fixture
def fleet(transactional_db, settings, monkeypatch):
    """P, MD1 and MD2 in one datacenter; `script` says what the fake agents stream."""
    settings.REDIS_URL = ""
    made = _one_dc_fleet(
        ("p", InstanceRole.PREFILL),
        ("md1", InstanceRole.MAIN_DECODE),
        ("md2", InstanceRole.MAIN_DECODE),
    )
    calls: list[tuple[str, str]] = []  # (url, source)
    attempts: list[dict] = []
    script: dict = {"to": "routed", "md_fails": 0}

    async def events(url, body, source="prefill"):
        calls.append((url, source))
        if source == "prefill":
            assert body["direct"] is True  # the gateway asks for one hop per token
            main = body["main"]
            target = main["http"] if script["to"] == "routed" else script["to"]
            follow = {
                "request_id": body["request_id"],
                "instance": main["instance"],
                "first_event": {"type": "token", "index": 0, "token_id": ord("o"),
                                "role": "prefill"},
            }  # fmt: skip
            stats = {"prefill_s": 0.25, "kv_bytes": {"intra_dc": 0, "wan": 4096},
                     "cached_tokens": 4, "kv_format_wan": "int8"}  # fmt: skip
            yield [{"type": "continue", "url": f"{target}/v1/pdd/decode", "body": follow,
                    "instance": main["instance"], "role": "md", "stats": stats}]  # fmt: skip
            return
        assert body["prompt_ids"]  # P leaves the prompt out; the gateway puts it back
        if script.get("md_continues"):  # only RLD may hand its stream over (to MD)
            yield [{"type": "token", "index": 0, "token_id": ord("o"), "role": "prefill"}]
            yield [
                {
                    "type": "continue",
                    "url": f"{url.split('/v1/pdd/')[0]}/v1/pdd/attach",
                    "body": {
                        "request_id": body["request_id"],
                        "instance": body["instance"],
                        "from_index": 1,
                    },
                    "instance": body["instance"],
                    "role": "md",
                }
            ]
            return  # fmt: skip
        if script["md_fails"]:
            script["md_fails"] -= 1
            raise AgentRunError("MD agent unreachable: connection refused", at_prefill=False)
        if script.get("md_silent"):  # frozen before its first token
            script["md_silent"] -= 1
            await asyncio.sleep(30)
        for i in range(script.get("md_keep_alives", 0)):  # its KV still crossing the WAN
            yield [{"type": "queued", "waited_s": i * 0.1, "waiting_for": "kv"}]
            await asyncio.sleep(0.1)
        yield [{"type": "token", "index": 0, "token_id": ord("o"), "role": "prefill"}]
        yield [
            {"type": "token", "index": 1, "token_id": ord("k"), "role": "md"},
            {"type": "token", "index": 2, "token_id": ord("!"), "role": "md"},
        ]
        yield [{"type": "done", "finish_reason": "length", "stats": {"handoff": {"mode": "none"}}}]

    def noted(**kwargs):
        attempts.append(kwargs)

    monkeypatch.setattr(gw_run, "run_events", events)
    monkeypatch.setattr(records, "admission_attempt", noted)
    script["cancelled"] = []
    monkeypatch.setattr(gw_run, "cancel_on_path", lambda plan: script["cancelled"].append(plan))
    yield _tenant_client(), made, calls, attempts, script
    fleet_live._memory.clear()


BODY = {"model": "baton-tiny", "prompt": "hello", "max_tokens": 3}


@pytest.mark.parametrize("stream", [False, True])
def test_the_gateway_reads_the_decoders_stream_itself(fleet, stream):
    client, made, calls, attempts, script = fleet
    if stream:
        status, raw = post_stream(client, "/v1/completions", BODY | {"stream": True})
        assert status == 200
        assert '"text": "o' in raw.decode() or '"text":"o' in raw.decode()
    else:
        response = client.post("/v1/completions", BODY, format="json")
        assert response.status_code == 200, response.content
        assert response.json()["choices"][0]["text"] == "ok!"
    assert [source for _, source in calls] == ["prefill", "md"]
    md_url = calls[1][0]
    assert md_url.startswith((made["md1"][0].agent_endpoint, made["md2"][0].agent_endpoint))
    # Where the stream now comes from, for a process that finishes the admission.
    assert attempts and attempts[-1]["prefill_url"] == md_url.split("/v1/pdd/")[0]
    assert attempts[-1]["token_offset"] == 0
    record = RequestRecord.objects.get()
    assert record.status == "ok" and record.completion_tokens == 3
    assert script["cancelled"] == []  # the stream ended with its done: nothing to cancel
    assert record.tokens_by_md == 2  # counted from the decoder's token events
    assert record.kv_bytes_wan == 4096  # P's figures, from its `continue`
    assert record.kv_format_wan == "int8"  # the format the link asked P to send
    assert record.cached_tokens == 4


def test_a_continuation_to_a_decoder_off_the_path_is_refused(fleet):
    client, _, calls, _, script = fleet
    script["to"] = "http://169.254.169.254:80"
    response = client.post("/v1/completions", BODY, format="json")
    assert response.status_code == 502
    assert not any(url.startswith("http://169.254.169.254") for url, _ in calls)
    record = RequestRecord.objects.get()
    retried = record.decision.inputs["retried"]
    assert "continuation was refused" in retried[0]["error"]


def test_a_failure_of_the_decoders_stream_points_at_the_decoder(fleet):
    client, made, calls, _, script = fleet
    script["md_fails"] = 1
    response = client.post("/v1/completions", BODY, format="json")
    assert response.status_code == 200, response.content
    record = RequestRecord.objects.get()
    first = record.decision.inputs["retried"][0]
    md_ids = {str(made["md1"][1].pk), str(made["md2"][1].pk)}
    assert set(first["instances"]) <= md_ids and first["instances"]  # MD, not P
    assert [s for _, s in calls] == ["prefill", "md", "prefill", "md"]
    # The failed attempt's decoders were told to let it go (MD's reservation), once.
    assert [plan["request_id"] for plan in script["cancelled"]] == [record.request_id]


def test_a_continue_from_mds_own_stream_is_refused(fleet):
    """A second `continue` is followed only from RLD's stream to MD's (after the handoff)."""
    client, _, calls, _, script = fleet
    script["md_continues"] = True
    response = client.post("/v1/completions", BODY, format="json")
    assert response.status_code == 502, response.content
    assert not any(url.endswith("/v1/pdd/attach") for url, _ in calls)
    record = RequestRecord.objects.get()
    errors = [r["error"] for r in record.decision.inputs["retried"]]
    assert any("a MD stream sent 'continue' to MD" in e for e in errors), errors


def test_a_decoder_silent_before_its_first_token_is_blamed_not_p(fleet, monkeypatch):
    """After P's `continue`, the first-token timeout is the decoder's: a frozen MD is the
    instance blamed (P did its part), and the request runs on the other MD."""
    from routing.gateway import routes

    client, made, calls, _, script = fleet
    monkeypatch.setattr(gw_run, "FIRST_TOKEN_TIMEOUT_S", 0.3)
    script["md_silent"] = 1
    response = client.post("/v1/completions", BODY, format="json")
    assert response.status_code == 200, response.content
    assert response.json()["choices"][0]["text"] == "ok!"
    record = RequestRecord.objects.get()
    (retried,) = record.decision.inputs["retried"]
    first_md = calls[1][0].split("/v1/pdd/")[0]
    blamed = next(i for name, (node, i) in made.items() if node.agent_endpoint == first_md)
    assert retried["instances"] == [str(blamed.pk)]
    assert "no first token from the MD agent" in retried["error"]
    assert str(made["p"][1].pk) not in routes.suspects.marks()


def test_a_decoder_s_keep_alives_while_its_kv_comes_are_waited_for(fleet, monkeypatch):
    """MD waiting for the request's KV on a busy WAN says so (`queued`, waiting for kv): the
    gateway waits past its first-token timeout, blames nobody, and does not count it as a
    prefill queue."""
    from routing.gateway import routes
    from routing.gateway.overload import overload

    client, _, calls, _, script = fleet
    monkeypatch.setattr(gw_run, "FIRST_TOKEN_TIMEOUT_S", 0.3)
    script["md_keep_alives"] = 8
    before = overload.stats.at_prefill
    response = client.post("/v1/completions", BODY, format="json")
    assert response.status_code == 200, response.content
    assert response.json()["choices"][0]["text"] == "ok!"
    assert [source for _, source in calls] == ["prefill", "md"]  # no retry
    assert routes.suspects.marks() == {}
    assert "retried" not in RequestRecord.objects.get().decision.inputs
    assert overload.stats.at_prefill == before
