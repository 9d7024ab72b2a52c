"""The agent's state: engine instances by id, the two KV fabrics (servers and clients), WAN links
per peer datacenter, the inbox where received transfers wait for their request, DRC
reservations and the KV incoming to MD (counted in its prefix match, agents/node/inflight.py),
drain, and the state document of agents/PROTOCOL.md."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import sys
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypedDict

import httpx
import numpy as np

from agents.engine.config import DTYPE_NAMES, EngineConfig
from agents.engine.core import EngineCore as Engine
from agents.engine.emulated import EmulatedEngine
from agents.engine.interface import EMULATED, TORCH
from agents.node.inflight import block_prefix_len
from agents.node.kv_events import KVEventLog
from agents.node.served import ServedLedger
from agents.node.settings import ROLES, AgentSettings, split_host_port
from agents.node.tail import Tails
from agents.node.worker import EngineWorker
from agents.transfer.client import FabricClient
from agents.transfer.counters import Direction, FabricCounters, FabricName
from agents.transfer.pool import PoolStats
from agents.transfer.records import Transfer
from agents.transfer.server import FabricServer
from agents.transfer.shaping import LinkSettings, LinkShaper
from pdd.dataplane import CLIENT_IDLE_S, bearer_headers
from pdd.hardware import GpuType, unit_from_json
from pdd.prefix import prefix_block_hashes
from pdd.profiles import ModelProfile, is_profile_source, load_profile
from pdd.vocab import InstanceStatus

if TYPE_CHECKING:
    from agents.engine.loader import LoadedModel

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
# Transfer ids on the fabric: "<request id>|<target instance id>|<what>", what = "kv" or
# "h<n>" / "h<n>.final" (a handoff batch of token ids).
SEP = "|"
# How many ended (request, instance) pairs an agent remembers, to drop their late transfers.
ENDED_REMEMBERED = 4096


class AgentError(Exception):
    """An error the HTTP layer turns into a status code and a JSON message."""

    def __init__(
        self, status: int, message: str, field: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.field = field
        self.code = code  # machine-readable, e.g. pdd.events.ENGINE_FULL


@dataclass(eq=False)
class Instance:
    instance_id: str
    role: str
    model: str
    source: str
    dtype: str = "float32"  # the engine's weights and KV (EngineConfig.dtype)
    state: str = InstanceStatus.STARTING
    worker: EngineWorker | None = None
    error: str | None = None
    active: int = 0  # requests in flight on this instance
    tokens_emitted: int = 0  # output tokens this instance produced in its role
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    # The GPU unit the control plane's start command named (None: not named). An emulated
    # instance (source "profile:...") takes its step times from it and from its model profile.
    gpu: GpuType | None = None
    profile: ModelProfile | None = None
    # The instance's prefix-cache changes, published to the control plane's prefix index
    # (agents/node/kv_events.py); None until its engine runs.
    kv_events: KVEventLog | None = None

    @property
    def engine_kind(self) -> str:
        return EMULATED if is_profile_source(self.source) else TORCH

    @property
    def spec(self) -> tuple[str, str, str, str]:
        return (self.role, self.model, self.source, self.dtype)

    def admitting(self) -> bool:
        return self.state == InstanceStatus.RUNNING and self.worker is not None

    @property
    def running_worker(self) -> EngineWorker:
        """The engine's worker, for the pipelines; AgentError (503) once the instance stopped."""
        if self.worker is None:
            raise AgentError(503, f"instance {self.instance_id} is {self.state}")
        return self.worker


class _DeviceOption(TypedDict, total=False):
    """EngineConfig's device, given only when the agent names one (else the engine's default,
    which reads $BATON_ENGINE_DEVICE)."""

    device: str


@dataclass(slots=True)
class _InboxEntry:
    queue: asyncio.Queue
    created_at: float
    claimed: bool = False


def _remember(seen: OrderedDict, key: Any) -> None:
    """Add ``key`` as the newest of ``seen``, forgetting the oldest past ENDED_REMEMBERED."""
    seen[key] = None
    seen.move_to_end(key)
    while len(seen) > ENDED_REMEMBERED:
        seen.popitem(last=False)


@dataclass(slots=True, eq=False)
class Reservation:
    """MD's DRC pin for one request, until its KV is imported or the reservation is dropped.

    `nodes` are radix TreeNodes locked on the engine thread for this request: the cached
    prefix matched at reserve time and, when `depends_on` names an incoming request, the
    prefix that request's import put in the cache. Whoever pops the reservation from
    `Agent.reservations` unlocks the nodes it holds at that moment, once; a pin for a
    reservation no longer there is unlocked by whoever made it."""

    instance_id: str
    nodes: list[Any]
    cached_tokens: int
    created_at: float
    # An incoming request whose KV `cached_tokens` counts on: import only after it landed.
    depends_on: Incoming | None = None
    # The request's KV arrived and its importer owns the reservation (the expiry sweep skips it).
    claimed: bool = False


