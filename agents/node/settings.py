"""Agent settings from flags and an optional JSON config file (flags win), the link spec
`PEER_DC=GBPS:RTT_MS[:POOL]`, and the engine's thread budget and OpenMP wait policy.

Imports no torch: `python -m agents serve` resolves the thread plan and sets OMP_NUM_THREADS /
OMP_WAIT_POLICY from here before anything loads torch (OpenMP reads them once, at load)."""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from agents.transfer.shaping import LinkSettings
from pdd.checks import check_number
from pdd.dataplane import check_data_token
from pdd.hardware import unit_from_json
from pdd.vocab import Role

ROLES = tuple(Role)
WAIT_POLICIES = ("auto", "passive", "active")
# The engine options an agent passes to every engine it starts (agents.engine.EngineConfig).
DTYPES = ("float32", "bfloat16", "float16")
DECODE_WEIGHTS = ("full", "int8", "stream")
# Fields a config file may not set (worked out by the agent itself).
_DERIVED = frozenset({"thread_plan"})


@dataclass(slots=True)
class AgentSettings:
    """Everything one agent process is started with."""

    listen: str = "127.0.0.1:9100"
    datacenter: str = "dc-a"
    node: str | None = None
    role: str | None = None  # standalone: start instance "0" with this role
    model: str = "baton-tiny"  # standalone instance's source: "baton-tiny" or a checkpoint folder
    kv_listen: str = "127.0.0.1:0"  # intra-DC fabric server; the WAN server binds the same host
    wan_port: int = 0
    links: dict[str, LinkSettings] = field(default_factory=dict)
    control_plane: str | None = None
    token: str | None = None
    # Fleet-wide data-plane token: when set, the data endpoints (/v1/generate, /v1/pdd/*)
    # require "Authorization: Bearer <it>" and this agent sends it to its peers. A control
    # plane with BATON_DATA_TOKEN hands it out at registration as well.
    data_token: str | None = None
    advertise_url: str | None = None
    # The WAN fabric port peers in other datacenters reach (behind NAT, a port forward or a
    # proxy); None: the port the WAN server bound.
    advertise_wan_port: int | None = None
    heartbeat_interval_s: float = 2.0
    drain_grace_s: float = 30.0
    # torch / OpenMP threads of this agent's engines; None: the host's cores // agents_per_host
    # (resolve_thread_plan, which `python -m agents serve` runs before torch loads).
    threads: int | None = None
    agents_per_host: int = 1  # agents sharing this host's cores (the thread default divides)
    omp_wait_policy: str = "auto"  # auto, passive or active (resolve_thread_plan)
    # Where this agent's engines run: "cpu", "cuda" or "cuda:N"; None = $BATON_ENGINE_DEVICE,
    # else the CPU (agents.engine.EngineConfig.device).
    device: str | None = None
    # The engines' weights and KV dtype, and the weights decode steps multiply by: "full" (the
    # model's own) or "int8" (weight-only int8 copies, CPU only). Defaults: float32 / full;
    # speed and agreement with float32 are in bench/engine/REPORT.md.
    dtype: str = "float32"
    decode_weights: str = "full"
    # Decode steps through torch.compile (EngineConfig.decode_compile): needs a C++ compiler and
    # tens of seconds of compiling on an instance's first steps; pays at larger batches
    # (bench/engine/REPORT.md). Off by default.
    decode_compile: bool = False
    # Engine capacity of every instance this agent starts.
    num_blocks: int = 1024
    block_size: int = 16
    max_running: int = 32
    max_queued: int = 256
    # New tokens one forward may process (the chunked prefill's chunk; EngineConfig's default).
    max_batch_tokens: int = 2048
    seed: int = 0
    # Emulated instances (a served model whose source is "profile:..."): KV bytes on the wire are
    # the profile's real bytes / kv_scale, and this agent's WAN links are shaped to their
    # declared bandwidth / kv_scale, so transfers take the real link's time with 1/kv_scale of
    # the bytes (an agent with kv_scale > 1 hosts emulated instances only). speedup divides
    # every modelled step time (1: real time). docs/emulation.md.
    kv_scale: float = 1.0
    speedup: float = 1.0
    # Standalone (--role): the GPU unit instance "0" runs on, as a start command's "gpu" object
    # ({"name", "count", "peak_bf16_tflops", "memory_gib", "memory_bandwidth_gbps",
    # "interconnect_gbps"}); required when --model is a profile.
    gpu: dict[str, Any] | None = None
    # Pipeline timeouts.
    kv_timeout_s: float = 120.0  # a decode side waits this long for P's KV
    # RLD waits for MD to acknowledge the final handoff (MD's first token after it) at most
    # handoff_ack_floor_s + 4 x the link's RTT, and never more than handoff_timeout_s: MD was
    # ready (a decode slot held) before the batch left, so a late answer means a dead MD or a
    # black-holed link, and RLD finishes the request itself after a stall of ~2 s, not 30.
    handoff_timeout_s: float = 30.0
    handoff_ack_floor_s: float = 1.5
    reserve_ttl_s: float = 120.0  # an unused DRC reservation is dropped after this
    # P waits this long for MD's reservation (the prefix pin, a small HTTP call running while P
    # prefills). A frozen MD or a black-holed link then costs p-rld-md this much TTFT (RLD
    # decodes alone) and makes p-md fail over at the gateway, instead of a 10 s wait.
    reserve_timeout_s: float = 3.0
    # MD keeps decoding a request RLD handed over to a direct caller (one hop per token) this
    # long without a reader: RLD's held stream left and the caller's attach is on its way. An
    # ended one is kept as long for an attach still coming.
    handoff_attach_s: float = 10.0
    # Streamed export (P): MD's delta leaves in pieces of at least this many tokens as prefill
    # computes them, so its transfer overlaps the prefill; the rest of the prompt goes when
    # prefill ends. 0 (the default): the whole delta is sent after prefill. docs/agents.md.
    kv_stream_tokens: int = 0
    # P's stream sends a ``queued`` event this often while a request waits in its engine's
    # queue for its first token: the gateway's first-token timeout then measures silence (a
    # frozen P), not the queue (a busy one).
    queued_every_s: float = 5.0
    # What the agent resolved and applied before torch loaded (the state document's "threads").
    thread_plan: ThreadPlan | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        split_host_port(self.listen, "listen")
        split_host_port(self.kv_listen, "kv_listen")
        if self.role is not None and self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if (self.control_plane is None) != (self.token is None):
            raise ValueError(
                "--control-plane and the node's agent token go together (--token-file, "
                "$BATON_AGENT_TOKEN_FILE or $BATON_AGENT_TOKEN)"
            )
        if self.data_token is not None:
            check_data_token(self.data_token, "data_token")
        for name in (
            "heartbeat_interval_s",
            "kv_timeout_s",
            "handoff_timeout_s",
            "handoff_ack_floor_s",
            "reserve_ttl_s",
            "reserve_timeout_s",
            "handoff_attach_s",
            "queued_every_s",
        ):
            check_number(getattr(self, name), name, gt=0)
        check_number(self.kv_scale, "kv_scale", ge=1)
        if not isinstance(self.kv_stream_tokens, int) or self.kv_stream_tokens < 0:
            raise ValueError(
                f"kv_stream_tokens must be an integer >= 0, got {self.kv_stream_tokens!r}"
            )
        if self.gpu is not None:
            unit_from_json(self.gpu)
        check_number(self.speedup, "speedup", gt=0)
        if self.drain_grace_s < 0:
            raise ValueError(f"drain_grace_s must be >= 0, got {self.drain_grace_s}")
        if self.device is not None:
            check_device(self.device)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {'|'.join(DTYPES)}, got {self.dtype!r}")
        if self.decode_weights not in DECODE_WEIGHTS:
            raise ValueError(
                f"decode_weights must be one of {'|'.join(DECODE_WEIGHTS)}, "
                f"got {self.decode_weights!r}"
            )
        if not isinstance(self.decode_compile, bool):
            raise ValueError(f"decode_compile must be true or false, got {self.decode_compile!r}")
        if self.decode_compile and self.engine_device() != "cpu":
            raise ValueError(
                f"decode_compile runs on the CPU only, not device {self.engine_device()!r}"
            )
        if self.decode_compile and self.decode_weights != "full":
            raise ValueError(
                "decode_compile runs with the model's own weights (decode_weights full)"
            )
        if self.decode_weights != "full" and self.engine_device() != "cpu":
            raise ValueError(
                f"decode_weights {self.decode_weights} runs on the CPU only, not device "
                f"{self.engine_device()!r}"
            )
        if self.omp_wait_policy not in WAIT_POLICIES:
            raise ValueError(
                f"omp_wait_policy must be one of {'|'.join(WAIT_POLICIES)}, "
                f"got {self.omp_wait_policy!r}"
            )
        if self.advertise_wan_port is not None and (
            isinstance(self.advertise_wan_port, bool)
            or not isinstance(self.advertise_wan_port, int)
            or not 1 <= self.advertise_wan_port <= 65535
        ):
            raise ValueError(
                f"advertise_wan_port must be a port 1-65535, got {self.advertise_wan_port!r}"
            )
        for name in (
            "threads",
            "agents_per_host",
            "num_blocks",
            "block_size",
            "max_running",
            "max_batch_tokens",
        ):
            value = getattr(self, name)
            if value is None and name == "threads":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")

    def engine_device(self) -> str:
        """Where the engines run: --device, else $BATON_ENGINE_DEVICE, else the CPU (the
        base name: "cuda:1" -> "cuda")."""
        name = self.device or os.environ.get("BATON_ENGINE_DEVICE", "").strip() or "cpu"
        return name.partition(":")[0]

    def engine_options(self) -> dict[str, Any]:
        """The engine options every instance of this agent runs with (state document, /health
        and the pdd_engine_info metric)."""
        device = self.device or os.environ.get("BATON_ENGINE_DEVICE", "").strip() or "cpu"
        options: dict[str, Any] = {
            "device": device,
            "dtype": self.dtype,
            "decode_weights": self.decode_weights,
        }
        if self.decode_compile:  # named only when on: the default document is unchanged
            options["decode_compile"] = True
        if self.kv_scale != 1:
            options["kv_scale"] = self.kv_scale
        if self.speedup != 1:
            options["speedup"] = self.speedup
        return options


