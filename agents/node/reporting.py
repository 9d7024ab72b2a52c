"""The agent's state document (agents/PROTOCOL.md, `GET /state`) and the heartbeat's body:
each instance's state, load, cache and engine figures, the fabrics and links, the KV in
flight and the thread budget. Reads the other parts; never calls into an engine thread."""

from __future__ import annotations

import os
import sys
from typing import Any

from agents.engine.interface import EMULATED
from agents.node.instances import Instance, Instances
from agents.node.kv_flight import KvInFlight
from agents.node.links import Links
from agents.node.settings import AgentSettings
from agents.node.tail import Tails
from pdd import looplag
from pdd.kv_formats import PROFILE_KV_DTYPE

PROTOCOL_VERSION = 1


class Reporting:
    """What the agent reports of itself, from its parts."""

    def __init__(
        self,
        settings: AgentSettings,
        instances: Instances,
        links: Links,
        kv_flight: KvInFlight,
        tails: Tails,
    ) -> None:
        self.settings = settings
        self.instances, self.links, self.kv_flight, self.tails = instances, links, kv_flight, tails
        # Set by the control-plane link (agents/node/control.py) when the agent has one.
        self.heartbeat_stats: Any = None

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
            "kv_endpoint": self.links.kv_endpoint(),
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
                # What the KV is held in: what a WAN link's transport format is relative to.
                "dtype": getattr(inst.worker.engine.pool, "dtype_name", None) or PROFILE_KV_DTYPE,
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
            if item.get("role") == "main_decode":  # the KV in flight to each MD
                item["incoming_prefix_blocks"] = self.kv_flight.incoming_block_hashes(
                    item["instance_id"]
                )
        if link_use:
            self.links.add_utilisation(doc["links"])
        return doc

    def state(self) -> dict[str, Any]:
        return {
            "node": self.settings.node,
            "datacenter": self.settings.datacenter,
            "protocol": PROTOCOL_VERSION,
            "draining": self.instances.draining,
            "active_requests": self.instances.active_requests,
            "instances": [self.instance_state(i) for i in self.instances.values()],
            "tokens_by_role": dict(self.instances.tokens_by_role),
            # The most this agent's event loop ran late over the last 10 s and 60 s.
            "loop_late_s": {
                "10s": round(looplag.recent_s(10.0), 3),
                "60s": round(looplag.recent_s(60.0), 3),
            },
            "late_kv_cached": self.kv_flight.late_kv_cached,
            # MD's streams RLD handed to a direct caller after the handoff (one hop per token).
            "handed_over": self.tails.to_json(),
            "kv_in_flight": self.kv_flight.to_json(),
            "fabrics": self.links.fabrics_json(),
            "links": self.links.to_json(),
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
