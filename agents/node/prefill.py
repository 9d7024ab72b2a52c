"""P, the prefill: prefill while MD pins its cached prefix (DRC), ship the delta to MD (over
the WAN, or intra-DC for an MD in P's datacenter) and, for p-rld-md / rld-only, the full KV
intra-DC to RLD at the same time, and relay the decoding role's token stream to the caller."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from agents.engine import SamplingParams, TokenLogprob
from agents.engine.outputs import PrefillResult, TokenOutput
from agents.node.agent import Agent, Instance
from agents.node.kv_stream import (
    StreamedDelta,
    delta_start,
    fabric_to,
    for_wire,
    kv_size,
    send_format,
)
from agents.node.pipeline_common import (
    Events,
    PeerFailed,
    cancel_remote,
    error_event,
    fire_and_forget,
    keep_alive,
    pump_stream,
    quiet,
    sampling_json,
    token_event,
    transfer_id,
)
from agents.node.wire import HandoffPlan, Peer
from agents.node.worker import EngineWorker
from agents.transfer.records import KVChunk, TransferStats
from pdd.events import PREFILL_FAILED
from pdd.stats import DoneStats
from pdd.vocab import Pipeline

log = logging.getLogger(__name__)


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
    # One hop per token: P's stream ends with a `continue` event naming the decoding role's
    # stream, which the caller reads itself, instead of P relaying every token of it.
    direct: bool = False


@dataclass(slots=True)
class Prefilled:
    first_token: int
    first_logprob: TokenLogprob | None
    finished: bool
    finish_reason: str | None
    prefill_cached_tokens: int
    main_cached_tokens: int | None  # None: MD's reservation failed (MD unreachable)
    main_error: str | None
    # What MD stores its KV as (its reservation's answer; None from an MD that does not say).
    main_kv_format: str | None

    started: float
    first_token_at: float
    # MD's delta streamed while prefill ran (kv_stream_tokens > 0 and MD reserved), else None.
    stream: StreamedDelta | None = None
    # MD's engine block size (its reservation's answer; None: an MD that does not say).
    main_block_size: int | None = None


@dataclass(frozen=True, slots=True)
class ReserveAnswer:
    """MD's answer to ``reserve``: the tokens of the prompt it holds (whole blocks of its own
    size), the format it stores KV in, and its engine's block size (None: an MD that does not
    say; the delta then starts at a block boundary of P's own size)."""

    cached_tokens: int
    kv_format: str | None = None
    block_size: int | None = None


async def reserve_remote(
    agent: Agent, main: Peer, request_id: str, prompt: list[int]
) -> ReserveAnswer:
    """MD pins its cached prefix of the prompt (``ReserveAnswer``)."""
    response = await agent.http.post(
        f"{main.http}/v1/pdd/reserve",
        json={"request_id": request_id, "instance": main.instance, "prompt_ids": prompt},
        timeout=agent.settings.reserve_timeout_s,
    )
    if response.status_code != 200:
        raise PeerFailed(f"reserve at MD: HTTP {response.status_code}: {response.text[:300]}")
    answer = response.json()
    stored, size = answer.get("kv_format"), answer.get("block_size")
    return ReserveAnswer(
        int(answer["cached_tokens"]),
        stored if isinstance(stored, str) else None,
        size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None,
    )


async def batched_prefill(
    worker: EngineWorker,
    request_id: str,
    prompt: list[int],
    sampling: SamplingParams,
    submitted: asyncio.Future[None] | None = None,
) -> PrefillResult:
    """Prefill batched with the engine's other work: the request joins the scheduler (chunked
    prefill with every other prompt waiting, not one prompt per engine command) and its first
    token arrives as a step output. EngineFull / ValueError surface from the submission;
    ``submitted`` is set once the engine has taken the request into its queue."""
    loop = asyncio.get_running_loop()
    first: asyncio.Future[TokenOutput] = loop.create_future()

    def sink(out: TokenOutput | BaseException) -> None:
        if first.done():
            return
        if isinstance(out, BaseException):
            first.set_exception(out)
        else:
            first.set_result(out)

    worker.add_sink(request_id, sink)
    try:
        await worker.call(lambda e: e.submit_prefill(request_id, prompt, sampling))
        if submitted is not None and not submitted.done():
            submitted.set_result(None)
        out = await first
        # Held from its first token on: read beside the next step, not after it.
        return await worker.read_held(lambda e: e.prefill_result(request_id, out))
    except BaseException:
        # Not started, or abandoned while queued: nothing of it may stay in the engine.
        await quiet(worker.call(lambda e: e.abort(request_id)))
        raise
    finally:
        worker.remove_sink(request_id)


