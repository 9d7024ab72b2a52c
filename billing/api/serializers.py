"""Serializers of the billing API."""

from __future__ import annotations

from rest_framework import serializers

from billing import pricing
from billing.models import ApiKey, ModelPrice, Tenant, UsageEntry
from fleet.api.serializers import ModelCleanMixin


class TenantSerializer(serializers.ModelSerializer):
    class Meta:
        model = Tenant
        fields = [
            "id",
            "name",
            "display_name",
            "requests_per_minute",
            "tokens_per_minute",
            "active",
            "created_at",
            "updated_at",
        ]
        read_only_fields = ["created_at", "updated_at"]


class ApiKeySerializer(serializers.ModelSerializer):
    display = serializers.SerializerMethodField(help_text="How the key shows in lists.")
    active = serializers.BooleanField(source="is_active", read_only=True)

    class Meta:
        model = ApiKey
        fields = [
            "id",
            "tenant",
            "name",
            "prefix",
            "display",
            "active",
            "created_at",
            "revoked_at",
            "last_used_at",
        ]
        read_only_fields = ["prefix", "created_at", "revoked_at", "last_used_at"]

    def get_display(self, obj: ApiKey) -> str:
        return f"sk-baton-{obj.prefix}-..."


class ApiKeyCreatedSerializer(ApiKeySerializer):
    key = serializers.SerializerMethodField(
        help_text="The API key. Shown only in this response; it is stored hashed."
    )

    class Meta(ApiKeySerializer.Meta):
        fields = [*ApiKeySerializer.Meta.fields, "key"]

    def get_key(self, obj: ApiKey) -> str | None:
        return getattr(obj, "_raw_key", None)


class UsageEntrySerializer(serializers.ModelSerializer):
    class Meta:
        model = UsageEntry
        fields = [
            "id",
            "request_id",
            "tenant",
            "api_key",
            "model",
            "prompt_tokens",
            "cached_tokens",
            "completion_tokens",
            "created_at",
        ]
        read_only_fields = fields


class ModelPriceSerializer(ModelCleanMixin, serializers.ModelSerializer):
    model_name = serializers.CharField(source="served_model.name", read_only=True)
    tenant_name = serializers.CharField(source="tenant.name", read_only=True, default=None)

    class Meta:
        model = ModelPrice
        fields = [
            "id",
            "served_model",
            "model_name",
            "tenant",
            "tenant_name",
            "input_per_mtok",
            "cached_input_per_mtok",
            "output_per_mtok",
            "currency",
            "effective_from",
            "effective_to",
            "created_at",
        ]
        read_only_fields = ["created_at"]

    def create(self, validated_data):
        return pricing.model_price_save(price=ModelPrice(**validated_data))

    def update(self, instance, validated_data):
        for field, value in validated_data.items():
            setattr(instance, field, value)
        return pricing.model_price_save(price=instance)
