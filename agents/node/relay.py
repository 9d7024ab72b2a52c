"""RLD, the relay decode, as an explicit state machine (`RelaySession`).

RLD imports P's full KV, decodes at once and streams its tokens, opens MD's held `decode`
stream itself, hands the request off to MD by token ids (one-shot or catch-up batches), and
relays MD's continuation; a caller that reads the decoder's stream itself (``direct``) gets a
``continue`` naming MD's stream from the handoff's token index instead (agents/node/tail.py),
so MD's tokens take one hop. If MD or the WAN fails before the handoff is acknowledged, RLD
finishes the request itself with the same tokens. agents/PROTOCOL.md, "RLD's handoff", has
the table of every event and failure in each phase.

Everything the session reacts to arrives on the request's inbox queue as one typed item
(`KvArrived`, `Cancelled`, `RldOutput`, `RldFailed`, `MdEvent`, `MdClosed`, `MdFailed`, or
`Unexpected`); `RelaySession.dispatch` hands each to one `on_*` method. Phases change only
through `RelaySession.to`, which checks the move against `TRANSITIONS`: an illegal move is a
bug, logged and ended with an error event, never a silent overwrite.

    WAIT_KV --kv imported--> RELAY --final batch sent--> FINAL --MD's token c--> MAIN
                               |                           |
                               +--MD / WAN failed----------+--> SOLO
    every phase but DONE --last event (done / error)--> DONE
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from agents.engine import EngineFull, PrefixMissing, TokenOutput
from agents.node.agent import Agent
from agents.node.instances import Instance
from agents.node.pipeline_common import (
    Events,
    cancel_remote,
    fire_and_forget,
    get_within,
    kv_payload,
    pump_stream,
    quiet,
    release_remote,
    sampling_json,
    settle,
    token_event,
    transfer_id,
)
from agents.node.relay_phases import (
    Cancelled,
    Handoff,
    KvArrived,
    MdClosed,
    MdEvent,
    MdFailed,
    Phase,
    PhaseMachine,
    RelayItem,
    RelayRequest,
    RldFailed,
    RldOutput,
    Unexpected,
    as_item,
)
from agents.node.wire import output_logprob, relayed_token
from agents.transfer.records import TokenIds, TransferStats
from pdd.events import ENGINE_FULL, ReadyEvent
from pdd.token_ids import to_wire
from pdd.vocab import HandoffMode

log = logging.getLogger(__name__)

# How long a finished relay lets its in-flight handoff batches (token IDs) reach MD.
HANDOFF_SEND_GRACE_S = 5.0
# How long a relay that hands the stream over waits for its final batch's send to report its
# bytes (it has normally reported: MD's token came after the batch).
HANDOFF_BYTES_WAIT_S = 0.5


# -- the session -------------------------------------------------------------------------------


class RelaySession(PhaseMachine):
    """One relayed request on RLD: its state, one method per kind of item, and the outbox of
    events for the caller (PhaseMachine). `events()` drives it; tests drive `dispatch`."""

    def __init__(self, agent: Agent, inst: Instance, req: RelayRequest) -> None:
        super().__init__(req.request_id)
        self.agent, self.inst, self.req = agent, inst, req
        self.worker = inst.running_worker
        self.main = req.main
        self.plan = req.plan
        self.length = len(req.prompt)
        self.queue: asyncio.Queue = agent.inbox.queue(self.rid, inst.instance_id)
        self.handoff = Handoff(req.plan.mode if req.main is not None else "none")
        self.rld_tokens: list[int] = []  # every token RLD's engine produced
        self.buffered: list[TokenOutput] = []  # RLD's outputs held back in FINAL
        self.counts = {"rld": 0, "md": 0}
        self.next_index = 1  # index 0 is P's first token
        self.early: list[RelayItem] = []  # items that came before the KV, replayed after it
        self.md_task: asyncio.Task | None = None
        self.deadline: asyncio.TimerHandle | None = None
        self.engine_live = False  # RLD's engine holds the request: abort it at the end
        self.md_done = False  # MD finished the request: nothing to cancel there
        # RLD finished the request itself: MD is not cancelled, only its stream closed, so it
        # still caches the KV P sent it (MD's prefix cache must not fall behind P's).
        self.finished_here = False

    def done_event(self, reason: str | None) -> dict[str, Any]:
        return {
            "type": "done",
            "finish_reason": reason,
            "stats": {
                "tokens_by_role": dict(self.counts),
                "handoff": self.handoff.to_json(),
                "handoff_bytes": self.handoff.bytes,
            },
        }

    def emit_rld(self, out: TokenOutput) -> bool:
        """Stream one RLD output; True when it finished the request (done is out)."""
        for j, tok in enumerate(out.token_ids):
            self.counts["rld"] += 1
            self.agent.instances.count_tokens(self.inst)
            self.emit(token_event(self.next_index, tok, "rld", output_logprob(out, j)))
            self.next_index += 1
        if out.finished:
            self.engine_live = False
            self.finish(self.done_event(out.finish_reason))
            return True
        return False

    # -- dispatch --------------------------------------------------------------------------

    async def dispatch(self, item: RelayItem) -> None:
        if self.phase is Phase.DONE:
            log.debug("%s: %r after the relay ended; dropped", self.rid, item)
            return
        if self.phase is Phase.WAIT_KV and not isinstance(item, KvArrived | Cancelled):
            self.early.append(item)  # MD's stream may report before P's KV lands: keep it
            return
        match item:
            case Cancelled():
                self.on_cancel(item)
            case KvArrived():
                await self.on_kv(item)
            case RldOutput():
                self.on_rld_output(item)
            case RldFailed():
                self.on_rld_failed(item)
            case MdEvent():
                await self.on_md_event(item)
            case MdClosed():
                self.on_md_closed(item)
            case MdFailed():
                self.on_md_failed(item)
            case _:
                self.on_unexpected(item)

    def on_kv_timeout(self) -> None:
        """No KV from P within kv_timeout_s (WAIT_KV only)."""
        if self.phase is Phase.WAIT_KV:
            self.fail(f"no KV from P within {self.agent.settings.kv_timeout_s} s")

    def on_cancel(self, item: Cancelled) -> None:
        if self.phase is Phase.WAIT_KV:
            self.fail(f"KV transfer failed: {item.error}")
        else:
            self.fail(f"{item.error}")

    async def on_kv(self, item: KvArrived) -> None:
        if self.phase is not Phase.WAIT_KV:
            log.info("%s: a second KV transfer in phase %s; ignored", self.rid, self.phase)
            return
        payload = kv_payload(item.transfer)
        req, rid, queue = self.req, self.rid, self.queue
        self.worker.add_sink(
            rid,
            lambda out: queue.put_nowait(
                RldFailed(out) if isinstance(out, BaseException) else RldOutput(out)
            ),
        )

        def admit(engine):
            engine.import_prefix(rid, req.prompt, 0, payload)
            engine.start_decode(rid, req.prompt, req.first_token, req.sampling)

        try:
            await self.worker.call(admit)
        except (EngineFull, PrefixMissing, ValueError, KeyError) as exc:
            self.fail(
                f"cannot import KV: {type(exc).__name__}: {exc}",
                ENGINE_FULL if isinstance(exc, EngineFull) else "",
            )
            return
        self.engine_live = True
        if not self.to(Phase.RELAY):
            return
        for early in self.early:  # after whatever reached the queue during the import
            queue.put_nowait(early)
        self.early.clear()

    def on_rld_output(self, item: RldOutput) -> None:
        if self.phase is Phase.MAIN:
            return  # released at the handoff: a step already under way, nobody's tokens
        if self.phase not in (Phase.RELAY, Phase.FINAL, Phase.SOLO):
            log.error("%s: relay bug: RLD output in phase %s dropped", self.rid, self.phase)
            return
        out = item.out
        self.rld_tokens.extend(out.token_ids)
        if self.phase is Phase.FINAL:
            self.buffered.append(out)  # MD's token c decides whose tokens the user gets
            return
        if self.emit_rld(out):
            self.finished_here = self.handoff.failed is None
            return
        self.maybe_handoff()

    def on_rld_failed(self, item: RldFailed) -> None:
        if self.phase is Phase.MAIN:
            return  # RLD no longer holds the request
        self.fail(f"engine failed: {item.error}")

    async def on_md_event(self, item: MdEvent) -> None:
        value = item.event
        kind = value.get("type")
        if kind == "ready":
            self.handoff.md_ready = True
            self.handoff.slot_wait_s = ReadyEvent.from_json(value).slot_wait_s
            self.maybe_handoff()
        elif kind == "extended":
            self.handoff.inflight = False
            self.maybe_handoff()
        elif kind == "token":
            index = value.get("index")
            if self.phase is Phase.FINAL and index == self.handoff.at_token:
                await self.complete_handoff()
                if self.phase is not Phase.MAIN:
                    return
            if self.phase is not Phase.MAIN:
                self.abandon(f"MD sent token {index} before the handoff")
            elif index != self.next_index:
                self.fail(f"MD sent index {index}, expected {self.next_index}", role="md")
            else:
                self.counts["md"] += 1
                self.emit(relayed_token(self.next_index, value, "md"))
                self.next_index += 1
        elif kind == "done":
            if self.phase is Phase.MAIN:
                self.md_done = True
                self.finish(self.done_event(value.get("finish_reason")))
            else:
                self.abandon("MD finished before the handoff")
        elif kind == "error":
            if self.phase is Phase.MAIN:
                self.fail(f"MD failed after the handoff: {value}", role="md")
            else:
                self.abandon(f"MD reported: {value.get('message')}")

    def on_md_closed(self, item: MdClosed) -> None:
        if self.phase is Phase.MAIN:
            self.fail(f"MD stream ended after the handoff: {item.error!r}", role="md")
        else:
            self.abandon(f"MD stream closed: {item.error!r}")

    def on_md_failed(self, item: MdFailed) -> None:
        self.abandon(item.reason)

    def on_unexpected(self, item: Unexpected) -> None:
        log.info("%s: unexpected %r in phase %s; ignored", self.rid, item.what, self.phase)

    # -- the handoff -----------------------------------------------------------------------

    def maybe_handoff(self) -> None:
        """In RELAY, once MD is ready and no batch is waiting for `extended`: send a catch-up
        batch, or cut at the next index and send the final one (-> FINAL)."""
        handoff, plan = self.handoff, self.plan
        if (
            self.phase is not Phase.RELAY
            or self.main is None
            or not handoff.md_ready
            or handoff.inflight
        ):
            return
        n = len(self.rld_tokens)
        if n < plan.handoff_at:
            return
        pending = self.rld_tokens[handoff.tokens_handed :]
        # Catch-up goes on while it converges: a round must leave a smaller gap than the batch
        # it sent (else RLD decodes faster than MD extends plus the round trip, and more rounds
        # only chase it), and at most max_catch_up_batches rounds; then the final batch takes
        # whatever is pending, as one-shot does.
        if (
            plan.mode == HandoffMode.CATCH_UP
            and len(pending) >= plan.catch_up_batch
            and handoff.batches < plan.max_catch_up_batches
            and (not handoff.batch_tokens or len(pending) < handoff.batch_tokens[-1])
        ):
            handoff.inflight = True
            self.send_batch(pending, final=False)
            return
        if not pending and handoff.batches > 0:
            return  # after a batch, MD holds KV for everything: wait for one more token
        if not self.to(Phase.FINAL):
            return
        handoff.at_token = n + 1
        self.send_batch(pending, final=True)
        ack_timeout_s = self.agent.links.handoff_ack_timeout_s(self.main.datacenter)
        self.deadline = asyncio.get_running_loop().call_later(
            ack_timeout_s,
            self.queue.put_nowait,
            MdFailed(f"no acknowledgement within {ack_timeout_s:.2f} s"),
        )

    def send_batch(self, ids: list[int], final: bool) -> None:
        main, handoff, queue = self.main, self.handoff, self.queue
        assert main is not None
        name = f"h{handoff.batches}" + (".final" if final else "")
        start = self.length + 1 + handoff.tokens_handed
        handoff.batches += 1
        handoff.tokens_handed += len(ids)
        handoff.batch_tokens.append(len(ids))
        client = self.agent.links.wan_client(main.datacenter)
        host, port = main.kv_address(True)
        tid = transfer_id(self.rid, main.instance, name)

        async def send() -> None:
            try:
                stats: TransferStats = await client.send(
                    host, port, tid, [], tokens=TokenIds(start, tuple(ids))
                )
            except Exception as exc:  # noqa: BLE001 - the WAN failed: RLD finishes itself
                queue.put_nowait(MdFailed(f"handoff send failed: {exc!r}"))
            else:
                handoff.bytes += stats.bytes_sent

        handoff.sent.append(asyncio.create_task(send()))

    async def complete_handoff(self) -> None:
        """MD's token c arrived in FINAL: the handoff is acknowledged (-> MAIN)."""
        if not self.to(Phase.MAIN):
            return
        self.handoff.completed = True
        self.cancel_deadline()
        self.worker.remove_sink(self.rid)
        await quiet(self.worker.call(lambda e: e.release(self.rid)))
        self.engine_live = False
        self.buffered.clear()
        if self.req.direct:
            await self.hand_over()

    async def hand_over(self) -> None:
        """One hop per token: end this stream with a `continue` naming MD's stream from the
        handoff's token index (MD keeps decoding for whoever attaches; closing the held stream
        does not cancel it there)."""
        main = self.main
        assert main is not None
        unsent = [task for task in self.handoff.sent if not task.done()]
        if unsent:  # the final batch's byte count, for the record
            await asyncio.wait(unsent, timeout=HANDOFF_BYTES_WAIT_S)
        self.md_done = True  # MD owns the request now
        stats = self.done_event(None)["stats"]
        self.finish(
            {
                "type": "continue",
                "url": f"{main.http}/v1/pdd/attach",
                "body": {
                    "request_id": self.rid,
                    "instance": main.instance,
                    "from_index": self.next_index,
                },
                "instance": main.instance,
                "role": "md",
                "stats": stats,
            }
        )

    def abandon(self, reason: str) -> None:
        """MD or the WAN failed before the handoff completed (RELAY / FINAL): cancel MD, flush
        RLD's buffered tokens and let RLD finish (-> SOLO). Elsewhere: nothing to abandon."""
        if self.phase not in (Phase.RELAY, Phase.FINAL):
            log.debug("%s: %s in phase %s; ignored", self.rid, reason, self.phase)
            return
        log.warning("%s: handoff abandoned, RLD finishes: %s", self.rid, reason)
        self.handoff.failed = reason
        if not self.to(Phase.SOLO):
            return
        self.cancel_deadline()
        if self.md_task is not None:
            self.md_task.cancel()
        fire_and_forget(self.agent, cancel_remote(self.agent, self.main, self.rid))
        buffered, self.buffered = self.buffered, []
        for out in buffered:
            if self.emit_rld(out):
                return

    def cancel_deadline(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()

    # -- driving ---------------------------------------------------------------------------

    def open_main(self) -> None:
        """Open MD's held decode stream (its events and its end come as MdEvent / MdClosed)."""
        main, req, queue = self.main, self.req, self.queue
        if main is None:
            return
        body = {
            "request_id": self.rid,
            "instance": main.instance,
            "prompt_ids": to_wire(req.prompt),
            "first_token": req.first_token,
            "sampling": sampling_json(req.sampling),
            "start_token": req.main_start_token,
            "hold": True,
        }
        if req.direct:
            body["detachable"] = True
        self.md_task = asyncio.create_task(
            pump_stream(
                self.agent.http,
                f"{main.http}/v1/pdd/decode",
                body,
                lambda event: queue.put_nowait(MdEvent(event)),
                lambda exc: queue.put_nowait(MdClosed(exc)),
            )
        )

    async def events(self) -> Events:
        """The relay's event stream: dispatch the inbox's items until the last event."""
        try:
            self.open_main()
            kv_deadline = time.monotonic() + self.agent.settings.kv_timeout_s
            while self.phase is not Phase.DONE:
                if self.phase is Phase.WAIT_KV:
                    try:
                        raw = await get_within(self.queue, kv_deadline - time.monotonic())
                    except TimeoutError:
                        self.on_kv_timeout()
                        raw = None
                else:
                    raw = await self.queue.get()
                if raw is not None:
                    await self.dispatch(as_item(raw))
                while self.outbox:
                    yield self.outbox.popleft()
            while self.outbox:
                yield self.outbox.popleft()
        finally:
            await self.close()

    async def close(self) -> None:
        """Whatever ended the request: stop MD's stream and the timer, let batches on the wire
        end, let RLD's engine go, and cancel MD unless it finished; release it (it keeps P's
        KV) when RLD finished alone."""
        self.cancel_deadline()
        if self.md_task is not None:
            self.md_task.cancel()
        unsent = [task for task in self.handoff.sent if not task.done()]
        if unsent:
            # Let handoff batches already on the wire end (a few bytes of token IDs each)
            # rather than cut them mid-stream, which MD would log as a failed transfer; MD
            # drops them once the request is over there.
            fire_and_forget(self.agent, settle(unsent, HANDOFF_SEND_GRACE_S))
        self.worker.remove_sink(self.rid)
        self.agent.inbox.drop(self.rid, self.inst.instance_id)
        if self.engine_live:
            await quiet(self.worker.call(lambda e: e.abort(self.rid)))
        if self.main is None or self.md_done:
            return
        if self.finished_here:
            # MD keeps P's KV (its cache must not fall behind P's): closing its stream says so
            # once MD's handler runs; this says so when the stream never reached it.
            start = self.req.main_start_token
            fire_and_forget(self.agent, release_remote(self.agent, self.main, self.rid, start))
        else:
            fire_and_forget(self.agent, cancel_remote(self.agent, self.main, self.rid))


async def run_relay(agent: Agent, inst: Instance, req: RelayRequest) -> Events:
    """RLD's pipeline for one request (POST /v1/pdd/relay): see RelaySession."""
    events = RelaySession(agent, inst, req).events()
    try:
        async for event in events:
            yield event
    finally:
        await events.aclose()  # the session's cleanup runs now, not when collected
