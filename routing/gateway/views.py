"""OpenAI-compatible endpoints: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import time
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import close_old_connections, transaction
from django.http import HttpRequest, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt

from agents.prefix import prefix_block_hashes
from billing.models import ApiKey
from billing.ratelimit import RateLimiter
from billing.services import api_key_authenticate
from fleet.models import ServedModel
from routing.gateway import parsing
from routing.gateway.caches import api_keys, secret_key, served_models
from routing.gateway.errors import (
    GatewayError,
    bad_request,
    rate_limited,
    unauthorized,
    unavailable,
)
from routing.gateway.openai_shapes import LogprobsCollector
from routing.gateway.records import (
    Outcome,
    admission_attempt,
    admission_open,
    admission_progress,
    record_request,
)
from routing.gateway.request_ids import gateway_request_id, with_request_id
from routing.gateway.runner import AgentRunError, Sampling, build_plan, run_events
from routing.gateway.stream import TextAssembler
from routing.gateway.timing import Stopwatch
from routing.gateway.tokenizers import apply_chat_template, tokenizer_for
from routing.live import (
    DispatchedBlocks,
    DispatchLedger,
    LiveViewCache,
    suspect_ledger,
    with_dispatched_blocks,
    with_dispatches,
    without_suspects,
)
from routing.policy import Decision, NoHealthyPath, Pipeline, RequestInfo, decide
from routing.policy_cache import PolicyCache

log = logging.getLogger(__name__)
# Blocking work (ORM, tokenizer, policy) runs in a thread pool, not Django's single
# thread-sensitive thread: concurrent requests must not queue behind each other there.


def in_worker(fn):
    """``fn`` as a coroutine function run in the thread pool, with the connection upkeep that
    Django's request signals do only in the thread-sensitive thread: before and after the call,
    this pool thread's database connection is closed if it is broken (a database restart) or
    older than CONN_MAX_AGE, so a pool thread never keeps a dead or stale connection."""

    def run(*args, **kwargs):
        close_old_connections()
        try:
            return fn(*args, **kwargs)
        finally:
            close_old_connections()

    return sync_to_async(run, thread_sensitive=False)


# Record writes in flight (each its own task, so a client's disconnect cannot cancel one);
# a shutting-down process waits for them (drain_pending_records).
pending_records: set[asyncio.Future] = set()


async def drain_pending_records(timeout_s: float = 30.0) -> int:
    """Wait for the record writes still in flight; returns how many did not finish in time."""
    if not pending_records:
        return 0
    _, left = await asyncio.wait(set(pending_records), timeout=timeout_s)
    return len(left)


live_views = LiveViewCache()
# Shared by every gateway process through Redis when REDIS_URL is set (else this process's).
dispatches = DispatchLedger(
    redis_url=settings.REDIS_URL, prefix=f"{settings.REDIS_KEY_PREFIX}:dispatch"
)
# The prompts' prefix blocks sent to each MD, counted as held there until MD's next report.
dispatched_blocks = DispatchedBlocks(
    redis_url=settings.REDIS_URL, prefix=f"{settings.REDIS_KEY_PREFIX}:dispatched-blocks"
)
# Instances seen failing, avoided until their next report (shared through Redis when set).
suspects = suspect_ledger()
# Attempts on another path for a request that failed before its first token.
MAX_RETRIES = 2
# Moves of a request to another decoder after its decoder failed mid-stream.
MAX_MIGRATIONS = 2
# How often a running request's delivered-token count is saved on its admission.
PROGRESS_EVERY_S = 2.0
# A stream with tokens out that goes this long without one (or 10 x its median gap, if more)
# has a frozen decoder: the request migrates (BATON_GATEWAY_STALL_S). An attempt that has not
# sent its first token within FIRST_TOKEN_TIMEOUT_S fails over to another path.
STALL_FLOOR_S = settings.BATON_GATEWAY_STALL_S
FIRST_TOKEN_TIMEOUT_S = settings.BATON_GATEWAY_FIRST_TOKEN_TIMEOUT_S
policies = PolicyCache()
_limiter: RateLimiter | None = None


def limiter() -> RateLimiter:
    global _limiter
    if _limiter is None:
        _limiter = RateLimiter(settings.REDIS_URL, prefix=f"{settings.REDIS_KEY_PREFIX}:rl")
    return _limiter


def _authenticate(request: HttpRequest) -> ApiKey:
    header = request.headers.get("Authorization", "")
    scheme, _, raw = header.partition(" ")
    if scheme.lower() != "bearer" or not raw.strip():
        raise unauthorized("Missing API key: send 'Authorization: Bearer <key>'.")
    raw = raw.strip()
    key = api_keys.get(secret_key(raw), lambda: api_key_authenticate(raw))
    if key is None:
        raise unauthorized("Invalid, revoked or inactive API key.")
    return key


def _served_model(name: str) -> ServedModel:
    model = served_models.get(name, lambda: ServedModel.objects.filter(name=name).first())
    if model is None:
        raise GatewayError(
            404, f"The model '{name}' does not exist.", param="model", code="model_not_found"
        )
    return model


class Prepared:
    """Everything decided before the agents run: who, what, where and why."""

    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


def _prepare(request: HttpRequest, kind: str, watch: Stopwatch | None = None) -> Prepared:
    received_at = time.monotonic()
    watch = watch or Stopwatch()
    watch.lap("queue")  # the hop onto a gateway worker thread
    key = _authenticate(request)
    watch.lap("auth")
    body = parsing.parse_json(request.body)
    greq = (
        parsing.parse_chat(body, apply_chat_template)
        if kind == "chat.completions"
        else parsing.parse_completion(body)
    )
    watch.lap("parse")
    model = _served_model(greq.model)
    tokenizer = tokenizer_for(name=model.name, source=model.source, tokenizer=model.tokenizer)
    prompt_ids = tokenizer.encode(greq.prompt_text)
    watch.lap("tokenize")
    total = len(prompt_ids) + greq.max_tokens
    if total > model.max_context_tokens:
        raise bad_request(
            f"This model's maximum context length is {model.max_context_tokens} tokens; the "
            f"prompt ({len(prompt_ids)}) plus max_tokens ({greq.max_tokens}) is {total}.",
            "max_tokens",
        )
    tenant = key.tenant
    verdict = limiter().check(
        tenant=tenant.name,
        rpm=tenant.requests_per_minute,
        tpm=tenant.tokens_per_minute,
        tokens=total,
    )
    if not verdict.allowed:
        raise rate_limited(verdict.limit, verdict.retry_after_s)
    watch.lap("limit")
    request_id = gateway_request_id(request, kind)
    client_request_id = getattr(request, "baton_client_request_id", "")
    policy, version = policies.current()
    info = RequestInfo(
        prompt_tokens=len(prompt_ids),
        max_tokens=greq.max_tokens,
        prefix_block_hashes=prefix_block_hashes(prompt_ids, model.kv_block_size),
        block_tokens=model.kv_block_size,
    )
    p = Prepared(
        key=key,
        greq=greq,
        model=model,
        tokenizer=tokenizer,
        prompt_ids=prompt_ids,
        request_id=request_id,
        client_request_id=client_request_id,
        kind=kind,
        info=info,
        policy=policy,
        version=version,
        first_token_early=policy.stream_first_token_early,
        received_at=received_at,
        attempt=0,
        migrations=0,
        retried=[],
        watch=watch,
    )
    try:
        _route(p)
    except NoHealthyPath as exc:
        record_request(
            request_id=request_id,
            api_key=key,
            model=model.name,
            endpoint=kind,
            stream=greq.stream,
            decision=None,
            policy_version=version,
            decision_inputs=p.inputs,
            outcome=Outcome(
                status="rejected", error=f"no healthy path: {exc}", prompt_tokens=len(prompt_ids)
            ),
            client_request_id=client_request_id,
        )
        raise unavailable(f"No healthy path for model '{model.name}': {exc}") from exc
    watch.lap("route")
    # Durable before any agent is called: if this process dies, a later one records it.
    admission_open(
        request_id=request_id,
        api_key=key,
        model=model.name,
        endpoint=kind,
        stream=greq.stream,
        prompt_tokens=len(prompt_ids),
        decision=p.decision,
        policy_version=version,
        decision_inputs=p.inputs,
        attempt_request_id=p.plan["request_id"],
        prefill_url=p.prefill_http,
        client_request_id=client_request_id,
    )
    watch.lap("admit")
    return p


def _route(p: Prepared) -> None:
    """Decide the path on the live view (with this gateway's dispatches, the KV already sent
    to each MD, and without the instances seen failing) and build the agents' plan; sets
    ``p.decision``, ``p.inputs``, ``p.url`` and ``p.plan``. Raises NoHealthyPath."""
    view = live_views.get(p.model.name)
    snapshot = with_dispatches(view, dispatches)
    # MD will hold what the gateways have already sent it (KV on its way, not yet in its
    # heartbeat): a session's next turn sent right after the previous answer is a hit there.
    snapshot, in_flight = with_dispatched_blocks(
        view, snapshot, dispatched_blocks, p.info.prefix_block_hashes
    )
    snapshot, avoided = without_suspects(view, snapshot, suspects)
    inputs = {
        "prompt_tokens": len(p.prompt_ids),
        "max_tokens": p.greq.max_tokens,
        "instances": {
            i.id: {
                "role": i.role,
                "healthy": i.healthy,
                "load": round(i.load, 3),
                "dc": i.datacenter,
            }
            for i in (
                *snapshot.prefill,
                *snapshot.relay_decode,
                *snapshot.main_decode,
            )
        },
        "wan_links": {
            dc: {
                "gbps": link.bandwidth_gbps,
                "rtt_ms": link.rtt_ms,
                "use": round(link.utilisation, 3),
                "status": link.status,
            }
            for dc, link in snapshot.wan_links.items()
        },
    }
    if in_flight:
        # Per MD, the prompt's leading blocks counted as held only because a gateway had
        # already dispatched them there (its heartbeat did not show them yet).
        inputs["dispatched_blocks"] = in_flight
    if avoided:
        inputs["suspect"] = avoided  # seen failing since their last report: routed around
    if p.retried:
        inputs["retried"] = p.retried
    p.inputs = inputs
    decision = decide(p.info, snapshot, p.policy)
    dispatches.record((decision.prefill_id, decision.relay_id, decision.main_id))
    if decision.pipeline in (Pipeline.P_MD, Pipeline.P_RLD_MD):
        dispatched_blocks.record(decision.main_id, p.info.prefix_block_hashes)
    # The agents see each attempt as its own request (a retry must not meet the first one's
    # leftovers); the record keeps the gateway's id.
    agent_request_id = p.request_id if not p.attempt else f"{p.request_id}-r{p.attempt}"
    # A migrated request continues from the prompt plus what the user already has.
    ids = getattr(p, "continue_ids", None) or p.prompt_ids
    max_tokens = getattr(p, "continue_max_tokens", None) or p.greq.max_tokens
    p.prefill_http = view.endpoints[decision.prefill_id].http
    p.url, p.plan = build_plan(
        request_id=agent_request_id,
        prompt_ids=ids,
        sampling=Sampling(
            max_tokens, p.greq.temperature, p.greq.top_p, p.greq.seed, p.greq.logprobs
        ),
        decision=decision,
        view=view,
        early_first_token=p.policy.stream_first_token_early,
    )
    p.decision = decision


def _implicated(decision: Decision, exc: AgentRunError) -> list[str]:
    """The instances a failure points at. P itself when P could not be reached; MD when the
    message names MD (RLD or P report MD's failures as "MD ..."); else P's next hop, the relay
    where the pipeline has one. Marking both decoders would leave a one-RLD, one-MD fleet no
    path to migrate to, although only one of them died."""
    if exc.at_prefill:
        return [decision.prefill_id]
    message = str(exc)
    if decision.main_id and (re.search(r"\bMD\b", message) or "main decode" in message.lower()):
        return [decision.main_id]
    hop = decision.relay_id or decision.main_id
    return [hop] if hop else []


def _reroute(p: Prepared, exc: AgentRunError, record: dict[str, Any]) -> tuple[list[str], str]:
    """Mark the instances `exc` implicates suspect, note the attempt (`record` added to its
    entry in the decision inputs) and route `p` again. Returns the implicated ids and, when no
    path is left, why (else "")."""
    d = p.decision
    implicated = _implicated(d, exc)
    suspects.mark(implicated)
    p.retried.append(
        {"pipeline": d.pipeline, "instances": implicated, "error": str(exc)[:300], **record}
    )
    p.attempt += 1
    try:
        _route(p)
    except NoHealthyPath as no_path:
        return implicated, str(no_path) or "no healthy path"
    # Where the new attempt streams from, for a process that finishes this one's admissions.
    offset = len(getattr(p, "continue_ids", None) or p.prompt_ids) - len(p.prompt_ids)
    admission_attempt(p.request_id, p.plan["request_id"], p.prefill_http, offset)
    return implicated, ""


def _migrate(p: Prepared, exc: AgentRunError, delivered: list[int], remaining: int) -> bool:
    """The decoder failed after `delivered` tokens went out: route the prompt plus those
    tokens again for the `remaining` ones (its prefix is cached where the KV is held, so MD's
    cache makes that cheap). False past the limit or with no path left."""
    if p.migrations >= MAX_MIGRATIONS or p.attempt >= MAX_RETRIES + MAX_MIGRATIONS:
        return False
    ids = [*p.prompt_ids, *delivered]
    p.continue_ids, p.continue_max_tokens = ids, remaining
    p.info = RequestInfo(
        prompt_tokens=len(ids),
        max_tokens=remaining,
        prefix_block_hashes=prefix_block_hashes(ids, p.model.kv_block_size),
        block_tokens=p.model.kv_block_size,
    )
    implicated, no_path = _reroute(p, exc, {"migrated_at_token": len(delivered)})
    if no_path:
        log.warning(
            "request %s: %s failed after %d tokens (%s); no path to migrate to: %s",
            p.request_id, implicated, len(delivered), exc, no_path,
        )  # fmt: skip
        return False
    p.migrations += 1
    log.warning(
        "request %s: %s failed after %d tokens (%s); migrated to %s",
        p.request_id, implicated, len(delivered), exc, p.decision.pipeline,
    )  # fmt: skip
    return True


def _retry_elsewhere(p: Prepared, exc: AgentRunError) -> bool:
    """After a failure before the user got any token: route the request again. False when
    the retries are used up or no path is left."""
    if p.attempt >= MAX_RETRIES:
        return False
    implicated, no_path = _reroute(p, exc, {})
    if no_path:
        return False
    log.warning(
        "request %s: %s failed before its first token (%s); retrying on %s",
        p.request_id, implicated, exc, p.decision.pipeline,
    )  # fmt: skip
    return True


def _usage(p: Prepared, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": len(p.prompt_ids),
        "completion_tokens": completion_tokens,
        "total_tokens": len(p.prompt_ids) + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class Run:
    """Drives one request's agent stream and assembles text, finish reason and the outcome."""

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
        self.started = getattr(p, "received_at", None) or time.monotonic()
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.max_gap_s = 0.0
        self.token_count = 0
        self.by_role = {"prefill": 0, "rld": 0, "md": 0}
        self.stats: dict[str, Any] = {}
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

    async def deltas(self):
        """Yield text pieces in order as tokens arrive; set finish_reason at the end.

        A failure before the first token is retried on another path (``_retry_elsewhere``);
        one after tokens went out migrates the request (``_migrate``): a healthy path gets the
        prompt plus the tokens already delivered and continues from there, so the user's stream
        has no gap and no duplicate, and greedy output equals ``single``'s."""
        while True:
            try:
                async for piece in self._attempt():
                    yield piece
                return
            except AgentRunError as exc:
                if not self.token_count:
                    if not await in_worker(_retry_elsewhere)(self.p, exc):
                        raise
                    continue
                remaining = self.p.greq.max_tokens - self.token_count
                if remaining <= 0:  # every token is out; only the 'done' was lost
                    self.finish_reason = "length"
                    tail = self.text.flush()
                    if tail:
                        yield tail
                    return
                if not await in_worker(_migrate)(self.p, exc, list(self.token_ids), remaining):
                    raise
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

    async def _events(self):
        """The agent's events; a decoder that falls silent mid-stream (frozen, or its link
        black-holed) is a failure after the stall limit, so the request migrates. An attempt
        with no token after FIRST_TOKEN_TIMEOUT_S (a frozen P) fails over the same way."""
        events = run_events(self.p.url, self.p.plan)
        try:
            while True:
                limit = self._stall_limit_s()
                try:
                    event = await asyncio.wait_for(
                        events.__anext__(), FIRST_TOKEN_TIMEOUT_S if limit is None else limit
                    )
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    if limit is None:
                        raise AgentRunError(
                            f"no first token from the prefill agent within "
                            f"{FIRST_TOKEN_TIMEOUT_S:g} s"
                        ) from None
                    role = {"md": "MD", "rld": "RLD"}.get(self.last_role, self.last_role)
                    raise AgentRunError(
                        f"stream stalled: no token for {limit:.1f} s (the last one from {role})",
                        at_prefill=False,
                    ) from None
                yield event
        finally:
            await events.aclose()

    async def _attempt(self):
        events = self._events()
        try:
            async for event in events:
                kind = event.get("type")
                if kind == "token":
                    if event.get("index") != self.token_count - self.offset:
                        raise AgentRunError(
                            f"token stream out of order: got index {event.get('index')}, "
                            f"expected {self.token_count - self.offset}",
                            at_prefill=False,
                        )
                    self.token_count += 1
                    self.token_ids.append(int(event["token_id"]))
                    now = time.monotonic()
                    if now - self.progress_at >= PROGRESS_EVERY_S:
                        self.progress_at = now
                        self._save_progress()
                    if self.first_at is None:
                        self.first_at = now
                    else:
                        self.max_gap_s = max(self.max_gap_s, now - self.last_at)
                        self.gaps.append(now - self.last_at)
                    self.last_at = now
                    role = event.get("role", "")
                    self.last_role = role
                    if role in self.by_role:
                        self.by_role[role] += 1
                    if self.logprobs is not None:
                        self.logprobs.add(event, self.text.decoded_len)
                    piece, stopped = self.text.push(int(event["token_id"]))
                    if piece:
                        yield piece
                    if stopped:
                        self.finish_reason = "stop"
                        return
                elif kind == "done":
                    self.stats = event.get("stats") or {}
                    reason = event.get("finish_reason")
                    self.finish_reason = "length" if reason in ("length", "max_tokens") else "stop"
                elif kind == "error":
                    raise AgentRunError(str(event.get("message", "agent error")), at_prefill=False)
            tail = self.text.flush()
            if tail:
                yield tail
            if self.finish_reason is None:
                raise AgentRunError(
                    "the agent stream ended without a 'done' event", at_prefill=False
                )
        finally:
            await events.aclose()

    def outcome(self) -> Outcome:
        now = time.monotonic()
        s = self.stats
        kv = s.get("kv_bytes") or {}
        handoff = s.get("handoff") or {}
        by_role = s.get("tokens_by_role") or {}
        ttft = (self.first_at - self.started) if self.first_at is not None else None
        tpot = (
            (now - self.first_at) / (self.token_count - 1)
            if self.first_at is not None and self.token_count > 1
            else None
        )
        return Outcome(
            status=self.status,
            error=self.error,
            prompt_tokens=len(self.p.prompt_ids),
            cached_tokens=int(s.get("cached_tokens", self.p.decision.cached_tokens) or 0),
            completion_tokens=self.token_count,
            # P's first token counts with the decode role that carries on from it.
            # After a migration the last attempt's stats cover only its part: count here.
            tokens_by_rld=int(
                self.by_role["rld"] if self.migrations else by_role.get("rld", self.by_role["rld"])
            ),
            tokens_by_md=int(
                self.by_role["md"] if self.migrations else by_role.get("md", self.by_role["md"])
            ),
            migrations=self.migrations,
            ttft_s=ttft,
            prefill_s=_seconds(s.get("prefill_s")),
            kv_wait_s=_seconds(s.get("kv_wait_s")),
            max_gap_s=self.max_gap_s if self.first_at is not None else None,
            first_token_early=bool(s.get("first_token_early", self.p.first_token_early)),
            tpot_s=tpot,
            e2e_s=now - self.started,
            kv_bytes_intra_dc=int(kv.get("intra_dc", 0) or 0),
            kv_bytes_wan=int(kv.get("wan", 0) or 0),
            handoff_bytes=int(s.get("handoff_bytes", 0) or 0),
            handoff_at_token=handoff.get("at_token"),
            handoff_batches=int(handoff.get("batches", 0) or 0),
        )

    def take_logprobs(self) -> dict | None:
        """The logprobs of the tokens delivered since the last call (a stream chunk's)."""
        return self.logprobs.take() if self.logprobs is not None else None

    def all_logprobs(self) -> dict | None:
        """Every delivered token's logprobs; None when the request did not ask."""
        return self.logprobs.all() if self.logprobs is not None else None

    @property
    def migrations(self) -> int:
        """Times this request moved to another decoder (``_migrate`` counts them)."""
        return getattr(self.p, "migrations", 0)

    def _save_progress(self) -> None:
        """Save the delivered-token count on the admission, off the stream's path."""
        task = asyncio.ensure_future(
            in_worker(_quietly(admission_progress))(self.p.request_id, self.token_count)
        )
        pending_records.add(task)
        task.add_done_callback(pending_records.discard)

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
                await in_worker(record_request)(
                    request_id=p.request_id,
                    api_key=p.key,
                    model=p.model.name,
                    endpoint=p.kind,
                    stream=p.greq.stream,
                    decision=p.decision,
                    policy_version=p.version,
                    decision_inputs=p.inputs,
                    outcome=outcome,
                    client_request_id=getattr(p, "client_request_id", ""),
                )
            except Exception:
                log.exception("could not record request %s", p.request_id)

        task = asyncio.ensure_future(write())
        pending_records.add(task)
        task.add_done_callback(pending_records.discard)
        self.write_task = task
        return task


def _quietly(fn):
    def run(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception:  # progress is best effort: the final record is what counts
            log.warning("could not save progress", exc_info=True)
            return None

    return run


def _seconds(value: Any) -> float | None:
    """A duration from the agent's stats, or None when absent or not a finite number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _chunk(
    p: Prepared,
    created: int,
    text: str | None,
    finish: str | None,
    usage=None,
    logprobs: dict | None = None,
) -> dict:
    if p.kind == "chat.completions":
        delta = {} if text is None else {"content": text}
        return {
            "id": p.request_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": p.model.name,
            "choices": []
            if usage is not None
            else [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
            "usage": usage,
        }
    return {
        "id": p.request_id,
        "object": "text_completion",
        "created": created,
        "model": p.model.name,
        "choices": []
        if usage is not None
        else [{"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}],
        "usage": usage,
    }


def _sse(data: dict | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


async def _stream(p: Prepared):
    run = Run(p)
    created = int(time.time())
    try:
        if p.kind == "chat.completions":
            yield _sse(
                _chunk(p, created, None, None)
                | {
                    "choices": [
                        {
                            "index": 0,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ]
                }
            )
        async for piece in run.deltas():
            yield _sse(_chunk(p, created, piece, None, logprobs=run.take_logprobs()))
        # Every token is out: the request is complete. Start writing its record before the
        # last bytes go, so a client that closes right after [DONE] (the openai client does)
        # cannot lose it, but do not make the client wait for the database: the write runs
        # while the last chunks go out and is awaited after [DONE].
        cached = run.outcome().cached_tokens
        run.record_soon()
        yield _sse(
            _chunk(
                p,
                created,
                None if p.kind == "chat.completions" else "",
                run.finish_reason,
                logprobs=run.take_logprobs(),  # tokens whose text was never released
            )
        )
        if p.greq.include_usage:
            yield _sse(_chunk(p, created, None, None, usage=_usage(p, run.token_count, cached)))
        yield _sse("[DONE]")
    except AgentRunError as exc:
        run.status, run.error = "error", str(exc)
        yield _sse(
            GatewayError(
                500, f"The request failed on the agents: {exc}", type_="server_error"
            ).body()
        )
    except BaseException as exc:  # client went away (CancelledError / GeneratorExit)
        run.status, run.error = "cancelled", f"client disconnected ({type(exc).__name__})"
        raise
    finally:
        await run.record()


async def _complete(p: Prepared) -> JsonResponse:
    run = Run(p)
    created = int(time.time())
    pieces: list[str] = []
    try:
        async for piece in run.deltas():
            pieces.append(piece)
    except AgentRunError as exc:
        run.status, run.error = "error", str(exc)
        await run.record()
        raise GatewayError(
            502, f"The request failed on the agents: {exc}", type_="server_error"
        ) from exc
    except BaseException as exc:
        run.status, run.error = "cancelled", f"client disconnected ({type(exc).__name__})"
        await run.record()
        raise
    watch = getattr(p, "watch", None) or Stopwatch()
    watch.lap("agents")
    await run.record()
    watch.lap("record")
    text = "".join(pieces)
    usage = _usage(p, run.token_count, run.outcome().cached_tokens)
    if p.kind == "chat.completions":
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": run.all_logprobs(),
            "finish_reason": run.finish_reason,
        }
        body = {
            "id": p.request_id,
            "object": "chat.completion",
            "created": created,
            "model": p.model.name,
            "choices": [choice],
            "usage": usage,
        }
    else:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": run.all_logprobs(),
            "finish_reason": run.finish_reason,
        }
        body = {
            "id": p.request_id,
            "object": "text_completion",
            "created": created,
            "model": p.model.name,
            "choices": [choice],
            "usage": usage,
        }
    return JsonResponse(body)


async def _handle(request: HttpRequest, kind: str):
    if request.method != "POST":
        return GatewayError(405, "Use POST.", code="method_not_allowed").response()
    try:
        watch = Stopwatch()
        p = await in_worker(_prepare)(request, kind, watch)
        watch.lap("resume")  # back on the event loop
        if p.greq.stream:
            response = StreamingHttpResponse(_stream(p), content_type="text/event-stream")
            response["Cache-Control"] = "no-cache"
            response["X-Request-Id"] = p.request_id
            response["Server-Timing"] = watch.header()
            return response
        response = await _complete(p)
        response["Server-Timing"] = watch.header()
        return response
    except GatewayError as exc:
        return exc.response()


# Async views cannot run inside ATOMIC_REQUESTS; the record write is its own transaction.
@csrf_exempt
@transaction.non_atomic_requests
@with_request_id("chat.completions")
async def chat_completions(request: HttpRequest):
    return await _handle(request, "chat.completions")


@csrf_exempt
@transaction.non_atomic_requests
@with_request_id("completions")
async def completions(request: HttpRequest):
    return await _handle(request, "completions")


def _list_models(request: HttpRequest) -> JsonResponse:
    _authenticate(request)
    data = [
        {
            "id": m.name,
            "object": "model",
            "created": int(m.created_at.timestamp()),
            "owned_by": "baton",
        }
        for m in ServedModel.objects.all()
    ]
    return JsonResponse({"object": "list", "data": data})


@transaction.non_atomic_requests
@with_request_id()
async def models(request: HttpRequest):
    try:
        return await sync_to_async(_list_models)(request)
    except GatewayError as exc:
        return exc.response()
