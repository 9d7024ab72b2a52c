"""The autopilot section of the /planner/ page (plans/autopilot.py): its mode and guardrails,
the live workload profile it sizes for, the newest proposals with their predicted figures
(operators approve or reject a proposed one), the newest one's steps, and how past
predictions came out beside the realised figures.

Operators post plain forms here (``ProposeView``, ``DecideView``): they work without
JavaScript and come back to ``/planner/#autopilot`` with a message. The section is rendered by
the ``autopilot_section`` tag (frontend/templatetags/planner_autopilot.py), so the planner
page's own view is unchanged. The REST API (/api/v1/autopilot/...) does the same for scripts.
"""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect
from django.urls import reverse
from django.views import View

from frontend.fleet_edit import OperatorRequiredMixin
from plans import autopilot
from plans.models import Proposal, ProposalStatus
from plans.services import PlanInputError

PROPOSALS_SHOWN = 10
PAST_SHOWN = 5
MESSAGE_TAG = "autopilot"
ANCHOR = "#autopilot"
ROLE_LABELS = {"prefill": "P", "relay_decode": "RLD", "main_decode": "MD"}
# A proposal's or a step's status drawn with the page's existing state colours.
TONES = {
    "sizing": "state-queued",
    "proposed": "state-queued",
    "approved": "state-starting",
    "applying": "state-starting",
    "applied": "state-done",
    "failed": "state-failed",
    "rejected": "state-stopped",
    "pending": "state-pending",
    "running": "state-starting",  # its side effect is done; waiting for the fleet
    "done": "state-done",
}


def duration(seconds: int | float | None) -> str:
    """Seconds in words: 300 -> "5 min", 90 -> "90 s", 7200 -> "2 h", 0 -> "0 s"."""
    if seconds is None:
        return "–"
    s = int(seconds)
    if s >= 3600 and s % 3600 == 0:
        return f"{s // 3600} h"
    if s >= 60 and s % 60 == 0:
        return f"{s // 60} min"
    return f"{s} s"


def arrows(text: str) -> str:
    """The stored words' ``->`` as one arrow character, which a line break cannot split."""
    return (text or "").replace(" -> ", " \u2192 ")


def _settings_view(row: Any) -> dict[str, Any]:
    """The settings as the section shows them (durations in words, floors with the defaults
    filled in, in the planner's role order)."""
    floors = autopilot.floors_of(row)
    return {
        "row": row,
        "automatic": row.automatic,
        "interval": duration(row.interval_s) if row.interval_s else "",
        "window": duration(row.window_s),
        "cooldown": duration(row.cooldown_s),
        "floors": [
            {"label": ROLE_LABELS.get(role, role), "role": role, "nodes": floors[role]}
            for role in autopilot.ROLES
            if role in floors
        ],
    }


def _profile_view(profile: dict[str, Any]) -> dict[str, Any]:
    """The live profile's figures the section's table shows."""
    rate = profile.get("rate_rps") or {}
    hit = profile.get("hit_rate") or {}
    return {
        "model": profile.get("model") or "",
        "requests": profile.get("requests", 0),
        "served": profile.get("served", 0),
        "window": duration(profile.get("window_s")),
        "rate_1m": rate.get("1m"),
        "rate_5m": rate.get("5m"),
        "rate_15m": rate.get("15m"),
        "forecast": profile.get("forecast_rps"),
        "horizon_min": profile.get("forecast_horizon_min"),
        "sizing": profile.get("sizing_rps"),
        "hit_mean": hit.get("mean"),
        "hit_high": hit.get("high_share"),
        "prompt": profile.get("prompt_tokens") or {},
        "output": profile.get("output_tokens") or {},
        "singular": profile.get("singular_share"),
        "wan": profile.get("wan_gbps") or {},
    }


def _roles(proposal: Proposal) -> list[dict[str, Any]]:
    """Nodes per role, now and proposed (roles in the planner's order)."""
    now = (proposal.current or {}).get("nodes") or {}
    then = (proposal.target or {}).get("nodes") or {}
    rows = []
    for role in autopilot.ROLES:
        if role not in now and role not in then:
            continue
        before, after = now.get(role), then.get(role)
        rows.append(
            {
                "label": ROLE_LABELS.get(role, role),
                "role": role,
                "before": before,
                "after": after,
                "changed": before != after,
            }
        )
    return rows


def proposal_row(proposal: Proposal) -> dict[str, Any]:
    """One proposal, ready for the template."""
    predicted = proposal.predicted or {}
    before = predicted.get("before") or {}
    after = predicted.get("after") or {}
    return {
        "p": proposal,
        "tone": TONES.get(proposal.status, ""),
        "roles": _roles(proposal),
        "cost_before": (proposal.current or {}).get("cost_per_hour"),
        "cost_after": (proposal.target or {}).get("cost_per_hour"),
        "rps": predicted.get("rps"),
        "p90_before": before.get("ttft_p90_s"),
        "p90_after": after.get("ttft_p90_s"),
        "met_before": before.get("met"),
        "met_after": after.get("met"),
        "reason": arrows(proposal.reason),
        "guardrails": list(proposal.guardrails or []),
        "decidable": proposal.status == ProposalStatus.PROPOSED,
        "approve_url": reverse("frontend:planner-autopilot-approve", args=[proposal.pk]),
        "reject_url": reverse("frontend:planner-autopilot-reject", args=[proposal.pk]),
    }