_DEVICE = re.compile(r"(cpu|cuda)(:\d+)?")


def check_device(name: str) -> str:
    """The device name: cpu, cuda or cuda:N, checked without torch (the engine makes the
    torch.device with agents.engine.config.parse_device when it starts)."""
    if not isinstance(name, str) or not _DEVICE.fullmatch(name):
        raise ValueError(f"EngineConfig.device must be cpu, cuda or cuda:N, got {name!r}")
    return name


# -- threads and the OpenMP wait policy ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ThreadPlan:
    """How many torch threads this agent's engines use and how OpenMP's idle threads wait:
    `passive` (sleep at once) where cores are shared, `active` (spin) on dedicated ones."""

    torch_threads: int
    omp_wait_policy: str  # "passive" or "active"
    source: str  # why that wait policy, e.g. "auto: 3 agents share 2 cores"
    threads_source: str  # where torch_threads came from, e.g. "default: 2 cores // 3 agents"
    cores: int
    agents_per_host: int
    # Whether apply_thread_plan ran before torch was imported (else OpenMP missed the env).
    set_before_torch: bool | None = None

    def env(self) -> dict[str, str]:
        """What the process's environment must hold before torch loads."""
        return {
            "OMP_NUM_THREADS": str(self.torch_threads),
            "OMP_WAIT_POLICY": self.omp_wait_policy.upper(),
        }

    def as_json(self) -> dict[str, Any]:
        return {
            "torch_threads": self.torch_threads,
            "omp_wait_policy": self.omp_wait_policy,
            "source": self.source,
            "threads_source": self.threads_source,
            "cores": self.cores,
            "agents_per_host": self.agents_per_host,
            "set_before_torch": self.set_before_torch,
        }

    def line(self) -> str:
        return (
            f"agent threads: {self.torch_threads} torch thread(s) ({self.threads_source}), "
            f"OMP_WAIT_POLICY={self.omp_wait_policy.upper()} ({self.source})"
        )


