"""The PDD pipelines across agents, one coroutine per role:

- `run_prefill` (P): prefill, pin MD's cached prefix (DRC), ship the delta over the WAN to MD
  and, for p-rld-md, the full KV over the intra-DC fabric to RLD at the same time, and relay
  the token stream of RLD (or MD) to the caller.
- `run_relay` (RLD): decode at once, stream tokens, hand off to MD by token ids (one-shot or
  catch-up), relay MD's continuation; if MD or the WAN fails first, finish the request itself.
- `run_main` (MD): import the delta on top of the cached prefix (after the KV it counted on
  as in flight to it has landed, see `reserve_prefix`), then decode (p-md) or wait held for
  the handoff batches and continue from the final one (p-rld-md).
- `run_single`: the whole request on one engine, no transfer (the baseline).

Each yields NDJSON-ready event dicts; see agents/PROTOCOL.md, "Data plane"."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from agents.engine import EngineFull, PrefixMissing, SamplingParams, TokenOutput
from agents.node.agent import (
    SEP,
    Agent,
    AgentError,
    Incoming,
    Instance,
    Reservation,
    unlock_all,
)
from agents.node.inflight import as_tokens
from agents.node.wire import (
    ROLE_SHORT,
    HandoffPlan,
    Peer,
    error_event,
    sampling_json,
    token_event,
)
from agents.node.worker import EngineWorker
from agents.transfer.records import KVChunk, TokenIds, Transfer, TransferStats

log = logging.getLogger(__name__)

# How long a finished relay lets its in-flight handoff batches (token IDs) reach MD.
HANDOFF_SEND_GRACE_S = 5.0
Events = AsyncIterator[dict[str, Any]]


class PeerFailed(Exception):
    """A peer agent answered with an error, or its stream broke."""


def transfer_id(request_id: str, instance_id: str, what: str) -> str:
    return SEP.join((request_id, instance_id, what))


def kv_payload(transfer: Transfer) -> bytes:
    return b"".join(bytes(chunk.payload) for chunk in transfer.chunks)


async def pump_stream(
    http: httpx.AsyncClient, url: str, body: dict, out: asyncio.Queue, tag: str
) -> None:
    """POST body to a peer's NDJSON endpoint; put (tag, event) for each line and finally
    (tag + "_closed", None | exception) on `out`."""
    try:
        timeout = httpx.Timeout(30.0, read=None)
        async with http.stream("POST", url, json=body, timeout=timeout) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")[:500]
                raise PeerFailed(f"{url}: HTTP {response.status_code}: {text}")
            async for line in response.aiter_lines():
                if line.strip():
                    out.put_nowait((tag, json.loads(line)))
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure of the peer is reported, not raised
        out.put_nowait((tag + "_closed", exc))
    else:
        out.put_nowait((tag + "_closed", None))


def fire_and_forget(agent: Agent, coro) -> None:
    task = asyncio.create_task(coro)
    agent.background.add(task)
    task.add_done_callback(agent.background.discard)


async def _settle(tasks: list[asyncio.Task], grace_s: float) -> None:
    """Give tasks ``grace_s`` to finish, then cancel what is left."""
    _, pending = await asyncio.wait(tasks, timeout=grace_s)
    for task in pending:
        task.cancel()


async def cancel_remote(agent: Agent, peer: Peer | None, request_id: str) -> None:
    if peer is None:
        return
    try:
        await agent.http.post(
            f"{peer.http}/v1/pdd/cancel", json={"request_id": request_id}, timeout=5.0
        )
    except Exception as exc:  # noqa: BLE001 - best effort: the peer may be gone
        log.info("cancel of %s at %s failed: %r", request_id, peer.http, exc)


# -- single ------------------------------------------------------------------------------------


async def admit_single(
    agent: Agent, inst: Instance, request_id: str, prompt: list[int], sampling: SamplingParams
) -> asyncio.Queue:
    """Queue the request on the engine (EngineFull / ValueError surface before streaming)."""
    queue = agent.inbox(request_id, inst.instance_id)
    inst.worker.add_sink(request_id, lambda out: queue.put_nowait(("tok", out)))
    try:
        await inst.worker.call(lambda e: e.add_request(request_id, prompt, sampling))
    except BaseException:
        inst.worker.remove_sink(request_id)
        agent.drop_inbox(request_id, inst.instance_id)
        raise
    return queue


async def run_single(
    agent: Agent, inst: Instance, request_id: str, queue: asyncio.Queue, started: float
) -> Events:
    role = ROLE_SHORT[inst.role]
    index, ttft = 0, None
    finished = False
    try:
        while True:
            item = await queue.get()
            if isinstance(item, BaseException):
                yield error_event(f"{request_id}: {item}")
                return
            _, out = item
            for tok in out.token_ids:
                ttft = ttft if ttft is not None else time.monotonic() - started
                agent.count_tokens(inst)
                yield token_event(index, tok, role)
                index += 1
            if out.finished:
                finished = True
                yield {
                    "type": "done",
                    "finish_reason": out.finish_reason,
                    "stats": {
                        "ttft_s": ttft,
                        "e2e_s": time.monotonic() - started,
                        "tokens_by_role": {role: index},
                        "pipeline": "single",
                    },
                }
                return
    finally:
        inst.worker.remove_sink(request_id)
        agent.drop_inbox(request_id, inst.instance_id)
        if not finished:
            await _quiet(inst.worker.call(lambda e: e.abort(request_id)))


async def _quiet(future) -> Any:
    try:
        return await future
    except Exception as exc:  # noqa: BLE001
        log.info("cleanup step failed: %r", exc)
        return None


# -- MD ----------------------------------------------------------------------------------------


@dataclass(slots=True)
class DecodeRequest:
    request_id: str
    prompt: list[int]
    first_token: int
    sampling: SamplingParams
    start_token: int
    hold: bool


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

    node, matched = await inst.worker.call(pin)
    current = agent.reservations.get(request_id)
    if current is not None and current.instance_id == inst.instance_id:
        # A concurrent call for the same request got there first: keep its reservation.
        inst.worker.call(lambda engine: engine.cache.unlock(node))
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
    res = agent.reservations.get(request_id)
    if res is None or res.instance_id != inst.instance_id:
        return _Claim(None, "")
    res.claimed = True
    source = res.depends_on
    if source is None:
        agent.reservations.pop(request_id, None)
        return _Claim(res, "")
    if not source.done.is_set():
        waits = [asyncio.ensure_future(source.done.wait())]
        own = agent.incoming.get(request_id)
        if own is not None:
            waits.append(asyncio.ensure_future(own.done.wait()))
        try:
            await asyncio.wait(
                waits, timeout=agent.settings.kv_timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for waiter in waits:
                waiter.cancel()
    where = f" (counted on the KV of request {source.request_id} in flight to this instance"
    if agent.reservations.get(request_id) is not res:
        return _Claim(None, where + ")", dropped=True)
    agent.reservations.pop(request_id, None)
    if not source.done.is_set():
        note = f", which did not land within {agent.settings.kv_timeout_s} s)"
    elif not source.landed:
        note = ", whose import failed or was cancelled)"
    else:
        note = ")"
    return _Claim(res, where + note)


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

    future = inst.worker.call(run)
    future.add_done_callback(settled)
    return future


async def import_kv(future: asyncio.Future) -> Any:
    """Await a `start_import` (shielded: cancelling the caller does not lose its pins)."""
    result, failure, _ = await asyncio.shield(future)
    if failure is not None:
        raise failure
    return result


SLOT_POLL_S = 0.01


async def _wait_for_decode_slot(worker: EngineWorker, queue: asyncio.Queue) -> float:
    """Seconds waited until the engine has a decode slot for one more request, or until
    anything reaches the request's inbox (a cancel, which the caller then handles)."""
    start = time.monotonic()
    while queue.empty() and not await worker.call(lambda e: e.has_decode_slot()):
        await asyncio.sleep(SLOT_POLL_S)
    return time.monotonic() - start


