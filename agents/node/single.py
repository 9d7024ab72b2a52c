"""The `single` baseline: the whole request on one engine, no transfer."""

from __future__ import annotations

import asyncio
import time

from agents.engine import SamplingParams
from agents.node.agent import Agent
from agents.node.instances import Instance
from agents.node.pipeline_common import Events, error_event, quiet, token_event
from agents.node.wire import ROLE_SHORT, output_logprob
from pdd.vocab import Role


async def admit_single(
    agent: Agent, inst: Instance, request_id: str, prompt: list[int], sampling: SamplingParams
) -> asyncio.Queue:
    """Queue the request on the engine (EngineFull / ValueError surface before streaming)."""
    queue = agent.inbox.queue(request_id, inst.instance_id)
    inst.running_worker.add_sink(request_id, lambda out: queue.put_nowait(("tok", out)))
    try:
        await inst.running_worker.call(lambda e: e.add_request(request_id, prompt, sampling))
    except BaseException:
        inst.running_worker.remove_sink(request_id)
        agent.inbox.drop(request_id, inst.instance_id)
        raise
    return queue


async def run_single(
    agent: Agent, inst: Instance, request_id: str, queue: asyncio.Queue, started: float
) -> Events:
    role = ROLE_SHORT[Role(inst.role)]
    index, ttft = 0, None
    finished = False
    try:
        while True:
            item = await queue.get()
            if isinstance(item, BaseException):
                yield error_event(f"{request_id}: {item}")
                return
            _, out = item
            for j, tok in enumerate(out.token_ids):
                ttft = ttft if ttft is not None else time.monotonic() - started
                agent.instances.count_tokens(inst)
                yield token_event(index, tok, role, output_logprob(out, j))
                index += 1
            if out.finished:
                finished = True
                yield {
                    "type": "done",
                    "finish_reason": out.finish_reason,
                    "stats": {
                        "ttft_s": ttft,
                        "e2e_s": time.monotonic() - started,
                        "tokens_by_role": {role: index},
                        "pipeline": "single",
                    },
                }
                return
    finally:
        inst.running_worker.remove_sink(request_id)
        agent.inbox.drop(request_id, inst.instance_id)
        if not finished:
            await quiet(inst.running_worker.call(lambda e: e.abort(request_id)))
