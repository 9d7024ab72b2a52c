"""Prometheus families computed from an agent's state document (agents/PROTOCOL.md).

Shared by the agent's own ``GET /metrics`` (rendered here as text, so agents need no metrics
library) and the control plane's ``/metrics`` (which reads the same documents from the nodes'
heartbeats and wraps the samples in prometheus_client families), so it lives in ``pdd``, which
both import. Pure Python: no Django, no torch.

Per-instance families carry vLLM's names where the figure is the one vLLM reports
(``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc``, ``vllm:prefix_cache_hits`` ...),
labelled ``model_name`` (vLLM's label), ``instance`` (the Baton instance id), ``role``,
``datacenter``, ``node`` and ``engine`` (``torch`` or ``emulated``: an emulated instance is
never passed off as a real one). Node-wide figures (fabric bytes, tokens by role, the WAN pools)
are ``pdd_*`` and labelled ``node`` and ``datacenter``. docs/metrics.md lists them all.
Counter names here have no ``_total``: the renderers add it, as prometheus_client does.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

# ``engine``: "torch" (the real engine) or "emulated" (a model profile on modelled hardware).
INSTANCE_LABELS = ("model_name", "instance", "role", "datacenter", "node", "engine")
NODE_LABELS = ("node", "datacenter")


@dataclass(slots=True)
class Family:
    """One metric family: its name (a counter's without ``_total``), kind, help and samples."""

    name: str
    kind: str  # "gauge" or "counter"
    doc: str
    labels: tuple[str, ...]
    samples: list[tuple[tuple[str, ...], float]] = field(default_factory=list)


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _ratio(used: Any, total: Any) -> float | None:
    u, t = _num(used), _num(total)
    return u / t if u is not None and t else None


def _kv_usage(inst: Mapping[str, Any]) -> float | None:
    kv = inst.get("kv") or {}
    return _ratio(kv.get("used_blocks"), kv.get("total_blocks"))


# (name, kind, help, how to read it from an instance's entry in the state document)
INSTANCE_FIGURES: tuple[tuple[str, str, str, Any], ...] = (
    (
        "vllm:num_requests_running",
        "gauge",
        "Requests in the engine's running batch (the instance's load.running).",
        lambda i: (i.get("load") or {}).get("running"),
    ),
    (
        "vllm:num_requests_waiting",
        "gauge",
        "Requests queued for the engine, not yet running (load.queued).",
        lambda i: (i.get("load") or {}).get("queued"),
    ),
    (
        "vllm:kv_cache_usage_perc",
        "gauge",
        "KV-cache usage, 0..1: KV blocks in use / KV blocks of the instance.",
        _kv_usage,
    ),
    (
        "vllm:gpu_cache_usage_perc",
        "gauge",
        "The same KV-cache usage under vLLM's older name (before v0.10).",
        _kv_usage,
    ),
    (
        "pdd_kv_blocks_used",
        "gauge",
        "KV blocks in use on the instance.",
        lambda i: (i.get("kv") or {}).get("used_blocks"),
    ),
    (
        "pdd_kv_blocks_capacity",
        "gauge",
        "KV blocks the instance has.",
        lambda i: (i.get("kv") or {}).get("total_blocks"),
    ),
    (
        "pdd_instance_running",
        "gauge",
        "1 while the instance reports state running, else 0.",
        lambda i: 1.0 if i.get("state") == "running" else 0.0,
    ),
    (
        "vllm:prefix_cache_queries",
        "counter",
        "Prompt tokens looked up in the instance's prefix cache (cache.queried_tokens).",
        lambda i: (i.get("cache") or {}).get("queried_tokens"),
    ),
    (
        "vllm:prefix_cache_hits",
        "counter",
        "Prompt tokens found in the instance's prefix cache (cache.matched_tokens).",
        lambda i: (i.get("cache") or {}).get("matched_tokens"),
    ),
    (
        "vllm:generation_tokens",
        "counter",
        "Output tokens the instance produced in its role (P: first tokens; RLD: before the "
        "handoff; MD: after it).",
        lambda i: i.get("tokens_generated"),
    ),
    (
        "vllm:num_preemptions",
        "counter",
        "Requests the instance's scheduler preempted (engine.preemptions).",
        lambda i: (i.get("engine") or {}).get("preemptions"),
    ),
    (
        "pdd_engine_tokens_computed",
        "counter",
        "Tokens the instance's engine ran forward passes over (prefill and decode).",
        lambda i: (i.get("engine") or {}).get("tokens_computed"),
    ),
)


def instance_families(nodes: Iterable[tuple[str, str, Mapping[str, Any]]]) -> list[Family]:
    """Per-instance families from (node, datacenter, state document) triples."""
    families = [Family(n, k, d, INSTANCE_LABELS) for n, k, d, _ in INSTANCE_FIGURES]
    for node, datacenter, doc in nodes:
        for inst in doc.get("instances") or ():
            labels = (
                str(inst.get("model") or ""),
                str(inst.get("instance_id") or ""),
                str(inst.get("role") or ""),
                datacenter,
                node,
                str(inst.get("engine_kind") or "torch"),
            )
            for family, (_n, _k, _d, read) in zip(families, INSTANCE_FIGURES, strict=True):
                value = _num(read(inst))
                if value is not None:
                    family.samples.append((labels, value))
    return families


def node_families(nodes: Iterable[tuple[str, str, Mapping[str, Any]]]) -> list[Family]:
    """Node-wide families (fabrics, tokens by role, KV in flight, WAN pools)."""
    tokens = Family(
        "pdd_agent_generation_tokens",
        "counter",
        "Output tokens the node's instances produced, by role (tokens_by_role).",
        (*NODE_LABELS, "role"),
    )
    fabric_bytes = Family(
        "pdd_fabric_bytes",
        "counter",
        "Bytes over the node's KV fabrics, by fabric (wan, intra_dc), direction (sent, "
        "received) and kind (wire: frames as sent; payload: KV and token ids).",
        (*NODE_LABELS, "fabric", "direction", "kind"),
    )
    transfers = Family(
        "pdd_fabric_transfers",
        "counter",
        "Transfers over the node's KV fabrics, sent and received.",
        (*NODE_LABELS, "fabric"),
    )
    failures = Family(
        "pdd_fabric_failures",
        "counter",
        "Transfers over the node's KV fabrics that failed.",
        (*NODE_LABELS, "fabric"),
    )
    active = Family(
        "pdd_agent_active_requests",
        "gauge",
        "Requests the agent is serving now, all instances.",
        NODE_LABELS,
    )
    in_flight = Family(
        "pdd_kv_in_flight",
        "gauge",
        "MD: requests whose KV is reserved here and not imported yet (incoming), and DRC "
        "reservations held (reservations).",
        (*NODE_LABELS, "kind"),
    )
    pools = Family(
        "pdd_wan_connections",
        "gauge",
        "The node's WAN connection pool towards each peer datacenter: slots in use, waiters.",
        (*NODE_LABELS, "peer", "state"),
    )
    # An info metric (value 1): the engine options every instance of the node runs with.
    engine = Family(
        "pdd_engine_info",
        "gauge",
        "1, labelled with the engine options of the node's instances: device, dtype and "
        "decode_weights (full or int8).",
        (*NODE_LABELS, "device", "dtype", "decode_weights"),
    )
    for node, datacenter, doc in nodes:
        base = (node, datacenter)
        options = doc.get("engine_options")
        if isinstance(options, Mapping):
            labels = tuple(str(options.get(k) or "") for k in ("device", "dtype", "decode_weights"))
            engine.samples.append(((*base, *labels), 1.0))
        for role, n in sorted((doc.get("tokens_by_role") or {}).items()):
            if _num(n) is not None:
                tokens.samples.append(((*base, str(role)), float(n)))
        for fabric, f in sorted((doc.get("fabrics") or {}).items()):
            for direction in ("sent", "received"):
                for kind, key in (("wire", "bytes"), ("payload", "payload_bytes")):
                    value = _num(f.get(f"{direction}_{key}"))
                    if value is not None:
                        fabric_bytes.samples.append(((*base, fabric, direction, kind), value))
            for family, key in ((transfers, "transfers"), (failures, "failures")):
                value = _num(f.get(key))
                if value is not None:
                    family.samples.append(((*base, fabric), value))
        value = _num(doc.get("active_requests"))
        if value is not None:
            active.samples.append((base, value))
        for kind in ("incoming", "reservations"):
            value = _num((doc.get("kv_in_flight") or {}).get(kind))
            if value is not None:
                in_flight.samples.append(((*base, kind), value))
        for peer, link in sorted((doc.get("links") or {}).items()):
            conns = (link or {}).get("connections") or {}
            for state in ("in_use", "waiting"):
                value = _num(conns.get(state))
                if value is not None:
                    pools.samples.append(((*base, str(peer), state), value))
    return [tokens, fabric_bytes, transfers, failures, active, in_flight, pools, engine]


def state_families(doc: Mapping[str, Any]) -> list[Family]:
    """Every family of one agent, from its own state document."""
    node = [(str(doc.get("node") or ""), str(doc.get("datacenter") or ""), doc)]
    return instance_families(node) + node_families(node)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


# repr's spelling of the values Prometheus spells otherwise.
_SPECIAL = {"nan": "NaN", "inf": "+Inf", "-inf": "-Inf"}


def render(families: Iterable[Family]) -> str:
    """Prometheus text exposition format 0.0.4 (``text/plain; version=0.0.4``).

    Each distinct label set is spelled once per render: an instance's six labels recur in
    every per-instance family (~30 of them), and at a thousand nodes spelling them per sample
    was most of /metrics' render time."""
    lines: list[str] = []
    spelled: dict[tuple[tuple[str, ...], tuple[str, ...]], str] = {}
    escaped: dict[str, str] = {}  # a node's name and datacenter recur in every node family
    for family in families:
        name = family.name + ("_total" if family.kind == "counter" else "")
        doc = family.doc.replace("\\", "\\\\").replace("\n", "\\n")
        lines.append(f"# HELP {name} {doc}")
        lines.append(f"# TYPE {name} {family.kind}")
        names = family.labels
        for labels, value in family.samples:
            key = (names, labels)
            pairs = spelled.get(key)
            if pairs is None:
                parts = []
                for k, v in zip(names, labels, strict=True):
                    quoted = escaped.get(v)
                    if quoted is None:
                        quoted = escaped[v] = _escape(v)
                    parts.append(f'{k}="{quoted}"')
                pairs = spelled[key] = ",".join(parts)
            text = repr(float(value))
            text = _SPECIAL.get(text, text)
            lines.append(f"{name}{{{pairs}}} {text}" if pairs else f"{name} {text}")
    return "\n".join(lines) + "\n"


CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
