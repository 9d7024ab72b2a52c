"""The routing service that writes what the request path knows of a request: its durable
admission before any agent is called, each new attempt and the tokens delivered while it runs,
and its record (with its decision and usage line) when it ends or is refused. Every write
goes through the record writer (``workers.record_writer``), in order, so a request's later
writes find its admission row; the rows themselves are ``records.py``'s.

The steps call this; none of them writes a record itself (routing/gateway/README.md)."""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Any

from pdd.policy import Decision
from routing.gateway import records
from routing.gateway.prepared import Prepared
from routing.gateway.records import Outcome
from routing.gateway.workers import record_writer

log = logging.getLogger(__name__)

__all__ = ["Outcome", "admitted", "attempt", "finished", "progress", "rejected"]


def _request(p: Prepared) -> dict[str, Any]:
    """What every record of ``p`` says about it: who asked, for what, how it was routed."""
    return {
        "request_id": p.request_id,
        "api_key": p.key,
        "model": p.model.name,
        "endpoint": p.kind,
        "stream": p.greq.stream,
        "policy_version": p.version,
        "decision_inputs": p.inputs,
        "client_request_id": p.client_request_id,
    }


def admitted(p: Prepared) -> Future:
    """The durable admission of a routed request, before any agent is called: a line in this
    process's journal now, its row in the record writer's next batch (the future). If this
    process dies, a later one records the request (``interrupted.finish_interrupted``)."""
    if p.decision is None:
        raise RuntimeError("admitted() of a request that was never routed")
    return records.admission_journaled(
        **_request(p),
        prompt_tokens=len(p.prompt_ids),
        decision=p.decision,
        attempt_request_id=p.plan["request_id"],
        prefill_url=p.prefill_http,
    )


def attempt(p: Prepared, *, prefill_url: str = "", token_offset: int | None = None) -> Future:
    """A new attempt on the agents (a retry or a migration: where ``p`` was routed again), or
    P's handoff of the attempt's stream to ``prefill_url`` after ``token_offset`` tokens: where
    it now streams from, so a process that finishes this admission asks the right agent."""
    if token_offset is None:  # a migration continues after the tokens the user has
        token_offset = len(p.continue_ids or p.prompt_ids) - len(p.prompt_ids)
    return record_writer.submit(
        _quietly(records.admission_attempt),
        request_id=p.request_id,
        attempt_request_id=str(p.plan.get("request_id") or p.request_id),
        prefill_url=prefill_url or p.prefill_http,
        token_offset=token_offset,
    )


def progress(p: Prepared, delivered_tokens: int) -> Future:
    """The tokens delivered so far, saved on the admission (best effort)."""
    return record_writer.submit(
        _quietly(records.admission_progress),
        request_id=p.request_id,
        delivered_tokens=delivered_tokens,
    )


def finished(p: Prepared, outcome: Outcome) -> Future:
    """The request's record, decision and usage line (``records.record_request``), its
    admission removed; the future resolves when they are committed."""
    return _record(p, p.decision, outcome)


def rejected(p: Prepared, reason: str) -> Future:
    """The ``rejected`` record of a request refused before any agent was called (the tenant's
    rate limit, no healthy path): no decision, no usage line."""
    return _record(
        p, None, Outcome(status="rejected", error=reason, prompt_tokens=len(p.prompt_ids))
    )


def _record(p: Prepared, decision: Decision | None, outcome: Outcome) -> Future:
    """The one place a live request's record is written (a dead process's admissions are
    recorded by ``interrupted.finish_interrupted``)."""
    return record_writer.submit(
        records.record_request, **_request(p), decision=decision, outcome=outcome
    )


def _quietly(fn):
    def run(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception:  # progress is best effort: the final record is what counts
            log.warning("could not save progress", exc_info=True)
            return None

    return run
