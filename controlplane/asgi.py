"""ASGI entry: Django over HTTP and Channels consumers over websockets."""

from __future__ import annotations

import asyncio
import logging
import os
import sys

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
# Django must be set up before anything imports models (consumers, routing).
django.setup(set_prefix=False)

from controlplane.middleware import ASGIHandler  # noqa: E402

# Django's handler with its middleware run without thread hops (controlplane/middleware.py).
django_http = ASGIHandler()

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402
from django.conf import settings  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402

from controlplane import gcwatch  # noqa: E402
from controlplane.embedded_beat import start_embedded_beat  # noqa: E402
from controlplane.limits import BodyGuard  # noqa: E402
from controlplane.routing import websocket_urlpatterns  # noqa: E402
from controlplane.warmup import warm_up  # noqa: E402
from pdd import looplag  # noqa: E402
from routing.caching import versions  # noqa: E402

# The event loop gets the GIL back from computing threads within this (settings.py).
if settings.BATON_GIL_SWITCH_INTERVAL_MS > 0:
    sys.setswitchinterval(settings.BATON_GIL_SWITCH_INTERVAL_MS / 1000.0)
gcwatch.tune(settings.BATON_GC_THRESHOLDS)
gcwatch.install(settings.BATON_GC_WARN_MS)

http_app = BodyGuard(ASGIStaticFilesHandler(django_http) if settings.SERVE_STATIC else django_http)

start_embedded_beat()


async def lifespan(scope, receive, send):
    """uvicorn's start and stop: on stop (SIGTERM), after the server has stopped accepting and
    its open streams have ended, wait for the request records still being written."""
    refresher = None
    lag_watch = None
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            # The gateway caches' change counters, read off the request path.
            refresher = versions.start_refresher()
            lag_watch = looplag.start()  # the loop's own delay, not taken for the nodes'
            # The URLconf and the prefix index's mirror loaded now, not by the first requests.
            await asyncio.to_thread(warm_up)
            if settings.BATON_GC_FREEZE:  # start-up's objects out of every later collection
                gcwatch.freeze()
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            if refresher is not None:
                refresher.set()
            if lag_watch is not None:
                lag_watch.cancel()
            from routing.gateway.records import admission_journal
            from routing.gateway.views import drain_pending_records

            left = await drain_pending_records(timeout_s=30.0)
            if left:
                logging.getLogger(__name__).error("%d request records were not written", left)
            # Gone if every admission has its row; else kept for the next process to recover.
            admission_journal().close()
            await send({"type": "lifespan.shutdown.complete"})
            return


application = ProtocolTypeRouter(
    {
        "lifespan": lifespan,
        "http": http_app,
        "websocket": AllowedHostsOriginValidator(
            AuthMiddlewareStack(URLRouter(websocket_urlpatterns))
        ),
    }
)
