"""P, the prefill: admit the request to P's engine and prefill it while MD pins its cached
prefix (DRC) and, with ``kv_stream_tokens``, the delta starts leaving. What P streams
afterwards (ship the delta to MD over the WAN, or intra-DC for an MD in P's datacenter, and for
p-rld-md / rld-only the full KV intra-DC to RLD, then the decoding role's tokens) is
prefill_stream.py."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from agents.engine import SamplingParams, TokenLogprob
from agents.engine.outputs import PrefillResult, TokenOutput
from agents.node.agent import Agent
from agents.node.instances import Instance
from agents.node.kv_stream import (
    StreamedDelta,
    delta_start,
    fabric_to,
    send_format,
)
from agents.node.pipeline_common import (
    PeerFailed,
    cancel_remote,
    fire_and_forget,
    quiet,
)
from agents.node.wire import HandoffPlan, Peer
from agents.node.worker import EngineWorker
from pdd.token_ids import to_wire

log = logging.getLogger(__name__)


@dataclass(slots=True)
class PddRequest:
    request_id: str
    prompt: list[int]
    sampling: SamplingParams
    pipeline: str
    plan: HandoffPlan
    main: Peer | None  # None only for rld-only
    relay: Peer | None
    # Stream P's sampled token the moment prefill ends (the old behaviour, an explicit policy
    # setting), instead of at the head of the decoding role's stream (the default).
    early_first_token: bool = False
    # One hop per token: P's stream ends with a `continue` event naming the decoding role's
    # stream, which the caller reads itself, instead of P relaying every token of it.
    direct: bool = False


@dataclass(slots=True)
class Prefilled:
    first_token: int
    first_logprob: TokenLogprob | None
    finished: bool
    finish_reason: str | None
    prefill_cached_tokens: int
    main_cached_tokens: int | None  # None: MD's reservation failed (MD unreachable)
    main_error: str | None
    # What MD stores its KV as (its reservation's answer; None from an MD that does not say).
    main_kv_format: str | None

    started: float
    first_token_at: float
    # MD's delta streamed while prefill ran (kv_stream_tokens > 0 and MD reserved), else None.
    stream: StreamedDelta | None = None
    # MD's engine block size (its reservation's answer; None: an MD that does not say).
    main_block_size: int | None = None


@dataclass(frozen=True, slots=True)
class ReserveAnswer:
    """MD's answer to ``reserve``: the tokens of the prompt it holds (whole blocks of its own
    size), the format it stores KV in, and its engine's block size (None: an MD that does not
    say; the delta then starts at a block boundary of P's own size)."""

    cached_tokens: int
    kv_format: str | None = None
    block_size: int | None = None


async def reserve_remote(
    agent: Agent, main: Peer, request_id: str, prompt: list[int]
) -> ReserveAnswer:
    """MD pins its cached prefix of the prompt (``ReserveAnswer``)."""
    response = await agent.http.post(
        f"{main.http}/v1/pdd/reserve",
        json={"request_id": request_id, "instance": main.instance, "prompt_ids": to_wire(prompt)},
        timeout=agent.settings.reserve_timeout_s,
    )
    if response.status_code != 200:
        raise PeerFailed(f"reserve at MD: HTTP {response.status_code}: {response.text[:300]}")
    answer = response.json()
    stored, size = answer.get("kv_format"), answer.get("block_size")
    return ReserveAnswer(
        int(answer["cached_tokens"]),
        stored if isinstance(stored, str) else None,
        size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None,
    )


async def batched_prefill(
    worker: EngineWorker,
    request_id: str,
    prompt: list[int],
    sampling: SamplingParams,
    submitted: asyncio.Future[None] | None = None,
) -> PrefillResult:
    """Prefill batched with the engine's other work: the request joins the scheduler (chunked
    prefill with every other prompt waiting, not one prompt per engine command) and its first
    token arrives as a step output. EngineFull / ValueError surface from the submission;
    ``submitted`` is set once the engine has taken the request into its queue."""
    loop = asyncio.get_running_loop()
    first: asyncio.Future[TokenOutput] = loop.create_future()

    def sink(out: TokenOutput | BaseException) -> None:
        if first.done():
            return
        if isinstance(out, BaseException):
            first.set_exception(out)
        else:
            first.set_result(out)

    worker.add_sink(request_id, sink)
    try:
        await worker.call(lambda e: e.submit_prefill(request_id, prompt, sampling))
        if submitted is not None and not submitted.done():
            submitted.set_result(None)
        out = await first
        # Held from its first token on: read beside the next step, not after it.
        return await worker.read_held(lambda e: e.prefill_result(request_id, out))
    except BaseException:
        # Not started, or abandoned while queued: nothing of it may stay in the engine.
        await quiet(worker.call(lambda e: e.abort(request_id)))
        raise
    finally:
        worker.remove_sink(request_id)


