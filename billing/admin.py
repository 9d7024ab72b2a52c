from django.contrib import admin, messages

from billing import pricing, services
from billing.models import (
    ApiKey,
    DeletedInstanceRun,
    ModelPrice,
    Statement,
    StatementLine,
    Tenant,
    UsageEntry,
)


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    list_display = ["name", "display_name", "requests_per_minute", "tokens_per_minute", "active"]
    search_fields = ["name", "display_name"]
    actions = ["issue_key"]

    @admin.action(description="Issue a new API key (shown once)")
    def issue_key(self, request, queryset):
        for tenant in queryset:
            _, raw = services.api_key_create(tenant=tenant, name="admin")
            messages.warning(request, f"API key for {tenant.name} (shown once): {raw}")


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ["prefix", "tenant", "name", "created_at", "revoked_at", "last_used_at"]
    list_filter = ["tenant"]
    readonly_fields = ["prefix", "created_at", "revoked_at", "last_used_at"]
    actions = ["revoke"]

    def has_add_permission(self, request) -> bool:
        return False  # keys are issued from the tenant list so the raw key can be shown once

    @admin.action(description="Revoke")
    def revoke(self, request, queryset):
        for key in queryset:
            services.api_key_revoke(key=key)


@admin.register(UsageEntry)
class UsageEntryAdmin(admin.ModelAdmin):
    list_display = [
        "created_at",
        "tenant",
        "model",
        "prompt_tokens",
        "cached_tokens",
        "completion_tokens",
    ]
    list_filter = ["tenant", "model"]
    search_fields = ["request_id"]


@admin.register(ModelPrice)
class ModelPriceAdmin(admin.ModelAdmin):
    # The form's fields and the list's columns, in this order (the model has PeriodPrice's
    # fields first).
    fields = (
        "served_model",
        "tenant",
        "input_per_mtok",
        "cached_input_per_mtok",
        "output_per_mtok",
        "currency",
        "effective_from",
        "effective_to",
    )
    list_display = fields
    list_filter = ["served_model", "tenant", "currency"]
    date_hierarchy = "effective_from"

    def save_model(self, request, obj, form, change):
        pricing.model_price_save(price=obj)  # the form already ran clean(); this serialises


class StatementLineInline(admin.TabularInline):
    model = StatementLine
    extra = 0
    can_delete = False
    readonly_fields = [
        "model",
        "adjustment",
        "contract",
        "requests",
        "input_tokens",
        "cached_tokens",
        "output_tokens",
        "input_per_mtok",
        "cached_input_per_mtok",
        "output_per_mtok",
        "currency",
        "amount",
    ]
    # A list of its own: `fields` is typed as a list of names *or groups*, which the
    # list[str] of readonly_fields is not (lists are invariant).
    fields = [*readonly_fields]

    def has_add_permission(self, request, obj=None) -> bool:
        return False


@admin.register(Statement)
class StatementAdmin(admin.ModelAdmin):
    """Read-only: statements are built from the ledger and closed by billing.close_statements."""

    list_display = ["tenant", "period_start", "period_end", "status", "rated_at", "closed_at"]
    list_filter = ["status", "tenant"]
    inlines = [StatementLineInline]
    readonly_fields = [
        "tenant",
        "period_start",
        "period_end",
        "status",
        "rated_at",
        "closed_at",
        "last_entry_id",
        "entry_count",
    ]

    def has_add_permission(self, request) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False


@admin.register(DeletedInstanceRun)
class DeletedInstanceRunAdmin(admin.ModelAdmin):
    """Read-only: kept when an instance is deleted, for the provider cost of the past."""

    list_display = ["instance_id", "model", "datacenter", "gpu_type", "gpu_count", "started_at"]
    list_filter = ["model", "datacenter", "gpu_type"]
    readonly_fields = [
        "instance_id",
        "model",
        "datacenter",
        "datacenter_ref",
        "gpu_type",
        "gpu_type_ref",
        "gpu_count",
        "started_at",
        "ended_at",
        "created_at",
    ]

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False
