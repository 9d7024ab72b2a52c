"""Billing API: tenants, their API keys (create shows the key once; revoke), usage, the price
book, and statements (JSON with lines, or CSV)."""

from __future__ import annotations

import django_filters
from django import forms
from django.core.validators import RegexValidator
from django.http import HttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import (
    OpenApiParameter,
    OpenApiResponse,
    extend_schema,
    inline_serializer,
)
from rest_framework import mixins, viewsets
from rest_framework import serializers as rf
from rest_framework.decorators import action
from rest_framework.response import Response

from base.filters import INT64_MAX, BoundedFilterSet
from billing import services, statements
from billing.api import serializers as s
from billing.models import ApiKey, ModelPrice, Statement, Tenant, UsageEntry


class TenantViewSet(viewsets.ModelViewSet):
    queryset = Tenant.objects.all()
    serializer_class = s.TenantSerializer
    filterset_fields = ["name", "active"]
    search_fields = ["name", "display_name"]
    ordering_fields = ["name", "created_at"]

    def perform_destroy(self, instance):
        from django.db.models import ProtectedError
        from rest_framework import serializers

        try:
            instance.delete()
        except ProtectedError as exc:
            raise serializers.ValidationError(
                {"detail": "The tenant has usage on record; deactivate it instead (active=false)."}
            ) from exc


class ApiKeyViewSet(
    mixins.CreateModelMixin,
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    viewsets.GenericViewSet,
):
    queryset = ApiKey.objects.select_related("tenant")
    serializer_class = s.ApiKeySerializer
    filterset_fields = ["tenant", "prefix"]

    def get_serializer_class(self):
        return s.ApiKeyCreatedSerializer if self.action == "create" else s.ApiKeySerializer

    def perform_create(self, serializer):
        key, raw = services.api_key_create(
            tenant=serializer.validated_data["tenant"],
            name=serializer.validated_data.get("name", ""),
        )
        key._raw_key = raw
        serializer.instance = key

    @extend_schema(request=None, responses=s.ApiKeySerializer)
    @action(detail=True, methods=["post"])
    def revoke(self, request, pk=None):
        """Revoke the key: requests with it are refused from now on."""
        key = services.api_key_revoke(key=self.get_object())
        return Response(s.ApiKeySerializer(key).data)


class UsageFilterSet(BoundedFilterSet):
    since = django_filters.IsoDateTimeFilter(field_name="created_at", lookup_expr="gte")
    until = django_filters.IsoDateTimeFilter(field_name="created_at", lookup_expr="lt")

    class Meta:
        model = UsageEntry
        fields = ["tenant", "model", "request_id"]


class UsageEntryViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    queryset = UsageEntry.objects.all()
    serializer_class = s.UsageEntrySerializer
    filterset_class = UsageFilterSet
    ordering_fields = ["created_at"]


class StrictBooleanField(forms.NullBooleanField):
    """true/false/1/0 (any case) or empty; anything else is an error naming the parameter
    (forms.NullBooleanField reads an unknown word as "not given" and filters nothing)."""

    TRUE, FALSE = {"true", "1"}, {"false", "0"}
    widget = forms.TextInput  # the raw text (NullBooleanSelect maps unknown words to None)

    def to_python(self, value):
        if value in (None, ""):
            return None
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in self.TRUE:
            return True
        if text in self.FALSE:
            return False
        raise forms.ValidationError("Use true or false.", code="invalid")

    def validate(self, value):
        pass


class StrictBooleanFilter(django_filters.BooleanFilter):
    field_class = StrictBooleanField


class ModelPriceFilterSet(BoundedFilterSet):
    list_prices = StrictBooleanFilter(
        field_name="tenant", lookup_expr="isnull", label="Only list prices (no tenant)."
    )
    effective_at = django_filters.IsoDateTimeFilter(
        method="filter_effective_at", label="Only prices in force at this instant."
    )

    class Meta:
        model = ModelPrice
        fields = ["served_model", "tenant", "currency"]

    def filter_effective_at(self, queryset, name, value):
        return queryset.effective_at(value)


class ModelPriceViewSet(viewsets.ModelViewSet):
    """The price book: list prices (no tenant) and tenants' contract prices per served model."""

    queryset = ModelPrice.objects.select_related("served_model", "tenant")
    serializer_class = s.ModelPriceSerializer
    filterset_class = ModelPriceFilterSet
    ordering_fields = ["effective_from", "created_at"]

    def perform_destroy(self, instance):
        from django.db.models import ProtectedError
        from rest_framework import serializers

        try:
            instance.delete()
        except ProtectedError as exc:
            raise serializers.ValidationError(
                {"detail": "The price is on a statement; end its period (effective_to) instead."}
            ) from exc


