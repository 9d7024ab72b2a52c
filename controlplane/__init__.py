"""The Baton control plane Django project: settings, URL root, ASGI entry and the Celery app."""

from controlplane.celery import app as celery_app

__all__ = ["celery_app"]
