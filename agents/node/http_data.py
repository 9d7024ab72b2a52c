"""The agent's data plane (agents/PROTOCOL.md, "Data plane"): `/v1/generate` and the PDD
calls (`/v1/pdd/*`), which parse the body, admit the request to an instance and stream the
role pipeline's NDJSON events. Each handler takes the agent and the request; http_api.py
routes to them."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from agents.engine import EngineFull
from agents.node import pipelines
from agents.node.agent import Agent
from agents.node.errors import AgentError
from agents.node.http_common import EventStream, body_of, error, nothing
from agents.node.instances import Instance
from agents.node.wire import (
    PIPELINES,
    HandoffPlan,
    Peer,
    bad,
    get_bool,
    get_ids,
    get_int,
    get_str,
    parse_sampling,
)
from pdd.events import ENGINE_FULL, TokenEvent
from pdd.vocab import Pipeline


def check_prompt(agent: Agent, inst: Instance, prompt: list[int], max_tokens: int) -> None:
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


async def admit(agent: Agent, inst: Instance, fn: Callable[[], Awaitable[Any]]) -> Any:
    agent.instances.begin(inst)
    try:
        return await fn()
    except EngineFull as exc:
        agent.instances.end(inst)
        raise AgentError(503, f"engine full: {exc}", code=ENGINE_FULL) from None
    except ValueError as exc:
        agent.instances.end(inst)
        raise AgentError(400, f"prompt_ids: {exc}", "prompt_ids") from None
    except BaseException:
        agent.instances.end(inst)
        raise


def stream(agent: Agent, inst: Instance, events, cleanup=None) -> EventStream:
    async def on_close() -> None:
        try:
            if cleanup is not None:
                await cleanup()
        finally:
            agent.instances.end(inst)

    return EventStream(events, on_close)


async def generate(agent: Agent, request: Request) -> Response:
    body = await body_of(request)
    inst = agent.instances.for_request(get_str(body, "instance", None), None)
    prompt = get_ids(body, "prompt_ids", vocab(inst))
    sampling = parse_sampling(body.get("sampling"))
    check_prompt(agent, inst, prompt, sampling.max_tokens)
    rid = request_id_of(body)
    started = time.monotonic()
    queue = await admit(
        agent, inst, lambda: pipelines.admit_single(agent, inst, rid, prompt, sampling)
    )
    return stream(
        agent, inst, agent.served.count(rid, pipelines.run_single(agent, inst, rid, queue, started))
    )


async def pdd_generate(agent: Agent, request: Request) -> Response:
    body = await body_of(request)
    inst = agent.instances.for_request(get_str(body, "instance", None), "prefill")
    prompt = get_ids(body, "prompt_ids", vocab(inst))
    sampling = parse_sampling(body.get("sampling"))
    check_prompt(agent, inst, prompt, sampling.max_tokens)
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
    prefilling = await admit(agent, inst, lambda: pipelines.admit_prefill(agent, inst, req))

    async def cleanup() -> None:
        # The caller may leave before the stream's first event (the prefill still queued,
        # its generator never started): the prefill is dropped from the engine here.
        if not prefilling.done():
            prefilling.cancel()
        await asyncio.gather(prefilling, return_exceptions=True)
        # Idempotent: a held prefill (never streamed) is released; otherwise a no-op.
        await pipelines.release_prefill(agent, inst, req.request_id)

    events = pipelines.run_prefill(agent, inst, req, prefilling)
    return stream(agent, inst, agent.served.count(req.request_id, events), cleanup)


async def pdd_reserve(agent: Agent, request: Request) -> Response:
    body = await body_of(request)
    inst = agent.instances.for_request(get_str(body, "instance", None), "main_decode")
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


def decode_common(agent: Agent, body: dict, inst: Instance) -> tuple[str, list[int], int, Any]:
    prompt = get_ids(body, "prompt_ids", vocab(inst))
    first = get_int(body, "first_token", minimum=0)
    if first >= vocab(inst):
        raise bad("first_token", "outside the vocabulary")
    sampling = parse_sampling(body.get("sampling"))
    check_prompt(agent, inst, prompt, sampling.max_tokens)
    return get_str(body, "request_id"), prompt, first, sampling


def direct_stream(agent: Agent, body: dict, rid: str, first: int, events):
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


async def pdd_decode(agent: Agent, request: Request) -> Response:
    body = await body_of(request)
    inst = agent.instances.for_request(get_str(body, "instance", None), "main_decode")
    rid, prompt, first, sampling = decode_common(agent, body, inst)
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
    events = direct_stream(agent, body, rid, first, pipelines.run_main(agent, inst, req))
    agent.instances.begin(inst)
    return stream(agent, inst, events, lambda: pipelines.main_stream_closed(agent, inst, req))


async def pdd_relay(agent: Agent, request: Request) -> Response:
    body = await body_of(request)
    inst = agent.instances.for_request(get_str(body, "instance", None), "relay_decode")
    rid, prompt, first, sampling = decode_common(agent, body, inst)
    main = None if body.get("main") is None else Peer.parse(body.get("main"), "main")
    start = get_int(body, "main_start_token", 0, minimum=0)
    req = pipelines.RelayRequest(
        rid, prompt, first, sampling, main, start, HandoffPlan.parse(body),
        direct=get_bool(body, "direct"),
    )  # fmt: skip
    events = direct_stream(agent, body, rid, first, pipelines.run_relay(agent, inst, req))
    agent.instances.begin(inst)
    return stream(agent, inst, events)


async def pdd_attach(agent: Agent, request: Request) -> Response:
    """MD's stream of a request after RLD's handoff, from a token index (the gateway's one
    hop per token; RLD's ``continue`` names this call)."""
    body = await body_of(request)
    inst = agent.instances.for_request(get_str(body, "instance", None), "main_decode")
    rid = get_str(body, "request_id")
    start = get_int(body, "from_index", 0, minimum=0)
    tail = agent.tails.get(rid, inst.instance_id)
    if tail is None:
        return error(404, f"no handed-off stream of request {rid!r} here", "request_id")
    return EventStream(agent.served.count(rid, tail.read(start, attach=True)), nothing)


async def pdd_request(agent: Agent, request: Request) -> Response:
    """What this agent streamed for a recent request it served to its caller (served.py)."""
    rid = request.path_params["request_id"]
    entry = agent.served.get(rid)
    if entry is None:
        return error(404, f"no recent request {rid!r} on this agent", "request_id")
    return JSONResponse(entry.to_json())


async def pdd_release(agent: Agent, request: Request) -> Response:
    body = await body_of(request)
    inst = agent.instances.for_request(get_str(body, "instance", None), "main_decode")
    rid = get_str(body, "request_id")
    start = get_int(body, "start_token", 0, minimum=0)
    if start % agent.settings.block_size:
        raise bad("start_token", "must be a whole number of blocks")
    try:
        caching = pipelines.release_main(agent, inst, rid, start)
    except ValueError as exc:
        raise bad("start_token", str(exc)) from None
    return JSONResponse({"request_id": rid, "caching": caching})


async def pdd_cancel(agent: Agent, request: Request) -> Response:
    body = await body_of(request)
    rid = get_str(body, "request_id")
    found = await pipelines.cancel_local(agent, rid)
    return JSONResponse({"request_id": rid, "aborted": found})
