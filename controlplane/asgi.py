"""ASGI entry: Django over HTTP and Channels consumers over websockets."""

from __future__ import annotations

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
# Django must be set up before anything imports models (consumers, routing).
django_http = get_asgi_application()

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402
from django.conf import settings  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402

from controlplane.embedded_beat import start_embedded_beat  # noqa: E402
from controlplane.limits import BodyGuard  # noqa: E402
from controlplane.routing import websocket_urlpatterns  # noqa: E402

http_app = BodyGuard(ASGIStaticFilesHandler(django_http) if settings.SERVE_STATIC else django_http)

start_embedded_beat()

application = ProtocolTypeRouter(
    {
        "http": http_app,
        "websocket": AllowedHostsOriginValidator(
            AuthMiddlewareStack(URLRouter(websocket_urlpatterns))
        ),
    }
)
