"""MD, the main decode: reserve the cached prefix (DRC) for a request, import P's delta on
top of it (after any KV in flight it counted on has landed), then decode (p-md) or wait held
for RLD's handoff batches and continue from the final one (p-rld-md). A caller that leaves
before the import still leaves the KV cached (`main_stream_closed`, `_cache_late_kv`), and so
does a request RLD answered alone whose decode call never reached MD (`release_main`)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agents.engine import EngineFull, PrefixMissing, SamplingParams, TokenOutput
from agents.engine.core import EngineCore as Engine
from agents.node.agent import Agent, Incoming, Instance, Reservation, unlock_all
from agents.node.inflight import as_tokens
from agents.node.pipeline_common import (
    Events,
    error_event,
    fire_and_forget,
    get_within,
    kv_payload,
    queued_event,
    quiet,
    token_event,
)
from agents.node.tail import Tail
from agents.node.wire import output_logprob
from agents.node.worker import EngineWorker
from pdd.events import ENGINE_FULL, ExtendedEvent, ReadyEvent

log = logging.getLogger(__name__)


@dataclass(slots=True)
class DecodeRequest:
    request_id: str
    prompt: list[int]
    first_token: int
    sampling: SamplingParams
    start_token: int
    hold: bool
    # RLD's gateway reads MD's stream itself after the handoff (``detachable``): the decoding
    # outlives RLD's held stream as a tail (agents/node/tail.py), attached to from an index.
    detachable: bool = False


async def reserve_prefix(agent: Agent, inst: Instance, request_id: str, prompt: list[int]) -> int:
    """Pin the longest cached whole-block prefix of `prompt` for this request until its KV is
    imported (or the reservation expires / is cancelled); returns its length.

    KV committed to this instance counts too (agents/node/inflight.py): when a request whose
    KV is still in flight here shares a longer whole-block prefix with `prompt`, that length
    is the answer and this request's import first waits for that KV to land (its import pins
    the prefix for this reservation). This request's own KV becomes incoming in turn. A
    second call for the same request returns the existing reservation."""
    existing = agent.reservations.get(request_id)
    if existing is not None and existing.instance_id == inst.instance_id:
        return existing.cached_tokens
    tokens = as_tokens(prompt)

    def pin(engine):
        match = engine.cache.match_prefix(prompt)
        engine.cache.lock(match.node)
        return match.node, match.matched_tokens

    node, matched = await inst.running_worker.call(pin)
    current = agent.reservations.get(request_id)
    if current is not None and current.instance_id == inst.instance_id:
        # A concurrent call for the same request got there first: keep its reservation.
        inst.running_worker.call(lambda engine: engine.cache.unlock(node))
        return current.cached_tokens
    if current is not None:
        await agent.unreserve(request_id)
    now = time.monotonic()
    reservation = Reservation(inst.instance_id, [node], matched, now)
    source, counted = agent.best_incoming(inst.instance_id, tokens, request_id)
    if source is not None and counted > matched:
        reservation.cached_tokens = counted
        reservation.depends_on = source
        source.dependents.append((request_id, prompt[:counted]))
        agent.in_flight_prefix_hits += 1
    agent.reservations[request_id] = reservation
    agent.incoming[request_id] = Incoming(request_id, inst.instance_id, tokens, now)
    return reservation.cached_tokens


@dataclass(slots=True)
class _Claim:
    reservation: Reservation | None  # taken: its pins are unlocked by the import
    note: str  # what the reservation counted on, for an error message
    dropped: bool = False  # cancelled or expired while waiting for KV in flight


async def claim_reservation(agent: Agent, inst: Instance, request_id: str) -> _Claim:
    """Take request_id's reservation for its import. When it counted on another request's KV
    in flight to this instance, first wait (at most kv_timeout_s) until that KV landed, failed
    or was dropped, or until this reservation is dropped itself."""
    claimed: list[_Claim] = []
    async for _ in claiming(agent, inst, request_id, claimed):
        pass
    return claimed[0]


async def claiming(
    agent: Agent,
    inst: Instance,
    request_id: str,
    claimed: list[_Claim],
    every_s: float | None = None,
) -> Events:
    """`claim_reservation` as a stream: a keep-alive (``queued``, waiting for kv) every
    ``every_s`` (None: none) while the KV in flight it counted on is still coming, the claim
    appended to ``claimed`` at the end."""
    res = agent.reservations.get(request_id)
    if res is None or res.instance_id != inst.instance_id:
        claimed.append(_Claim(None, ""))
        return
    res.claimed = True
    source = res.depends_on
    if source is None:
        agent.reservations.pop(request_id, None)
        claimed.append(_Claim(res, ""))
        return
    started = time.monotonic()
    own = agent.incoming.get(request_id)
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
    if agent.reservations.get(request_id) is not res:
        claimed.append(_Claim(None, where + ")", dropped=True))
        return
    agent.reservations.pop(request_id, None)
    if not source.done.is_set():
        note = f", which did not land within {agent.settings.kv_timeout_s} s)"
    elif not source.landed:
        note = ", whose import failed or was cancelled)"
    else:
        note = ")"
    claimed.append(_Claim(res, where + note))


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
    incoming = agent.incoming.get(request_id)
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
            agent.finish_incoming(request_id, inst=inst)
        else:
            result, _, pins = future.result()
            if result.recomputed_tokens:
                agent.recomputed_imports += 1
                agent.recomputed_tokens += result.recomputed_tokens
                log.warning(
                    "%s: recomputed %d prefix tokens the cache lacked (KV counted on never "
                    "landed)", request_id, result.recomputed_tokens,
                )  # fmt: skip
            agent.finish_incoming(request_id, landed=True, pins=pins, inst=inst)

    future = inst.running_worker.call(run)
    future.add_done_callback(settled)
    return future


async def import_kv(future: asyncio.Future) -> Any:
    """Await a `start_import` (shielded: cancelling the caller does not lose its pins)."""
    result, failure, _ = await asyncio.shield(future)
    if failure is not None:
        raise failure
    return result


SLOT_POLL_S = 0.01


def _extend(request_id: str, ids: list[int], final: bool) -> Callable[[Engine], TokenOutput | None]:
    """The engine call that appends a handoff batch to a held request (resuming its decoding
    after the final one), with the batch bound now."""
    return lambda e: e.extend(request_id, ids, resume=final)


async def _wait_for_decode_slot(worker: EngineWorker, queue: asyncio.Queue) -> float:
    """Seconds waited until the engine has a decode slot for one more request, or until
    anything reaches the request's inbox (a cancel, which the caller then handles)."""
    start = time.monotonic()
    while queue.empty() and not await worker.call(lambda e: e.has_decode_slot()):
        await asyncio.sleep(SLOT_POLL_S)
    return time.monotonic() - start


