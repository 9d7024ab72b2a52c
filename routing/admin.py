from django.contrib import admin

from routing.models import RequestRecord, RoutingDecision, RoutingPolicyConfig


@admin.register(RoutingPolicyConfig)
class RoutingPolicyAdmin(admin.ModelAdmin):
    list_display = ["version", "updated_at", "updated_by"]


@admin.register(RequestRecord)
class RequestRecordAdmin(admin.ModelAdmin):
    list_display = [
        "created_at",
        "request_id",
        "tenant",
        "pipeline",
        "handoff_mode",
        "status",
        "ttft_s",
        "e2e_s",
    ]
    list_filter = ["pipeline", "handoff_mode", "status"]
    search_fields = ["request_id"]


@admin.register(RoutingDecision)
class RoutingDecisionAdmin(admin.ModelAdmin):
    list_display = [
        "created_at",
        "pipeline",
        "handoff_mode",
        "cached_tokens",
        "delta_tokens",
        "est_wan_s",
    ]
    list_filter = ["pipeline", "handoff_mode", "fallback"]
