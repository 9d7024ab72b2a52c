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
from agents.engine.outputs import ImportResult
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
    """MD's stream of a request: `MainDecode`'s steps, in order."""
    if agent.inbox.released(req.request_id, inst.instance_id):
        # RLD answered the request alone and said so before this call got here.
        yield error_event(f"{req.request_id}: already answered by the relay; its KV is cached here")
        return
    async with aclosing(MainDecode(agent, inst, req).events()) as events:
        async for event in events:
            yield event


class MainDecode:
    """One request on MD: the steps of `events` (receive P's KV, claim the reservation, import,
    take RLD's handoff when held, decode), each ending the stream with one error event when it
    fails (``over``), and what `close` lets go of whatever step the stream ended in."""

    def __init__(self, agent: Agent, inst: Instance, req: DecodeRequest) -> None:
        self.agent, self.inst, self.req = agent, inst, req
        self.rid, self.worker = req.request_id, inst.running_worker
        # The request's inbox: P's KV, RLD's handoff batches, the engine's tokens, a cancel.
        self.queue = agent.inbox.queue(self.rid, inst.instance_id)
        self.every = agent.settings.queued_every_s
        self.kv_timeout = agent.settings.kv_timeout_s
        self.over = False  # a step sent the stream's last event (an error)
        self.payload: bytes | None = None  # P's KV, once received
        self.claim: Claim | None = None
        self.admission: asyncio.Future | None = None  # the import, once queued on the engine
        self.result: ImportResult | None = None
        self.finished = False  # MD's engine said done (only after the import)
        self.detached = False  # the decoding runs as a tail that lets the request go itself
        self.index = 1  # of MD's first token (index 0 is P's)
        self.first_out: TokenOutput | None = None  # made by the handoff's final extend

    async def events(self) -> Events:
        try:
            for step in (self.receive_kv, self.claim_prefix, self.import_delta, self.handoff):
                async with aclosing(step()) as events:
                    async for event in events:
                        yield event
                if self.over:
                    return
            async with aclosing(self.decode()) as events:
                async for event in events:
                    yield event
        finally:
            await self.close()

    def fail(self, message: str, code: str = "") -> dict[str, Any]:
        """The stream's last event: an error naming the request (``code`` ENGINE_FULL when the
        engine had no room)."""
        self.over = True
        return error_event(f"{self.rid}: {message}", code)

    # -- the steps ----------------------------------------------------------------------------

    async def receive_kv(self) -> Events:
        """P's KV, with a keep-alive every ``every`` while it comes (it may cross a busy WAN:
        busy, not frozen), up to the KV timeout. Read with get_within, whose cancellation
        leaves the item queued (the caller may leave as it lands: `close`'s late import must
        still find it)."""
        started = time.monotonic()
        while True:
            left = self.kv_timeout - (time.monotonic() - started)
            try:
                item = await get_within(self.queue, max(0.0, min(self.every, left)))
                break
            except TimeoutError:
                if left <= self.every:
                    yield self.fail(f"no KV from P within {self.kv_timeout} s")
                    return
                yield queued_event(started, "kv")
        if isinstance(item, BaseException):
            self.agent.kv_flight.finish_incoming(self.rid)  # whoever counted on it stops waiting
            yield self.fail(f"KV transfer failed: {item}")
            return
        what, transfer = item
        if what != "kv":
            yield self.fail(f"expected the KV transfer first, got {what!r}")
            return
        self.payload = kv_payload(transfer)

    async def claim_prefix(self) -> Events:
        """The reservation of the cached prefix, once the KV in flight it counted on landed."""
        claimed: list[Claim] = []
        async for event in claiming(self.agent, self.inst, self.rid, claimed, self.every):
            yield event
        self.claim = claimed[0]
        if self.claim.dropped:
            yield self.fail(
                "reservation dropped (cancelled or expired) while waiting for KV in "
                f"flight{self.claim.note}"
            )

    async def import_delta(self) -> Events:
        """P's delta imported on top of the reserved prefix and the request started on the
        engine. The import waits for the engine's step in flight, and a busy engine (one
        behind its model) may take long: keep-alives meanwhile, up to the KV timeout."""
        req, rid, claim = self.req, self.rid, self.claim
        assert claim is not None and self.payload is not None
        queue = self.queue
        self.worker.add_sink(rid, lambda out: queue.put_nowait(("tok", out)))
        self.admission = start_import(
            self.agent,
            self.inst,
            rid,
            req.prompt,
            req.start_token,
            self.payload,
            claim.reservation,
            lambda e: e.start_decode(rid, req.prompt, req.first_token, req.sampling, hold=req.hold),
        )
        importing = asyncio.ensure_future(import_kv(self.admission))
        async with aclosing(
            _while_engine_busy(
                importing, self.every, self.kv_timeout, f"{rid}: the engine did not import the KV"
            )
        ) as waits:
            async for event in waits:
                yield event
        if importing.cancelled():  # not within the KV timeout: the error event went out
            self.over = True
            return
        try:
            self.result = importing.result()
        except (EngineFull, PrefixMissing, ValueError, KeyError) as exc:
            yield self.fail(
                f"cannot import KV: {type(exc).__name__}: {exc}{claim.note}",
                ENGINE_FULL if isinstance(exc, EngineFull) else "",
            )
            return

    async def handoff(self) -> Events:
        """Held for RLD (p-rld-md): ``ready`` once MD has a decode slot for the request (so a
        full MD leaves RLD decoding instead of stalling the stream here), then RLD's handoff
        batches appended in order (``extended`` after each but the final one, which resumes
        the decoding). Nothing to do when not held."""
        if not self.req.hold:
            return
        rid, worker, queue, result = self.rid, self.worker, self.queue, self.result
        assert result is not None
        slot_wait_s = await wait_for_decode_slot(worker, queue)
        yield ReadyEvent(result.local_tokens, result.received_tokens, slot_wait_s).to_json()
        expected = len(self.req.prompt) + 1  # where the next batch starts
        while True:
            item = await queue.get()
            if isinstance(item, BaseException):
                yield self.fail(str(item))
                return
            what, transfer = item
            if what == "tok" or transfer.tokens is None or not what.startswith("h"):
                yield self.fail(f"unexpected {what!r} while held for the handoff")
                return
            if transfer.tokens.token_start != expected:
                yield self.fail(
                    f"handoff batch starts at {transfer.tokens.token_start}, expected {expected}"
                )
                return
            ids = list(transfer.tokens.ids)
            final = what.endswith(".final")
            try:
                out = await worker.call(_extend(rid, ids, final))
            except (EngineFull, ValueError) as exc:
                yield self.fail(f"extend failed: {exc}")
                return
            expected += len(ids)
            handed = expected - len(self.req.prompt) - 1
            if not final:
                yield ExtendedEvent(1 + handed).to_json()
                continue
            # MD's first tokens after the handoff go out through the decode loop, ahead of
            # anything the engine has queued since.
            self.index, self.first_out = 1 + handed, out
            return

    async def decode(self) -> Events:
        """MD's token events, then ``done``: read here, or, when RLD's gateway reads MD's
        stream itself after the handoff (``detachable``: one hop per token), run as a tail of
        its own (agents/node/tail.py) that this stream (RLD's) reads first."""
        agent, inst, rid = self.agent, self.inst, self.rid
        decoded = _decoded(agent, inst, rid, self.queue, self.index, self.first_out)
        if self.req.hold and self.req.detachable:
            tail = Tail(rid, inst.instance_id, agent.settings.handoff_attach_s)
            agent.instances.begin(inst)
            agent.tails.start(tail, decoded, _tail_cleanup(agent, inst, rid))
            self.detached = True
            async for event in tail.read(self.index):
                yield event
            return
        first = asyncio.ensure_future(anext(decoded, None))
        async with aclosing(
            _while_engine_busy(
                first, self.every, self.kv_timeout, f"{rid}: no first token from the engine"
            )
        ) as waits:
            async for event in waits:
                yield event
        if first.cancelled():
            return
        out: dict[str, Any] | None = first.result()
        while out is not None:
            self.finished = self.finished or out.get("type") == "done"
            yield out
            out = await anext(decoded, None)

    async def close(self) -> None:
        """Let the request go, whichever step the stream ended in."""
        if self.detached:
            return  # the tail's cleanup lets the request go when it ends
        if self.admission is not None or (self.claim is not None and self.claim.dropped):
            # The import was queued on the engine (and the request finished, or did not, or the
            # import failed, or the caller left meanwhile: this abort runs after it), or the
            # reservation was dropped: let the request go. Whatever was imported stays in the
            # prefix cache, so MD's cache stays aligned with P's.
            await _let_go(
                self.agent,
                self.inst,
                self.worker,
                self.rid,
                finished=self.finished,
            )
            return
        self.worker.remove_sink(self.rid)
        # The caller left before P's KV was imported (RLD finished alone): keep the KV anyway,
        # or MD's cache falls behind P's and every later turn becomes low-hit (docs/pdd.md).
        fire_and_forget(
            self.agent, cache_late_kv(self.agent, self.inst, self.req, self.queue, self.payload)
        )


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
