"""The OpenAI-compatible endpoints: /v1/chat/completions, /v1/completions, /v1/models.

A request's path, one module per step, each called once and never calling back into an
earlier one (routing/gateway/README.md):

1. ``admission.admit``: API key, parsed request, token ids, context and rate limits.
2. ``routes.route_first``: live view, decision, plan for P (``routes`` also retries and
   migrates when the run fails).
3. ``records.admission_journaled``: the durable admission (a journal line, its row in the
   record writer's next batch), before any agent is called.
4. ``run.Run``: the agent stream, its stall limits, the record and usage at the end.
5. here: the answer framed in OpenAI's shapes (``openai_shapes``), streamed or whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.exceptions import SynchronousOnlyOperation
from django.db import transaction
from django.http import HttpRequest, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt

from fleet.models import ServedModel
from routing.gateway import admission, coalesce, openai_shapes, routes
from routing.gateway.errors import GatewayError, notify_error
from routing.gateway.overload import overload
from routing.gateway.prepared import Prepared
from routing.gateway.records import admission_journaled
from routing.gateway.request_ids import with_request_id
from routing.gateway.run import Run
from routing.gateway.runner import AgentBusy, AgentRunError
from routing.gateway.timing import RECEIVED, Stopwatch
from routing.gateway.workers import drain_pending_records, in_worker, pending_records

__all__ = [
    "Prepared",
    "chat_completions",
    "completions",
    "drain_pending_records",
    "models",
    "pending_records",
]


def _prepare(request: HttpRequest, kind: str, watch: Stopwatch | None = None) -> Prepared:
    """Steps 1-3, in one hop onto a worker thread."""
    watch = watch or Stopwatch()
    p = admission.admit(request, kind, watch)
    routes.route_first(p)
    watch.lap("route")
    _admitted(p)
    watch.lap("admit")
    return p


def _prepare_inline(request: HttpRequest, kind: str, watch: Stopwatch) -> Prepared:
    """Steps 1-3 on the event loop, without the hop, for a process whose whole hot path is
    in memory (no Redis: the limiter, the dispatch ledgers and the agents' reports are this
    process's). Every read comes first and has no side effect; one that needs the database
    (a cache miss, the counters or the policy due for a check) raises
    SynchronousOnlyOperation, Django's refusal of the ORM on the event loop, and the caller
    runs ``_prepare`` on a worker instead, from the start: nothing was counted yet."""
    p = admission.identify(request, kind, watch)
    view = routes.route_inputs(p)
    watch.lap("route")
    admission.check_limits(p)
    routes.route_first(p, view)
    watch.lap("route")
    _admitted(p)
    watch.lap("admit")
    return p


def _inline_ok() -> bool:
    return not settings.REDIS_URL and settings.BATON_GATEWAY_INLINE


def _admitted(p: Prepared) -> None:
    # Durable before any agent is called (a journal line; the row follows in the record
    # writer's next batch): if this process dies, a later one records it.
    admission_journaled(
        request_id=p.request_id,
        api_key=p.key,
        model=p.model.name,
        endpoint=p.kind,
        stream=p.greq.stream,
        prompt_tokens=len(p.prompt_ids),
        decision=p.decision,
        policy_version=p.version,
        decision_inputs=p.inputs,
        attempt_request_id=p.plan["request_id"],
        prefill_url=p.prefill_http,
        client_request_id=p.client_request_id,
    )


def _recoverer(p: Prepared):
    """What the run calls when an attempt fails: route again (``routes``), a retry before the
    first token, a migration after it. True when a new attempt is ready."""

    async def recover(exc: AgentRunError, delivered: list[int], remaining: int) -> bool:
        if isinstance(exc, AgentBusy) and not delivered:
            # Capacity, not a fault: wait in the overload queue, then route again.
            if p.busy_since is None:
                p.busy_since = time.monotonic()
            await overload.wait(p.key.tenant.name, p.busy_since, p.busy_tries)
            p.busy_tries += 1
            return await in_worker(routes.retry_when_room)(p, exc)
        if not delivered:
            return await in_worker(routes.retry_elsewhere)(p, exc)
        return await in_worker(routes.migrate)(p, exc, delivered, remaining)

    return recover


def _usage(p: Prepared, run: Run) -> dict:
    return openai_shapes.usage(len(p.prompt_ids), run.token_count, run.outcome().cached_tokens)


async def _ended_unanswered(run: Run, exc: BaseException) -> BaseException:
    """Record a run that ended before any answer went out, and return what to raise: the
    overload queue's 503 / 429 as it is (``rejected``), the agents' failure as a 502
    (``error``), anything else, a client gone meanwhile, as it is (``cancelled``)."""
    answer: BaseException = exc
    if isinstance(exc, GatewayError):
        run.status, run.error = "rejected", exc.message
    elif isinstance(exc, AgentRunError):
        run.status, run.error = "error", str(exc)
        answer = GatewayError(502, f"The request failed on the agents: {exc}", type_="server_error")
    else:
        run.status, run.error = "cancelled", f"client disconnected ({type(exc).__name__})"
    await run.record()
    return answer


async def _open_stream(p: Prepared):
    """A stream's response once its first tokens are in: until then no byte has gone out, so a
    request that cannot run (no room past the overload queue's limits, or a failure the
    retries could not get around) is answered with a status code, not an error inside a 200."""
    run = Run(p)
    deltas = run.deltas(_recoverer(p))
    first: list | None
    try:
        first = await deltas.__anext__()
    except StopAsyncIteration:
        first = None
    except BaseException as exc:
        answer = await _ended_unanswered(run, exc)
        if answer is exc:
            raise
        raise answer from exc
    return _stream(p, run, deltas, first)


async def _stream_body(p: Prepared):
    """The bytes a stream's response sends, opened as the view opens it (for callers that drive
    a stream without a response, such as the tests)."""
    inner = await _open_stream(p)
    try:
        async for chunk in inner:
            yield chunk
    finally:
        await inner.aclose()


async def _stream(p: Prepared, run: Run, deltas, first: list | None):
    created = int(time.time())

    def chunk(text, finish, **kw) -> bytes:
        return openai_shapes.sse(
            openai_shapes.chunk(p.kind, p.request_id, p.model.name, created, text, finish, **kw)
        )

    coalesce.stats.open += 1
    pieces_in = coalesce.coalesced(deltas)
    try:
        head = b""
        if p.kind == "chat.completions":
            head = openai_shapes.sse(openai_shapes.role_chunk(p.request_id, p.model.name, created))
        if first:
            head += b"".join(chunk(piece, None, logprobs=lp) for piece, lp in first)
        yield head
        async for pieces in pieces_in:
            # The tokens that arrived together (or waited together, under load: coalesce.py)
            # leave together: one event each, one write.
            yield b"".join(chunk(piece, None, logprobs=lp) for piece, lp in pieces)
        # Every token is out: the request is complete. Start writing its record before the
        # last bytes go, so a client that closes right after [DONE] (the openai client does)
        # cannot lose it, but do not make the client wait for the database: the write runs
        # while the last chunks go out and is awaited after [DONE].
        usage = _usage(p, run)
        run.record_soon()
        # The last events in one write (one socket send instead of three).
        tail = chunk(
            None if p.kind == "chat.completions" else "",
            run.finish_reason,
            logprobs=run.take_logprobs(),  # tokens whose text was never released
        )
        if p.greq.include_usage:
            tail += chunk(None, None, usage=usage)
        yield tail + openai_shapes.sse("[DONE]")
    except (AgentRunError, GatewayError) as exc:
        run.status, run.error = "error", str(exc)
        notify_error(500, "agent_error", p.key.tenant.name, p.model.name)
        yield openai_shapes.sse(
            GatewayError(
                500, f"The request failed on the agents: {exc}", type_="server_error"
            ).body()
        )
    except BaseException as exc:  # client went away (CancelledError / GeneratorExit)
        run.status, run.error = "cancelled", f"client disconnected ({type(exc).__name__})"
        raise
    finally:
        coalesce.stats.open -= 1
        await pieces_in.aclose()
        await run.record()


async def _complete(p: Prepared) -> JsonResponse:
    run = Run(p)
    created = int(time.time())
    pieces: list[str] = []
    try:
        async for batch in run.deltas(_recoverer(p)):
            pieces.extend(piece for piece, _ in batch)
    except BaseException as exc:
        answer = await _ended_unanswered(run, exc)
        if answer is exc:
            raise
        raise answer from exc
    watch = p.watch or Stopwatch()
    watch.lap("agents")
    await run.record()
    watch.lap("record")
    body = openai_shapes.completion(
        p.kind,
        p.request_id,
        p.model.name,
        created,
        "".join(pieces),
        run.finish_reason,
        _usage(p, run),
        run.all_logprobs(),
    )
    return JsonResponse(body)


async def _handle(request: HttpRequest, kind: str):
    if request.method != "POST":
        notify_error(405, "method_not_allowed")
        return GatewayError(405, "Use POST.", code="method_not_allowed").response()
    try:
        # From the request's arrival at the ASGI app (its body read, Django's request
        # signals, middleware and URL resolution: "django") when served over ASGI.
        scope = getattr(request, "scope", None) or {}
        watch = Stopwatch(scope.get(RECEIVED))
        if RECEIVED in scope:
            watch.lap("django")
        p = None
        if _inline_ok():
            try:
                p = _prepare_inline(request, kind, watch)
            except SynchronousOnlyOperation:
                watch.lap("inline")  # a read needed the database: the worker does it all
        if p is None:
            p = await in_worker(_prepare)(request, kind, watch)
            watch.lap("resume")  # back on the event loop
        if p.greq.stream:
            response = StreamingHttpResponse(
                await _open_stream(p), content_type="text/event-stream"
            )
            response["Cache-Control"] = "no-cache"
            response["X-Request-Id"] = p.request_id
            response["Server-Timing"] = watch.header()
            return response
        whole = await _complete(p)
        whole["Server-Timing"] = watch.header()
        return whole
    except GatewayError as exc:
        if exc.pending_write is not None:  # the rejected request's record, first
            with contextlib.suppress(Exception):
                await asyncio.wrap_future(exc.pending_write)
        notify_error(
            exc.status,
            exc.code,
            getattr(request, "baton_tenant", ""),
            getattr(request, "baton_model", ""),
        )
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
    admission.authenticate(request)
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
