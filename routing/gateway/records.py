"""What the gateway writes about a request: an admission row when it is accepted, and when it
ends the request record, its decision and the tenant's usage line, in one transaction, at most
once per request id, removing the admission. Admissions a dead gateway process left behind are
finished as ``interrupted`` records by a later process (``finish_interrupted``)."""

from __future__ import annotations

import logging
import os
import socket
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from billing.models import ApiKey
from billing.services import usage_line, usage_record, usage_records
from fleet.models import ServedModel
from pdd.policy import Decision
from routing.gateway.caches import served_models
from routing.gateway.journal import Journal
from routing.gateway.workers import record_writer
from routing.models import Admission, RequestRecord, RoutingDecision

log = logging.getLogger(__name__)

# Called with each new RequestRecord after commit (telemetry); set by the app that aggregates.
record_observers: list = []


@dataclass(slots=True)
class Outcome:
    status: str
    error: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    tokens_by_rld: int = 0
    tokens_by_md: int = 0
    ttft_s: float | None = None
    prefill_s: float | None = None
    kv_wait_s: float | None = None
    max_gap_s: float | None = None
    first_token_early: bool = False
    tpot_s: float | None = None
    e2e_s: float | None = None
    finish_reason: str = ""
    kv_bytes_intra_dc: int = 0
    kv_bytes_wan: int = 0
    kv_format_wan: str = ""
    handoff_bytes: int = 0
    handoff_at_token: int | None = None
    handoff_batches: int = 0
    migrations: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def is_emulated(model: str) -> bool:
    """Whether a served model runs on the emulated engine (its source is a model profile)."""
    row = served_models.get(model, lambda: ServedModel.objects.filter(name=model).first())
    return row is not None and row.emulated


def _record_row(
    *,
    request_id: str,
    api_key: ApiKey,
    model: str,
    endpoint: str,
    stream: bool,
    decision: Decision | None,
    outcome: Outcome,
    client_request_id: str = "",
    **_: Any,
) -> RequestRecord:
    """A request's record, not saved yet."""
    return RequestRecord(
        request_id=request_id,
        client_request_id=client_request_id,
        tenant=api_key.tenant,
        model=model,
        emulated=is_emulated(model),
        endpoint=endpoint,
        stream=stream,
        status=outcome.status,
        error=outcome.error[:2000],
        pipeline=decision.pipeline if decision else "",
        handoff_mode=decision.handoff_mode if decision else "",
        handoff_at_token=outcome.handoff_at_token,
        handoff_batches=outcome.handoff_batches,
        migrations=outcome.migrations,
        prompt_tokens=outcome.prompt_tokens,
        cached_tokens=min(outcome.cached_tokens, outcome.prompt_tokens),
        completion_tokens=outcome.completion_tokens,
        tokens_by_rld=outcome.tokens_by_rld,
        tokens_by_md=outcome.tokens_by_md,
        ttft_s=outcome.ttft_s,
        prefill_s=outcome.prefill_s,
        kv_wait_s=outcome.kv_wait_s,
        max_gap_s=outcome.max_gap_s,
        first_token_early=outcome.first_token_early,
        tpot_s=outcome.tpot_s,
        e2e_s=outcome.e2e_s,
        finish_reason=outcome.finish_reason if outcome.status == "ok" else "",
        kv_bytes_intra_dc=outcome.kv_bytes_intra_dc,
        kv_bytes_wan=outcome.kv_bytes_wan,
        kv_format_wan=outcome.kv_format_wan,
        handoff_bytes=outcome.handoff_bytes,
        prefill_instance=(decision.prefill_id if decision else "") or "",
        relay_instance=(decision.relay_id if decision else "") or "",
        main_instance=(decision.main_id if decision else "") or "",
    )


def _decision_row(
    record: RequestRecord, decision: Decision, policy_version: int, decision_inputs: dict
) -> RoutingDecision:
    return RoutingDecision(
        request=record,
        policy_version=policy_version,
        pipeline=decision.pipeline,
        handoff_mode=decision.handoff_mode,
        cached_tokens=decision.cached_tokens,
        delta_tokens=decision.delta_tokens,
        est_wan_s=decision.est_wan_s,
        fallback=decision.fallback,
        reason=decision.reason,
        inputs=decision_inputs,
    )


def _usage_line(write: dict[str, Any]) -> dict[str, Any] | None:
    """The usage line of a record write, as billing rules it (``billing.services.usage_line``)."""
    outcome: Outcome = write["outcome"]
    return usage_line(
        request_id=write["request_id"],
        api_key=write["api_key"],
        model=write["model"],
        status=outcome.status,
        prompt_tokens=outcome.prompt_tokens,
        cached_tokens=outcome.cached_tokens,
        completion_tokens=outcome.completion_tokens,
    )


def _notify(record: RequestRecord) -> None:
    for observer in record_observers:
        try:
            observer(record)
        except Exception:  # telemetry must never fail a request
            log.warning("record observer failed", exc_info=True)


def record_request(
    *,
    request_id: str,
    api_key: ApiKey,
    model: str,
    endpoint: str,
    stream: bool,
    decision: Decision | None,
    policy_version: int,
    decision_inputs: dict[str, Any],
    outcome: Outcome,
    client_request_id: str = "",
) -> RequestRecord:
    """The record, decision and usage line of a finished request, in one transaction, and its
    admission removed; a request id already recorded is left as it is (its record returned)."""
    write: dict[str, Any] = {
        "request_id": request_id,
        "api_key": api_key,
        "model": model,
        "endpoint": endpoint,
        "stream": stream,
        "decision": decision,
        "outcome": outcome,
        "client_request_id": client_request_id,
    }
    existing = RequestRecord.objects.filter(request_id=request_id).first()
    if existing is not None:
        return existing
    with transaction.atomic():
        record = _record_row(**write)
        record.save(force_insert=True)
        if decision is not None:
            _decision_row(record, decision, policy_version, decision_inputs).save(force_insert=True)
        Admission.objects.filter(request_id=request_id).delete()
        line = _usage_line(write)
        if line is not None:
            usage_record(**line)
        transaction.on_commit(partial(_notify, record))
    return record


