"""The autopilot (plans/profile.py, plans/autopilot.py): the live profile from the records, a
proposal sized by the planner over the database's fleet, approval and its refusal when stale,
the automatic mode's guardrails, an idempotent, resumable apply, and the realised figures."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from billing.models import Tenant
from fleet import services
from fleet.choices import ActualState, DesiredState, InstanceRole, NodeStatus
from fleet.models import FleetEvent, Instance, Node
from plans import autopilot
from plans.models import AutopilotSettings, Proposal, ProposalStatus, ProposalStep
from plans.profile import holt_forecast, workload_overrides, workload_profile
from routing.models import RequestRecord
from tests.plans.test_planning import _price

API = "/api/v1/autopilot/"


@pytest.fixture
def fleet(dc_a, dc_b, gpu_a, gpu_b, link_ab, tiny_model):
    """Four 8-GPU gpu-a nodes in dc-a, four 4-GPU gpu-b nodes in dc-b, all online, priced;
    one prefill on a-1 and one main decode on b-1."""
    _price(gpu_a, dc_a, "2.00")
    _price(gpu_b, dc_b, "2.50")
    nodes = {}
    for i in range(1, 5):
        nodes[f"a-{i}"], _ = services.node_create(
            hostname=f"a-{i}", datacenter=dc_a, gpu_type=gpu_a, gpu_count=8
        )
        nodes[f"b-{i}"], _ = services.node_create(
            hostname=f"b-{i}", datacenter=dc_b, gpu_type=gpu_b, gpu_count=4
        )
    Node.objects.update(status=NodeStatus.ONLINE)
    p = services.instance_create(
        role=InstanceRole.PREFILL, node=nodes["a-1"], served_model=tiny_model, gpu_count=8
    )
    md = services.instance_create(
        role=InstanceRole.MAIN_DECODE, node=nodes["b-1"], served_model=tiny_model, gpu_count=4
    )
    Instance.objects.update(actual_state=ActualState.RUNNING)
    return {"nodes": nodes, "p": p, "md": md, "model": tiny_model}


def _record(at, *, prompt=16_000, cached=14_000, out=200, pipeline="p-md", wan=0, wait=None,
            ttft=0.5, status="ok"):  # fmt: skip
    tenant, _ = Tenant.objects.get_or_create(name="acme")
    record = RequestRecord.objects.create(
        request_id=f"r-{RequestRecord.objects.count()}",
        tenant=tenant,
        model="baton-tiny",
        endpoint="chat.completions",
        status=status,
        pipeline=pipeline,
        prompt_tokens=prompt,
        cached_tokens=cached,
        completion_tokens=out,
        kv_bytes_wan=wan,
        kv_wait_s=wait,
        ttft_s=ttft,
    )
    RequestRecord.objects.filter(pk=record.pk).update(created_at=at)
    return record


def _proposal(fleet_rows, changes, **kw) -> Proposal:
    """A proposed proposal with these changes, as proposal_execute would leave it."""
    return Proposal.objects.create(
        status=ProposalStatus.PROPOSED,
        scenario="tiny-size",
        model=fleet_rows["model"].name,
        fingerprint=autopilot.fleet_fingerprint(),
        changes=changes,
        target={"cost_per_hour": 26.0, "nodes": {}, "pools": {}},
        **kw,
    )


def _start(node, role="prefill"):
    return {"action": "start", "role": role, "node": node.pk, "hostname": node.hostname}


def _drain(inst):
    return {"action": "drain", "role": inst.role, "node": inst.node_id, "instance": inst.pk}


# --- the live profile ----------------------------------------------------------------------------


def test_the_profile_reads_rates_hits_lengths_singular_share_and_the_wan(db):
    now = timezone.now()
    for i in range(30):  # 30 in the last minute, 30 more in the 4 minutes before
        _record(now - timedelta(seconds=1 + i), cached=16_000 if i % 3 else 4_000)
        _record(now - timedelta(seconds=90 + 6 * i), pipeline="rld-only" if i < 6 else "p-md")
    _record(now - timedelta(seconds=5), wan=10**9, wait=2.0)  # 8 Gbit over 2 s: 4 Gbit/s
    _record(now - timedelta(seconds=20), status="failed", prompt=0)  # demand, not served
    _record(now - timedelta(hours=2))  # outside the window
    profile = workload_profile(900, now=now)
    assert profile["requests"] == 62 and profile["served"] == 61
    assert profile["rate_rps"]["1m"] == pytest.approx(32 / 60)
    assert profile["rate_rps"]["5m"] == pytest.approx(62 / 300)
    assert profile["singular_share"] == pytest.approx(6 / 62)
    hit = profile["hit_rate"]
    assert hit["high_share"] == pytest.approx(20 / 61)  # 16,000 of 16,000 cached
    assert hit["mean"] == pytest.approx((20 + 10 * 0.25 + 31 * 0.875) / 61)
    assert hit["p50"] == pytest.approx(14_000 / 16_000)
    assert profile["prompt_tokens"]["p50"] == 16_000 and profile["output_tokens"]["p50"] == 200
    assert profile["wan_gbps"] == {"requests": 1, "p50": 4.0, "p90": 4.0}
    assert profile["sizing_rps"] >= profile["rate_rps"]["1m"]


def test_the_forecast_follows_a_ramp_and_never_goes_below_zero():
    assert holt_forecast([10, 20, 30, 40, 50]) > 50  # still rising
    assert holt_forecast([50, 40, 30, 20, 10, 0, 0]) == 0.0
    assert holt_forecast([]) == 0.0
    assert holt_forecast([12.0] * 10) == pytest.approx(12.0)


def test_the_profile_becomes_a_valid_planner_workload(db):
    from planner.workload import WorkloadSpec

    now = timezone.now()
    for i in range(40):
        _record(now - timedelta(seconds=i), prompt=8_000 + 100 * i,
                cached=8_000 if i % 4 else 1_000, out=100 + 10 * i)  # fmt: skip
    overrides = workload_overrides(workload_profile(900, now=now))
    assert overrides["context"] is None
    assert overrides["hit_rate"]["kind"] == "skewed"
    spec = WorkloadSpec(**{"rps": 1.0, **overrides})  # the planner accepts it
    assert 9_000 < spec.input_tokens.median < 11_000
    assert workload_overrides(workload_profile(900, now=now - timedelta(days=1))) == {}


# --- proposals -----------------------------------------------------------------------------------


def test_a_proposal_is_sized_from_the_live_traffic_and_the_database_fleet(fleet):
    now = timezone.now()
    for i in range(480):  # 8 requests/s of tiny-size's kind for the last minute: more than
        # one P and one MD serve within the SLA (their goodput is ~4.7 requests/s)
        _record(now - timedelta(seconds=i / 8), prompt=16_000, cached=15_000, out=300)
    proposal = autopilot.proposal_create(trigger="manual", actor="op")
    assert proposal.status == ProposalStatus.SIZING and len(proposal.fingerprint) == 64
    proposal = autopilot.proposal_execute(proposal_id=proposal.pk)
    assert proposal.status == ProposalStatus.PROPOSED, proposal.error
    assert proposal.current["nodes"] == {"prefill": 1, "relay_decode": 0, "main_decode": 1}
    target = proposal.target["nodes"]
    assert target["prefill"] >= 1 and target["main_decode"] >= 1
    assert sum(target.values()) > 2  # grows: one P and one MD miss the SLA at this rate
    # The changes are the difference, starts on free nodes of the pool's place.
    starts = [c for c in proposal.changes if c["action"] == "start"]
    drains = [c for c in proposal.changes if c["action"] == "drain"]
    for role in ("prefill", "relay_decode", "main_decode"):
        delta = target[role] - proposal.current["nodes"][role]
        assert sum(c["role"] == role for c in starts) == max(delta, 0)
        assert sum(c["role"] == role for c in drains) == max(-delta, 0)
    for change in starts:
        node = Node.objects.get(pk=change["node"])
        assert not node.instances.exists()
        assert node.datacenter.name == ("dc-b" if change["role"] == "main_decode" else "dc-a")
    predicted = proposal.predicted
    assert predicted["rps"] == pytest.approx(proposal.profile["sizing_rps"])
    assert predicted["after"]["met"] is True
    assert predicted["after"]["bcr"] > 0 and predicted["after"]["goodput_rps"] > 0
    assert predicted["before"]["cost_per_hour"] == pytest.approx(16 + 10)  # 1 node each
    assert predicted["before"]["met"] is False  # the running fleet misses the SLA
    assert predicted["after"]["goodput_rps"] > predicted["before"]["goodput_rps"]
    assert proposal.target["cost_per_hour"] == pytest.approx(
        16 * (target["prefill"] + target["relay_decode"]) + 10 * target["main_decode"]
    )
    assert proposal.thresholds["best"] and len(proposal.thresholds["tried"]) == 6
    assert "req/s" in proposal.reason and "misses the SLA" in proposal.reason
    # Executing again changes nothing (only a proposal being sized is sized).
    assert autopilot.proposal_execute(proposal_id=proposal.pk).status == proposal.status


def test_floors_keep_roles_when_there_is_no_traffic(fleet):
    row = autopilot.settings_get()
    row.floors = {"prefill": 2, "main_decode": 1, "relay_decode": 1}
    row.save()
    proposal = autopilot.proposal_execute(proposal_id=autopilot.proposal_create().pk)
    assert proposal.status == ProposalStatus.PROPOSED, proposal.error
    assert proposal.target["nodes"] == {"prefill": 2, "relay_decode": 1, "main_decode": 1}
    assert sorted(c["role"] for c in proposal.changes) == ["prefill", "relay_decode"]
    assert "no request" in proposal.reason


def test_without_fleet_data_a_proposal_is_refused_naming_the_fleet(db):
    with pytest.raises(autopilot.PlanInputError) as err:
        autopilot.proposal_create()
    assert err.value.field == "fleet"


# --- approval, staleness and apply ---------------------------------------------------------------


def test_approve_then_apply_starts_first_and_drains_before_removing(fleet):
    nodes = fleet["nodes"]
    extra = services.instance_create(
        role=InstanceRole.MAIN_DECODE, node=nodes["b-2"], served_model=fleet["model"], gpu_count=4
    )
    Instance.objects.filter(pk=extra.pk).update(actual_state=ActualState.RUNNING)
    proposal = _proposal(fleet, [_start(nodes["a-2"]), _drain(extra)])
    autopilot.proposal_decide(proposal=proposal, approve=True, actor="op")
    proposal.refresh_from_db()
    assert proposal.status == ProposalStatus.APPLYING and proposal.decided_by == "op"
    autopilot.proposal_apply(proposal_id=proposal.pk)  # what the queued task does
    started = Instance.objects.get(node=nodes["a-2"])
    assert started.role == "prefill" and started.desired_state == DesiredState.RUNNING
    # The drain waits for the start to be running.
    assert Instance.objects.get(pk=extra.pk).desired_state == DesiredState.RUNNING
    autopilot.proposal_apply(proposal_id=proposal.pk)
    assert Instance.objects.get(node=nodes["a-2"]).pk == started.pk  # not started twice
    Instance.objects.filter(pk=started.pk).update(actual_state=ActualState.RUNNING)
    autopilot.proposal_apply(proposal_id=proposal.pk)
    assert Instance.objects.get(pk=extra.pk).desired_state == DesiredState.DRAINED
    assert Instance.objects.filter(pk=extra.pk).exists()  # not removed before it drained
    Instance.objects.filter(pk=extra.pk).update(actual_state=ActualState.DRAINED)
    proposal = autopilot.proposal_apply(proposal_id=proposal.pk)
    assert not Instance.objects.filter(pk=extra.pk).exists()
    assert proposal.status == ProposalStatus.APPLIED and proposal.applied_at is not None
    assert [s.status for s in proposal.steps.all()] == ["done", "done"]
    kinds = list(
        FleetEvent.objects.filter(kind__startswith="autopilot.").values_list("kind", flat=True)
    )
    assert {"autopilot.approved", "autopilot.start", "autopilot.drain", "autopilot.applied"} <= set(
        kinds
    )


def test_a_worker_dying_mid_step_does_not_start_twice(fleet):
    nodes = fleet["nodes"]
    proposal = _proposal(fleet, [_start(nodes["a-3"])])
    Proposal.objects.filter(pk=proposal.pk).update(status=ProposalStatus.APPLYING)
    ProposalStep.objects.create(proposal=proposal, index=0, action="start", role="prefill",
                                node=nodes["a-3"])  # fmt: skip
    autopilot.proposal_apply(proposal_id=proposal.pk)
    autopilot.proposal_apply(proposal_id=proposal.pk)  # a second worker, or a retry
    assert Instance.objects.filter(node=nodes["a-3"]).count() == 1


def test_a_stale_proposal_is_refused_and_marked(fleet, operator):
    proposal = _proposal(fleet, [_start(fleet["nodes"]["a-2"])])
    services.instance_create(role=InstanceRole.PREFILL, node=fleet["nodes"]["a-4"],
                             served_model=fleet["model"], gpu_count=8)  # fmt: skip
    response = operator.post(f"{API}proposals/{proposal.pk}/approve/")
    assert response.status_code == 409 and response.json()["code"] == "stale"
    proposal.refresh_from_db()
    assert proposal.status == ProposalStatus.STALE and not proposal.steps.exists()
    assert not Instance.objects.filter(node=fleet["nodes"]["a-2"]).exists()


def test_reject_and_decisions_on_a_decided_proposal(fleet, operator, viewer):
    proposal = _proposal(fleet, [_start(fleet["nodes"]["a-2"])])
    assert viewer.post(f"{API}proposals/{proposal.pk}/approve/").status_code == 403
    response = operator.post(f"{API}proposals/{proposal.pk}/reject/")
    assert response.status_code == 200 and response.json()["status"] == "rejected"
    again = operator.post(f"{API}proposals/{proposal.pk}/approve/")
    assert again.status_code == 409 and again.json()["code"] == "not_proposed"
    assert operator.get(f"{API}proposals/").json()["results"][0]["id"] == proposal.pk
    assert operator.get(f"{API}proposals/999999/").status_code == 404


# --- the automatic mode's guardrails -------------------------------------------------------------


def _automatic(**kw) -> AutopilotSettings:
    row = autopilot.settings_get()
    row.automatic = True
    row.interval_s = 0  # no scheduled proposal in these tests
    for k, v in kw.items():
        setattr(row, k, v)
    row.save()
    return row


def test_automatic_mode_applies_a_clean_proposal_in_steps_of_the_largest_change(fleet, monkeypatch):
    nodes = fleet["nodes"]
    _automatic(max_change_per_step=1)
    proposal = _proposal(fleet, [_start(nodes["a-2"]), _start(nodes["a-3"])])
    queued: list[tuple] = []
    monkeypatch.setattr(autopilot, "enqueue_after_commit", lambda *a, **k: queued.append(a))
    did = autopilot.autopilot_tick()
    assert queued == []  # the tick applies it itself: no second task doing the same
    assert did["approved"] == proposal.pk
    proposal.refresh_from_db()
    assert proposal.decided_by == "autopilot" and proposal.steps.count() == 1
    assert "1 of 2 changes" in proposal.reason
    assert Instance.objects.filter(node=nodes["a-2"]).exists()
    assert not Instance.objects.filter(node=nodes["a-3"]).exists()


@pytest.mark.parametrize("guard", ["fault", "cooldown", "budget", "off"])
def test_automatic_mode_holds_back_outside_its_guardrails(fleet, guard):
    nodes = fleet["nodes"]
    _automatic(budget_per_hour=Decimal("20.00") if guard == "budget" else None, cooldown_s=600)
    if guard == "off":
        AutopilotSettings.objects.update(automatic=False)
    if guard == "cooldown":
        Proposal.objects.create(status=ProposalStatus.APPLIED, scenario="tiny-size",
                                fingerprint="x", applied_at=timezone.now())  # fmt: skip
    proposal = _proposal(fleet, [_start(nodes["a-2"])])
    if guard == "fault":
        Node.objects.filter(pk=nodes["b-1"].pk).update(status=NodeStatus.OFFLINE)
        proposal.fingerprint = autopilot.fleet_fingerprint()
        proposal.save()
    did = autopilot.autopilot_tick()
    assert did["approved"] is None
    proposal.refresh_from_db()
    assert proposal.status == ProposalStatus.PROPOSED
    expected = {"fault": "not online", "cooldown": "cooling down", "budget": "budget", "off": ""}
    if guard != "off":
        assert any(expected[guard] in why for why in proposal.guardrails), proposal.guardrails


def test_the_schedule_proposes_once_per_interval(fleet):
    row = autopilot.settings_get()
    row.interval_s = 3600
    row.save()
    did = autopilot.autopilot_tick()
    assert did["proposed"] is not None
    assert autopilot.autopilot_tick()["proposed"] is None  # within the interval
    assert Proposal.objects.get(pk=did["proposed"]).trigger == "schedule"


# --- the honesty loop ----------------------------------------------------------------------------


def test_realised_figures_are_recorded_per_window_after_apply(fleet):
    settle = autopilot.REALISED_SETTLE_S
    applied = timezone.now() - timedelta(seconds=autopilot.REALISED_WINDOW_S + settle + 30)
    proposal = Proposal.objects.create(
        status=ProposalStatus.APPLIED, scenario="tiny-size", fingerprint="x", applied_at=applied,
        predicted={"after": {"ttft_p90_s": 0.8}},
        target={"cost_per_hour": 26.0, "pools": {
            "p": {"role": "prefill", "unit_price": 16.0},
            "md": {"role": "main_decode", "unit_price": 10.0}}},
    )  # fmt: skip
    for i in range(10):
        _record(applied + timedelta(seconds=10 + i), ttft=0.1 * (i + 1))
    # Arrived before the apply, answered after it (the queue the new fleet inherited): not its
    inherited = _record(applied + timedelta(seconds=5), ttft=40.0)
    RequestRecord.objects.filter(pk=inherited.pk).update(e2e_s=60.0)
    assert autopilot.record_realised(proposal)
    assert not autopilot.record_realised(proposal)  # the next window has not ended
    window = proposal.realised[0]
    assert window["requests"] == 10 and window["ttft_p90_s"] == pytest.approx(0.9)
    assert window["predicted_ttft_p90_s"] == 0.8
    assert window["cost_per_hour"] == pytest.approx(26.0)  # 1 P + 1 MD running


# --- the API -------------------------------------------------------------------------------------


def test_settings_are_read_by_all_and_changed_by_operators(db, operator, viewer):
    assert viewer.get(f"{API}settings/").json()["automatic"] is False
    assert viewer.patch(f"{API}settings/", {"automatic": True}, format="json").status_code == 403
    change = {"automatic": True, "cooldown_s": 60, "floors": {"prefill": 2}}
    response = operator.patch(f"{API}settings/", change, format="json")
    assert response.status_code == 200, response.content
    assert response.json()["automatic"] is True and response.json()["floors"] == {"prefill": 2}
    assert FleetEvent.objects.filter(kind="autopilot.settings").exists()


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"floors": {"gpu": 1}}, "floors"),
        ({"floors": {"prefill": -1}}, "floors"),
        ({"floors": [1]}, "floors"),
        ({"scenario": "no-such"}, "scenario"),
        ({"max_change_per_step": 0}, "max_change_per_step"),
        ({"budget_per_hour": -5}, "budget_per_hour"),
        ({"interval_s": "often"}, "interval_s"),
    ],
)
def test_bad_settings_are_400_naming_the_field_and_change_nothing(db, operator, body, field):
    response = operator.patch(f"{API}settings/", body, format="json")
    assert response.status_code == 400 and field in response.json(), response.content
    assert operator.get(f"{API}settings/").json()["max_change_per_step"] == 4


def test_the_profile_endpoint(db, viewer):
    _record(timezone.now())
    body = viewer.get(f"{API}profile/").json()
    assert body["requests"] == 1 and body["window_s"] == 900


def test_the_autopilot_sizes_one_served_model_over_its_own_link(fleet, gpu_a, gpu_b):
    """Two models on two links (the demo's trio and emulated fleet): the settings' model, or
    the one with the most instances, is sized over the link its P and MD span."""
    from fleet.models import Datacenter, ServedModel, WANLink

    dc_c = Datacenter.objects.create(name="dc-c", region="city-c")
    dc_d = Datacenter.objects.create(name="dc-d", region="city-d")
    other = ServedModel.objects.create(name="other", source="baton-tiny", num_layers=4,
                                       kv_bytes_per_token=2048)  # fmt: skip
    link_cd = WANLink.objects.create(from_datacenter=dc_c, to_datacenter=dc_d,
                                     bandwidth_gbps=5, rtt_ms=10)  # fmt: skip
    _price(gpu_a, dc_c, "1.00")
    _price(gpu_b, dc_d, "1.50")
    for name, dc, gpu, role in (("c-1", dc_c, gpu_a, "prefill"), ("c-2", dc_c, gpu_a, "prefill"),
                                ("d-1", dc_d, gpu_b, "main_decode")):  # fmt: skip
        node, _ = services.node_create(hostname=name, datacenter=dc, gpu_type=gpu, gpu_count=8)
        services.instance_create(role=role, node=node, served_model=other, gpu_count=8)
    row = autopilot.settings_get()
    assert autopilot.served_model_of(row) == other  # 3 instances against 2
    assert autopilot.link_of(other) == link_cd
    assert autopilot.link_of(fleet["model"]).from_datacenter.name == "dc-a"
    assert len(autopilot.running_by_role(other)["prefill"]) == 2
    row.served_model = fleet["model"]
    row.save()
    proposal = autopilot.proposal_execute(proposal_id=autopilot.proposal_create().pk)
    assert proposal.model == "baton-tiny", proposal.error
    assert proposal.current["nodes"] == {"prefill": 1, "relay_decode": 0, "main_decode": 1}
    assert all("dc-a" in k or "dc-b" in k for k in proposal.current["pools"])


def test_arrivals_per_minute_count_back_from_now():
    from plans.profile import per_minute

    now = timezone.now()
    times = [now - timedelta(seconds=back_s) for back_s in (5, 30, 59, 61, 119, 200, 300)]
    counts = per_minute(times, now - timedelta(seconds=240), now)
    assert counts == [1, 0, 2, 3]  # 200 s ago; none; 61 and 119 s; 5, 30 and 59 s


def test_arrivals_are_when_requests_came_not_when_they_ended(db):
    """Records are written at a request's end: under overload they lag the arrivals, and the
    rate sized for must not fall while the queue grows. Requests in flight count too."""
    from plans.profile import arrival_times
    from routing.models import Admission

    now = timezone.now()
    late = _record(now - timedelta(seconds=10))  # ended 10 s ago after 100 s: came 110 s ago
    RequestRecord.objects.filter(pk=late.pk).update(e2e_s=100.0)
    tenant = Tenant.objects.get(name="acme")
    for i in range(3):
        Admission.objects.create(request_id=f"in-flight-{i}", tenant=tenant, model="baton-tiny",
                                 endpoint="chat.completions")  # fmt: skip
    profile = workload_profile(900, now=now + timedelta(seconds=1))
    assert profile["requests"] == 4
    assert profile["rate_rps"]["1m"] == pytest.approx(3 / 60)  # the admissions, just now
    times = arrival_times(None, now - timedelta(seconds=900), now + timedelta(seconds=1))
    assert min(times) == pytest.approx(now - timedelta(seconds=110), abs=timedelta(seconds=1))


def test_a_scale_down_waits_for_a_stable_rate_and_a_fleet_that_meets_the_sla(fleet):
    """A dip in the rate right after a ramp is not a fall: a proposal that shrinks a role is
    held while a proposal of the last scale_down_after_s wanted more of it, or while the fleet
    misses the SLA now."""
    row = _automatic(scale_down_after_s=300)
    shrink = {"current": {"nodes": {"prefill": 2, "relay_decode": 0, "main_decode": 1}},
              "sizing": {"sla": {"ttft_p90_s": 10.0, "ttft_p99_s": 15.0}}}  # fmt: skip
    earlier = _proposal(fleet, [])
    Proposal.objects.filter(pk=earlier.pk).update(
        status=ProposalStatus.UNCHANGED,
        target={"nodes": {"prefill": 2, "relay_decode": 0, "main_decode": 1}},
    )
    proposal = _proposal(fleet, [_drain(fleet["p"])], **shrink)
    proposal.target = {"nodes": {"prefill": 1, "relay_decode": 0, "main_decode": 1},
                       "cost_per_hour": 26.0}  # fmt: skip
    proposal.save()
    why = autopilot.guardrail_violations(proposal, row)
    assert any(f"proposal #{earlier.pk}" in w and "prefill" in w for w in why), why
    Proposal.objects.filter(pk=earlier.pk).update(
        created_at=timezone.now() - timedelta(seconds=400)
    )
    assert autopilot.guardrail_violations(proposal, row) == []
    for i in range(10):  # the fleet misses the SLA now
        _record(timezone.now() - timedelta(seconds=i), ttft=30.0)
    why = autopilot.guardrail_violations(proposal, row)
    assert any("misses the SLA now (P90 30.0 s)" in w for w in why), why
    grow = _proposal(fleet, [_start(fleet["nodes"]["a-2"])], **shrink)
    grow.target = {"nodes": {"prefill": 3, "relay_decode": 0, "main_decode": 1}}
    grow.save()
    assert autopilot.guardrail_violations(grow, row) == []  # growing is never held so


def test_the_measured_wan_throughput_replaces_the_scenarios_per_connection_rate():
    fleet = {"links": {"dc-b": {"bandwidth_gbps": 2.5, "rtt_ms": 20, "tcp_window_kb": 562.5}}}
    few = {"wan_gbps": {"requests": 3, "p50": 1.1}}
    assert autopilot.measured_link(fleet, few) == ""
    assert fleet["links"]["dc-b"]["tcp_window_kb"] == 562.5  # too few samples: unchanged
    note = autopilot.measured_link(fleet, {"wan_gbps": {"requests": 40, "p50": 1.1}})
    assert "1.10 Gbit/s" in note and "40 requests" in note
    assert fleet["links"]["dc-b"] == {"bandwidth_gbps": 2.5, "rtt_ms": 20,
                                      "per_connection_gbps": 1.1}  # fmt: skip
    autopilot.measured_link(fleet, {"wan_gbps": {"requests": 40, "p50": 9.0}})
    assert fleet["links"]["dc-b"]["per_connection_gbps"] == 2.5  # never above the line
