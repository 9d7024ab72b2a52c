"""Routes of the plan-run API under /api/v1/."""

from rest_framework.routers import DefaultRouter

from plans.api import views

router = DefaultRouter()
router.register("plans", views.PlanRunViewSet, basename="planrun")

urlpatterns = router.urls
