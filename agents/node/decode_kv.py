"""MD's side of a request's KV (DRC): reserve the cached prefix for it (counting KV in flight
to the instance, kv_flight.py), claim the reservation when its KV arrives (after the KV it
counted on has landed), and import the delta on top of the cached prefix on the engine
thread, handing the pins on to the reservations that counted on this KV. decode.py runs the
request around these steps."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agents.node.agent import Agent
from agents.node.inflight import as_tokens
from agents.node.instances import Instance
from agents.node.kv_flight import Reservation, unlock_all
from agents.node.pipeline_common import Events, queued_event

log = logging.getLogger("agents.node.decode")  # MD's own log, as before the split


async def reserve_prefix(agent: Agent, inst: Instance, request_id: str, prompt: list[int]) -> int:
    """Pin the longest cached whole-block prefix of `prompt` for this request until its KV is
    imported (or the reservation expires / is cancelled); returns its length.

    KV committed to this instance counts too (agents/node/inflight.py): when a request whose
    KV is still in flight here shares a longer whole-block prefix with `prompt`, that length
    is the answer and this request's import first waits for that KV to land (its import pins
    the prefix for this reservation). This request's own KV becomes incoming in turn. A
    second call for the same request returns the existing reservation."""
    kv = agent.kv_flight
    existing = kv.reservation(request_id)
    if existing is not None and existing.instance_id == inst.instance_id:
        return existing.cached_tokens
    tokens = as_tokens(prompt)

    def pin(engine):
        match = engine.cache.match_prefix(prompt)
        engine.cache.lock(match.node)
        return match.node, match.matched_tokens

    node, matched = await inst.running_worker.call(pin)
    current = kv.reservation(request_id)
    if current is not None and current.instance_id == inst.instance_id:
        # A concurrent call for the same request got there first: keep its reservation.
        inst.running_worker.call(lambda engine: engine.cache.unlock(node))
        return current.cached_tokens
    if current is not None:
        await kv.unreserve(request_id)
    return kv.record(request_id, inst.instance_id, node, matched, prompt, tokens).cached_tokens


@dataclass(slots=True)
class Claim:
    reservation: Reservation | None  # taken: its pins are unlocked by the import
    note: str  # what the reservation counted on, for an error message
    dropped: bool = False  # cancelled or expired while waiting for KV in flight


async def claim_reservation(agent: Agent, inst: Instance, request_id: str) -> Claim:
    """Take request_id's reservation for its import. When it counted on another request's KV
    in flight to this instance, first wait (at most kv_timeout_s) until that KV landed, failed
    or was dropped, or until this reservation is dropped itself."""
    claimed: list[Claim] = []
    async for _ in claiming(agent, inst, request_id, claimed):
        pass
    return claimed[0]


async def claiming(
    agent: Agent,
    inst: Instance,
    request_id: str,
    claimed: list[Claim],
    every_s: float | None = None,
) -> Events:
    """`claim_reservation` as a stream: a keep-alive (``queued``, waiting for kv) every
    ``every_s`` (None: none) while the KV in flight it counted on is still coming, the claim
    appended to ``claimed`` at the end."""
    kv = agent.kv_flight
    res = kv.claim(request_id, inst.instance_id)
    if res is None:
        claimed.append(Claim(None, ""))
        return
    source = res.depends_on
    if source is None:
        kv.take(request_id, res)
        claimed.append(Claim(res, ""))
        return
    started = time.monotonic()
    own = kv.incoming_of(request_id)
    events = [source.done] + ([own.done] if own is not None else [])
    while not any(e.is_set() for e in events):
        left = agent.settings.kv_timeout_s - (time.monotonic() - started)
        if left <= 0:
            break
        waits = [asyncio.ensure_future(e.wait()) for e in events]
        try:
            done, _ = await asyncio.wait(
                waits,
                timeout=left if every_s is None else min(every_s, left),
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            for waiter in waits:
                waiter.cancel()
        if done or time.monotonic() - started >= agent.settings.kv_timeout_s:
            break
        yield queued_event(started, "kv")
    where = f" (counted on the KV of request {source.request_id} in flight to this instance"
    if not kv.take(request_id, res):
        claimed.append(Claim(None, where + ")", dropped=True))
        return
    if not source.done.is_set():
        note = f", which did not land within {agent.settings.kv_timeout_s} s)"
    elif not source.landed:
        note = ", whose import failed or was cancelled)"
    else:
        note = ")"
    claimed.append(Claim(res, where + note))


def start_import(
    agent: Agent,
    inst: Instance,
    request_id: str,
    prompt: list[int],
    start_token: int,
    payload: bytes,
    reservation: Reservation | None,
    then: Callable[[Any], Any],
) -> asyncio.Future:
    """Queue the import of request_id's KV on the engine thread: import `payload` on top of the
    cached prefix, unlock the reservation's pins, run `then(engine)` (start decoding, or let
    the request go), and pin the prefix of every reservation that counted on this KV. The
    future gives (ImportResult, exception of `then` or None). Whatever becomes of the awaiting
    coroutine, once the engine ran it the request's incoming entry is finished and the pins
    go to the dependent reservations."""
    unlock = list(reservation.nodes) if reservation is not None else []
    if reservation is not None:
        reservation.nodes.clear()
    incoming = agent.kv_flight.incoming_of(request_id)
    dependents = incoming.dependents if incoming is not None else []

    def run(engine):
        try:
            # When the KV this import builds on never landed (its sender gave up, or it was
            # cancelled), MD computes that prefix itself: slower, but the request is served.
            result = engine.import_prefix(
                request_id, prompt, start_token, payload, recompute_missing=True
            )
        finally:
            unlock_all(engine, unlock)
        failure: Exception | None = None
        try:
            then(engine)
        except Exception as exc:  # noqa: BLE001 - handed to the caller; the KV is in the cache
            failure = exc
        pins = []
        for dep_rid, prefix in list(dependents):
            node = engine.cache.match_prefix(prefix).node
            engine.cache.lock(node)
            pins.append((dep_rid, node))
        return result, failure, pins

    def settled(future: asyncio.Future) -> None:
        if future.cancelled() or future.exception() is not None:
            agent.kv_flight.finish_incoming(request_id, inst=inst)
        else:
            result, _, pins = future.result()
            if result.recomputed_tokens:
                agent.kv_flight.note_recomputed(result.recomputed_tokens)
                log.warning(
                    "%s: recomputed %d prefix tokens the cache lacked (KV counted on never "
                    "landed)", request_id, result.recomputed_tokens,
                )  # fmt: skip
            agent.kv_flight.finish_incoming(request_id, landed=True, pins=pins, inst=inst)

    future = inst.running_worker.call(run)
    future.add_done_callback(settled)
    return future


async def import_kv(future: asyncio.Future) -> Any:
    """Await a `start_import` (shielded: cancelling the caller does not lose its pins)."""
    result, failure, _ = await asyncio.shield(future)
    if failure is not None:
        raise failure
    return result
