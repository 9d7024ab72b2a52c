"""Serializers of the billing API."""

from __future__ import annotations

import csv
import io

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from billing import pricing, statements
from billing.models import ApiKey, ModelPrice, StatementLine, Tenant, UsageEntry
from fleet.api.serializers import PeriodPriceSerializer


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
        return obj.masked()


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


class ModelPriceSerializer(PeriodPriceSerializer):
    model_name = serializers.CharField(source="served_model.name", read_only=True)
    tenant_name = serializers.CharField(source="tenant.name", read_only=True, default=None)

    class Meta(PeriodPriceSerializer.Meta):
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
            *PeriodPriceSerializer.PERIOD_FIELDS,
        ]

    def save_price(self, price):
        return pricing.model_price_save(price=price)


def _full(value):
    return serializers.DecimalField(max_digits=30, decimal_places=12).to_representation(value)


class StatementLineSerializer(serializers.ModelSerializer):
    kind = serializers.SerializerMethodField(help_text="usage, or adjustment (late usage).")
    input_amount = serializers.SerializerMethodField(help_text="Full precision.")
    cached_amount = serializers.SerializerMethodField(help_text="Full precision.")
    output_amount = serializers.SerializerMethodField(help_text="Full precision.")

    class Meta:
        model = StatementLine
        fields = [
            "kind",
            "model",
            "price",
            "contract",
            "requests",
            "input_tokens",
            "cached_tokens",
            "output_tokens",
            "currency",
            "input_per_mtok",
            "cached_input_per_mtok",
            "output_per_mtok",
            "input_amount",
            "cached_amount",
            "output_amount",
            "amount",
        ]
        read_only_fields = fields

    def get_kind(self, obj) -> str:
        return "adjustment" if obj.adjustment else "usage"

    @extend_schema_field(serializers.DecimalField(max_digits=30, decimal_places=12))
    def get_input_amount(self, obj) -> str:
        return _full(obj.input_amount)

    @extend_schema_field(serializers.DecimalField(max_digits=30, decimal_places=12))
    def get_cached_amount(self, obj) -> str:
        return _full(obj.cached_amount)

    @extend_schema_field(serializers.DecimalField(max_digits=30, decimal_places=12))
    def get_output_amount(self, obj) -> str:
        return _full(obj.output_amount)


class StatementTotalSerializer(serializers.Serializer):
    currency = serializers.CharField()
    amount = serializers.DecimalField(max_digits=20, decimal_places=2)


class StatementSummarySerializer(serializers.Serializer):
    """A statement without its lines (lists); works for stored ones and previews alike."""

    id = serializers.IntegerField(allow_null=True, read_only=True)
    tenant = serializers.IntegerField(source="tenant_id", read_only=True)
    tenant_name = serializers.CharField(source="tenant.name", read_only=True)
    period_start = serializers.DateTimeField(read_only=True)
    period_end = serializers.DateTimeField(read_only=True)
    status = serializers.CharField(read_only=True, help_text="open, closed, or preview.")
    rated_at = serializers.DateTimeField(read_only=True, allow_null=True)
    closed_at = serializers.DateTimeField(read_only=True, allow_null=True)
    totals = serializers.SerializerMethodField(help_text="Sum of the line amounts per currency.")

    @extend_schema_field(StatementTotalSerializer(many=True))
    def get_totals(self, obj) -> list:
        return StatementTotalSerializer(statements.totals(statements.lines_of(obj)), many=True).data


class StatementSerializer(StatementSummarySerializer):
    lines = serializers.SerializerMethodField()

    @extend_schema_field(StatementLineSerializer(many=True))
    def get_lines(self, obj) -> list:
        return StatementLineSerializer(statements.lines_of(obj), many=True).data


CSV_HEAD = ["statement", "tenant", "period_start", "period_end", "status"]
CSV_LINE = StatementLineSerializer.Meta.fields


def statement_csv(document: dict) -> str:
    """The statement document (StatementSerializer's data) as CSV: one row per line, then one
    'total' row per currency; the values are the JSON's, character for character."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_HEAD + CSV_LINE)
    head = [
        document["id"] if document["id"] is not None else "",
        document["tenant_name"],
        document["period_start"],
        document["period_end"],
        document["status"],
    ]

    def cell(value):
        if value is None:
            return ""
        if isinstance(value, bool):
            return "true" if value else "false"
        return value

    for line in document["lines"]:
        writer.writerow(head + [cell(line[name]) for name in CSV_LINE])
    for total in document["totals"]:
        row = dict.fromkeys(CSV_LINE, "")
        row.update(kind="total", currency=total["currency"], amount=total["amount"])
        writer.writerow(head + [row[name] for name in CSV_LINE])
    return out.getvalue()
