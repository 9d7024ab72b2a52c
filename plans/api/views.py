"""The plan-run API: POST queues a capacity plan over the fleet, GET lists and reads runs."""

from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response
from rest_framework.views import APIView

from fleet.events import event_record
from plans import autopilot, services, sizing
from plans.api import serializers as s
from plans.models import PlanRun, Proposal, SizingRun


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


# --- the autopilot ---------------------------------------------------------------------------


class AutopilotProfileView(APIView):
    """The live workload profile the autopilot sizes for (plans/profile.py): rates and a
    forecast, hit-rate, prompt and output length distributions, singular share, WAN throughput,
    over the settings' window of the sized served model's request records."""

    @extend_schema(responses={200: OpenApiTypes.OBJECT})
    def get(self, request):
        return Response(autopilot.live_profile())


class AutopilotSettingsView(APIView):
    """The autopilot's settings; operators change them (PATCH)."""

    @extend_schema(responses=s.AutopilotSettingsSerializer)
    def get(self, request):
        return Response(s.AutopilotSettingsSerializer(autopilot.settings_get()).data)

    @extend_schema(request=s.AutopilotSettingsSerializer, responses=s.AutopilotSettingsSerializer)
    def patch(self, request):
        row = autopilot.settings_get()
        body = s.AutopilotSettingsSerializer(row, data=request.data, partial=True)
        body.is_valid(raise_exception=True)
        body.save()
        event_record(
            kind="autopilot.settings",
            message=f"Autopilot settings changed by {request.user.username}: "
            + ", ".join(sorted(body.validated_data))
            + ".",
            data={"changes": {k: str(v) for k, v in body.validated_data.items()}},
            actor=request.user.username,
        )
        return Response(s.AutopilotSettingsSerializer(row).data)

    put = patch


class ProposalViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """The autopilot's proposals, newest first. POST asks for one now (operators; sized by a
    Celery task, in-process on the embedded defaults); approve / reject decide a proposed one:
    approving one whose fleet changed since it was made answers 409 (stale)."""

    queryset = Proposal.objects.prefetch_related("steps")
    serializer_class = s.ProposalSerializer
    ordering_fields = ["created_at", "status"]
    filterset_fields = ["status"]

    def get_serializer_class(self):
        if self.action == "list":
            return s.ProposalListSerializer
        return super().get_serializer_class()

    @extend_schema(request=None, responses={201: s.ProposalSerializer})
    def create(self, request, *args, **kwargs):
        try:
            proposal = autopilot.proposal_create(trigger="manual", actor=request.user.username)
        except services.PlanInputError as exc:
            raise serializers.ValidationError({exc.field: [exc.message]}) from exc
        proposal.refresh_from_db()
        return Response(s.ProposalSerializer(proposal).data, status=status.HTTP_201_CREATED)

    def _decide(self, request, approve: bool):
        proposal = self.get_object()
        try:
            decided = autopilot.proposal_decide(
                proposal=proposal, approve=approve, actor=request.user.username
            )
        except autopilot.ProposalRefused as exc:
            return Response(
                {"detail": exc.message, "code": "stale" if exc.stale else "not_proposed"},
                status=status.HTTP_409_CONFLICT,
            )
        decided.refresh_from_db()
        return Response(s.ProposalSerializer(decided).data)

    @extend_schema(request=None, responses={200: s.ProposalSerializer})
    @action(detail=True, methods=["post"])
    def approve(self, request, pk=None):
        return self._decide(request, True)

    @extend_schema(request=None, responses={200: s.ProposalSerializer})
    @action(detail=True, methods=["post"])
    def reject(self, request, pk=None):
        return self._decide(request, False)
