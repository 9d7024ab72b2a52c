"""What the role pipelines (prefill.py, relay.py, decode.py, single.py) share: the NDJSON
events (from wire.py), transfer ids and KV payloads, the peer stream pump, background tasks,
remote and local cancels."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

import httpx

from agents.engine.kv_codec import join_payloads
from agents.node.agent import Agent
from agents.node.errors import AgentError
from agents.node.inbox import transfer_id
from agents.node.instances import Instance
from agents.node.wire import Peer, error_event, sampling_json, token_event
from agents.transfer.records import Transfer
from pdd.events import QueuedEvent

__all__ = [
    "Events",
    "OnClose",
    "PeerFailed",
    "cancel_local",
    "cancel_remote",
    "ensure_instance_worker",
    "error_event",
    "fire_and_forget",
    "get_within",
    "keep_alive",
    "kv_payload",
    "pump_stream",
    "queued_event",
    "quiet",
    "release_remote",
    "sampling_json",
    "settle",
    "token_event",
    "transfer_id",
]

log = logging.getLogger(__name__)

# A pipeline's event stream: an async generator, which its consumer closes (aclose) so the
# pipeline's cleanup runs at once rather than when the generator is collected.
Events = AsyncGenerator[dict[str, Any], None]
OnClose = Callable[[], Any]


class PeerFailed(Exception):
    """A peer agent answered with an error, or its stream broke."""


def kv_payload(transfer: Transfer) -> bytes:
    """The transfer's KV as one payload: its chunks are whole payloads of consecutive token
    ranges (one, or a streamed export's several: kv_codec.join_payloads)."""
    if not transfer.chunks:
        return b""  # no KV at all: the import refuses it, as it did
    return join_payloads([chunk.payload for chunk in transfer.chunks])


async def pump_stream(
    http: httpx.AsyncClient,
    url: str,
    body: dict,
    on_event: Callable[[dict[str, Any]], None],
    on_closed: Callable[[BaseException | None], None],
) -> None:
    """POST body to a peer's NDJSON endpoint; call on_event(event) for each line and finally
    on_closed(None | exception). Both run on the loop and must not block (they queue)."""
    try:
        timeout = httpx.Timeout(30.0, read=None)
        async with http.stream("POST", url, json=body, timeout=timeout) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")[:500]
                raise PeerFailed(f"{url}: HTTP {response.status_code}: {text}")
            async for line in response.aiter_lines():
                if line.strip():
                    on_event(json.loads(line))
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure of the peer is reported, not raised
        on_closed(exc)
    else:
        on_closed(None)


async def led_by(first: dict[str, Any], events: Events) -> Events:
    """`events` with `first` (P's token event) ahead of their first token, done event or
    `continue` (RLD handing the stream to MD before it made a token of its own), as P sends
    it at the head of the decoding role's stream; an error before any of them goes out alone
    (no token was made for the user). Closing this closes `events`."""
    sent = False
    try:
        async for event in events:
            if not sent and event.get("type") in ("token", "done", "continue"):
                sent = True
                yield first
            yield event
    finally:
        await events.aclose()


async def get_within(queue: asyncio.Queue, timeout_s: float) -> Any:
    """`queue.get()`, or TimeoutError after timeout_s.

    Not `asyncio.wait_for`: on Python 3.11 it swallows a cancellation that comes in the same
    loop turn as the item, returning the item instead. A pipeline whose stream's client left
    then runs on with nobody left to stop it (MD held a request for a handoff that never came,
    its decode slot and KV blocks with it, and its stream handler never returned). Here the
    cancellation always wins, and the item stays in the queue for whoever reads it next."""
    async with asyncio.timeout(timeout_s):
        return await queue.get()


def queued_event(started: float, waiting_for: str) -> dict[str, Any]:
    """An agent's keep-alive (``queued``) for a wait that began at ``started`` (monotonic)."""
    return QueuedEvent(round(time.monotonic() - started, 3), waiting_for).to_json()


async def keep_alive(
    task: asyncio.Future, every_s: float, waiting_for: str, limit_s: float | None = None
) -> Events:
    """A ``queued`` event every ``every_s`` until ``task`` is done (the caller then reads its
    result): the agent holds the request with no token for it yet, busy, not frozen, so the
    gateway's first-token timeout measures silence. Closed early (the caller left), it
    cancels the task. With ``limit_s``, a task not done by then is cancelled and TimeoutError
    raised (a wait that is bounded, such as a decoder's engine behind its model)."""
    started = time.monotonic()
    try:
        while True:
            wait = every_s
            if limit_s is not None:
                left = limit_s - (time.monotonic() - started)
                if left <= 0:
                    raise TimeoutError(f"not done within {limit_s:g} s")
                wait = min(every_s, left)
            done, _ = await asyncio.wait({task}, timeout=wait)
            if done:
                return
            if limit_s is None or time.monotonic() - started < limit_s:
                yield queued_event(started, waiting_for)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def fire_and_forget(agent: Agent, coro) -> None:
    agent.keep(asyncio.create_task(coro))


async def settle(tasks: list[asyncio.Task], grace_s: float) -> None:
    """Give tasks ``grace_s`` to finish, then cancel what is left."""
    _, pending = await asyncio.wait(tasks, timeout=grace_s)
    for task in pending:
        task.cancel()


async def quiet(future) -> Any:
    """Await a cleanup step; a failure is logged, not raised."""
    try:
        return await future
    except Exception as exc:  # noqa: BLE001
        log.info("cleanup step failed: %r", exc)
        return None


async def _tell_peer(agent: Agent, peer: Peer, what: str, body: dict) -> None:
    """POST body to the peer's /v1/pdd/<what>, best effort: the peer may be gone."""
    try:
        await agent.http.post(f"{peer.http}/v1/pdd/{what}", json=body, timeout=5.0)
    except Exception as exc:  # noqa: BLE001 - best effort: the peer may be gone
        log.info("%s of %s at %s failed: %r", what, body["request_id"], peer.http, exc)


async def cancel_remote(agent: Agent, peer: Peer | None, request_id: str) -> None:
    if peer is not None:
        await _tell_peer(agent, peer, "cancel", {"request_id": request_id})


async def release_remote(agent: Agent, peer: Peer, request_id: str, start_token: int) -> None:
    """Tell MD that RLD answered request_id alone: MD caches P's KV for it even if RLD's
    decode call never reached it (POST /v1/pdd/release). Best effort, like a cancel."""
    body = {"request_id": request_id, "instance": peer.instance, "start_token": start_token}
    await _tell_peer(agent, peer, "release", body)


async def cancel_local(agent: Agent, request_id: str) -> bool:
    """Abort request_id on every instance of this agent and wake whoever waits for it, now
    or later (a decode call that raced the cancel finds it in its inbox)."""
    agent.inbox.cancel(request_id)
    await agent.kv_flight.unreserve(request_id)
    found = False
    for inst in list(agent.instances.values()):
        if inst.worker is not None:
            found |= bool(await quiet(inst.worker.call(lambda e: e.abort(request_id))))
    return found


def ensure_instance_worker(inst: Instance) -> None:
    if inst.worker is None:
        raise AgentError(503, f"instance {inst.instance_id} is {inst.state}")
