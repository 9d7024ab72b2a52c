from django.urls import path
from rest_framework.routers import DefaultRouter

from routing.api import views

router = DefaultRouter()
router.register("requests", views.RequestRecordViewSet, basename="request")
router.register("decisions", views.RoutingDecisionViewSet, basename="decision")

urlpatterns = [
    path("routing-policy/", views.RoutingPolicyView.as_view(), name="routing-policy"),
    path("suspect-instances/", views.SuspectInstancesView.as_view(), name="suspect-instances"),
    *router.urls,
]
