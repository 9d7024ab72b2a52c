"""The OpenAI-compatible endpoints: /v1/chat/completions, /v1/completions, /v1/models.

A completion request's path is a line: ``_handle`` calls each step once, in this order, and
no step calls back into another or into this module (routing/gateway/README.md):

1. ``admission.admit``: API key, parsed request, token ids, context, the tenant's limits.
2. ``routes.route_first``: live view, decision, plan for P.
3. ``recorder.admitted``: the durable admission (a journal line, its row in the record
   writer's next batch), before any agent is called.
4. ``run.Run``: the agent stream and its stall limits, a failed attempt handed to
   ``routes.recovery``, the record and usage at the end (``recorder.finished``).
5. here: the answer framed in OpenAI's shapes (``openai_shapes``), streamed or whole.

Steps 1-3 run through ``workers.in_order``: on the event loop while their reads are in
memory, else (from the first read that needs the database) in one hop onto a worker thread.
A request refused in step 1 or 2 (``Refused``) gets its ``rejected`` record
(``recorder.rejected``) before its answer goes out.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import transaction
from django.http import HttpRequest, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt

from fleet.models import ServedModel
from routing.gateway import admission, coalesce, openai_shapes, recorder, routes
from routing.gateway.errors import GatewayError, notify_error
from routing.gateway.overload import overload
from routing.gateway.prepared import Prepared, Refused
from routing.gateway.request_ids import with_request_id
from routing.gateway.run import Run
from routing.gateway.runner import AgentRunError
from routing.gateway.timing import RECEIVED, Stopwatch
from routing.gateway.workers import drain_pending_records, in_order, pending_records

__all__ = [
    "Prepared",
    "chat_completions",
    "completions",
    "drain_pending_records",
    "models",
    "pending_records",
]


def _inline_ok() -> bool:
    """Whether steps 1-3 may run on the event loop: a process whose hot path is in memory (no
    Redis: the limiter, the dispatch ledgers and the agents' reports are this process's)."""
    return not settings.REDIS_URL and settings.BATON_GATEWAY_INLINE


async def _admit(request: HttpRequest, kind: str, watch: Stopwatch) -> Prepared:
    """Steps 1-3, each once, in order. Each reads before it changes anything, so one whose read
    needs the database on the event loop moves, with the rest, to a worker having counted
    nothing (``workers.in_order``). A refusal's record is written before it is raised. No path
    only because some instances' reports are late: the request waits in the overload queue
    and steps 2-3 run again (a 503 / 429 from the queue when it has waited its limit)."""
    admitted: list[Prepared] = []

    def admit() -> None:
        admitted.append(admission.admit(request, kind, watch))

    def route() -> None:
        routes.route_first(admitted[0])
        watch.lap("route")

    def journal() -> None:
        recorder.admitted(admitted[0])
        watch.lap("admit")

    steps: tuple = (admit, route, journal)
    while True:
        try:
            await in_order(steps, inline=_inline_ok(), watch=watch)
            return admitted[0]
        except Refused as refused:
            answer: GatewayError = refused.error
            if refused.late:
                # No path only because reports are late (a control plane too busy to take
                # the beats in time): wait in the overload queue, then route again.
                p = refused.p
                if p.busy_since is None:
                    p.busy_since = time.monotonic()
                try:
                    await overload.wait(p.key.tenant.name, p.busy_since, p.busy_tries)
                    p.busy_tries += 1
                    steps = (route, journal)
                    continue
                except GatewayError as exc:
                    answer = exc
            with contextlib.suppress(Exception):
                await asyncio.wrap_future(recorder.rejected(refused.p, refused.reason))
            raise answer from refused


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
    deltas = run.deltas(routes.recovery(p))
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


async def stream_body(p: Prepared):
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
        async for batch in run.deltas(routes.recovery(p)):
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
        p = await _admit(request, kind, watch)
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
