"""Sending work to Celery once the current transaction commits.

A task is named as Celery registers it (``"fleet.link_apply"``) and found in Celery's registry,
which every process fills at start-up (``controlplane.apps``): the services that queue work never
import the task modules that call them, so there is no import circle, not even a lazy one."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from celery import current_app
from celery.exceptions import Retry
from django.db import transaction

from fleet.agent_client import AgentUnreachable

log = logging.getLogger(__name__)


def enqueue_after_commit(
    task_name: str, *args: Any, on_error: Callable[[Exception], None] | None = None
) -> None:
    """Queue the task registered as `task_name` once the current transaction commits. A broker
    or agent failure is logged, never raised into the operator's request: the periodic
    reconcile repairs it; `on_error(exc)` runs too, for work nothing repairs (a queued plan)."""

    def send() -> None:
        try:
            current_app.tasks[task_name].delay(*args)
        except (AgentUnreachable, Retry) as exc:
            # Expected while an agent is starting or away (run eagerly without a broker, the
            # task's own retry surfaces here): one line, no traceback.
            log.warning("could not run %s%r now (%s); reconcile will retry", task_name, args, exc)
            if on_error is not None:
                on_error(exc)
        except Exception as exc:
            log.warning(
                "could not run %s%r now; reconcile will retry", task_name, args, exc_info=True
            )
            if on_error is not None:
                on_error(exc)

    transaction.on_commit(send)
