"""Agent settings from flags and an optional JSON config file (flags win), and the link spec
`PEER_DC=GBPS:RTT_MS[:POOL]`."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from agents.dataplane import check_data_token
from agents.engine.config import parse_device
from agents.transfer.shaping import LinkSettings

ROLES = ("prefill", "relay_decode", "main_decode")


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
    heartbeat_interval_s: float = 2.0
    drain_grace_s: float = 30.0
    threads: int = 1
    # Where this agent's engines run: "cpu", "cuda" or "cuda:N"; None = $BATON_ENGINE_DEVICE,
    # else the CPU (agents.engine.EngineConfig.device).
    device: str | None = None
    # Engine capacity of every instance this agent starts.
    num_blocks: int = 1024
    block_size: int = 16
    max_running: int = 32
    max_queued: int = 256
    seed: int = 0
    # Pipeline timeouts.
    kv_timeout_s: float = 120.0  # a decode side waits this long for P's KV
    handoff_timeout_s: float = 30.0  # RLD waits this long for MD to acknowledge the final handoff
    reserve_ttl_s: float = 120.0  # an unused DRC reservation is dropped after this

    def __post_init__(self) -> None:
        split_host_port(self.listen, "listen")
        split_host_port(self.kv_listen, "kv_listen")
        if self.role is not None and self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if (self.control_plane is None) != (self.token is None):
            raise ValueError("--control-plane and --token go together")
        if self.data_token is not None:
            check_data_token(self.data_token, "data_token")
        for name in ("heartbeat_interval_s", "kv_timeout_s", "handoff_timeout_s", "reserve_ttl_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.drain_grace_s < 0:
            raise ValueError(f"drain_grace_s must be >= 0, got {self.drain_grace_s}")
        if self.device is not None:
            parse_device(self.device)
        for name in ("threads", "num_blocks", "block_size", "max_running"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


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


def load_settings(config_path: str | None, overrides: dict[str, Any]) -> AgentSettings:
    """Settings from a JSON file (keys as the dataclass fields, "links" as {peer: {...}} or
    ["peer=g:r:p"]) with the non-None `overrides` (the flags) on top."""
    values: dict[str, Any] = {}
    if config_path:
        raw = json.loads(Path(config_path).read_text())
        if not isinstance(raw, dict):
            raise ValueError(f"{config_path}: must hold a JSON object")
        known = {f.name for f in fields(AgentSettings)}
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"{config_path}: unknown keys {sorted(unknown)}")
        values.update(raw)
    links = _links(values.pop("links", {}))
    flag_links = overrides.pop("links", None) or []
    links.update(_links(flag_links))
    values.update({k: v for k, v in overrides.items() if v is not None})
    return AgentSettings(links=links, **values)


def _links(raw: Any) -> dict[str, LinkSettings]:
    if isinstance(raw, dict):
        return {peer: link_from_json(body) for peer, body in raw.items()}
    return dict(parse_link(spec) for spec in raw)
