"""Websocket URL routes of every app, collected for the ASGI entry."""

from __future__ import annotations

from django.urls import path

from fleet.consumers import FleetConsumer

websocket_urlpatterns = [
    path("ws/fleet/", FleetConsumer.as_asgi()),
]
