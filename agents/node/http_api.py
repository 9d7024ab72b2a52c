"""The agent's HTTP API (starlette): health, state and operator commands from agents/PROTOCOL.md,
and the data plane (`/v1/generate`, `/v1/pdd/*`) that streams NDJSON token events."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from agents.engine import EngineFull
from agents.engine.config import DTYPE_NAMES
from agents.engine.interface import EMULATED
from agents.node import pipelines
from agents.node.agent import Agent, AgentError, Instance, link_json
from agents.node.settings import link_from_json
from agents.node.wire import (
    PIPELINES,
    HandoffPlan,
    Peer,
    bad,
    get_bool,
    get_ids,
    get_int,
    get_str,
    need_dict,
    parse_gpu,
    parse_sampling,
    refused,
)
from pdd.events import ENGINE_FULL, TokenEvent
from pdd.metrics import CONTENT_TYPE as METRICS_TYPE
from pdd.metrics import render as render_metrics
from pdd.metrics import state_families
from pdd.vocab import Pipeline

log = logging.getLogger(__name__)


class EventStream(Response):
    """NDJSON stream of event dicts. If the client goes away the producer is cancelled (so its
    cleanup runs at once), and `on_close` always runs exactly once afterwards."""

    media_type = "application/x-ndjson"

    def __init__(
        self, events: AsyncGenerator[dict[str, Any], None], on_close: Callable[[], Awaitable[None]]
    ) -> None:
        self.events = events
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-store"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def produce() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for event in self.events:
                line = json.dumps(event, separators=(",", ":")) + "\n"
                await send({"type": "http.response.body", "body": line.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def listen() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        producer = asyncio.create_task(produce())
        listener = asyncio.create_task(listen())
        try:
            await asyncio.wait({producer, listener}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (producer, listener):
                task.cancel()
            await asyncio.gather(producer, listener, return_exceptions=True)
            try:
                await self.events.aclose()
            finally:
                await self.on_close()


async def _nothing() -> None:
    """An EventStream's close with nothing to release."""


def error(
    status: int, message: str, field: str | None = None, code: str | None = None
) -> JSONResponse:
    body: dict[str, Any] = {"error": message}
    if field:
        body["field"] = field
    if code:
        body["code"] = code
    return JSONResponse(body, status_code=status)


def bearer_ok(request: Request, token: str | None) -> bool:
    """True when no token is required or the request carries it (constant-time compare)."""
    if token is None:
        return True
    given = request.headers.get("authorization", "")
    return hmac.compare_digest(given.encode(), f"Bearer {token}".encode())


