"""URL root: admin, the REST API under /api/v1/, its OpenAPI schema and docs."""

from django.contrib import admin
from django.http import JsonResponse
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerSplitView


def healthz(request):
    return JsonResponse({"status": "ok"})


urlpatterns = [
    path("admin/", admin.site.urls),
    path("healthz", healthz, name="healthz"),
    path("", include("routing.gateway.urls")),
    path("api/v1/", include("fleet.api.urls")),
    path("api/v1/", include("billing.api.urls")),
    path("api/v1/", include("routing.api.urls")),
    path("api/v1/", include("plans.api.urls")),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerSplitView.as_view(url_name="schema"), name="api-docs"),
    path("api-auth/", include("rest_framework.urls")),
    path("", include("billing.tenant_urls")),  # /v1/organization/...: a tenant's own usage
    path("", include("frontend.urls")),
]
