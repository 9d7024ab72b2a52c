"""MD, the main decode: with the cached prefix reserved for a request (DRC, decode_kv.py),
import P's delta on top of it (after any KV in flight it counted on has landed), then decode
(p-md) or wait held for RLD's handoff batches and continue from the final one (p-rld-md). A
caller that leaves before the import still leaves the KV cached (`main_stream_closed`,
`cache_late_kv`), and so does a request RLD answered alone whose decode call never reached
MD (`release_main`)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from agents.engine import EngineFull, PrefixMissing, SamplingParams, TokenOutput
from agents.engine.core import EngineCore as Engine
from agents.node.agent import Agent
from agents.node.decode_kv import Claim, claim_reservation, claiming, import_kv, start_import
from agents.node.instances import Instance
from agents.node.pipeline_common import (
    Events,
    error_event,
    fire_and_forget,
    get_within,
    keep_alive,
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


SLOT_POLL_S = 0.01


def _extend(request_id: str, ids: list[int], final: bool) -> Callable[[Engine], TokenOutput | None]:
    """The engine call that appends a handoff batch to a held request (resuming its decoding
    after the final one), with the batch bound now."""
    return lambda e: e.extend(request_id, ids, resume=final)


async def wait_for_decode_slot(worker: EngineWorker, queue: asyncio.Queue) -> float:
    """Seconds waited until the engine has a decode slot for one more request, or until
    anything reaches the request's inbox (a cancel, which the caller then handles)."""
    start = time.monotonic()
    while queue.empty() and not await worker.call(lambda e: e.has_decode_slot()):
        await asyncio.sleep(SLOT_POLL_S)
    return time.monotonic() - start


async def run_main(agent: Agent, inst: Instance, req: DecodeRequest) -> Events:
    rid, worker = req.request_id, inst.running_worker
    if agent.inbox.released(rid, inst.instance_id):
        # RLD answered the request alone and said so before this call got here.
        yield error_event(f"{rid}: already answered by the relay; its KV is cached here")
        return
    queue = agent.inbox.queue(rid, inst.instance_id)
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
            agent.kv_flight.finish_incoming(
                rid
            )  # no KV is coming: whoever counted on it stops waiting
            yield error_event(f"{rid}: KV transfer failed: {item}")
            return
        what, transfer = item
        if what != "kv":
            yield error_event(f"{rid}: expected the KV transfer first, got {what!r}")
            return
        payload = kv_payload(transfer)
        claimed: list[Claim] = []
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
        # The import waits for the engine's step in flight, and a busy engine (one behind
        # its model) may take long: keep-alives meanwhile (busy, not frozen), up to the KV
        # timeout. Then the first token below, the same way.
        importing = asyncio.ensure_future(import_kv(admission))
        async with aclosing(
            _while_engine_busy(
                importing, every, kv_timeout, f"{rid}: the engine did not import the KV"
            )
        ) as waits:
            async for event in waits:
                yield event
        if importing.cancelled():  # not within the KV timeout: the error event went out
            return
        try:
            result = importing.result()
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
            slot_wait_s = await wait_for_decode_slot(worker, queue)
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
            agent.instances.begin(inst)
            agent.tails.start(tail, decoded, _tail_cleanup(agent, inst, rid))
            detached = True
            async for event in tail.read(index):
                yield event
            return
        first = asyncio.ensure_future(anext(decoded, None))
        async with aclosing(
            _while_engine_busy(first, every, kv_timeout, f"{rid}: no first token from the engine")
        ) as waits:
            async for event in waits:
                yield event
        if first.cancelled():
            return
        decoded_event: dict[str, Any] | None = first.result()
        while decoded_event is not None:
            finished = finished or decoded_event.get("type") == "done"
            yield decoded_event
            decoded_event = await anext(decoded, None)
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
            fire_and_forget(agent, cache_late_kv(agent, inst, req, queue, payload))


async def _while_engine_busy(
    task: asyncio.Future, every: float, limit_s: float, what: str
) -> Events:
    """Keep-alives (``queued``, waiting for the engine) every ``every`` while ``task`` runs; not
    done within ``limit_s``: the task cancelled and one error event, "<what> within <limit> s".
    The caller reads the task's result, or returns when it was cancelled."""
    try:
        async with aclosing(keep_alive(task, every, "engine", limit_s)) as alive:
            async for event in alive:
                yield event
    except TimeoutError:
        yield error_event(f"{what} within {limit_s} s")


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
            agent.instances.count_tokens(inst)
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
    agent.inbox.drop(rid, inst.instance_id)
    if not finished and worker is not None:
        await quiet(worker.call(lambda e: e.abort(rid)))
    await agent.kv_flight.unreserve(rid)


def _tail_cleanup(agent: Agent, inst: Instance, rid: str) -> Callable[[bool], Any]:
    """What ends a detached request on MD (agents/node/tail.py): `_let_go`, and the
    instance's active count the tail held."""

    async def cleanup(finished: bool) -> None:
        try:
            await _let_go(agent, inst, inst.worker, rid, finished=finished)
        finally:
            agent.instances.end(inst)

    return cleanup


async def main_stream_closed(agent: Agent, inst: Instance, req: DecodeRequest) -> None:
    """MD's decode stream is over. If its caller left before ``run_main`` even started (RLD
    finished a short request within moments), nothing ran ``run_main``'s own cleanup, so the
    KV P sent is cached here the same way (MD's prefix cache must not fall behind P's)."""
    if not agent.inbox.consumer_started(req.request_id, inst.instance_id):
        queue = agent.inbox.queue(req.request_id, inst.instance_id)
        fire_and_forget(agent, cache_late_kv(agent, inst, req, queue))


def release_main(agent: Agent, inst: Instance, request_id: str, start_token: int) -> bool:
    """RLD answered request_id alone (POST /v1/pdd/release). When MD's decode call for it never
    started here (RLD's call was cut before MD read it, or MD was too slow to start it), cache
    the KV P sends all the same, from the prompt the reservation recorded; a decode call that
    comes later ends at once. False: a decode call has the request (its own cleanup caches
    the KV), or nothing was reserved for it here. ValueError: start_token beyond the prompt."""
    incoming = agent.kv_flight.incoming_of(request_id)
    if incoming is None or incoming.instance_id != inst.instance_id:
        return False
    prompt = [int(t) for t in incoming.tokens]
    if start_token > len(prompt):
        raise ValueError(f"beyond the reserved prompt's {len(prompt)} tokens")
    queue = agent.inbox.claim_released(request_id, inst.instance_id)
    if queue is None:
        return False
    req = DecodeRequest(request_id, prompt, 0, SamplingParams(max_tokens=1), start_token, True)
    fire_and_forget(agent, cache_late_kv(agent, inst, req, queue))
    return True


async def cache_late_kv(
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
        agent.kv_flight.note_late_cached()
    except Exception as exc:  # noqa: BLE001 - best effort; the request itself is done
        log.info("%s: late KV not cached: %r", rid, exc)
    finally:
        agent.inbox.drop(rid, inst.instance_id)
        await agent.kv_flight.unreserve(rid)
