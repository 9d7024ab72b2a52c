"""Routes of the plan-run API under /api/v1/."""

from django.urls import path
from rest_framework.routers import DefaultRouter

from plans.api import views

router = DefaultRouter()
# Before "plans": its detail route would take "sizing" for a plan id.
router.register("plans/sizing", views.SizingRunViewSet, basename="sizingrun")
router.register("plans", views.PlanRunViewSet, basename="planrun")
router.register("autopilot/proposals", views.ProposalViewSet, basename="proposal")

urlpatterns = [
    path("autopilot/profile/", views.AutopilotProfileView.as_view(), name="autopilot-profile"),
    path("autopilot/settings/", views.AutopilotSettingsView.as_view(), name="autopilot-settings"),
    *router.urls,
]
