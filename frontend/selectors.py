"""Read-side queries of the UI: the filterable request log and instance / link details."""

from __future__ import annotations

from django import forms
from django.db.models import Q, QuerySet

from routing.choices import HandoffChoice, PipelineChoice, RequestStatus
from routing.models import RequestRecord


class RequestLogFilter(forms.Form):
    """Filters of the request log; every field optional."""

    pipeline = forms.ChoiceField(
        required=False, choices=[("", "any pipeline")] + list(PipelineChoice.choices)
    )
    handoff_mode = forms.ChoiceField(
        required=False, choices=[("", "any handoff")] + list(HandoffChoice.choices)
    )
    status = forms.ChoiceField(
        required=False, choices=[("", "any status")] + list(RequestStatus.choices)
    )
    model = forms.CharField(required=False, max_length=128)
    tenant = forms.CharField(required=False, max_length=64)
    instance = forms.CharField(required=False, max_length=32)
    q = forms.CharField(required=False, max_length=64, label="request id")


def request_log(*, filters: dict) -> QuerySet[RequestRecord]:
    """Newest first, with the routing decision (for its reason) and the tenant joined in."""
    qs = RequestRecord.objects.select_related("tenant", "decision").order_by("-created_at", "-id")
    for field in ("pipeline", "handoff_mode", "status", "model"):
        if filters.get(field):
            qs = qs.filter(**{field: filters[field]})
    if filters.get("tenant"):
        qs = qs.filter(tenant__name=filters["tenant"])
    if filters.get("instance"):
        iid = filters["instance"]
        qs = qs.filter(Q(prefill_instance=iid) | Q(relay_instance=iid) | Q(main_instance=iid))
    if filters.get("q"):
        qs = qs.filter(request_id__startswith=filters["q"])
    return qs


ROLE_ORDER = {"prefill": 0, "relay_decode": 1, "main_decode": 2}
DC_W, DC_GAP, DC_X0, DC_Y0, ROW_H = 300, 240, 20, 40, 26


def topology_layout() -> dict:
    """Positions for the fleet page's SVG: datacenters side by side, their instances stacked
    inside by role, WAN links as lines between the boxes."""
    from fleet.models import Datacenter, Instance, WANLink

    dcs = list(Datacenter.objects.all())
    instances = Instance.objects.select_related("node", "served_model").order_by("id")
    by_dc: dict[int, list] = {dc.pk: [] for dc in dcs}
    for inst in instances:
        by_dc.setdefault(inst.node.datacenter_id, []).append(inst)
    rows = max([len(v) for v in by_dc.values()] + [1])
    box_h = 50 + rows * ROW_H
    boxes = []
    centre: dict[int, tuple[float, float]] = {}
    for i, dc in enumerate(dcs):
        x = DC_X0 + i * (DC_W + DC_GAP)
        items = sorted(by_dc.get(dc.pk, []), key=lambda it: (ROLE_ORDER.get(it.role, 9), it.pk))
        boxes.append(
            {
                "dc": dc,
                "x": x,
                "y": DC_Y0,
                "w": DC_W,
                "h": box_h,
                "instances": [
                    {"obj": inst, "x": x + 12, "y": DC_Y0 + 40 + j * ROW_H, "w": DC_W - 24}
                    for j, inst in enumerate(items)
                ],
            }
        )
        centre[dc.pk] = (x + DC_W / 2, DC_Y0 + box_h / 2)
    links = []
    all_links = list(WANLink.objects.select_related("from_datacenter", "to_datacenter"))
    # links between the same two datacenters (either way) are spread vertically, 44 apart
    pairs: dict[frozenset, list] = {}
    for link in all_links:
        pairs.setdefault(frozenset((link.from_datacenter_id, link.to_datacenter_id)), []).append(
            link
        )
    for link in all_links:
        a, b = centre.get(link.from_datacenter_id), centre.get(link.to_datacenter_id)
        if a is None or b is None:
            continue
        # the line runs between the facing edges
        left, right = (a, b) if a[0] <= b[0] else (b, a)
        same = pairs[frozenset((link.from_datacenter_id, link.to_datacenter_id))]
        dy = (same.index(link) - (len(same) - 1) / 2) * 44
        links.append(
            {
                "obj": link,
                "name": f"{link.from_datacenter.name}->{link.to_datacenter.name}",
                "x1": left[0] + DC_W / 2,
                "y1": left[1] + dy,
                "x2": right[0] - DC_W / 2,
                "y2": right[1] + dy,
                "lx": (left[0] + right[0]) / 2,
                "ly": left[1] + dy - 20,  # bandwidth and RTT
                "uy": left[1] + dy - 6,  # status and utilisation
            }
        )
    width = DC_X0 * 2 + max(1, len(dcs)) * DC_W + max(0, len(dcs) - 1) * DC_GAP
    return {"boxes": boxes, "links": links, "width": width, "height": DC_Y0 + box_h + 20}