async def admit_prefill(agent: Agent, inst: Instance, req: PddRequest) -> asyncio.Task[Prefilled]:
    """Start the prefill and return once P's engine has taken the request into its queue:
    EngineFull / ValueError are raised before that (the caller answers 503 / 400, a status
    code); the task (the prefill while MD pins its cached prefix) is what `run_prefill` waits
    for, with a ``queued`` event every ``queued_every_s`` while the request waits in the queue,
    so that a busy P is told from a frozen one (silent) by the gateway."""
    submitted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(prefill_with_reservation(agent, inst, req, submitted))
    try:
        waits: set[asyncio.Future[Any]] = {task, submitted}
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # the caller left while the submission ran
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise
    if task.done() and not submitted.done():
        task.result()  # the submission's EngineFull / ValueError (or the engine's failure)
    return task


async def prefill_with_reservation(
    agent: Agent, inst: Instance, req: PddRequest, submitted: asyncio.Future[None]
) -> Prefilled:
    """Prefill on P (``submitted`` set once the engine queued it) while MD pins its cached
    prefix and, with ``kv_stream_tokens``, the delta starts leaving."""
    started = time.monotonic()
    stream = (
        StreamedDelta(
            agent,
            inst.running_worker,
            req.request_id,
            req.main,
            len(req.prompt),
            background=req.relay is not None,
        )  # fmt: skip
        if req.main is not None and agent.settings.kv_stream_tokens > 0
        else None
    )

    async def reserve_main(main: Peer) -> ReserveAnswer:
        reservation = await reserve_remote(agent, main, req.request_id, req.prompt)
        if stream is not None:
            # The delta starts leaving while prefill runs.
            await stream.begin(
                main_delta_start(
                    agent, reservation.cached_tokens, reservation.block_size, len(req.prompt)
                ),
                wire_format(agent, inst, main, reservation.kv_format),
            )
        return reservation

    reserve = asyncio.create_task(reserve_main(req.main)) if req.main is not None else None
    try:
        result = await batched_prefill(inst.running_worker, req.request_id, req.prompt,
                                       req.sampling, submitted)  # fmt: skip
    except BaseException:
        if reserve is not None:
            reserve.cancel()
            fire_and_forget(agent, cancel_remote(agent, req.main, req.request_id))
        if stream is not None:
            stream.abort()
        raise
    first_at = time.monotonic()
    agent.instances.count_tokens(inst)
    reservation: ReserveAnswer | None = None
    error: str | None = None
    try:
        if reserve is None:
            error = "no main decode in this pipeline (rld-only)"
        else:
            reservation = await reserve
    except Exception as exc:  # noqa: BLE001 - MD unreachable: p-rld-md falls back to RLD alone
        error = f"{type(exc).__name__}: {exc}"
    if stream is not None and stream.send is None:
        stream.abort()  # MD did not reserve: nothing was streamed
        stream = None
    return Prefilled(
        result.first_token,
        result.first_logprob,
        result.finished,
        result.finish_reason,
        result.cached_tokens,
        None if reservation is None else reservation.cached_tokens,
        error,
        None if reservation is None else reservation.kv_format,
        started,
        first_at,
        stream,
        None if reservation is None else reservation.block_size,
    )


def main_delta_start(agent: Agent, cached: int, block_size: int | None, length: int) -> int:
    """Where MD's delta starts: MD's cached prefix, in whole blocks of MD's own size
    (``block_size``, its reservation's answer; None: P's own). MD's import starts at one of
    its block boundaries; P's may be larger or smaller."""
    return delta_start(cached, length, block_size or agent.settings.block_size)


def wire_format(agent: Agent, inst: Instance, main: Peer, stored: str | None) -> str | None:
    """The format MD's delta crosses in (kv_stream.send_format): the WAN link's, or MD's
    narrower dtype, or None for P's own."""
    own = getattr(inst.running_worker.engine.pool, "dtype_name", None)
    link_format = main.kv_format if fabric_to(agent, main) == "wan" else None
    return send_format(link_format, own, stored)


async def release_prefill(agent: Agent, inst: Instance, request_id: str) -> None:
    await quiet(inst.running_worker.call(lambda e: e.release(request_id)))
