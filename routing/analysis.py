"""Read-side figures of the request log: how the policy's cache estimate compared with what MD
actually held.

A routing decision's ``cached_tokens`` (RoutingDecision) is the policy's estimate at decision
time: the prefix of the prompt MD was believed to hold (its heartbeat's radix cache and KV in
flight, plus what the gateways had dispatched to it since). The request record's
``cached_tokens`` (RequestRecord) is what MD actually reserved for the request (its DRC hit,
counting KV in flight). Both are kept; nothing here is stored.
"""

from __future__ import annotations

from django.db.models import Count, ExpressionWrapper, F, FloatField, QuerySet, Sum, Value

from routing.choices import PipelineChoice
from routing.models import RequestRecord

RELAYED_DESPITE_CACHE_THRESHOLD = 0.9


def relayed_despite_cache(
    queryset: QuerySet[RequestRecord] | None = None,
    threshold: float = RELAYED_DESPITE_CACHE_THRESHOLD,
) -> tuple[int, int]:
    """``(count, total_relayed)``: among the p-rld-md records of ``queryset`` (all records by
    default), how many MD had in fact cached more than ``threshold`` of the prompt when their KV
    was reserved (actual ``cached_tokens`` > threshold x ``prompt_tokens``), and how many
    p-rld-md records there are. Such a request was relayed although MD held its prefix: the
    policy's view of MD's cache was behind. Every status counts; filter ``queryset`` first for
    completed requests only."""
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"threshold must be within 0..1, got {threshold}")
    qs = RequestRecord.objects.all() if queryset is None else queryset
    relayed = qs.filter(pipeline=PipelineChoice.P_RLD_MD)
    total = relayed.count()
    held = (
        relayed.filter(prompt_tokens__gt=0)
        .annotate(
            _bar=ExpressionWrapper(
                F("prompt_tokens") * Value(float(threshold)), output_field=FloatField()
            )
        )
        .filter(cached_tokens__gt=F("_bar"))
        .count()
    )
    return held, total


def cache_estimate_summary(
    queryset: QuerySet[RequestRecord] | None = None,
    threshold: float = RELAYED_DESPITE_CACHE_THRESHOLD,
) -> dict[str, object]:
    """The request log's cache figures, for the API's summary and ``manage.py routing_report``:
    the relayed-although-cached count and share, and the summed estimated (decision) and actual
    (MD's reservation) cached tokens over the records that went to MD (p-md, p-rld-md)."""
    qs = RequestRecord.objects.all() if queryset is None else queryset
    count, total = relayed_despite_cache(qs, threshold)
    to_md = qs.filter(
        pipeline__in=(PipelineChoice.P_MD, PipelineChoice.P_RLD_MD), decision__isnull=False
    )
    sums = to_md.aggregate(
        records=Count("id"),
        prompt=Sum("prompt_tokens"),
        estimated=Sum("decision__cached_tokens"),
        actual=Sum("cached_tokens"),
    )
    return {
        "threshold": threshold,
        "relayed": total,
        "relayed_despite_cache": count,
        "relayed_despite_cache_share": round(count / total, 4) if total else None,
        "to_main_decode": sums["records"],
        "prompt_tokens": sums["prompt"] or 0,
        "estimated_cached_tokens": sums["estimated"] or 0,
        "actual_cached_tokens": sums["actual"] or 0,
    }
