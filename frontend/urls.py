"""Routes of the operator UI and /metrics, mounted at the site root by controlplane/urls.py."""

from __future__ import annotations

from django.urls import path

from frontend import fleet_edit, planner_autopilot, planner_size, views
from frontend.metrics import metrics_view

app_name = "frontend"

urlpatterns = [
    path("", views.OverviewView.as_view(), name="overview"),
    path("login/", views.LoginView.as_view(), name="login"),
    path("logout/", views.LogoutView.as_view(), name="logout"),
    path("fleet/", views.FleetView.as_view(), name="fleet"),
    path("fleet/instances/<int:pk>/", views.InstanceDetailView.as_view(), name="instance"),
    path("fleet/links/<int:pk>/", views.LinkDetailView.as_view(), name="link"),
    path("fleet/config/", fleet_edit.FleetConfigView.as_view(), name="fleet-config"),
    path("fleet/<slug:kind>/add/", fleet_edit.FleetEditView.as_view(), name="fleet-add"),
    path("fleet/<slug:kind>/<int:pk>/edit/", fleet_edit.FleetEditView.as_view(), name="fleet-edit"),
    path("requests/", views.RequestsView.as_view(), name="requests"),
    path("requests/<path:request_id>/", views.RequestDetailView.as_view(), name="request"),
    path("planner/", views.PlannerView.as_view(), name="planner"),
    path("planner/size/", planner_size.SizingStartView.as_view(), name="planner-size"),
    path(
        "planner/autopilot/propose/",
        planner_autopilot.ProposeView.as_view(),
        name="planner-autopilot-propose",
    ),
    path(
        "planner/autopilot/<int:pk>/approve/",
        planner_autopilot.DecideView.as_view(approve=True),
        name="planner-autopilot-approve",
    ),
    path(
        "planner/autopilot/<int:pk>/reject/",
        planner_autopilot.DecideView.as_view(approve=False),
        name="planner-autopilot-reject",
    ),
    path("billing/", views.BillingView.as_view(), name="billing"),
    path("billing/usage/<path:request_id>/", views.UsageDetailView.as_view(), name="usage"),
    path("telemetry/snapshot/", views.SnapshotJSONView.as_view(), name="snapshot"),
    path("telemetry/history/", views.HistoryJSONView.as_view(), name="history"),
    path("metrics", metrics_view, name="metrics"),
    path("favicon.ico", views.favicon_view, name="favicon"),
]
