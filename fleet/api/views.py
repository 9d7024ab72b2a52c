"""Fleet API views: CRUD viewsets over querysets, commands as actions calling services."""

from __future__ import annotations

from django.core.exceptions import ValidationError as DjangoValidationError
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response
from rest_framework.views import APIView

from fleet import services
from fleet.api import serializers as s
from fleet.filtersets import (
    DatacenterFilterSet,
    FleetEventFilterSet,
    GPUTypeFilterSet,
    InstanceFilterSet,
    NodeFilterSet,
    ServedModelFilterSet,
    UnitPriceFilterSet,
    WANLinkFilterSet,
)
from fleet.models import (
    Datacenter,
    FleetEvent,
    GPUType,
    Instance,
    Node,
    ServedModel,
    UnitPrice,
    WANLink,
)


def _actor(request) -> str:
    return getattr(request.user, "username", "") or ""


class ProtectedDestroyMixin:
    """Deleting a row others still point at is a 400 with the reason, not a 500."""

    def perform_destroy(self, instance):
        from django.db.models import ProtectedError

        try:
            instance.delete()
        except ProtectedError as exc:
            names = sorted({type(obj).__name__ for obj in exc.protected_objects})
            raise serializers.ValidationError(
                {"detail": f"Still in use by: {', '.join(names)}. Delete or move those first."}
            ) from exc


class DatacenterViewSet(ProtectedDestroyMixin, viewsets.ModelViewSet):
    queryset = Datacenter.objects.all()
    serializer_class = s.DatacenterSerializer
    filterset_class = DatacenterFilterSet
    search_fields = ["name", "region"]
    ordering_fields = ["name", "region", "created_at"]


class GPUTypeViewSet(ProtectedDestroyMixin, viewsets.ModelViewSet):
    queryset = GPUType.objects.all()
    serializer_class = s.GPUTypeSerializer
    filterset_class = GPUTypeFilterSet
    search_fields = ["vendor", "model"]
    ordering_fields = ["vendor", "model", "peak_bf16_tflops", "memory_bandwidth_gbps"]


class UnitPriceViewSet(viewsets.ModelViewSet):
    queryset = UnitPrice.objects.select_related("gpu_type", "datacenter")
    serializer_class = s.UnitPriceSerializer
    filterset_class = UnitPriceFilterSet
    ordering_fields = ["effective_from", "price_per_gpu_hour"]


class WANLinkViewSet(viewsets.ModelViewSet):
    queryset = WANLink.objects.select_related("from_datacenter", "to_datacenter")
    serializer_class = s.WANLinkSerializer
    filterset_class = WANLinkFilterSet
    ordering_fields = ["bandwidth_gbps", "rtt_ms", "status"]


class ServedModelViewSet(ProtectedDestroyMixin, viewsets.ModelViewSet):
    queryset = ServedModel.objects.all()
    serializer_class = s.ServedModelSerializer
    filterset_class = ServedModelFilterSet
    search_fields = ["name"]
    ordering_fields = ["name", "kv_bytes_per_token"]


class NodeViewSet(ProtectedDestroyMixin, viewsets.ModelViewSet):
    queryset = Node.objects.select_related("datacenter", "gpu_type")
    serializer_class = s.NodeSerializer
    filterset_class = NodeFilterSet
    search_fields = ["hostname"]
    ordering_fields = ["hostname", "status", "last_heartbeat_at"]

    def get_serializer_class(self):
        if self.action == "create":
            return s.NodeCreatedSerializer
        return super().get_serializer_class()

    @extend_schema(request=None, responses=s.NodeCreatedSerializer)
    @action(detail=True, methods=["post"], url_path="rotate-token")
    def rotate_token(self, request, pk=None):
        """Issue a new agent token for the node; the old one stops working at once."""
        node = self.get_object()
        token = services.node_rotate_token(node=node, actor=_actor(request))
        node.refresh_from_db()
        node._agent_token = token
        return Response(s.NodeCreatedSerializer(node, context={"request": request}).data)

    @extend_schema(responses=s.FleetEventSerializer(many=True))
    @action(detail=True, methods=["get"])
    def events(self, request, pk=None):
        """The node's event history, newest first."""
        node = self.get_object()
        page = self.paginate_queryset(FleetEvent.objects.filter(node=node))
        return self.get_paginated_response(s.FleetEventSerializer(page, many=True).data)


class InstanceViewSet(viewsets.ModelViewSet):
    queryset = Instance.objects.select_related("node__datacenter", "served_model")
    serializer_class = s.InstanceSerializer
    filterset_class = InstanceFilterSet
    ordering_fields = ["role", "actual_state", "created_at"]

    def perform_destroy(self, instance):
        try:
            services.instance_delete(instance=instance, actor=_actor(self.request))
        except DjangoValidationError as exc:
            raise s.as_api_error(exc) from exc

    def _set_desired(self, request, desired_state: str):
        instance = self.get_object()
        try:
            instance = services.instance_set_desired_state(
                instance=instance, desired_state=desired_state, actor=_actor(request)
            )
        except DjangoValidationError as exc:
            raise s.as_api_error(exc) from exc
        return Response(self.get_serializer(instance).data)

    @extend_schema(request=None, responses=s.InstanceSerializer)
    @action(detail=True, methods=["post"])
    def start(self, request, pk=None):
        """Ask for the instance to run."""
        return self._set_desired(request, "running")

    @extend_schema(request=None, responses=s.InstanceSerializer)
    @action(detail=True, methods=["post"])
    def drain(self, request, pk=None):
        """Stop sending new work to the instance; in-flight requests finish."""
        return self._set_desired(request, "drained")

    @extend_schema(request=None, responses=s.InstanceSerializer)
    @action(detail=True, methods=["post"])
    def stop(self, request, pk=None):
        """Ask for the instance to stop."""
        return self._set_desired(request, "stopped")

    @extend_schema(responses=s.FleetEventSerializer(many=True))
    @action(detail=True, methods=["get"])
    def events(self, request, pk=None):
        """The instance's event history, newest first."""
        instance = self.get_object()
        page = self.paginate_queryset(FleetEvent.objects.filter(instance=instance))
        return self.get_paginated_response(s.FleetEventSerializer(page, many=True).data)


class FleetEventViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    queryset = FleetEvent.objects.all()
    serializer_class = s.FleetEventSerializer
    filterset_class = FleetEventFilterSet
    ordering_fields = ["created_at"]


class TopologyView(APIView):
    """Datacenters, WAN links and instance counts per role, in one call."""

    @extend_schema(responses=s.TopologySerializer)
    def get(self, request):
        return Response(services.topology_snapshot(), status=status.HTTP_200_OK)
