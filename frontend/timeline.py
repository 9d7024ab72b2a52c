"""One request's timeline for its detail page, drawn from its RequestRecord and RoutingDecision.

The record holds phase durations and counts, not per-token timestamps, so the bars are placed
from them: prefill [0, prefill_s]; the KV transfer to the first decoder [prefill_s, prefill_s +
kv_wait_s] (TTFT); then the output tokens after the first at an even pace, except that in
P-RLD-MD the largest gap between two tokens (``max_gap_s``, the handoff's stall) falls between
RLD's last token and MD's first. P's first token is output token 0: it leaves with the decoding
role's stream at TTFT (at prefill_s when streamed early), so RLD + MD count one less than the
output. The WAN transfer of P-RLD-MD's KV delta to MD runs while RLD decodes; its length is the
decision's estimate (``est_wan_s``). Migrations are placed at the token they resumed from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from django.template.defaultfilters import filesizeformat

from pdd.vocab import Pipeline

WIDTH = 1000  # SVG user units
LABEL_W = 150
PLOT_W = WIDTH - LABEL_W - 20
LANE_H = 30
TOP = 28


@dataclass
class Bar:
    start: float
    end: float
    kind: str  # css class: prefill, kv-intra, kv-wan, rld, handoff, md, estimate
    text: str
    title: str


@dataclass
class Marker:
    at: float
    kind: str  # first-token, migration, retry
    text: str
    title: str


@dataclass
class Lane:
    label: str
    bars: list[Bar] = field(default_factory=list)
    markers: list[Marker] = field(default_factory=list)


def _s(v: float | None) -> str:
    if v is None:
        return "–"
    return f"{v * 1000:.0f} ms" if v < 1 else f"{v:.3f} s"


def _tick(t: float, step: float) -> str:
    if not t:
        return "0"
    if step < 1:
        return f"{t * 1000:.4g} ms"
    return f"{t:.4g} s"


def _nice_step(total: float) -> float:
    raw = total / 8
    for e in range(-4, 5):
        for m in (1, 2, 2.5, 5):
            step = m * 10**e
            if step >= raw:
                return step
    return raw


def attempts(decision) -> list[dict[str, Any]]:
    """The failed attempts before the one that finished: ``decision.inputs["retried"]``
    (routing.gateway.routes.reroute), each a retry before the first token or a migration
    (``migrated_at_token``)."""
    if decision is None or not isinstance(decision.inputs, dict):
        return []
    out = []
    for entry in decision.inputs.get("retried") or []:
        if not isinstance(entry, dict):
            continue
        at = entry.get("migrated_at_token")
        out.append(
            {
                "kind": "migration" if at is not None else "retry",
                "at_token": at,
                "pipeline": entry.get("pipeline", ""),
                "instances": ", ".join(map(str, entry.get("instances") or [])) or "–",
                "error": entry.get("error", ""),
            }
        )
    return out


def request_timeline(r, decision=None) -> dict[str, Any] | None:
    """Lanes of bars and markers with SVG coordinates, or None when the record has no timing
    (a request rejected or failed before its first token)."""
    ttft, e2e, prefill = r.ttft_s, r.e2e_s, r.prefill_s
    if ttft is None and e2e is None:
        return None
    kv_wait = r.kv_wait_s
    if prefill is None:
        prefill = ttft if kv_wait is None else max(0.0, (ttft or 0) - kv_wait)
    first_out = prefill if r.first_token_early else (ttft if ttft is not None else prefill)
    kv_end = prefill + kv_wait if kv_wait is not None else (ttft if ttft is not None else prefill)
    end = max(x for x in (e2e, ttft, kv_end, prefill) if x is not None)
    after_first = max(0, r.completion_tokens - 1)
    rld_n, md_n = r.tokens_by_rld, r.tokens_by_md
    decode_start = max(first_out, kv_end)
    stall = (r.max_gap_s or 0.0) if (rld_n and md_n) else 0.0
    span = max(0.0, end - decode_start - stall)
    pace = span / max(1, after_first - 1) if after_first > 1 else span

    lanes: list[Lane] = []
    p = Lane("P prefill")
    p.bars.append(
        Bar(
            0,
            prefill,
            "prefill",
            _s(prefill),
            f"prefill on P {r.prefill_instance or '–'}: {_s(prefill)}, {r.prompt_tokens} prompt "
            f"tokens ({r.cached_tokens} cached); P makes output token 0",
        )  # fmt: skip
    )
    lanes.append(p)

    kv_label = (
        "to RLD"
        if r.pipeline == Pipeline.P_RLD_MD
        else "to MD"
        if r.pipeline == Pipeline.P_MD
        else ""
    )
    if r.kv_bytes_intra_dc or (r.pipeline == Pipeline.P_RLD_MD and kv_wait is not None):
        lane = Lane("KV intra-DC")
        lane.bars.append(
            Bar(
                prefill,
                kv_end,
                "kv-intra",
                f"{filesizeformat(r.kv_bytes_intra_dc)} · {_s(kv_end - prefill)}",
                f"KV {kv_label} over the intra-datacenter fabric: "
                f"{filesizeformat(r.kv_bytes_intra_dc)}; KV wait {_s(kv_wait)} (export, "
                "transfer, admission)",
            )  # fmt: skip
        )
        lanes.append(lane)
    if r.kv_bytes_wan or (decision is not None and decision.est_wan_s):
        lane = Lane("KV WAN")
        if r.pipeline == Pipeline.P_RLD_MD:
            est = decision.est_wan_s if decision is not None else None
            stop = prefill + est if est else decode_start + rld_n * pace
            lane.bars.append(
                Bar(
                    prefill,
                    min(stop, end),
                    "kv-wan estimate",
                    f"{filesizeformat(r.kv_bytes_wan)} · "
                    + (f"est. {_s(est)}" if est else "before the handoff"),
                    f"KV delta to MD over the WAN while RLD decodes: "
                    f"{filesizeformat(r.kv_bytes_wan)}; "
                    + (
                        f"the decision estimated {_s(est)} (drawn from that estimate)"
                        if est
                        else "no estimate recorded (drawn up to the handoff)"
                    ),
                )  # fmt: skip
            )
        else:
            lane.bars.append(
                Bar(
                    prefill,
                    kv_end,
                    "kv-wan",
                    f"{filesizeformat(r.kv_bytes_wan)} · {_s(kv_end - prefill)}",
                    f"KV {kv_label} over the WAN: {filesizeformat(r.kv_bytes_wan)}, in the KV "
                    f"wait of {_s(kv_wait)}",
                )  # fmt: skip
            )
        lanes.append(lane)

    rld_end = decode_start + rld_n * pace
    if rld_n:
        lane = Lane("RLD decode")
        lane.bars.append(
            Bar(
                decode_start,
                min(rld_end, end),
                "rld",
                f"{rld_n} tokens",
                f"RLD {r.relay_instance or '–'} decodes {rld_n} tokens after P's first",
            )
        )
        lanes.append(lane)
    if rld_n and md_n:
        lane = Lane("handoff")
        at = f" at token {r.handoff_at_token}" if r.handoff_at_token is not None else ""
        lane.bars.append(
            Bar(
                rld_end,
                min(rld_end + stall, end),
                "handoff",
                f"{r.get_handoff_mode_display() or 'handoff'}{at} · {r.handoff_batches} "
                f"{'batch' if r.handoff_batches == 1 else 'batches'} · stall {_s(stall)}",
                f"RLD hands the tokens to MD ({r.handoff_batches} batches, "
                f"{filesizeformat(r.handoff_bytes)} of token ids); MD took over{at}; the "
                f"largest gap between two tokens was {_s(r.max_gap_s)}",
            )  # fmt: skip
        )
        lanes.append(lane)
    if md_n:
        lane = Lane("MD decode")
        md_start = rld_end + stall if rld_n else decode_start
        lane.bars.append(
            Bar(
                min(md_start, end),
                end,
                "md",
                f"{md_n} tokens",
                f"MD {r.main_instance or '–'} decodes {md_n} tokens",
            )
        )
        lanes.append(lane)

    out = Lane("to the user")
    out.markers.append(
        Marker(
            first_out,
            "first-token",
            f"first token {_s(first_out)}",
            "P's token reaches the user"
            + (
                " (streamed early, at prefill's end)"
                if r.first_token_early
                else " with the decoding role's stream (TTFT)"
            ),
        )  # fmt: skip
    )
    if e2e is not None:
        out.markers.append(
            Marker(
                e2e, "done", f"done {_s(e2e)}", f"last of {r.completion_tokens} output tokens (E2E)"
            )
        )
    lanes.append(out)

    tried = attempts(decision)
    if tried:
        lane = Lane("retries")
        for a in tried:
            if a["kind"] == "migration":
                t = decode_start + max(0, (a["at_token"] or 0) - 1) * pace
                text = f"migrated at token {a['at_token']}"
            else:
                t = 0.0
                text = "retried before the first token"
            lane.markers.append(
                Marker(
                    min(t, end),
                    a["kind"],
                    text,
                    f"{a['pipeline']} via {a['instances']} failed: {a['error']}",
                )
            )
        lanes.append(lane)

    # SVG coordinates
    scale = PLOT_W / end if end > 0 else 0.0

    def x(t: float) -> float:
        return round(LABEL_W + max(0.0, min(t, end)) * scale, 1)

    drawn = []
    for i, lane in enumerate(lanes):
        y = TOP + i * LANE_H
        bars = []
        for b in lane.bars:
            x1, x2 = x(b.start), x(b.end)
            w = max(2.0, round(x2 - x1, 1))
            inside = w > 7 * len(b.text)
            tx = x1 + 6 if inside else min(x1 + w + 6, WIDTH - 4)
            anchor = "end" if not inside and tx > WIDTH - 200 else "start"
            if anchor == "end":
                tx = x1 - 6
            bars.append({"x": x1, "w": w, "kind": b.kind, "text": b.text, "title": b.title,
                         "tx": round(tx, 1), "anchor": anchor, "inside": inside})  # fmt: skip
        markers = []
        for m in lane.markers:
            mx = x(m.at)
            anchor = "end" if mx > WIDTH - 200 else "start"
            tx = mx - 6 if anchor == "end" else mx + 6
            markers.append(
                {
                    "x": mx,
                    "kind": m.kind,
                    "text": m.text,
                    "title": m.title,
                    "tx": tx,
                    "anchor": anchor,
                }
            )
        drawn.append({"label": lane.label, "y": y, "bars": bars, "markers": markers})
    step = _nice_step(end) if end > 0 else 1
    ticks: list[dict[str, Any]] = []
    t = 0.0
    while t <= end * 1.0001 and len(ticks) < 20:
        ticks.append({"x": x(t), "text": _tick(t, step)})
        t += step
    height = TOP + len(lanes) * LANE_H + 10
    return {
        "lanes": drawn,
        "ticks": ticks,
        "width": WIDTH,
        "height": height,
        "plot_left": LABEL_W,
        "plot_right": LABEL_W + PLOT_W,
        "axis_bottom": height - 6,
        "total_s": end,
        "estimated": bool(after_first > 1),
    }
