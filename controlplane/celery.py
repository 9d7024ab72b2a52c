"""The Celery app: Redis broker when ``REDIS_URL`` is set, in-process execution otherwise."""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

app = Celery("baton")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
