"""Websocket URL routes of every app, collected for the ASGI entry."""

from __future__ import annotations

from django.urls import path

from fleet.consumers import FleetConsumer
from frontend.routing import websocket_urlpatterns as frontend_websocket_urlpatterns

websocket_urlpatterns = [
    path("ws/fleet/", FleetConsumer.as_asgi()),
    *frontend_websocket_urlpatterns,
]