def _steps(proposal: Proposal | None) -> list[dict[str, Any]]:
    """The newest proposal's steps; before approval, its planned changes (status planned)."""
    if proposal is None:
        return []
    steps = list(proposal.steps.all())
    if steps:
        return [
            {
                "index": s.index,
                "action": s.action,
                "role": ROLE_LABELS.get(s.role, s.role),
                "node": s.node.hostname if s.node is not None else "",
                "status": s.status,
                "tone": TONES.get(s.status, ""),
                "note": arrows(s.note),
            }
            for s in steps
        ]
    return [
        {
            "index": i,
            "action": c.get("action", ""),
            "role": ROLE_LABELS.get(c.get("role", ""), c.get("role", "")),
            "node": c.get("hostname", ""),
            "status": "planned",
            "tone": "",
            "note": arrows(c.get("why", "")),
        }
        for i, c in enumerate(proposal.changes or [])
    ]


def _no_steps(proposal: Proposal | None) -> str:
    """Why a proposal has no step to show."""
    if proposal is None:
        return ""
    if proposal.status == ProposalStatus.SIZING:
        return "still being sized."
    if proposal.status == ProposalStatus.FAILED:
        return "it failed (see above)."
    now = (proposal.current or {}).get("nodes")
    then = (proposal.target or {}).get("nodes")
    if now != then:
        return "none could be planned (no free node of the pool's datacenter and GPU type)."
    return "the running fleet already is the answer."


def _past() -> list[dict[str, Any]]:
    """Applied proposals' predicted P90 TTFT and cost beside the realised per window."""
    applied = Proposal.objects.filter(
        status=ProposalStatus.APPLIED, applied_at__isnull=False
    ).order_by("-applied_at")[:PAST_SHOWN]
    rows = []
    for item in autopilot.recent(applied):
        windows = [
            {"p90": p90, "cost": cost}
            for p90, cost in zip(item["realised_p90"], item["realised_cost"], strict=False)
        ]
        rows.append({**item, "windows": windows})
    return rows


def autopilot_context(is_operator: bool) -> dict[str, Any]:
    """What the autopilot section shows."""
    row = autopilot.settings_get()
    proposals = list(Proposal.objects.prefetch_related("steps__node")[:PROPOSALS_SHOWN])
    newest = proposals[0] if proposals else None
    return {
        "is_operator": is_operator,
        "ap_settings": _settings_view(row),
        "ap_profile": _profile_view(autopilot.live_profile(row)),
        "ap_proposals": [proposal_row(p) for p in proposals],
        "ap_newest": newest,
        "ap_steps": _steps(newest),
        "ap_steps_planned": newest is not None and not newest.steps.all(),
        "ap_no_steps": _no_steps(newest),
        "ap_past": _past(),
        "ap_windows": autopilot.REALISED_WINDOWS,
        "ap_window": duration(autopilot.REALISED_WINDOW_S),
        "ap_propose_url": reverse("frontend:planner-autopilot-propose"),
        "ap_settings_api": reverse("autopilot-settings"),
        "ap_profile_api": reverse("autopilot-profile"),
        "ap_proposals_api": reverse("proposal-list"),
    }


def _back() -> HttpResponse:
    return redirect(reverse("frontend:planner") + ANCHOR)


class _OperatorPost(OperatorRequiredMixin, View):
    http_method_names = ["post"]
    refused = "Only operators may do this."


class ProposeView(_OperatorPost):
    """POST /planner/autopilot/propose/: ask for a proposal now (sized after commit: by a
    worker, or in-process on the embedded defaults). Missing fleet data comes back as a
    message naming it."""

    refused = "Only operators may ask the autopilot for a proposal."

    def post(self, request: HttpRequest) -> HttpResponse:
        try:
            proposal = autopilot.proposal_create(
                trigger="manual", actor=request.user.get_username()
            )
        except PlanInputError as exc:
            messages.error(
                request, f"No proposal: {exc.field}: {exc.message}", extra_tags=MESSAGE_TAG
            )
            return _back()
        proposal.refresh_from_db()
        if proposal.status == ProposalStatus.SIZING:
            text = f"Proposal #{proposal.pk} asked for: being sized."
        else:
            text = f"Proposal #{proposal.pk}: {proposal.status}."
        messages.success(request, text, extra_tags=MESSAGE_TAG)
        return _back()


class DecideView(_OperatorPost):
    """POST /planner/autopilot/<id>/approve/ or .../reject/: decide a proposed proposal.
    A refusal (stale: the fleet changed since it was made; or not proposed any more) comes
    back as a message; a stale one is marked stale."""

    approve = True
    refused = "Only operators may approve or reject proposals."

    def post(self, request: HttpRequest, pk: int) -> HttpResponse:
        proposal = get_object_or_404(Proposal, pk=pk)
        try:
            decided = autopilot.proposal_decide(
                proposal=proposal, approve=self.approve, actor=request.user.get_username()
            )
        except autopilot.ProposalRefused as exc:
            text = exc.message[:1].upper() + exc.message[1:] + "."
            messages.error(request, text, extra_tags=MESSAGE_TAG)
            return _back()
        if self.approve:
            steps = decided.steps.count()
            text = f"Proposal #{pk} approved: {steps} step{'s' if steps != 1 else ''} to apply."
        else:
            text = f"Proposal #{pk} rejected."
        messages.success(request, text, extra_tags=MESSAGE_TAG)
        return _back()