class MonthFilter(django_filters.CharFilter):
    field_class = forms.CharField

    def __init__(self, *args, **kwargs):
        kwargs.setdefault(
            "validators",
            [RegexValidator(statements.MONTH_RE, "Use YYYY-MM, e.g. 2026-01.")],
        )
        super().__init__(*args, **kwargs)

    def filter(self, qs, value):
        if not value:
            return qs
        start, _ = statements.parse_month(value)
        return qs.filter(period_start=start)


class StatementFilterSet(BoundedFilterSet):
    period = MonthFilter(label="The calendar month, YYYY-MM (UTC).")
    since = django_filters.IsoDateTimeFilter(field_name="period_start", lookup_expr="gte")
    until = django_filters.IsoDateTimeFilter(field_name="period_end", lookup_expr="lte")

    class Meta:
        model = Statement
        fields = ["tenant", "status"]


class StatementViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Monthly statements per tenant: open ones are re-rated as usage arrives (every few
    minutes, by billing.close_statements); closed ones are final."""

    queryset = Statement.objects.select_related("tenant").prefetch_related("lines")
    filterset_class = StatementFilterSet
    ordering_fields = ["period_start", "created_at"]

    def get_serializer_class(self):
        return s.StatementSummarySerializer if self.action == "list" else s.StatementSerializer

    @extend_schema(
        responses={(200, "text/csv"): OpenApiResponse(OpenApiTypes.STR, description="CSV")}
    )
    @action(detail=True, methods=["get"])
    def csv(self, request, pk=None):
        """The statement as CSV: its lines, then one total row per currency."""
        statement = self.get_object()
        body = s.statement_csv(s.StatementSerializer(statement).data)
        response = HttpResponse(body, content_type="text/csv; charset=utf-8")
        name = f"statement-{statement.tenant.name}-{statement.period_start:%Y-%m}.csv"
        response["Content-Disposition"] = f'attachment; filename="{name}"'
        return response

    def _range(self, request) -> statements.Preview:
        from rest_framework.exceptions import ValidationError

        from billing.api.finance import period

        raw = request.query_params.get("tenant", "")
        tenant = None
        if raw.isdigit() and int(raw) <= INT64_MAX:
            tenant = Tenant.objects.filter(pk=int(raw)).first()
        if tenant is None:
            raise ValidationError({"tenant": ["Give the id of an existing tenant."]})
        start, end = period(request)
        return statements.preview(tenant=tenant, start=start, end=end)

    RANGE_PARAMS = [
        OpenApiParameter("tenant", OpenApiTypes.INT, required=True, description="Tenant id."),
        OpenApiParameter(
            "start",
            OpenApiTypes.DATETIME,
            description="Start (inclusive), ISO 8601 date or date-time; default: this month's.",
        ),
        OpenApiParameter(
            "end",
            OpenApiTypes.DATETIME,
            description="End (exclusive); default: the first of the month after start.",
        ),
    ]

    @extend_schema(
        parameters=RANGE_PARAMS,
        responses={
            200: s.StatementSerializer,
            400: OpenApiResponse(OpenApiTypes.OBJECT, description="Parameter -> messages."),
        },
    )
    @action(detail=False, methods=["get"], url_path="range", filter_backends=[])
    def range(self, request):
        """A tenant's statement for any [start, end) (at most 366 days), worked out from the
        ledger by request time: the same lines, unit prices, amounts and totals as a monthly
        statement, with status ``preview`` and no id (not stored, never closed)."""
        return Response(s.StatementSerializer(self._range(request)).data)

    @extend_schema(
        parameters=RANGE_PARAMS,
        responses={
            (200, "text/csv"): OpenApiResponse(OpenApiTypes.STR, description="CSV"),
            400: OpenApiResponse(OpenApiTypes.OBJECT, description="Parameter -> messages."),
        },
    )
    @action(
        detail=False,
        methods=["get"],
        url_path="range/csv",
        url_name="range-csv",
        filter_backends=[],
    )
    def range_csv(self, request):
        """The statement of `range` as CSV (an attachment)."""
        statement = self._range(request)
        body = s.statement_csv(s.StatementSerializer(statement).data)
        response = HttpResponse(body, content_type="text/csv; charset=utf-8")
        name = (
            f"statement-{statement.tenant.name}-{statement.period_start:%Y%m%dT%H%M}-"
            f"{statement.period_end:%Y%m%dT%H%M}.csv"
        )
        response["Content-Disposition"] = f'attachment; filename="{name}"'
        return response

    @extend_schema(
        request=None,
        responses=inline_serializer("RatePendingResult", {"assigned": rf.IntegerField()}),
    )
    @action(detail=False, methods=["post"])
    def rate(self, request):
        """Create the statements new usage needs and re-rate the open statements that changed
        (new usage or a price change) now; the periodic task does the same every few minutes.
        ``assigned``: how many entries joined statements."""
        assigned = statements.rate_pending()
        return Response({"assigned": assigned})
