from __future__ import annotations

from django.contrib import admin

from frontend.models import ServedModelSLA


@admin.register(ServedModelSLA)
class ServedModelSLAAdmin(admin.ModelAdmin):
    list_display = ["model_name", "p90_ttft_s", "p99_ttft_s", "updated_at"]
    search_fields = ["model_name"]