async def admit_prefill(agent: Agent, inst: Instance, req: PddRequest) -> asyncio.Task[Prefilled]:
    """Start the prefill and return once P's engine has taken the request into its queue:
    EngineFull / ValueError are raised before that (the caller answers 503 / 400, a status
    code); the task (the prefill while MD pins its cached prefix) is what `run_prefill` waits
    for, with a ``queued`` event every ``queued_every_s`` while the request waits in the queue,
    so that a busy P is told from a frozen one (silent) by the gateway."""
    submitted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(prefill_with_reservation(agent, inst, req, submitted))
    try:
        waits: set[asyncio.Future[Any]] = {task, submitted}
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # the caller left while the submission ran
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise
    if task.done() and not submitted.done():
        task.result()  # the submission's EngineFull / ValueError (or the engine's failure)
    return task


async def prefill_with_reservation(
    agent: Agent, inst: Instance, req: PddRequest, submitted: asyncio.Future[None]
) -> Prefilled:
    """Prefill on P (``submitted`` set once the engine queued it) while MD pins its cached
    prefix and, with ``kv_stream_tokens``, the delta starts leaving."""
    started = time.monotonic()
    stream = (
        StreamedDelta(
            agent,
            inst.running_worker,
            req.request_id,
            req.main,
            len(req.prompt),
            background=req.relay is not None,
        )  # fmt: skip
        if req.main is not None and agent.settings.kv_stream_tokens > 0
        else None
    )

    async def reserve_main(main: Peer) -> ReserveAnswer:
        reservation = await reserve_remote(agent, main, req.request_id, req.prompt)
        if stream is not None:
            # The delta starts leaving while prefill runs.
            await stream.begin(
                main_delta_start(
                    agent, reservation.cached_tokens, reservation.block_size, len(req.prompt)
                ),
                wire_format(agent, inst, main, reservation.kv_format),
            )
        return reservation

    reserve = asyncio.create_task(reserve_main(req.main)) if req.main is not None else None
    try:
        result = await batched_prefill(inst.running_worker, req.request_id, req.prompt,
                                       req.sampling, submitted)  # fmt: skip
    except BaseException:
        if reserve is not None:
            reserve.cancel()
            fire_and_forget(agent, cancel_remote(agent, req.main, req.request_id))
        if stream is not None:
            stream.abort()
        raise
    first_at = time.monotonic()
    agent.count_tokens(inst)
    reservation: ReserveAnswer | None = None
    error: str | None = None
    try:
        if reserve is None:
            error = "no main decode in this pipeline (rld-only)"
        else:
            reservation = await reserve
    except Exception as exc:  # noqa: BLE001 - MD unreachable: p-rld-md falls back to RLD alone
        error = f"{type(exc).__name__}: {exc}"
    if stream is not None and stream.send is None:
        stream.abort()  # MD did not reserve: nothing was streamed
        stream = None
    return Prefilled(
        result.first_token,
        result.first_logprob,
        result.finished,
        result.finish_reason,
        result.cached_tokens,
        None if reservation is None else reservation.cached_tokens,
        error,
        None if reservation is None else reservation.kv_format,
        started,
        first_at,
        stream,
        None if reservation is None else reservation.block_size,
    )


def main_delta_start(agent: Agent, cached: int, block_size: int | None, length: int) -> int:
    """Where MD's delta starts: MD's cached prefix, in whole blocks of MD's own size
    (``block_size``, its reservation's answer; None: P's own). MD's import starts at one of
    its block boundaries; P's may be larger or smaller."""
    return delta_start(cached, length, block_size or agent.settings.block_size)


