"""The plan-run API: POST queues a capacity plan over the fleet, GET lists and reads runs."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.response import Response

from plans import services, sizing
from plans.api import serializers as s
from plans.models import PlanRun, SizingRun


class PlanRunViewSet(mixins.CreateModelMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin,
                     viewsets.GenericViewSet):  # fmt: skip
    """Capacity plans over the fleet in the database. POST queues a search (operators); it runs
    as a Celery task. Without a broker (embedded default) the task runs in-process after the
    request commits, so the POST returns only when the plan is done."""

    queryset = PlanRun.objects.select_related("created_by")
    serializer_class = s.PlanRunSerializer
    ordering_fields = ["created_at", "status"]

    def get_serializer_class(self):
        if self.action == "list":
            return s.PlanRunListSerializer
        return super().get_serializer_class()

    @extend_schema(request=s.PlanRunCreateSerializer, responses={201: s.PlanRunSerializer})
    def create(self, request, *args, **kwargs):
        body = s.PlanRunCreateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        try:
            run = services.plan_run_create(**body.validated_data, created_by=request.user)
        except services.PlanInputError as exc:
            raise serializers.ValidationError({exc.field: [exc.message]}) from exc
        return Response(s.PlanRunSerializer(run).data, status=status.HTTP_201_CREATED)


class SizingRunViewSet(mixins.CreateModelMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin,
                       viewsets.GenericViewSet):  # fmt: skip
    """Sizing runs (``planner size``): the cheapest fleet meeting an SLA at a target rate, and
    the max-BCR fleet, from the scenario's fleet or the database's. POST queues one
    (operators); it runs as a Celery task. Without a broker (embedded default) the task runs
    in-process after the request commits, so the POST returns only when the run is done."""

    queryset = SizingRun.objects.select_related("created_by")
    serializer_class = s.SizingRunSerializer
    ordering_fields = ["created_at", "status"]

    def get_serializer_class(self):
        if self.action == "list":
            return s.SizingRunListSerializer
        return super().get_serializer_class()

    @extend_schema(request=s.SizingRunCreateSerializer, responses={201: s.SizingRunSerializer})
    def create(self, request, *args, **kwargs):
        body = s.SizingRunCreateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        try:
            run = sizing.sizing_run_create(**body.validated_data, created_by=request.user)
        except services.PlanInputError as exc:
            raise serializers.ValidationError({exc.field: [exc.message]}) from exc
        # On the embedded defaults the run has finished by now (after commit): read it again.
        run.refresh_from_db()
        return Response(s.SizingRunSerializer(run).data, status=status.HTTP_201_CREATED)
