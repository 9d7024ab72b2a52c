"""Serializers of the plan-run API (/api/v1/plans/): counts to try in, runs and results out."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from plans import services, sizing
from plans.models import PlanRun, SizingRun


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


# --- sizing runs (/api/v1/plans/sizing/) -------------------------------------------------------


# An object until the run is done, null before (the schema says so: responses validate).
NULLABLE_OBJECT = serializers.DictField(allow_null=True)


class SizingRunCreateSerializer(serializers.Serializer):
    """What to size: a scenario, the target rate and SLA (each empty: the scenario's)."""

    scenario = serializers.CharField(
        default=sizing.DEFAULT_SIZE_SCENARIO,
        help_text="Bundled planner scenario: model, engine, workload, SLA, policy and (unless "
        "from_db) the starting fleet. tiny-size finishes in seconds.",
    )
    rps = serializers.FloatField(
        required=False,
        allow_null=True,
        min_value=0.001,
        max_value=sizing.MAX_RPS,
        help_text="Target rate, requests/s (default: the scenario's).",
    )
    p90 = serializers.FloatField(
        required=False,
        allow_null=True,
        min_value=0.001,
        max_value=sizing.MAX_SLA_S,
        help_text="SLA: P90 TTFT below this many seconds (default: the scenario's).",
    )
    p99 = serializers.FloatField(
        required=False,
        allow_null=True,
        min_value=0.001,
        max_value=sizing.MAX_SLA_S,
        help_text="SLA: P99 TTFT below this many seconds (default: the scenario's).",
    )
    from_db = serializers.BooleanField(
        default=False,
        help_text="Start from the fleet in the database (GPU types, unit prices, WAN link; "
        "counts = nodes now running each role) instead of the scenario's pools.",
    )


class SizingRunSerializer(serializers.ModelSerializer):
    """A sizing run with its answer; ``result`` is planner.size's whole output."""

    cheapest = serializers.SerializerMethodField(
        help_text="The cheapest fleet meeting the SLA at the rate: found, counts per "
        "'role@datacenter:gpu', cost_per_hour, its figures (at), one_fewer, binding, "
        "local_minimum (null until done)."
    )
    max_bcr = serializers.SerializerMethodField(
        help_text="The best-BCR fleet (best) among the cheapest at the scanned multiples of "
        "the rate (candidates): counts, goodput_rps, cost_per_hour, bcr (null until done)."
    )
    band = serializers.SerializerMethodField(
        help_text="The cheapest fleet's figures over +-5% rate, +-5% fitted constants and "
        "other seeds, and whether it sits on a cliff (null until done or if none found)."
    )
    unit_prices = serializers.SerializerMethodField(
        help_text="Price per unit-hour of each GPU type in the fleet (null until done)."
    )
    sla = serializers.SerializerMethodField(help_text="The SLA sized for (null until done).")
    from_db = serializers.BooleanField(
        source="start_from_db",
        read_only=True,
        help_text="Whether the search started from the fleet in the database.",
    )
    notes = serializers.SerializerMethodField()
    created_by = serializers.SerializerMethodField()

    class Meta:
        model = SizingRun
        fields = [
            "id",
            "status",
            "scenario",
            "rps",
            "p90",
            "p99",
            "from_db",
            "progress_done",
            "progress_total",
            "progress_note",
            "cheapest",
            "max_bcr",
            "band",
            "unit_prices",
            "sla",
            "notes",
            "error",
            "created_by",
            "created_at",
            "started_at",
            "finished_at",
            "result",
        ]
        read_only_fields = fields

    @extend_schema_field(NULLABLE_OBJECT)
    def get_cheapest(self, run: SizingRun) -> dict | None:
        cheapest = run.result.get("cheapest")
        return {k: v for k, v in cheapest.items() if k != "band"} if cheapest else None

    @extend_schema_field(NULLABLE_OBJECT)
    def get_max_bcr(self, run: SizingRun) -> dict | None:
        return run.result.get("max_bcr")

    @extend_schema_field(NULLABLE_OBJECT)
    def get_band(self, run: SizingRun) -> dict | None:
        return (run.result.get("cheapest") or {}).get("band")

    @extend_schema_field(NULLABLE_OBJECT)
    def get_unit_prices(self, run: SizingRun) -> dict | None:
        return run.result.get("unit_prices")

    @extend_schema_field(NULLABLE_OBJECT)
    def get_sla(self, run: SizingRun) -> dict | None:
        return run.result.get("sla")

    def get_notes(self, run: SizingRun) -> list[str]:
        return list(run.inputs.get("notes", []))

    def get_created_by(self, run: SizingRun) -> str | None:
        return run.created_by.username if run.created_by else None


class SizingRunListSerializer(SizingRunSerializer):
    """A sizing run without planner.size's whole output: lists stay small."""

    class Meta(SizingRunSerializer.Meta):
        fields = [f for f in SizingRunSerializer.Meta.fields if f != "result"]
        read_only_fields = fields


# --- the autopilot ---------------------------------------------------------------------------


class AutopilotSettingsSerializer(serializers.ModelSerializer):
    """The autopilot's settings: schedule, SLA and the automatic mode's guardrails."""

    class Meta:
        from plans.models import AutopilotSettings

        model = AutopilotSettings
        fields = [
            "automatic",
            "served_model",
            "scenario",
            "interval_s",
            "window_s",
            "p90",
            "p99",
            "max_change_per_step",
            "cooldown_s",
            "scale_down_after_s",
            "budget_per_hour",
            "floors",
            "updated_at",
        ]
        read_only_fields = ["updated_at"]

    def validate_scenario(self, value: str) -> str:
        try:
            services.scenario_config(value)
        except services.PlanInputError as exc:
            raise serializers.ValidationError(exc.message) from exc
        return value

    def validate_floors(self, value):
        from plans.autopilot import check_floors

        try:
            return check_floors(value)
        except ValueError as exc:
            raise serializers.ValidationError(str(exc)) from exc


class ProposalStepSerializer(serializers.ModelSerializer):
    class Meta:
        from plans.models import ProposalStep

        model = ProposalStep
        fields = ["index", "action", "role", "node", "instance_id_ref", "status", "note",
                  "updated_at"]  # fmt: skip
        read_only_fields = fields


class ProposalListSerializer(serializers.ModelSerializer):
    class Meta:
        from plans.models import Proposal

        model = Proposal
        fields = ["id", "status", "trigger", "reason", "current", "target", "guardrails",
                  "decided_by", "decided_at", "applied_at", "created_at"]  # fmt: skip
        read_only_fields = fields


class ProposalSerializer(serializers.ModelSerializer):
    steps = ProposalStepSerializer(many=True, read_only=True)

    class Meta:
        from plans.models import Proposal

        model = Proposal
        fields = ["id", "status", "trigger", "scenario", "model", "reason", "error", "profile",
                  "fingerprint", "current", "target", "changes", "predicted", "thresholds",
                  "guardrails", "decided_by", "decided_at", "applied_at", "realised", "steps",
                  "sizing", "created_at", "updated_at"]  # fmt: skip
        read_only_fields = fields