async def run_main(agent: Agent, inst: Instance, req: DecodeRequest) -> Events:
    rid, worker = req.request_id, inst.worker
    queue = agent.inbox(rid, inst.instance_id)
    length = len(req.prompt)
    imported = finished = dropped = False
    payload: bytes | None = None
    admission: asyncio.Future | None = None
    try:
        try:
            item = await asyncio.wait_for(queue.get(), agent.settings.kv_timeout_s)
        except TimeoutError:
            yield error_event(f"{rid}: no KV from P within {agent.settings.kv_timeout_s} s")
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
        claim = await claim_reservation(agent, inst, rid)
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
            yield error_event(f"{rid}: cannot import KV: {type(exc).__name__}: {exc}{claim.note}")
            return
        imported = True
        index = 1  # index 0 is P's first token
        first_out = None
        if req.hold:
            # RLD hands off when MD is ready; MD is ready when it has a decode slot for the
            # request, so a full MD leaves RLD decoding instead of stalling the stream here.
            slot_wait_s = await _wait_for_decode_slot(worker, queue)
            yield {
                "type": "ready",
                "cached_tokens": result.local_tokens,
                "received_tokens": result.received_tokens,
                "slot_wait_s": round(slot_wait_s, 4),
            }
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
                    out = await worker.call(
                        lambda e, ids=ids, final=final: e.extend(rid, ids, resume=final)
                    )
                except (EngineFull, ValueError) as exc:
                    yield error_event(f"{rid}: extend failed: {exc}")
                    return
                handed += len(ids)
                if not final:
                    yield {"type": "extended", "upto": 1 + handed}
                    continue
                index = 1 + handed
                # MD's first tokens after the handoff go out through the decode loop, ahead
                # of anything the engine has queued since.
                first_out = out
                break
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
            for tok in out.token_ids:
                agent.count_tokens(inst)
                yield token_event(index, tok, "md")
                index += 1
            if out.finished:
                finished = True
                yield {"type": "done", "finish_reason": out.finish_reason}
                return
    finally:
        worker.remove_sink(rid)
        if imported and finished:
            agent.drop_inbox(rid, inst.instance_id)
            await agent.unreserve(rid)
        elif imported or admission is not None or dropped:
            # Imported but not finished, or the import was queued on the engine (and failed, or
            # the caller left meanwhile: this abort runs after it), or the reservation was
            # dropped: let the request go. Whatever was imported stays in the prefix cache, so
            # MD's cache stays aligned with P's.
            agent.drop_inbox(rid, inst.instance_id)
            await _quiet(worker.call(lambda e: e.abort(rid)))
            await agent.unreserve(rid)
        else:
            # The caller left before P's KV was imported (RLD finished alone): keep the KV
            # anyway, or MD's cache falls behind P's and every later turn becomes low-hit
            # (PDD.md).
            fire_and_forget(agent, _cache_late_kv(agent, inst, req, queue, payload))


