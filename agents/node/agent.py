"""The agent: one per process, composed of parts with one job each, which the HTTP API
(http_api.py) and the role pipelines (prefill.py, relay.py, decode.py, single.py) call:

- `instances` (instances.py): the engine instances by id, their lifecycle, admission and
  the requests in flight that drain waits for;
- `links` (links.py): the KV fabrics' servers and clients and the WAN link per peer
  datacenter;
- `inbox` (inbox.py): received transfers waiting for the pipeline of their request;
- `kv_flight` (kv_flight.py): MD's DRC reservations and the KV in flight to it;
- `reporting` (reporting.py): the state document of agents/PROTOCOL.md and the heartbeat;
- `served` (served.py) and `tails` (tail.py): what each request streamed, and MD's streams
  handed to a direct caller.

The agent itself holds what they share: the settings, the peer HTTP client, the data-plane and
command tokens, the background tasks, and the sweep that expires unclaimed transfers and stale
reservations."""

from __future__ import annotations

import asyncio
import time

import httpx

from agents.node.inbox import Inbox
from agents.node.instances import Instances
from agents.node.kv_flight import KvInFlight
from agents.node.links import Links
from agents.node.reporting import Reporting
from agents.node.served import ServedLedger
from agents.node.settings import AgentSettings
from agents.node.tail import Tails
from pdd import looplag
from pdd.dataplane import CLIENT_IDLE_S, bearer_headers
from pdd.hardware import unit_from_json
from pdd.vocab import InstanceStatus


class Agent:
    """One per process. Lives on the event loop's thread; engines live on their own threads."""

    def __init__(self, settings: AgentSettings) -> None:
        self.settings = settings
        self.instances = Instances(settings)
        self.links = Links(settings)
        self.inbox = Inbox()
        self.kv_flight = KvInFlight(settings, self.instances)
        # Tokens each recent request streamed to its caller (served.py), for a gateway that
        # has to finish a dead process's requests.
        self.served = ServedLedger()
        # MD's requests whose stream outlives RLD's after the handoff (one hop per token).
        self.tails = Tails()
        self.reporting = Reporting(settings, self.instances, self.links, self.kv_flight, self.tails)
        self.background: set[asyncio.Task] = set()
        self.command_token: str | None = None  # set by registration with a control plane
        self.registered = False
        self._janitor: asyncio.Task | None = None
        self._lag_watch: asyncio.Task | None = None
        # Peer agents' data plane; no pooled-connection cap, streams can be long.
        self.http = httpx.AsyncClient(
            limits=httpx.Limits(
                max_connections=None, max_keepalive_connections=32, keepalive_expiry=CLIENT_IDLE_S
            )
        )
        self.data_token: str | None = None
        if settings.data_token:
            self.set_data_token(settings.data_token)

    def keep(self, task: asyncio.Task) -> None:
        """Hold a task that outlives its request (a cancel sent to a peer, a KV send still
        under way) until it ends."""
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    def set_data_token(self, token: str) -> None:
        """Require `token` on the data endpoints and the KV fabrics, and send it on every call
        and transfer to a peer."""
        self.data_token = token
        self.http.headers.update(bearer_headers(token))
        self.links.set_token(token)

    async def start(self) -> None:
        await self.links.start(self.inbox.on_transfer, self.inbox.on_transfer_error)
        self._janitor = asyncio.create_task(self._sweep())
        # How late this agent's loop runs (the state's loop_late_s): an agent writing hundreds
        # of streams may take a call in late while its engines are on time.
        self._lag_watch = looplag.start()
        if self.settings.role is not None:
            gpu = self.settings.gpu
            inst = await self.instances.put(
                "0",
                self.settings.role,
                self.settings.model,
                self.settings.model,
                gpu=None if gpu is None else unit_from_json(gpu),
            )
            await inst.ready.wait()
            if inst.state == InstanceStatus.FAILED:
                raise RuntimeError(f"instance 0 failed to start: {inst.error}")

    async def close(self) -> None:
        if self._janitor is not None:
            self._janitor.cancel()
        if self._lag_watch is not None:
            self._lag_watch.cancel()
        await self.tails.close()
        await self.instances.stop_all()
        await self.links.close()
        await self.http.aclose()

    async def _sweep(self) -> None:
        """Drop unclaimed inbox entries and stale DRC reservations."""
        while True:
            await asyncio.sleep(min(5.0, self.settings.reserve_ttl_s / 4))
            now = time.monotonic()
            self.inbox.sweep(now, self.settings.kv_timeout_s)
            await self.kv_flight.sweep(now)
