"""Through the gateway's endpoint: a session's next turn, sent the moment the previous answer
ended, is routed as the hit MD will serve it as, though no heartbeat came between the two.

The fleet is fake: instances in the database, their agents' heartbeats published to the live
state, and the prefill agent a mock that answers as MD's ``reserve`` would (counting the KV in
flight to it, so the record's ``cached_tokens`` is what MD actually held)."""

from __future__ import annotations

import json

import httpx
import pytest
from rest_framework.test import APIClient

from billing import services as billing
from billing.models import Tenant
from fleet import kv_index
from fleet import live as fleet_live
from fleet.choices import InstanceRole, NodeStatus
from fleet.models import Datacenter, GPUType, Instance, Node, ServedModel, WANLink
from pdd.prefix import prefix_block_hashes
from pdd.token_ids import from_wire
from routing import analysis
from routing.gateway import routes, runner
from routing.models import RequestRecord

BLOCK = 16
TURN_1 = "You are a careful agent. " * 32  # 800 bytes: 50 blocks of the byte tokenizer
TURN_2 = TURN_1 + "Tool said ok; continue." + " " * 17  # 840 bytes: the next turn


@pytest.fixture(autouse=True)
def fresh_dispatched_blocks():
    routes.dispatched_blocks.clear()
    yield
    routes.dispatched_blocks.clear()


