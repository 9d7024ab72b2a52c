"""The planner page's autopilot section (frontend/planner_autopilot.py): the mode and the
guardrails, the live profile, the newest proposals with their predictions and the newest one's
steps, past predictions beside the realised figures; operators ask for a proposal and approve
or reject a proposed one through plain forms."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.contrib.auth.models import Group, User
from django.test import Client
from django.utils import timezone

from fleet import services
from fleet.choices import InstanceRole
from fleet.models import Instance
from plans import autopilot
from plans.models import Proposal, ProposalStatus
from tests.fleet.conftest import dc_a, dc_b, gpu_a, gpu_b, link_ab, tiny_model  # noqa: F401
from tests.plans.test_autopilot import _proposal, _record, _start, fleet  # noqa: F401

PAGE = "/planner/"
PROPOSE = "/planner/autopilot/propose/"


@pytest.fixture
def operator_user(db):
    user = User.objects.create_user("otto", password="pw-operator-1")
    user.groups.add(Group.objects.get_or_create(name="operator")[0])
    return user


@pytest.fixture
def viewer_user(db):
    user = User.objects.create_user("vera", password="pw-viewer-1")
    user.groups.add(Group.objects.get_or_create(name="viewer")[0])
    return user


def _section(client: Client) -> str:
    """The autopilot section of the planner page."""
    page = client.get(PAGE)
    assert page.status_code == 200
    html = page.content.decode()
    assert html.count('id="autopilot"') == 1
    return html.split('id="autopilot"', 1)[1].split("</section>", 1)[0]


def _sized(rows, **kw) -> Proposal:
    """A proposed proposal: one more prefill on a-2, as proposal_execute would word it."""
    proposal = _proposal(
        rows,
        [_start(rows["nodes"]["a-2"]) | {"why": "prefill: 1 -> 2 nodes"}],
        reason="At 8.00 req/s: +1 prefill nodes, cost 26.00/h -> 42.00/h.",
        current={"nodes": {"prefill": 1, "relay_decode": 0, "main_decode": 1},
                 "cost_per_hour": 26.0},
        predicted={"rps": 8.0, "before": {"ttft_p90_s": 3.21, "met": False},
                   "after": {"ttft_p90_s": 0.74, "met": True}},
        guardrails=["cooling down until 12:00:00 (proposal #1 applied)"],
        **kw,
    )  # fmt: skip
    proposal.target = {
        "nodes": {"prefill": 2, "relay_decode": 0, "main_decode": 1},
        "cost_per_hour": 42.0,
    }
    proposal.save(update_fields=["target"])
    return proposal


def test_a_viewer_reads_the_section_without_buttons(client, viewer_user, fleet):  # noqa: F811
    proposal = _sized(fleet)
    client.force_login(viewer_user)
    html = _section(client)
    assert "<strong>approval</strong>" in html
    assert "cool-down 5 min after an apply" in html and "at most 4 changes per step" in html
    assert "no cap" in html and "P &ge; 1" in html and "MD &ge; 1" in html
    assert 'href="/api/v1/autopilot/settings/"' in html
    assert 'id="ap-viewer-note"' in html and 'id="ap-propose"' not in html
    assert f'data-proposal-row="{proposal.pk}"' in html
    assert "At 8.00 req/s: +1 prefill nodes, cost 26.00/h \u2192 42.00/h." in html
    assert "P 1 &rarr; <strong>2</strong>" in html and 'MD 1 <span class="muted">unchanged' in html
    assert "26 &rarr; <strong>42</strong>" in html
    assert "3.21" in html and "misses SLA" in html and "<strong>0.74</strong>" in html
    assert "cooling down until 12:00:00" in html
    assert "data-approve" not in html and "data-reject" not in html
    # Its planned changes (not approved yet).
    assert f"Planned changes of proposal #{proposal.pk}" in html
    assert "<td>a-2</td>" in html and "prefill: 1 \u2192 2 nodes" in html
    assert "No traffic in the last 15 min" in html
    assert "No applied proposal yet." in html
    assert "emulated" not in html.lower()


def test_an_operator_gets_approve_and_reject_forms(client, operator_user, fleet):  # noqa: F811
    proposal = _sized(fleet)
    done = Proposal.objects.create(status=ProposalStatus.REJECTED, scenario="tiny-size",
                                   fingerprint="x", decided_by="otto")  # fmt: skip
    client.force_login(operator_user)
    html = _section(client)
    assert f'action="{PROPOSE}"' in html and "Ask for a proposal now" in html
    assert f'action="/planner/autopilot/{proposal.pk}/approve/"' in html
    assert f'action="/planner/autopilot/{proposal.pk}/reject/"' in html
    assert html.count("csrfmiddlewaretoken") == 3  # ask, approve, reject
    assert f'data-approve="{done.pk}"' not in html
    assert "rejected by otto" in html


def test_approve_through_the_page_makes_the_steps(client, operator_user, fleet):  # noqa: F811
    proposal = _sized(fleet)
    client.force_login(operator_user)
    response = client.post(f"/planner/autopilot/{proposal.pk}/approve/")
    assert response.status_code == 302 and response["Location"] == "/planner/#autopilot"
    proposal.refresh_from_db()
    assert proposal.status == ProposalStatus.APPLYING and proposal.decided_by == "otto"
    assert proposal.steps.count() == 1
    html = _section(client)
    assert f"Proposal #{proposal.pk} approved: 1 step to apply." in html
    assert f"Steps of proposal #{proposal.pk}" in html
    assert '<span class="state state-pending">pending</span>' in html
    assert "approved by otto" in html and "data-approve" not in html
    again = client.post(f"/planner/autopilot/{proposal.pk}/approve/", follow=True)
    assert f"Proposal #{proposal.pk} is applying, not proposed." in again.content.decode()


def test_reject_through_the_page(client, operator_user, fleet):  # noqa: F811
    proposal = _sized(fleet)
    client.force_login(operator_user)
    response = client.post(f"/planner/autopilot/{proposal.pk}/reject/", follow=True)
    assert response.redirect_chain == [("/planner/#autopilot", 302)]
    assert f"Proposal #{proposal.pk} rejected." in response.content.decode()
    proposal.refresh_from_db()
    assert proposal.status == ProposalStatus.REJECTED and not proposal.steps.exists()


def test_approving_a_stale_one_says_so_and_marks_it(client, operator_user, fleet):  # noqa: F811
    proposal = _sized(fleet)
    services.instance_create(role=InstanceRole.PREFILL, node=fleet["nodes"]["a-4"],
                             served_model=fleet["model"], gpu_count=8)  # fmt: skip
    client.force_login(operator_user)
    page = client.post(f"/planner/autopilot/{proposal.pk}/approve/", follow=True)
    html = page.content.decode()
    assert "msg-error" in html and "is stale: the fleet changed since it was made" in html
    proposal.refresh_from_db()
    assert proposal.status == ProposalStatus.STALE and not proposal.steps.exists()
    assert not Instance.objects.filter(node=fleet["nodes"]["a-2"]).exists()


def test_viewers_and_anonymous_users_cannot_post(client, viewer_user, fleet):  # noqa: F811
    proposal = _sized(fleet)
    urls = [PROPOSE, f"/planner/autopilot/{proposal.pk}/approve/",
            f"/planner/autopilot/{proposal.pk}/reject/"]  # fmt: skip
    for url in urls:
        assert client.post(url).status_code == 302  # to the login page
    client.force_login(viewer_user)
    for url in urls:
        assert client.post(url).status_code == 403
    proposal.refresh_from_db()
    assert proposal.status == ProposalStatus.PROPOSED
    assert Proposal.objects.count() == 1


def test_asking_without_fleet_data_says_so_and_creates_nothing(client, operator_user):
    client.force_login(operator_user)
    response = client.post(PROPOSE, follow=True)
    html = response.content.decode()
    assert response.redirect_chain == [("/planner/#autopilot", 302)]
    assert "msg-error" in html and "No proposal: fleet: " in html
    assert not Proposal.objects.exists()
    assert client.get(PROPOSE).status_code == 405


def test_asking_with_fleet_data_queues_a_proposal(client, operator_user, fleet):  # noqa: F811
    client.force_login(operator_user)
    response = client.post(PROPOSE, follow=True)
    proposal = Proposal.objects.get()
    assert proposal.status == ProposalStatus.SIZING and proposal.trigger == "manual"
    html = response.content.decode()
    assert f"Proposal #{proposal.pk} asked for: being sized." in html
    assert "still being sized." in html


def test_the_live_profile_and_past_predictions(client, viewer_user, fleet):  # noqa: F811
    now = timezone.now()
    for i in range(60):
        _record(now - timedelta(seconds=1 + i / 2), cached=16_000 if i % 2 else 8_000,
                pipeline="rld-only" if i < 6 else "p-md")  # fmt: skip
    row = autopilot.settings_get()
    row.automatic, row.budget_per_hour, row.floors = True, Decimal("80.00"), {"relay_decode": 1}
    row.save()
    applied = now - timedelta(minutes=20)
    Proposal.objects.create(
        status=ProposalStatus.APPLIED, scenario="tiny-size", fingerprint="x", applied_at=applied,
        predicted={"after": {"ttft_p90_s": 0.8}}, target={"cost_per_hour": 42.0},
        realised=[{"ttft_p90_s": 0.91, "cost_per_hour": 42.0},
                  {"ttft_p90_s": 0.77, "cost_per_hour": 42.0}],
    )  # fmt: skip
    client.force_login(viewer_user)
    html = _section(client)
    assert "<strong>automatic</strong>" in html and "80/h" in html and "RLD &ge; 1" in html
    assert 'id="ap-profile"' in html and "No traffic" not in html
    assert "60 requests, 60 served" in html
    assert "<td>1</td><td>0.2</td><td>0.07</td>" in html  # req/s over 1, 5 and 15 min
    assert "<td>75.0%</td><td>50.0%</td>" in html  # hit mean, share at or above 95%
    assert "16000 / 16000" in html and "<td>10.0%</td>" in html  # prompt; singular share
    assert "no KV over the WAN" in html
    assert "<td>0.8</td>" in html and "0.91 · 0.77" in html and "42 · 42" in html