@dataclass(slots=True, eq=False)
class Incoming:
    """A request whose KV is committed to an MD instance: reserved, on its way over the WAN.
    Later reservations on that instance count its prompt's whole blocks as cached."""

    request_id: str
    instance_id: str
    tokens: np.ndarray  # the prompt (inflight.as_tokens)
    created_at: float
    done: asyncio.Event = field(default_factory=asyncio.Event)  # imported, failed or dropped
    landed: bool = False  # its import succeeded: its prompt's whole blocks are in the cache
    # (request id, prompt[:cached_tokens]) of the reservations counting on this KV, pinned by
    # the engine call that imports it. Appended on the loop, copied on the engine thread.
    dependents: list[tuple[str, Sequence[int]]] = field(default_factory=list)


class Agent:
    """One per process. Lives on the event loop's thread; engines live on their own threads."""

    def __init__(self, settings: AgentSettings) -> None:
        self.settings = settings
        self.instances: dict[str, Instance] = {}
        self.counters = FabricCounters()
        self.links: dict[str, LinkShaper] = {}
        # Set by the control-plane link (agents/node/control.py) when the agent has one.
        self.heartbeat_stats: Any = None
        # Requests whose KV MD cached after RLD had finished them alone (DRC alignment).
        self.late_kv_cached = 0
        # (monotonic time, bytes granted) per link at the last report, for its utilisation.
        self._link_marks: dict[str, tuple[float, int]] = {}
        self.wan_clients: dict[str, FabricClient] = {}
        self.intra_client = FabricClient(FabricName.INTRA_DC, None, counters=self.counters)
        self._unshaped_wan = FabricClient(FabricName.WAN, None, counters=self.counters)
        self.intra_server: FabricServer | None = None
        self.wan_server: FabricServer | None = None
        self.draining = False
        self.active_requests = 0
        self.tokens_by_role: dict[str, int] = {role: 0 for role in ROLES}
        self.command_token: str | None = None  # set by registration with a control plane
        self.registered = False
        self._inbox: dict[tuple[str, str], _InboxEntry] = {}
        # (request, instance) whose consumer has finished here, newest last (bounded): a
        # transfer for one of them arriving or failing later (RLD cancels its unsent handoff
        # batches once the request is over) is expected and dropped without a new inbox entry.
        self._ended: OrderedDict[tuple[str, str], None] = OrderedDict()
        # Requests cancelled here, newest last (bounded): a consumer or transfer for one that
        # turns up after the cancel (its call raced the cancel on another connection) finds
        # the cancel already in its inbox instead of waiting for KV that is not coming.
        self._cancelled: OrderedDict[str, None] = OrderedDict()
        # (request, instance) that RLD answered alone and released here (POST
        # /v1/pdd/release), newest last (bounded): a decode call for one of them that turns up
        # afterwards ends at once instead of sharing the inbox the release's import reads.
        self._released: OrderedDict[tuple[str, str], None] = OrderedDict()
        self.reservations: dict[str, Reservation] = {}
        self.incoming: dict[str, Incoming] = {}
        self._incoming_blocks: dict[str, tuple[str, ...]] = {}  # request id -> its prompt's
        # prefix-block hashes, computed once (incoming_block_hashes)
        # Reservations that answered more than the radix cache held, counting KV in flight.
        self.in_flight_prefix_hits = 0
        # Imports whose counted-on prefix never landed, so MD recomputed it, and its tokens.
        self.recomputed_imports = 0
        self.recomputed_tokens = 0
        self._models: dict[tuple[str, str], LoadedModel] = {}  # by (source, dtype)
        self._janitor: asyncio.Task | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        self.background: set[asyncio.Task] = set()
        # Tokens each recent request streamed to its caller (served.py), for a gateway that
        # has to finish a dead process's requests.
        self.served = ServedLedger()
        # MD's requests whose stream outlives RLD's after the handoff (one hop per token).
        self.tails = Tails()
        # Peer agents' data plane; no pooled-connection cap, streams can be long.
        self.http = httpx.AsyncClient(
            limits=httpx.Limits(
                max_connections=None, max_keepalive_connections=32, keepalive_expiry=CLIENT_IDLE_S
            )
        )
        self.data_token: str | None = None
        if settings.data_token:
            self.set_data_token(settings.data_token)
        for peer, link in settings.links.items():
            self.set_link(peer, link)

    def set_data_token(self, token: str) -> None:
        """Require `token` on the data endpoints and the KV fabrics, and send it on every call
        and transfer to a peer."""
        self.data_token = token
        self.http.headers.update(bearer_headers(token))
        for fabric in self._fabrics():
            fabric.token = token

    def _fabrics(self) -> list[FabricClient | FabricServer]:
        clients = [self.intra_client, self._unshaped_wan, *self.wan_clients.values()]
        servers = [s for s in (self.intra_server, self.wan_server) if s is not None]
        return [*clients, *servers]

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        host, port = split_host_port(self.settings.kv_listen, "kv_listen")
        self.intra_server = FabricServer(
            self._on_transfer,
            self._on_transfer_error,
            host=host,
            port=port,
            fabric=FabricName.INTRA_DC,
            counters=self.counters,
        )
        self.wan_server = FabricServer(
            self._on_transfer,
            self._on_transfer_error,
            host=host,
            port=self.settings.wan_port,
            fabric=FabricName.WAN,
            counters=self.counters,
        )
        self.intra_server.token = self.wan_server.token = self.data_token
        await self.intra_server.start()
        await self.wan_server.start()
        self._janitor = asyncio.create_task(self._sweep())
        if self.settings.role is not None:
            gpu = self.settings.gpu
            await self.put_instance(
                "0",
                self.settings.role,
                self.settings.model,
                self.settings.model,
                gpu=None if gpu is None else unit_from_json(gpu),
            )
            inst = self.instances["0"]
            await inst.ready.wait()
            if inst.state == InstanceStatus.FAILED:
                raise RuntimeError(f"instance 0 failed to start: {inst.error}")

    async def close(self) -> None:
        if self._janitor is not None:
            self._janitor.cancel()
        await self.tails.close()
        for inst in list(self.instances.values()):
            await self._stop_instance(inst)
        for server in (self.intra_server, self.wan_server):
            if server is not None:
                await server.close()
        await self.http.aclose()

    # -- instances ---------------------------------------------------------------------------

    async def put_instance(
        self,
        instance_id: str,
        role: str,
        model: str,
        source: str,
        wait_s: float = 3.0,
        *,
        dtype: str | None = None,
        gpu: GpuType | None = None,
    ) -> Instance:
        """Start an instance (idempotent for the same spec; 409 for a different one). The spec
        is (role, model, source, dtype); `dtype` None is the agent's own (settings.dtype). A
        source "profile:..." starts an emulated engine, which needs the `gpu` unit it models."""
        if role not in ROLES:
            raise AgentError(400, f"role must be one of {list(ROLES)}, got {role!r}", "role")
        profile = None
        if is_profile_source(source):
            if gpu is None:
                raise AgentError(
                    400, f"gpu: required for an emulated instance (source {source!r})", "gpu"
                )
            try:
                profile = load_profile(source)
            except ValueError as exc:
                raise AgentError(400, str(exc), "source") from None
        elif self.settings.kv_scale != 1:
            raise AgentError(
                400,
                f"source: this agent runs with kv_scale {self.settings.kv_scale:g} and hosts "
                f"emulated instances only (source profile:...), not {source!r}",
                "source",
            )
        dtype = self.settings.dtype if dtype is None else dtype
        if dtype not in DTYPE_NAMES:
            raise AgentError(
                400, f"dtype must be one of {list(DTYPE_NAMES)}, got {dtype!r}", "dtype"
            )
        spec = (role, model, source, dtype)
        current = self.instances.get(instance_id)
        if current is not None and current.state not in (
            InstanceStatus.STOPPED,
            InstanceStatus.FAILED,
        ):
            if current.spec != spec:
                raise AgentError(
                    409,
                    f"instance {instance_id} runs {current.spec}; stop it before starting {spec}",
                )
            if current.state in (InstanceStatus.DRAINING, InstanceStatus.DRAINED):
                if self.draining:
                    raise AgentError(503, "agent is draining; not resuming instances")
                # Start after drain: the engine is still loaded, so it just admits work again.
                current.state = InstanceStatus.RUNNING
            await asyncio.wait({asyncio.ensure_future(current.ready.wait())}, timeout=wait_s)
            return current
        if self.draining:
            raise AgentError(503, "agent is draining; not starting instances")
        inst = Instance(instance_id, role, model, source, dtype, gpu=gpu, profile=profile)
        self.instances[instance_id] = inst
        task = asyncio.create_task(self._load(inst))
        await asyncio.wait({task}, timeout=wait_s)
        return inst

    async def _load(self, inst: Instance) -> None:
        s = self.settings
        device: _DeviceOption = {"device": s.device} if s.device else {}
        config = EngineConfig(
            block_size=s.block_size,
            num_blocks=s.num_blocks,
            max_running=s.max_running,
            max_queued=s.max_queued,
            max_batch_tokens=s.max_batch_tokens,
            seed=s.seed,
            dtype=inst.dtype,
            decode_weights=None if s.decode_weights == "full" else s.decode_weights,
            decode_compile=s.decode_compile,
            **device,
        )
        try:
            engine = await self._make_engine(inst, config)
        except Exception as exc:  # noqa: BLE001 - reported in the state document
            log.exception("instance %s failed to load %s", inst.instance_id, inst.source)
            inst.state, inst.error = InstanceStatus.FAILED, f"{type(exc).__name__}: {exc}"
        else:
            if inst.state == InstanceStatus.STARTING:
                loop = asyncio.get_running_loop()
                # Every instance publishes its prefix cache's changes (KV cache events): the
                # engine thread records them after every step and command. The gateway routes
                # on P's and MD's.
                engine.cache.enable_events()
                inst.kv_events = KVEventLog(inst.instance_id)
                snapshot = functools.partial(_record_kv_events, inst.kv_events)
                inst.worker = EngineWorker(
                    engine, loop, inst.instance_id, snapshot=snapshot, snapshot_every_s=0.0
                )
                inst.state = InstanceStatus.RUNNING
        inst.ready.set()

    async def _make_engine(self, inst: Instance, config: EngineConfig) -> Engine:
        s = self.settings
        if inst.engine_kind == EMULATED:
            assert inst.gpu is not None and inst.profile is not None  # put_instance checked
            return EmulatedEngine(
                inst.profile,
                inst.gpu,
                config,
                kv_scale=s.kv_scale,
                speedup=s.speedup,
            )
        # The real engine: torch loads with the first one (an agent of emulated instances only
        # never loads it), with the thread budget `python -m agents serve` resolved.
        import torch

        from agents.engine.engine import Engine as TorchEngine
        from agents.engine.loader import load_model

        if s.thread_plan is not None:
            torch.set_num_threads(s.thread_plan.torch_threads)
        # One loaded checkpoint per (source, dtype): an engine casts its model in place
        # (Engine.__init__), so instances of one source in different dtypes must not share it.
        key = (inst.source, inst.dtype)
        loaded = self._models.get(key)
        if loaded is None:
            loaded = await asyncio.to_thread(load_model, inst.source, config.torch_dtype, s.seed)
            self._models[key] = loaded
        return TorchEngine(loaded, config)

    async def drain_instance(self, instance_id: str) -> Instance:
        inst = self.instances.get(instance_id)
        if inst is None or inst.state == InstanceStatus.STOPPED:
            raise AgentError(404, f"no instance {instance_id}")
        if inst.state in (InstanceStatus.RUNNING, InstanceStatus.STARTING):
            inst.state = InstanceStatus.DRAINING
        self._check_drained(inst)
        return inst

    async def delete_instance(self, instance_id: str) -> None:
        inst = self.instances.pop(instance_id, None)
        if inst is not None:
            await self._stop_instance(inst)

    async def _stop_instance(self, inst: Instance) -> None:
        inst.state = InstanceStatus.STOPPED
        inst.ready.set()
        if inst.worker is not None:
            inst.worker.stop()
            await asyncio.to_thread(inst.worker.join, 10.0)
            inst.worker = None

    def _check_drained(self, inst: Instance) -> None:
        if inst.state == InstanceStatus.DRAINING and inst.active == 0:
            inst.state = InstanceStatus.DRAINED

    def instance(self, instance_id: str | None, role: str | None) -> Instance:
        """The instance a data-plane request names (or the only one of `role`), admitting."""
        inst: Instance | None
        if instance_id is None:
            matches = [i for i in self.instances.values() if role is None or i.role == role]
            if len(matches) != 1:
                raise AgentError(
                    400,
                    f"instance: required when this agent has {len(matches)} "
                    f"{role or 'any'} instances",
                    "instance",
                )
            inst = matches[0]
        else:
            inst = self.instances.get(instance_id)
            if inst is None:
                raise AgentError(404, f"no instance {instance_id} on this agent", "instance")
        if role is not None and inst.role != role:
            raise AgentError(
                400, f"instance {inst.instance_id} is a {inst.role}, not a {role}", "instance"
            )
        if self.draining or inst.state in (InstanceStatus.DRAINING, InstanceStatus.DRAINED):
            raise AgentError(503, f"instance {inst.instance_id} is draining; not admitting")
        if not inst.admitting():
            raise AgentError(503, f"instance {inst.instance_id} is {inst.state}")
        return inst

    # -- request accounting (drain waits for these) ------------------------------------------

    def begin(self, inst: Instance | None) -> None:
        self.active_requests += 1
        self._idle.clear()
        if inst is not None:
            inst.active += 1

    def end(self, inst: Instance | None) -> None:
        self.active_requests -= 1
        if inst is not None:
            inst.active -= 1
            self._check_drained(inst)
        if self.active_requests == 0:
            self._idle.set()

    def count_tokens(self, inst: Instance, n: int = 1) -> None:
        inst.tokens_emitted += n
        self.tokens_by_role[inst.role] += n

    async def drain(self, grace_s: float) -> bool:
        """Stop admitting; wait up to grace_s for in-flight requests. True if all finished."""
        self.draining = True
        for inst in self.instances.values():
            if inst.state in (InstanceStatus.RUNNING, InstanceStatus.STARTING):
                inst.state = InstanceStatus.DRAINING
            self._check_drained(inst)
        try:
            async with asyncio.timeout(grace_s):  # never swallows a cancel (get_within)
                await self._idle.wait()
            return True
        except TimeoutError:
            return False

    # -- links -------------------------------------------------------------------------------

    def set_link(self, peer: str, link: LinkSettings) -> LinkSettings:
        """Shape the WAN link towards `peer` as declared; returns the declared settings. With
        kv_scale > 1 the shaper runs at bandwidth / kv_scale (emulated KV carries 1/kv_scale of
        the real bytes, so transfers take the declared link's time); with speedup != 1 the
        link runs at bandwidth x speedup and RTT / speedup, as the engines' modelled steps do
        (slow motion when speedup < 1)."""
        scale, speed = self.settings.kv_scale, self.settings.speedup
        shaped = dataclasses.replace(
            link,
            bandwidth_gbps=link.bandwidth_gbps * speed / scale,
            rtt_ms=link.rtt_ms / speed,
        )
        shaper = self.links.get(peer)
        if shaper is None:
            shaper = LinkShaper(shaped)
            self.links[peer] = shaper
            client = FabricClient(FabricName.WAN, shaper, counters=self.counters)
            client.token = self.data_token
            self.wan_clients[peer] = client
        else:
            shaper.update(
                bandwidth_gbps=shaped.bandwidth_gbps, rtt_ms=shaped.rtt_ms, pool_size=link.pool_size
            )
        return _declared(shaper, scale, speed)

    def handoff_ack_timeout_s(self, peer_datacenter: str | None) -> float:
        """How long RLD waits for MD's acknowledgement of the final handoff over the link to
        `peer_datacenter`: the floor plus four round trips, at most handoff_timeout_s."""
        shaper = self.links.get(peer_datacenter) if peer_datacenter else None
        rtt_s = shaper.settings.rtt_s if shaper is not None else 0.0
        return min(self.settings.handoff_timeout_s, self.settings.handoff_ack_floor_s + 4 * rtt_s)

    def wan_client(self, peer_datacenter: str | None) -> FabricClient:
        """The WAN link's shaped client towards that datacenter; a peer with no configured
        link gets unshaped WAN (still counted as WAN, and logged)."""
        client = self.wan_clients.get(peer_datacenter) if peer_datacenter else None
        if client is None:
            log.warning("no link configured towards %s: WAN transfer is unshaped", peer_datacenter)
            return self._unshaped_wan
        return client

    # -- inbox: received transfers wait here for their request -------------------------------

    def inbox(self, request_id: str, instance_id: str) -> asyncio.Queue:
        """The queue of transfers (or failures) for this request on this instance."""
        entry = self._inbox.get((request_id, instance_id)) or self._new_entry(
            (request_id, instance_id)
        )
        entry.claimed = True
        return entry.queue

    def claim_released(self, request_id: str, instance_id: str) -> asyncio.Queue | None:
        """The request was answered elsewhere (RLD alone): claim its inbox here, for caching
        the KV P sends, unless a consumer already has it (None). Remembers the release."""
        if self.consumer_started(request_id, instance_id):
            return None
        _remember(self._released, (request_id, instance_id))
        return self.inbox(request_id, instance_id)

    def released(self, request_id: str, instance_id: str) -> bool:
        return (request_id, instance_id) in self._released

    def consumer_started(self, request_id: str, instance_id: str) -> bool:
        """Whether a consumer has claimed this request's inbox here, or has finished with it."""
        key = (request_id, instance_id)
        entry = self._inbox.get(key)
        return key in self._ended or (entry is not None and entry.claimed)

    def _new_entry(self, key: tuple[str, str]) -> _InboxEntry:
        entry = _InboxEntry(asyncio.Queue(), time.monotonic())
        if key[0] in self._cancelled:
            entry.queue.put_nowait(RuntimeError("cancelled"))
        self._inbox[key] = entry
        return entry

    def drop_inbox(self, request_id: str, instance_id: str) -> None:
        """The request is over on this instance: drop its inbox and remember that it ended."""
        key = (request_id, instance_id)
        self._inbox.pop(key, None)
        _remember(self._ended, key)

    @staticmethod
    def _parse_transfer_id(transfer_id: str | None) -> tuple[tuple[str, str], str] | None:
        """``request|instance|kind`` -> ((request, instance), kind); None if malformed."""
        if transfer_id is None or transfer_id.count(SEP) != 2:
            return None
        request_id, instance_id, what = transfer_id.split(SEP)
        return (request_id, instance_id), what

    def _ended_here(self, transfer_id: str | None) -> bool:
        parsed = self._parse_transfer_id(transfer_id)
        return parsed is not None and parsed[0] in self._ended

    def fail_inbox(self, request_id: str, reason: str) -> None:
        """Wake every consumer of request_id with a failure (a cancel, a failed send)."""
        for (rid, _iid), entry in list(self._inbox.items()):
            if rid == request_id:
                entry.queue.put_nowait(RuntimeError(reason))

    def cancel_inbox(self, request_id: str) -> None:
        """Cancel request_id here: wake its consumers, and every consumer that arrives later
        finds the cancel waiting in its inbox (remembered for the last ENDED_REMEMBERED)."""
        _remember(self._cancelled, request_id)
        self.fail_inbox(request_id, "cancelled")

    def _entry(self, transfer_id: str | None) -> tuple[_InboxEntry | None, str]:
        parsed = self._parse_transfer_id(transfer_id)
        if parsed is None:
            return None, ""
        key, what = parsed
        entry = self._inbox.get(key) or self._new_entry(key)
        return entry, what

    async def _on_transfer(self, transfer: Transfer) -> None:
        if self._ended_here(transfer.request_id):
            log.debug("transfer %s arrived after its request ended here; dropped",
                      transfer.request_id)  # fmt: skip
            return
        entry, what = self._entry(transfer.request_id)
        if entry is None:
            log.warning("transfer %r names no request|instance|kind; dropped", transfer.request_id)
            return
        entry.queue.put_nowait((what, transfer))

    async def _on_transfer_error(self, transfer_id: str | None, exc: Exception) -> None:
        if self._ended_here(transfer_id):
            # The sender gave up on a request that is already over here (RLD cancels its
            # in-flight handoff batches when the request ends): nobody waits for it.
            log.info("transfer %s cut after its request ended here: %r", transfer_id, exc)
            return
        log.warning("transfer %s failed: %r", transfer_id, exc)
        entry, _ = self._entry(transfer_id)
        if entry is not None:
            entry.queue.put_nowait(exc)

    async def _sweep(self) -> None:
        """Drop unclaimed inbox entries and stale DRC reservations."""
        while True:
            await asyncio.sleep(min(5.0, self.settings.reserve_ttl_s / 4))
            now = time.monotonic()
            for key, entry in list(self._inbox.items()):
                if not entry.claimed and now - entry.created_at > self.settings.kv_timeout_s:
                    self._inbox.pop(key, None)
            for rid, res in list(self.reservations.items()):
                if not res.claimed and now - res.created_at > self.settings.reserve_ttl_s:
                    await self.unreserve(rid)
            # Belt and braces: every path that ends a request finishes its incoming entry.
            stale = self.settings.reserve_ttl_s + 2 * self.settings.kv_timeout_s
            for rid, inc in list(self.incoming.items()):
                if rid not in self.reservations and now - inc.created_at > stale:
                    self.finish_incoming(rid)

    async def unreserve(self, request_id: str) -> None:
        """Drop request_id's reservation (cancel, expiry, after its import): unlock its pins,
        and stop counting its KV as incoming (whoever waits for it wakes up)."""
        res = self.reservations.pop(request_id, None)
        self.finish_incoming(request_id)
        if res is None:
            return
        nodes = list(res.nodes)
        res.nodes.clear()
        inst = self.instances.get(res.instance_id)
        if nodes and inst is not None and inst.worker is not None:
            await inst.worker.call(lambda engine: unlock_all(engine, nodes))

    # -- KV incoming to MD (agents/node/inflight.py) -----------------------------------------

    def finish_incoming(
        self,
        request_id: str,
        *,
        landed: bool = False,
        pins: Sequence[tuple[str, Any]] = (),
        inst: Instance | None = None,
    ) -> None:
        """request_id's KV import finished (`landed`: it succeeded), or its reservation was
        dropped: hand `pins` (TreeNodes its import locked for dependent reservations) to those
        reservations, and wake whoever waits. Idempotent; runs on the loop."""
        inc = self.incoming.pop(request_id, None)
        if inst is None and inc is not None:
            inst = self.instances.get(inc.instance_id)
        worker = inst.worker if inst is not None else None
        pinned: set[str] = set()
        orphans: list[Any] = []
        for dep_rid, node in pins:
            res = self.reservations.get(dep_rid)
            if res is not None and depends_on(res, request_id):
                res.nodes.append(node)
                pinned.add(dep_rid)
            else:
                orphans.append(node)  # the dependent is gone (imported, timed out, cancelled)
        if orphans and worker is not None:
            worker.call(lambda engine: unlock_all(engine, orphans))
        if inc is None:
            return
        inc.landed = landed
        if landed and worker is not None:
            # Dependents that registered after the import's engine call had started.
            for dep_rid, prefix in list(inc.dependents):
                if dep_rid not in pinned and dep_rid in self.reservations:
                    self._pin_late(worker, request_id, dep_rid, prefix)
        inc.done.set()

    def _pin_late(self, worker: EngineWorker, source: str, dep_rid: str, prefix) -> None:
        def pin(engine: Engine) -> Any:
            node = engine.cache.match_prefix(prefix).node
            engine.cache.lock(node)
            return node

        def attach(future: asyncio.Future) -> None:
            if future.cancelled() or future.exception() is not None:
                return
            res = self.reservations.get(dep_rid)
            if res is not None and depends_on(res, source):
                res.nodes.append(future.result())
            else:
                node = future.result()
                worker.call(lambda engine: engine.cache.unlock(node))

        worker.call(pin).add_done_callback(attach)

    def best_incoming(
        self, instance_id: str, tokens: np.ndarray, exclude: str
    ) -> tuple[Incoming | None, int]:
        """The incoming request on that instance sharing the longest whole-block prefix with
        `tokens`, and that length."""
        best: Incoming | None = None
        best_len = 0
        bs = self.settings.block_size
        for rid, inc in self.incoming.items():
            if rid == exclude or inc.instance_id != instance_id or inc.done.is_set():
                continue
            length = block_prefix_len(tokens, inc.tokens, bs)
            if length > best_len:
                best, best_len = inc, length
        return best, best_len

    def incoming_block_hashes(self, instance_id: str, limit: int = 8192) -> list[str]:
        """Prefix-block hashes (pdd/prefix.py, this agent's block size) of the prompts whose
        KV is in flight to `instance_id`, newest request first, at most `limit`: the
        heartbeat's `incoming_prefix_blocks`, which routing counts as held here, as `reserve`
        counts that KV. Each request's hashes are computed once, on the event loop."""
        memo = self._incoming_blocks
        for rid in [rid for rid in memo if rid not in self.incoming]:
            del memo[rid]
        bs = self.settings.block_size
        out: dict[str, None] = {}
        for rid, inc in reversed(self.incoming.items()):
            if inc.instance_id != instance_id or inc.done.is_set():
                continue
            hashes = memo.get(rid)
            if hashes is None:
                hashes = memo[rid] = prefix_block_hashes(inc.tokens[: limit * bs].tolist(), bs)
            for block in hashes:
                if len(out) >= limit:
                    return list(out)
                out[block] = None
        return list(out)

    def _add_incoming_blocks(self, doc: dict[str, Any]) -> None:
        for item in doc["instances"]:
            if item.get("role") == "main_decode":
                item["incoming_prefix_blocks"] = self.incoming_block_hashes(item["instance_id"])

    # -- state document ----------------------------------------------------------------------

    def instance_state(self, inst: Instance) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "instance_id": inst.instance_id,
            "role": inst.role,
            "model": inst.model,
            "source": inst.source,
            "dtype": inst.dtype,
            # "emulated": a model profile on modelled hardware, not a real model (the
            # "emulation" object says which unit and profile); "torch": the real engine.
            "engine_kind": inst.engine_kind,
            "state": inst.state,
            "tokens_generated": inst.tokens_emitted,
            "kv_endpoint": self.kv_endpoint(),
        }
        if inst.gpu is not None:
            doc["gpu"] = inst.gpu.name
        if inst.error:
            doc["error"] = inst.error
        if inst.worker is not None:
            if inst.engine_kind == EMULATED:
                doc["emulation"] = inst.worker.engine.describe()
            st = inst.worker.stats
            doc["load"] = {
                "running": st.running,
                "queued": st.queued,
                "held": st.held,
                "active_requests": inst.active,
                "max_running": inst.worker.engine.config.max_running,
            }
            doc["kv"] = {
                "used_blocks": st.kv_blocks_used,
                "total_blocks": st.kv_blocks_total,
                "block_size": self.settings.block_size,
            }
            doc["cache"] = {
                "lookups": st.cache_lookups,
                "hits": st.cache_hits,
                "queried_tokens": st.cache_queried_tokens,
                "matched_tokens": st.cache_matched_tokens,
                "cached_blocks": st.cached_blocks,
                "hit_rate": st.cache_hit_rate,
            }
            doc["engine"] = {
                "tokens_computed": st.tokens_computed,
                "tokens_sampled": st.tokens_generated,
                "forwards": st.forwards,
                "preemptions": st.preemptions,
                # Wall seconds the engine thread has spent in engine work (steps and commands:
                # prefill, KV export and import) since the instance started.
                "busy_s": round(inst.worker.busy_s, 6),
                # The longest single step and command (wall seconds): what held every stream
                # of the instance at once (logged when over a second).
                "longest_step_s": round(inst.worker.longest_step_s, 6),
                "longest_command_s": round(inst.worker.longest_command_s, 6),
            }
        return doc

    def _link_json(self, shaper: LinkShaper) -> dict[str, Any]:
        scale, speed = self.settings.kv_scale, self.settings.speedup
        declared = _declared(shaper, scale, speed)
        doc = link_json(declared) | {"connections": pool_json(shaper.pool.stats())}
        if scale != 1 or speed != 1:
            doc["wire_bandwidth_gbps"] = shaper.settings.bandwidth_gbps
            doc["kv_scale"] = scale
        if speed != 1:
            doc["speedup"] = speed
        return doc

    def kv_endpoint(self) -> dict[str, Any] | None:
        if self.intra_server is None or self.wan_server is None:
            return None
        return {
            "host": self.intra_server.host,
            "port": self.intra_server.port,
            "wan_port": self.settings.advertise_wan_port or self.wan_server.port,
        }

    async def report(self, *, link_use: bool = True) -> dict[str, Any]:
        """The state document plus what routing needs from heartbeats: where each decode
        instance's KV cache events stand (``kv_events``: epoch, last batch, digest; the blocks
        themselves go to the prefix index, kv_events.py), the KV in flight to each MD and each
        WAN link's recent use. Never calls into an engine thread."""
        doc = self.state()
        for item in doc["instances"]:
            inst = self.instances.get(item["instance_id"])
            if inst is not None and inst.kv_events is not None:
                item["kv_events"] = inst.kv_events.summary()
        self._add_incoming_blocks(doc)  # the KV in flight to each MD (incoming_prefix_blocks)
        now = time.monotonic()
        for peer, shaper in self.links.items() if link_use else ():
            granted = shaper.bytes_granted
            last = self._link_marks.get(peer)
            self._link_marks[peer] = (now, granted)
            if last is not None and now > last[0] and peer in doc["links"]:
                rate = shaper.settings.bandwidth_gbps * 1e9 / 8
                used = (granted - last[1]) / (now - last[0]) / rate if rate > 0 else 0.0
                doc["links"][peer]["utilisation"] = round(min(1.0, max(0.0, used)), 4)
        return doc

    def state(self) -> dict[str, Any]:
        fabrics = {}
        for fabric in FabricName.ALL:
            sent = self.counters.totals(fabric, Direction.SENT)
            received = self.counters.totals(fabric, Direction.RECEIVED)
            fabrics[fabric] = {
                "sent_bytes": sent.wire_bytes,
                "received_bytes": received.wire_bytes,
                "sent_payload_bytes": sent.payload_bytes,
                "received_payload_bytes": received.payload_bytes,
                "transfers": sent.transfers + received.transfers,
                "failures": sent.failures + received.failures,
            }
        return {
            "node": self.settings.node,
            "datacenter": self.settings.datacenter,
            "protocol": PROTOCOL_VERSION,
            "draining": self.draining,
            "active_requests": self.active_requests,
            "instances": [self.instance_state(i) for i in self.instances.values()],
            "tokens_by_role": dict(self.tokens_by_role),
            "late_kv_cached": self.late_kv_cached,
            # MD's streams RLD handed to a direct caller after the handoff (one hop per token).
            "handed_over": self.tails.to_json(),
            "kv_in_flight": {
                "incoming": len(self.incoming),
                "reservations": len(self.reservations),
                "prefix_hits": self.in_flight_prefix_hits,
                "recomputed_imports": self.recomputed_imports,
                "recomputed_tokens": self.recomputed_tokens,
            },
            "fabrics": fabrics,
            "links": {peer: self._link_json(s) for peer, s in self.links.items()},
            "threads": self.threads_json(),
            "engine_options": self.settings.engine_options(),
            **(
                {"control_plane": self.heartbeat_stats.to_json()}
                if self.heartbeat_stats is not None
                else {}
            ),
        }

    def threads_json(self) -> dict[str, Any]:
        """The engines' thread budget and OpenMP wait policy, and why (PROTOCOL.md)."""
        plan = self.settings.thread_plan
        if plan is not None:
            # What the process environment holds now: what OpenMP read when torch loaded.
            env = {name: os.environ.get(name) for name in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
            return plan.as_json() | {"environment": env}
        # Not started by `python -m agents serve` (an agent built in process): what this
        # process runs with, set by whoever started it.
        policy = os.environ.get("OMP_WAIT_POLICY", "").strip().lower() or "default"
        torch = sys.modules.get("torch")  # None until a real engine loaded it
        if torch is not None:
            threads = torch.get_num_threads()
        else:  # what torch will take when it loads: OMP_NUM_THREADS, else every core
            env_threads = os.environ.get("OMP_NUM_THREADS", "").strip()
            threads = int(env_threads) if env_threads.isdigit() else (os.cpu_count() or 1)
        return {
            "torch_threads": threads,
            "omp_wait_policy": policy,
            "source": "not set by the agent (started in process)",
        }


def depends_on(res: Reservation, request_id: str) -> bool:
    return res.depends_on is not None and res.depends_on.request_id == request_id


def unlock_all(engine: Engine, nodes: Sequence[Any]) -> None:
    """Unlock radix nodes (on the engine thread)."""
    for node in nodes:
        engine.cache.unlock(node)


def pool_json(stats: PoolStats) -> dict[str, Any]:
    """The WAN connection pool's queue, for operators (PROTOCOL.md, state document)."""
    return {
        "in_use": stats.in_use,
        "waiting": stats.waiting,
        "acquisitions": stats.acquisitions,
        "background_acquisitions": stats.background_acquisitions,
        "total_wait_s": round(stats.total_wait_s, 6),
    }


def _record_kv_events(kv_log: KVEventLog, engine: Engine) -> None:
    """On the engine thread, after each step and command: the cache's changes into the log."""
    events = engine.cache.drain_events()
    if events:
        kv_log.record(events)


def _declared(shaper: LinkShaper, kv_scale: float, speedup: float = 1.0) -> LinkSettings:
    """The link as declared: the shaper runs at bandwidth x speedup / kv_scale and RTT /
    speedup (Agent.set_link)."""
    return dataclasses.replace(
        shaper.settings,
        bandwidth_gbps=shaper.settings.bandwidth_gbps * kv_scale / speedup,
        rtt_ms=shaper.settings.rtt_ms * speedup,
    )


def link_json(link: LinkSettings) -> dict[str, Any]:
    return {
        "bandwidth_gbps": link.bandwidth_gbps,
        "rtt_ms": link.rtt_ms,
        "pool_size": link.pool_size,
    }
