"""Routes of the plan-run API under /api/v1/."""

from rest_framework.routers import DefaultRouter

from plans.api import views

router = DefaultRouter()
# Before "plans": its detail route would take "sizing" for a plan id.
router.register("plans/sizing", views.SizingRunViewSet, basename="sizingrun")
router.register("plans", views.PlanRunViewSet, basename="planrun")

urlpatterns = router.urls