def host_cores() -> int:
    """The cores this process may run on (its CPU affinity, e.g. a container's cpuset)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _positive_int(value: Any, where: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{where} must be an integer >= 1, got {value!r}")
    if isinstance(value, str):
        text = value.strip()
        if not text.isdigit():
            raise ValueError(f"{where} must be an integer >= 1, got {value!r}")
        value = int(text)
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{where} must be an integer >= 1, got {value!r}")
    return value


# setting -> (its flag, its env var)
_THREAD_INPUTS = {
    "agents_per_host": ("--agents-per-host", "BATON_AGENTS_PER_HOST"),
    "threads": ("--threads", "BATON_AGENT_THREADS"),
    "omp_wait_policy": ("--omp-wait-policy", "BATON_OMP_WAIT_POLICY"),
}


def _pick(
    name: str, flags: Mapping[str, Any], config: Mapping[str, Any], environ: Mapping[str, str]
) -> tuple[Any, str] | None:
    """(value, where it came from) for one setting: its flag, else its env var, else the
    config file; None when none of them sets it."""
    flag, env_name = _THREAD_INPUTS[name]
    if flags.get(name) is not None:
        return flags[name], flag
    if environ.get(env_name, "").strip():
        return environ[env_name].strip(), env_name
    if config.get(name) is not None:
        return config[name], f"config {name}"
    return None


def resolve_thread_plan(
    flags: Mapping[str, Any],
    config: Mapping[str, Any],
    environ: Mapping[str, str],
    cores: int,
) -> ThreadPlan:
    """The agent's thread budget and OpenMP wait policy (pure: reads and sets no globals).

    Each of `threads`, `agents_per_host`, `omp_wait_policy` comes from its flag, else its env
    var (BATON_AGENT_THREADS, BATON_AGENTS_PER_HOST, BATON_OMP_WAIT_POLICY), else the config
    file, else the default: agents_per_host 1, threads max(1, cores // agents_per_host), wait
    policy auto. auto: an OMP_WAIT_POLICY already in the environment wins; otherwise passive
    when cores are shared (agents_per_host > 1, threads x agents_per_host > cores, or $CI is
    set), else active. Raises ValueError with a one-line message naming the bad input."""
    cores = max(1, int(cores))
    picked = _pick("agents_per_host", flags, config, environ)
    agents = _positive_int(*picked) if picked else 1
    picked = _pick("threads", flags, config, environ)
    if picked:
        threads = _positive_int(*picked)
        threads_source = f"{picked[1]} = {threads}"
    else:
        threads = max(1, cores // agents)
        threads_source = f"default: {_n(cores, 'core')} // {_n(agents, 'agent')}"

    def plan(policy: str, source: str) -> ThreadPlan:
        return ThreadPlan(threads, policy, source, threads_source, cores, agents)

    picked = _pick("omp_wait_policy", flags, config, environ)
    if picked:
        value, where = picked
        requested = str(value).strip().lower()
        if requested not in WAIT_POLICIES:
            raise ValueError(f"{where} must be one of {'|'.join(WAIT_POLICIES)}, got {value!r}")
        if requested != "auto":
            return plan(requested, f"{where} = {requested}")
    explicit = environ.get("OMP_WAIT_POLICY", "").strip()
    if explicit:
        if explicit.lower() not in ("passive", "active"):
            raise ValueError(f"OMP_WAIT_POLICY must be PASSIVE or ACTIVE, got {explicit!r}")
        return plan(explicit.lower(), f"environment: OMP_WAIT_POLICY={explicit}")
    if agents > 1:
        return plan("passive", f"auto: {agents} agents share {_n(cores, 'core')}")
    if threads * agents > cores:
        return plan("passive", f"auto: {_n(threads, 'thread')} > {_n(cores, 'core')}")
    if environ.get("CI", "").strip():
        return plan("passive", "auto: CI is set (a shared runner)")
    return plan("active", f"auto: 1 agent, {threads} of {_n(cores, 'core')}, not shared")


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def apply_thread_plan(plan: ThreadPlan, environ: dict[str, str] | None = None) -> ThreadPlan:
    """Put the plan's OMP_NUM_THREADS / OMP_WAIT_POLICY into the environment (os.environ by
    default). Must run before torch is imported: OpenMP reads them once, when torch loads it.
    Returns the plan with `set_before_torch` saying whether that held."""
    target = os.environ if environ is None else environ
    before = "torch" not in sys.modules
    target.update(plan.env())
    return ThreadPlan(
        plan.torch_threads,
        plan.omp_wait_policy,
        plan.source,
        plan.threads_source,
        plan.cores,
        plan.agents_per_host,
        before,
    )


def split_host_port(value: str, name: str = "address") -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{name} must be HOST:PORT, got {value!r}")
    return host, int(port)


def parse_link(spec: str) -> tuple[str, LinkSettings]:
    """`dc-b=20:30:16` -> ("dc-b", 20 Gbit/s, 30 ms RTT, pool 16); the pool defaults to 16."""
    peer, sep, rest = spec.partition("=")
    parts = rest.split(":")
    if not sep or not peer or len(parts) not in (2, 3):
        raise ValueError(f"link must be PEER_DC=GBPS:RTT_MS[:POOL], got {spec!r}")
    try:
        gbps, rtt = float(parts[0]), float(parts[1])
        pool = int(parts[2]) if len(parts) == 3 else 16
    except ValueError:
        raise ValueError(f"link must be PEER_DC=GBPS:RTT_MS[:POOL], got {spec!r}") from None
    return peer, LinkSettings(bandwidth_gbps=gbps, rtt_ms=rtt, pool_size=pool)


def link_from_json(body: Any) -> LinkSettings:
    """A link from {"bandwidth_gbps", "rtt_ms", "pool_size"}; raises ValueError naming the field."""
    if not isinstance(body, dict):
        raise ValueError("body: must be a JSON object")
    values: dict[str, Any] = {}
    for name, kind in (("bandwidth_gbps", float), ("rtt_ms", float), ("pool_size", int)):
        value = body.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{name}: required number")
        if kind is int and value != int(value):
            raise ValueError(f"{name}: must be an integer")
        values[name] = kind(value)
    try:
        return LinkSettings(**values)
    except ValueError as exc:
        raise ValueError(str(exc)) from None


def read_config(config_path: str | None) -> dict[str, Any]:
    """The JSON config file's object (keys as AgentSettings' fields); {} without a file."""
    if not config_path:
        return {}
    raw = json.loads(Path(config_path).read_text())
    if not isinstance(raw, dict):
        raise ValueError(f"{config_path}: must hold a JSON object")
    known = {f.name for f in fields(AgentSettings)} - _DERIVED
    unknown = set(raw) - known
    if unknown:
        raise ValueError(f"{config_path}: unknown keys {sorted(unknown)}")
    return raw


def load_settings(config_path: str | None, overrides: dict[str, Any]) -> AgentSettings:
    """Settings from a JSON file (keys as the dataclass fields, "links" as {peer: {...}} or
    ["peer=g:r:p"]) with the non-None `overrides` (the flags) on top."""
    values: dict[str, Any] = dict(read_config(config_path))
    links = _links(values.pop("links", {}))
    flag_links = overrides.pop("links", None) or []
    links.update(_links(flag_links))
    values.update({k: v for k, v in overrides.items() if v is not None})
    speedup = float(values.get("speedup", 1.0) or 1.0)
    if 0 < speedup < 1:
        # Slow motion: the protocol's timeouts are modelled seconds too, stretched as the
        # engines and links are (a KV transfer 8x slower must not time out 8x sooner).
        defaults = {f.name: f.default for f in fields(AgentSettings)}
        for name in SLOW_MOTION_TIMEOUTS:
            values[name] = float(values.get(name, defaults[name])) / speedup
    return AgentSettings(links=links, **values)


# Timeouts that --speedup below 1 stretches by 1 / speedup (load_settings).
SLOW_MOTION_TIMEOUTS = (
    "kv_timeout_s",
    "handoff_timeout_s",
    "handoff_ack_floor_s",
    "reserve_ttl_s",
    "reserve_timeout_s",
    "handoff_attach_s",
)


def _links(raw: Any) -> dict[str, LinkSettings]:
    if isinstance(raw, dict):
        return {peer: link_from_json(body) for peer, body in raw.items()}
    return dict(parse_link(spec) for spec in raw)