async def main_stream_closed(agent: Agent, inst: Instance, req: DecodeRequest) -> None:
    """MD's decode stream is over. If its caller left before ``run_main`` even started (RLD
    finished a short request within moments), nothing ran ``run_main``'s own cleanup, so the
    KV P sent is cached here the same way (MD's prefix cache must not fall behind P's)."""
    if not agent.consumer_started(req.request_id, inst.instance_id):
        queue = agent.inbox(req.request_id, inst.instance_id)
        fire_and_forget(agent, _cache_late_kv(agent, inst, req, queue))


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
            item = await asyncio.wait_for(queue.get(), agent.settings.kv_timeout_s)
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


# -- RLD ---------------------------------------------------------------------------------------


@dataclass(slots=True)
class RelayRequest:
    request_id: str
    prompt: list[int]
    first_token: int
    sampling: SamplingParams
    main: Peer | None
    main_start_token: int
    plan: HandoffPlan


@dataclass
class _Handoff:
    mode: str
    at_token: int | None = None  # index of the first token MD produced
    batches: int = 0
    completed: bool = False
    failed: str | None = None
    bytes: int = 0
    tokens_handed: int = 0
    inflight: bool = False
    md_ready: bool = False
    slot_wait_s: float = 0.0  # how long MD waited for a decode slot before it was ready
    sent: list[asyncio.Task] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "at_token": self.at_token,
            "batches": self.batches,
            "completed": self.completed,
            "failed": self.failed,
            "tokens_handed": self.tokens_handed,
            "slot_wait_s": self.slot_wait_s,
        }


