"""Serializers of the fleet API: field checks here, model clean() and services for the rest."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError as DjangoValidationError
from django.db import models
from rest_framework import serializers

from fleet import services
from fleet.choices import DesiredState
from fleet.endpoints import check_agent_endpoint
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


def as_api_error(exc: DjangoValidationError) -> serializers.ValidationError:
    return serializers.ValidationError(serializers.as_serializer_error(exc))


class ModelCleanMixin:
    """Run the model's clean() on the would-be row, so API and admin enforce the same rules."""

    # Provided by the ModelSerializer the mixin is combined with.
    Meta: Any  # its Meta class: ``Meta.model`` is the model the serializer writes
    instance: models.Model | None

    def validate(self, attrs):
        attrs = super().validate(attrs)
        model = self.Meta.model
        if self.instance is not None:
            current = self._current_values()
            for field in model._meta.concrete_fields:
                if field.name in attrs and field.attname != field.name:
                    current.pop(field.attname, None)
            candidate = model(**{**current, **attrs})
            candidate.pk = self.instance.pk
        else:
            candidate = model(**attrs)
        try:
            candidate.clean()
        except DjangoValidationError as exc:
            raise as_api_error(exc) from exc
        return attrs

    def _current_values(self) -> dict:
        values = {}
        for field in self.Meta.model._meta.concrete_fields:
            if field.primary_key:
                continue
            values[field.attname] = getattr(self.instance, field.attname)
        return values


class DatacenterSerializer(serializers.ModelSerializer):
    class Meta:
        model = Datacenter
        fields = ["id", "name", "region", "rdma_domain", "description", "created_at", "updated_at"]
        read_only_fields = ["created_at", "updated_at"]


class GPUTypeSerializer(serializers.ModelSerializer):
    class Meta:
        model = GPUType
        fields = [
            "id",
            "vendor",
            "model",
            "peak_bf16_tflops",
            "memory_gib",
            "memory_bandwidth_gbps",
            "interconnect_gbps",
            "created_at",
            "updated_at",
        ]
        read_only_fields = ["created_at", "updated_at"]


class PeriodPriceSerializer(ModelCleanMixin, serializers.ModelSerializer):
    """A row of a price table (fleet.models.pricing.PeriodPrice): its fields, then the
    period's; the model's clean() checks the period and the overlaps, and ``save_price``
    writes the row through its service."""

    PERIOD_FIELDS = ["currency", "effective_from", "effective_to", "created_at"]

    class Meta:
        read_only_fields = ["created_at"]

    def save_price(self, price):
        raise NotImplementedError

    def create(self, validated_data):
        return self.save_price(self.Meta.model(**validated_data))

    def update(self, instance, validated_data):
        for field, value in validated_data.items():
            setattr(instance, field, value)
        return self.save_price(instance)


class UnitPriceSerializer(PeriodPriceSerializer):
    class Meta(PeriodPriceSerializer.Meta):
        model = UnitPrice
        fields = [
            "id",
            "gpu_type",
            "datacenter",
            "price_per_gpu_hour",
            *PeriodPriceSerializer.PERIOD_FIELDS,
        ]

    def save_price(self, price):
        return services.unit_price_save(price=price)


class WANLinkSerializer(ModelCleanMixin, serializers.ModelSerializer):
    class Meta:
        model = WANLink
        fields = [
            "id",
            "from_datacenter",
            "to_datacenter",
            "bandwidth_gbps",
            "rtt_ms",
            "connection_pool_size",
            "monthly_cost",
            "currency",
            "status",
            "kv_format",
            "created_at",
            "updated_at",
        ]
        read_only_fields = ["created_at", "updated_at"]


class ServedModelSerializer(ModelCleanMixin, serializers.ModelSerializer):
    emulated = serializers.BooleanField(
        read_only=True,
        help_text="True when the source is a model profile: served by the emulated engine.",
    )

    class Meta:
        model = ServedModel
        fields = [
            "id",
            "name",
            "source",
            "tokenizer",
            "dtype",
            "num_layers",
            "kv_bytes_per_token",
            "max_context_tokens",
            "kv_block_size",
            "emulated",
            "created_at",
            "updated_at",
        ]
        read_only_fields = ["emulated", "created_at", "updated_at"]


