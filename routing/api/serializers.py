"""Serializers of the routing API."""

from __future__ import annotations

from rest_framework import serializers

from routing.models import RequestRecord, RoutingDecision, RoutingPolicyConfig


class RoutingDecisionSerializer(serializers.ModelSerializer):
    request_id = serializers.CharField(source="request.request_id", read_only=True)

    class Meta:
        model = RoutingDecision
        fields = [
            "id",
            "request_id",
            "policy_version",
            "pipeline",
            "handoff_mode",
            "cached_tokens",
            "delta_tokens",
            "est_wan_s",
            "fallback",
            "reason",
            "inputs",
            "created_at",
        ]
        read_only_fields = fields


class RequestRecordSerializer(serializers.ModelSerializer):
    tenant_name = serializers.CharField(source="tenant.name", read_only=True)
    reason = serializers.CharField(source="decision.reason", read_only=True, default="")

    class Meta:
        model = RequestRecord
        fields = "__all__"
        read_only_fields = [f.name for f in RequestRecord._meta.fields]


class RoutingPolicySerializer(serializers.ModelSerializer):
    class Meta:
        model = RoutingPolicyConfig
        fields = ["settings", "version", "updated_at", "updated_by"]
        read_only_fields = ["version", "updated_at", "updated_by"]

    def validate_settings(self, value):
        if not isinstance(value, dict):
            raise serializers.ValidationError("Must be an object of policy settings.")
        return value
