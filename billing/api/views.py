"""Billing API: tenants, their API keys (create shows the key once; revoke), usage, prices."""

from __future__ import annotations

import django_filters
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from billing import services
from billing.api import serializers as s
from billing.models import ApiKey, ModelPrice, Tenant, UsageEntry
from controlplane.filters import BoundedFilterSet


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


class ModelPriceFilterSet(BoundedFilterSet):
    list_prices = django_filters.BooleanFilter(
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
