"""Provider cost and margin, read-only for operators and viewers (billing/costs.py,
billing/margin.py). Mounted by billing/api/urls.py: GET /api/v1/billing/costs/ and
/api/v1/billing/margin/."""

from __future__ import annotations

from datetime import UTC, datetime, time, timedelta

from django.urls import path
from django.utils import timezone
from django.utils.dateparse import parse_date, parse_datetime
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import serializers as rf
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response
from rest_framework.views import APIView

from billing.costs import fleet_cost
from billing.margin import live_bcr, margin
from billing.statements import month_start, next_month

MAX_DAYS = 366


def parse_instant(name: str, text: str | None) -> datetime | None:
    """An ISO 8601 date (midnight UTC) or date-time (naive is UTC); 400 naming `name`."""
    if text in (None, ""):
        return None
    try:
        value = parse_datetime(text)
        if value is None:
            day = parse_date(text)
            value = datetime.combine(day, time()) if day is not None else None
    except ValueError:
        value = None
    if value is None:
        raise ValidationError({name: ["Use an ISO 8601 date or date-time, e.g. 2026-02-01."]})
    if timezone.is_naive(value):
        value = value.replace(tzinfo=UTC)
    return value


def period(request) -> tuple[datetime, datetime]:
    """[start, end) from ?start=&end=; default the current calendar month (UTC)."""
    start = parse_instant("start", request.query_params.get("start"))
    end = parse_instant("end", request.query_params.get("end"))
    if start is None:
        start = month_start(end - timedelta(microseconds=1) if end else timezone.now())
    if end is None:
        end = next_month(month_start(start))
    if end <= start:
        raise ValidationError({"end": ["Must be later than start."]})
    if end - start > timedelta(days=MAX_DAYS):
        raise ValidationError({"end": [f"The period may span at most {MAX_DAYS} days."]})
    return start, end


PERIOD_PARAMS = [
    OpenApiParameter(
        "start",
        OpenApiTypes.DATETIME,
        description="Start (inclusive), ISO 8601 date or date-time; default: this month's first.",
    ),
    OpenApiParameter(
        "end",
        OpenApiTypes.DATETIME,
        description="End (exclusive); default: the first of the month after start.",
    ),
]
BAD_REQUEST = OpenApiResponse(
    response=OpenApiTypes.OBJECT,
    description="A bad `start`, `end` (or range): field name -> messages.",
)


class CostPoolSerializer(rf.Serializer):
    datacenter = rf.CharField()
    gpu_type = rf.CharField()
    currency = rf.CharField(help_text="Empty: time with no unit price in force.")
    gpu_hours = rf.DecimalField(max_digits=24, decimal_places=6)
    amount = rf.DecimalField(max_digits=20, decimal_places=2)


class CostModelSerializer(rf.Serializer):
    model = rf.CharField()
    currency = rf.CharField()
    gpu_hours = rf.DecimalField(max_digits=24, decimal_places=6)
    amount = rf.DecimalField(max_digits=20, decimal_places=2)


class CostModelDaySerializer(CostModelSerializer):
    day = rf.DateField()


class TotalSerializer(rf.Serializer):
    currency = rf.CharField()
    amount = rf.DecimalField(max_digits=20, decimal_places=2)


class CostReportSerializer(rf.Serializer):
    start = rf.DateTimeField()
    end = rf.DateTimeField()
    until = rf.DateTimeField(help_text="min(end, now): time after it is not costed yet.")
    gpu_hours = rf.DecimalField(max_digits=24, decimal_places=6)
    unpriced_gpu_hours = rf.DecimalField(max_digits=24, decimal_places=6)
    by_pool = CostPoolSerializer(many=True, help_text="Per datacenter and GPU type.")
    by_model = CostModelSerializer(many=True)
    by_model_day = CostModelDaySerializer(many=True)
    totals = TotalSerializer(many=True, help_text="Sum of the rounded by_pool lines.")