def wire_format(agent: Agent, inst: Instance, main: Peer, stored: str | None) -> str | None:
    """The format MD's delta crosses in (kv_stream.send_format): the WAN link's, or MD's
    narrower dtype, or None for P's own."""
    own = getattr(inst.running_worker.engine.pool, "dtype_name", None)
    link_format = main.kv_format if fabric_to(agent, main) == "wan" else None
    return send_format(link_format, own, stored)


def keep_in_background(agent: Agent, sends: list[asyncio.Task]) -> None:
    """Let KV sends still under way finish after the request's stream has ended (the agent
    holds them); `sends` is emptied, so the stream's cleanup does not cancel them."""
    for task in sends:
        if not task.done():
            agent.background.add(task)
            task.add_done_callback(agent.background.discard)
    sends.clear()


async def release_prefill(agent: Agent, inst: Instance, request_id: str) -> None:
    await quiet(inst.running_worker.call(lambda e: e.release(request_id)))


async def run_prefill(
    agent: Agent, inst: Instance, req: PddRequest, prefilling: asyncio.Task[Prefilled]
) -> Events:
    """P's stream of a request its engine has queued (`admit_prefill`): a ``queued`` event
    every ``queued_every_s`` while the prefill has not produced its first token (so the
    caller's first-token timeout measures silence, not a queue), then `stream_prefilled`'s.
    A prefill that fails after it was queued is an error event naming P (``role`` prefill)."""
    # Closed early (the caller left while the request was queued), it drops the prefill.
    async with aclosing(keep_alive(prefilling, agent.settings.queued_every_s, "prefill")) as alive:
        async for event in alive:
            yield event
    try:
        pre = prefilling.result()
    except Exception as exc:  # noqa: BLE001 - the engine failed the queued prefill
        log.warning("%s: prefill failed after it was queued: %r", req.request_id, exc)
        yield error_event(f"{req.request_id}: prefill failed: {exc}", role=PREFILL_FAILED)
        return
    async with aclosing(stream_prefilled(agent, inst, req, pre)) as events:
        async for event in events:
            yield event