async def run_relay(agent: Agent, inst: Instance, req: RelayRequest) -> Events:
    rid, worker, plan, main = req.request_id, inst.worker, req.plan, req.main
    length = len(req.prompt)
    queue = agent.inbox(rid, inst.instance_id)
    handoff = _Handoff(plan.mode if main is not None else "none")
    phase = "relay"  # relay -> final (cut sent, RLD tokens buffered) -> md | solo
    rld_tokens: list[int] = []
    buffered: list[TokenOutput] = []
    counts = {"rld": 0, "md": 0}
    next_index = 1
    md_task: asyncio.Task | None = None
    deadline: asyncio.TimerHandle | None = None
    engine_live = md_done = False
    # RLD finished the request itself: MD is not cancelled, only its stream closed, so it still
    # caches the KV P sent it (MD's prefix cache must not fall behind P's).
    finished_here = False

    def done_event(reason: str | None) -> dict[str, Any]:
        return {
            "type": "done",
            "finish_reason": reason,
            "stats": {
                "tokens_by_role": dict(counts),
                "handoff": handoff.to_json(),
                "handoff_bytes": handoff.bytes,
            },
        }

    def send_batch(ids: list[int], final: bool) -> None:
        assert main is not None
        name = f"h{handoff.batches}" + (".final" if final else "")
        start = length + 1 + handoff.tokens_handed
        handoff.batches += 1
        handoff.tokens_handed += len(ids)
        client = agent.wan_client(main.datacenter)
        host, port = main.kv_address(True)

        async def send() -> None:
            try:
                stats: TransferStats = await client.send(
                    host,
                    port,
                    transfer_id(rid, main.instance, name),
                    [],
                    tokens=TokenIds(start, tuple(ids)),
                )
            except Exception as exc:  # noqa: BLE001 - the WAN failed: RLD finishes itself
                queue.put_nowait(("md_failed", f"handoff send failed: {exc!r}"))
            else:
                handoff.bytes += stats.bytes_sent

        handoff.sent.append(asyncio.create_task(send()))

    def maybe_handoff() -> None:
        nonlocal phase, deadline
        if phase != "relay" or main is None or not handoff.md_ready or handoff.inflight:
            return
        n = len(rld_tokens)
        if n < plan.handoff_at:
            return
        pending = rld_tokens[handoff.tokens_handed :]
        if (
            plan.mode == "catch-up"
            and len(pending) >= plan.catch_up_batch
            and handoff.batches < plan.max_catch_up_batches
        ):
            handoff.inflight = True
            send_batch(pending, final=False)
            return
        if not pending and handoff.batches > 0:
            return  # after a batch, MD holds KV for everything: wait for one more token
        handoff.at_token = n + 1
        phase = "final"
        send_batch(pending, final=True)
        ack_timeout_s = agent.handoff_ack_timeout_s(main.datacenter)
        deadline = asyncio.get_running_loop().call_later(
            ack_timeout_s,
            queue.put_nowait,
            ("md_failed", f"no acknowledgement within {ack_timeout_s:.2f} s"),
        )

    try:
        if main is not None:
            body = {
                "request_id": rid,
                "instance": main.instance,
                "prompt_ids": req.prompt,
                "first_token": req.first_token,
                "sampling": sampling_json(req.sampling),
                "start_token": req.main_start_token,
                "hold": True,
            }
            md_task = asyncio.create_task(
                pump_stream(agent.http, f"{main.http}/v1/pdd/decode", body, queue, "md")
            )
        # P's full KV over the intra-DC fabric (MD's stream may report first: keep its events).
        early: list[Any] = []
        waited_until = time.monotonic() + agent.settings.kv_timeout_s
        while True:
            try:
                item = await asyncio.wait_for(queue.get(), waited_until - time.monotonic())
            except TimeoutError:
                yield error_event(f"{rid}: no KV from P within {agent.settings.kv_timeout_s} s")
                return
            if isinstance(item, BaseException):
                yield error_event(f"{rid}: KV transfer failed: {item}")
                return
            if item[0] == "kv":
                break
            early.append(item)
        payload = kv_payload(item[1])
        worker.add_sink(rid, lambda out: queue.put_nowait(("rld", out)))

        def admit(engine):
            engine.import_prefix(rid, req.prompt, 0, payload)
            engine.start_decode(rid, req.prompt, req.first_token, req.sampling)

        try:
            await worker.call(admit)
        except (EngineFull, PrefixMissing, ValueError, KeyError) as exc:
            yield error_event(f"{rid}: cannot import KV: {type(exc).__name__}: {exc}")
            return
        engine_live = True
        for item in early:
            queue.put_nowait(item)

        while True:
            item = await queue.get()
            if isinstance(item, BaseException):  # a cancel
                yield error_event(f"{rid}: {item}")
                return
            tag, value = item
            failure: str | None = None
            if tag == "rld":
                if isinstance(value, BaseException):
                    if phase in ("relay", "final", "solo"):
                        yield error_event(f"{rid}: engine failed: {value}")
                        return
                    continue
                if phase == "md":
                    continue
                rld_tokens.extend(value.token_ids)
                if phase == "final":
                    buffered.append(value)
                    continue
                for tok in value.token_ids:
                    counts["rld"] += 1
                    agent.count_tokens(inst)
                    yield token_event(next_index, tok, "rld")
                    next_index += 1
                if value.finished:
                    engine_live = False
                    finished_here = handoff.failed is None
                    yield done_event(value.finish_reason)
                    return
                maybe_handoff()
            elif tag == "md":
                kind = value.get("type")
                if kind == "ready":
                    handoff.md_ready = True
                    handoff.slot_wait_s = float(value.get("slot_wait_s") or 0.0)
                    maybe_handoff()
                elif kind == "extended":
                    handoff.inflight = False
                    maybe_handoff()
                elif kind == "token":
                    if phase == "final" and value.get("index") == handoff.at_token:
                        phase, handoff.completed = "md", True
                        if deadline is not None:
                            deadline.cancel()
                        worker.remove_sink(rid)
                        await _quiet(worker.call(lambda e: e.release(rid)))
                        engine_live = False
                        buffered.clear()
                    if phase != "md":
                        failure = f"MD sent token {value.get('index')} before the handoff"
                    elif value.get("index") != next_index:
                        yield error_event(
                            f"{rid}: MD sent index {value.get('index')}, expected {next_index}"
                        )
                        return
                    else:
                        counts["md"] += 1
                        yield token_event(next_index, value["token_id"], "md")
                        next_index += 1
                elif kind == "done":
                    if phase == "md":
                        md_done = True
                        yield done_event(value.get("finish_reason"))
                        return
                    failure = "MD finished before the handoff"
                elif kind == "error":
                    if phase == "md":
                        yield error_event(f"{rid}: MD failed after the handoff: {value}")
                        return
                    failure = f"MD reported: {value.get('message')}"
            elif tag == "md_closed":
                if phase == "md":
                    yield error_event(f"{rid}: MD stream ended after the handoff: {value!r}")
                    return
                failure = f"MD stream closed: {value!r}"
            elif tag == "md_failed":
                failure = value
            if failure is not None and phase in ("relay", "final"):
                # MD or the WAN failed before the handoff completed: RLD finishes the request.
                log.warning("%s: handoff abandoned, RLD finishes: %s", rid, failure)
                handoff.failed = failure
                phase = "solo"
                if deadline is not None:
                    deadline.cancel()
                if md_task is not None:
                    md_task.cancel()
                fire_and_forget(agent, cancel_remote(agent, main, rid))
                for out in buffered:
                    for tok in out.token_ids:
                        counts["rld"] += 1
                        agent.count_tokens(inst)
                        yield token_event(next_index, tok, "rld")
                        next_index += 1
                    if out.finished:
                        engine_live = False
                        yield done_event(out.finish_reason)
                        return
                buffered.clear()
    finally:
        if deadline is not None:
            deadline.cancel()
        if md_task is not None:
            md_task.cancel()
        unsent = [task for task in handoff.sent if not task.done()]
        if unsent:
            # Let handoff batches already on the wire end (a few bytes of token IDs each)
            # rather than cut them mid-stream, which MD would log as a failed transfer; MD
            # drops them once the request is over there.
            fire_and_forget(agent, _settle(unsent, HANDOFF_SEND_GRACE_S))
        worker.remove_sink(rid)
        agent.drop_inbox(rid, inst.instance_id)
        if engine_live:
            await _quiet(worker.call(lambda e: e.abort(rid)))
        if main is not None and not md_done and not finished_here:
            fire_and_forget(agent, cancel_remote(agent, main, rid))


