from rest_framework.routers import DefaultRouter

from billing.api import finance, views

router = DefaultRouter()
router.register("tenants", views.TenantViewSet, basename="tenant")
router.register("api-keys", views.ApiKeyViewSet, basename="apikey")
router.register("usage", views.UsageEntryViewSet, basename="usage")
router.register("model-prices", views.ModelPriceViewSet, basename="modelprice")
router.register("statements", views.StatementViewSet, basename="statement")

urlpatterns = router.urls + finance.urlpatterns  # /billing/costs/, /billing/margin/
