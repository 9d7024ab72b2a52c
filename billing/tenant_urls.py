"""Tenant self-service URLs (API-key authenticated); included at the URL root, beside the
gateway's /v1/ routes: ``path("", include("billing.tenant_urls"))``.

Every answer under /v1/organization/ is JSON in OpenAI's error shape, as the schema says
(billing/tenant_openapi.py): a statement id that is not a number is a missing statement (404),
not Django's HTML page for an unmatched URL, and so is any other path below the prefix."""

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
        "v1/organization/statements/<str:statement_id>",
        tenant_api.statement_detail,
        name="tenant-statement",
    ),
    path(
        "v1/organization/statements/<str:statement_id>/csv",
        tenant_api.statement_csv_view,
        name="tenant-statement-csv",
    ),
    path("v1/organization/<path:rest>", tenant_api.unknown_url, name="tenant-unknown"),
]
