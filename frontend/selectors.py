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


# The topology is drawn at its own size (it scrolls sideways past the card, never shrinks), so
# its 12-15 px text stays that size whatever the fleet: a datacenter box holds one row per role
# x GPU type group, not one per instance.
DC_W, DC_GAP, DC_X0, DC_Y0 = 520, 180, 20, 20
HEAD_H, GROUP_H, GROUP_GAP, MIN_GROUPS = 40, 60, 8, 2
LINK_SPREAD = 64  # links between the same two datacenters, this far apart vertically
# Datacenters are drawn this many to a row (rows wrap), linked ones side by side where they can
# be: a fleet of two-datacenter pairs reads as one pair per row.
DC_PER_ROW, ROW_GAP = 2, 56


def _segments(group, x: float, width: float) -> list[dict]:
    """The health bar of a group: one segment per state (width 0 when none), in STATES order."""
    from frontend.fleet_groups import STATES

    out = []
    total = max(1, group.instances)
    for state in STATES:
        w = width * group.states.get(state.value, 0) / total
        out.append({"state": state.value, "x": round(x, 1), "w": round(w, 1)})
        x += w
    return out


def _group_box(group, x: float, y: float, w: float) -> dict:
    """One group's row in a datacenter box: its title and counts, health bar, states and load."""
    return {
        "g": group,
        "x": x,
        "y": y,
        "w": w,
        "h": GROUP_H,
        "tx": x + 10,  # text, left and right
        "rx": x + w - 10,
        "y1": y + 19,
        "ybar": y + 27,
        "y3": y + 51,
        "bar_x": x + 10,
        "bar_w": w - 20,
        "segments": _segments(group, x + 10, w - 20),
    }


def topology_layout(groups: list | None = None) -> dict:
    """Positions for the fleet page's SVG: datacenters side by side, in each one row per
    (role, GPU type) group of its instances (``frontend.fleet_groups``), WAN links as lines
    between the boxes."""
    from fleet.models import Datacenter, WANLink
    from frontend.fleet_groups import fleet_rows, groups_of

    if groups is None:
        groups = groups_of(fleet_rows())
    all_links = list(WANLink.objects.select_related("from_datacenter", "to_datacenter"))
    dcs = _linked_order(list(Datacenter.objects.all()), all_links)
    by_dc: dict[str, list] = {dc.name: [] for dc in dcs}
    for group in groups:
        by_dc.setdefault(group.datacenter, []).append(group)
    # Each row of boxes is as tall as its fullest datacenter.
    row_heights: list[float] = []
    for start in range(0, len(dcs), DC_PER_ROW):
        in_row = dcs[start : start + DC_PER_ROW]
        rows = max([len(by_dc.get(dc.name, [])) for dc in in_row] + [MIN_GROUPS])
        row_heights.append(HEAD_H + rows * (GROUP_H + GROUP_GAP))
    row_tops = [DC_Y0 + sum(row_heights[:r]) + r * ROW_GAP for r in range(len(row_heights))]
    boxes = []
    place: dict[int, tuple[float, float, float]] = {}  # dc pk -> (left x, top y, height)
    for i, dc in enumerate(dcs):
        row, col = divmod(i, DC_PER_ROW)
        x, y, box_h = DC_X0 + col * (DC_W + DC_GAP), row_tops[row], row_heights[row]
        items = by_dc.get(dc.name, [])
        gx, gw = x + 12, DC_W - 24
        nodes: set[int] = set()
        for group in items:
            nodes |= group.node_ids
        boxes.append(
            {
                "dc": dc,
                "x": x,
                "y": y,
                "w": DC_W,
                "h": box_h,
                "right": x + DC_W - 12,
                "instances": sum(g.instances for g in items),
                "nodes": len(nodes),
                "groups": [
                    _group_box(group, gx, y + HEAD_H + j * (GROUP_H + GROUP_GAP), gw)
                    for j, group in enumerate(items)
                ],
            }
        )
        place[dc.pk] = (x, y, box_h)
    links = []
    # links between the same two datacenters (either way) are spread apart
    pairs: dict[frozenset, list] = {}
    for link in all_links:
        pairs.setdefault(frozenset((link.from_datacenter_id, link.to_datacenter_id)), []).append(
            link
        )
    for link in all_links:
        a, b = place.get(link.from_datacenter_id), place.get(link.to_datacenter_id)
        if a is None or b is None:
            continue
        same = pairs[frozenset((link.from_datacenter_id, link.to_datacenter_id))]
        d = (same.index(link) - (len(same) - 1) / 2) * LINK_SPREAD
        if a[1] == b[1]:  # one row: between the facing edges, at the boxes' middle height
            left, right = (a, b) if a[0] <= b[0] else (b, a)
            x1, x2 = left[0] + DC_W, right[0]
            y1 = y2 = left[1] + left[2] / 2 + d
        else:  # rows apart: from the upper box's bottom to the lower box's top
            upper, lower = (a, b) if a[1] < b[1] else (b, a)
            x1, y1 = upper[0] + DC_W / 2 + d, upper[1] + upper[2]
            x2, y2 = lower[0] + DC_W / 2 + d, lower[1]
        lx, my = (x1 + x2) / 2, (y1 + y2) / 2
        links.append(
            {
                "obj": link,
                "name": f"{link.from_datacenter.name}->{link.to_datacenter.name}",
                "x1": x1,
                "y1": y1,
                "x2": x2,
                "y2": y2,
                "lx": lx,
                "ny": my - 24,  # the link's name
                "ly": my - 9,  # bandwidth and RTT
                "uy": my + 19,  # status and utilisation
            }
        )
    cols = max(1, min(len(dcs), DC_PER_ROW))
    width = DC_X0 * 2 + cols * DC_W + (cols - 1) * DC_GAP
    height = DC_Y0 * 2 + sum(row_heights) + max(0, len(row_heights) - 1) * ROW_GAP
    if not row_heights:
        height = DC_Y0 * 2 + HEAD_H + MIN_GROUPS * (GROUP_H + GROUP_GAP)
    return {"boxes": boxes, "links": links, "width": width, "height": height}


def _linked_order(dcs: list, links: list) -> list:
    """Datacenters in drawing order: each link's two ends next to each other (the from end
    first), in link order, then the unlinked ones in their own order."""
    by_pk = {dc.pk: dc for dc in dcs}
    order: list = []
    for link in links:
        for pk in (link.from_datacenter_id, link.to_datacenter_id):
            dc = by_pk.get(pk)
            if dc is not None and dc not in order:
                order.append(dc)
    return order + [dc for dc in dcs if dc not in order]