# -- P -----------------------------------------------------------------------------------------


@dataclass(slots=True)
class PddRequest:
    request_id: str
    prompt: list[int]
    sampling: SamplingParams
    pipeline: str
    plan: HandoffPlan
    main: Peer | None  # None only for rld-only
    relay: Peer | None
    # Stream P's sampled token the moment prefill ends (the old behaviour, an explicit policy
    # setting), instead of at the head of the decoding role's stream (the default).
    early_first_token: bool = False


@dataclass(slots=True)
class Prefilled:
    first_token: int
    finished: bool
    finish_reason: str | None
    prefill_cached_tokens: int
    main_cached_tokens: int | None  # None: MD's reservation failed (MD unreachable)
    main_error: str | None
    started: float
    first_token_at: float


async def reserve_remote(agent: Agent, main: Peer, request_id: str, prompt: list[int]) -> int:
    response = await agent.http.post(
        f"{main.http}/v1/pdd/reserve",
        json={"request_id": request_id, "instance": main.instance, "prompt_ids": prompt},
        timeout=10.0,
    )
    if response.status_code != 200:
        raise PeerFailed(f"reserve at MD: HTTP {response.status_code}: {response.text[:300]}")
    return int(response.json()["cached_tokens"])


async def admit_prefill(agent: Agent, inst: Instance, req: PddRequest) -> Prefilled:
    """Prefill on P while MD pins its cached prefix; raises EngineFull / ValueError before any
    streaming starts, so the caller can answer 503 / 400."""
    started = time.monotonic()
    reserve = (
        asyncio.create_task(reserve_remote(agent, req.main, req.request_id, req.prompt))
        if req.main is not None
        else None
    )
    try:
        result = await inst.worker.call(
            lambda e: e.prefill(req.request_id, req.prompt, req.sampling)
        )
    except BaseException:
        if reserve is not None:
            reserve.cancel()
            fire_and_forget(agent, cancel_remote(agent, req.main, req.request_id))
        raise
    first_at = time.monotonic()
    agent.count_tokens(inst)
    cached: int | None
    try:
        if reserve is None:
            cached, error = None, "no main decode in this pipeline (rld-only)"
        else:
            cached, error = await reserve, None
    except Exception as exc:  # noqa: BLE001 - MD unreachable: p-rld-md falls back to RLD alone
        cached, error = None, f"{type(exc).__name__}: {exc}"
    return Prefilled(
        result.first_token,
        result.finished,
        result.finish_reason,
        result.cached_tokens,
        cached,
        error,
        started,
        first_at,
    )


