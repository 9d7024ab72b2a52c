"""Celery tasks of billing: rate pending usage and close the statements of ended periods."""

from __future__ import annotations

import logging

from celery import shared_task
from django.db import OperationalError

from billing import statements

log = logging.getLogger(__name__)


@shared_task(
    name="billing.close_statements",
    autoretry_for=(OperationalError,),  # e.g. a lock timeout: the whole run is safe to repeat
    retry_backoff=5,
    retry_backoff_max=60,
    max_retries=5,
)
def close_statements() -> list[int]:
    """Assign new usage to statements, then close every open statement whose period ended.

    Idempotent: a closed statement is skipped, so a retry or an overlapping beat round closes
    nothing twice and changes no closed statement.
    """
    closed = statements.close_statements()
    if closed:
        log.info("billing: closed statements %s", closed)
    return closed
