"""Serializers of the plan-run API (/api/v1/plans/): counts to try in, runs and results out."""

from __future__ import annotations

from rest_framework import serializers

from plans import services
from plans.models import PlanRun


class PlanRunCreateSerializer(serializers.Serializer):
    """What to plan: node counts to try per role; the service checks the rest."""

    scenario = serializers.CharField(
        default=services.DEFAULT_SCENARIO,
        help_text="Bundled planner scenario for model, engine, workload, SLA and policy.",
    )
    prefill_counts = serializers.ListField(
        child=serializers.IntegerField(min_value=0, max_value=services.MAX_COUNT),
        allow_empty=False,
        help_text="Prefill (P) node counts to try in the WAN link's from datacenter.",
    )
    relay_counts = serializers.ListField(
        child=serializers.IntegerField(min_value=0, max_value=services.MAX_COUNT),
        allow_empty=False,
        help_text="Relay-decode (RLD) node counts to try beside prefill.",
    )
    main_counts = serializers.ListField(
        child=serializers.IntegerField(min_value=0, max_value=services.MAX_COUNT),
        allow_empty=False,
        help_text="Main-decode (MD) node counts to try in the link's to datacenter.",
    )
    top = serializers.IntegerField(
        min_value=1,
        max_value=services.MAX_TOP,
        default=5,
        help_text="How many of the best configurations to report.",
    )


class PlanRunSerializer(serializers.ModelSerializer):
    prefill_counts = serializers.ListField(source="inputs.prefill_counts", read_only=True)
    relay_counts = serializers.ListField(source="inputs.relay_counts", read_only=True)
    main_counts = serializers.ListField(source="inputs.main_counts", read_only=True)
    currency = serializers.CharField(source="inputs.currency", read_only=True)
    notes = serializers.ListField(source="inputs.notes", read_only=True)
    created_by = serializers.SerializerMethodField()

    class Meta:
        model = PlanRun
        fields = [
            "id",
            "status",
            "scenario",
            "top",
            "prefill_counts",
            "relay_counts",
            "main_counts",
            "currency",
            "progress_done",
            "progress_total",
            "results",
            "error",
            "notes",
            "created_by",
            "created_at",
            "started_at",
            "finished_at",
            "inputs",
        ]
        read_only_fields = fields

    def get_created_by(self, run: PlanRun) -> str | None:
        return run.created_by.username if run.created_by else None


class PlanRunListSerializer(PlanRunSerializer):
    """A run without its inputs (the scenario's whole fleet spec, with notes): lists stay small."""

    class Meta(PlanRunSerializer.Meta):
        fields = [f for f in PlanRunSerializer.Meta.fields if f != "inputs"]
        read_only_fields = fields