async def run_main(agent: Agent, inst: Instance, req: DecodeRequest) -> Events:
    rid, worker = req.request_id, inst.running_worker
    if agent.released(rid, inst.instance_id):
        # RLD answered the request alone and said so before this call got here.
        yield error_event(f"{rid}: already answered by the relay; its KV is cached here")
        return
    queue = agent.inbox(rid, inst.instance_id)
    length = len(req.prompt)
    imported = finished = dropped = detached = False
    payload: bytes | None = None
    admission: asyncio.Future | None = None
    every, kv_timeout = agent.settings.queued_every_s, agent.settings.kv_timeout_s
    try:
        # The KV may cross a busy WAN: a keep-alive while it comes (busy, not frozen). Read
        # with get_within, whose cancellation leaves the item queued (the caller may leave
        # as it lands: the late import below must still find it).
        started = time.monotonic()
        while True:
            left = kv_timeout - (time.monotonic() - started)
            try:
                item = await get_within(queue, max(0.0, min(every, left)))
                break
            except TimeoutError:
                if left <= every:
                    item = None
                    break
                yield queued_event(started, "kv")
        if item is None:
            yield error_event(f"{rid}: no KV from P within {kv_timeout} s")
            return
        if isinstance(item, BaseException):
            agent.finish_incoming(rid)  # no KV is coming: whoever counted on it stops waiting
            yield error_event(f"{rid}: KV transfer failed: {item}")
            return
        what, transfer = item
        if what != "kv":
            yield error_event(f"{rid}: expected the KV transfer first, got {what!r}")
            return
        payload = kv_payload(transfer)
        claimed: list[_Claim] = []
        async for event in claiming(agent, inst, rid, claimed, every):  # KV it counted on
            yield event
        claim = claimed[0]
        if claim.dropped:
            dropped = True
            yield error_event(
                f"{rid}: reservation dropped (cancelled or expired) while waiting for KV in "
                f"flight{claim.note}"
            )
            return
        worker.add_sink(rid, lambda out: queue.put_nowait(("tok", out)))
        admission = start_import(
            agent,
            inst,
            rid,
            req.prompt,
            req.start_token,
            payload,
            claim.reservation,
            lambda e: e.start_decode(rid, req.prompt, req.first_token, req.sampling, hold=req.hold),
        )
        try:
            result = await import_kv(admission)
        except (EngineFull, PrefixMissing, ValueError, KeyError) as exc:
            yield error_event(
                f"{rid}: cannot import KV: {type(exc).__name__}: {exc}{claim.note}",
                ENGINE_FULL if isinstance(exc, EngineFull) else "",
            )
            return
        imported = True
        index = 1  # index 0 is P's first token
        first_out = None
        if req.hold:
            # RLD hands off when MD is ready; MD is ready when it has a decode slot for the
            # request, so a full MD leaves RLD decoding instead of stalling the stream here.
            slot_wait_s = await _wait_for_decode_slot(worker, queue)
            yield ReadyEvent(result.local_tokens, result.received_tokens, slot_wait_s).to_json()
            handed = 0
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    yield error_event(f"{rid}: {item}")
                    return
                what, transfer = item
                if what == "tok" or transfer.tokens is None or not what.startswith("h"):
                    yield error_event(f"{rid}: unexpected {what!r} while held for the handoff")
                    return
                ids = list(transfer.tokens.ids)
                if transfer.tokens.token_start != length + 1 + handed:
                    yield error_event(
                        f"{rid}: handoff batch starts at {transfer.tokens.token_start}, "
                        f"expected {length + 1 + handed}"
                    )
                    return
                final = what.endswith(".final")
                try:
                    out = await worker.call(_extend(rid, ids, final))
                except (EngineFull, ValueError) as exc:
                    yield error_event(f"{rid}: extend failed: {exc}")
                    return
                handed += len(ids)
                if not final:
                    yield ExtendedEvent(1 + handed).to_json()
                    continue
                index = 1 + handed
                # MD's first tokens after the handoff go out through the decode loop, ahead
                # of anything the engine has queued since.
                first_out = out
                break
        decoded = _decoded(agent, inst, rid, queue, index, first_out)
        if req.hold and req.detachable:
            # The gateway reads MD's stream itself once RLD let go (one hop per token): the
            # decoding runs as a tail of its own, which this stream (RLD's) reads first.
            tail = Tail(rid, inst.instance_id, agent.settings.handoff_attach_s)
            agent.begin(inst)
            agent.tails.start(tail, decoded, _tail_cleanup(agent, inst, rid))
            detached = True
            async for event in tail.read(index):
                yield event
            return
        async for event in decoded:
            finished = finished or event.get("type") == "done"
            yield event
    finally:
        if detached:
            pass  # the tail's cleanup lets the request go when it ends
        elif imported or admission is not None or dropped:
            # Finished; or imported but not finished, or the import was queued on the engine
            # (and failed, or the caller left meanwhile: this abort runs after it), or the
            # reservation was dropped: let the request go. Whatever was imported stays in the
            # prefix cache, so MD's cache stays aligned with P's.
            await _let_go(agent, inst, worker, rid, finished=imported and finished)
        else:
            worker.remove_sink(rid)
            # The caller left before P's KV was imported (RLD finished alone): keep the KV
            # anyway, or MD's cache falls behind P's and every later turn becomes low-hit
            # (docs/pdd.md).
            fire_and_forget(agent, _cache_late_kv(agent, inst, req, queue, payload))