async def stream_prefilled(agent: Agent, inst: Instance, req: PddRequest, pre: Prefilled) -> Events:
    """P's stream once its prefill is done: ship the KV, then the decoding role's stream (or a
    ``continue`` naming it, one hop per token)."""
    rid, worker = req.request_id, inst.running_worker
    length = len(req.prompt)
    bs = agent.settings.block_size
    prefill_s = pre.first_token_at - pre.started
    # The attempt's figures, sent with `done` (or `continue`); ttft_s is filled in when the
    # user's first token leaves (see `first` below).
    stats = DoneStats(
        pipeline=req.pipeline,
        prefill_s=prefill_s,
        max_gap_s=0.0,
        first_token_early=req.early_first_token,
        prefill_cached_tokens=pre.prefill_cached_tokens,
        cached_tokens=0,
        tokens_by_role=(by_role := {"prefill": 1, "rld": 0, "md": 0}),
    )
    downstream: Peer | None = None
    done = False
    released = False  # P let the request go (its KV stays in its prefix cache)
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
            stats.ttft_s = now - pre.started
        else:
            stats.max_gap_s = max(stats.max_gap_s or 0.0, now - last_at)
        last_at = now
        return event

    def first() -> dict[str, Any]:
        nonlocal first_sent
        first_sent = True
        return emit(token_event(0, pre.first_token, "prefill", pre.first_logprob))

    def decoder_started() -> None:
        if stats.kv_wait_s is None:
            stats.kv_wait_s = time.monotonic() - pre.first_token_at

    try:
        if req.early_first_token or pre.finished:
            # Early (a policy setting), or P's token is the whole answer: nothing to wait for.
            yield first()
        if pre.finished:
            if pre.stream is not None:
                pre.stream.abort()
            await release_prefill(agent, inst, rid)
            fire_and_forget(agent, cancel_remote(agent, req.main, rid))
            done = True
            stats.kv_wait_s = 0.0
            stats.e2e_s = time.monotonic() - pre.started
            yield {"type": "done", "finish_reason": pre.finish_reason, "stats": stats.to_json()}
            return
        main_cached = pre.main_cached_tokens
        # The MD that pinned its cached prefix; None: rld-only, or MD's reservation failed.
        main = req.main if main_cached is not None else None
        main_ok = main is not None
        if not main_ok and req.pipeline == Pipeline.P_MD:
            await release_prefill(agent, inst, rid)
            released = True
            yield error_event(f"{rid}: MD unreachable: {pre.main_error}", role="md")
            return
        start = 0
        if main_cached is not None:
            start = stats.cached_tokens = main_delta_start(
                agent, main_cached, pre.main_block_size, length
            )

        streamed = pre.stream

        def export(engine):
            # A streamed delta's pieces are out up to `rest`: only the rest goes now.
            rest = worker.take_export_watch(rid) if streamed is not None else None
            lo = start if rest is None else rest
            delta = engine.export_kv(rid, lo, length) if main_ok else None
            full = engine.export_kv(rid, 0, length) if req.relay is not None else None
            return delta, full, rest

        # The request is held: its KV is read beside the step in flight, then released on
        # the engine thread (P's KV stays in its prefix cache) while it travels.
        delta, full, rest = await worker.read_held(export)
        fire_and_forget(agent, release_prefill(agent, inst, rid))
        released = True
        end_block = -(-length // bs)

        async def shipped(peer: Peer, fabric: str, sending: Awaitable[TransferStats]) -> None:
            """Await a KV send to ``peer``: its wire bytes counted, or its failure reported."""
            try:
                sent = await sending
            except Exception as exc:  # noqa: BLE001
                if done:  # the stream has ended: nobody reads the queue any more
                    log.warning("%s: KV send over %s to %s failed: %r", rid, fabric, peer.http, exc)
                    fire_and_forget(agent, cancel_remote(agent, peer, rid))
                else:
                    queue.put_nowait(("send_failed", (peer, fabric, exc)))
            else:
                stats.kv_wire_bytes[fabric] += sent.bytes_sent

        async def ship(peer: Peer, payload: bytes, fabric: str, lo: int) -> None:
            client = agent.wan_client(peer.datacenter) if fabric == "wan" else agent.intra_client
            host, port = peer.kv_address(fabric == "wan")
            chunk = KVChunk(lo // bs, end_block, lo, length, payload)
            # With a relay, RLD answers the user: the KV for MD is background WAN traffic and
            # yields the connection queue to transfers a first token waits on.
            background = fabric == "wan" and req.relay is not None
            tid = transfer_id(rid, peer.instance, "kv")
            await shipped(
                peer, fabric, client.send(host, port, tid, [chunk], background=background)
            )

        def start_ship(peer: Peer, payload: bytes, fabric: str, lo: int) -> None:
            # Counted when committed: a relayed request's KV for MD may still be on its way when
            # the user's stream ends (see "done" below). The KV the payload stands for: an
            # emulated engine's carries 1/kv_scale of it (kv_wire_bytes: what crossed).
            fmt = wire_format(agent, inst, peer, pre.main_kv_format) if peer is main else None
            stats.kv_bytes[fabric] += kv_size(worker.engine, payload, fmt)
            if fmt:
                # Another format (the WAN link's, or MD's narrower dtype): encoded off the
                # event loop, counted at its encoded size; MD decodes it on import.
                if fabric == "wan":
                    stats.kv_format_wan = fmt
                sends.append(asyncio.create_task(ship_as(peer, payload, fmt, fabric, lo)))
                return
            sends.append(asyncio.create_task(ship(peer, payload, fabric, lo)))

        async def ship_as(peer: Peer, payload: bytes, fmt: str, fabric: str, lo: int) -> None:
            encoded = await asyncio.to_thread(for_wire, payload, fmt)
            await ship(peer, encoded, fabric, lo)

        if main is not None and streamed is not None and rest is not None:
            assert delta is not None and streamed.send is not None  # begun: MD reserved
            streamed.finish(rest, delta)
            stats.kv_bytes[streamed.fabric] += streamed.kv_bytes
            stats.kv_stream_pieces = streamed.pieces
            if streamed.kv_format and streamed.fabric == "wan":
                stats.kv_format_wan = streamed.kv_format
            sends.append(asyncio.create_task(shipped(main, streamed.fabric, streamed.send)))
        elif main is not None:
            # An MD in P's own datacenter (in-DC PD) gets the delta over the intra-DC fabric.
            start_ship(main, delta, fabric_to(agent, main), start)
        if req.pipeline == Pipeline.P_MD:
            assert main is not None  # p-md without MD's reservation returned above
            downstream = main
            url = f"{main.http}/v1/pdd/decode"
            body = {
                "request_id": rid,
                "instance": main.instance,
                "prompt_ids": req.prompt,
                "first_token": pre.first_token,
                "sampling": sampling_json(req.sampling),
                "start_token": start,
                "hold": False,
            }
        else:
            assert req.relay is not None
            start_ship(req.relay, full, "intra_dc", 0)
            downstream = req.relay
            url = f"{req.relay.http}/v1/pdd/relay"
            body = {
                "request_id": rid,
                "instance": req.relay.instance,
                "prompt_ids": req.prompt,
                "first_token": pre.first_token,
                "sampling": sampling_json(req.sampling),
                "main": main.to_json() if main is not None else None,
                "main_start_token": start,
                **req.plan.to_json(),
            }
            if not main_ok and req.pipeline != Pipeline.RLD_ONLY:
                stats.main_error = f"MD unreachable: {pre.main_error}"
        if req.direct:
            # The caller opens the decoding role's stream itself; the KV sends carry on in the
            # background (a failed one cancels the request at the decoder, whose stream then
            # ends with an error the caller sees).
            body["direct"] = True
            if not first_sent:  # P's token leaves at the head of the decoder's stream
                body["first_event"] = token_event(0, pre.first_token, "prefill", pre.first_logprob)
            keep_in_background(agent, sends)
            done = True
            # The caller has the prompt: it puts it back (a 64K-token prompt is ~400 KB of
            # JSON each way).
            yield {
                "type": "continue",
                "url": url,
                "body": {k: v for k, v in body.items() if k != "prompt_ids"},
                "instance": downstream.instance,
                "role": "md" if req.pipeline == Pipeline.P_MD else "rld",
                "stats": stats.to_json(),
            }
            return
        pump = asyncio.create_task(
            pump_stream(
                agent.http,
                url,
                body,
                lambda event: queue.put_nowait(("down", event)),
                lambda exc: queue.put_nowait(("down_closed", exc)),
            )
        )
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
                by_role[role] = by_role.get(role, 0) + 1
                yield emit(value)
            elif kind == "done":
                decoder_started()
                if not first_sent:  # the decoding role stopped at once (EOS after P's token)
                    yield first()
                # RLD may have answered the whole request while P's KV for MD is still crossing
                # the WAN (as background traffic): MD caches it when it lands, but the user's
                # stream ends now rather than when the transfer does.
                keep_in_background(agent, sends)
                sub = value.get("stats") or {}
                if "handoff" in sub:
                    sent_on = DoneStats.from_json(sub)
                    stats.handoff, stats.handoff_bytes = sent_on.handoff, sent_on.handoff_bytes
                stats.e2e_s = time.monotonic() - pre.started
                done = True
                yield {
                    "type": "done",
                    "finish_reason": value.get("finish_reason"),
                    "stats": stats.to_json(),
                }
                return
            elif kind == "error":
                yield value
                return
            elif kind == "queued":  # the decoder's keep-alive while its KV comes: passed on
                yield value
    finally:
        if pump is not None:
            pump.cancel()
        for task in sends:
            if not task.done():
                task.cancel()
        if not done:
            if pre.stream is not None:
                pre.stream.abort()  # a delta still streaming is dropped (MD sees it partial)
            if not released:
                await release_prefill(agent, inst, rid)
            for peer in (req.main, req.relay, downstream):
                if peer is not None:
                    fire_and_forget(agent, cancel_remote(agent, peer, rid))
