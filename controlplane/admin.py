"""Admin for API tokens: listed by prefix, never with their digest; a new key is shown once."""

from django.apps import apps
from django.contrib import admin, messages
from django.utils import timezone

from controlplane.models import ApiToken

if apps.is_installed("rest_framework.authtoken"):
    # DRF's token admin would show keys and write them into the admin log (object_repr);
    # its tokens are moved into ApiTokens anyway (controlplane.models).
    from rest_framework.authtoken.models import TokenProxy

    if admin.site.is_registered(TokenProxy):
        admin.site.unregister(TokenProxy)


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    list_display = [
        "prefix",
        "user",
        "name",
        "created_at",
        "last_used_at",
        "expires_at",
        "revoked_at",
        "state",
    ]
    list_filter = ["user", "revoked_at", "expires_at"]
    search_fields = ["prefix", "name", "user__username"]
    # The digest is never shown, nor the key (which is not stored).
    fields = ["user", "name", "expires_at", "prefix", "created_at", "last_used_at", "revoked_at"]
    actions = ["revoke"]

    def get_readonly_fields(self, request, obj=None):
        readonly = ["prefix", "created_at", "last_used_at", "revoked_at"]
        return readonly + ["user"] if obj is not None else readonly

    @admin.display(description="state")
    def state(self, obj: ApiToken) -> str:
        return obj.state()

    def save_model(self, request, obj: ApiToken, form, change: bool) -> None:
        if change:
            super().save_model(request, obj, form, change)
            return
        key = obj.new_secret()
        obj.created_at = timezone.now()
        super().save_model(request, obj, form, change)
        messages.warning(
            request,
            f"API token for {obj.user} (shown once, copy it now): {key}",
        )

    @admin.action(description="Revoke")
    def revoke(self, request, queryset):
        for token in queryset:
            token.revoke()