async def _decoded(
    agent: Agent,
    inst: Instance,
    rid: str,
    queue: asyncio.Queue,
    index: int,
    first_out: TokenOutput | None,
) -> Events:
    """MD's token events from `index` on (its first output `first_out`, when the handoff's
    extend made one), then ``done``, or an error event."""
    while True:
        if first_out is not None:
            what, out, first_out = "tok", first_out, None
        else:
            item = await queue.get()
            if isinstance(item, BaseException):
                yield error_event(f"{rid}: {item}")
                return
            what, out = item
        if what != "tok":
            yield error_event(f"{rid}: unexpected transfer {what!r} while decoding")
            return
        for j, tok in enumerate(out.token_ids):
            agent.count_tokens(inst)
            yield token_event(index, tok, "md", output_logprob(out, j))
            index += 1
        if out.finished:
            yield {"type": "done", "finish_reason": out.finish_reason}
            return


async def _let_go(
    agent: Agent, inst: Instance, worker: EngineWorker | None, rid: str, *, finished: bool
) -> None:
    """A decoded (or failed) request is over on MD: its sink and inbox go, the engine lets it
    go unless it finished (its KV stays in the prefix cache), its reservation is released."""
    if worker is not None:
        worker.remove_sink(rid)
    agent.drop_inbox(rid, inst.instance_id)
    if not finished and worker is not None:
        await quiet(worker.call(lambda e: e.abort(rid)))
    await agent.unreserve(rid)