def build_app(agent: Agent) -> Starlette:
    def command(handler: Callable[[Request], Awaitable[Response]]):
        async def wrapped(request: Request) -> Response:
            if not bearer_ok(request, agent.command_token):
                return error(401, "missing or wrong command token (Authorization: Bearer)")
            return await guarded(handler, request)

        return wrapped

    async def guarded(handler, request: Request) -> Response:
        try:
            return await handler(request)
        except AgentError as exc:
            return error(exc.status, exc.message, exc.field, exc.code)

    def data(handler):
        async def wrapped(request: Request) -> Response:
            if agent.settings.control_plane and not agent.registered:
                # Nobody routes here before the control plane knows this agent, and its answer
                # may carry the fleet's data-plane token: refuse until then.
                return error(503, "not registered with the control plane yet")
            if not bearer_ok(request, agent.data_token):
                return error(401, "missing or wrong data-plane token (Authorization: Bearer)")
            return await guarded(handler, request)

        return wrapped

    async def body_of(request: Request) -> dict[str, Any]:
        try:
            raw = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise bad("body", "must be JSON") from None
        return need_dict(raw)

    # -- health, state, commands -------------------------------------------------------------

    async def health(request: Request) -> Response:
        return JSONResponse(
            {
                "status": "draining" if agent.draining else "ok",
                "node": agent.settings.node,
                "protocol": 1,
                "engine_options": agent.settings.engine_options(),
            }
        )

    async def metrics(request: Request) -> Response:
        # Open, like /health: counters and gauges only, no ids beyond instance and node names.
        # From the state document, which never waits for an engine (pdd/metrics.py).
        return Response(render_metrics(state_families(agent.state())), media_type=METRICS_TYPE)

    async def state(request: Request) -> Response:
        # Link utilisation is measured between heartbeats; a /state call must not reset it.
        return JSONResponse(await agent.report(link_use=False))

    async def instance_cache(request: Request) -> Response:
        # What a decode instance's prefix cache holds, as the chain hashes its KV cache events
        # name (taken on the engine thread: waits for the current step). For operators and
        # tests checking the prefix index against the agent.
        inst = agent.instances.get(request.path_params["instance_id"])
        if inst is None:
            raise AgentError(404, f"no instance {request.path_params['instance_id']}")
        if inst.kv_events is None or inst.worker is None:
            raise AgentError(409, f"instance {inst.instance_id} publishes no prefix cache")
        edges = await inst.worker.call(lambda engine: engine.cache.held_hashes())
        return JSONResponse(
            {
                "instance_id": inst.instance_id,
                "block_size": agent.settings.block_size,
                "blocks": [h.hex() for _, hashes in edges for h in hashes],
                "kv_events": inst.kv_events.summary(),
            }
        )

    async def warm_instance(request: Request) -> Response:
        # Benchmarks only, emulated instances only: put prompts' blocks in the prefix cache at
        # no modelled cost (the cache of a fleet that has been serving for a while).
        inst = agent.instances.get(request.path_params["instance_id"])
        if inst is None:
            raise AgentError(404, f"no instance {request.path_params['instance_id']}")
        if inst.engine_kind != EMULATED or inst.worker is None:
            raise AgentError(409, f"instance {inst.instance_id} is not a running emulated one")
        body = await body_of(request)
        if "texts" in body:
            # Emulated profiles speak the byte tokenizer: a text's UTF-8 bytes are its ids.
            texts = body["texts"]
            if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
                raise bad("texts", "must be a list of strings")
            prompts: list[list[int]] = [list(t.encode("utf-8")) for t in texts]
        else:
            given = body.get("token_ids")
            if not isinstance(given, list) or not all(
                isinstance(p, list) and all(type(t) is int and 0 <= t < 2**31 for t in p)
                for p in given
            ):
                raise bad("token_ids", "must be a list of lists of token ids")
            prompts = given

        def warm(engine: Any) -> int:
            return sum(engine.warm_prefix(p) for p in prompts)

        added = await inst.worker.call(warm)
        return JSONResponse({"instance_id": inst.instance_id, "blocks_added": added})

    async def put_instance(request: Request) -> Response:
        body = await body_of(request)
        iid = request.path_params["instance_id"]
        if "|" in iid:
            raise bad("instance_id", "must not contain '|'")
        role = get_str(body, "role")
        model = get_str(body, "model", "baton-tiny")
        source = get_str(body, "source", model)
        # Absent (or null): the agent's own --dtype.
        dtype = get_str(body, "dtype", None, choices=DTYPE_NAMES)
        # The GPU unit the instance runs on (the control plane sends it; an emulated instance
        # needs it: agents/PROTOCOL.md).
        gpu = parse_gpu(body["gpu"]) if body.get("gpu") is not None else None
        inst = await agent.put_instance(iid, role, model, source, dtype=dtype, gpu=gpu)
        return JSONResponse(agent.instance_state(inst))

    async def drain_instance(request: Request) -> Response:
        inst = await agent.drain_instance(request.path_params["instance_id"])
        return JSONResponse(agent.instance_state(inst))

    async def delete_instance(request: Request) -> Response:
        await agent.delete_instance(request.path_params["instance_id"])
        return JSONResponse({"state": "stopped"})

    async def put_link(request: Request) -> Response:
        body = await body_of(request)
        try:
            link = link_from_json(body)
        except ValueError as exc:
            raise refused(exc) from None
        applied = agent.set_link(request.path_params["peer"], link)
        return JSONResponse(link_json(applied))

    # -- data plane --------------------------------------------------------------------------

    def check_prompt(inst: Instance, prompt: list[int], max_tokens: int) -> None:
        cfg = inst.running_worker.engine.model_config
        if len(prompt) + max_tokens > cfg.max_position:
            raise bad(
                "prompt_ids",
                f"{len(prompt)} prompt tokens + max_tokens {max_tokens} exceed the model's "
                f"context of {cfg.max_position}",
            )
        bs = agent.settings.block_size
        need = -(-(len(prompt) + max_tokens) // bs)
        blocks = inst.running_worker.engine.pool.num_blocks
        if need > blocks:
            raise bad("prompt_ids", f"needs {need} KV blocks; the instance has {blocks}")

    def vocab(inst: Instance) -> int:
        return inst.running_worker.engine.model_config.vocab_size

    def request_id_of(body: dict) -> str:
        rid = get_str(body, "request_id", None)
        return rid or f"req-{uuid.uuid4().hex[:16]}"

    async def admit(inst: Instance, fn: Callable[[], Awaitable[Any]]) -> Any:
        agent.begin(inst)
        try:
            return await fn()
        except EngineFull as exc:
            agent.end(inst)
            raise AgentError(503, f"engine full: {exc}", code=ENGINE_FULL) from None
        except ValueError as exc:
            agent.end(inst)
            raise AgentError(400, f"prompt_ids: {exc}", "prompt_ids") from None
        except BaseException:
            agent.end(inst)
            raise

    def stream(inst: Instance, events, cleanup=None) -> EventStream:
        async def on_close() -> None:
            try:
                if cleanup is not None:
                    await cleanup()
            finally:
                agent.end(inst)

        return EventStream(events, on_close)

    async def generate(request: Request) -> Response:
        body = await body_of(request)
        inst = agent.instance(get_str(body, "instance", None), None)
        prompt = get_ids(body, "prompt_ids", vocab(inst))
        sampling = parse_sampling(body.get("sampling"))
        check_prompt(inst, prompt, sampling.max_tokens)
        rid = request_id_of(body)
        started = time.monotonic()
        queue = await admit(
            inst, lambda: pipelines.admit_single(agent, inst, rid, prompt, sampling)
        )
        return stream(
            inst, agent.served.count(rid, pipelines.run_single(agent, inst, rid, queue, started))
        )

    async def pdd_generate(request: Request) -> Response:
        body = await body_of(request)
        inst = agent.instance(get_str(body, "instance", None), "prefill")
        prompt = get_ids(body, "prompt_ids", vocab(inst))
        sampling = parse_sampling(body.get("sampling"))
        check_prompt(inst, prompt, sampling.max_tokens)
        pipeline = get_str(body, "pipeline", choices=PIPELINES)
        plan = HandoffPlan.parse(body)
        main = None if pipeline == Pipeline.RLD_ONLY else Peer.parse(body.get("main"), "main")
        relay = None
        if pipeline in (Pipeline.P_RLD_MD, Pipeline.RLD_ONLY):
            relay = Peer.parse(body.get("relay"), "relay")
        req = pipelines.PddRequest(
            request_id_of(body),
            prompt,
            sampling,
            pipeline,
            plan,
            main,
            relay,
            early_first_token=get_bool(body, "early_first_token"),
            direct=get_bool(body, "direct"),
        )
        prefilling = await admit(inst, lambda: pipelines.admit_prefill(agent, inst, req))

        async def cleanup() -> None:
            # The caller may leave before the stream's first event (the prefill still queued,
            # its generator never started): the prefill is dropped from the engine here.
            if not prefilling.done():
                prefilling.cancel()
            await asyncio.gather(prefilling, return_exceptions=True)
            # Idempotent: a held prefill (never streamed) is released; otherwise a no-op.
            await pipelines.release_prefill(agent, inst, req.request_id)

        events = pipelines.run_prefill(agent, inst, req, prefilling)
        return stream(inst, agent.served.count(req.request_id, events), cleanup)

    async def pdd_reserve(request: Request) -> Response:
        body = await body_of(request)
        inst = agent.instance(get_str(body, "instance", None), "main_decode")
        prompt = get_ids(body, "prompt_ids", vocab(inst))
        rid = get_str(body, "request_id")
        cached = await pipelines.reserve_prefix(agent, inst, rid, prompt)
        # What this MD stores its KV as: P sends a wider one narrowed already (kv_stream.py).
        stored = getattr(inst.running_worker.engine.pool, "dtype_name", None)
        # ... and its block size: P's delta starts at one of MD's block boundaries.
        return JSONResponse(
            {
                "request_id": rid,
                "cached_tokens": cached,
                "kv_format": stored,
                "block_size": agent.settings.block_size,
            }
        )

    def decode_common(body: dict, inst: Instance) -> tuple[str, list[int], int, Any]:
        prompt = get_ids(body, "prompt_ids", vocab(inst))
        first = get_int(body, "first_token", minimum=0)
        if first >= vocab(inst):
            raise bad("first_token", "outside the vocabulary")
        sampling = parse_sampling(body.get("sampling"))
        check_prompt(inst, prompt, sampling.max_tokens)
        return get_str(body, "request_id"), prompt, first, sampling

    def direct_stream(body: dict, rid: str, first: int, events):
        """A decoder's stream the gateway reads itself (``direct``, one hop per token): P's
        token (``first_event``, unless P already sent it) leads the decoder's own, and the
        served ledger counts it, as P's ledger counts a relayed stream."""
        if not get_bool(body, "direct"):
            return events
        raw = body.get("first_event")
        if raw is None:
            return agent.served.count(rid, events)
        try:
            event = TokenEvent.from_json(raw) if isinstance(raw, dict) else None
        except ValueError:
            event = None
        if event is None or event.index != 0 or event.token_id != first:
            raise bad("first_event", "must be the token event of first_token at index 0")
        return agent.served.count(rid, pipelines.led_by(event.to_json(), events))

    async def pdd_decode(request: Request) -> Response:
        body = await body_of(request)
        inst = agent.instance(get_str(body, "instance", None), "main_decode")
        rid, prompt, first, sampling = decode_common(body, inst)
        start = get_int(body, "start_token", 0, minimum=0)
        if start > len(prompt) or start % agent.settings.block_size:
            raise bad("start_token", "must be a whole number of blocks within the prompt")
        hold = body.get("hold", False)
        if not isinstance(hold, bool):
            raise bad("hold", "must be a boolean")
        detachable = body.get("detachable", False)
        if not isinstance(detachable, bool):
            raise bad("detachable", "must be a boolean")
        req = pipelines.DecodeRequest(rid, prompt, first, sampling, start, hold, detachable)
        events = direct_stream(body, rid, first, pipelines.run_main(agent, inst, req))
        agent.begin(inst)
        return stream(inst, events, lambda: pipelines.main_stream_closed(agent, inst, req))

    async def pdd_relay(request: Request) -> Response:
        body = await body_of(request)
        inst = agent.instance(get_str(body, "instance", None), "relay_decode")
        rid, prompt, first, sampling = decode_common(body, inst)
        main = None if body.get("main") is None else Peer.parse(body.get("main"), "main")
        start = get_int(body, "main_start_token", 0, minimum=0)
        req = pipelines.RelayRequest(
            rid, prompt, first, sampling, main, start, HandoffPlan.parse(body),
            direct=get_bool(body, "direct"),
        )  # fmt: skip
        events = direct_stream(body, rid, first, pipelines.run_relay(agent, inst, req))
        agent.begin(inst)
        return stream(inst, events)

    async def pdd_attach(request: Request) -> Response:
        """MD's stream of a request after RLD's handoff, from a token index (the gateway's one
        hop per token; RLD's ``continue`` names this call)."""
        body = await body_of(request)
        inst = agent.instance(get_str(body, "instance", None), "main_decode")
        rid = get_str(body, "request_id")
        start = get_int(body, "from_index", 0, minimum=0)
        tail = agent.tails.get(rid, inst.instance_id)
        if tail is None:
            return error(404, f"no handed-off stream of request {rid!r} here", "request_id")
        return EventStream(agent.served.count(rid, tail.read(start, attach=True)), _nothing)

    async def pdd_request(request: Request) -> Response:
        """What this agent streamed for a recent request it served to its caller (served.py)."""
        rid = request.path_params["request_id"]
        entry = agent.served.get(rid)
        if entry is None:
            return error(404, f"no recent request {rid!r} on this agent", "request_id")
        return JSONResponse(entry.to_json())

    async def pdd_release(request: Request) -> Response:
        body = await body_of(request)
        inst = agent.instance(get_str(body, "instance", None), "main_decode")
        rid = get_str(body, "request_id")
        start = get_int(body, "start_token", 0, minimum=0)
        if start % agent.settings.block_size:
            raise bad("start_token", "must be a whole number of blocks")
        try:
            caching = pipelines.release_main(agent, inst, rid, start)
        except ValueError as exc:
            raise bad("start_token", str(exc)) from None
        return JSONResponse({"request_id": rid, "caching": caching})

    async def pdd_cancel(request: Request) -> Response:
        body = await body_of(request)
        rid = get_str(body, "request_id")
        found = await pipelines.cancel_local(agent, rid)
        return JSONResponse({"request_id": rid, "aborted": found})

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/state", command(state), methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/instances/{instance_id}", command(put_instance), methods=["PUT"]),
        Route("/instances/{instance_id}", command(delete_instance), methods=["DELETE"]),
        Route("/instances/{instance_id}/drain", command(drain_instance), methods=["POST"]),
        Route("/instances/{instance_id}/cache", command(instance_cache), methods=["GET"]),
        Route("/instances/{instance_id}/warm", command(warm_instance), methods=["POST"]),
        Route("/links/{peer}", command(put_link), methods=["PUT"]),
        Route("/v1/generate", data(generate), methods=["POST"]),
        Route("/v1/pdd/generate", data(pdd_generate), methods=["POST"]),
        Route("/v1/pdd/reserve", data(pdd_reserve), methods=["POST"]),
        Route("/v1/pdd/decode", data(pdd_decode), methods=["POST"]),
        Route("/v1/pdd/relay", data(pdd_relay), methods=["POST"]),
        Route("/v1/pdd/attach", data(pdd_attach), methods=["POST"]),
        Route("/v1/pdd/release", data(pdd_release), methods=["POST"]),
        Route("/v1/pdd/cancel", data(pdd_cancel), methods=["POST"]),
        Route("/v1/pdd/requests/{request_id}", data(pdd_request), methods=["GET"]),
    ]
    return Starlette(routes=routes)
