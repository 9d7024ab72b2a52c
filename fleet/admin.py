"""Admin for the fleet: same validation as the API (model clean() and services)."""

from __future__ import annotations

from django.contrib import admin, messages

from fleet import services
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


@admin.register(Datacenter)
class DatacenterAdmin(admin.ModelAdmin):
    list_display = ["name", "region", "rdma_domain"]
    search_fields = ["name", "region"]


@admin.register(GPUType)
class GPUTypeAdmin(admin.ModelAdmin):
    list_display = [
        "vendor",
        "model",
        "peak_bf16_tflops",
        "memory_gib",
        "memory_bandwidth_gbps",
        "interconnect_gbps",
    ]
    search_fields = ["vendor", "model"]


@admin.register(UnitPrice)
class UnitPriceAdmin(admin.ModelAdmin):
    # The form's fields and the list's columns, in this order (the model has PeriodPrice's
    # fields first).
    fields = (
        "gpu_type",
        "datacenter",
        "price_per_gpu_hour",
        "currency",
        "effective_from",
        "effective_to",
    )
    list_display = fields
    list_filter = ["datacenter", "gpu_type", "currency"]


@admin.register(WANLink)
class WANLinkAdmin(admin.ModelAdmin):
    list_display = [
        "from_datacenter",
        "to_datacenter",
        "bandwidth_gbps",
        "rtt_ms",
        "connection_pool_size",
        "status",
    ]
    list_filter = ["status"]


@admin.register(ServedModel)
class ServedModelAdmin(admin.ModelAdmin):
    list_display = ["name", "source", "num_layers", "kv_bytes_per_token", "dtype"]
    search_fields = ["name"]


class InstanceInline(admin.TabularInline):
    model = Instance
    extra = 0
    fields = ["role", "served_model", "gpu_count", "desired_state", "actual_state"]
    readonly_fields = ["actual_state"]


class EventInline(admin.TabularInline):
    model = FleetEvent
    extra = 0
    readonly_fields = ["created_at", "kind", "message", "actor"]
    # A list of its own: `fields` is typed as a list of names *or groups*, which the
    # list[str] of readonly_fields is not (lists are invariant).
    fields = [*readonly_fields]
    can_delete = False
    ordering = ["-created_at"]

    def has_add_permission(self, request, obj=None) -> bool:
        return False


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    list_display = [
        "hostname",
        "datacenter",
        "gpu_type",
        "gpu_count",
        "status",
        "last_heartbeat_at",
    ]
    list_filter = ["datacenter", "status", "gpu_type"]
    search_fields = ["hostname"]
    readonly_fields = ["status", "last_heartbeat_at", "agent_token_prefix"]
    inlines = [InstanceInline, EventInline]
    actions = ["rotate_token"]

    def save_model(self, request, obj, form, change):
        if change:
            super().save_model(request, obj, form, change)
            return
        node, token = services.node_create(
            hostname=obj.hostname,
            datacenter=obj.datacenter,
            gpu_type=obj.gpu_type,
            gpu_count=obj.gpu_count,
            agent_endpoint=obj.agent_endpoint,
            actor=request.user.username,
        )
        obj.pk = node.pk
        obj.agent_token_prefix = node.agent_token_prefix
        obj.agent_token_hash = node.agent_token_hash
        messages.warning(request, f"Agent token for {node.hostname} (shown once): {token}")

    @admin.action(description="Rotate the agent token (shown once)")
    def rotate_token(self, request, queryset):
        for node in queryset:
            token = services.node_rotate_token(node=node, actor=request.user.username)
            messages.warning(request, f"New agent token for {node.hostname} (shown once): {token}")


@admin.register(Instance)
class InstanceAdmin(admin.ModelAdmin):
    list_display = [
        "id",
        "role",
        "served_model",
        "node",
        "gpu_count",
        "desired_state",
        "actual_state",
    ]
    list_filter = ["role", "desired_state", "actual_state", "served_model"]
    readonly_fields = ["actual_state", "state_changed_at"]
    inlines = [EventInline]


@admin.register(FleetEvent)
class FleetEventAdmin(admin.ModelAdmin):
    list_display = ["created_at", "kind", "node", "instance", "actor", "message"]
    list_filter = ["kind"]
    search_fields = ["message"]
    readonly_fields = ["node", "instance", "kind", "message", "data", "actor", "created_at"]

    def has_add_permission(self, request) -> bool:
        return False
