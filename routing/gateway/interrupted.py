"""Requests a gateway process left unfinished when it died: the admissions it had only
journaled get their rows (``recover_journals``), then every admission whose process is gone
is recorded as ``interrupted``, billed for the tokens the prefill agent reports it streamed
(``finish_interrupted``, every 30 s: the Celery task in ``routing/tasks.py``)."""

from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from billing.models import ApiKey
from fleet.agent_client import tls_context
from fleet.pinning import EndpointNotCalled, PinnedTransport, resolved_endpoints
from pdd.policy import Decision
from routing.gateway.journal import recover
from routing.gateway.records import Outcome, admission_row, record_request
from routing.gateway.runner import data_plane_headers
from routing.models import Admission, RequestRecord

log = logging.getLogger(__name__)


def _restore_admissions(owner: str, entries: list[dict[str, Any]]) -> int:
    """Rows for a dead process's journaled admissions that have neither a row nor a record."""
    ids = [e["request_id"] for e in entries]
    done = set(Admission.objects.filter(request_id__in=ids).values_list("request_id", flat=True))
    done |= set(
        RequestRecord.objects.filter(request_id__in=ids).values_list("request_id", flat=True)
    )
    fields = {f.name for f in Admission._meta.concrete_fields} | {"tenant_id", "api_key_id"}
    restored = 0
    with transaction.atomic():
        for entry in entries:
            if entry["request_id"] in done:
                continue
            entry = {k: v for k, v in entry.items() if k in fields}
            if (
                entry.get("api_key_id") is not None
                and not ApiKey.objects.filter(pk=entry["api_key_id"]).exists()
            ):
                entry["api_key_id"] = None  # the key was deleted meanwhile
            admission_row(entry, owner)
            done.add(entry["request_id"])
            restored += 1
    if restored:
        log.warning("restored %d admissions from %s's journal", restored, owner)
    return restored


def recover_journals() -> int:
    """Admission rows for what dead gateway processes on this host journaled but had not
    committed; ``finish_interrupted`` records them."""
    return recover(Path(settings.BATON_JOURNAL_DIR), _restore_admissions)


def agent_reported_tokens(admission: Admission, timeout_s: float = 2.0) -> int | None:
    """How many tokens the prefill agent says it streamed for the admission's attempt
    (``GET /v1/pdd/requests/{id}``, agents/PROTOCOL.md); None when it cannot say (gone,
    unknown request, not an allowed agent endpoint)."""
    if not admission.prefill_url or not admission.attempt_request_id:
        return None
    try:
        base = resolved_endpoints.lookup(admission.prefill_url).url
    except EndpointNotCalled as exc:
        log.warning("admission %s: %r is not an allowed agent endpoint now: %s",
                    admission.request_id, admission.prefill_url, exc)  # fmt: skip
        return None
    url = f"{base}/v1/pdd/requests/{admission.attempt_request_id}"
    # Pinned to the address just checked, as the data-plane calls are (fleet.pinning).
    transport = PinnedTransport(httpx.HTTPTransport(verify=tls_context()), resolved_endpoints)
    try:
        with httpx.Client(transport=transport, timeout=timeout_s, trust_env=False) as client:
            response = client.get(url, headers=data_plane_headers())
        if response.status_code != 200:
            return None
        tokens = response.json().get("tokens")
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        return None
    return tokens


def _owner_dead(owner: str, updated_at, now, stale_after_s: float) -> bool:
    host, _, pid = owner.rpartition(":")
    if host == socket.gethostname() and pid.isdigit():
        if int(pid) == os.getpid():
            return False
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass  # alive, another user's
        # Alive, or its pid reused: fall back on staleness.
    return now - updated_at > timedelta(seconds=stale_after_s)


def finish_interrupted(*, stale_after_s: float = 120.0, now=None) -> list[str]:
    """Record every admission whose gateway process is gone (dead pid on this host, or no
    progress for `stale_after_s` from elsewhere) as ``interrupted``, billing the tokens the
    prefill agent reports it streamed (or, when it cannot be asked, the count the process last
    saved). Idempotent: record_request writes each request once."""
    now = now or timezone.now()
    recover_journals()
    finished: list[str] = []
    for admission in Admission.objects.select_related("api_key__tenant", "tenant"):
        if not _owner_dead(admission.owner, admission.updated_at, now, stale_after_s):
            continue
        if admission.api_key is None:  # the key was deleted: nothing to bill it to
            Admission.objects.filter(pk=admission.pk).delete()
            continue
        try:
            decision = Decision(**admission.decision) if admission.decision else None
        except TypeError:
            decision = None
        delivered = admission.delivered_tokens
        reported = agent_reported_tokens(admission)
        if reported is not None:
            delivered = max(delivered, admission.token_offset + reported)
        record_request(
            request_id=admission.request_id,
            api_key=admission.api_key,
            model=admission.model,
            endpoint=admission.endpoint,
            stream=admission.stream,
            decision=decision,
            policy_version=admission.policy_version,
            decision_inputs=admission.decision_inputs,
            client_request_id=admission.client_request_id,
            outcome=Outcome(
                status="interrupted",
                error=f"the gateway process {admission.owner} ended while the request ran"
                + (
                    f"; the prefill agent had streamed {reported} tokens of its attempt"
                    if reported is not None
                    else "; the prefill agent could not be asked how many tokens it streamed"
                ),
                prompt_tokens=admission.prompt_tokens,
                completion_tokens=delivered,
            ),
        )
        Admission.objects.filter(pk=admission.pk).delete()
        finished.append(admission.request_id)
    if finished:
        log.warning("recorded %d interrupted requests: %s", len(finished), finished[:10])
    return finished
