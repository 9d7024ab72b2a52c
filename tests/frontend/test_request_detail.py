"""The request log's full ids, the token split P + RLD + MD, and the request detail page."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Group, User


@pytest.fixture
def viewer(db):
    user = User.objects.create_user("vic", password="pw-viewer-2")
    user.groups.add(Group.objects.get_or_create(name="viewer")[0])
    return user


@pytest.fixture
def relayed(fleet):
    """A P-RLD-MD request that migrated once, with its decision and the policy's inputs."""
    from billing.models import Tenant
    from routing.models import RequestRecord, RoutingDecision

    tenant = Tenant.objects.create(name="acme", display_name="Acme")
    record = RequestRecord.objects.create(
        request_id="chatcmpl-32fc5add0123456789abcdef01234567",
        tenant=tenant,
        model="baton-tiny",
        endpoint="chat.completions",
        stream=True,
        status="ok",
        pipeline="p-rld-md",
        handoff_mode="catch-up",
        handoff_at_token=31,
        handoff_batches=3,
        handoff_bytes=480,
        migrations=1,
        prompt_tokens=4000,
        cached_tokens=1000,
        completion_tokens=128,
        tokens_by_rld=30,
        tokens_by_md=97,
        ttft_s=0.9,
        prefill_s=0.6,
        kv_wait_s=0.3,
        max_gap_s=0.25,
        tpot_s=0.03,
        e2e_s=4.9,
        kv_bytes_intra_dc=8_000_000,
        kv_bytes_wan=6_000_000,
        prefill_instance=str(fleet["prefill"].pk),
        relay_instance=str(fleet["relay"].pk),
        main_instance=str(fleet["main"].pk),
    )
    RoutingDecision.objects.create(
        request=record,
        policy_version=3,
        pipeline="p-rld-md",
        handoff_mode="catch-up",
        cached_tokens=1000,
        delta_tokens=3000,
        est_wan_s=1.2,
        reason="hit 25% below threshold: relay decodes while 3000 tokens of KV cross " * 4,
        inputs={
            "prompt_tokens": 4000,
            "max_tokens": 128,
            "instances": {
                str(fleet["main"].pk): {"role": "main_decode", "healthy": True, "load": 0.25,
                                        "dc": "dc-b"},
            },
            "wan_links": {"dc-b": {"gbps": 0.06, "rtt_ms": 30, "use": 0.1, "status": "up"}},
            "retried": [
                {"pipeline": "p-rld-md", "instances": ["9"], "error": "MD stream broke",
                 "migrated_at_token": 40},
            ],
        },
    )  # fmt: skip
    return record


def test_the_log_shows_full_ids_linking_to_the_detail_page(client, viewer, relayed):
    client.force_login(viewer)
    html = client.get("/requests/").content.decode()
    rid = relayed.request_id
    assert f'href="/requests/{rid}/"' in html
    assert f">{rid}</a>" in html  # not cut
    assert f'href="/billing/usage/{rid}/"' in html
    # P's first token is counted: 1 + 30 + 97 = 128
    assert "out by P + RLD + MD" in html
    assert ">1 + 30 + 97</td>" in html
    # the reason is clipped in the row, whole in its title
    assert 'class="clip" title="hit 25% below threshold' in html


def test_the_detail_page_draws_the_timeline_and_the_decision(client, viewer, relayed):
    client.force_login(viewer)
    page = client.get(f"/requests/{relayed.request_id}/")
    assert page.status_code == 200
    html = page.content.decode()
    lanes = [lane["label"] for lane in page.context["timeline"]["lanes"]]
    assert lanes == [
        "P prefill",
        "KV intra-DC",
        "KV WAN",
        "RLD decode",
        "handoff",
        "MD decode",
        "to the user",
        "retries",
    ]
    assert 'class="bar prefill"' in html and 'class="bar handoff"' in html
    assert "migrated at token 40" in html and "MD stream broke" in html
    assert "P 1 + RLD 30 + MD 97" in html
    assert "hit 25% below threshold" in html
    assert "0.06 Gbit/s" in html  # the inputs, with the precision they have
    assert f'href="/fleet/instances/{relayed.main_instance}/"' in html
    assert "not billed" in html  # no usage entry for it
    # bars stay inside the plot and in order
    bars = {lane["label"]: lane["bars"] for lane in page.context["timeline"]["lanes"]}
    right = page.context["timeline"]["plot_right"]
    assert bars["P prefill"][0]["x"] < bars["RLD decode"][0]["x"] < bars["MD decode"][0]["x"]
    assert bars["MD decode"][0]["x"] + bars["MD decode"][0]["w"] <= right + 0.5


def test_the_detail_page_links_to_the_usage_entry(client, viewer, fleet):
    from billing.models import UsageEntry
    from frontend.synthetic import synthetic_records_create

    record = synthetic_records_create(count=1, seed=7)[0]
    client.force_login(viewer)
    html = client.get(f"/requests/{record.request_id}/").content.decode()
    if UsageEntry.objects.filter(request_id=record.request_id).exists():
        assert f'href="/billing/usage/{record.request_id}/"' in html
    assert 'id="timeline"' in html


def test_a_request_without_timing_or_decision_renders(client, viewer, fleet):
    from billing.models import Tenant
    from routing.models import RequestRecord

    tenant = Tenant.objects.create(name="t2", display_name="T2")
    RequestRecord.objects.create(
        request_id="r-rejected", tenant=tenant, model="m", endpoint="completions",
        status="rejected", error="no healthy path",
    )  # fmt: skip
    client.force_login(viewer)
    html = client.get("/requests/r-rejected/").content.decode()
    assert "No timing" in html and "No routing decision" in html


def test_the_detail_page_is_for_logged_in_users_only(client, relayed):
    response = client.get(f"/requests/{relayed.request_id}/")
    assert response.status_code == 302 and response["Location"].startswith("/login/?next=")


def test_an_unknown_request_is_404(client, viewer, db):
    client.force_login(viewer)
    assert client.get("/requests/nope/").status_code == 404


def test_link_bandwidth_keeps_its_precision(client, viewer, fleet):
    link = fleet["link"]
    link.bandwidth_gbps = 0.06
    link.save()
    client.force_login(viewer)
    assert "0.06 Gbit/s" in client.get("/fleet/").content.decode()
    assert "0.06 Gbit/s" in client.get(f"/fleet/links/{link.pk}/").content.decode()


def test_an_emulated_models_requests_are_labelled_emulated(client, viewer, relayed):
    from fleet.models import ServedModel
    from routing.models import RequestRecord

    ServedModel.objects.create(
        name="paper-dsv4", source="profile:paper-dsv4", num_layers=61, kv_bytes_per_token=4400
    )
    RequestRecord.objects.filter(pk=relayed.pk).update(model="paper-dsv4")
    client.force_login(viewer)
    listing = client.get("/requests/").content.decode()
    assert 'class="badge emulated"' in listing
    detail = client.get(f"/requests/{relayed.request_id}/").content.decode()
    assert "paper-dsv4" in detail and 'class="badge emulated"' in detail


def test_a_real_models_requests_are_not_labelled_emulated(client, viewer, relayed):
    client.force_login(viewer)
    assert 'class="badge emulated"' not in client.get("/requests/").content.decode()