def _tail_cleanup(agent: Agent, inst: Instance, rid: str) -> Callable[[bool], Any]:
    """What ends a detached request on MD (agents/node/tail.py): `_let_go`, and the
    instance's active count the tail held."""

    async def cleanup(finished: bool) -> None:
        try:
            await _let_go(agent, inst, inst.worker, rid, finished=finished)
        finally:
            agent.end(inst)

    return cleanup


async def main_stream_closed(agent: Agent, inst: Instance, req: DecodeRequest) -> None:
    """MD's decode stream is over. If its caller left before ``run_main`` even started (RLD
    finished a short request within moments), nothing ran ``run_main``'s own cleanup, so the
    KV P sent is cached here the same way (MD's prefix cache must not fall behind P's)."""
    if not agent.consumer_started(req.request_id, inst.instance_id):
        queue = agent.inbox(req.request_id, inst.instance_id)
        fire_and_forget(agent, _cache_late_kv(agent, inst, req, queue))


def release_main(agent: Agent, inst: Instance, request_id: str, start_token: int) -> bool:
    """RLD answered request_id alone (POST /v1/pdd/release). When MD's decode call for it never
    started here (RLD's call was cut before MD read it, or MD was too slow to start it), cache
    the KV P sends all the same, from the prompt the reservation recorded; a decode call that
    comes later ends at once. False: a decode call has the request (its own cleanup caches
    the KV), or nothing was reserved for it here. ValueError: start_token beyond the prompt."""
    incoming = agent.incoming.get(request_id)
    if incoming is None or incoming.instance_id != inst.instance_id:
        return False
    prompt = [int(t) for t in incoming.tokens]
    if start_token > len(prompt):
        raise ValueError(f"beyond the reserved prompt's {len(prompt)} tokens")
    queue = agent.claim_released(request_id, inst.instance_id)
    if queue is None:
        return False
    req = DecodeRequest(request_id, prompt, 0, SamplingParams(max_tokens=1), start_token, True)
    fire_and_forget(agent, _cache_late_kv(agent, inst, req, queue))
    return True


async def _cache_late_kv(
    agent: Agent, inst: Instance, req: DecodeRequest, queue, payload: bytes | None = None
) -> None:
    """Wait (bounded) for a request's KV unless it already arrived (`payload`), import it into
    the prefix cache (after any KV in flight it counted on), and let it go."""
    rid, worker = req.request_id, inst.worker
    try:
        if worker is None:
            return
        if payload is None:
            item = await get_within(queue, agent.settings.kv_timeout_s)
            if isinstance(item, BaseException) or item[0] != "kv":
                return  # cancelled, failed or not KV: nothing to keep
            payload = kv_payload(item[1])
        claim = await claim_reservation(agent, inst, rid)
        if claim.dropped:
            return
        # A held request once imported: abort it, its blocks stay in the radix cache.
        await import_kv(
            start_import(
                agent,
                inst,
                rid,
                req.prompt,
                req.start_token,
                payload,
                claim.reservation,
                lambda e: e.abort(rid),
            )
        )
        agent.late_kv_cached += 1
    except Exception as exc:  # noqa: BLE001 - best effort; the request itself is done
        log.info("%s: late KV not cached: %r", rid, exc)
    finally:
        agent.drop_inbox(rid, inst.instance_id)
        await agent.unreserve(rid)
