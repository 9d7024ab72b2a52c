"""Routes of the fleet API under /api/v1/ (kebab-case plural collections)."""

from django.urls import path
from rest_framework.routers import DefaultRouter

from fleet.api import agent, views

router = DefaultRouter()
router.register("datacenters", views.DatacenterViewSet, basename="datacenter")
router.register("gpu-types", views.GPUTypeViewSet, basename="gputype")
router.register("unit-prices", views.UnitPriceViewSet, basename="unitprice")
router.register("wan-links", views.WANLinkViewSet, basename="wanlink")
router.register("models", views.ServedModelViewSet, basename="servedmodel")
router.register("nodes", views.NodeViewSet, basename="node")
router.register("instances", views.InstanceViewSet, basename="instance")
router.register("events", views.FleetEventViewSet, basename="fleetevent")

urlpatterns = [
    path("topology/", views.TopologyView.as_view(), name="topology"),
    path("agent/register", agent.AgentRegisterView.as_view(), name="agent-register"),
    path("agent/heartbeat", agent.AgentHeartbeatView.as_view(), name="agent-heartbeat"),
    path("agent/kv-events", agent.AgentKVEventsView.as_view(), name="agent-kv-events"),
    *router.urls,
]
