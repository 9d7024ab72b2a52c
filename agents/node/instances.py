"""The agent's engine instances: the table by id (read-only to everyone else), each one's
lifecycle (start and load, drain, stop), the data-plane lookup that admits a request to one,
and the count of requests in flight that drain waits for."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypedDict

from agents.engine.config import DTYPE_NAMES, EngineConfig
from agents.engine.core import EngineCore as Engine
from agents.engine.emulated import EmulatedEngine
from agents.engine.interface import EMULATED, TORCH
from agents.node.errors import AgentError
from agents.node.kv_events import KVEventLog
from agents.node.settings import ROLES, AgentSettings
from agents.node.worker import EngineWorker
from pdd.hardware import GpuType
from pdd.profiles import ModelProfile, is_profile_source, load_profile
from pdd.vocab import InstanceStatus

if TYPE_CHECKING:
    from agents.engine.loader import LoadedModel

log = logging.getLogger(__name__)


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


class Instances(Mapping[str, Instance]):
    """The agent's instances by id (a read-only mapping; change it through the methods), and
    the requests in flight on them. Lives on the event loop's thread."""

    def __init__(self, settings: AgentSettings) -> None:
        self.settings = settings
        self._by_id: dict[str, Instance] = {}
        self.draining = False
        self.active_requests = 0
        self.tokens_by_role: dict[str, int] = {role: 0 for role in ROLES}
        self._models: dict[tuple[str, str], LoadedModel] = {}  # by (source, dtype)
        self._idle = asyncio.Event()
        self._idle.set()

    def __getitem__(self, instance_id: str) -> Instance:
        return self._by_id[instance_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_id)

    def __len__(self) -> int:
        return len(self._by_id)

    async def put(
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
        current = self._by_id.get(instance_id)
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
        self._by_id[instance_id] = inst
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

    async def drain_one(self, instance_id: str) -> Instance:
        inst = self._by_id.get(instance_id)
        if inst is None or inst.state == InstanceStatus.STOPPED:
            raise AgentError(404, f"no instance {instance_id}")
        if inst.state in (InstanceStatus.RUNNING, InstanceStatus.STARTING):
            inst.state = InstanceStatus.DRAINING
        self._check_drained(inst)
        return inst

    async def delete(self, instance_id: str) -> None:
        inst = self._by_id.pop(instance_id, None)
        if inst is not None:
            await self._stop(inst)

    async def stop_all(self) -> None:
        """Stop every instance (the agent is closing)."""
        for inst in list(self._by_id.values()):
            await self._stop(inst)

    async def _stop(self, inst: Instance) -> None:
        inst.state = InstanceStatus.STOPPED
        inst.ready.set()
        if inst.worker is not None:
            inst.worker.stop()
            await asyncio.to_thread(inst.worker.join, 10.0)
            inst.worker = None

    def _check_drained(self, inst: Instance) -> None:
        if inst.state == InstanceStatus.DRAINING and inst.active == 0:
            inst.state = InstanceStatus.DRAINED

    def for_request(self, instance_id: str | None, role: str | None) -> Instance:
        """The instance a data-plane request names (or the only one of `role`), admitting."""
        inst: Instance | None
        if instance_id is None:
            matches = [i for i in self._by_id.values() if role is None or i.role == role]
            if len(matches) != 1:
                raise AgentError(
                    400,
                    f"instance: required when this agent has {len(matches)} "
                    f"{role or 'any'} instances",
                    "instance",
                )
            inst = matches[0]
        else:
            inst = self._by_id.get(instance_id)
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

    # -- requests in flight (drain waits for these) -----------------------------------------

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
        for inst in self._by_id.values():
            if inst.state in (InstanceStatus.RUNNING, InstanceStatus.STARTING):
                inst.state = InstanceStatus.DRAINING
            self._check_drained(inst)
        try:
            async with asyncio.timeout(grace_s):  # never swallows a cancel (get_within)
                await self._idle.wait()
            return True
        except TimeoutError:
            return False


def _record_kv_events(kv_log: KVEventLog, engine: Engine) -> None:
    """On the engine thread, after each step and command: the cache's changes into the log."""
    events = engine.cache.drain_events()
    if events:
        kv_log.record(events)