class MarginLineSerializer(rf.Serializer):
    model = rf.CharField()
    currency = rf.CharField(help_text="Empty: unpriced usage or time.")
    requests = rf.IntegerField()
    tokens = rf.IntegerField()
    revenue = rf.DecimalField(max_digits=20, decimal_places=2)
    cost = rf.DecimalField(max_digits=20, decimal_places=2)
    gpu_hours = rf.DecimalField(max_digits=24, decimal_places=6)
    margin = rf.DecimalField(max_digits=20, decimal_places=2)
    bcr = rf.DecimalField(
        max_digits=20, decimal_places=4, allow_null=True, help_text="revenue / cost."
    )


class MarginDaySerializer(MarginLineSerializer):
    day = rf.DateField()


class MarginTotalSerializer(rf.Serializer):
    currency = rf.CharField()
    revenue = rf.DecimalField(max_digits=20, decimal_places=2)
    cost = rf.DecimalField(max_digits=20, decimal_places=2)
    margin = rf.DecimalField(max_digits=20, decimal_places=2)
    bcr = rf.DecimalField(max_digits=20, decimal_places=4, allow_null=True)


class LiveBcrSerializer(rf.Serializer):
    window = rf.CharField()
    goodput_rps = rf.FloatField(allow_null=True)
    cost_per_hour = rf.FloatField(allow_null=True)
    currency = rf.CharField()
    bcr = rf.FloatField(allow_null=True, help_text="goodput req/s per fleet cost per hour.")


class MarginReportSerializer(rf.Serializer):
    start = rf.DateTimeField()
    end = rf.DateTimeField()
    model = rf.CharField(allow_null=True)
    per_model = MarginLineSerializer(many=True)
    per_day = MarginDaySerializer(many=True, help_text="Per model and UTC day.")
    totals = MarginTotalSerializer(many=True)
    unpriced_requests = rf.IntegerField()
    live = LiveBcrSerializer()


def cost_report(start: datetime, end: datetime) -> dict:
    cost = fleet_cost(start, end)
    pools = cost.by_pool()
    return {
        "start": start,
        "end": end,
        "until": cost.until,
        "gpu_hours": cost.gpu_hours,
        "unpriced_gpu_hours": cost.unpriced_gpu_hours,
        "by_pool": [line.as_dict() for line in pools],
        "by_model": [line.as_dict() for line in cost.by_model()],
        "by_model_day": [line.as_dict() for line in cost.by_model_day()],
        "totals": cost.totals(pools),
    }


def margin_report(start: datetime, end: datetime, model: str | None) -> dict:
    report = margin(start, end, model=model)
    return {
        "start": start,
        "end": end,
        "model": model,
        "per_model": report.per_model,
        "per_day": report.per_day,
        "totals": report.totals,
        "unpriced_requests": report.unpriced_requests,
        "live": live_bcr(),
    }


class CostView(APIView):
    """The fleet's provider cost over [start, end): GPU-hours of running instances x the unit
    price in force, per datacenter and GPU type, per served model and per model and day."""

    @extend_schema(
        parameters=PERIOD_PARAMS,
        responses={200: CostReportSerializer, 400: BAD_REQUEST},
        tags=["billing"],
    )
    def get(self, request):
        start, end = period(request)
        return Response(CostReportSerializer(cost_report(start, end)).data)


class MarginView(APIView):
    """Revenue (rated usage), provider cost, margin and BCR (revenue / cost) per served model
    and per model and day, with the live BCR (goodput req/s per cost per hour) beside it."""

    @extend_schema(
        parameters=[
            *PERIOD_PARAMS,
            OpenApiParameter("model", OpenApiTypes.STR, description="Only this served model."),
        ],
        responses={200: MarginReportSerializer, 400: BAD_REQUEST},
        tags=["billing"],
    )
    def get(self, request):
        start, end = period(request)
        model = request.query_params.get("model") or None
        if model is not None and len(model) > 128:
            raise ValidationError({"model": ["At most 128 characters."]})
        return Response(MarginReportSerializer(margin_report(start, end, model)).data)


urlpatterns = [
    path("billing/costs/", CostView.as_view(), name="billing-costs"),
    path("billing/margin/", MarginView.as_view(), name="billing-margin"),
]
