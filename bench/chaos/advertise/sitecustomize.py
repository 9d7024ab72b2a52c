"""Put on the PYTHONPATH of one agent process by the testbed's `wan_proxy=True` (never
imported otherwise): with $BATON_CHAOS_ADVERTISE_WAN_PORT set, the agent reports that port as
its WAN fabric's (`kv_endpoint.wan_port` in its state document), where the chaos proxy listens,
instead of the port it bound. The agent has `--advertise-url` for its HTTP API but no setting
for an advertised KV fabric address, and bench code may not change agents/, so the one method
is wrapped here, lazily: `python -m agents serve` sets its thread plan before torch loads, so
nothing may import agents.node.agent (torch) this early."""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

_PORT = os.environ.get("BATON_CHAOS_ADVERTISE_WAN_PORT", "")
_TARGET = "agents.node.agent"


def _patch(module) -> None:
    original = module.Agent.kv_endpoint

    def kv_endpoint(self):
        endpoint = original(self)
        if endpoint is not None:
            endpoint = {**endpoint, "wan_port": int(_PORT)}
        return endpoint

    module.Agent.kv_endpoint = kv_endpoint


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)  # once; find the real spec without us
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module) -> None:
            exec_module(module)
            _patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


if _PORT:
    sys.meta_path.insert(0, _Finder())
