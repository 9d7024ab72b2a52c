"""Routing API: the request log, the decision log, and the live policy settings."""

from __future__ import annotations

from datetime import UTC, datetime

import django_filters
from django.core.exceptions import ValidationError as DjangoValidationError
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import mixins, serializers, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response
from rest_framework.views import APIView

from base.filters import BoundedFilterSet
from routing import analysis, services
from routing.api import serializers as s
from routing.live import instance_reports
from routing.models import RequestRecord, RoutingDecision
from routing.suspects import suspect_ledger


class RequestFilterSet(BoundedFilterSet):
    since = django_filters.IsoDateTimeFilter(field_name="created_at", lookup_expr="gte")
    until = django_filters.IsoDateTimeFilter(field_name="created_at", lookup_expr="lt")
    tenant_name = django_filters.CharFilter(field_name="tenant__name")

    class Meta:
        model = RequestRecord
        fields = [
            "tenant",
            "model",
            "pipeline",
            "handoff_mode",
            "status",
            "stream",
            "request_id",
            "client_request_id",
        ]


class DecisionFilterSet(BoundedFilterSet):
    since = django_filters.IsoDateTimeFilter(field_name="created_at", lookup_expr="gte")
    request_id = django_filters.CharFilter(field_name="request__request_id")

    class Meta:
        model = RoutingDecision
        fields = ["pipeline", "handoff_mode", "fallback", "policy_version"]


class RequestRecordViewSet(
    mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet
):
    """The request log. Each record's ``cached_tokens`` (what MD reserved) stands beside
    ``estimated_cached_tokens`` (what the routing decision expected); ``summary/`` counts, over
    the same filters, the requests relayed although MD held their prefix."""

    queryset = RequestRecord.objects.select_related("tenant", "decision")
    serializer_class = s.RequestRecordSerializer
    filterset_class = RequestFilterSet
    ordering_fields = ["created_at", "ttft_s", "e2e_s"]

    @extend_schema(
        responses=s.CacheSummarySerializer,
        parameters=[
            OpenApiParameter(
                "threshold",
                float,
                description="Share of the prompt MD must have held (default 0.9).",
            )
        ],
    )
    @action(detail=False, methods=["get"], pagination_class=None)
    def summary(self, request):
        """Relayed (p-rld-md) requests whose prompt MD had in fact cached more than
        ``threshold`` of, against all relayed ones, and the estimated vs actual cached tokens
        of the requests that went to MD; the request log's filters apply."""
        raw = request.query_params.get("threshold", analysis.RELAYED_DESPITE_CACHE_THRESHOLD)
        try:
            threshold = float(raw)
            if not 0.0 <= threshold <= 1.0:
                raise ValueError
        except (TypeError, ValueError) as exc:
            raise serializers.ValidationError(
                {"threshold": "Must be a number within 0..1."}
            ) from exc
        records = self.filter_queryset(RequestRecord.objects.all())
        return Response(
            s.CacheSummarySerializer(analysis.cache_estimate_summary(records, threshold)).data
        )


class RoutingDecisionViewSet(
    mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet
):
    queryset = RoutingDecision.objects.select_related("request")
    serializer_class = s.RoutingDecisionSerializer
    filterset_class = DecisionFilterSet
    ordering_fields = ["created_at"]


class RoutingPolicyView(APIView):
    """The policy settings every gateway follows; a change reaches them within a second."""

    @extend_schema(responses=s.RoutingPolicySerializer)
    def get(self, request):
        return Response(s.RoutingPolicySerializer(services.policy_current()).data)

    @extend_schema(request=s.RoutingPolicySerializer, responses=s.RoutingPolicySerializer)
    def patch(self, request):
        body = s.RoutingPolicySerializer(data=request.data, partial=True)
        body.is_valid(raise_exception=True)
        try:
            config = services.policy_update(
                changes=body.validated_data.get("settings", {}), actor=request.user.username
            )
        except DjangoValidationError as exc:
            # Name the field inside settings, e.g. {"settings": {"catch_up_batch_tokens": [...]}}.
            raise serializers.ValidationError({"settings": exc.message_dict}) from exc
        return Response(s.RoutingPolicySerializer(config).data)

    put = patch


class SuspectInstanceSerializer(serializers.Serializer):
    instance = serializers.CharField(help_text="Instance id.")
    marked_at = serializers.DateTimeField(help_text="When it was last seen failing.")
    routed_around = serializers.BooleanField(
        help_text="True until its node reports after marked_at."
    )


class SuspectInstancesView(APIView):
    """Instances seen failing in the last minute, by a gateway or by the agent probe, newest
    first; `routed_around` while their node has not reported since (docs/faults.md)."""

    @extend_schema(responses=SuspectInstanceSerializer(many=True))
    def get(self, request):
        reported = {
            instance: float(entry.get("received_at") or 0.0)
            for (_, instance), (entry, _) in instance_reports().items()
        }
        marks = sorted(suspect_ledger().marks().items(), key=lambda kv: -kv[1])
        rows = [
            {
                "instance": instance,
                "marked_at": datetime.fromtimestamp(at, UTC),
                "routed_around": at >= reported.get(instance, 0.0),
            }
            for instance, at in marks
        ]
        return Response(SuspectInstanceSerializer(rows, many=True).data)
