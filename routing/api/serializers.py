"""Serializers of the routing API."""

from __future__ import annotations

from rest_framework import serializers

from routing.models import RequestRecord, RoutingDecision, RoutingPolicyConfig


class RoutingDecisionSerializer(serializers.ModelSerializer):
    """``cached_tokens`` is the policy's estimate when it decided; ``actual_cached_tokens`` is
    what MD reserved for the request (the request record's ``cached_tokens``)."""

    request_id = serializers.CharField(source="request.request_id", read_only=True)
    prompt_tokens = serializers.IntegerField(source="request.prompt_tokens", read_only=True)
    actual_cached_tokens = serializers.IntegerField(
        source="request.cached_tokens",
        read_only=True,
        help_text="Prompt tokens MD actually held for the request (its reservation).",
    )

    class Meta:
        model = RoutingDecision
        fields = [
            "id",
            "request_id",
            "policy_version",
            "pipeline",
            "handoff_mode",
            "cached_tokens",
            "actual_cached_tokens",
            "prompt_tokens",
            "delta_tokens",
            "est_wan_s",
            "fallback",
            "reason",
            "inputs",
            "created_at",
        ]
        read_only_fields = fields


class RequestRecordSerializer(serializers.ModelSerializer):
    """``cached_tokens`` is what MD actually reserved for the request; beside it,
    ``estimated_cached_tokens`` is what the routing decision expected MD to hold (null when no
    decision was taken)."""

    tenant_name = serializers.CharField(source="tenant.name", read_only=True)
    reason = serializers.CharField(source="decision.reason", read_only=True, default="")
    estimated_cached_tokens = serializers.IntegerField(
        source="decision.cached_tokens",
        read_only=True,
        default=None,
        help_text="The routing decision's estimate of the prompt tokens MD held.",
    )

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


class CacheSummarySerializer(serializers.Serializer):
    """routing.analysis.cache_estimate_summary over the filtered request log."""

    threshold = serializers.FloatField()
    relayed = serializers.IntegerField(help_text="p-rld-md records.")
    relayed_despite_cache = serializers.IntegerField(
        help_text="p-rld-md records MD had in fact cached more than `threshold` of."
    )
    relayed_despite_cache_share = serializers.FloatField(allow_null=True)
    to_main_decode = serializers.IntegerField(help_text="p-md and p-rld-md records.")
    prompt_tokens = serializers.IntegerField()
    estimated_cached_tokens = serializers.IntegerField(help_text="Summed decision estimates.")
    actual_cached_tokens = serializers.IntegerField(help_text="Summed MD reservations.")
