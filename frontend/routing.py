"""Websocket routes of the operator UI, mounted by controlplane/routing.py."""

from __future__ import annotations

from django.urls import path

from frontend.consumers import DashboardConsumer

websocket_urlpatterns = [
    path("ws/dashboard/", DashboardConsumer.as_asgi()),
]