class NodeSerializer(serializers.ModelSerializer):
    gpus_free = serializers.SerializerMethodField(help_text="GPUs not yet given to instances.")

    class Meta:
        model = Node
        fields = [
            "id",
            "hostname",
            "datacenter",
            "gpu_type",
            "gpu_count",
            "gpus_free",
            "agent_endpoint",
            "status",
            "last_heartbeat_at",
            "agent_token_prefix",
            "created_at",
            "updated_at",
        ]
        # Status and heartbeats come from the agent, never from an operator's PATCH.
        read_only_fields = [
            "status",
            "last_heartbeat_at",
            "agent_token_prefix",
            "created_at",
            "updated_at",
        ]

    def get_gpus_free(self, obj: Node) -> int:
        return obj.gpus_free()

    def validate_agent_endpoint(self, value: str) -> str:
        """The agent endpoint policy (fleet.endpoints); stored normalised."""
        if not value:
            return value
        try:
            return check_agent_endpoint(value)
        except DjangoValidationError as exc:
            raise serializers.ValidationError(exc.messages) from None

    def create(self, validated_data):
        request = self.context.get("request")
        node, token = services.node_create(
            actor=getattr(getattr(request, "user", None), "username", ""), **validated_data
        )
        # Handed back once in the create response; only its hash is stored.
        node._agent_token = token
        return node

    def update(self, instance, validated_data):
        request = self.context.get("request")
        try:
            return services.node_update(
                node=instance,
                actor=getattr(getattr(request, "user", None), "username", ""),
                **validated_data,
            )
        except DjangoValidationError as exc:
            raise as_api_error(exc) from exc


class NodeCreatedSerializer(NodeSerializer):
    agent_token = serializers.SerializerMethodField(
        help_text="The agent's token. Shown only in this response; store it on the node now."
    )

    class Meta(NodeSerializer.Meta):
        fields = [*NodeSerializer.Meta.fields, "agent_token"]

    def get_agent_token(self, obj: Node) -> str | None:
        return getattr(obj, "_agent_token", None)


class InstanceSerializer(ModelCleanMixin, serializers.ModelSerializer):
    datacenter = serializers.IntegerField(
        source="node.datacenter_id",
        read_only=True,
        help_text="Datacenter id (from the node).",
    )

    class Meta:
        model = Instance
        fields = [
            "id",
            "role",
            "node",
            "datacenter",
            "served_model",
            "gpu_count",
            "desired_state",
            "actual_state",
            "state_changed_at",
            "created_at",
            "updated_at",
        ]
        # actual_state is what agents report; operators change desired_state only.
        read_only_fields = ["actual_state", "state_changed_at", "created_at", "updated_at"]

    def create(self, validated_data):
        request = self.context.get("request")
        try:
            return services.instance_create(
                actor=getattr(getattr(request, "user", None), "username", ""), **validated_data
            )
        except DjangoValidationError as exc:
            raise as_api_error(exc) from exc

    def update(self, instance, validated_data):
        request = self.context.get("request")
        try:
            return services.instance_update(
                instance=instance,
                actor=getattr(getattr(request, "user", None), "username", ""),
                **validated_data,
            )
        except DjangoValidationError as exc:
            raise as_api_error(exc) from exc


class DesiredStateSerializer(serializers.Serializer):
    desired_state = serializers.ChoiceField(choices=DesiredState.choices)


class FleetEventSerializer(serializers.ModelSerializer):
    class Meta:
        model = FleetEvent
        fields = ["id", "node", "instance", "kind", "message", "data", "actor", "created_at"]
        read_only_fields = fields


class TopologyDatacenterSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    name = serializers.CharField()
    region = serializers.CharField()
    rdma_domain = serializers.CharField()
    nodes = serializers.IntegerField()
    gpus = serializers.IntegerField()
    instances = serializers.DictField(child=serializers.IntegerField())
    running_instances = serializers.DictField(child=serializers.IntegerField())


class TopologyLinkSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    # "from" is a Python keyword; the field keeps the JSON name the topology uses.
    to = serializers.CharField()
    bandwidth_gbps = serializers.FloatField()
    rtt_ms = serializers.FloatField()
    connection_pool_size = serializers.IntegerField()
    status = serializers.CharField()

    def get_fields(self):
        fields = super().get_fields()
        fields["from"] = serializers.CharField()
        return fields


class TopologySerializer(serializers.Serializer):
    datacenters = TopologyDatacenterSerializer(many=True)
    links = TopologyLinkSerializer(many=True)