@pytest.fixture
def fake_fleet(transactional_db, settings, monkeypatch):
    """P and RLD in dc-a, MD in dc-b over a 20 Mbit/s WAN: 800 tokens of KV (3.5 MB at the
    policy's 4,400 B/token) take 1.4 s, over the 1 s threshold, so a miss is relayed; a 40
    token delta takes 0.07 s and goes straight to MD."""
    settings.REDIS_URL = ""  # the live state in this process
    tenant = Tenant.objects.create(name="acme", requests_per_minute=100, tokens_per_minute=10**6)
    _, raw = billing.api_key_create(tenant=tenant)
    model = ServedModel.objects.create(
        name="baton-tiny",
        source="baton-tiny",
        num_layers=4,
        kv_bytes_per_token=4096,
        max_context_tokens=4096,
        kv_block_size=BLOCK,
    )
    a = Datacenter.objects.create(name="dc-a", region="city-a")
    b = Datacenter.objects.create(name="dc-b", region="city-b")
    WANLink.objects.create(from_datacenter=a, to_datacenter=b, bandwidth_gbps=0.02, rtt_ms=20)
    gpu = GPUType.objects.create(
        vendor="g",
        model="gpu",
        peak_bf16_tflops=989,
        memory_gib=80,
        memory_bandwidth_gbps=3350,
        interconnect_gbps=400,
    )
    instances, items = {}, {}
    for role, dc in (
        (InstanceRole.PREFILL, a),
        (InstanceRole.RELAY_DECODE, a),
        (InstanceRole.MAIN_DECODE, b),
    ):
        node = Node.objects.create(
            hostname=f"{dc.name}-{role}",
            datacenter=dc,
            gpu_type=gpu,
            gpu_count=8,
            agent_endpoint=f"http://{role}.agent",
            agent_token_prefix=f"t-{role}",  # at most 16 characters
            status=NodeStatus.ONLINE,
        )
        inst = Instance.objects.create(role=role, node=node, served_model=model, gpu_count=8)
        instances[role] = inst
        item = {
            "instance_id": str(inst.pk),
            "role": role,
            "state": "running",
            "load": {"running": 0, "queued": 0, "max_running": 32},
            "kv_endpoint": {"host": "127.0.0.1", "port": 9000 + inst.pk, "wan_port": 9500},
        }
        # MD's cache is cold: the session is new (the prefix index holds nothing for it).
        _publish(node, item)
        items[role] = item
    sent: list[dict] = []  # the bodies P received
    held: list[list[int]] = []  # prompts whose KV MD has (or has coming): reserve's view

    def prefill_agent(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        sent.append(body)
        prompt = from_wire(body["prompt_ids"])
        cached = 0
        for earlier in held:
            common = 0
            for x, y in zip(prompt, earlier, strict=False):
                if x != y:
                    break
                common += 1
            cached = max(cached, common - common % BLOCK)
        held.append(prompt)
        decoder = "rld" if body["pipeline"] == "p-rld-md" else "md"
        lines = [
            {"type": "token", "index": 0, "token_id": 79, "role": "prefill"},
            {"type": "token", "index": 1, "token_id": 75, "role": decoder},
            {
                "type": "done",
                "finish_reason": "length",
                "stats": {"cached_tokens": cached, "tokens_by_role": {decoder: 2}},
            },
        ]
        return httpx.Response(200, content="".join(json.dumps(x) + "\n" for x in lines).encode())

    monkeypatch.setattr(
        runner, "_client", httpx.AsyncClient(transport=httpx.MockTransport(prefill_agent))
    )
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    main = instances[InstanceRole.MAIN_DECODE]

    def report_md(**fields) -> None:
        """MD's agent heartbeats again, its item carrying ``fields``."""
        _publish(main.node, items[InstanceRole.MAIN_DECODE] | fields)
        routes.live_views.clear()

    yield {"client": client, "sent": sent, "main": main, "report_md": report_md}
    for inst in instances.values():
        fleet_live.forget(inst.node_id)


def _publish(node: Node, item: dict) -> None:
    fleet_live.publish_report(
        node_id=node.pk,
        hostname=node.hostname,
        datacenter=node.datacenter.name,
        endpoint=node.agent_endpoint,
        report={"instances": [item]},
    )


def _send(client: APIClient, prompt: str) -> RequestRecord:
    response = client.post(
        "/v1/completions", {"model": "baton-tiny", "prompt": prompt, "max_tokens": 2}, format="json"
    )
    assert response.status_code == 200, response.content
    return RequestRecord.objects.select_related("decision").get(request_id=response.json()["id"])


def test_the_next_turn_sent_back_to_back_is_a_hit_on_md(fake_fleet):
    client, main = fake_fleet["client"], fake_fleet["main"]
    first = _send(client, TURN_1)
    assert first.pipeline == "p-rld-md"  # a cold MD: the whole context crosses, so relay
    assert first.main_instance == str(main.pk)
    assert first.decision.cached_tokens == 0 and first.cached_tokens == 0

    # No heartbeat since: MD's report still shows a cold cache. The gateway counts what it sent.
    second = _send(client, TURN_2)
    assert second.pipeline == "p-md", second.decision.reason
    assert second.main_instance == str(main.pk)
    assert second.decision.reason.startswith("high hit 95.2%")
    # Estimated and actual side by side: the decision expected what MD then reserved.
    assert second.decision.cached_tokens == 800
    assert second.cached_tokens == 800
    assert second.decision.inputs["dispatched_blocks"] == {str(main.pk): 50}
    assert [b["pipeline"] for b in fake_fleet["sent"]] == ["p-rld-md", "p-md"]
    assert analysis.relayed_despite_cache() == (0, 1)


def test_without_the_dispatched_blocks_the_next_turn_looks_like_a_miss(fake_fleet):
    """The demo's finding, reproduced: on MD's last heartbeat alone the second turn is relayed
    although MD held 95% of its prompt by the time its KV was reserved."""
    client = fake_fleet["client"]
    _send(client, TURN_1)
    routes.dispatched_blocks.clear()  # as the gateway was: heartbeats only
    second = _send(client, TURN_2)
    assert second.pipeline == "p-rld-md"
    assert second.decision.reason.startswith("low hit 0.0%")
    assert (second.decision.cached_tokens, second.cached_tokens) == (0, 800)
    assert "dispatched_blocks" not in second.decision.inputs
    assert analysis.relayed_despite_cache() == (1, 2)


def test_an_rld_only_request_records_no_blocks_for_md(fake_fleet, settings):
    from routing import services

    services.policy_update(
        changes={"singular_min_prompt_tokens": 100, "singular_max_output_tokens": 4}
    )
    routes.policies.clear()
    record = _send(fake_fleet["client"], TURN_1)
    assert record.pipeline == "rld-only"
    hashes = prefix_block_hashes(list(TURN_1.encode()), BLOCK)
    assert routes.dispatched_blocks.held(str(fake_fleet["main"].pk), hashes, after=0.0) == 0


def test_md_s_heartbeat_reporting_the_kv_in_flight_keeps_the_hit(fake_fleet):
    """Once MD's next report is in, the gateway's own ledger gives way to it: the report lists
    the first turn's blocks as incoming (reserved, still crossing the WAN), and the live view
    counts them as held."""
    client, main = fake_fleet["client"], fake_fleet["main"]
    _send(client, TURN_1)
    routes.dispatched_blocks.clear()  # only the report can make the next turn a hit now
    incoming = list(prefix_block_hashes(list(TURN_1.encode()), BLOCK))
    fake_fleet["report_md"](incoming_prefix_blocks=incoming)
    view = routes.live_views.get("baton-tiny")
    (md,) = view.snapshot.main_decode
    assert md.id == str(main.pk) and set(md.cached_prefix_blocks) == set(incoming)
    second = _send(client, TURN_2)
    assert second.pipeline == "p-md"
    assert (second.decision.cached_tokens, second.cached_tokens) == (800, 800)
    assert "dispatched_blocks" not in second.decision.inputs
    # Its radix cache (the prefix index, from its KV cache events) and the KV in flight both
    # count (a union).
    held = {int(h, 16) for h in incoming[:10]}
    kv_index.prefix_index().local.replace(str(main.pk), "epoch", 1, held)
    fake_fleet["report_md"](incoming_prefix_blocks=incoming[5:])
    (md,) = routes.live_views.get("baton-tiny").snapshot.main_decode
    assert set(md.cached_prefix_blocks) == set(incoming)


def test_the_ledger_records_only_the_blocks_past_what_md_reports(fake_fleet):
    """A request whose MD reports most of its prefix sends only the rest to the ledger: a later
    request asks the ledger from the end of MD's reported run, never for the leading blocks."""
    client, main = fake_fleet["client"], fake_fleet["main"]
    hashes = list(prefix_block_hashes(list(TURN_2.encode()), BLOCK))  # 52 blocks
    fake_fleet["report_md"](incoming_prefix_blocks=hashes[:50])
    record = _send(client, TURN_2)
    assert record.pipeline == "p-md"
    md = str(main.pk)
    ledger = routes.dispatched_blocks
    assert ledger.held(md, hashes[50:], after=0.0) == 2  # the new blocks are in it
    assert ledger.held(md, hashes, after=0.0) == 0  # the reported ones are not


def test_an_md_whose_cache_hashes_blocks_of_another_size_is_matched_in_its_size(fake_fleet):
    """An MD of another kind (its engine's block size 32, the served model's 16) reports its
    block size; the gateway hashes the prompt in MD's size too and matches MD's cache and the
    KV in flight to it in that size (issue 42: a decoder of another kind)."""
    client = fake_fleet["client"]
    md_hashes = list(prefix_block_hashes(list(TURN_1.encode()), 32))  # 25 blocks of 32
    fake_fleet["report_md"](kv={"block_size": 32}, incoming_prefix_blocks=md_hashes)
    (md,) = routes.live_views.get("baton-tiny").snapshot.main_decode
    assert md.block_tokens == 32
    second = _send(client, TURN_2)
    assert second.pipeline == "p-md", second.decision.reason
    assert second.decision.cached_tokens == 800  # 25 blocks of 32 (the model's 16: 50)
    # The hashes of the model's size would have matched nothing there.
    fake_fleet["report_md"](
        kv={"block_size": 32},
        incoming_prefix_blocks=list(prefix_block_hashes(list(TURN_1.encode()), BLOCK)),
    )
    routes.dispatched_blocks.clear()
    third = _send(client, TURN_2 + " and on.")
    assert third.decision.cached_tokens == 0


def test_the_ledger_keeps_an_md_s_blocks_in_its_own_size(fake_fleet):
    """Back to back, no report between: the dispatched blocks recorded for an MD of block
    size 32 are hashes of 32 tokens, and the next turn is a hit in that size."""
    client, main = fake_fleet["client"], fake_fleet["main"]
    fake_fleet["report_md"](kv={"block_size": 32})
    first = _send(client, TURN_1)
    assert first.main_instance == str(main.pk)
    md_hashes = prefix_block_hashes(list(TURN_1.encode()), 32)
    assert routes.dispatched_blocks.held(str(main.pk), md_hashes, after=0.0) == 25
    second = _send(client, TURN_2)
    assert second.pipeline == "p-md", second.decision.reason
    assert second.decision.cached_tokens == 800
    assert second.decision.inputs["dispatched_blocks"] == {str(main.pk): 25}