def record_requests(writes: list[dict[str, Any]]) -> list[RequestRecord]:
    """``record_request`` for a batch (the record writer's): each item its keyword arguments,
    the same rows as calling it for each in turn, in a few statements for the whole batch
    (records, decisions and usage lines each in one insert, the admissions in one delete).
    Needs the database to return the inserted rows' keys (PostgreSQL, SQLite >= 3.35);
    otherwise, or when a concurrent writer got a request id in first (IntegrityError), it
    raises and the caller writes the batch one by one (``workers.BatchWriter``)."""
    ids = [w["request_id"] for w in writes]
    # Which ids have a record already: one narrow query, no ordering; their rows (rare) next.
    done = RequestRecord.objects.filter(request_id__in=ids).order_by()
    found = list(done.values_list("request_id", flat=True))
    records = {r.request_id: r for r in done.filter(request_id__in=found)} if found else {}
    new: dict[str, tuple[RequestRecord, dict[str, Any]]] = {}
    for w in writes:
        if w["request_id"] not in records and w["request_id"] not in new:
            new[w["request_id"]] = (_record_row(**w), w)
    if new:
        rows = RequestRecord.objects.bulk_create([row for row, _ in new.values()])
        if any(row.pk is None for row in rows):
            raise NotImplementedError("the database did not return the new records' keys")
        RoutingDecision.objects.bulk_create(
            [
                _decision_row(row, w["decision"], w["policy_version"], w["decision_inputs"])
                for row, w in new.values()
                if w["decision"] is not None
            ]
        )
        Admission.objects.filter(request_id__in=list(new)).delete()
        usage_records([line for _, w in new.values() if (line := _usage_line(w)) is not None])
        for row, _ in new.values():
            records[row.request_id] = row
            transaction.on_commit(partial(_notify, row))
    return [records[i] for i in ids]


def this_process() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def admission_entry(
    *,
    request_id: str,
    api_key: ApiKey,
    model: str,
    endpoint: str,
    stream: bool,
    prompt_tokens: int,
    decision: Decision,
    policy_version: int,
    decision_inputs: dict[str, Any],
    attempt_request_id: str = "",
    prefill_url: str = "",
    client_request_id: str = "",
) -> dict[str, Any]:
    """An admission's fields as plain data (a journal line; an Admission row's fields)."""
    return {
        "request_id": request_id,
        "client_request_id": client_request_id,
        "tenant_id": api_key.tenant_id,
        "api_key_id": api_key.pk,
        "model": model,
        "endpoint": endpoint,
        "stream": stream,
        "prompt_tokens": prompt_tokens,
        "decision": decision.to_dict(),
        "decision_inputs": decision_inputs,
        "policy_version": policy_version,
        "attempt_request_id": attempt_request_id,
        "prefill_url": prefill_url,
    }


def admission_row(entry: dict[str, Any], owner: str) -> Admission:
    """An admission row from a journal entry (``admission_entry``), owned by ``owner`` (the
    process that accepted the request: ``this_process``)."""
    return Admission.objects.create(**entry, owner=owner)


def admission_rows(writes: list[dict[str, Any]]) -> list[Admission]:
    """``admission_row`` for a batch, in one insert (the record writer's)."""
    return Admission.objects.bulk_create(
        [Admission(**w["entry"], owner=w["owner"]) for w in writes]
    )


record_writer.batched(admission_row, admission_rows)
record_writer.batched(record_request, record_requests)


def admission_open(**fields: Any) -> None:
    """The durable trace of an accepted request as a row, committed now (the request path
    journals it instead: ``admission_journaled``, through ``recorder.admitted``)."""
    admission_row(admission_entry(**fields), this_process())


def admission_journaled(**fields: Any) -> Future:
    """The durable trace of an accepted request, before any agent is called: one line in this
    process's journal (durable when this returns), its row in the record writer's next batch
    (the future). The writer's queue is in order, so the request's later progress, attempts
    and record find the row (routing/gateway/journal.py)."""
    entry = admission_entry(**fields)
    journal = admission_journal()
    journal.append(entry)
    future = record_writer.submit(admission_row, entry=entry, owner=this_process())
    future.add_done_callback(lambda _: journal.committed(1))
    return future


_journals: dict[str, Journal] = {}


def admission_journal() -> Journal:
    """This process's journal, in ``BATON_JOURNAL_DIR``."""
    directory = str(settings.BATON_JOURNAL_DIR)
    if directory not in _journals:
        _journals[directory] = Journal(Path(directory))
    return _journals[directory]


def admission_progress(request_id: str, delivered_tokens: int) -> None:
    Admission.objects.filter(request_id=request_id).update(
        delivered_tokens=delivered_tokens, updated_at=timezone.now()
    )


def admission_attempt(
    request_id: str, attempt_request_id: str, prefill_url: str, token_offset: int
) -> None:
    """A retry or a migration started a new attempt on the agents, or P handed the attempt's
    stream to its decoder (one hop per token): note where it streams from and how many tokens
    the user had before that stream, so a later process can ask that agent."""
    Admission.objects.filter(request_id=request_id).update(
        attempt_request_id=attempt_request_id,
        prefill_url=prefill_url,
        delivered_tokens=token_offset,
        token_offset=token_offset,
        updated_at=timezone.now(),
    )
