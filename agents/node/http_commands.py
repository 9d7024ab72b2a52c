"""The agent's operator endpoints (agents/PROTOCOL.md, "Control plane -> agent"): health,
state and metrics, instance start, drain, stop, cache and warm-up, and link shaping. Each
handler takes the agent and the request; http_api.py routes to them."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from agents.engine.config import DTYPE_NAMES
from agents.engine.interface import EMULATED
from agents.node.agent import Agent
from agents.node.errors import AgentError
from agents.node.http_common import body_of
from agents.node.instances import Instance
from agents.node.links import link_json
from agents.node.settings import link_from_json
from agents.node.wire import bad, get_str, parse_gpu, refused
from pdd.metrics import CONTENT_TYPE as METRICS_TYPE
from pdd.metrics import render as render_metrics
from pdd.metrics import state_families


def _named(agent: Agent, request: Request) -> Instance:
    """The instance the path names; AgentError 404 if there is none."""
    inst = agent.instances.get(request.path_params["instance_id"])
    if inst is None:
        raise AgentError(404, f"no instance {request.path_params['instance_id']}")
    return inst


async def health(agent: Agent, request: Request) -> Response:
    return JSONResponse(
        {
            "status": "draining" if agent.instances.draining else "ok",
            "node": agent.settings.node,
            "protocol": 1,
            "engine_options": agent.settings.engine_options(),
        }
    )


async def metrics(agent: Agent, request: Request) -> Response:
    # Open, like /health: counters and gauges only, no ids beyond instance and node names.
    # From the state document, which never waits for an engine (pdd/metrics.py).
    return Response(
        render_metrics(state_families(agent.reporting.state())), media_type=METRICS_TYPE
    )


async def state(agent: Agent, request: Request) -> Response:
    # Link utilisation is measured between heartbeats; a /state call must not reset it.
    return JSONResponse(await agent.reporting.report(link_use=False))


async def instance_cache(agent: Agent, request: Request) -> Response:
    # What a decode instance's prefix cache holds, as the chain hashes its KV cache events
    # name (taken on the engine thread: waits for the current step). For operators and
    # tests checking the prefix index against the agent.
    inst = _named(agent, request)
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


async def warm_instance(agent: Agent, request: Request) -> Response:
    # Benchmarks only, emulated instances only: put prompts' blocks in the prefix cache at
    # no modelled cost (the cache of a fleet that has been serving for a while).
    inst = _named(agent, request)
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
            isinstance(p, list) and all(type(t) is int and 0 <= t < 2**31 for t in p) for p in given
        ):
            raise bad("token_ids", "must be a list of lists of token ids")
        prompts = given

    def warm(engine: Any) -> int:
        return sum(engine.warm_prefix(p) for p in prompts)

    added = await inst.worker.call(warm)
    return JSONResponse({"instance_id": inst.instance_id, "blocks_added": added})


async def put_instance(agent: Agent, request: Request) -> Response:
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
    inst = await agent.instances.put(iid, role, model, source, dtype=dtype, gpu=gpu)
    return JSONResponse(agent.reporting.instance_state(inst))


async def drain_instance(agent: Agent, request: Request) -> Response:
    inst = await agent.instances.drain_one(request.path_params["instance_id"])
    return JSONResponse(agent.reporting.instance_state(inst))


async def delete_instance(agent: Agent, request: Request) -> Response:
    await agent.instances.delete(request.path_params["instance_id"])
    return JSONResponse({"state": "stopped"})


async def put_link(agent: Agent, request: Request) -> Response:
    body = await body_of(request)
    try:
        link = link_from_json(body)
    except ValueError as exc:
        raise refused(exc) from None
    applied = agent.links.set(request.path_params["peer"], link)
    return JSONResponse(link_json(applied))
