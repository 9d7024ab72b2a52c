"""P's stream of a request, once its engine has queued it (prefill.py): ``queued`` events until
the first token, then `PrefilledStream`'s named steps: answer alone when P's token is the whole
answer, choose MD (or fail p-md without it), export the KV and ship it (the delta to MD, the
full KV to RLD), then hand the caller the decoding role's stream (``continue``, one hop per
token) or relay it, with the attempt's `DoneStats`."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from contextlib import aclosing
from typing import Any

from agents.node.agent import Agent
from agents.node.instances import Instance
from agents.node.kv_stream import fabric_to, for_wire, kv_size
from agents.node.pipeline_common import (
    Events,
    cancel_remote,
    error_event,
    fire_and_forget,
    keep_alive,
    pump_stream,
    sampling_json,
    token_event,
    transfer_id,
)
from agents.node.prefill import (
    PddRequest,
    Prefilled,
    main_delta_start,
    release_prefill,
    wire_format,
)
from agents.node.wire import Peer
from agents.transfer.records import KVChunk, TransferStats
from pdd.events import PREFILL_FAILED
from pdd.stats import DoneStats
from pdd.token_ids import to_wire
from pdd.vocab import Pipeline

log = logging.getLogger("agents.node.prefill")  # P's own log, as before the split


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
    async with aclosing(PrefilledStream(agent, inst, req, pre).events()) as events:
        async for event in events:
            yield event


class PrefilledStream:
    """One request on P after its prefill: the steps of `events`, the KV sends under way, the
    downstream pump, and the attempt's figures (`stats`, sent with ``done`` or ``continue``)."""

    def __init__(self, agent: Agent, inst: Instance, req: PddRequest, pre: Prefilled) -> None:
        self.agent, self.inst, self.req, self.pre = agent, inst, req, pre
        self.rid, self.worker = req.request_id, inst.running_worker
        self.length = len(req.prompt)
        self.bs = agent.settings.block_size
        # ttft_s is filled in when the user's first token leaves (`first`).
        self.by_role = {"prefill": 1, "rld": 0, "md": 0}
        self.stats = DoneStats(
            pipeline=req.pipeline,
            prefill_s=pre.first_token_at - pre.started,
            max_gap_s=0.0,
            first_token_early=req.early_first_token,
            prefill_cached_tokens=pre.prefill_cached_tokens,
            cached_tokens=0,
            tokens_by_role=self.by_role,
        )
        # The MD that pinned its cached prefix (None: rld-only, or MD's reservation failed),
        # and where its delta starts.
        self.main: Peer | None = None
        self.start = 0
        self.downstream: Peer | None = None
        self.done = False  # the last event is out: what is still under way carries on alone
        self.released = False  # P let the request go (its KV stays in its prefix cache)
        self.sends: list[asyncio.Task] = []
        self.pump: asyncio.Task | None = None
        self.queue: asyncio.Queue = asyncio.Queue()
        # TTFT as the user sees it: P's token leaves at the head of the stream of the role that
        # carries on decoding (MD in p-md, RLD in p-rld-md / rld-only), so it counts the KV
        # transfer and admission that role waited for. kv_wait_s is the time from P's token
        # being ready to the decoding role's first token reaching P.
        self.first_sent = False
        self.last_at: float | None = None

    async def events(self) -> Events:
        req, pre = self.req, self.pre
        try:
            if req.early_first_token or pre.finished:
                # Early (a policy setting), or P's token is the whole answer: nothing to wait for.
                yield self.first()
            if pre.finished:
                yield await self.answer_alone()
                return
            failure = await self.choose_main()
            if failure is not None:
                yield failure
                return
            await self.export_and_ship()
            url, body = self.downstream_call()
            if req.direct:
                yield self.hand_over(url, body)
                return
            async with aclosing(self.relay_downstream(url, body)) as events:
                async for event in events:
                    yield event
        finally:
            await self.close()

    # -- the user's tokens ------------------------------------------------------------------

    def emit(self, event: dict[str, Any]) -> dict[str, Any]:
        """Note a token event's send time (TTFT, largest gap) and return it."""
        now = time.monotonic()
        if self.last_at is None:
            self.stats.ttft_s = now - self.pre.started
        else:
            self.stats.max_gap_s = max(self.stats.max_gap_s or 0.0, now - self.last_at)
        self.last_at = now
        return event

    def first(self) -> dict[str, Any]:
        """P's token event, sent now."""
        self.first_sent = True
        pre = self.pre
        return self.emit(token_event(0, pre.first_token, "prefill", pre.first_logprob))

    def decoder_started(self) -> None:
        if self.stats.kv_wait_s is None:
            self.stats.kv_wait_s = time.monotonic() - self.pre.first_token_at

    # -- the steps --------------------------------------------------------------------------

    async def answer_alone(self) -> dict[str, Any]:
        """P's token finished the request: let it go, cancel MD's reservation, ``done``."""
        agent, pre = self.agent, self.pre
        if pre.stream is not None:
            pre.stream.abort()
        await release_prefill(agent, self.inst, self.rid)
        fire_and_forget(agent, cancel_remote(agent, self.req.main, self.rid))
        self.done = True
        self.stats.kv_wait_s = 0.0
        self.stats.e2e_s = time.monotonic() - pre.started
        return {"type": "done", "finish_reason": pre.finish_reason, "stats": self.stats.to_json()}

    async def choose_main(self) -> dict[str, Any] | None:
        """MD, if it reserved, and where its delta starts; p-md without it: the error event."""
        req, pre = self.req, self.pre
        cached = pre.main_cached_tokens
        self.main = req.main if cached is not None else None
        if self.main is None and req.pipeline == Pipeline.P_MD:
            await release_prefill(self.agent, self.inst, self.rid)
            self.released = True
            return error_event(f"{self.rid}: MD unreachable: {pre.main_error}", role="md")
        if cached is not None:
            self.start = self.stats.cached_tokens = main_delta_start(
                self.agent, cached, pre.main_block_size, self.length
            )
        return None

    async def export_and_ship(self) -> None:
        """Read MD's delta and RLD's full KV (the held request, beside the step in flight),
        release the request (P's KV stays in its prefix cache) and start the sends."""
        agent, req, stats = self.agent, self.req, self.stats
        main, start, streamed, worker, rid = (
            self.main,
            self.start,
            self.pre.stream,
            self.worker,
            self.rid,
        )
        length = self.length

        def export(engine):
            # A streamed delta's pieces are out up to `rest`: only the rest goes now.
            rest = worker.take_export_watch(rid) if streamed is not None else None
            lo = start if rest is None else rest
            delta = engine.export_kv(rid, lo, length) if main is not None else None
            full = engine.export_kv(rid, 0, length) if req.relay is not None else None
            return delta, full, rest

        delta, full, rest = await worker.read_held(export)
        fire_and_forget(agent, release_prefill(agent, self.inst, rid))
        self.released = True
        if main is not None and streamed is not None and rest is not None:
            assert delta is not None and streamed.send is not None  # begun: MD reserved
            streamed.finish(rest, delta)
            stats.kv_bytes[streamed.fabric] += streamed.kv_bytes
            stats.kv_stream_pieces = streamed.pieces
            if streamed.kv_format and streamed.fabric == "wan":
                stats.kv_format_wan = streamed.kv_format
            self.sends.append(
                asyncio.create_task(self.shipped(main, streamed.fabric, streamed.send))
            )
        elif main is not None:
            # An MD in P's own datacenter (in-DC PD) gets the delta over the intra-DC fabric.
            self.start_ship(main, delta, fabric_to(agent, main), start)
        if req.pipeline != Pipeline.P_MD:
            assert req.relay is not None
            self.start_ship(req.relay, full, "intra_dc", 0)

    def downstream_call(self) -> tuple[str, dict[str, Any]]:
        """The decoding role's stream: MD's ``decode`` (p-md) or RLD's ``relay``."""
        req, pre, main = self.req, self.pre, self.main

        def head(instance: str) -> dict[str, Any]:
            return {
                "request_id": self.rid,
                "instance": instance,
                "prompt_ids": to_wire(req.prompt),
                "first_token": pre.first_token,
                "sampling": sampling_json(req.sampling),
            }

        if req.pipeline == Pipeline.P_MD:
            assert main is not None  # p-md without MD's reservation ended in choose_main
            self.downstream = main
            body = head(main.instance) | {"start_token": self.start, "hold": False}
            return f"{main.http}/v1/pdd/decode", body
        assert req.relay is not None
        self.downstream = req.relay
        if main is None and req.pipeline != Pipeline.RLD_ONLY:
            self.stats.main_error = f"MD unreachable: {pre.main_error}"
        body = head(req.relay.instance) | {
            "main": main.to_json() if main is not None else None,
            "main_start_token": self.start,
            **req.plan.to_json(),
        }
        return f"{req.relay.http}/v1/pdd/relay", body

    def hand_over(self, url: str, body: dict[str, Any]) -> dict[str, Any]:
        """One hop per token: the ``continue`` naming the decoding role's stream, which the
        caller opens itself; the KV sends carry on in the background (a failed one cancels the
        request at the decoder, whose stream then ends with an error the caller sees)."""
        pre, req = self.pre, self.req
        assert self.downstream is not None
        body["direct"] = True
        if not self.first_sent:  # P's token leaves at the head of the decoder's stream
            body["first_event"] = token_event(0, pre.first_token, "prefill", pre.first_logprob)
        keep_in_background(self.agent, self.sends)
        self.done = True
        # The caller has the prompt: it puts it back (a 64K-token prompt is ~400 KB of JSON
        # each way).
        return {
            "type": "continue",
            "url": url,
            "body": {k: v for k, v in body.items() if k != "prompt_ids"},
            "instance": self.downstream.instance,
            "role": "md" if req.pipeline == Pipeline.P_MD else "rld",
            "stats": self.stats.to_json(),
        }

    async def relay_downstream(self, url: str, body: dict[str, Any]) -> Events:
        """Relay the decoding role's stream (P's token at its head) until done or an error;
        a KV send that fails meanwhile cancels the request at its receiver."""
        agent, queue, stats = self.agent, self.queue, self.stats
        self.pump = asyncio.create_task(
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
                self.send_failed(*value)
                continue
            if tag == "down_closed":
                yield error_event(f"{self.rid}: downstream stream ended without done: {value!r}")
                return
            kind = value.get("type")
            if kind == "token":
                self.decoder_started()
                if not self.first_sent:
                    yield self.first()
                role = value.get("role", "md")
                self.by_role[role] = self.by_role.get(role, 0) + 1
                yield self.emit(value)
            elif kind == "done":
                self.decoder_started()
                if not self.first_sent:  # the decoding role stopped at once (EOS after P's)
                    yield self.first()
                # RLD may have answered the whole request while P's KV for MD is still crossing
                # the WAN (as background traffic): MD caches it when it lands, but the user's
                # stream ends now rather than when the transfer does.
                keep_in_background(agent, self.sends)
                sub = value.get("stats") or {}
                if "handoff" in sub:
                    sent_on = DoneStats.from_json(sub)
                    stats.handoff, stats.handoff_bytes = sent_on.handoff, sent_on.handoff_bytes
                stats.e2e_s = time.monotonic() - self.pre.started
                self.done = True
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

    async def close(self) -> None:
        """Whatever ended the stream: stop the pump and the sends still under way; unless the
        last event went out, drop a delta still streaming, let the request go and cancel it
        at every peer."""
        if self.pump is not None:
            self.pump.cancel()
        for task in self.sends:
            if not task.done():
                task.cancel()
        if self.done:
            return
        if self.pre.stream is not None:
            self.pre.stream.abort()  # a delta still streaming is dropped (MD sees it partial)
        if not self.released:
            await release_prefill(self.agent, self.inst, self.rid)
        for peer in (self.req.main, self.req.relay, self.downstream):
            if peer is not None:
                fire_and_forget(self.agent, cancel_remote(self.agent, peer, self.rid))

    # -- the KV sends -----------------------------------------------------------------------

    def start_ship(self, peer: Peer, payload: bytes | None, fabric: str, lo: int) -> None:
        """Send `payload` (the KV from token `lo`) to `peer`. Counted when committed: a relayed
        request's KV for MD may still be on its way when the user's stream ends. The KV the
        payload stands for: an emulated engine's carries 1/kv_scale of it (kv_wire_bytes:
        what crossed)."""
        assert payload is not None
        stats = self.stats
        fmt = (
            wire_format(self.agent, self.inst, peer, self.pre.main_kv_format)
            if peer is self.main
            else None
        )
        stats.kv_bytes[fabric] += kv_size(self.worker.engine, payload, fmt)
        if fmt:
            # Another format (the WAN link's, or MD's narrower dtype): encoded off the event
            # loop, counted at its encoded size; MD decodes it on import.
            if fabric == "wan":
                stats.kv_format_wan = fmt
            self.sends.append(asyncio.create_task(self.ship_as(peer, payload, fmt, fabric, lo)))
            return
        self.sends.append(asyncio.create_task(self.ship(peer, payload, fabric, lo)))

    async def ship_as(self, peer: Peer, payload: bytes, fmt: str, fabric: str, lo: int) -> None:
        encoded = await asyncio.to_thread(for_wire, payload, fmt)
        await self.ship(peer, encoded, fabric, lo)

    async def ship(self, peer: Peer, payload: bytes, fabric: str, lo: int) -> None:
        links = self.agent.links
        client = links.wan_client(peer.datacenter) if fabric == "wan" else links.intra_client
        host, port = peer.kv_address(fabric == "wan")
        chunk = KVChunk(lo // self.bs, -(-self.length // self.bs), lo, self.length, payload)
        # With a relay, RLD answers the user: the KV for MD is background WAN traffic and
        # yields the connection queue to transfers a first token waits on.
        background = fabric == "wan" and self.req.relay is not None
        tid = transfer_id(self.rid, peer.instance, "kv")
        await self.shipped(
            peer, fabric, client.send(host, port, tid, [chunk], background=background)
        )

    async def shipped(self, peer: Peer, fabric: str, sending: Awaitable[TransferStats]) -> None:
        """Await a KV send to ``peer``: its wire bytes counted, or its failure reported."""
        try:
            sent = await sending
        except Exception as exc:  # noqa: BLE001
            if self.done:  # the stream has ended: nobody reads the queue any more
                self.send_failed(peer, fabric, exc)
            else:
                self.queue.put_nowait(("send_failed", (peer, fabric, exc)))
        else:
            self.stats.kv_wire_bytes[fabric] += sent.bytes_sent

    def send_failed(self, peer: Peer, fabric: str, exc: Exception) -> None:
        """A KV send failed: wake its receiver, so it gives up at once instead of at its KV
        timeout."""
        log.warning("%s: KV send over %s to %s failed: %r", self.rid, fabric, peer.http, exc)
        fire_and_forget(self.agent, cancel_remote(self.agent, peer, self.rid))


def keep_in_background(agent: Agent, sends: list[asyncio.Task]) -> None:
    """Let KV sends still under way finish after the request's stream has ended (the agent
    holds them); `sends` is emptied, so the stream's cleanup does not cancel them."""
    for task in sends:
        if not task.done():
            agent.keep(task)
    sends.clear()
