"""Step 4 of a request's path: the run. One streaming call to P per attempt, whose token events
become text pieces in order; the stall limit and the first-token timeout turn a silent agent
into a failure, which the `recover` the composer hands it (`routes.recovery`) answers with a
retry or a migration. Where the stream comes from, the tokens delivered and, at the end, the
record and usage are written through `recorder` (the end once, as a task no disconnect can
cancel)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from django.conf import settings

from pdd.events import (
    ENGINE_FULL,
    FAILING_ROLES,
    PREFILL_FAILED,
    ContinueEvent,
    DoneEvent,
    ErrorEvent,
    QueuedEvent,
    TokenEvent,
    parse_event,
)
from pdd.stats import DoneStats
from routing.gateway import recorder
from routing.gateway.openai_shapes import LogprobsCollector
from routing.gateway.overload import overload
from routing.gateway.prepared import Prepared
from routing.gateway.recorder import Outcome
from routing.gateway.runner import (
    AgentBusy,
    AgentRunError,
    cancel_on_path,
    continuation_target,
    run_events,
)
from routing.gateway.stream import TextAssembler
from routing.gateway.workers import pending_records

log = logging.getLogger(__name__)
# recover(exc, delivered token ids, tokens still to make) -> whether a new attempt is routed.
Recover = Callable[[AgentRunError, list[int], int], Awaitable[bool]]

# How often a running request's delivered-token count is saved on its admission.
PROGRESS_EVERY_S = 2.0
# A stream with tokens out that goes this long without one (or 10 x its median gap, if more)
# has a frozen decoder: the request migrates (BATON_GATEWAY_STALL_S). An attempt that has not
# sent its first token within FIRST_TOKEN_TIMEOUT_S fails over to another path.
STALL_FLOOR_S = settings.BATON_GATEWAY_STALL_S
FIRST_TOKEN_TIMEOUT_S = settings.BATON_GATEWAY_FIRST_TOKEN_TIMEOUT_S
# A P that keeps saying "queued" (busy, not frozen) is waited for this long at most.
PREFILL_QUEUE_TIMEOUT_S = settings.BATON_GATEWAY_PREFILL_QUEUE_TIMEOUT_S


class Run:
    """Drives one request's agent stream and assembles text, finish reason and the outcome."""

    # Whether the attempt waits in P's engine queue now (a `queued` event came, no token yet).
    at_prefill_queue = False

    def __init__(self, p: Prepared) -> None:
        self.p = p
        self.text = TextAssembler(p.tokenizer, stop=p.greq.stop)
        # The delivered tokens' logprobs, when the request asked for them.
        self.logprobs = (
            LogprobsCollector(p.kind, p.tokenizer)
            if getattr(p.greq, "logprobs", None) is not None
            else None
        )
        # From the request's arrival at the gateway (auth, tokenizing and the policy count).
        self.started = p.received_at or time.monotonic()
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.max_gap_s = 0.0
        self.token_count = 0
        self.by_role = {"prefill": 0, "rld": 0, "md": 0}
        self.stats = DoneStats()  # the last attempt's, from P's done event
        self.finish_reason: str | None = None
        self.status = "ok"
        self.error = ""
        self.recorded = False
        self.write_task: asyncio.Task | None = None
        # When the delivered-token count was last saved on the admission: every
        # PROGRESS_EVERY_S from the start; P's own count (agents/node/served.py) is what a
        # later process bills first, so a short request writes no progress at all.
        self.progress_at = self.started
        self.token_ids: list[int] = []  # delivered so far, for a migration
        self.gaps: list[float] = []  # between consecutive tokens, for the stall limit
        self.last_role = ""
        self.offset = 0  # tokens delivered before the current attempt (its index 0)
        # P's figures from its `continue` event (the decoder's `done` completes them), and
        # when it came: None while the attempt's stream is still P's own.
        self.prefill_stats: DoneStats | None = None
        self.continued_at: float | None = None
        self.kv_wait_s: float | None = None
        # RLD's figures from its `continue` to MD after the handoff (one hop per token), and
        # whose stream the attempt reads now (prefill, rld or md).
        self.relay_stats: DoneStats | None = None
        self.following = "prefill"
        self.attempt_at = self.started  # when this attempt's P stream began

    async def deltas(self, recover: Recover):
        """Yield text pieces in order as tokens arrive, as lists of ``(piece, logprobs)``: the
        pieces of the tokens that arrived together (one read from P's stream), each with the
        logprobs of the tokens it completes (None when not asked); set finish_reason at the end.

        When an attempt fails, ``recover(exc, delivered, remaining)`` (the caller's: it routes
        again) decides whether another attempt follows: before the first token a retry on
        another path, after tokens went out a migration, where a healthy path gets the prompt
        plus the tokens already delivered and continues from there, so the user's stream has no
        gap and no duplicate, and greedy output equals ``single``'s."""
        while True:
            try:
                async for pieces in self._attempt():
                    yield pieces
                return
            except AgentRunError as exc:
                remaining = self.p.greq.max_tokens - self.token_count
                if self.token_count and remaining <= 0:  # every token is out; only 'done' lost
                    self.finish_reason = "length"
                    tail = self.text.flush()
                    if tail:
                        yield [(tail, self.take_logprobs())]
                    return
                if not await recover(exc, list(self.token_ids), remaining):
                    raise
                recorder.attempt(self.p)  # where the new attempt streams from
                self.offset = self.token_count

    def _stall_limit_s(self) -> float | None:
        """How long the stream may go without an event once this attempt's first token is out:
        STALL_FLOOR_S, or 10 x its median gap between tokens when that is longer. None before
        the attempt's first token (the first-token timeout applies)."""
        if self.token_count - self.offset < 1:
            return None
        gaps = self.gaps[-64:]
        median = sorted(gaps)[len(gaps) // 2] if gaps else 0.0
        return max(STALL_FLOOR_S, 10 * median)

    async def _batches(self):
        """The attempt's events, parsed, a list per read: P's stream, then (after P's
        ``continue``) the decoding role's, read directly, one hop per token; in p-rld-md
        RLD's, then (after RLD's ``continue`` at the handoff) MD's from the handoff's index."""
        self.prefill_stats = self.relay_stats = self.continued_at = self.kv_wait_s = None
        self.following = "prefill"
        self.attempt_at = time.monotonic()
        source = run_events(self.p.url, self.p.plan)
        ended = False  # a done event came through
        try:
            while True:
                try:
                    raw = await source.__anext__()
                except StopAsyncIteration:
                    return
                try:
                    # One read's events (runner.run_events); a single event is a batch of one.
                    batch = [parse_event(e) for e in (raw if isinstance(raw, list) else [raw])]
                except ValueError as exc:
                    raise AgentRunError(
                        f"the agent sent a malformed event: {exc}",
                        at_prefill=self.continued_at is None,
                        role=self._own_role(),
                    ) from None
                at = next((i for i, e in enumerate(batch) if isinstance(e, ContinueEvent)), None)
                if at is None:
                    ended = ended or any(isinstance(e, DoneEvent) for e in batch)
                    yield batch
                    continue
                if at:
                    yield batch[:at]
                follow = batch[at]
                assert isinstance(follow, ContinueEvent)
                await source.aclose()
                source = self._follow(follow)
        finally:
            self._left_prefill_queue()
            await source.aclose()
            if self.continued_at is not None and not ended:
                # P handed the stream over and is done; whatever ended it early (a dead
                # decoder, a stall, the client leaving), the other agents on the path must
                # let the request go, as P told them when it relayed: MD's reservation would
                # otherwise hold the prompt's KV "in flight" and make the next attempt wait
                # for it (reserve_ttl_s).
                cancel_on_path(self.p.plan)

    def _follow(self, event: ContinueEvent):
        """A stream ended with ``continue``: P's (to MD or RLD), or RLD's after the handoff
        (to MD, from the handoff's token index). Check the decoder it names is the routed one,
        note the figures and where the stream now comes from (for a process that finishes
        this admission), and open the decoder's stream."""
        from_relay = self.following != "prefill"
        self._left_prefill_queue()  # P prefilled: the request left its queue
        if from_relay and (self.following != "rld" or event.role != "md"):
            raise AgentRunError(
                f"a {self.following.upper()} stream sent 'continue' to {event.role.upper()}",
                at_prefill=False,
            )
        refused = continuation_target(self.p.plan, event.url, event.body, event.role)
        if refused is not None:
            who = "RLD's" if from_relay else "the prefill agent's"
            raise AgentRunError(
                f"{who} continuation was refused: {refused}",
                at_prefill=not from_relay,
                role="rld" if from_relay else "",
            )
        if from_relay:
            self.relay_stats = event.stats  # the handoff's figures; MD's done has none
        else:
            self.prefill_stats = event.stats
            self.continued_at = time.monotonic()
        self.following = event.role
        # Every token delivered so far (P's own, when it went out early) is before the
        # decoder's stream, whose ledger counts the rest (agents/node/served.py).
        recorder.attempt(
            self.p, prefill_url=event.url.split("/v1/pdd/", 1)[0], token_offset=self.token_count
        )
        body = dict(event.body)
        if not from_relay:  # P leaves the prompt out of the decoder's call (the attempt's own)
            body.setdefault("prompt_ids", self.p.plan["prompt_ids"])
        return run_events(event.url, body, source=event.role)

    async def _events(self):
        """The agent's events; a decoder that falls silent mid-stream (frozen, or its link
        black-holed) is a failure after the stall limit, so the request migrates. An attempt
        with no token after FIRST_TOKEN_TIMEOUT_S (a frozen P) fails over the same way."""
        events = self._batches()
        limit: float | None = None
        try:
            while True:
                limit = self._stall_limit_s()
                # A deadline per read, entered in the task that reads: the stream is read by
                # whichever task iterates it (the view for the first tokens, then the
                # coalescing pump), and asyncio.timeout cancels the task that entered it. One
                # deadline held across reads cancelled the view instead of failing the
                # attempt: every stalled stream was cut, none migrated to its end. The
                # deadline is lifted while the event is with the caller, whose time (the
                # client's back-pressure included) is not the agent's silence.
                async with asyncio.timeout(FIRST_TOKEN_TIMEOUT_S if limit is None else limit):
                    try:
                        raw = await events.__anext__()
                    except StopAsyncIteration:
                        return
                yield raw
        except TimeoutError:
            if limit is None:
                if self.continued_at is not None:  # P handed over: the decoder fell silent
                    role = self._own_role()
                    named = {"md": "MD", "rld": "RLD"}.get(role, "decoding")
                    raise AgentRunError(
                        f"no first token from the {named} agent within "
                        f"{FIRST_TOKEN_TIMEOUT_S:g} s (and no keep-alive)",
                        at_prefill=False,
                        role=role,
                    ) from None
                raise AgentRunError(
                    f"no first token from the prefill agent within {FIRST_TOKEN_TIMEOUT_S:g} s"
                ) from None
            last = self.last_role
            named = {"md": "MD", "rld": "RLD"}.get(last, last)
            raise AgentRunError(
                f"stream stalled: no token for {limit:.1f} s (the last one from {named})",
                at_prefill=False,
                role=last if last in FAILING_ROLES else "",
            ) from None
        finally:
            await events.aclose()

    async def _attempt(self):
        events = self._events()
        try:
            async for batch in events:
                pieces: list[tuple[str, dict | None]] = []
                stopped = False
                for event in batch:
                    try:
                        stopped = self._take(event, pieces)
                    except AgentRunError:
                        if pieces:  # the tokens before the failure are the user's already
                            yield pieces
                        raise
                    if stopped:
                        break
                if pieces:
                    yield pieces
                if stopped:
                    return
            tail = self.text.flush()
            if tail:
                yield [(tail, self.take_logprobs())]
            if self.finish_reason is None:
                raise AgentRunError(
                    "the agent stream ended without a 'done' event",
                    at_prefill=False,
                    role=self._own_role(),
                )
        finally:
            await events.aclose()

    def _left_prefill_queue(self) -> None:
        if self.at_prefill_queue:
            self.at_prefill_queue = False
            overload.queued_at_prefill(False)

    def _queued(self, event: QueuedEvent) -> None:
        """An agent's keep-alive (busy, not frozen): the read's first-token deadline restarts
        with it (``_events``). P's (its engine queues the request) is counted as waiting in a
        prefill queue, and past PREFILL_QUEUE_TIMEOUT_S the request is let go with a 503 (no
        token has gone out); a decoder's (its KV on the way) is bounded by the decoder's own
        KV timeout, which ends its stream with an error."""
        if self.following != "prefill" or event.waiting_for != "prefill":
            return  # a decoder's (read directly, or relayed by P): its KV on the way
        if not self.at_prefill_queue:
            self.at_prefill_queue = True
            overload.queued_at_prefill(True)
        waited = time.monotonic() - self.attempt_at
        if waited >= PREFILL_QUEUE_TIMEOUT_S and self.token_count == self.offset:
            raise overload.prefill_queue_timeout(waited)

    def _own_role(self) -> str:
        """The decoding role whose stream is read now (``md``, ``rld``); "" for P's."""
        return self.following if self.following in FAILING_ROLES else ""

    def _take(self, event, pieces: list[tuple[str, dict | None]]) -> bool:
        """One agent event: a token's text (and logprobs) onto ``pieces``, the done event's
        stats, an error event raised. True when a stop string ended the answer."""
        if isinstance(event, QueuedEvent):
            self._queued(event)
        elif isinstance(event, TokenEvent):
            self._left_prefill_queue()
            if event.index != self.token_count - self.offset:
                raise AgentRunError(
                    f"token stream out of order: got index {event.index}, "
                    f"expected {self.token_count - self.offset}",
                    at_prefill=False,
                    role=self._own_role(),
                )
            self.token_count += 1
            self.token_ids.append(event.token_id)
            now = time.monotonic()
            if now - self.progress_at >= PROGRESS_EVERY_S:
                self.progress_at = now
                self._save_progress()
            if self.first_at is None:
                self.first_at = now
            elif self.last_at is not None:
                self.max_gap_s = max(self.max_gap_s, now - self.last_at)
                self.gaps.append(now - self.last_at)
            self.last_at = now
            if self.continued_at is not None and self.kv_wait_s is None:
                self.kv_wait_s = now - self.continued_at  # the decoder's first token is in
            role = event.role
            self.last_role = role
            if role in self.by_role:
                self.by_role[role] += 1
            if self.logprobs is not None:
                self.logprobs.add(event, self.text.decoded_len)
            piece, stopped = self.text.push(event.token_id)
            if piece:
                pieces.append((piece, self.take_logprobs()))
            if stopped:
                self.finish_reason = "stop"
                return True
        elif isinstance(event, DoneEvent):
            self.stats = self._merged(event.stats)
            self.finish_reason = "length" if event.hit_length else "stop"
        elif isinstance(event, ErrorEvent):
            # The role that failed: the one the event names, else the decoder whose own
            # stream this is (read directly, one hop per token); P's: the path's next hop.
            if event.role == PREFILL_FAILED:  # P's own prefill failed after it was queued
                raise AgentRunError(event.message, at_prefill=True)
            role = event.role or self._own_role()
            if event.code == ENGINE_FULL and self.token_count == self.offset:
                raise AgentBusy(event.message, at_prefill=False, role=role)
            raise AgentRunError(event.message, at_prefill=False, role=role)
        return False

    def _merged(self, done: DoneStats) -> DoneStats:
        """The attempt's figures: P's own (its ``continue``) with what the decoder's ``done``
        adds (the handoff); tokens by role as counted here. A stream relayed by P: its done."""
        if self.prefill_stats is None:
            return done
        stats = self.prefill_stats
        handoff = self.relay_stats if self.relay_stats is not None else done
        stats.handoff, stats.handoff_bytes = handoff.handoff, handoff.handoff_bytes
        stats.tokens_by_role = None  # counted from the token events (Run.by_role)
        stats.kv_wait_s = self.kv_wait_s if self.kv_wait_s is not None else 0.0
        return stats

    def outcome(self) -> Outcome:
        now = time.monotonic()
        s = self.stats
        ttft = (self.first_at - self.started) if self.first_at is not None else None
        tpot = (
            (now - self.first_at) / (self.token_count - 1)
            if self.first_at is not None and self.token_count > 1
            else None
        )
        # P's first token counts with the decode role that carries on from it. After a
        # migration the last attempt's stats cover only its part: count here.
        by_role = self.by_role if self.migrations or s.tokens_by_role is None else s.tokens_by_role
        return Outcome(
            status=self.status,
            error=self.error,
            prompt_tokens=len(self.p.prompt_ids),
            cached_tokens=(
                s.cached_tokens
                if s.cached_tokens is not None
                else (self.p.decision.cached_tokens if self.p.decision is not None else 0)
            ),
            completion_tokens=self.token_count,
            tokens_by_rld=by_role["rld"],
            tokens_by_md=by_role["md"],
            migrations=self.migrations,
            ttft_s=ttft,
            prefill_s=s.prefill_s,
            kv_wait_s=s.kv_wait_s,
            max_gap_s=self.max_gap_s if self.first_at is not None else None,
            first_token_early=(
                s.first_token_early if s.first_token_early is not None else self.p.first_token_early
            ),
            tpot_s=tpot,
            e2e_s=now - self.started,
            finish_reason=self.finish_reason or "",
            kv_bytes_intra_dc=s.kv_bytes["intra_dc"],
            kv_bytes_wan=s.kv_bytes["wan"],
            kv_format_wan=s.kv_format_wan,
            handoff_bytes=s.handoff_bytes,
            handoff_at_token=s.handoff.at_token,
            handoff_batches=s.handoff.batches,
        )

    def take_logprobs(self) -> dict | None:
        """The logprobs of the tokens delivered since the last call (a stream chunk's)."""
        return self.logprobs.take() if self.logprobs is not None else None

    def all_logprobs(self) -> dict | None:
        """Every delivered token's logprobs; None when the request did not ask."""
        return self.logprobs.all() if self.logprobs is not None else None

    @property
    def migrations(self) -> int:
        """Times this request moved to another decoder (the migrations routing counts)."""
        return self.p.migrations

    def _save_progress(self) -> None:
        """Save the delivered-token count on the admission, off the stream's path (the record
        writer's queue: after the admission's row, before the record)."""
        recorder.progress(self.p, self.token_count)

    async def record(self) -> None:
        """Write the record and usage once, whatever the client does meanwhile: the write runs
        as its own task, so a disconnect (which cancels the response) cannot cancel it."""
        task = self.record_soon()
        if task is not None:
            # A cancellation (the client went away) reaches the caller; the write carries on.
            await asyncio.shield(task)
        elif self.write_task is not None and not self.write_task.done():
            await asyncio.shield(self.write_task)

    def record_soon(self) -> asyncio.Task | None:
        """Start writing the record and usage (once) as a task of its own, and return it; None
        when it was already started. The caller need not wait: the task is held in
        ``pending_records`` until it ends, and the ASGI shutdown drains those."""
        if self.recorded:
            return None
        self.recorded = True
        p = self.p
        outcome = self.outcome()

        async def write() -> None:
            try:
                await asyncio.wrap_future(recorder.finished(p, outcome))
            except Exception:
                log.exception("could not record request %s", p.request_id)

        task = asyncio.ensure_future(write())
        pending_records.add(task)
        task.add_done_callback(pending_records.discard)
        self.write_task = task
        return task
