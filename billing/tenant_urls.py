"""Tenant self-service URLs (API-key authenticated); included at the URL root, beside the
gateway's /v1/ routes: ``path("", include("billing.tenant_urls"))``."""

from django.urls import path

from billing import tenant_api

urlpatterns = [
    path(
        "v1/organization/usage/completions",
        tenant_api.usage_completions,
        name="tenant-usage-completions",
    ),
    path("v1/organization/statements", tenant_api.statement_list, name="tenant-statements"),
    path(
        "v1/organization/statements/range",
        tenant_api.statement_range,
        name="tenant-statement-range",
    ),
    path(
        "v1/organization/statements/range/csv",
        tenant_api.statement_range_csv,
        name="tenant-statement-range-csv",
    ),
    path(
        "v1/organization/statements/<int:statement_id>",
        tenant_api.statement_detail,
        name="tenant-statement",
    ),
    path(
        "v1/organization/statements/<int:statement_id>/csv",
        tenant_api.statement_csv_view,
        name="tenant-statement-csv",
    ),
]