async def release_prefill(agent: Agent, inst: Instance, request_id: str) -> None:
    await _quiet(inst.worker.call(lambda e: e.release(request_id)))


async def run_prefill(agent: Agent, inst: Instance, req: PddRequest, pre: Prefilled) -> Events:
    rid, worker = req.request_id, inst.worker
    length = len(req.prompt)
    bs = agent.settings.block_size
    prefill_s = pre.first_token_at - pre.started
    stats: dict[str, Any] = {
        "pipeline": req.pipeline,
        # Filled in when the user's first token leaves (see `first` below).
        "ttft_s": None,
        "prefill_s": prefill_s,
        "kv_wait_s": None,
        "max_gap_s": 0.0,
        "first_token_early": req.early_first_token,
        "prefill_cached_tokens": pre.prefill_cached_tokens,
        "cached_tokens": 0,
        "tokens_by_role": {"prefill": 1, "rld": 0, "md": 0},
        "kv_bytes": {"intra_dc": 0, "wan": 0},
        "kv_wire_bytes": {"intra_dc": 0, "wan": 0},
        "handoff_bytes": 0,
        "handoff": {"mode": "none", "at_token": None, "batches": 0},
    }
    downstream: Peer | None = None
    done = False
    sends: list[asyncio.Task] = []
    pump: asyncio.Task | None = None
    queue: asyncio.Queue = asyncio.Queue()
    # TTFT as the user sees it: P's token leaves at the head of the stream of the role that
    # carries on decoding (MD in p-md, RLD in p-rld-md / rld-only), so it counts the KV
    # transfer and admission that role waited for. kv_wait_s is the time from P's token being
    # ready to the decoding role's first token reaching P.
    first_sent = False
    last_at: float | None = None

    def emit(event: dict[str, Any]) -> dict[str, Any]:
        """Note a token event's send time (TTFT, largest gap) and return it."""
        nonlocal last_at
        now = time.monotonic()
        if last_at is None:
            stats["ttft_s"] = now - pre.started
        else:
            stats["max_gap_s"] = max(stats["max_gap_s"], now - last_at)
        last_at = now
        return event

    def first() -> dict[str, Any]:
        nonlocal first_sent
        first_sent = True
        return emit(token_event(0, pre.first_token, "prefill"))

    def decoder_started() -> None:
        if stats["kv_wait_s"] is None:
            stats["kv_wait_s"] = time.monotonic() - pre.first_token_at

    try:
        if req.early_first_token or pre.finished:
            # Early (a policy setting), or P's token is the whole answer: nothing to wait for.
            yield first()
        if pre.finished:
            await release_prefill(agent, inst, rid)
            fire_and_forget(agent, cancel_remote(agent, req.main, rid))
            done = True
            stats["kv_wait_s"] = 0.0
            stats["e2e_s"] = time.monotonic() - pre.started
            yield {"type": "done", "finish_reason": pre.finish_reason, "stats": stats}
            return
        main_ok = pre.main_cached_tokens is not None
        if not main_ok and req.pipeline == "p-md":
            await release_prefill(agent, inst, rid)
            yield error_event(f"{rid}: MD unreachable: {pre.main_error}")
            return
        start = 0
        if main_ok:
            start = min(pre.main_cached_tokens, length)
            start -= start % bs
            stats["cached_tokens"] = start

        def export(engine):
            delta = engine.export_kv(rid, start, length) if main_ok else None
            full = engine.export_kv(rid, 0, length) if req.relay is not None else None
            engine.release(rid)  # P's KV stays in its prefix cache
            return delta, full

        delta, full = await worker.call(export)
        end_block = -(-length // bs)

        async def ship(peer: Peer, payload: bytes, fabric: str, lo: int) -> None:
            client = agent.wan_client(peer.datacenter) if fabric == "wan" else agent.intra_client
            host, port = peer.kv_address(fabric == "wan")
            chunk = KVChunk(lo // bs, end_block, lo, length, payload)
            # With a relay, RLD answers the user: the KV for MD is background WAN traffic and
            # yields the connection queue to transfers a first token waits on.
            background = fabric == "wan" and req.relay is not None
            # Counted when committed: a relayed request's KV for MD may still be on its way when
            # the user's stream ends (see "done" below).
            stats["kv_bytes"][fabric] += len(payload)
            try:
                sent = await client.send(
                    host,
                    port,
                    transfer_id(rid, peer.instance, "kv"),
                    [chunk],
                    background=background,
                )
            except Exception as exc:  # noqa: BLE001
                if done:  # the stream has ended: nobody reads the queue any more
                    log.warning("%s: KV send over %s to %s failed: %r", rid, fabric, peer.http, exc)
                    fire_and_forget(agent, cancel_remote(agent, peer, rid))
                else:
                    queue.put_nowait(("send_failed", (peer, fabric, exc)))
            else:
                stats["kv_wire_bytes"][fabric] += sent.bytes_sent

        if main_ok:
            # An MD in P's own datacenter (in-DC PD) gets the delta over the intra-DC fabric.
            same_dc = req.main.datacenter == agent.settings.datacenter
            main_fabric = "intra_dc" if same_dc else "wan"
            sends.append(asyncio.create_task(ship(req.main, delta, main_fabric, start)))
        if req.pipeline == "p-md":
            downstream = req.main
            url = f"{req.main.http}/v1/pdd/decode"
            body = {
                "request_id": rid,
                "instance": req.main.instance,
                "prompt_ids": req.prompt,
                "first_token": pre.first_token,
                "sampling": sampling_json(req.sampling),
                "start_token": start,
                "hold": False,
            }
        else:
            assert req.relay is not None
            sends.append(asyncio.create_task(ship(req.relay, full, "intra_dc", 0)))
            downstream = req.relay
            url = f"{req.relay.http}/v1/pdd/relay"
            body = {
                "request_id": rid,
                "instance": req.relay.instance,
                "prompt_ids": req.prompt,
                "first_token": pre.first_token,
                "sampling": sampling_json(req.sampling),
                "main": req.main.to_json() if main_ok else None,
                "main_start_token": start,
                **req.plan.to_json(),
            }
            if not main_ok and req.pipeline != "rld-only":
                stats["main_error"] = f"MD unreachable: {pre.main_error}"
        pump = asyncio.create_task(pump_stream(agent.http, url, body, queue, "down"))
        while True:
            tag, value = await queue.get()
            if tag == "send_failed":
                peer, fabric, exc = value
                log.warning("%s: KV send over %s to %s failed: %r", rid, fabric, peer.http, exc)
                # Wake the receiver so it gives up at once instead of at its KV timeout.
                fire_and_forget(agent, cancel_remote(agent, peer, rid))
                continue
            if tag == "down_closed":
                yield error_event(f"{rid}: downstream stream ended without done: {value!r}")
                return
            kind = value.get("type")
            if kind == "token":
                decoder_started()
                if not first_sent:
                    yield first()
                role = value.get("role", "md")
                stats["tokens_by_role"][role] = stats["tokens_by_role"].get(role, 0) + 1
                yield emit(value)
            elif kind == "done":
                decoder_started()
                if not first_sent:  # the decoding role stopped at once (EOS after P's token)
                    yield first()
                # RLD may have answered the whole request while P's KV for MD is still crossing
                # the WAN (as background traffic): MD caches it when it lands, but the user's
                # stream ends now rather than when the transfer does.
                for task in sends:
                    if not task.done():
                        agent.background.add(task)
                        task.add_done_callback(agent.background.discard)
                sends.clear()  # so the finally below does not cancel them
                sub = value.get("stats") or {}
                if "handoff" in sub:
                    stats["handoff"] = sub["handoff"]
                    stats["handoff_bytes"] = sub.get("handoff_bytes", 0)
                stats["e2e_s"] = time.monotonic() - pre.started
                done = True
                yield {"type": "done", "finish_reason": value.get("finish_reason"), "stats": stats}
                return
            elif kind == "error":
                yield value
                return
    finally:
        if pump is not None:
            pump.cancel()
        for task in sends:
            if not task.done():
                task.cancel()
        if not done:
            await release_prefill(agent, inst, rid)
            for peer in (req.main, req.relay, downstream):
                if peer is not None:
                    fire_and_forget(agent, cancel_remote(agent, peer, rid))


async def cancel_local(agent: Agent, request_id: str) -> bool:
    """Abort request_id on every instance of this agent and wake whoever waits for it, now
    or later (a decode call that raced the cancel finds it in its inbox)."""
    agent.cancel_inbox(request_id)
    await agent.unreserve(request_id)
    found = False
    for inst in list(agent.instances.values()):
        if inst.worker is not None:
            found |= bool(await _quiet(inst.worker.call(lambda e: e.abort(request_id))))
    return found


def ensure_instance_worker(inst: Instance) -> None:
    if inst.worker is None:
        raise AgentError(503, f"instance {inst.instance_id} is {inst.state}")


OnClose = Callable[[], Any]
